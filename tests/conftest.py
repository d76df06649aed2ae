"""Shared test setup.

On a machine without CUDA, Triton kernels run under the interpreter (TRITON_INTERPRET=1, which Triton
reads when a kernel is decorated, so it is set here before any kernel module is imported). The
interpreter is right in float16/float32 and wrong in bfloat16: CPU tests use fp16/fp32 only.
GPU-only tests carry `@pytest.mark.gpu`; the README's CPU command deselects them with `-m "not gpu"`,
and the device machine runs them with `pytest -m gpu`.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run on the device machine: pytest -m gpu)")
