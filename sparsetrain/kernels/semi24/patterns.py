"""The 90 transposable 2:4 patterns of a 4x4 tile, and the weight checks every 2:4 entry point shares.

A tile pattern keeps exactly 2 cells per row and 2 per column, so both ``W ⊙ M`` and its transpose are 2:4
along their rows. Patterns are 16-bit sets (bit ``4*row + col``); the mask kernel and the reference score
all of them at once as one ``[tiles, 16] x [16, patterns]`` product.

>>> NPAT, bin(PATTERNS[0])
(90, '0b1100110000110011')
"""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

_PAIRS = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def _pattern_bits() -> list[int]:
    """Every 4x4 0/1 tile with two ones per row and per column, as 16-bit sets (bit 4*row + col).

    Order is lexicographic in the (row0, row1, row2, row3) column pairs: the kernel and the reference both
    break score ties towards the first pattern in this list.
    """
    out = []
    for rows in itertools.product(range(6), repeat=4):
        cols = [0, 0, 0, 0]
        bits = 0
        for i, p in enumerate(rows):
            for j in _PAIRS[p]:
                cols[j] += 1
                bits |= 1 << (4 * i + j)
        if cols == [2, 2, 2, 2]:
            out.append(bits)
    return out


PATTERNS = _pattern_bits()
NPAT = len(PATTERNS)  # 90
NPAT_PAD = 128  # tl.arange / tl.dot want a power of two
_PATTERN_CACHE: dict[tuple, tuple[Tensor, Tensor]] = {}


def pattern_tensors(device: torch.device) -> tuple[Tensor, Tensor]:
    """(16, NPAT_PAD) float32 cell-membership matrix and (NPAT_PAD,) int32 bit sets, cached per device."""
    key = (device.type, device.index)
    if key not in _PATTERN_CACHE:
        bits = torch.zeros(NPAT_PAD, dtype=torch.int32)
        bits[:NPAT] = torch.tensor(PATTERNS, dtype=torch.int32)
        cells = torch.arange(16, dtype=torch.int32)
        member = ((bits[None, :] >> cells[:, None]) & 1).to(torch.float32)
        _PATTERN_CACHE[key] = (member.to(device), bits.to(device))
    return _PATTERN_CACHE[key]


def check_weight(weight: Tensor) -> None:
    """Raises unless ``weight`` is a 2-D float16/bfloat16/float32 tensor with both dims multiples of 4."""
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    if weight.shape[0] % 4 or weight.shape[1] % 4:
        raise ValueError(f"weight shape {tuple(weight.shape)}: both dims must be multiples of 4 for 4x4 tiles")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"weight dtype must be float16, bfloat16 or float32, got {weight.dtype}")
