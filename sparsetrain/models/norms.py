"""The residual stream's precision under mixed precision (``model.fp32_residual``).

Under bf16/fp16 autocast, PyTorch runs LayerNorm in float32 and returns float32, so in a post-LN model (BERT) the
residual stream between layers is float32: every residual add, dropout and LayerNorm reads and writes 4-byte
activations, and each linear casts its input down again. With ``fp32_residual=false``, :func:`use_16bit_residual`
makes every LayerNorm return the autocast dtype (it still normalises in float32), so the stream is 16-bit, as in
Megatron-LM's default (``fp32_residual_connection`` off). Off autocast nothing changes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class AutocastLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose output takes the autocast dtype where autocast is on (made by
    :func:`use_16bit_residual`; the same parameters and state-dict names)."""

    def forward(self, x: Tensor) -> Tensor:
        y = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        kind = y.device.type
        if y.dtype == torch.float32 and torch.is_autocast_enabled(kind):
            y = y.to(torch.get_autocast_dtype(kind))
        return y


def use_16bit_residual(model: nn.Module) -> nn.Module:
    """Swap the class of every ``nn.LayerNorm`` of ``model`` for :class:`AutocastLayerNorm` (in place; returns
    ``model``)."""
    for module in model.modules():
        if type(module) is nn.LayerNorm:
            module.__class__ = AutocastLayerNorm
    return model


__all__ = ["AutocastLayerNorm", "use_16bit_residual"]
