"""Pair bitmap: the inference format that trades bytes for decode speed.

``W [M, K]`` is cut into the bitmap format's ``128 x 64`` tiles (:mod:`.bitmap`). Inside a tile row the 64
columns form 32 *pairs* ``(2p, 2p + 1)``; a 32-bit word per tile row has bit ``p`` set when either column of
pair ``p`` is nonzero, and every such pair is stored whole (two values, the even column first, one of them
possibly zero). Per tile row an int16 offset of its first value, per tile an int32 offset (both in values,
always even). Bytes per element, fp16/bf16: ``0.0625 (bitmap) + 0.03125 (row offsets) + 2 * P``, where ``P``
is the fraction of nonzero pairs (``1 - s²`` for uniformly random zeros at sparsity ``s``): 0.47 at 90%, 0.81
at 80%, 1.11 at 70%, against 0.39 / 0.59 / 0.79 for the element bitmap and 0.31 at 90% for tiled CSL.

Why it exists: a tensor-core A-fragment register of ``mma.sync`` holds exactly one pair of adjacent K
columns. The element bitmap kernel decodes each element (bit test, rank, address, predicated 2-byte load:
~12 instructions per element in its main loop) and is bound by instruction issue, not by bytes, on an H200.
Here a register costs one bit test, one POPC under an immediate mask (its rank), one address and one
predicated 4-byte load (``csrc/spmm_pair.cu``). ``compress(w, fmt="pair")`` (:mod:`.op`) builds it; ``"auto"``
still picks by bytes (the memory-first choice), and the benchmark (``sparsetrain bench inference``) reports
all three formats side by side.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sparsetrain.kernels.spmm import _launch
from sparsetrain.kernels.spmm.weight import TILE_K, TILE_M, CompressedWeight, padded_tiles

PAIRS = TILE_K // 2  # 32: one bitmap word per tile row


@dataclass
class PairWeight(CompressedWeight):
    """A weight ``[M, K]`` in the pair-bitmap format (see the module docstring).

    Attributes:
        bitmap: int32 ``[TM, TK, 128]``; bit ``p`` of row ``r`` of tile ``(i, t)`` is set when
            ``W[128 i + r, 64 t + 2p]`` or ``W[128 i + r, 64 t + 2p + 1]`` is nonzero.
        values: tile by tile, row by row, the rows' stored pairs left to right (two values each).
        row_offsets: int16 ``[TM, TK, 128]``, each row's first value relative to its tile's first.
        tile_offsets: int32 ``[TM, TK]``, index in ``values`` of each tile's first value.
        shape: ``(M, K)``.
    """

    bitmap: Tensor
    values: Tensor
    row_offsets: Tensor
    tile_offsets: Tensor
    shape: tuple[int, int]
    block_m: int = TILE_M
    fmt: str = "pair"

    @property
    def nnz(self) -> int:
        """Nonzero weights (the stored values minus the zero halves of stored pairs; one device sync)."""
        return int((self.values != 0).sum())

    TENSORS: ClassVar[tuple[str, ...]] = ("bitmap", "values", "row_offsets", "tile_offsets")

    def _decode_into(self, out: Tensor) -> None:
        from ._triton import decode_pair_kernel
        m, k = self.shape
        tm, tk = self.tile_offsets.shape
        decode_pair_kernel[(tm, tk)](self.bitmap, self.row_offsets, self.values, self.tile_offsets, out,
                                     m, k, out.stride(0), tk, BM=TILE_M, num_warps=4)

    def _to_dense_torch(self) -> Tensor:
        m, k = self.shape
        tm, tk = self.tile_offsets.shape
        shifts = torch.arange(PAIRS, device=self.device, dtype=torch.int32)
        present = ((self.bitmap.unsqueeze(-1) >> shifts) & 1).bool()  # [TM, TK, 128, 32]
        pairs = torch.zeros(tm, tk, TILE_M, PAIRS, 2, dtype=self.dtype, device=self.device)
        pairs[present] = self.values.view(-1, 2)  # boolean indexing walks the pairs in storage order
        dense = pairs.reshape(tm, tk, TILE_M, TILE_K).permute(0, 2, 1, 3).reshape(tm * TILE_M, tk * TILE_K)
        return dense[:m, :k].contiguous()


def compress_pair(weight: Tensor) -> PairWeight:
    """Builds the pair-bitmap format of a 2-D float weight on its own device (all-zero pairs dropped)."""
    padded, tm, tk = padded_tiles(weight)
    m, k = weight.shape
    pairs = padded.view(tm, TILE_M, tk, PAIRS, 2).permute(0, 2, 1, 3, 4)  # [TM, TK, 128, 32, 2]
    present = (pairs != 0).any(-1)
    values = pairs[present].reshape(-1)
    if values.numel() >= 2**31:
        raise ValueError(f"weight needs {values.numel()} stored values; the int32 offsets allow < 2**31")
    place = torch.ones(PAIRS, dtype=torch.int64, device=weight.device) << torch.arange(PAIRS, device=weight.device)
    words = (present.long() * place).sum(-1)  # < 2**32
    bitmap = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    row_len = 2 * present.sum(-1)  # [TM, TK, 128]
    row_offsets = (torch.cumsum(row_len, -1) - row_len).to(torch.int16)  # < 128 * 64: fits int16
    tile_len = row_len.sum(-1).reshape(-1)
    tile_offsets = (torch.cumsum(tile_len, 0) - tile_len).to(torch.int32).reshape(tm, tk)
    return PairWeight(bitmap.contiguous(), values.contiguous(), row_offsets.contiguous(), tile_offsets, (m, k))


def pair_bytes(m: int, k: int, n_pairs: int, elem: int = 2) -> int:
    """Bytes :func:`compress_pair` stores for an ``M x K`` weight with ``n_pairs`` nonzero pairs."""
    tm, tk = math.ceil(m / TILE_M), math.ceil(k / TILE_K)
    rows = tm * tk * TILE_M
    return rows * 4 + rows * 2 + tm * tk * 4 + 2 * n_pairs * elem


def nonzero_pairs(weight: Tensor) -> int:
    """Pairs of adjacent columns ``(2p, 2p + 1)`` of a 2-D weight with a nonzero (what the format stores)."""
    m, k = weight.shape
    padded = weight if k % 2 == 0 else torch.nn.functional.pad(weight, (0, 1))
    return int((padded.view(m, -1, 2) != 0).any(-1).sum())


def cuda_usable(x2: Tensor, weight: PairWeight) -> bool:
    """Whether :func:`spmm_pair_cuda` takes this call (CUDA, fp16/bf16, 1..64 tokens, aligned tensors, built)."""
    return _launch.cuda_usable(x2, weight, "spmm_pair")


def spmm_pair_cuda(x2: Tensor, weight: PairWeight, bias: Tensor | None = None,
                   split_k: int | None = None) -> Tensor:
    """``x2 [N, K] @ Wᵀ (+ bias)`` through ``csrc/spmm_pair.cu``; ``1 <= N <= 64``; returns ``[N, M]``."""
    return _launch.run_cuda("spmm_pair",
                            (weight.bitmap.data_ptr(), weight.row_offsets.data_ptr(), weight.values.data_ptr()),
                            weight, x2, bias, split_k)
