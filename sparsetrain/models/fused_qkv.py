"""One input projection for the queries, keys and values of BERT's and ViT's attention: ``model.fused_qkv``.

Each attention layer reads the same hidden states through three H x H linears. Fused, they are one H -> 3H
linear ``qkv`` whose output rows are the query's, then the key's, then the value's: one matrix product instead
of three in the forward and in each gradient. The model computes what it computed before, dense and sparse
alike a little faster (larger products; a block-sparse product pays its fixed cost per call and per output tile
once instead of three times: at BERT-base's 768x768 projections 16x16 blocks at 10% density run no faster than
dense cuBLAS, one 768 -> 2304 product does; see docs/benchmarks/e2e.md).

What changes for sparsity: the fused projection is **one layer** to the sparsity layer. A uniform density is
unchanged; a distribution that sets a density per layer from its shape (ERK) gives the fused layer one density
where it gave the three separate ones theirs, and prune/regrow ranks the three together. Blocks never straddle
two of the three (H is a multiple of every block size the block format takes at these models' widths).

:func:`fuse_qkv` converts a model in place (the weights are concatenated, so the model computes what it did);
:func:`unfuse_qkv` converts back, so an export is a plain transformers checkpoint. A fused model also loads a
state dict with separate ``query``/``key``/``value`` (or ``q_proj``/``k_proj``/``v_proj``) entries.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert import modeling_bert
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.vit import modeling_vit
from transformers.models.vit.modeling_vit import ViTAttention

from sparsetrain.nn.parts import linear_in_parts


def _split_heads(qkv: nn.Module, hidden_states: torch.Tensor, head_dim: int):
    """``qkv(hidden_states)`` [B, S, 3H] as the query, key and value [B, heads, S, head_dim] (views of the three
    pieces of :func:`~sparsetrain.nn.parts.linear_in_parts`). Where a block-sparse layer's kernels write the
    pieces as tensors of their own, its backward reads the three gradients where attention wrote them; elsewhere
    the output is split along its last dimension and the backward concatenates the gradients, a plain copy (not
    unbound from a [B, S, 3, heads, head_dim] view: inductor folds that view and the flattening for a
    block-sparse op into one copy kernel whose per-element index arithmetic made it twice as slow)."""
    shape = (*hidden_states.shape[:-1], -1, head_dim)
    return (t.view(shape).transpose(1, 2) for t in linear_in_parts(qkv, hidden_states))


def _attend(module: nn.Module, eager, q, k, v, attention_mask, dropout: float, kwargs: dict):
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
    return interface(module, q, k, v, attention_mask, dropout=dropout if module.training else 0.0,
                     scaling=module.scaling, **kwargs)


class BertSelfAttentionQKV(BertSelfAttention):
    """``BertSelfAttention`` with one ``qkv`` projection (made by :func:`fuse_qkv`; encoder self-attention only)."""

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, cache=None, **kwargs):
        if past_key_values is not None or cache is not None:
            raise ValueError("model.fused_qkv: a key/value cache (decoding) is not supported; build without it")
        q, k, v = _split_heads(self.qkv, hidden_states, self.attention_head_size)
        out, weights = _attend(self, modeling_bert.eager_attention_forward, q, k, v, attention_mask, self.dropout.p,
                               kwargs)
        return out.reshape(*hidden_states.shape[:-1], -1).contiguous(), weights


class ViTAttentionQKV(ViTAttention):
    """``ViTAttention`` with one ``qkv`` projection (made by :func:`fuse_qkv`)."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        q, k, v = _split_heads(self.qkv, hidden_states, self.head_dim)
        out, weights = _attend(self, modeling_vit.eager_attention_forward, q, k, v, attention_mask,
                               self.attention_dropout, kwargs)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


#: attention class -> (its fused class, the names of its query, key and value linears)
_FUSED = {BertSelfAttention: (BertSelfAttentionQKV, ("query", "key", "value")),
          ViTAttention: (ViTAttentionQKV, ("q_proj", "k_proj", "v_proj"))}
_PLAIN = {fused: (plain, names) for plain, (fused, names) in _FUSED.items()}


def _replace(module: nn.Module, old: tuple[str, ...], new: dict[str, nn.Module]) -> None:
    """Swap the child modules named ``old`` for ``new``, in the place of the first (state-dict order kept)."""
    items = list(module._modules.items())
    at = [k for k, _ in items].index(old[0])
    kept = [(k, v) for k, v in items if k not in old]
    module._modules = dict(kept[:at] + list(new.items()) + kept[at:])


def _merge_separate_entries(names):
    """A load_state_dict pre-hook: separate query/key/value entries become the ``qkv`` entry."""

    def hook(module, state_dict, prefix, *args):
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{n}.{kind}" for n in names]
            if all(k in state_dict for k in keys):
                state_dict[f"{prefix}qkv.{kind}"] = torch.cat([state_dict.pop(k) for k in keys])

    return hook


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` [out, in] and ``bias`` (same device and dtype)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                    dtype=weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(weight)
        if bias is not None:
            lin.bias.copy_(bias)
    return lin


def fuse_qkv(model: nn.Module) -> nn.Module:
    """Give every BERT self-attention and ViT attention of ``model`` one ``qkv`` linear in place of its three
    (in place; returns ``model``). The outputs are unchanged up to float rounding. Raises ValueError naming
    ``model.fused_qkv`` if the model has no such attention, or one of them is a decoder's."""
    found = 0
    for name, module in model.named_modules():
        if type(module) not in _FUSED:
            continue
        fused_cls, names = _FUSED[type(module)]
        if getattr(module, "is_decoder", False):
            raise ValueError(f"model.fused_qkv: {name} is a decoder's self-attention (only encoders are fused)")
        parts = [getattr(module, n) for n in names]
        bias = torch.cat([p.bias.detach() for p in parts]) if parts[0].bias is not None else None
        _replace(module, names, {"qkv": _linear(torch.cat([p.weight.detach() for p in parts]), bias)})
        module.__class__ = fused_cls
        module._qkv_load_hook = module.register_load_state_dict_pre_hook(_merge_separate_entries(names))
        found += 1
    if not found:
        raise ValueError(f"model.fused_qkv: {type(model).__name__} has no BERT or ViT attention to fuse")
    return model


def unfuse_qkv(model: nn.Module) -> nn.Module:
    """Undo :func:`fuse_qkv` in place (three linears again, the plain transformers classes); a model that is not
    fused comes back unchanged. Used by exports, so every export loads with ``from_pretrained``."""
    for module in model.modules():
        if type(module) not in _PLAIN:
            continue
        plain_cls, names = _PLAIN[type(module)]
        qkv = module.qkv
        weights = qkv.weight.detach().chunk(3)
        biases = qkv.bias.detach().chunk(3) if qkv.bias is not None else (None,) * 3
        _replace(module, ("qkv",), {n: _linear(w, b) for n, w, b in zip(names, weights, biases)})
        module._qkv_load_hook.remove()
        del module._qkv_load_hook
        module.__class__ = plain_cls
    return model


__all__ = ["BertSelfAttentionQKV", "ViTAttentionQKV", "fuse_qkv", "unfuse_qkv"]
