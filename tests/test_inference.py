"""Sparse inference modules, conversion, and the two checkpoint formats (HF with zeros, compressed).

Models are tiny and built from configs with random weights (nothing is downloaded), magnitude-pruned to 80%.
"""
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparsetrain.inference import (
    SparseInferenceLinear,
    checkpoint,
    export_hf,
    load_sparse,
    save_sparse,
    to_dense_linears,
    to_inference,
)
from sparsetrain.inference import linear as inference_linear
from sparsetrain.kernels.spmm import BREAK_EVEN_SPARSITY


def _prune_(linear: nn.Linear, sparsity: float) -> None:
    with torch.no_grad():
        w = linear.weight
        k = int(sparsity * w.numel())
        if k:
            threshold = w.abs().flatten().kthvalue(k).values
            w[w.abs() <= threshold] = 0


def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval()
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("model.layers"):
            _prune_(module, 0.8)
    return model


def test_from_linear_keeps_dense_below_break_even_and_compresses_above(monkeypatch):
    lin = nn.Linear(64, 32)
    _prune_(lin, 0.3)
    x = torch.randn(5, 64)
    dense_layer = SparseInferenceLinear.from_linear(lin, min_sparsity=0.0)
    assert not dense_layer.is_compressed  # 30% < BREAK_EVEN_SPARSITY: cuBLAS is faster
    assert 0.3 < BREAK_EVEN_SPARSITY
    assert torch.equal(dense_layer(x), F.linear(x, lin.weight, lin.bias))
    _prune_(lin, 0.9)
    monkeypatch.setattr(inference_linear, "BREAK_EVEN_SPARSITY", 0.85)  # dispatch follows the measured constant
    assert SparseInferenceLinear.from_linear(lin).is_compressed
    monkeypatch.setattr(inference_linear, "BREAK_EVEN_SPARSITY", 0.95)
    assert not SparseInferenceLinear.from_linear(lin).is_compressed
    assert not SparseInferenceLinear.from_linear(lin, mode="dense").is_compressed
    sparse_layer = SparseInferenceLinear.from_linear(lin, mode="compressed")
    assert sparse_layer.is_compressed
    torch.testing.assert_close(sparse_layer(x), lin(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(sparse_layer.to_linear().weight, lin.weight)
    with pytest.raises(TypeError, match="nn.Linear"):
        SparseInferenceLinear.from_linear(nn.Conv1d(2, 2, 1))
    with pytest.raises(ValueError, match="min_sparsity"):
        SparseInferenceLinear.from_linear(lin, min_sparsity=1.5)
    with pytest.raises(ValueError, match="mode"):
        SparseInferenceLinear.from_linear(lin, mode="fast")


def test_to_inference_respects_sparsity_and_targets():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 16))
    _prune_(model[0], 0.9)
    _prune_(model[2], 0.9)
    _prune_(model[3], 0.2)  # below min_sparsity: untouched
    x = torch.randn(3, 64)
    expected = model(x)
    model, swaps = to_inference(model, min_sparsity=0.5, targets=["0", "3"], mode="compressed")
    assert [s.name for s in swaps] == ["0"]
    assert isinstance(model[0], SparseInferenceLinear) and type(model[2]) is nn.Linear
    assert swaps[0].compressed and swaps[0].stored_bytes < swaps[0].dense_bytes
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="glob"):
        to_inference(model, targets="0")
    to_dense_linears(model)
    assert type(model[0]) is nn.Linear
    torch.testing.assert_close(model(x), expected, rtol=1e-6, atol=1e-6)


def test_sparse_model_matches_dense_twin():
    model = _tiny_llama()
    ids = torch.randint(0, 96, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits
        model, swaps = to_inference(model, mode="compressed")
        assert len(swaps) == 2 * 7 and all(s.compressed for s in swaps)
        got = model(ids).logits  # 14 tokens per call: the compressed kernel (interpreter here)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_export_hf_round_trip_is_identical(tmp_path):
    from transformers import LlamaForCausalLM

    model = _tiny_llama()
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        expected = model(ids).logits
    export_hf(model, str(tmp_path))
    reloaded = LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)
    # a model already converted for inference exports its dense weights (zeros included)
    to_inference(model, mode="compressed")
    export_hf(model, str(tmp_path / "again"))
    again = LlamaForCausalLM.from_pretrained(str(tmp_path / "again")).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, expected)


def test_save_load_sparse_round_trip(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = _tiny_llama()
    ids = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        expected = model(ids).logits
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    swaps = save_sparse(model, str(tmp_path))
    assert len(swaps) == 14
    assert os.path.exists(tmp_path / "config.json")
    assert os.path.getsize(tmp_path / checkpoint.TENSORS_FILE) < dense_bytes
    config = LlamaConfig.from_pretrained(str(tmp_path))
    loaded = load_sparse(lambda: LlamaForCausalLM(config).eval(), str(tmp_path))
    assert sum(isinstance(m, SparseInferenceLinear) for m in loaded.modules()) == 14
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_save_load_sparse_plain_module_with_tied_weights(tmp_path):
    model = nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 64), nn.Linear(64, 10, bias=False))
    _prune_(model[1], 0.85)
    model[2].weight = model[0].weight  # tied, dense
    x = torch.randint(0, 10, (4,))
    expected = model(x)
    save_sparse(model, str(tmp_path))
    def factory():
        return nn.Sequential(nn.Embedding(10, 64), nn.Linear(64, 64), nn.Linear(64, 10, bias=False))

    loaded = load_sparse(factory, str(tmp_path))
    assert isinstance(loaded[1], SparseInferenceLinear)
    assert torch.equal(loaded[2].weight, loaded[0].weight)
    torch.testing.assert_close(loaded(x), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_gpu_sparse_llama_matches_dense_fp16():
    model = _tiny_llama().half().cuda()
    ids = torch.randint(0, 96, (4, 5), device="cuda")
    with torch.no_grad():
        expected = model(ids).logits.float()
        to_inference(model, mode="compressed")
        got = model(ids).logits.float()
    assert float((got - expected).norm() / expected.norm()) < 5e-3


def test_save_load_sparse_mixes_bitmap_and_csl_layers(tmp_path):
    import json

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128))
    _prune_(model[0], 0.95)  # CSL stores fewer bytes
    _prune_(model[2], 0.5)   # the bitmap stores fewer bytes
    x = torch.randn(3, 64)
    expected = model(x)
    w0 = model[0].weight.detach().clone()
    save_sparse(model, str(tmp_path))  # converts model's layers in place
    with open(tmp_path / checkpoint.INDEX_FILE) as f:
        layers = json.load(f)["layers"]
    assert {name: info["fmt"] for name, info in layers.items()} == {"0": "csl", "2": "bitmap"}
    loaded = load_sparse(lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128)), str(tmp_path))
    assert loaded[0].fmt == "csl" and loaded[2].fmt == "bitmap"
    torch.testing.assert_close(loaded(x), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(loaded[0].to_linear().weight, w0)


def test_save_load_sparse_pair_format(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96))
    _prune_(model[0], 0.9)
    _prune_(model[2], 0.7)
    x = torch.randn(3, 64)
    expected = model(x)
    w2 = model[2].weight.detach().clone()
    save_sparse(model, str(tmp_path), fmt="pair")
    assert model[0].fmt == model[2].fmt == "pair"
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)
    loaded = load_sparse(lambda: nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 96)), str(tmp_path))
    assert loaded[0].fmt == loaded[2].fmt == "pair"
    torch.testing.assert_close(loaded(x), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(loaded[2].to_linear().weight, w2)


def test_layer_forward_does_not_recompute_tile_lengths(monkeypatch):
    """The CUDA kernels need the longest tile's length; a layer computes it once, not per call (a per-call
    device sync would also break CUDA-graph capture)."""
    from sparsetrain.kernels.spmm import _launch

    lin = nn.Linear(64, 128)
    _prune_(lin, 0.9)
    layer = SparseInferenceLinear.from_linear(lin, mode="compressed")
    expected = layer._max_tile_len
    calls = []
    monkeypatch.setattr(_launch, "max_tile_len", lambda w: calls.append(1) or 0)
    w = layer.compressed_weight()
    assert w._max_tile_len == expected > 0 and not calls
    tiles = w.tile_offsets.reshape(-1).tolist() + [w.values.numel()]
    assert expected == max(b - a for a, b in zip(tiles, tiles[1:]))


def test_load_state_dict_refreshes_the_longest_tile():
    a, b = nn.Linear(64, 256), nn.Linear(64, 256)  # two 128-row tiles
    _prune_(a, 0.9)
    _prune_(b, 0.9)
    with torch.no_grad():  # b: all its nonzeros in the first tile rows, same count as a
        flat = b.weight.flatten()
        nz = int((a.weight != 0).sum())
        flat.zero_()
        flat[:nz] = 1.0
    la = SparseInferenceLinear.from_linear(a, mode="compressed", fmt="csl")
    lb = SparseInferenceLinear.from_linear(b, mode="compressed", fmt="csl")
    assert la._max_tile_len != lb._max_tile_len
    la.load_state_dict(lb.state_dict())
    assert la._max_tile_len == lb._max_tile_len
    x = torch.randn(3, 64)
    torch.testing.assert_close(la(x), lb(x))
