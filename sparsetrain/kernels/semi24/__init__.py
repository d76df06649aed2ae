"""Transposable 2:4 sparsity for training: mask + compress every step, products through cuSPARSELt.

One op, split by concern:

- :mod:`.patterns`: the 90 transposable patterns of a 4x4 tile (``PATTERNS``), the shared weight checks;
- :mod:`._triton` + :mod:`.mask`: the Triton kernel and :func:`transposable24`, one pass over ``W`` writing the
  mask and ``W⊙M`` / ``(W⊙M)ᵀ``, or both already in cuSPARSELt's compressed layout;
- :mod:`.cusparselt`: compressing, the sparse product, the per-shape algorithm choice (:func:`select_alg`)
  and the once-per-shape check of the fused packing (:func:`pack_supported`);
- :mod:`.op`: :func:`semi24_linear` and its autograd function (modes ``"24"``, ``"24fwd"``, ``"dense"``), and
  :func:`semi24_dense_linear`, the ``"dense"`` mode that ``torch.compile`` traces;
- :mod:`.reference`: the same in plain torch (tests compare).

Measurements behind the choices: docs/history/semi24.md.

>>> import torch
>>> m, wm = transposable24_reference(torch.randn(64, 128))
>>> is_transposable24(m), int(m.sum())
(True, 4096)
"""
from sparsetrain.kernels.semi24.cusparselt import (
    CSLT_ALIGN,
    SPARSE_DTYPES,
    TOKEN_ALIGN,
    AlgChoice,
    alg_table,
    compress,
    cslt_available,
    pack_supported,
    pad_tokens,
    select_alg,
    sparse_mm_t,
)
from sparsetrain.kernels.semi24.mask import (
    Sparsified,
    kernel_available,
    transposable24,
    transposable24_mask,
    transposable24_mask_of,
)
from sparsetrain.kernels.semi24.op import (
    MODES,
    Semi24LinearFn,
    compute_dtype,
    semi24_dense_linear,
    semi24_linear,
)
from sparsetrain.kernels.semi24.patterns import NPAT, NPAT_PAD, PATTERNS
from sparsetrain.kernels.semi24.reference import (
    cslt_pack_reference,
    cslt_unpack_reference,
    is_transposable24,
    semi24_linear_reference,
    transposable24_reference,
)

__all__ = [
    "CSLT_ALIGN", "MODES", "NPAT", "NPAT_PAD", "PATTERNS", "SPARSE_DTYPES", "TOKEN_ALIGN",
    "AlgChoice", "Semi24LinearFn", "Sparsified",
    "alg_table", "compress", "compute_dtype", "cslt_available", "cslt_pack_reference", "cslt_unpack_reference",
    "is_transposable24", "kernel_available", "pack_supported", "pad_tokens", "select_alg", "semi24_dense_linear",
    "semi24_linear", "semi24_linear_reference", "sparse_mm_t", "transposable24", "transposable24_mask", "transposable24_mask_of",
    "transposable24_reference",
]
