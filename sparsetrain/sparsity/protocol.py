"""What a scheduler sees of a sparse layer: the :class:`SparseLayer` protocol and the :class:`FormatCaps`
of its storage format. The sparsity package never imports ``nn`` or ``kernels``; ``SparseLinear`` satisfies
this protocol, and so does any layer a user writes with the same members.

>>> caps = FormatCaps(keeps_count=True)
>>> caps.keeps_count, caps.straight_through
(True, False)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from sparsetrain.sparsity.layout import Block


@dataclass(frozen=True)
class FormatCaps:
    """What a storage format can do with its mask; schedulers and the FLOP count read these, never names.

    - ``keeps_count``: ``set_mask`` must keep the number of active blocks (compressed storage such as
      ``block``); a scheduler that shrinks the count (gradual pruning) drives it through ``shrink_to`` where
      ``can_shrink`` (the storage is rebuilt at the new count), and cannot otherwise.
    - ``straight_through``: the layer trains a dense master weight; the mask only shapes the forward product
      (pruned weights keep their values and receive the dense gradient).
    - ``needs_nm``: masks must be transposable 2:4 element masks (block 1x1).
    - ``derives_mask``: the forward recomputes the mask from the current weight, so a scheduler does not set it.
    - ``shardable``: its Parameters may be sharded by FSDP2 (DTensors): a mask update, ``dense_weight`` and the
      state dict gather them whole and each rank keeps its own shard of the result.
    """

    keeps_count: bool = False
    can_shrink: bool = True
    straight_through: bool = False
    needs_nm: bool = False
    derives_mask: bool = False
    shardable: bool = False


@runtime_checkable
class SparseLayer(Protocol):
    """A linear layer whose weight is zero outside the active blocks of a bool block ``mask``.

    ``mask`` has shape ``(out_features // block.rows, in_features // block.cols)``. ``dense_weight()`` is the
    effective weight as a detached ``(out, in)`` tensor; ``weight_parameter()`` the trainable Parameter.
    ``set_mask(mask, optimizer)`` rewrites the topology (newly active weights start at zero with zeroed
    optimizer moments); ``shrink_to(mask, optimizer)`` keeps a subset of the active blocks (gradual pruning). ``arm_dense_grad(True)`` makes the backward passes accumulate the gradient of every
    position (``capture_dense_grad``), read by ``dense_gradient()``; ``arm_dense_grad(False)`` stops and drops it,
    ``drop_dense_grad()`` drops it. ``dense_phase()`` is an ``nn.Module`` holding the same Parameters, dense.
    """

    in_features: int
    out_features: int
    block: Block
    capture_dense_grad: bool
    dense_grad: Tensor | None
    if TYPE_CHECKING:
        # A registered buffer: isinstance() on Python >= 3.12 looks members up statically and cannot see
        # buffers, so the runtime check leaves it out.
        mask: Tensor

    @property
    def caps(self) -> FormatCaps: ...

    def shrink_to(self, new_mask: Tensor, optimizer: torch.optim.Optimizer | None = None) -> None: ...

    def arm_dense_grad(self, want: bool) -> None: ...

    def dense_gradient(self) -> Tensor | None: ...

    def drop_dense_grad(self) -> None: ...

    @property
    def format_name(self) -> str: ...

    @property
    def n_active(self) -> int: ...

    @property
    def density(self) -> float: ...

    def dense_weight(self) -> Tensor: ...

    def weight_parameter(self) -> nn.Parameter: ...

    def set_mask(self, new_mask: Tensor, optimizer: torch.optim.Optimizer | None = None) -> None: ...

    def set_format(self, format: str, optimizer: torch.optim.Optimizer | None = None) -> None: ...

    def dense_phase(self) -> nn.Module: ...

    def densify(self, optimizer: torch.optim.Optimizer | None = None) -> nn.Module: ...


def sparse_layers(model: nn.Module) -> dict[str, SparseLayer]:
    """``{qualified name: layer}`` for every module of ``model`` that is a :class:`SparseLayer`."""
    return {name: m for name, m in model.named_modules() if isinstance(m, SparseLayer)}
