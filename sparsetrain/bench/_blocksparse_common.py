"""What the sections of ``sparsetrain bench blocksparse`` share: random block masks, a relative error, the
list options."""
from __future__ import annotations

import torch

from sparsetrain.sparsity.layout import Block, n_active_blocks, random_mask

DEV = "cuda"


def make_mask(out_f: int, in_f: int, b: int, density: float, seed: int) -> torch.Tensor:
    k = n_active_blocks((out_f, in_f), Block(b, b), density)
    return random_mask((out_f // b, in_f // b), k, torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float("nan")
    den = ref.norm().item()
    return (a - ref).norm().item() / den if den > 0 else (a - ref).norm().item()


def ints(s: str) -> list[int]:
    return [int(v) for v in s.split(",")]


def shapes(s: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in shp.split("x")) for shp in s.split(",")]
