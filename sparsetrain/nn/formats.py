"""Storage formats of a :class:`~sparsetrain.nn.SparseLinear` weight.

A format is a small strategy object that owns *how* a layer stores and multiplies its weight; the layer
owns *which* blocks are active (its ``mask`` buffer, a bool block grid). Every format implements:

- ``setup(layer, weight, mask)``: register parameters/buffers on ``layer`` from a dense weight and mask;
- ``forward(layer, x)``: ``x @ W_effᵀ + bias`` where ``W_eff`` is zero outside the mask;
- ``dense_weight(layer)``: ``W_eff`` as a dense, detached ``(out, in)`` tensor;
- ``state_weight(layer)``: the dense tensor saved under ``weight`` in the state dict;
- ``load(layer, weight, mask)``: in-place inverse of ``state_weight`` (keeps Parameter identity, so an
  optimizer built before loading still points at the right tensors);
- ``set_mask(layer, new_mask, optimizer)``: rewrite the topology. Surviving weights and their optimizer
  moments are kept; newly active weights start at zero with zeroed moments; pruned weights are gone (or
  zero) in the weight *and* in the optimizer state, so momentum cannot revive them;
- ``weight_parameter(layer)``: the trainable Parameter holding the weight.

Dense-gradient capture (RigL): when ``layer.capture_dense_grad`` is True, the next backward passes
accumulate ``dL/dW_eff`` for *all* positions (active or not) into ``layer.dense_grad``.

New formats register with :func:`register_format` and are picked by name: ``sparsity.format=block``.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparsetrain.sparsity.layout import to_element_mask

if TYPE_CHECKING:  # pragma: no cover
    from sparsetrain.nn.sparse_linear import SparseLinear

FORMATS: dict[str, type[WeightFormat]] = {}


def register_format(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        cls.name = name
        FORMATS[name] = cls
        return cls
    return deco


def get_format(name: str | WeightFormat, **kwargs) -> WeightFormat:
    """Instantiate a format by name (``"masked"``, ``"block"``, ``"2:4"`` ...)."""
    if isinstance(name, WeightFormat):
        return name
    _import_optional_formats()
    if name not in FORMATS:
        raise ValueError(f"unknown sparsity format {name!r}; known formats: {sorted(FORMATS)}")
    return FORMATS[name](**kwargs)


def _import_optional_formats() -> None:
    """Formats backed by GPU kernels register themselves when their module is imported."""
    import importlib

    for mod in ("sparsetrain.kernels.block_format", "sparsetrain.kernels.semi24_format"):
        try:
            importlib.import_module(mod)
        except ImportError:
            pass


def zero_optimizer_state(optimizer: torch.optim.Optimizer | None, param: Tensor, where: Tensor) -> None:
    """Zero every per-element optimizer state of ``param`` (Adam moments, SGD momentum...) at ``where``."""
    if optimizer is None:
        return
    state = optimizer.state.get(param)
    if not state:
        return
    for value in state.values():
        if torch.is_tensor(value) and value.shape == param.shape:
            value.masked_fill_(where.to(value.device), 0)


class WeightFormat:
    name = "base"

    def setup(self, layer: SparseLinear, weight: Tensor, mask: Tensor) -> None:
        raise NotImplementedError

    def forward(self, layer: SparseLinear, x: Tensor) -> Tensor:
        raise NotImplementedError

    def dense_weight(self, layer: SparseLinear) -> Tensor:
        raise NotImplementedError

    def state_weight(self, layer: SparseLinear) -> Tensor:
        return self.dense_weight(layer)

    def load(self, layer: SparseLinear, weight: Tensor, mask: Tensor) -> None:
        raise NotImplementedError

    def set_mask(self, layer: SparseLinear, new_mask: Tensor, optimizer=None) -> None:
        raise NotImplementedError

    def weight_parameter(self, layer: SparseLinear) -> nn.Parameter:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return self.name


class _CaptureGrad(torch.autograd.Function):
    """Identity whose backward also accumulates the incoming dense gradient into ``layer.dense_grad``."""

    @staticmethod
    def forward(ctx, w_eff: Tensor, layer_box: list) -> Tensor:  # noqa: D102
        ctx.layer_box = layer_box
        return w_eff.view_as(w_eff)

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: D102
        layer = ctx.layer_box[0]
        g = grad.detach().float()
        layer.dense_grad = g if layer.dense_grad is None else layer.dense_grad + g
        return grad, None


def capture_dense_grad(layer: SparseLinear, w_eff: Tensor) -> Tensor:
    """Route ``w_eff`` through a grad-capturing identity when the layer asked for its dense gradient."""
    if layer.capture_dense_grad and torch.is_grad_enabled() and w_eff.requires_grad:
        return _CaptureGrad.apply(w_eff, [layer])
    return w_eff


@register_format("masked")
class MaskedFormat(WeightFormat):
    """Reference format: a dense weight Parameter times the element mask. Runs anywhere.

    ``straight_through=False`` (dynamic/static sparsity): pruned weights are held at zero, their gradient is
    masked, and their optimizer state is zeroed on every topology change.
    ``straight_through=True`` (2:4 sparse-then-dense): the dense weight keeps its values and receives the
    dense gradient; the mask only shapes the forward product (PyTorch's 2:4 training recipe).
    """

    def __init__(self, straight_through: bool = False) -> None:
        self.straight_through = bool(straight_through)

    def setup(self, layer, weight, mask):
        w = weight.detach().clone()
        em = to_element_mask(mask, layer.block).to(w.device)
        if not self.straight_through:
            w = w * em
        layer.weight = nn.Parameter(w)
        layer.register_buffer("_element_mask", em.to(w.dtype), persistent=False)

    def _refresh(self, layer) -> None:
        layer._element_mask = to_element_mask(layer.mask, layer.block).to(
            device=layer.weight.device, dtype=layer.weight.dtype)

    def effective_weight(self, layer) -> Tensor:
        w = layer.weight
        m = layer._element_mask
        if m.dtype != w.dtype or m.device != w.device:
            m = layer._element_mask = m.to(device=w.device, dtype=w.dtype)
        if self.straight_through:
            # forward: w * m ; backward: identity to the dense weight (straight-through estimator)
            w_eff = w + (w * m - w).detach()
        else:
            w_eff = w * m
        return capture_dense_grad(layer, w_eff)

    def forward(self, layer, x):
        return F.linear(x, self.effective_weight(layer), layer.bias)

    def dense_weight(self, layer):
        return (layer.weight * layer._element_mask.to(layer.weight.dtype)).detach()

    def state_weight(self, layer):
        return layer.weight.detach() if self.straight_through else self.dense_weight(layer)

    def load(self, layer, weight, mask):
        with torch.no_grad():
            layer.mask.copy_(mask.to(layer.mask.device))
            self._refresh(layer)
            w = weight.to(device=layer.weight.device, dtype=layer.weight.dtype)
            layer.weight.copy_(w if self.straight_through else w * layer._element_mask)

    def set_mask(self, layer, new_mask, optimizer=None):
        new_mask = new_mask.to(layer.mask.device, torch.bool)
        changed = to_element_mask(new_mask ^ layer.mask, layer.block)
        with torch.no_grad():
            layer.mask.copy_(new_mask)
            self._refresh(layer)
            if not self.straight_through:
                # pruned -> zero; regrown -> start at zero. Both with zeroed moments.
                layer.weight.masked_fill_(changed.to(layer.weight.device), 0)
                zero_optimizer_state(optimizer, layer.weight, changed)

    def weight_parameter(self, layer):
        return layer.weight

    def extra_repr(self) -> str:
        return "masked" + (", straight_through" if self.straight_through else "")


@register_format("masked_st")
class MaskedStraightThrough(MaskedFormat):
    """``masked`` with ``straight_through=True``: the CPU reference for 2:4 sparse-then-dense training."""

    def __init__(self) -> None:
        super().__init__(straight_through=True)
