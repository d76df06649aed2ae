"""Shared test setup.

On a machine without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1, which Triton
reads when a kernel is decorated, so it is set here before any kernel module is imported). The
interpreter is right in float16/float32 and wrong in bfloat16: CPU tests use fp16/fp32 only.
GPU-only tests carry `@pytest.mark.gpu`; the README's CPU command deselects them with `-m "not gpu"`
(and runs the rest in two processes, `-n 2`: pytest-xdist), and the device machine runs them with `pytest -m gpu`.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def _no_tuning_cache():
    """Tests never read or write the user's kernel-tuning cache (a GPU run times kernels for real): the tuner's
    choices stay in the process unless a test turns ``tuning_cache`` on itself."""
    from sparsetrain.kernels import set_kernel_options

    previous = set_kernel_options(tuning_cache=False)
    yield
    set_kernel_options(previous)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device machine: pytest -m gpu)")


@pytest.fixture(scope="session")
def built_wheel(tmp_path_factory):
    """The project's wheel, built from a clean copy of the source (a stale build/ folder of the checkout would
    otherwise ship modules that no longer exist)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    src = tmp_path_factory.mktemp("wheel_src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in ("sparsetrain", "configs", "recipes", "hydra_plugins"):
        shutil.copytree(root / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                    "-w", str(out)], check=True, capture_output=True, cwd=src)
    return next(out.glob("sparsetrain-*.whl"))
