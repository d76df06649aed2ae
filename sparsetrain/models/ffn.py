"""The feed-forward blocks of the BERT and ViT models with :func:`sparsetrain.nn.mlp.gelu_mlp`'s fusion: where it
applies (both linears block-sparse, ``trainer.kernels.gelu_recompute`` on), GELU is recomputed in the backward
instead of kept; otherwise transformers' modules run as they are.

:func:`use_gelu_mlp` swaps the class of each BERT layer and ViT MLP whose activation is the exact GELU (in place,
no weight or state-dict name changes); :mod:`sparsetrain.models.builders` applies it to every model it builds.
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from transformers.activations import GELUActivation
from transformers.models.bert.modeling_bert import BertLayer
from transformers.models.vit.modeling_vit import ViTMLP

from sparsetrain.nn.mlp import fusable, fused_gelu_mlp


def _exact_gelu(act) -> bool:
    return type(act) is GELUActivation and act.act is F.gelu


class BertLayerGeluMLP(BertLayer):
    """``BertLayer`` whose feed-forward block takes :func:`~sparsetrain.nn.mlp.fused_gelu_mlp` where it applies
    (made by :func:`use_gelu_mlp`)."""

    def feed_forward_chunk(self, attention_output):
        out = self.output
        if not fusable(attention_output, self.intermediate.dense, out.dense):
            return super().feed_forward_chunk(attention_output)  # transformers' modules, as they are
        hidden = fused_gelu_mlp(attention_output, self.intermediate.dense, out.dense)
        return out.LayerNorm(out.dropout(hidden) + attention_output)


class ViTMLPGelu(ViTMLP):
    """``ViTMLP`` taking :func:`~sparsetrain.nn.mlp.fused_gelu_mlp` where it applies (made by
    :func:`use_gelu_mlp`)."""

    def forward(self, hidden_states):
        if not fusable(hidden_states, self.fc1, self.fc2):
            return super().forward(hidden_states)
        return fused_gelu_mlp(hidden_states, self.fc1, self.fc2)


def use_gelu_mlp(model: nn.Module) -> nn.Module:
    """Give every BERT layer and ViT MLP of ``model`` with the exact GELU the fused-capable feed-forward block (in
    place; returns ``model``). Others (another activation, other model types) are left as they are."""
    for module in model.modules():
        if type(module) is BertLayer and _exact_gelu(module.intermediate.intermediate_act_fn):
            module.__class__ = BertLayerGeluMLP
        elif type(module) is ViTMLP and _exact_gelu(module.activation_fn):
            module.__class__ = ViTMLPGelu
    return model


__all__ = ["BertLayerGeluMLP", "ViTMLPGelu", "use_gelu_mlp"]
