"""model.fp32_residual=false: LayerNorms return the autocast dtype (a 16-bit residual stream)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from sparsetrain.models import build_model
from sparsetrain.models.norms import AutocastLayerNorm


def _batch(vocab: int, gen: torch.Generator) -> dict:
    ids = torch.randint(5, vocab, (4, 32), generator=gen)
    labels = torch.full_like(ids, -100)
    labels[:, ::5] = ids[:, ::5]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def test_16bit_residual_stream_under_autocast_same_loss_and_weights():
    """Every LayerNorm returns bf16 under CPU bf16 autocast with fp32_residual=false (the residual adds then run in
    bf16), float32 without autocast and by default; the state dict is the same, and the loss and gradients stay
    within bf16 rounding of the float32 stream's."""
    torch.manual_seed(0)
    ref = build_model("bert", "tiny", vocab_size=200, seq_len=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = build_model("bert", "tiny", vocab_size=200, seq_len=32, attn_implementation="sdpa", fp32_residual=False)
    assert ref.state_dict().keys() == model.state_dict().keys()
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert norms and all(type(m) is AutocastLayerNorm for m in norms)
    assert not any(type(m) is AutocastLayerNorm for m in ref.modules())
    for a, b in zip(ref.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    ref.eval()
    model.eval()
    batch = _batch(200, torch.Generator().manual_seed(1))
    seen = []
    hook = norms[1].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**batch).loss
        loss_ref = ref(**batch).loss
    model(**batch)
    hook.remove()
    assert seen == [torch.bfloat16, torch.float32]
    loss.backward()
    loss_ref.backward()
    assert abs(loss.item() - loss_ref.item()) < 0.02 * abs(loss_ref.item())
    # the whole gradient (per tensor some are rounding noise: a key bias's gradient is zero in exact arithmetic)
    ga = torch.cat([p.grad.flatten() for p in ref.parameters() if p.grad is not None])
    gb = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert ga.shape == gb.shape and (ga - gb).norm() / ga.norm() < 0.05


def test_fp32_residual_must_be_a_bool():
    with pytest.raises(ValueError, match="fp32_residual"):
        build_model("bert", "tiny", vocab_size=200, seq_len=32, fp32_residual="no")
