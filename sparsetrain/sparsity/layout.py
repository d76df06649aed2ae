"""Which blocks of a weight matrix are active.

A *block mask* is a bool tensor of shape ``(out // block.rows, in // block.cols)``: one entry per block of
the ``(out, in)`` weight. Element-wise (unstructured) sparsity is the 1x1 block. Everything that turns
scores into masks lives here and in :mod:`sparsetrain.sparsity.update`.

>>> b = Block(16, 16)
>>> grid_shape((768, 3072), b)
(48, 192)
>>> n_active_blocks((768, 3072), b, density=0.1)
922
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Block:
    """Block shape (rows of the weight, columns of the weight). ``Block(1, 1)`` is unstructured."""

    rows: int = 1
    cols: int = 1

    def __post_init__(self) -> None:
        for name, v in (("rows", self.rows), ("cols", self.cols)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"block.{name} must be a positive int, got {v!r}")

    @classmethod
    def parse(cls, value: BlockLike | list[int] | str) -> Block:
        """Accept ``16``, ``(16, 16)``, ``[16, 16]``, ``"16x16"`` (as a config may spell it) or a Block.
        Public functions parse once at their boundary and pass the Block on."""
        if isinstance(value, Block):
            return value
        if isinstance(value, bool):
            raise ValueError(f"block must be an int, a pair or 'RxC', got {value!r}")
        if isinstance(value, int):
            return cls(value, value)
        if isinstance(value, str):
            parts = value.lower().split("x")
            if len(parts) == 2 and all(p.strip().isdigit() for p in parts):
                return cls(int(parts[0]), int(parts[1]))
            if value.strip().isdigit():
                return cls(int(value), int(value))
            raise ValueError(f"block must look like '16x16' or 16, got {value!r}")
        if isinstance(value, (tuple, list)) and len(value) == 2:
            return cls(int(value[0]), int(value[1]))
        raise ValueError(f"block must be an int, a pair or 'RxC', got {value!r}")

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def __str__(self) -> str:
        return f"{self.rows}x{self.cols}"


#: What public functions accept as a block shape (``Block.parse`` also reads config strings like ``"16x16"``).
BlockLike = Block | int | tuple[int, int]


def grid_shape(weight_shape: tuple[int, ...] | torch.Size, block: Block) -> tuple[int, int]:
    """Shape of the block grid; raises if the block does not tile the weight."""
    out_f, in_f = int(weight_shape[0]), int(weight_shape[1])
    if out_f % block.rows or in_f % block.cols:
        raise ValueError(
            f"block {block} does not divide weight of shape ({out_f}, {in_f}): "
            f"{out_f} % {block.rows} = {out_f % block.rows}, {in_f} % {block.cols} = {in_f % block.cols}"
        )
    return out_f // block.rows, in_f // block.cols


def check_density(density: float, name: str = "density") -> float:
    d = float(density)
    if not (0.0 < d <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {density!r}")
    return d


def n_active_blocks(weight_shape: tuple[int, ...] | torch.Size, block: Block, density: float) -> int:
    """Exact number of active blocks for a density: round(density * n_blocks), at least one."""
    check_density(density)
    r, c = grid_shape(weight_shape, block)
    return max(1, min(r * c, int(round(density * r * c))))


def block_reduce(element_scores: Tensor, block: Block) -> Tensor:
    """Sum element scores over each block: ``(O, I) -> (O/br, I/bc)``. Identity for 1x1 blocks."""
    if block.rows == 1 and block.cols == 1:
        return element_scores
    r, c = grid_shape(element_scores.shape, block)
    return element_scores.reshape(r, block.rows, c, block.cols).sum(dim=(1, 3))


def to_scores_grid(scores: Tensor, weight_shape: torch.Size, block: Block) -> Tensor:
    """Scores from a policy may be per element (weight-shaped) or already per block."""
    grid = grid_shape(weight_shape, block)
    if tuple(scores.shape) == tuple(grid):
        return scores
    if tuple(scores.shape) == tuple(weight_shape):
        return block_reduce(scores, block)
    raise ValueError(f"scores of shape {tuple(scores.shape)} match neither weight {tuple(weight_shape)} "
                     f"nor block grid {grid}")


def to_element_mask(block_mask: Tensor, block: Block) -> Tensor:
    """Expand a block mask to the element mask of the weight."""
    if block.rows == 1 and block.cols == 1:
        return block_mask
    return block_mask.repeat_interleave(block.rows, 0).repeat_interleave(block.cols, 1)


def topk_mask(scores: Tensor, k: int) -> Tensor:
    """Bool mask with exactly ``k`` True entries at the largest scores (ties broken by index, stably)."""
    flat = scores.reshape(-1).float()
    if not 0 <= k <= flat.numel():
        raise ValueError(f"k must be in [0, {flat.numel()}], got {k}")
    mask = torch.zeros(flat.numel(), dtype=torch.bool, device=scores.device)
    if k > 0:
        # argsort with stable=True gives the same choice on every rank for equal scores.
        idx = torch.argsort(flat, descending=True, stable=True)[:k]
        mask.index_fill_(0, idx, True)  # a scalar fill: `mask[idx] = True` would copy True to the device and wait
    return mask.reshape(scores.shape)


def random_mask(grid: tuple[int, int], k: int, generator: torch.Generator, device=None) -> Tensor:
    """Exactly ``k`` active blocks chosen uniformly at random from ``generator`` (CPU generator)."""
    scores = torch.rand(grid, generator=generator)
    return topk_mask(scores, k).to(device) if device is not None else topk_mask(scores, k)


def density_of(block_mask: Tensor) -> float:
    return float(block_mask.float().mean().item())
