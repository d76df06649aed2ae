"""RigL's dense weight gradient as a probe's gradient (``kernels/blocksparse/probe.py``): the numbers of the Python
hook path, over micro-batches, on the kernels and on the plain-torch reference, and through ``torch.compile`` in
one graph (the custom op), where the hook breaks the graph."""
from __future__ import annotations

import pytest
import torch

from sparsetrain.nn import SparseLinear
from sparsetrain.sparsity.layout import Block, to_element_mask


def _layer(block: int, seed: int = 0, device: str = "cpu") -> SparseLinear:
    torch.manual_seed(seed)
    lin = torch.nn.Linear(64, 96)
    with torch.no_grad():
        lin.bias.normal_()
    return SparseLinear.from_dense(lin, density=0.5, block=block, format="block",
                                   generator=torch.Generator().manual_seed(seed)).to(device)


def _backward(layer: SparseLinear, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One backward per micro-batch (a random output gradient each); returns the inputs' gradients."""
    grads = []
    for x, dy in xs:
        x = x.clone().requires_grad_()
        layer(x).backward(dy)
        grads.append(x.grad)
    return grads


@pytest.mark.parametrize("block", [16, 32, 4])   # the kernels (interpreted on a CPU), the reference (block 4)
def test_probe_gets_the_hooks_dense_gradient(block):
    hooked, probed = _layer(block), _layer(block)
    hooked.capture_dense_grad = True                 # no probe: the format's Python hook fills dense_grad
    probed.arm_dense_grad(True)
    assert hooked.grad_probe is None and probed.grad_probe is not None
    assert probed.grad_probe.untyped_storage().nbytes() == 4 and probed.grad_probe.shape == (96, 64)
    xs = [(torch.randn(3, 7, 64), torch.randn(3, 7, 96)) for _ in range(2)]   # two micro-batches accumulate
    dx_h, dx_p = _backward(hooked, xs), _backward(probed, xs)
    dense = probed.dense_gradient()
    assert probed.dense_grad is None and dense is probed.grad_probe.grad and dense.dtype == torch.float32
    assert torch.equal(dense, hooked.dense_gradient())
    for a, b in [(probed.values.grad, hooked.values.grad), (probed.bias.grad, hooked.bias.grad), *zip(dx_p, dx_h)]:
        assert torch.equal(a, b)
    # against the closed form, summed over the micro-batches: dense everywhere, inside the mask or not
    want = sum(dy.reshape(-1, 96).t().double() @ x.reshape(-1, 64).double() for x, dy in xs)
    torch.testing.assert_close(dense.double(), want, rtol=1e-4, atol=1e-4)
    assert dense[~to_element_mask(probed.mask, Block(block, block))].abs().sum() > 0
    probed.arm_dense_grad(False)
    assert not probed.capture_dense_grad and probed.dense_gradient() is None and probed.grad_probe.grad is None


def test_the_masked_format_takes_no_probe():
    layer = SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=16, format="masked")
    layer.arm_dense_grad(True)
    assert layer.grad_probe is None
    layer(torch.randn(5, 64)).sum().backward()
    assert layer.dense_gradient() is layer.dense_grad and layer.dense_grad.shape == (96, 64)
    layer.drop_dense_grad()
    assert layer.dense_gradient() is None


def test_a_probe_follows_the_layer_to_another_device():
    layer = _layer(16)
    layer.arm_dense_grad(True)
    first = layer.grad_probe
    layer.arm_dense_grad(True)
    assert layer.grad_probe is first                 # kept while the layer stays where it is
    layer.grad_probe = torch.zeros(96, 64, device="meta", requires_grad=True)   # left behind by a move
    layer.arm_dense_grad(True)
    assert layer.grad_probe.device == layer.mask.device and layer.grad_probe is not first


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_probe_through_torch_compile_in_one_graph_equals_eager(device):
    """The compiled layer with a probe has no graph break (``fullgraph=True``: the custom op), and gives eager's
    dense gradient and block gradients; with the probe off it goes back to the plain op."""
    import torch._dynamo

    torch._dynamo.reset()
    layer = _layer(16, device=device)
    x = torch.randn(20, 64, device=device)
    layer.arm_dense_grad(True)
    layer(x).square().sum().backward()
    want_dense, want_values = layer.dense_gradient().clone(), layer.values.grad.clone()
    layer.drop_dense_grad()
    layer.values.grad = layer.bias.grad = None
    compiled = torch.compile(layer, fullgraph=True)
    compiled(x).square().sum().backward()
    tol = 1e-5 if device == "cpu" else 1e-3
    torch.testing.assert_close(layer.dense_gradient(), want_dense, rtol=tol, atol=tol)
    torch.testing.assert_close(layer.values.grad, want_values, rtol=tol, atol=tol)
    layer.arm_dense_grad(False)
    layer.values.grad = None
    compiled(x).square().sum().backward()
    assert layer.dense_gradient() is None and layer.grad_probe.grad is None and layer.values.grad is not None
    torch._dynamo.reset()
