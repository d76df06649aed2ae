"""Skinny sparse-dense products for inference: ``Y = X·Wᵀ`` with an unstructured-sparse ``W`` kept compressed.

One op, split by concern:

- :mod:`.op`: :func:`compress` (picks the format), :func:`spmm_infer` (dispatch: the format's kernel for up
  to 64 tokens, a transient dense weight + cuBLAS for more), :func:`spmm_reference`;
- :mod:`.weight`: :class:`CompressedWeight`, what the formats share (tiles, stored tensors, decode);
- :mod:`.bitmap`, :mod:`.csl`, :mod:`.pair`: the three formats, each with its CUDA kernel (``csrc/*.cu``, built
  on first use where ``nvcc`` exists); the bitmap format also has a Triton kernel (:mod:`._triton`, the CPU
  interpreter path, and the path where ``KernelOptions.spmm_backend == "triton"``);
- :mod:`._launch`: split-K sizing, workspace and the CUDA launch plumbing the kernels share.

Measurements behind the choices: docs/history/inference.md.

Example::

    cw = compress(pruned_weight, fmt="auto")   # the format with fewer bytes
    y = spmm_infer(x, cw, bias)                # == F.linear(x, pruned_weight, bias)
"""
from sparsetrain.kernels.spmm._launch import CUDA_WAVES, MAX_TOKENS, max_tile_len
from sparsetrain.kernels.spmm.bitmap import (
    BLOCK_K,
    BLOCK_M_CHOICES,
    CONFIG,
    SparseInferenceWeight,
    bitmap_bytes,
    compress_bitmap,
    cuda_kernel_usable,
    spmm_cuda,
    spmm_triton,
)
from sparsetrain.kernels.spmm.csl import CslWeight, compress_csl, csl_bytes, spmm_csl_cuda, spmm_csl_reference
from sparsetrain.kernels.spmm.op import BREAK_EVEN_SPARSITY, FORMATS, compress, spmm_infer, spmm_reference
from sparsetrain.kernels.spmm.pair import PairWeight, compress_pair, nonzero_pairs, pair_bytes, spmm_pair_cuda
from sparsetrain.kernels.spmm.weight import TILE_K, TILE_M, CompressedWeight

__all__ = [
    "BLOCK_K", "BLOCK_M_CHOICES", "BREAK_EVEN_SPARSITY", "CONFIG", "CUDA_WAVES", "FORMATS", "MAX_TOKENS",
    "TILE_K", "TILE_M",
    "CompressedWeight", "CslWeight", "PairWeight", "SparseInferenceWeight",
    "bitmap_bytes", "compress", "compress_bitmap", "compress_csl", "compress_pair", "csl_bytes",
    "cuda_kernel_usable", "max_tile_len", "nonzero_pairs", "pair_bytes", "spmm_csl_cuda", "spmm_csl_reference",
    "spmm_cuda", "spmm_infer", "spmm_pair_cuda", "spmm_reference", "spmm_triton",
]
