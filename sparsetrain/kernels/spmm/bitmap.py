"""The bitmap format of a sparse inference weight, and its skinny products (Triton, CUDA).

``W [M, K]`` is stored as per-tile bitmaps plus the packed nonzeros (:func:`compress_bitmap`); the products
expand each tile on chip and multiply it on the tensor cores: the CUDA kernel (``csrc/spmm_bitmap.cu``,
:func:`spmm_cuda`, built on first use where ``nvcc`` exists) on CUDA fp16/bf16, else the Triton kernel
(:mod:`._triton`, :func:`spmm_triton`; also the CPU interpreter path).

Bytes per weight element (fp16/bf16, 128 x 64 tiles): 0.125 (bitmap) + 2(1-s) (values) + 0.0625 (per tile
row of 64: a 2-byte zero slot and an int16 offset) + 0.0005 (one int32 per tile). Why a bitmap and not a tiled
CSL (value + 16-bit index per nonzero, 4(1-s) B/elem): the bitmap moves fewer bytes below 90.6% sparsity
(93.75% without the per-row metadata), e.g. 0.79 vs 1.2 B/elem at 70%, 0.59 vs 0.8 at 80%, 0.39 vs 0.4 at 90%.
Why the per-row metadata: it takes two instructions per weight element and every cross-thread prefix scan
out of the decoder, whose cost is per weight element, not per byte (docs/history/inference.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sparsetrain.kernels._runtime.options import kernel_options
from sparsetrain.kernels.spmm._launch import MAX_TOKENS, cuda_usable, run_cuda, split_k_for, workspace
from sparsetrain.kernels.spmm.weight import TILE_K, CompressedWeight

BLOCK_M_CHOICES = (16, 32, 64, 128)
BLOCK_K = TILE_K  # columns per tile: one 64-bit bitmap word per tile row (fixed by the kernel)

# Launch configuration of the Triton kernel (block_m = 128 is compress's default), measured on an H200: with
# 128-row tiles and 4 warps, 8 programs per multiprocessor (split-K) beat 2 by 9% on 28672x7168 and by 25% on
# 4096x14336 (N = 16, 80%); 8 warps and num_stages 2 were no better (docs/history/inference.md).
CONFIG = {"num_warps": 4, "num_stages": 1, "waves": 8}

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class SparseInferenceWeight(CompressedWeight):
    """A weight ``[M, K]`` as tile bitmaps + packed nonzeros (see the module docstring).

    Attributes:
        bitmap: uint8 ``[TM, TK, block_m, 8]``; bit ``j`` of byte ``c`` of row ``r`` of tile ``(i, t)`` is set
            when ``W[i*block_m + r, 64t + 8c + j] != 0``. Padding rows/columns (past M, K) are 0.
        values: tile by tile (tile ``(i, t)`` before ``(i, t+1)``), row by row: one 0 (the row's zero slot)
            then the row's nonzeros, left to right.
        row_offsets: int16 ``[TM, TK, block_m]``, index of each row's zero slot relative to its tile's start.
        tile_offsets: int32 ``[TM, TK]``, index in ``values`` of each tile's first entry.
        shape: ``(M, K)``.
        block_m: rows per tile (tiles are ``block_m x 64``).
    """

    bitmap: Tensor
    values: Tensor
    row_offsets: Tensor
    tile_offsets: Tensor
    shape: tuple[int, int]
    block_m: int = 128
    fmt = "bitmap"  # class attribute: SparseInferenceLinear and checkpoints tell the formats apart by it

    @property
    def nnz(self) -> int:
        """Stored nonzeros (the values minus one zero slot per tile row)."""
        return self.values.numel() - self.row_offsets.numel()

    TENSORS: ClassVar[tuple[str, ...]] = ("bitmap", "values", "row_offsets", "tile_offsets")

    @classmethod
    def _derived(cls, tensors: dict[str, Tensor]) -> dict:
        return {"block_m": tensors["bitmap"].shape[2]}  # the tile height, read off the bitmap

    def nbytes(self) -> int:
        """Bytes of all stored tensors.

        For fp16/bf16 and M, K multiples of the tile: ``M*K/8 + 2*nnz + 2*M*TK (zero slots) + 2*M*TK
        (row offsets) + 4*TM*TK``, with TK = K / 64 and TM = M / block_m.
        """
        return super().nbytes()

    def _decode_into(self, out: Tensor) -> None:
        from ._triton import decode_bitmap_kernel
        m, k = self.shape
        tm, tk = self.tile_offsets.shape
        decode_bitmap_kernel[(tm, tk)](
            self.bitmap.view(torch.int32), self.row_offsets, self.values, self.tile_offsets, out,
            m, k, out.stride(0), tk, self.values.element_size(), BM=self.block_m,
            USE_POPC=self.values.is_cuda, num_warps=CONFIG["num_warps"])

    def _to_dense_torch(self) -> Tensor:
        return _to_dense_torch(self)


def _masks(w: SparseInferenceWeight) -> Tensor:
    """Bool ``[TM, TK, BM, 1 + BK]``: column 0 is the zero slot (always stored), then the bitmap's bits."""
    tm, tk = w.tile_offsets.shape
    shifts = torch.arange(8, device=w.bitmap.device, dtype=torch.uint8)
    bits = ((w.bitmap.unsqueeze(-1) >> shifts) & 1).bool().reshape(tm, tk, w.block_m, BLOCK_K)
    return torch.cat([torch.ones_like(bits[..., :1]), bits], dim=-1)


def _to_dense_torch(w: SparseInferenceWeight) -> Tensor:
    mask = _masks(w)
    tiles = torch.zeros(mask.shape, dtype=w.dtype, device=w.device)
    tiles[mask] = w.values  # boolean indexing walks the tiles in the order compress packed them
    tm, tk, bm, _ = mask.shape
    m, k = w.shape
    dense = tiles[..., 1:].permute(0, 2, 1, 3).reshape(tm * bm, tk * BLOCK_K)
    return dense[:m, :k].contiguous()



def compress_bitmap(weight: Tensor, block_m: int = 128) -> SparseInferenceWeight:
    """Builds the bitmap format of a 2-D float weight on its own device (exact zeros dropped); tiles are
    ``block_m x 64``."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [M, K], got shape {tuple(weight.shape)}")
    if weight.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"weight dtype must be float16, bfloat16 or float32, got {weight.dtype}")
    if block_m not in BLOCK_M_CHOICES:
        raise ValueError(f"block_m must be one of {BLOCK_M_CHOICES}, got {block_m}")
    weight = weight.detach()
    m, k = weight.shape
    tm, tk = math.ceil(m / block_m), math.ceil(k / BLOCK_K)
    padded = weight.new_zeros(tm * block_m, tk * BLOCK_K)
    padded[:m, :k] = weight
    tiles = padded.view(tm, block_m, tk, BLOCK_K).permute(0, 2, 1, 3)  # [TM, TK, BM, BK]
    mask = tiles != 0
    # Column 0 of every tile row is its zero slot: stored always, so "absent" decodes as a plain load.
    slot_mask = torch.cat([torch.ones_like(mask[..., :1]), mask], dim=-1)
    values = torch.cat([torch.zeros_like(tiles[..., :1]), tiles], dim=-1)[slot_mask]
    if values.numel() >= 2**31:
        raise ValueError(f"weight needs {values.numel()} stored values; the int32 offsets allow < 2**31")
    place = 2 ** torch.arange(8, device=weight.device, dtype=torch.int32)
    bits = mask.reshape(tm, tk, block_m, BLOCK_K // 8, 8).to(torch.int32)
    bitmap = (bits * place).sum(-1).to(torch.uint8)
    row_len = slot_mask.sum(-1)  # [TM, TK, BM]
    row_offsets = (torch.cumsum(row_len, -1) - row_len).to(torch.int16)  # < 128 * 129: fits int16
    tile_len = row_len.sum(-1).reshape(-1)
    tile_offsets = (torch.cumsum(tile_len, 0) - tile_len).to(torch.int32).reshape(tm, tk)
    return SparseInferenceWeight(bitmap.contiguous(), values.contiguous(), row_offsets.contiguous(),
                                 tile_offsets, (m, k), block_m)


def bitmap_bytes(m: int, k: int, nnz: int, elem: int = 2, block_m: int = 128) -> int:
    """Bytes :func:`compress_bitmap` stores for an ``M x K`` weight with ``nnz`` nonzeros."""
    tm, tk = math.ceil(m / block_m), math.ceil(k / BLOCK_K)
    rows = tm * tk * block_m
    return rows * 8 + (nnz + rows) * elem + rows * 2 + tm * tk * 4


def spmm_triton(x2: Tensor, weight: SparseInferenceWeight, bias: Tensor | None = None,
                split_k: int | None = None) -> Tensor:
    """The Triton kernel on ``x2 [N, K]`` with ``1 <= N <= 64``; returns ``[N, M]`` in x's dtype.

    ``split_k`` (default: enough programs for ``CONFIG["waves"]`` per multiprocessor) exists for the tests.
    """
    from ._triton import spmm_bitmap_kernel

    cfg = CONFIG
    n, k = x2.shape
    m = weight.shape[0]
    if not 1 <= n <= MAX_TOKENS:
        raise ValueError(f"x must have 1..{MAX_TOKENS} rows for the sparse kernel, got {n}")
    tm, tk = weight.tile_offsets.shape
    split_k, tiles_per_split = split_k_for(tm, tk, split_k, cfg["waves"], x2.device)
    y = torch.empty(n, m, dtype=x2.dtype, device=x2.device)
    ws, locks = workspace(x2.device, MAX_TOKENS * m, tm) if split_k > 1 else (y, y)
    block_n = max(16, _next_pow2(n))
    spmm_bitmap_kernel[(tm, split_k)](
        x2, weight.bitmap.view(torch.int32), weight.row_offsets, weight.values,
        weight.tile_offsets, bias if bias is not None else y, y, ws, locks,
        n, m, k, x2.stride(0), x2.stride(1), y.stride(0), y.stride(1), tk, tiles_per_split, split_k,
        weight.values.element_size(),
        BM=weight.block_m, BN=block_n, ATOMIC=split_k > 1,
        HAS_BIAS=bias is not None, IEEE=x2.dtype == torch.float32, USE_POPC=x2.is_cuda,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y


def cuda_kernel_usable(x2: Tensor, weight: SparseInferenceWeight) -> bool:
    """Whether :func:`spmm_cuda` takes this call: CUDA, fp16/bf16, 128-row tiles, 1..64 tokens, the library
    built, and ``KernelOptions.spmm_backend`` is not ``"triton"`` (which forces the Triton kernel)."""
    if weight.block_m != 128 or kernel_options().spmm_backend == "triton":
        return False
    return cuda_usable(x2, weight, "spmm_bitmap")


def spmm_cuda(x2: Tensor, weight: SparseInferenceWeight, bias: Tensor | None = None,
              split_k: int | None = None) -> Tensor:
    """The CUDA kernel (``csrc/spmm_bitmap.cu``) on ``x2 [N, K]``, ``1 <= N <= 64``; returns ``[N, M]``.

    Shared-memory staging of each tile's packed values + decode straight into ``mma.sync`` fragments (the
    source's header says why this beats the Triton kernel). ``split_k`` (default: enough blocks for
    ``CUDA_WAVES`` per multiprocessor) exists for the tests.
    """
    if weight.block_m != 128:
        raise ValueError(f"the CUDA kernel takes 128-row tiles, got block_m={weight.block_m}")
    return run_cuda("spmm_bitmap", (weight.bitmap.data_ptr(), weight.row_offsets.data_ptr(), weight.values.data_ptr()),
                    weight, x2, bias, split_k)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
