"""N:M masks, including the transposable 2:4 mask used for 2:4 sparse training.

In an N:M mask every group of M consecutive weights along the input dimension keeps N. In a *transposable*
N:M mask every MxM tile keeps exactly N per row and per column, so both W (forward) and Wᵀ (dX) are N:M
sparse. We pick, for every tile, the valid pattern that keeps the most magnitude: an exact search over all
patterns (90 for 2:4), done as one matrix product of tile magnitudes with the pattern table.

>>> w = torch.randn(8, 8)
>>> m = transposable_nm_mask(w)
>>> bool((m.reshape(2, 4, 2, 4).sum(3) == 2).all() and (m.reshape(2, 4, 2, 4).sum(1) == 2).all())
True
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor


@dataclass(frozen=True)
class NM:
    """N of every M weights kept; ``transposable`` asks for N per row and per column of each MxM tile."""

    n: int = 2
    m: int = 4
    transposable: bool = True

    def __post_init__(self) -> None:
        if not (1 <= self.n <= self.m):
            raise ValueError(f"N:M needs 1 <= n <= m, got n={self.n}, m={self.m}")

    @property
    def density(self) -> float:
        return self.n / self.m

    def mask(self, weight: Tensor) -> Tensor:
        return transposable_nm_mask(weight, self.n, self.m) if self.transposable else nm_mask(weight, self.n, self.m)

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" + ("T" if self.transposable else "")


def _check_shape(weight: Tensor, m: int, both: bool) -> None:
    o, i = weight.shape
    if i % m or (both and o % m):
        what = f"{m}x{m} tiles" if both else f"groups of {m}"
        raise ValueError(f"weight ({o}, {i}) is not divisible into {what}")


def nm_mask(weight: Tensor, n: int = 2, m: int = 4) -> Tensor:
    """Keep the ``n`` largest |w| of every ``m`` consecutive weights along the input dimension."""
    _check_shape(weight, m, both=False)
    o, i = weight.shape
    groups = weight.detach().abs().float().reshape(o, i // m, m)
    idx = groups.topk(n, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True)
    return mask.reshape(o, i)


@cache
def _patterns(n: int, m: int) -> Tensor:
    """All m x m 0/1 matrices with n ones in each row and each column, flattened: (P, m*m)."""
    rows = [r for r in itertools.product((0, 1), repeat=m) if sum(r) == n]
    pats = []
    for choice in itertools.product(rows, repeat=m):
        t = torch.tensor(choice)
        if bool((t.sum(0) == n).all()):
            pats.append(t.flatten())
    return torch.stack(pats).float()


def transposable_nm_mask(weight: Tensor, n: int = 2, m: int = 4) -> Tensor:
    """Best transposable N:M mask: per MxM tile, the valid pattern with the largest kept L1 magnitude."""
    _check_shape(weight, m, both=True)
    o, i = weight.shape
    tiles = weight.detach().abs().float().reshape(o // m, m, i // m, m).permute(0, 2, 1, 3).reshape(-1, m * m)
    pats = _patterns(n, m).to(tiles.device)
    best = (tiles @ pats.t()).argmax(dim=1)
    chosen = pats[best].bool().reshape(o // m, i // m, m, m).permute(0, 2, 1, 3).reshape(o, i)
    return chosen


def is_transposable_nm(mask: Tensor, n: int = 2, m: int = 4) -> bool:
    o, i = mask.shape
    t = mask.reshape(o // m, m, i // m, m)
    return bool((t.sum(3) == n).all() and (t.sum(1) == n).all())
