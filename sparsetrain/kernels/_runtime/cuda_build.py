"""Builds and loads sparsetrain's CUDA C++ kernels (each op's ``csrc/*.cu``) on first use.

The sources take plain pointers and a stream as integers and are called through :mod:`ctypes`, so no torch
headers or pybind are compiled (a build is one ``nvcc`` call of a few seconds). The shared library is cached
under ``$SPARSETRAIN_CACHE`` (default ``~/.cache/sparsetrain``)/``kernels``, keyed by the source, the GPU
architecture and the nvcc version, and written atomically (temp file + rename), so concurrent processes are
safe. Without ``nvcc`` (or when a build fails) :func:`load` returns ``None`` with a warning, once, and callers
keep their Triton path. ``KernelOptions.cuda_kernels=False`` (``trainer.kernels.cuda_kernels``) turns them off.
Sources include ``common.cuh`` from this package's ``csrc/``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from sparsetrain.kernels._runtime.options import kernel_options

INCLUDE = Path(__file__).resolve().parent / "csrc"  # common.cuh, shared by every op's sources
_LIBS: dict[tuple, ctypes.CDLL | None] = {}


def nvcc_path() -> str | None:
    """``nvcc`` from ``$CUDA_HOME``/``$CUDA_PATH`` or the PATH, or None."""
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and (Path(root) / "bin" / "nvcc").is_file():
            return str(Path(root) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cache_dir() -> Path:
    root = os.environ.get("SPARSETRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "sparsetrain")
    return Path(root) / "kernels"


def enabled() -> bool:
    return kernel_options().cuda_kernels


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def build(src: Path, arch: str, nvcc: str, defines: tuple[str, ...] = ()) -> Path:
    """Compiles the CUDA source ``src`` for ``sm_<arch>`` into the cache (if not there yet); returns the .so path.
    ``defines`` (``("NAME=VALUE",)``) become ``-D`` flags and part of the cache key."""
    name = src.stem
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    headers = b"".join(h.read_bytes() for h in sorted([*INCLUDE.glob("*.cuh"), *src.parent.glob("*.cuh")]))
    key = hashlib.sha256(src.read_bytes() + headers + arch.encode() + version.encode()
                         + repr(sorted(defines)).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-sm{arch}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    cmd = [nvcc, "-O3", "-std=c++20", "-shared", "-Xcompiler", "-fPIC", "-lineinfo",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", f"-I{INCLUDE}", *(f"-D{d}" for d in defines), "-o", tmp,
           str(src)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


# Argument types of the exported launchers: set once per library, so calls pass plain Python ints.
_LL, _I = ctypes.c_longlong, ctypes.c_int
SIGNATURES = {
    "sparsetrain_spmm_bitmap": [_LL] * 10 + [_I] * 11 + [_LL],
    "sparsetrain_spmm_csl": [_LL] * 10 + [_I] * 11 + [_LL],
    "sparsetrain_spmm_pair": [_LL] * 10 + [_I] * 11 + [_LL],
    "sparsetrain_bs_dds": [_LL] * 12 + [_I] * 14 + [_LL],
    "sparsetrain_bs_dds_smem": [_I] * 4,
    "sparsetrain_bs_dds_warps": [_I] * 3,
    "sparsetrain_bs_dw": [_LL] * 8 + [_I] * 11 + [_LL],
    "sparsetrain_bs_dds_ks": [_LL] * 13 + [_I] * 14 + [_LL],
}
_FAST: dict[tuple, ctypes.CDLL | None] = {}  # (name, device index, defines) -> library: the per-call lookup


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for fn, argtypes in SIGNATURES.items():
        if hasattr(lib, fn):
            getattr(lib, fn).argtypes = argtypes
            getattr(lib, fn).restype = ctypes.c_int
    return lib


def load(src: Path, device: torch.device, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled CUDA source ``src`` for ``device`` (built on first call), or None where unavailable.
    Called on every kernel launch: after the first call it is one dictionary lookup."""
    name = src.stem
    if device.type != "cuda":
        return None
    if not enabled():
        return None
    fast_key = (src, device.index, defines)
    if fast_key in _FAST:
        return _FAST[fast_key]
    idx = device.index if device.index is not None else torch.cuda.current_device()
    arch = _arch(torch.device("cuda", idx))
    key = (src, int(arch), tuple(sorted(defines)))
    if key not in _LIBS:
        lib = None
        nvcc = nvcc_path()
        if nvcc is None:
            warnings.warn(f"sparsetrain: nvcc not found; the CUDA kernel '{name}' is off (Triton path used)",
                          stacklevel=3)
        else:
            try:
                lib = _declare(ctypes.CDLL(str(build(src, arch, nvcc, defines))))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                warnings.warn(f"sparsetrain: could not build the CUDA kernel '{name}' ({e!s:.500}); "
                              "using the Triton path", stacklevel=3)
        _LIBS[key] = lib
    if device.index is not None:  # "cuda" without an index follows the current device: not cached
        _FAST[fast_key] = _LIBS[key]
    return _LIBS[key]
