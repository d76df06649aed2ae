"""Tiled CSL with byte locations: the inference format for very sparse weights (>= ~88% zeros).

``W [M, K]`` is cut into the same ``128 x 64`` tiles as the bitmap format (:mod:`.bitmap`), each tile into
32 sub-tiles of ``16 x 16`` (sub-tile ``s = 4 * (r // 16) + c // 16`` inside the tile). Per nonzero: its value
(2 bytes) and its position inside the sub-tile as one byte (``16 * (r % 16) + c % 16``); per sub-tile an int16
offset of its first nonzero relative to the tile's first; per tile an int32 offset. Bytes per element:
``3 (1 - s) + 0.0083``, against ``0.125 + 2 (1 - s) + 0.0625`` for the bitmap format: smaller above ~88%
sparsity (0.31 vs 0.39 B/elem at 90%). Flash-LLM's tiled CSL stores 2-byte locations (4 B per nonzero); the
16 x 16 sub-tiles make one byte enough.

Why it exists: its kernel (``csrc/spmm_csl.cu``) does work per *nonzero* (scatter into a zeroed shared-memory
tile, then dense ``ldmatrix`` + ``mma.sync``), while the bitmap kernels decode every weight element. So where
few elements are nonzero it moves fewer bytes *and* issues fewer instructions. ``compress(w, fmt="auto")`` (:mod:`.op`)
picks the format with fewer bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sparsetrain.kernels.spmm import _launch
from sparsetrain.kernels.spmm.weight import TILE_K, TILE_M, CompressedWeight, padded_tiles

SUB = 16  # sub-tiles are SUB x SUB: a position inside one fits a byte
N_SUB = (TILE_M // SUB) * (TILE_K // SUB)  # 32 sub-tiles per tile


@dataclass
class CslWeight(CompressedWeight):
    """A weight ``[M, K]`` in tiled CSL with byte locations (see the module docstring).

    Attributes:
        values: the nonzeros, tile by tile (row-tile major), sub-tile by sub-tile, row-major inside a sub-tile.
        locs: uint8, one per value: ``16 * (r % 16) + c % 16`` inside its sub-tile.
        sub_offsets: int16 ``[TM, TK, 32]``, first value of each sub-tile relative to its tile's first.
        tile_offsets: int32 ``[TM, TK]``, index in ``values`` of each tile's first value.
        shape: ``(M, K)``.
    """

    values: Tensor
    locs: Tensor
    sub_offsets: Tensor
    tile_offsets: Tensor
    shape: tuple[int, int]
    block_m: int = TILE_M
    fmt: str = "csl"

    TENSORS: ClassVar[tuple[str, ...]] = ("values", "locs", "sub_offsets", "tile_offsets")

    def _decode_into(self, out: Tensor) -> None:
        from ._triton import decode_csl_kernel
        m, k = self.shape
        tm, tk = self.tile_offsets.shape
        decode_csl_kernel[(tm, tk)](self.values, self.locs, self.sub_offsets, self.tile_offsets, out, m, k,
                                    out.stride(0), tk, self.nnz, BM=TILE_M, CHUNK=512, num_warps=4)

    def _to_dense_torch(self) -> Tensor:
        m, k = self.shape
        tm, tk = self.tile_offsets.shape
        counts = _sub_counts(self).reshape(-1)  # per sub-tile, in storage order
        sub_id = torch.repeat_interleave(torch.arange(counts.numel(), device=self.device), counts)
        loc = self.locs.long()
        tile, s = sub_id // N_SUB, sub_id % N_SUB
        ti, tj = tile // tk, tile % tk
        rows = ti * TILE_M + (s // (TILE_K // SUB)) * SUB + loc // SUB
        cols = tj * TILE_K + (s % (TILE_K // SUB)) * SUB + loc % SUB
        dense = torch.zeros(tm * TILE_M, tk * TILE_K, dtype=self.dtype, device=self.device)
        dense[rows, cols] = self.values
        return dense[:m, :k].contiguous()


def _sub_counts(w: CslWeight) -> Tensor:
    """Nonzeros per sub-tile ``[TM, TK, 32]`` (int64) from the offsets."""
    tm, tk = w.tile_offsets.shape
    flat_tiles = w.tile_offsets.reshape(-1).long()
    tile_end = torch.cat([flat_tiles[1:], torch.tensor([w.nnz], device=w.device)])
    tile_len = tile_end - flat_tiles
    sub = w.sub_offsets.reshape(-1, N_SUB).long()
    sub_end = torch.cat([sub[:, 1:], tile_len[:, None]], dim=1)
    return (sub_end - sub).reshape(tm, tk, N_SUB)


def compress_csl(weight: Tensor) -> CslWeight:
    """Builds the tiled-CSL format of a 2-D float weight on its own device (exact zeros dropped)."""
    padded, tm, tk = padded_tiles(weight)
    m, k = weight.shape
    # [TM, 8 sub-rows, 16, TK, 4 sub-cols, 16] -> [TM, TK, 8, 4, 16, 16]: storage order.
    t = padded.view(tm, TILE_M // SUB, SUB, tk, TILE_K // SUB, SUB).permute(0, 3, 1, 4, 2, 5)
    mask = t != 0
    values = t[mask]
    if values.numel() >= 2**31:
        raise ValueError(f"weight has {values.numel()} nonzeros; the int32 offsets allow < 2**31")
    grid = torch.arange(SUB * SUB, device=weight.device, dtype=torch.int16).view(SUB, SUB)
    locs = grid.expand(mask.shape)[mask].to(torch.uint8)
    sub_counts = mask.sum((-1, -2)).reshape(tm, tk, N_SUB)
    sub_offsets = (torch.cumsum(sub_counts, -1) - sub_counts).to(torch.int16)  # < 8192: fits int16
    tile_len = sub_counts.sum(-1).reshape(-1)
    tile_offsets = (torch.cumsum(tile_len, 0) - tile_len).to(torch.int32).reshape(tm, tk)
    return CslWeight(values.contiguous(), locs.contiguous(), sub_offsets.contiguous(), tile_offsets, (m, k))


def csl_bytes(m: int, k: int, nnz: int, elem: int = 2) -> int:
    """Bytes :func:`compress_csl` stores for an ``M x K`` weight with ``nnz`` nonzeros."""
    tiles = math.ceil(m / TILE_M) * math.ceil(k / TILE_K)
    return nnz * (elem + 1) + tiles * (2 * N_SUB + 4)



def cuda_usable(x2: Tensor, weight: CslWeight) -> bool:
    """Whether :func:`spmm_csl_cuda` takes this call (CUDA, fp16/bf16, 1..64 tokens, aligned tensors, built)."""
    return _launch.cuda_usable(x2, weight, "spmm_csl")


def spmm_csl_cuda(x2: Tensor, weight: CslWeight, bias: Tensor | None = None, split_k: int | None = None) -> Tensor:
    """``x2 [N, K] @ Wᵀ (+ bias)`` through ``csrc/spmm_csl.cu``; ``1 <= N <= 64``; returns ``[N, M]``."""
    return _launch.run_cuda("spmm_csl",
                            (weight.values.data_ptr(), weight.locs.data_ptr(), weight.sub_offsets.data_ptr()),
                            weight, x2, bias, split_k)


def spmm_csl_reference(x: Tensor, weight: CslWeight, bias: Tensor | None = None) -> Tensor:
    """Plain torch through the dense weight, fp32 accumulation, result in x's dtype."""
    y = x.float() @ weight.to_dense().float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
