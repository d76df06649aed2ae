"""model.fused_qkv: one query/key/value projection computes what the three did (outputs and gradients), loads the
separate weights, converts back for exports, and is one layer to sparsify."""
import copy

import pytest
import torch
from torch import nn

from sparsetrain.models.builders import build_model
from sparsetrain.models.fused_qkv import fuse_qkv, unfuse_qkv


def _bert(attn="eager", **kw):
    torch.manual_seed(0)
    return build_model("bert", "tiny", vocab_size=100, seq_len=16, attn_implementation=attn, **kw).float()


def _vit(attn="eager", **kw):
    torch.manual_seed(0)
    return build_model("vit", "tiny", image_size=32, patch_size=16, num_labels=10, attn_implementation=attn, **kw)


def _inputs(arch):
    torch.manual_seed(1)
    if arch == "bert":
        ids = torch.randint(5, 100, (3, 16))
        return dict(input_ids=ids, labels=ids)
    return dict(pixel_values=torch.randn(3, 3, 32, 32), labels=torch.randint(0, 10, (3,)))


def _qkv_names(model):
    return [n for n, m in model.named_modules() if n.endswith(".qkv") and type(m) is nn.Linear]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["bert", "vit"])
def test_fused_model_computes_what_the_separate_projections_did(arch, attn):
    plain = (_bert if arch == "bert" else _vit)(attn).eval()
    fused = fuse_qkv(copy.deepcopy(plain))
    names = _qkv_names(fused)
    assert len(names) == plain.config.num_hidden_layers
    assert not any(n.endswith((".query", ".key", ".value", ".q_proj", ".k_proj", ".v_proj"))
                   for n, _ in fused.named_modules())
    batch = _inputs(arch)
    out_p, out_f = plain(**batch), fused(**batch)
    assert torch.allclose(out_p.logits, out_f.logits, atol=1e-5)
    out_p.loss.backward()
    out_f.loss.backward()
    # the fused weight's gradient is the three gradients stacked
    fmods, pmods = dict(fused.named_modules()), dict(plain.named_modules())
    for name in names:
        parent = pmods[name.rsplit(".", 1)[0]]
        parts = [getattr(parent, n) for n in (("query", "key", "value") if arch == "bert" else ("q_proj", "k_proj",
                                                                                               "v_proj"))]
        expected = torch.cat([p.weight.grad for p in parts])
        assert torch.allclose(fmods[name].weight.grad, expected, atol=1e-5)
        assert torch.allclose(fmods[name].bias.grad, torch.cat([p.bias.grad for p in parts]), atol=1e-5)


@pytest.mark.parametrize("arch", ["bert", "vit"])
def test_built_fused_loads_separate_weights_and_converts_back(arch):
    build = _bert if arch == "bert" else _vit
    plain, fused = build().eval(), build(fused_qkv=True).eval()
    assert _qkv_names(fused) and not _qkv_names(plain)
    missing, unexpected = fused.load_state_dict(plain.state_dict())   # separate entries become qkv
    assert not missing and not unexpected
    batch = _inputs(arch)
    assert torch.allclose(plain(**batch).logits, fused(**batch).logits, atol=1e-5)
    back = unfuse_qkv(fused)
    assert type(back) is type(plain)
    assert {type(m) for m in back.modules()} == {type(m) for m in plain.modules()}
    state = back.state_dict()
    assert list(state) == list(plain.state_dict())
    assert all(torch.equal(state[k], v) for k, v in plain.state_dict().items())
    back.load_state_dict(plain.state_dict())                           # the load hook went with the fusion
    assert unfuse_qkv(back) is back                                    # not fused: unchanged


def test_sparsify_sees_one_layer_per_fused_projection():
    from sparsetrain.nn.sparsify import sparsify

    model = _bert(fused_qkv=True)
    names = _qkv_names(model)
    layers = sparsify(model, targets=["*attention.self.*"], density=0.25, block=16)
    assert sorted(layers) == sorted(names) and len(names) == 2
    assert all((layer.out_features, layer.in_features, tuple(layer.mask.shape)) == (384, 128, (24, 8))
               for layer in layers.values())
    batch = _inputs("bert")
    model(**batch).loss.backward()


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_fused_qkv_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="fused_qkv"):
        build_model("bert", "tiny", vocab_size=100, seq_len=16, fused_qkv=bad)


def test_fused_qkv_config_key_is_checked_before_anything_is_built():
    from sparsetrain.config import ConfigError, compose, validate

    cfg = compose(["recipe=quickstart", "model.fused_qkv=maybe"])
    with pytest.raises(ConfigError, match="model.fused_qkv"):
        validate(cfg)


def test_a_model_without_bert_or_vit_attention_is_refused():
    with pytest.raises(ValueError, match="model.fused_qkv"):
        fuse_qkv(nn.Sequential(nn.Linear(4, 4)))


def test_a_local_pretrained_bert_is_fused_and_its_skeleton_too(tmp_path):
    """arch=hf: a saved BERT loads fused (same logits) and its meta skeleton has the qkv names the sparsity layout is
    checked against; a model type that cannot be fused is refused before any weight is read, naming the key."""
    from transformers import GPT2Config

    from sparsetrain.models.builders import build_skeleton, check_model_args
    from sparsetrain.models.mlm import to_masked_lm

    plain = to_masked_lm(_bert().eval())
    plain.save_pretrained(tmp_path / "bert")
    fused = build_model("hf", name_or_path=str(tmp_path / "bert"), fused_qkv=True).float().eval()
    ids = torch.randint(5, 100, (2, 16))
    with torch.no_grad():
        assert torch.allclose(fused(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5)
    skeleton = build_skeleton("hf", name_or_path=str(tmp_path / "bert"), fused_qkv=True)
    assert _qkv_names(skeleton) == _qkv_names(fused) and _qkv_names(fused)
    GPT2Config(n_layer=1, n_embd=16, n_head=2).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"")   # never read: the type is refused first
    with pytest.raises(ValueError, match="^fused_qkv: .*'gpt2'"):
        check_model_args("hf", name_or_path=str(tmp_path / "gpt2"), fused_qkv=True)


@pytest.mark.parametrize("arch", ["bert", "vit"])
def test_block_sparse_fused_projection_in_parts_matches_the_split_output(arch, monkeypatch):
    """A 64x64 block-sparse fused projection on the kernels (the Triton interpreter here) writes q, k and v as
    tensors of their own and its backward reads their gradients in place (sparsetrain.nn.parts): the model's loss
    and every gradient equal those of the same model with the output split (parts_native off)."""
    from sparsetrain.kernels.blocksparse import parts as bs_parts
    from sparsetrain.nn import parts
    from sparsetrain.nn.sparsify import sparsify

    calls = []
    real = parts.block_sparse_linear_parts
    monkeypatch.setattr(parts, "block_sparse_linear_parts", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run(native: bool):
        model = (_bert if arch == "bert" else _vit)("sdpa", fused_qkv=True).train()
        for m in model.modules():   # dropout off: the two runs must see the same masks
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        sparsify(model, targets=["*qkv"], density=0.5, block=64, format="block", seed=0)
        monkeypatch.setattr(bs_parts, "parts_native", lambda meta: native)
        out = model(**_inputs(arch))
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_s, grads_s = run(False)
    assert not calls
    loss_p, grads_p = run(True)
    assert len(calls) == (2 if arch == "bert" else 12)     # every fused projection took the parts path
    torch.testing.assert_close(loss_p, loss_s)
    assert grads_p.keys() == grads_s.keys() and any(n.endswith("qkv.values") for n in grads_p)
    for n in grads_s:
        torch.testing.assert_close(grads_p[n], grads_s[n], rtol=1e-4, atol=1e-5)
