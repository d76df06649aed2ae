"""gelu_mlp (sparsetrain.nn.mlp) on RigL's grow step: with both linears armed for the dense weight gradient through
their probes, the fused feed-forward block (GELU recomputed in the backward; the Triton interpreter here) takes the
probed fused ops and gives the plain modules' output, gradients and dense weight gradients, eager and compiled; a
capture without a probe (the Python hook path) still runs the plain modules."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sparsetrain.kernels._runtime.options import use_kernel_options
from sparsetrain.kernels.blocksparse import gelu as ops
from sparsetrain.nn import SparseLinear
from sparsetrain.nn.mlp import fusable, gelu_mlp


@pytest.fixture(autouse=True)
def _recompute_on():
    with use_kernel_options(gelu_recompute=True):
        yield


def _armed_pair(block=16, dtype=torch.float32):
    fc1 = SparseLinear.from_dense(torch.nn.Linear(64, 128), density=0.5, block=block, format="block").to(dtype)
    fc2 = SparseLinear.from_dense(torch.nn.Linear(128, 64), density=0.5, block=block, format="block").to(dtype)
    for m in (fc1, fc2):
        m.arm_dense_grad(True)
    return fc1, fc2


def _grads(fn, batches, mods):
    """Output of the last micro-batch, the inputs' gradients, the parameters' gradients and each layer's dense
    weight gradient, accumulated over ``batches`` (pairs of input and output gradient)."""
    for m in mods:
        m.zero_grad(set_to_none=True)
        if isinstance(m, SparseLinear):
            m.drop_dense_grad()
    out = []
    for x, g in batches:
        x = x.detach().clone().requires_grad_()
        y = fn(x)
        (y * g).sum().backward()
        out.append(x.grad)
    dense = [m.dense_gradient().clone() for m in mods if isinstance(m, SparseLinear)]
    return [y.detach(), *out] + [p.grad.clone() for m in mods for p in m.parameters()] + dense


@pytest.fixture
def probed_calls(monkeypatch):
    """Whether each call of the fused ops (first and second linear) got a probe."""
    calls = []
    for name in ("block_sparse_linear_gelu", "block_sparse_gelu_linear"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name: calls.append((name, a[-1] is not None))
                            or real(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block", [16, 32])
def test_probed_fused_block_matches_the_plain_modules(dtype, block, probed_calls):
    fc1, fc2 = _armed_pair(block, dtype)
    batches = [(torch.randn(3, 11, 64).to(dtype), torch.randn(3, 11, 64).to(dtype)) for _ in range(2)]
    assert fusable(batches[0][0], fc1, fc2)
    got = _grads(lambda t: gelu_mlp(t, fc1, fc2), batches, (fc1, fc2))
    assert probed_calls == [("block_sparse_linear_gelu", True), ("block_sparse_gelu_linear", True)] * 2
    # the plain modules: each layer on the single-layer probed path (probe.py)
    want = _grads(lambda t: fc2(F.gelu(fc1(t))), batches, (fc1, fc2))
    assert len(probed_calls) == 4
    assert got[-1].shape == (64, 128) and got[-2].shape == (128, 64) and got[-1].dtype == torch.float32
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == torch.float16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)
    if dtype == torch.float32:   # fc2's dense gradient in closed form: sum over micro-batches of dYᵀ·gelu(h)
        with torch.no_grad():
            h = [fc1(x) for x, _ in batches]
        closed = sum(g.reshape(-1, 64).t().double() @ F.gelu(hh).reshape(-1, 128).double()
                     for hh, (_, g) in zip(h, batches))
        torch.testing.assert_close(got[-1].double(), closed, rtol=1e-4, atol=1e-4)


def test_probed_fused_block_under_torch_compile():
    """Compiled in one graph: the probed fused ops forward and their backward ops; the plain modules' gradients and
    dense weight gradients (eager)."""
    import re

    import torch._dynamo
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    fc1, fc2 = _armed_pair()
    ln = torch.nn.LayerNorm(64)
    batches = [(torch.randn(2, 9, 64), torch.randn(2, 9, 64))]
    mods = (fc1, fc2, ln)
    want = _grads(lambda t: ln(t + fc2(F.gelu(fc1(t)))), batches, mods)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: ln(t + gelu_mlp(t, fc1, fc2)), fullgraph=True)
    with inductor_config.patch(force_disable_caches=True):
        got, codes = run_and_get_code(lambda: _grads(compiled, batches, mods))
    found = {op for c in codes for op in re.findall(r"sparsetrain\.(\w+)\.default", c)}
    assert {"block_sparse_linear_gelu_probed", "block_sparse_gelu_linear_probed",
            "block_sparse_gelu_linear_probed_backward", "block_sparse_linear_probed_backward"} <= found
    assert not found & {"block_sparse_linear_gelu", "block_sparse_gelu_linear", "block_sparse_gelu_linear_backward"}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_capture_without_a_probe_runs_the_plain_modules(probed_calls):
    """The hook path (capture_dense_grad without a probe) fills dense_grad from Python: the block is not fused.
    Neither is an armed block with grad off or values frozen (its forward captures nothing then)."""
    fc1, fc2 = _armed_pair()
    x = torch.randn(4, 64)
    fc2.grad_probe = None                                   # fc2 on the hook path
    assert not fusable(x, fc1, fc2)
    gelu_mlp(x, fc1, fc2).sum().backward()
    assert probed_calls == []
    assert fc2.dense_grad is not None and fc2.dense_gradient() is fc2.dense_grad
    assert fc1.dense_grad is None and fc1.dense_gradient() is fc1.grad_probe.grad   # its own probed path
    fc2.arm_dense_grad(True)
    assert fusable(x, fc1, fc2)
    with torch.no_grad():
        assert not fusable(x, fc1, fc2)
    fc1.values.requires_grad_(False)
    assert not fusable(x, fc1, fc2)
    fc1.values.requires_grad_(True)
    fc1.arm_dense_grad(False)                               # one armed, one not: fused, fc2 probed
    assert fusable(x, fc1, fc2)
    gelu_mlp(x, fc1, fc2).sum().backward()
    assert probed_calls == [("block_sparse_linear_gelu", False), ("block_sparse_gelu_linear", True)]
    assert fc2.dense_gradient() is not None and fc1.dense_gradient() is None


@pytest.mark.gpu
@pytest.mark.parametrize("block", [16, 64])
def test_gpu_probed_fused_block_matches_the_plain_modules_bf16(block):
    """On the GPU (the kernels as tuned), bf16 activations under autocast with fp32 master weights, BERT-base's FFN
    widths: the probed fused block against the plain modules, dense weight gradients included."""
    torch.manual_seed(0)
    fc1 = SparseLinear.from_dense(torch.nn.Linear(768, 3072), density=0.1, block=block, format="block").cuda()
    fc2 = SparseLinear.from_dense(torch.nn.Linear(3072, 768), density=0.1, block=block, format="block").cuda()
    for m in (fc1, fc2):
        m.arm_dense_grad(True)
    batches = [(torch.randn(4, 300, 768, device="cuda"), torch.randn(4, 300, 768, device="cuda"))]

    def run(fn):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return _grads(fn, batches, (fc1, fc2))

    assert fusable(batches[0][0].bfloat16(), fc1, fc2)
    got = run(lambda t: gelu_mlp(t, fc1, fc2))
    want = run(lambda t: fc2(F.gelu(fc1(t))))
    for a, b in zip(got, want, strict=True):
        assert (a.float() - b.float()).norm() / b.float().norm() < 2e-2
