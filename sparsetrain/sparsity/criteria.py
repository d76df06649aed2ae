"""Score functions. A policy (see :mod:`sparsetrain.sparsity.policies`) is a pair of these.

Scores may be per element (weight-shaped) or per block (block-grid shaped); element scores are summed over
each block by the framework, so ``magnitude`` becomes the block L1 norm.
Higher drop score = more worth keeping; higher grow score = grown first.
"""
from __future__ import annotations

import torch
from torch import Tensor


def magnitude(weight: Tensor) -> Tensor:
    """|w| (block L1 norm after block reduction)."""
    return weight.detach().abs().float()


def gradient(grad: Tensor) -> Tensor:
    """|dL/dw| of the dense gradient (RigL)."""
    if grad is None:
        raise ValueError("gradient scores need the dense gradient; the scheduler captures it on update steps "
                         "when the policy sets needs_grad = True")
    return grad.detach().abs().float()


def random(shape: tuple[int, ...] | torch.Size, generator: torch.Generator) -> Tensor:
    """Uniform scores from a generator seeded identically on every rank (SET)."""
    return torch.rand(tuple(shape), generator=generator)
