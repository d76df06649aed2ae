"""``format="block"`` inside SparseLinear: same function as the masked format, compressed parameters and
optimizer state, state-dict round trips, topology changes that move values and Adam moments."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.reference import dense_to_values, values_to_dense
from sparsetrain.nn import SparseLinear
from sparsetrain.nn.formats import BlockFormat
from sparsetrain.sparsity.layout import Block, to_element_mask


def pair(block=16, density=0.5, in_f=64, out_f=96, seed=0):
    """A block-format layer and a masked-format layer with the same weight, mask and bias."""
    torch.manual_seed(seed)
    lin = torch.nn.Linear(in_f, out_f)
    with torch.no_grad():
        lin.bias.normal_()
    blk = SparseLinear.from_dense(lin, density=density, block=block, format="block",
                                  generator=torch.Generator().manual_seed(seed))
    msk = SparseLinear.from_dense(lin, mask=blk.mask.clone(), block=block, format="masked")
    return blk, msk


@pytest.mark.parametrize("block", [16, 32, 4, 1])
def test_same_outputs_and_grads_as_masked(block):
    blk, msk = pair(block=block)
    assert blk.values.shape == (blk.n_active, block, block)
    x = torch.randn(3, 13, 64)
    xb, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
    yb, ym = blk(xb), msk(xm)
    torch.testing.assert_close(yb, ym, rtol=1e-5, atol=1e-5)
    dy = torch.randn_like(yb)
    yb.backward(dy)
    ym.backward(dy)
    torch.testing.assert_close(xb.grad, xm.grad, rtol=1e-5, atol=1e-5)
    meta = BlockFormat.meta(blk)
    torch.testing.assert_close(blk.values.grad, dense_to_values(msk.weight.grad, meta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(blk.bias.grad, msk.bias.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(blk.dense_weight(), msk.dense_weight())


def test_state_dict_round_trip_between_formats():
    blk, msk = pair()
    sd = blk.state_dict()
    assert set(sd) == {"weight", "mask", "bias"} and sd["weight"].shape == (96, 64)
    fresh_masked = SparseLinear(64, 96, block=16, format="masked")
    fresh_masked.load_state_dict(sd)
    x = torch.randn(10, 64)
    torch.testing.assert_close(fresh_masked(x), blk(x), rtol=1e-5, atol=1e-5)
    # masked -> block, into a block layer of another topology but the same count: in place
    other = SparseLinear(64, 96, block=16, format="block",
                         mask=torch.flip(blk.mask, dims=(0,)).contiguous())
    p = other.values
    other.load_state_dict(msk.state_dict())
    assert other.values is p
    assert torch.equal(other.mask, msk.mask)
    torch.testing.assert_close(other(x), msk(x), rtol=1e-5, atol=1e-5)
    # a different active count: same Parameter object, resized
    dense_layer = SparseLinear(64, 96, block=16, format="block")
    q = dense_layer.values
    dense_layer.load_state_dict(sd)
    assert dense_layer.values is q and q.shape == (blk.n_active, 16, 16)
    torch.testing.assert_close(dense_layer(x), blk(x), rtol=1e-5, atol=1e-5)


def _block_of(layer, pos):
    r, c = pos
    b = layer.block.rows
    return layer.dense_weight()[r * b:(r + 1) * b, c * b:(c + 1) * b]


def test_set_mask_moves_values_and_adam_moments():
    blk, _ = pair(density=0.5)
    opt = torch.optim.AdamW(blk.parameters(), lr=1e-2)
    x = torch.randn(17, 64)
    for _ in range(2):
        blk(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    old_mask = blk.mask.clone()
    state = opt.state[blk.values]
    slot_old = {tuple(p): i for i, p in enumerate(old_mask.nonzero().tolist())}
    old_vals = blk.values.detach().clone()
    old_m1, old_m2 = state["exp_avg"].clone(), state["exp_avg_sq"].clone()
    # drop 3 active blocks, grow 3 inactive ones
    active, inactive = old_mask.nonzero().tolist(), (~old_mask).nonzero().tolist()
    new_mask = old_mask.clone()
    for r, c in active[:3]:
        new_mask[r, c] = False
    for r, c in inactive[-3:]:
        new_mask[r, c] = True
    param = blk.values
    blk.set_mask(new_mask, opt)
    assert blk.values is param and any(p is param for p in opt.param_groups[0]["params"])
    assert torch.equal(blk.mask, new_mask)
    slot_new = {tuple(p): i for i, p in enumerate(new_mask.nonzero().tolist())}
    moved = 0
    for pos, j in slot_new.items():
        if pos in slot_old:
            i = slot_old[pos]
            moved += i != j
            assert torch.equal(blk.values[j], old_vals[i])
            assert torch.equal(state["exp_avg"][j], old_m1[i])
            assert torch.equal(state["exp_avg_sq"][j], old_m2[i])
        else:
            assert not blk.values[j].any() and not state["exp_avg"][j].any() and not state["exp_avg_sq"][j].any()
    assert moved > 0  # the test really exercises slots that shift
    # the dense view puts survivors where they were and zeros at pruned positions
    for pos in [tuple(p) for p in active[:3]]:
        assert not _block_of(blk, pos).any()
    # training goes on with the same optimizer
    blk(x).square().mean().backward()
    opt.step()
    assert torch.isfinite(blk.values).all()


def test_set_mask_sgd_momentum_and_count_check():
    blk, _ = pair(density=0.25, block=1)
    opt = torch.optim.SGD(blk.parameters(), lr=0.1, momentum=0.9)
    blk(torch.randn(5, 64)).sum().backward()
    opt.step()
    buf = opt.state[blk.values]["momentum_buffer"]
    new_mask = torch.roll(blk.mask, shifts=1, dims=1)
    survivors = blk.mask & new_mask
    before = dict(zip(map(tuple, blk.mask.nonzero().tolist()), buf.clone()))
    blk.set_mask(new_mask, opt)
    for j, pos in enumerate(map(tuple, new_mask.nonzero().tolist())):
        expect = before[pos] if survivors[pos] else torch.zeros_like(buf[j])
        assert torch.equal(buf[j], expect)
    too_many = new_mask.clone()
    too_many[~new_mask] = True
    with pytest.raises(ValueError, match="active blocks"):
        blk.set_mask(too_many, opt)


def test_shrink_keeps_the_surviving_blocks_and_their_moments_and_refuses_the_rest():
    blk, msk = pair(density=0.5)
    opt = torch.optim.AdamW(blk.parameters(), lr=1e-2)
    blk(torch.randn(4, 64)).square().sum().backward()
    opt.step()
    active = blk.mask.nonzero().tolist()
    keep = torch.zeros_like(blk.mask)
    for r, c in active[::3]:                                   # every third active block survives
        keep[r, c] = True
    before = {tuple(p): (blk.values.detach()[j].clone(), opt.state[blk.values]["exp_avg"][j].clone())
              for j, p in enumerate(active)}
    values = blk.values
    with torch._dynamo.config.patch(force_parameter_static_shapes=True, force_nn_module_property_static_shapes=True):
        blk.shrink_to(keep, opt)   # (lets torch.compile treat the changing count as dynamic: undone here)
    assert blk.values is values and blk.n_active == int(keep.sum()) == blk.values.shape[0]
    for j, p in enumerate(keep.nonzero().tolist()):
        assert torch.equal(blk.values.detach()[j], before[tuple(p)][0])
        assert torch.equal(opt.state[blk.values]["exp_avg"][j], before[tuple(p)][1])
    assert opt.state[blk.values]["exp_avg_sq"].shape == blk.values.shape
    msk.set_mask(keep)
    with torch.no_grad():
        msk.weight.copy_(blk.dense_weight())
        msk.bias.copy_(blk.bias)
    x = torch.randn(5, 64)
    torch.testing.assert_close(blk(x), msk(x), rtol=1e-5, atol=1e-5)   # the rebuilt metadata computes it
    assert blk.values.grad.shape == blk.values.shape                    # the last gradient, gathered too
    opt.step()                                                          # the optimizer goes on at the new count
    outside = (~keep).nonzero()[0].tolist()
    bad = keep.clone()
    bad[outside[0], outside[1]] = True                                  # a block that is not active now
    with pytest.raises(ValueError, match="subset"):
        blk.shrink_to(bad, opt)
    with pytest.raises(ValueError, match="subset"):
        blk.shrink_to(torch.zeros_like(keep), opt)
    same = blk.mask.clone()
    blk.shrink_to(same, opt)                                            # the same count: a plain set_mask
    assert blk.n_active == int(keep.sum())


def test_dense_grad_capture_equals_dense_gradient():
    blk, msk = pair()
    x = torch.randn(2, 9, 64)
    for layer in (blk, msk):
        layer.capture_dense_grad = True
        for _ in range(2):  # accumulates across backward passes
            layer(x).square().sum().backward()
    assert blk.dense_grad.shape == (96, 64) and blk.dense_grad.dtype == torch.float32
    torch.testing.assert_close(blk.dense_grad, msk.dense_grad, rtol=1e-5, atol=1e-4)
    # it is dense: non-zero outside the mask as well
    outside = ~to_element_mask(blk.mask, Block(16, 16))
    assert blk.dense_grad[outside].abs().sum() > 0


def test_memory_is_compressed_and_format_switch():
    blk, _ = pair(density=0.25, in_f=128, out_f=128)
    n_dense = 128 * 128
    assert blk.values.numel() == blk.n_active * 256 == n_dense // 4
    opt = torch.optim.AdamW(blk.parameters())
    blk(torch.randn(4, 128)).sum().backward()
    opt.step()
    assert opt.state[blk.values]["exp_avg"].numel() == n_dense // 4
    x = torch.randn(6, 128)
    y = blk(x)
    blk.set_format("masked")
    torch.testing.assert_close(blk(x), y, rtol=1e-5, atol=1e-5)
    blk.set_format("block")
    torch.testing.assert_close(blk(x), y, rtol=1e-5, atol=1e-5)


def test_meta_follows_buffer_moves():
    blk, _ = pair()
    x = torch.randn(4, 64)
    y = blk(x)
    old = blk._bs_meta
    blk._apply(lambda t: t.clone())  # what .to(device) does to buffers: new tensors
    assert BlockFormat.meta(blk) is not old
    assert BlockFormat.meta(blk).row_ptr is blk._bs_row_ptr
    torch.testing.assert_close(blk(x), y)


def _compiled_matches_eager(device: str, dtype: torch.dtype, tol: float) -> None:
    import torch._dynamo

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 96).to(device)
    layer = SparseLinear.from_dense(lin, density=0.5, block=16, format="block").to(dtype)
    x = torch.randn(20, 64, device=device, dtype=dtype, requires_grad=True)
    layer(x).square().sum().backward()
    eager = [x.grad.clone(), layer.values.grad.clone(), layer.bias.grad.clone()]
    y_eager = layer(x).detach()
    x.grad = None
    layer.zero_grad()
    torch._dynamo.reset()
    explain = torch._dynamo.explain(layer)(x)
    assert explain.graph_break_count == 0
    assert "sparsetrain.block_sparse_linear" in explain.graphs[0].code  # the kernels, as an opaque op
    from sparsetrain.kernels.blocksparse import registry as blocksparse

    compiled = torch.compile(layer)
    builds = blocksparse.OP_META_BUILDS[0]
    y = compiled(x)
    y.square().sum().backward()
    torch.testing.assert_close(y, y_eager, rtol=tol, atol=tol)
    for got, want in zip([x.grad, layer.values.grad, layer.bias.grad], eager):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for _ in range(2):
        compiled(x).sum().backward()
    assert blocksparse.OP_META_BUILDS[0] == builds  # the op uses the layer's own metadata object and caches
    torch._dynamo.reset()


@pytest.mark.parametrize("split", [None, 2])
def test_torch_compile_runs_the_kernels_as_a_custom_op(split, monkeypatch):
    """torch.compile traces the block format without graph breaks: the Triton kernels (interpreted here)
    are the custom op sparsetrain::block_sparse_linear with a registered backward; results equal eager.
    split=2 forces the split token reduction, whose weight and bias gradients share one buffer."""
    from sparsetrain.kernels.blocksparse import gather as blocksparse

    if split is not None:
        monkeypatch.setattr(blocksparse, "_choose_split", lambda *args, **kwargs: split)
    _compiled_matches_eager("cpu", torch.float32, 1e-5)


def test_torch_compile_backward_reads_the_gradient_where_its_producer_wrote_it():
    """The compiled ops take x with its leading dimensions, so the backward op's dY is the gradient buffer as its
    producer writes it (LayerNorm backward -> dropout backward over [B, S, O]), not a [T, O] view of it, which
    inductor's default constraint for custom ops (exact strides) realized as a copy of its own: a pointwise node
    whose loops do not match the reduction's, which on a GPU stayed out of LayerNorm backward's kernel (one more
    read of the float32 gradient per LayerNorm, ~57 us at BERT-base's 32,768 x 768 on an H100). The dropout is a
    fixed mask here, so the gradients can be compared with eager."""
    import re

    import torch._dynamo
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = SparseLinear.from_dense(torch.nn.Linear(32, 64), density=0.5, block=16, format="block")
            self.ln = torch.nn.LayerNorm(64)

        def forward(self, x, res, keep):
            return self.ln(res + self.lin(x) * keep * (1 / 0.9))  # dropout's arithmetic, with a fixed mask

    torch.manual_seed(0)
    block = Block()
    x, res = torch.randn(4, 16, 32, requires_grad=True), torch.randn(4, 16, 64, requires_grad=True)
    keep, g = torch.rand(4, 16, 64) > 0.1, torch.randn(4, 16, 64)
    (block(x, res, keep) * g).sum().backward()
    eager = [t.grad.clone() for t in (x, res, block.lin.values, block.lin.bias)]
    for t in (x, res, block.lin.values, block.lin.bias):
        t.grad = None
    torch._dynamo.reset()
    compiled = torch.compile(block)
    with inductor_config.patch(force_disable_caches=True):  # a cached graph would skip the code capture
        _, codes = run_and_get_code(lambda: (compiled(x, res, keep) * g).sum().backward())
    calls = [c[c.index("def call(self, args)"):] for c in codes if "block_sparse_linear_backward.default(" in c]
    assert len(calls) == 1
    dy = re.search(r"block_sparse_linear_backward\.default\((\w+)", calls[0]).group(1)
    assert dy != "reinterpret_tensor", "dY reaches the op as a view"
    producer = re.search(rf"{dy} = empty_strided_cpu\(\(([0-9, ]+)\)", calls[0])
    assert producer is not None and producer.group(1) == "4, 16, 64"  # the [B, S, O] buffer the producer writes
    for got, want in zip([x.grad, res.grad, block.lin.values.grad, block.lin.bias.grad], eager):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_the_ops_take_leading_dimensions():
    """The custom ops keep x's leading dimensions: [B, S, I] -> [B, S, O]; the backward's dX has dY's."""
    torch.manual_seed(0)
    layer = SparseLinear.from_dense(torch.nn.Linear(32, 48), density=0.5, block=16, format="block")
    meta = BlockFormat.meta(layer)
    tensors = [getattr(meta, n) for n in BlockSparseMeta.TENSORS]
    x, dy = torch.randn(3, 5, 32), torch.randn(3, 5, 48)
    y = torch.ops.sparsetrain.block_sparse_linear(x, layer.values.detach(), layer.bias.detach(), *tensors, 48, 32,
                                                  16)
    w = layer.dense_weight()
    torch.testing.assert_close(y, x @ w.t() + layer.bias.detach(), rtol=1e-5, atol=1e-5)
    dx, dv, db = torch.ops.sparsetrain.block_sparse_linear_backward(dy, x, layer.values.detach(), *tensors, 48, 32,
                                                                    16, True, True, True)
    assert dx.shape == (3, 5, 32)
    torch.testing.assert_close(dx, dy @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(db, dy.sum((0, 1)), rtol=1e-5, atol=1e-5)


def test_the_ops_take_fp32_master_values_with_16_bit_activations():
    """Under autocast the compiled ops get fp32 values and 16-bit x: the products run on the values cast once per
    op; the value gradient comes back in float32."""
    torch.manual_seed(0)
    layer = SparseLinear.from_dense(torch.nn.Linear(32, 48), density=0.5, block=16, format="block")
    meta = BlockFormat.meta(layer)
    tensors = [getattr(meta, n) for n in BlockSparseMeta.TENSORS]
    x, dy = torch.randn(3, 5, 32).half(), torch.randn(3, 5, 48).half()
    values = layer.values.detach()
    assert values.dtype == torch.float32
    y = torch.ops.sparsetrain.block_sparse_linear(x, values, None, *tensors, 48, 32, 16)
    w = layer.dense_weight().half().float()
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), x.float() @ w.t(), rtol=2e-3, atol=2e-3)
    dx, dv, _ = torch.ops.sparsetrain.block_sparse_linear_backward(dy, x, values, *tensors, 48, 32, 16, True, True,
                                                                   False)
    torch.testing.assert_close(dx.float(), dy.float() @ w, rtol=2e-3, atol=2e-3)
    assert dv.dtype == torch.float32 and dv.shape == values.shape


def test_torch_compile_follows_a_topology_change_without_recompiling():
    import torch._dynamo

    from sparsetrain.kernels.blocksparse import registry as blocksparse

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=16, format="block")
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    compiled = torch.compile(layer)
    x = torch.randn(20, 64)
    compiled(x).sum().backward()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    flat = layer.mask.clone().flatten()
    flat[flat.nonzero()[0]] = False  # move one block: same count, new topology
    flat[(~flat).nonzero()[-1]] = True
    layer.set_mask(flat.view(layer.mask.shape), opt)
    builds = blocksparse.OP_META_BUILDS[0]
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
    assert blocksparse.OP_META_BUILDS[0] == builds  # the op found the meta set_mask installed (shared caches)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()


@pytest.mark.gpu
def test_gpu_torch_compile_block_format():
    _compiled_matches_eager("cuda", torch.bfloat16, 2e-2)


@pytest.mark.gpu
def test_gpu_block_format_matches_masked_under_autocast():
    blk, msk = pair(block=32, density=0.25, in_f=1024, out_f=512)
    blk.cuda()  # replaces the metadata buffers: the format re-wraps them
    msk.cuda()
    x = torch.randn(4, 300, 1024, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        yb, ym = blk(x), msk(x)
    assert yb.dtype == ym.dtype == torch.bfloat16
    dy = torch.randn_like(yb)
    yb.backward(dy)
    ym.backward(dy)

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(yb, ym) < 1e-2
    meta = BlockFormat.meta(blk)
    assert blk.values.grad.dtype == torch.float32
    assert rel(blk.values.grad, dense_to_values(msk.weight.grad, meta)) < 1e-2
    assert rel(blk.bias.grad, msk.bias.grad) < 1e-2


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_with_dense_gradient_capture(device):
    """RigL's capture steps (a Python hook in the backward) run that layer outside the graph; the captured
    dense gradient and the block gradients equal eager."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=16, format="block").to(device)
    x = torch.randn(20, 64, device=device)
    layer(x).square().sum().backward()  # eager, no capture: the sampled-gradient kernel
    want_plain = layer.values.grad.clone()
    layer.values.grad = None
    layer.capture_dense_grad = True
    layer(x).square().sum().backward()  # eager, capture: block gradient cut from the dense one
    want_dense, want_values = layer.dense_grad.clone(), layer.values.grad.clone()
    layer.dense_grad, layer.values.grad = None, None
    compiled = torch.compile(layer)
    compiled(x).square().sum().backward()
    tol = 1e-5 if device == "cpu" else 1e-3
    torch.testing.assert_close(layer.dense_grad, want_dense, rtol=tol, atol=tol)
    torch.testing.assert_close(layer.values.grad, want_values, rtol=tol, atol=tol)
    layer.capture_dense_grad = False  # back to the custom op (a second, cached graph)
    layer.values.grad = None
    compiled(x).square().sum().backward()
    torch.testing.assert_close(layer.values.grad, want_plain, rtol=tol, atol=tol)
    torch._dynamo.reset()


# ---- the eager fast path: a call signature checked once, its plans kept ------------------------------------
def _grads_vs_reference(layer, x, tol):
    """One forward+backward of ``layer`` on fresh ``x`` against float64 plain torch on its dense weight."""
    x = x.detach().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    meta = BlockFormat.meta(layer)
    w = layer.dense_weight().double().requires_grad_()
    b = layer.bias.detach().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    y64 = torch.nn.functional.linear(x64, w, b)
    y64.backward(dy.double())

    def rel(a, r):
        return ((a.double() - r).norm() / r.norm()).item()

    assert y.dtype == x.dtype and rel(y, y64) < tol and rel(x.grad, x64.grad) < tol
    assert rel(layer.values.grad, dense_to_values(w.grad, meta)) < tol and rel(layer.bias.grad, b.grad) < tol


def test_fast_call_is_kept_and_invalidated_when_it_must_be(monkeypatch):
    """A call signature seen before takes the fast path (no checks, plans kept on a FastCall); another token count
    or dtype, changed kernel options and a module move each take the checked path once; a new topology of the same
    count (set_mask) is written into the kept metadata in place, so the kept FastCall computes it. Every result
    matches the reference on fresh inputs."""
    from sparsetrain.kernels import use_kernel_options
    from sparsetrain.kernels.blocksparse import op, register_backend, tuner, unregister_backend
    from sparsetrain.kernels.blocksparse.testing import use_timer

    checked = []
    real = op._block_sparse_linear
    monkeypatch.setattr(op, "_block_sparse_linear", lambda *a: checked.append(a[0].shape) or real(*a))

    def calls(expect_checked):
        before = len(checked)
        _grads_vs_reference(layer, torch.randn(*shape, dtype=dtype), tol)
        assert len(checked) - before == expect_checked

    torch.manual_seed(0)
    layer = SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=16, format="block")
    shape, dtype, tol = (3, 13, 64), torch.float32, 1e-5
    calls(1)
    calls(0)  # the fast path
    kept = BlockFormat.meta(layer)._groups["calls"]
    assert len(kept) == 1 and next(iter(kept.values())).fwd is not None

    shape = (7, 64)  # another token count (and a 2-D input)
    calls(1)
    calls(0)

    flat = layer.mask.clone().flatten()  # a new topology, same count
    flat[flat.nonzero()[0]] = False
    flat[(~flat).nonzero()[-1]] = True
    layer.set_mask(flat.view(layer.mask.shape))
    calls(0)  # rewritten in place: the kept FastCall and its plans compute the new topology

    dtype, tol = torch.float16, 3e-3  # 16-bit activations, float32 values: another signature
    calls(1)
    calls(0)
    dtype, tol = torch.float32, 1e-5

    layer._apply(lambda t: t.clone())  # what .to(device) does: new parameter data, new index buffers
    calls(1)
    calls(0)
    layer.half()  # values and bias float16: another signature
    dtype, tol = torch.float16, 3e-3
    calls(1)
    calls(0)
    layer.float()  # back to a signature this topology has seen: its FastCall again, with the new values
    dtype, tol = torch.float32, 1e-5
    calls(0)

    # changed kernel options: a fallback backend that wins only at dense_margin=1.0 must then compute the layer
    ran = []

    class Plain(NamedTuple):
        pass

    def plan(cfg, p):
        def dds(a, values, bias, out):
            ran.append(p.kind)
            w = values_to_dense(values.to(a.dtype), p.meta)
            out.copy_(a @ w.t() + bias if p.kind == "fwd" and bias is not a else a @ (w.t() if p.forward else w))

        def dw(x, dy, dv, db):
            ran.append("dw")
            dv.copy_(dense_to_values(dy.t() @ x, p.meta))
            if p.bias:
                db.copy_(dy.sum(0))
        dw.atomic = False
        return dw if p.kind == "dw" else dds

    register_backend(tuner.Backend("plain", (Plain,), lambda p: [Plain()], plan, fallback=True))
    try:
        with use_timer(lambda cfg, launch: 0.9 if isinstance(cfg, Plain) else 1.0):
            calls(1)  # the registry changed
            calls(0)
            assert ran == []
            with use_kernel_options(dense_margin=1.0):
                calls(1)
                calls(0)
                assert ran == ["fwd", "dx", "dw"] * 2
            calls(1)  # the previous options: their plans again
            assert ran == ["fwd", "dx", "dw"] * 2
    finally:
        unregister_backend("plain")
    calls(1)


@pytest.mark.parametrize("moved", [False, True])
def test_a_state_dict_loaded_into_a_layer_that_ran_computes_the_loaded_topology(moved):
    """What a resume does to each layer, on the kernels (interpreted here): a layer whose metadata keeps launch
    plans and a FastCall loads a state dict of another topology (after a move, which re-wraps the metadata,
    when ``moved``); its forward and gradients are then those of the loaded weight, on fresh inputs."""
    def layer(seed):
        return SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=16, format="block",
                                       generator=torch.Generator().manual_seed(seed))

    torch.manual_seed(0)
    src, dst = layer(2), layer(1)
    assert not torch.equal(src.mask, dst.mask)
    for _ in range(2):  # the second call takes the FastCall
        _grads_vs_reference(dst, torch.randn(2, 13, 64), 1e-5)
    if moved:
        dst._apply(lambda t: t.clone())
        _grads_vs_reference(dst, torch.randn(2, 13, 64), 1e-5)
    ran = BlockFormat.meta(dst)
    assert ran._groups["plans"] and ran._groups["calls"]
    dst.load_state_dict(src.state_dict())
    assert BlockFormat.meta(dst) is not ran and torch.equal(dst.mask, src.mask)
    torch.testing.assert_close(dst.dense_weight(), src.dense_weight(), rtol=0, atol=0)
    for _ in range(2):
        x = torch.randn(2, 13, 64)
        torch.testing.assert_close(dst(x), x @ src.dense_weight().t() + src.bias, rtol=1e-5, atol=1e-5)
        _grads_vs_reference(dst, x, 1e-5)


def test_fast_call_under_autocast_matches_reference():
    """Under autocast only x is cast (float32 values and bias, float32 gradients), on the fast path as on the first
    call; a new autocast dtype is another signature."""
    torch.manual_seed(1)
    layer = SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=32, format="block")
    for _ in range(3):
        x = torch.randn(2, 9, 64, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.float16):
            y = layer(x)
        assert y.dtype == torch.float16
        dy = torch.randn_like(y)
        layer.zero_grad()
        y.backward(dy)
        w = layer.dense_weight().double().requires_grad_()
        x16 = x.detach().half().double().requires_grad_()
        y64 = torch.nn.functional.linear(x16, w.half().double(), layer.bias.detach().double())
        y64.backward(dy.double())
        assert layer.values.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
        assert ((y.double() - y64).norm() / y64.norm()) < 3e-3
        assert ((x.grad.double() - x16.grad).norm() / x16.grad.norm()) < 3e-3
    assert len(BlockFormat.meta(layer)._groups["calls"]) == 1


def test_the_custom_op_computes_the_new_topology_after_an_in_place_update():
    """The compiled path finds a layer's metadata by its index tensors' addresses. If the op built a metadata of
    its own over them (the registry's bound cleared it, say), an in-place mask update must still reach the op:
    its tensors then lead to the rewritten metadata, not to the copy with the old entry lists."""
    from sparsetrain.kernels.blocksparse import registry

    torch.manual_seed(0)
    layer = SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=16, format="block")
    meta, x = layer._bs_meta, torch.randn(7, 64)

    def through_the_op() -> torch.Tensor:
        return torch.ops.sparsetrain.block_sparse_linear(
            x, layer.values.detach(), layer.bias.detach(), *(getattr(meta, n) for n in BlockSparseMeta.TENSORS),
            96, 64, 16)

    registry._OP_METAS.clear()                # the op builds its own metadata over the layer's tensors
    torch.testing.assert_close(through_the_op(), x @ layer.dense_weight().t() + layer.bias, rtol=1e-5, atol=1e-5)
    layer.set_mask(layer.mask.flatten()[torch.randperm(layer.mask.numel())].view_as(layer.mask))
    assert layer._bs_meta is meta             # rewritten in place
    torch.testing.assert_close(through_the_op(), x @ layer.dense_weight().t() + layer.bias, rtol=1e-5, atol=1e-5)


def test_mask_updates_do_not_pile_up_old_topologies_in_the_op_registry():
    """The custom ops find a layer's metadata by its tensors' addresses; a mask update replaces the entry instead
    of adding one, so old index tensors and their plans are freed (a BERT-base run makes ~11k of them)."""
    from sparsetrain.kernels.blocksparse import registry

    torch.manual_seed(0)
    layer = SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=16, format="block")
    mine = lambda: [m for m in registry._OP_METAS.values() if m is layer._bs_meta]  # noqa: E731
    before = len(registry._OP_METAS)
    assert len(mine()) == 1
    for i in range(6):
        if i % 2:   # a plan that cannot follow an in-place rewrite: the layer gets new tensors, re-registered
            layer._bs_meta._groups.setdefault("plans", {})["not rewritable"] = object()
        before_meta = layer._bs_meta
        mask = layer.mask.flatten()[torch.randperm(layer.mask.numel())].view_as(layer.mask)
        layer.set_mask(mask)
        assert (layer._bs_meta is before_meta) == (i % 2 == 0)
        assert len(mine()) == 1
    assert len(registry._OP_METAS) == before
    x = torch.randn(7, 64)
    want = x @ layer.dense_weight().t() + layer.bias
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [8, 16])   # the plain-torch reference path; the kernels (interpreter here)
def test_set_mask_rewrites_the_index_buffers_in_place_where_every_plan_can_follow(block):
    """A mask update keeps the layer's index buffers (the very tensors a CUDA graph of the step read) and writes
    the new topology into them where every plan kept on the metadata can follow; where one cannot (a CUDA-kernel
    plan, faked here) the layer gets new buffers. Either way it computes the new topology."""
    torch.manual_seed(1)
    layer = SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=block, format="block")
    x = torch.randn(7, 64)
    layer(x).sum().backward()                                          # plans (kernel path) kept on the metadata
    names = [n for n in layer._buffers if n.startswith("_bs_")]

    def update(expect_in_place: bool) -> None:
        before = {n: layer._buffers[n] for n in names}
        ptrs = {n: t.data_ptr() for n, t in before.items()}
        mask = layer.mask.flatten()[torch.randperm(layer.mask.numel())].view_as(layer.mask)
        layer.set_mask(mask)
        same = all(layer._buffers[n] is before[n] and before[n].data_ptr() == ptrs[n] for n in names)
        assert same == expect_in_place
        assert torch.equal(layer._bs_meta.row_idx, BlockSparseMeta.from_mask(mask, block).row_idx)
        torch.testing.assert_close(layer(x), x @ layer.dense_weight().t() + layer.bias, rtol=1e-5, atol=1e-5)
        layer(x).sum().backward()

    update(expect_in_place=True)
    update(expect_in_place=True)
    layer._bs_meta._groups.setdefault("plans", {})["not rewritable"] = object()
    update(expect_in_place=False)


def _kept_tables_match_a_fresh_build(meta: BlockSparseMeta, mask: torch.Tensor) -> set:
    """Assert that every index tensor and kept table of ``meta`` holds what a metadata built afresh from ``mask`` on
    meta's device builds for the same key (the weight-gradient CTA table: its rows with work, the spare rows
    empty); returns the kinds of table compared."""
    from sparsetrain.kernels.blocksparse import _cuda_tables as ct
    from sparsetrain.kernels.blocksparse.reference import block_index

    fresh = BlockSparseMeta.from_mask(mask.to(meta.device), meta.block)
    for name in meta.TENSORS:
        assert torch.equal(getattr(meta, name), getattr(fresh, name)), name
    builders = {"dds": BlockSparseMeta.padded_entries, "dw": BlockSparseMeta.dw_groups, "bs_dds_info": ct.entry_info,
                "bs_wbound": ct.warp_ranges, "bs_ks": ct.ks_table, "block_index": block_index}
    compared = set()
    for key, value in meta._groups.items():
        kind = key[0] if isinstance(key, tuple) else key
        if kind == "bs_dw_table":
            (cta, blk, aw, bw), (fcta, fblk, faw, fbw) = value, ct.dw_table(fresh, *key[1:])
            used = ct.dw_ctas_used(fresh, *key[1:])
            assert torch.equal(blk, fblk) and (aw, bw) == (faw, fbw), key
            assert torch.equal(cta[:used], fcta[:used]) and not cta[used:].any(), key
        elif kind in builders:
            want = builders[kind](fresh, *key[1:])
            got, want = ((x,) if torch.is_tensor(x) else x for x in (value, want))
            for g, w in zip(got, want, strict=True):
                assert (torch.equal(g, w) and g.dtype == w.dtype) if torch.is_tensor(g) else g == w, key
        else:
            continue
        compared.add(kind)
    return compared


def test_set_mask_refills_every_kept_table_from_the_host_build():
    """set_mask works out the slots on the host and hands rewrite_ the host copy of the new mask: the values and
    Adam moments follow their blocks, and every kept table (the CUDA kernels' tables too: plain torch, built here
    by hand) keeps its storage and holds what a fresh build of the new mask holds."""
    from sparsetrain.kernels.blocksparse import _cuda_tables as ct
    from sparsetrain.kernels.blocksparse.reference import block_index

    torch.manual_seed(2)
    layer = SparseLinear.from_dense(torch.nn.Linear(160, 384), density=0.1, block=16, format="block")
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    layer(torch.randn(5, 160)).square().sum().backward()
    opt.step()
    meta = BlockFormat.meta(layer)
    for forward in (True, False):
        ct.entry_info(meta, forward)
        ct.warp_ranges(meta, forward, 8)
        ct.ks_table(meta, forward, 4, 64)
    ct.dw_table(meta, True, 128)
    ct.dw_table(meta, False, 128)
    block_index(meta)
    kept = {k: v for k, v in meta._groups.items() if isinstance(k, tuple)}
    dense_before = layer.dense_weight().clone()
    moment_before = values_to_dense(opt.state[layer.values]["exp_avg"], meta).clone()

    flat = layer.mask.flatten()
    new = flat[torch.randperm(flat.numel())].view_as(layer.mask)
    layer.set_mask(new, opt)
    assert layer._bs_meta is meta and all(meta._groups[k] is v for k, v in kept.items())
    assert _kept_tables_match_a_fresh_build(meta, new) >= {"dds", "bs_dds_info", "bs_wbound", "bs_ks",
                                                           "bs_dw_table", "block_index"}
    both = to_element_mask(layer.mask & new, Block(16, 16))   # blocks active before and after keep their values
    torch.testing.assert_close(layer.dense_weight(), torch.where(both, dense_before, 0.0), rtol=0, atol=0)
    moment = values_to_dense(opt.state[layer.values]["exp_avg"], meta)
    torch.testing.assert_close(moment, torch.where(both, moment_before, 0.0), rtol=0, atol=0)


def _gpu_ffn_layer(dw_cuda: bool, seed: int = 0):
    """A BERT-base FFN layer (768 -> 3072, 16x16 blocks, density 0.1) in bf16 on the GPU after one Adam step whose
    kernels are forced: the CUDA forward and input-gradient tiles (entry lists, warp ranges) and, with ``dw_cuda``,
    the CUDA weight-gradient kernel (its CTA table is built on the host), else the Triton one (fixed groups)."""
    from sparsetrain.kernels.blocksparse import _cuda, gather
    from sparsetrain.kernels.blocksparse.testing import forced_config

    torch.manual_seed(seed)
    I, O, b = 768, 3072, 16
    layer = SparseLinear.from_dense(torch.nn.Linear(I, O), density=0.1, block=b, format="block")
    layer = layer.to("cuda", torch.bfloat16)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-3)
    probe = lambda k: torch.empty(1, k, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    x = torch.randn(256, I, device="cuda", dtype=torch.bfloat16, requires_grad=True)   # dX: the transposed lists
    dw = _cuda.DW_CANDIDATES[0] if dw_cuda else gather.DW_CANDIDATES[b][0]
    with forced_config(fwd=_cuda.candidates(probe(I), b, I)[0], dx=_cuda.candidates(probe(O), b, O)[0], dw=dw):
        layer(x).float().square().mean().backward()
    opt.step()
    return layer, opt, BlockFormat.meta(layer)


def _kept_storage(meta) -> list[int]:
    kept = [getattr(meta, n) for n in meta.TENSORS] + [t for v in meta._groups.values()
                                                       for t in (v if isinstance(v, tuple) else (v,))
                                                       if torch.is_tensor(t)]
    return [t.data_ptr() for t in kept]


def _shuffled(mask: torch.Tensor) -> torch.Tensor:
    flat = mask.flatten()
    return flat[torch.randperm(flat.numel(), device=flat.device)].view_as(mask)


@pytest.mark.gpu
@pytest.mark.parametrize("dw_cuda", [False, True])
def test_gpu_mask_update_waits_for_nothing(dw_cuda):
    """With the CUDA forward/input-gradient tables and the weight-gradient kernel's tables kept (Triton groups, or
    the CUDA kernel's CTA table), ``set_mask`` given the new mask on the GPU moves the blocks and Adam moments and
    rebuilds the topology and every kept table there, in place, waiting for nothing (sync debug mode "error"); the
    tables then hold what a fresh build holds, the blocks active before and after keep their weights and moments,
    the others are zero."""
    layer, opt, meta = _gpu_ffn_layer(dw_cuda=dw_cuda)
    assert layer.graph_update_key() is not None        # every kept table is rebuilt on the device
    dense, moment = layer.dense_weight().float(), values_to_dense(opt.state[layer.values]["exp_avg"], meta).float()
    before, old, new = _kept_storage(meta), layer.mask.clone(), _shuffled(layer.mask)   # (block_index kept now)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer.set_mask(new, opt)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert layer._bs_meta is meta and _kept_storage(meta) == before
    want = {"dds", "bs_dds_info", "bs_wbound", "bs_dw_table" if dw_cuda else "dw"}
    assert want <= _kept_tables_match_a_fresh_build(meta, new)
    both = to_element_mask(old & new, Block(16, 16))
    torch.testing.assert_close(layer.dense_weight().float(), torch.where(both, dense, 0.0), rtol=0, atol=0)
    torch.testing.assert_close(values_to_dense(opt.state[layer.values]["exp_avg"], meta).float(),
                               torch.where(both, moment, 0.0), rtol=0, atol=0)
