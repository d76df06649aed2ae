"""The CUDA build's ctypes declarations against the sources of every kernel package."""
import ctypes
import re
from pathlib import Path

import sparsetrain.kernels
from sparsetrain.kernels._runtime import cuda_build


def test_ctypes_signatures_match_the_cuda_sources():
    """Every launcher in ``cuda_build.SIGNATURES`` is declared in some ``kernels/**/csrc/*.cu`` file with exactly
    those argument types (a wrong count crashed the process on the GPU once: ctypes cannot check it)."""
    root = Path(sparsetrain.kernels.__file__).parent
    src = "".join(p.read_text() for p in sorted(root.glob("**/csrc/*.cu")))
    kinds = {"long long": ctypes.c_longlong, "int": ctypes.c_int}
    for name, argtypes in cuda_build.SIGNATURES.items():
        m = re.search(rf"\bint {name}\(([^)]*)\)", src)
        assert m, f"{name} is not declared in any csrc/"
        params = [" ".join(p.split()[:-1]) for p in m.group(1).split(",")]
        assert [kinds[p] for p in params] == argtypes, name
