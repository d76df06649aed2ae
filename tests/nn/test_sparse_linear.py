"""SparseLinear (masked reference format), sparsify/densify on real transformers models."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsetrain.nn import SparseLinear, densify, sparsify
from sparsetrain.sparsity.layout import Block


def _pair(block=Block(8, 8), density=0.3, bias=True, fmt="masked", seed=0):
    lin = nn.Linear(64, 48, bias=bias)
    sl = SparseLinear.from_dense(lin, density=density, block=block, format=fmt,
                                 generator=torch.Generator().manual_seed(seed))
    return lin, sl


@pytest.mark.parametrize("block", [Block(1, 1), Block(4, 4), Block(8, 16), Block(16, 16)])
@pytest.mark.parametrize("bias", [True, False])
def test_masked_equals_linear_with_masked_weight(block, bias):
    lin, sl = _pair(block, 0.3, bias)
    em = sl.element_mask()
    assert sl.density == pytest.approx(round(0.3 * em.numel() / block.numel) * block.numel / em.numel())
    ref_w = (lin.weight.detach() * em).requires_grad_(True)
    ref_b = lin.bias.detach().clone().requires_grad_(True) if bias else None
    x = torch.randn(7, 3, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    g = torch.randn(7, 3, 48)
    (sl(x) * g).sum().backward()
    (F.linear(x2, ref_w, ref_b) * g).sum().backward()
    torch.testing.assert_close(sl(x), F.linear(x, ref_w, ref_b))
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(sl.weight.grad, ref_w.grad * em)   # no gradient outside the mask
    assert (sl.weight.detach()[~em] == 0).all()                   # pruned weights are zero
    if bias:
        torch.testing.assert_close(sl.bias.grad, ref_b.grad)


def test_straight_through_gets_dense_gradient():
    lin, sl = _pair(Block(1, 1), 0.5, fmt="masked_st")
    x = torch.randn(5, 64)
    sl(x).sum().backward()
    em = sl.element_mask()
    torch.testing.assert_close(sl(x), F.linear(x, lin.weight * em, lin.bias))
    torch.testing.assert_close(sl.weight.grad, torch.ones(5, 48).t() @ x)  # dense, unmasked
    torch.testing.assert_close(sl.weight.detach(), lin.weight.detach())     # master weight kept dense


def test_dense_grad_capture_and_accumulation():
    _, sl = _pair(Block(4, 4), 0.25)
    sl.capture_dense_grad = True
    xs = [torch.randn(6, 64) for _ in range(2)]
    for x in xs:
        sl(x).sum().backward()
    expect = sum(torch.ones(6, 48).t() @ x for x in xs)
    torch.testing.assert_close(sl.dense_grad, expect)


@pytest.mark.parametrize("fmt", ["masked", "masked_st"])
def test_state_dict_round_trip(fmt):
    _, sl = _pair(Block(4, 8), 0.4, fmt=fmt, seed=3)
    sd = sl.state_dict()
    assert set(sd) == {"weight", "mask", "bias"} and sd["mask"].dtype == torch.bool
    other = SparseLinear(64, 48, block=Block(4, 8), format=fmt)  # dense mask, other weights
    other.load_state_dict(sd)
    assert other.mask.equal(sl.mask)
    x = torch.randn(3, 64)
    torch.testing.assert_close(other(x), sl(x))
    with pytest.raises(RuntimeError, match="size mismatch"):
        SparseLinear(64, 48, block=Block(8, 8)).load_state_dict(sd)


def test_set_mask_zeroes_weights_and_moments():
    _, sl = _pair(Block(4, 4), 0.5)
    opt = torch.optim.AdamW(sl.parameters(), lr=1e-2)
    sl(torch.randn(4, 64)).pow(2).sum().backward()
    opt.step()
    new = sl.mask.clone()
    on, off = (~new).nonzero()[0], new.nonzero()[0]
    new[tuple(on)] = True
    new[tuple(off)] = False
    sl.set_mask(new, opt)
    changed = torch.zeros(48, 64, dtype=torch.bool)
    changed[on[0] * 4:(on[0] + 1) * 4, on[1] * 4:(on[1] + 1) * 4] = True
    changed[off[0] * 4:(off[0] + 1) * 4, off[1] * 4:(off[1] + 1) * 4] = True
    st = opt.state[sl.weight]
    for key in ("exp_avg", "exp_avg_sq"):
        assert (st[key][changed] == 0).all()
        assert (st[key][sl.element_mask() & ~changed] != 0).any()
    assert (sl.weight.detach()[changed] == 0).all()


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="density"):
        SparseLinear.from_dense(nn.Linear(16, 16), density=0.0)
    with pytest.raises(ValueError, match="block 16x16 does not divide"):
        SparseLinear.from_dense(nn.Linear(24, 16), density=0.5, block=16)
    with pytest.raises(ValueError, match="unknown sparsity format 'bogus'"):
        SparseLinear.from_dense(nn.Linear(16, 16), density=0.5, format="bogus")
    with pytest.raises(ValueError, match="init"):
        SparseLinear.from_dense(nn.Linear(16, 16), density=0.5, init="lottery")


def _tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=32)
    return BertForMaskedLM(cfg).eval()


def _tiny_vit():
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=128, num_labels=10)
    return ViTForImageClassification(cfg).eval()


def _carry_masked_weights(dense_model, sparse_layers):
    for name, layer in sparse_layers.items():
        with torch.no_grad():
            dense_model.get_submodule(name).weight.copy_(layer.dense_weight())


@pytest.mark.parametrize("builder,inputs", [
    (_tiny_bert, lambda: {"input_ids": torch.randint(0, 120, (2, 16))}),
    (_tiny_vit, lambda: {"pixel_values": torch.randn(2, 3, 16, 16)}),
])
def test_sparsified_hf_model_equals_dense_with_masked_weights(builder, inputs):
    model = builder()
    dense = copy.deepcopy(model)
    layers = sparsify(model, density=0.3, block=16, distribution="erk", seed=1)
    names = set(layers)
    assert names and not any("classifier" in n or "cls.predictions" in n or "embeddings" in n for n in names)
    assert all(type(dense.get_submodule(n)) is nn.Linear for n in names)
    _carry_masked_weights(dense, layers)
    x = inputs()
    torch.testing.assert_close(model(**x).logits, dense(**x).logits)


def test_sparsify_targets_and_errors():
    model = _tiny_bert()
    layers = sparsify(model, targets=["*.intermediate.dense", "*.output.dense"], density=0.5, block=8)
    assert len(layers) == 2 * 3  # intermediate, output, attention.output per layer
    with pytest.raises(ValueError, match=r"targets entry '\*.nothing' matches no nn.Linear"):
        sparsify(_tiny_bert(), targets=["*.nothing"], density=0.5)
    with pytest.raises(ValueError, match="does not divide"):
        sparsify(_tiny_bert(), density=0.5, block=48)
    with pytest.raises(TypeError, match="lists of globs"):
        sparsify(_tiny_bert(), targets="*", density=0.5)


def test_save_pretrained_round_trip(tmp_path):
    from transformers import BertForMaskedLM

    model = _tiny_bert()
    sparsify(model, density=0.25, block=16, seed=2)
    x = torch.randint(0, 120, (2, 16))
    ref = model(input_ids=x).logits
    densify(model).save_pretrained(tmp_path)
    loaded = BertForMaskedLM.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(input_ids=x).logits, ref)
    w = loaded.bert.encoder.layer[0].intermediate.dense.weight
    assert (w == 0).float().mean().item() == pytest.approx(0.75, abs=0.01)
