"""Plain-torch reference for the block-sparse linear layer: runs anywhere, differentiable, and is what the
Triton kernels are tested against.

The compressed weight is ``values [n_blocks, br, bc]`` plus a :class:`~.meta.BlockSparseMeta` (only its
``row_idx`` / ``col_idx`` and shapes are used here). The reference scatters the
blocks into a dense ``W [O, I]`` and calls ``F.linear``: the same function as the kernels, at dense cost.

>>> import torch
>>> from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
>>> meta = BlockSparseMeta.from_mask(torch.tensor([[True, False], [False, True]]), 16)
>>> w = torch.randn(32, 32)
>>> v = dense_to_values(w, meta)
>>> v.shape
torch.Size([2, 16, 16])
>>> bool((values_to_dense(v, meta)[:16, 16:] == 0).all())
True
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta


def block_index(meta: BlockSparseMeta) -> tuple[Tensor, Tensor]:
    """``(row_idx, col_idx)`` of the active blocks as int64 index tensors (cached on the metadata)."""
    key = ("block_index",)
    if key not in meta._groups:
        meta._groups[key] = (meta.row_idx.long(), meta.col_idx.long())
    return meta._groups[key]


def _blocks(weight: Tensor, meta: BlockSparseMeta) -> Tensor:
    """``weight [O, I]`` as ``[R, C, br, bc]`` (a view when ``weight`` is contiguous)."""
    R, C = meta.grid
    return weight.reshape(R, meta.block_rows, C, meta.block_cols).permute(0, 2, 1, 3)


def values_to_dense(values: Tensor, meta: BlockSparseMeta) -> Tensor:
    """Scatter the active blocks into a dense ``[O, I]`` weight (zeros elsewhere). Differentiable."""
    w = values.new_zeros(meta.out_features, meta.in_features)
    _blocks(w, meta)[block_index(meta)] = values
    return w


def dense_to_values(weight: Tensor, meta: BlockSparseMeta) -> Tensor:
    """Gather the active blocks of a dense ``[O, I]`` tensor into ``[n_blocks, br, bc]`` (slot order)."""
    return _blocks(weight, meta)[block_index(meta)]


def reference_linear(x: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None = None) -> Tensor:
    """``x @ W_effᵀ + bias`` through a dense scatter of the blocks; autograd gives dX, dvalues, dbias."""
    return F.linear(x, values_to_dense(values, meta), bias)


def reference_grads(x: Tensor, dy: Tensor, values: Tensor, meta: BlockSparseMeta
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Closed-form gradients of ``y = x W_effᵀ + b`` for 2-D ``x [T, I]`` and ``dy [T, O]``:
    ``dX = dY·W_eff``, ``dvalues = blocks of dYᵀ·X at the active positions``, ``dbias = Σ_t dY``."""
    w = values_to_dense(values, meta)
    dx = dy @ w
    dvalues = dense_to_values(dy.t() @ x, meta)
    return dx, dvalues, dy.sum(0)
