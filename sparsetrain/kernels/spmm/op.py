"""Sparse inference for skinny products: ``Y = X·Wᵀ`` with an unstructured-sparse ``W`` loaded compressed.

Generation multiplies a few tokens ``X [N, K]`` (N <= 64) by a large weight ``W [M, K]``: the time is the time
to read ``W``. :func:`compress` stores ``W`` in one of three formats (:mod:`.bitmap`, :mod:`.csl`,
:mod:`.pair`), and :func:`spmm_infer` runs the format's kernel for up to 64 tokens, or expands the weight to a
transient dense matrix and calls cuBLAS for more (prefill).

Example::

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    w[w.abs() < 1.3] = 0                       # ~80% zeros
    cw = compress(w)                           # SparseInferenceWeight, ~0.59 bytes per element
    x = torch.randn(16, 4096, device="cuda", dtype=torch.float16)
    torch.testing.assert_close(spmm_infer(x, cw), spmm_reference(x, cw))
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsetrain.kernels.spmm import csl, pair
from sparsetrain.kernels.spmm._launch import MAX_TOKENS
from sparsetrain.kernels.spmm.bitmap import (
    SparseInferenceWeight,
    _to_dense_torch,
    bitmap_bytes,
    compress_bitmap,
    cuda_kernel_usable,
    spmm_cuda,
    spmm_triton,
)
from sparsetrain.kernels.spmm.csl import CslWeight, compress_csl, csl_bytes, spmm_csl_cuda
from sparsetrain.kernels.spmm.pair import PairWeight, compress_pair, spmm_pair_cuda
from sparsetrain.kernels.spmm.weight import CompressedWeight

FORMATS = ("bitmap", "csl", "pair", "auto")


# Below this sparsity SparseInferenceLinear(mode="auto") keeps a dense weight and calls F.linear, because the
# compressed kernel is slower than cuBLAS there. Measured on an H200 (``sparsetrain bench inference``, tables
# in docs/history/inference.md): the CUDA kernel reached 0.78-1.05x of cuBLAS at N = 16 (50-90% sparsity; >= 1.0x
# only on some shapes at 80-90%) and 0.48-0.59x at N = 64; the Triton kernel 0.30-0.74x. No sparsity is faster
# on every shape, so "auto" never compresses; mode="compressed" trades 0-20% of speed at 70-90% (N <= 16) for
# 2.5-5x less weight memory.
BREAK_EVEN_SPARSITY = 1.0


def compress(weight: Tensor, block_m: int = 128, fmt: str = "bitmap") -> CompressedWeight:
    """Builds the bitmap format (``fmt="bitmap"``), the tiled CSL format (``"csl"``, :mod:`.csl`), the pair
    bitmap (``"pair"``, :mod:`.pair`: more bytes, faster decode), or whichever of bitmap and CSL stores fewer
    bytes (``"auto"``: CSL above ~82% sparsity) of a 2-D weight on its own device; exact zeros are dropped.

    Example: ``cw = compress(linear.weight.detach()); cw.to_dense().equal(linear.weight)`` is True.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if fmt == "auto" and isinstance(weight, Tensor) and weight.dim() == 2:
        nnz = int((weight != 0).sum())
        m, k = weight.shape
        smaller = csl_bytes(m, k, nnz, weight.element_size()) < bitmap_bytes(m, k, nnz, weight.element_size(),
                                                                               block_m)
        fmt = "csl" if smaller else "bitmap"
    if fmt == "csl":
        return compress_csl(weight)
    if fmt == "pair":
        return compress_pair(weight)
    return compress_bitmap(weight, block_m)


def spmm_reference(x: Tensor, weight: SparseInferenceWeight, bias: Tensor | None = None) -> Tensor:
    """Plain-torch ``x @ W.T + bias`` through the dense weight, accumulated in fp32, returned in x's dtype.

    Example: ``spmm_reference(torch.randn(4, 64), compress(torch.randn(32, 64)))`` has shape ``[4, 32]``.
    """
    if isinstance(weight, SparseInferenceWeight):
        dense = _to_dense_torch(weight)
    elif isinstance(weight, PairWeight):
        dense = weight.to_dense(use_kernel=False)
    else:
        dense = weight.to_dense()
    dense = dense.float()
    y = x.float() @ dense.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _use_triton(t: Tensor) -> bool:
    return t.is_cuda or os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(x: Tensor, weight: CompressedWeight, bias: Tensor | None) -> None:
    if not isinstance(weight, (SparseInferenceWeight, CslWeight, PairWeight)):
        raise TypeError(f"weight must be a SparseInferenceWeight, CslWeight or PairWeight (see compress), "
                        f"got {type(weight).__name__}")
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x must end in K={weight.shape[1]} features, got shape {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"x dtype {x.dtype} differs from the weight dtype {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but the weight is on {weight.device}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.device != x.device):
        raise ValueError(f"bias must have shape ({weight.shape[0]},) on {x.device}, got {tuple(bias.shape)}")



class _SpmmInferFn(torch.autograd.Function):
    """Forward through the compressed weight; backward gives dX (and d bias) through a transient dense W."""

    @staticmethod
    def forward(ctx, x2: Tensor, bias: Tensor | None, weight: CompressedWeight) -> Tensor:
        if ctx is not None:
            ctx.weight = weight
            ctx.has_bias = bias is not None
        if isinstance(weight, CslWeight):
            if x2.is_cuda and csl.cuda_usable(x2, weight):
                return spmm_csl_cuda(x2, weight, bias)
            return F.linear(x2, weight.to_dense(), bias)  # no GPU kernel here (or prefill): expand, cuBLAS
        if isinstance(weight, PairWeight):
            if x2.is_cuda and pair.cuda_usable(x2, weight):
                return spmm_pair_cuda(x2, weight, bias)
            return F.linear(x2, weight.to_dense(), bias)
        if x2.is_cuda and cuda_kernel_usable(x2, weight):
            return spmm_cuda(x2, weight, bias)
        if _use_triton(x2) and x2.shape[0] <= MAX_TOKENS:
            return spmm_triton(x2, weight, bias)
        # Many tokens (prefill) or no Triton: the GEMM is compute-bound, so expand W once and call cuBLAS.
        return F.linear(x2, weight.to_dense(), bias)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        grad_x = grad_y @ ctx.weight.to_dense() if ctx.needs_input_grad[0] else None
        grad_b = grad_y.sum(0) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return grad_x, grad_b, None


def spmm_infer(x: Tensor, weight: CompressedWeight, bias: Tensor | None = None) -> Tensor:
    """``x @ W.T + bias`` for any leading dims of ``x [..., K]``, with W compressed.

    N = prod(leading dims) <= 64 runs the sparse kernel; larger N (and CPU without the Triton interpreter)
    expands W to a transient dense matrix and calls ``F.linear``.

    Example: ``spmm_infer(torch.randn(2, 3, 64, dtype=torch.float16, device="cuda"), cw)`` -> ``[2, 3, M]``.
    """
    _check(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, weight.shape[1])
    if x2.shape[0] == 0:
        return x.new_empty(*lead, weight.shape[0])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    needs_grad = torch.is_grad_enabled() and (x2.requires_grad or (bias is not None and bias.requires_grad))
    if needs_grad:
        y = _SpmmInferFn.apply(x2, bias, weight)
    else:  # inference: skip the autograd.Function bookkeeping (a few microseconds per call add up in decode)
        y = _SpmmInferFn.forward(None, x2, bias, weight)
    return y.reshape(*lead, weight.shape[0])
