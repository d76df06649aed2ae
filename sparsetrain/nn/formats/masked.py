"""``format="masked"`` and ``"masked_st"``: a dense weight Parameter times the element mask. Runs anywhere;
the reference every other format is tested against.

>>> from sparsetrain.nn import SparseLinear
>>> layer = SparseLinear(8, 4, format="masked_st")
>>> layer.caps.straight_through
True
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparsetrain.nn.formats.base import FormatCaps, WeightFormat, register_format, zero_optimizer_state
from sparsetrain.sparsity.layout import to_element_mask

if TYPE_CHECKING:  # pragma: no cover
    from sparsetrain.nn.sparse_linear import SparseLinear


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

    @property
    def caps(self) -> FormatCaps:
        return FormatCaps(straight_through=self.straight_through)

    def setup(self, layer, weight, mask):
        w = weight.detach().clone()
        em = to_element_mask(mask, layer.block).to(w.device)
        if not self.straight_through:
            w = w * em
        layer.weight = nn.Parameter(w)
        layer.register_buffer("_element_mask", em.to(w.dtype), persistent=False)

    def _refresh(self, layer) -> None:
        em = to_element_mask(layer.mask, layer.block)
        current = layer._buffers.get("_element_mask")
        if current is not None and current.shape == em.shape:
            current.copy_(em)   # in place: a training step replayed from a CUDA graph then reads the new mask
        else:
            layer._element_mask = em.to(device=layer.weight.device, dtype=layer.weight.dtype)

    def element_mask(self, layer) -> Tensor:
        """The mask the weight is multiplied by, in the weight's dtype and on its device (kept as a buffer)."""
        w, m = layer.weight, layer._element_mask
        if m.dtype != w.dtype or m.device != w.device:
            m = layer._element_mask = m.to(device=w.device, dtype=w.dtype)
        return m

    def effective_weight(self, layer) -> Tensor:
        w, m = layer.weight, self.element_mask(layer)
        if self.straight_through:
            # forward: w * m ; backward: identity to the dense weight (straight-through estimator)
            w_eff = w + (w * m - w).detach()
        else:
            w_eff = w * m
        return capture_dense_grad(layer, w_eff)

    def forward(self, layer, x):
        return F.linear(x, self.effective_weight(layer), layer.bias)

    def dense_weight(self, layer):
        return (layer.weight * self.element_mask(layer)).detach()

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
