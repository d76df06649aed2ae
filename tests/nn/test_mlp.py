"""gelu_mlp (sparsetrain.nn.mlp): with trainer.kernels.gelu_recompute, a feed-forward block whose two linears are
block-sparse keeps only GELU's input and recomputes GELU in the backward (the Triton interpreter here), with the
plain modules' output and gradients, eager and compiled; anything else runs the plain modules. The BERT and ViT
models built here use it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsetrain.kernels._runtime.options import use_kernel_options
from sparsetrain.nn import SparseLinear
from sparsetrain.nn.mlp import fusable, gelu_mlp


@pytest.fixture(autouse=True)
def _recompute_on():
    with use_kernel_options(gelu_recompute=True):
        yield


def _pair(block=16, density=0.5, dtype=torch.float32):
    fc1 = SparseLinear.from_dense(torch.nn.Linear(64, 128), density=density, block=block, format="block")
    fc2 = SparseLinear.from_dense(torch.nn.Linear(128, 64), density=density, block=block, format="block")
    return fc1.to(dtype), fc2.to(dtype)


def _grads(fn, x, mods, g):
    for m in mods:
        m.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    (y * g).sum().backward()
    return [y.detach(), x.grad] + [p.grad for m in mods for p in m.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", [16, 32])
def test_fused_block_matches_the_plain_modules(dtype, block):
    fc1, fc2 = _pair(block, dtype=dtype)
    x, g = torch.randn(3, 11, 64).to(dtype), torch.randn(3, 11, 64).to(dtype)
    assert fusable(x, fc1, fc2)
    calls = []
    from sparsetrain.kernels.blocksparse import gelu as ops
    real = ops.block_sparse_gelu_linear
    ops.block_sparse_gelu_linear = lambda *a: calls.append(1) or real(*a)
    try:
        got = _grads(lambda t: gelu_mlp(t, fc1, fc2), x, (fc1, fc2), g)
    finally:
        ops.block_sparse_gelu_linear = real
    assert calls, "the fused ops did not run"
    want = _grads(lambda t: fc2(F.gelu(fc1(t))), x, (fc1, fc2), g)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)


def test_fused_block_under_torch_compile():
    """Compiled: the graph calls the two fused ops (forward) and the fused backward op; same gradients as eager
    plain modules."""
    import re

    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    fc1, fc2 = _pair()
    ln = torch.nn.LayerNorm(64)
    x, g = torch.randn(2, 9, 64), torch.randn(2, 9, 64)
    mods = (fc1, fc2, ln)
    want = _grads(lambda t: ln(t + fc2(F.gelu(fc1(t)))), x, mods, g)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: ln(t + gelu_mlp(t, fc1, fc2)))
    from torch._inductor import config as inductor_config
    with inductor_config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(lambda: _grads(compiled, x, mods, g))
    ops = {op for c in codes for op in re.findall(r"sparsetrain\.(\w+)\.default", c)}
    assert {"block_sparse_linear_gelu", "block_sparse_gelu_linear", "block_sparse_gelu_linear_backward"} <= ops
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_compiled_block_follows_a_mask_update_without_recompiling():
    """A mask update (set_mask: same block count, new topology, rewritten in place) reaches the compiled fused
    ops: the next step computes the new topology's block, with no new graph."""
    import torch._dynamo

    torch._dynamo.reset()
    fc1, fc2 = _pair()
    opt = torch.optim.SGD([*fc1.parameters(), *fc2.parameters()], lr=0.1)
    x = torch.randn(2, 9, 64)
    compiled = torch.compile(lambda t: gelu_mlp(t, fc1, fc2))
    _grads(compiled, x, (fc1, fc2), torch.ones(2, 9, 64))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for layer in (fc1, fc2):
        flat = layer.mask.clone().flatten()
        flat[flat.nonzero()[0]] = False  # move one block
        flat[(~flat).nonzero()[-1]] = True
        layer.set_mask(flat.view(layer.mask.shape), opt)
    got = _grads(compiled, x, (fc1, fc2), torch.ones(2, 9, 64))
    want = _grads(lambda t: fc2(F.gelu(fc1(t))), x, (fc1, fc2), torch.ones(2, 9, 64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


def test_not_fused_where_it_cannot_be():
    fc1, fc2 = _pair()
    x = torch.randn(4, 64)
    dense1 = torch.nn.Linear(64, 128)
    masked = SparseLinear.from_dense(torch.nn.Linear(128, 64), density=0.5, block=16, format="masked")
    assert not fusable(x, dense1, fc2) and not fusable(x, fc1, masked)
    assert not fusable(torch.randn(4, 32), fc1, fc2)                 # wrong width
    assert not fusable(torch.randn(0, 64), fc1, fc2)                 # no tokens
    with use_kernel_options(gelu_recompute=False):
        assert not fusable(x, fc1, fc2)
    fc2.capture_dense_grad = True                                     # a RigL step: the hook path, unfused
    assert not fusable(x, fc1, fc2)
    fc2.capture_dense_grad = False
    handle = fc1.register_forward_hook(lambda *a: None)               # a hook must see the module's call
    assert not fusable(x, fc1, fc2)
    handle.remove()
    assert fusable(x, fc1, fc2)
    # a block size off the kernels (the plain-torch reference path)
    s1, s2 = _pair(block=8)
    assert not fusable(x, s1, s2)
    for a, b in ((dense1, masked), (fc1, fc2)):
        out = gelu_mlp(x, a, b)
        torch.testing.assert_close(out, b(F.gelu(a(x))), rtol=1e-5, atol=1e-5)


def test_models_use_it_and_compute_the_same(monkeypatch):
    """BERT and ViT built here carry the gelu_mlp feed-forward, with transformers' state-dict keys; a sparsified
    tiny BERT runs the fused ops in each layer and gives the loss and gradients it gives with the fusion off."""
    from transformers import ViTForImageClassification

    from sparsetrain.kernels.blocksparse import gelu as ops
    from sparsetrain.models import build_model
    from sparsetrain.models.builders import build_config
    from sparsetrain.models.ffn import BertLayerGeluMLP, ViTMLPGelu
    from sparsetrain.models.mlm import BertForMaskedPositionsLM
    from sparsetrain.nn.sparsify import sparsify

    vit = build_model("vit", "tiny", image_size=32, patch_size=8, num_labels=3)
    assert sum(type(m) is ViTMLPGelu for m in vit.modules()) == vit.config.num_hidden_layers
    plain_vit = ViTForImageClassification(build_config("vit", "tiny", image_size=32, patch_size=8, num_labels=3))
    assert list(vit.state_dict()) == list(plain_vit.state_dict())
    torch.manual_seed(0)
    # one layer: the fused ops run in the Triton interpreter here, ~10 s a layer
    model = build_model("bert", "tiny", vocab_size=300, seq_len=16, num_hidden_layers=1)
    assert sum(type(m) is BertLayerGeluMLP for m in model.modules()) == model.config.num_hidden_layers == 1
    plain = BertForMaskedPositionsLM(build_config("bert", "tiny", vocab_size=300, seq_len=16, num_hidden_layers=1))
    assert list(model.state_dict()) == list(plain.state_dict())
    sparsify(model, targets=["*encoder*"], density=0.5, block=16, format="block")
    model.eval()  # no dropout: the two runs compute the same function
    ids = torch.randint(5, 300, (2, 16))
    calls = []
    real = ops.block_sparse_linear_gelu
    monkeypatch.setattr(ops, "block_sparse_linear_gelu", lambda *a: calls.append(1) or real(*a))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        return [out.loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    fused = run()
    assert len(calls) == model.config.num_hidden_layers
    with use_kernel_options(gelu_recompute=False):
        unfused = run()
    assert len(calls) == model.config.num_hidden_layers
    assert len(fused) == len(unfused) > 1
    for a, b in zip(fused, unfused):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [16, 64])
def test_gpu_fused_block_matches_the_plain_modules_bf16(block):
    """On the GPU (CUDA or Triton kernels as tuned), bf16 activations under autocast with fp32 master weights:
    the fused block against the plain modules at BERT-base's FFN widths."""
    torch.manual_seed(0)
    fc1 = SparseLinear.from_dense(torch.nn.Linear(768, 3072), density=0.1, block=block, format="block").cuda()
    fc2 = SparseLinear.from_dense(torch.nn.Linear(3072, 768), density=0.1, block=block, format="block").cuda()
    x, g = torch.randn(4, 300, 768, device="cuda"), torch.randn(4, 300, 768, device="cuda")

    def run(fn):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return _grads(fn, x, (fc1, fc2), g)

    assert fusable(x.bfloat16(), fc1, fc2)
    got = run(lambda t: gelu_mlp(t, fc1, fc2))
    want = run(lambda t: fc2(F.gelu(fc1(t))))
    for a, b in zip(got, want):
        assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2
