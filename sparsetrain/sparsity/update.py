"""The one place masks change.

>>> m = torch.tensor([True, True, False, False])
>>> u = update_mask(m, drop_scores=torch.tensor([1., 5., 0., 0.]), grow_scores=torch.tensor([0., 0., 3., 1.]), n=1)
>>> u.mask.tolist(), u.dropped.tolist(), u.grown.tolist()
([False, True, True, False], [True, False, False, False], [False, False, True, False])
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sparsetrain.sparsity.layout import topk_mask

_NEG = float("-inf")


@dataclass
class MaskUpdate:
    mask: Tensor      # new block mask
    dropped: Tensor   # blocks active before, inactive now
    grown: Tensor     # blocks inactive before, active now
    counts: tuple[int, int] | None = None   # (dropped, grown) where known on the host, else counted on demand

    @property
    def n_dropped(self) -> int:
        return self.counts[0] if self.counts is not None else int(self.dropped.sum().item())

    @property
    def n_grown(self) -> int:
        return self.counts[1] if self.counts is not None else int(self.grown.sum().item())


def update_mask(mask: Tensor, drop_scores: Tensor, grow_scores: Tensor, n: int,
                n_active: int | None = None) -> MaskUpdate:
    """Drop the ``n`` active blocks with the lowest drop score and grow the ``n`` inactive blocks with the
    highest grow score. Blocks dropped in this update are not candidates for regrowth, so the pattern
    changes by exactly ``2n`` positions and the active count is unchanged. ``n`` is clipped to what is
    possible (no more than the active or the inactive count). ``n_active``: the mask's active count where the
    caller knows it (on a GPU, counting it here would wait for the device)."""
    if drop_scores.shape != mask.shape or grow_scores.shape != mask.shape:
        raise ValueError(f"score shapes {tuple(drop_scores.shape)}, {tuple(grow_scores.shape)} != mask {tuple(mask.shape)}")
    mask = mask.to(torch.bool)
    if n_active is None:
        n_active = int(mask.sum().item())
    n = max(0, min(int(n), n_active, mask.numel() - n_active))
    if n == 0:
        z = torch.zeros_like(mask)
        return MaskUpdate(mask.clone(), z, z.clone(), (0, 0))
    ds = drop_scores.float().masked_fill(~mask, float("inf"))
    dropped = topk_mask(-ds, n)  # lowest drop scores among active
    gs = grow_scores.float().masked_fill(mask, _NEG)
    grown = topk_mask(gs, n)     # highest grow scores among previously inactive
    new = (mask & ~dropped) | grown
    return MaskUpdate(new, dropped, grown, (n, n))   # topk_mask sets exactly n of each


def prune_to(mask: Tensor, scores: Tensor, k: int) -> MaskUpdate:
    """Keep the ``k`` active blocks with the highest scores (gradual pruning; never grows)."""
    mask = mask.to(torch.bool)
    k = max(1, min(int(k), int(mask.sum().item())))
    keep = topk_mask(scores.float().masked_fill(~mask, _NEG), k)
    return MaskUpdate(keep, mask & ~keep, torch.zeros_like(mask))
