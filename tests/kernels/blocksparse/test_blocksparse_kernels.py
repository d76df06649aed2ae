"""Block-sparse kernels vs the plain-torch reference and vs dense F.linear with the masked weight.

On the CPU the kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py) at small shapes in fp32/fp16;
GPU tests (bf16/fp16 at real shapes) are in test_blocksparse_gpu.py and test_blocksparse_cuda.py.
"""
from __future__ import annotations

import pytest
import torch
from blocksparse_cases import make_mask, rel, run_against_dense

from sparsetrain.kernels.blocksparse import plans, tuner
from sparsetrain.kernels.blocksparse.dense import DenseConfig
from sparsetrain.kernels.blocksparse.gather import INTERP_DDS, INTERP_DW, DdsConfig, DwConfig
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.op import block_sparse_linear, uses_kernels
from sparsetrain.kernels.blocksparse.reference import (
    dense_to_values,
    reference_grads,
    reference_linear,
    values_to_dense,
)
from sparsetrain.kernels.blocksparse.testing import forced_config
from sparsetrain.kernels.blocksparse.tma import TmaDdsConfig, TmaDwConfig
from sparsetrain.kernels.blocksparse.tuner import Product
from sparsetrain.sparsity.layout import Block, to_element_mask


# ---- kernels (interpreter on CPU) -------------------------------------------------------------
@pytest.mark.parametrize("T,I,O,b,pattern,dtype,with_bias", [
    (37, 64, 96, 16, "random", torch.float32, True),
    (37, 64, 96, 16, "empty_rows_cols", torch.float16, True),
    (37, 64, 96, 32, "random", torch.float16, False),
    (37, 64, 96, 32, "dense", torch.float32, True),
    (37, 64, 96, 16, "single", torch.float32, False),
    (5, 64, 96, 16, "random", torch.float16, True),
    (37, 128, 128, 64, "empty_rows_cols", torch.float32, True),
])
def test_kernels_match_dense_masked(T, I, O, b, pattern, dtype, with_bias, poison):
    run_against_dense(T, I, O, b, pattern, dtype, with_bias)


@pytest.mark.parametrize("b,dds,dw", [
    (16, DdsConfig(16, 1, 1, 4, 1), DwConfig(1, 16, 4, 1)),  # scalar paths at b16, one output block each
    (32, DdsConfig(32, 2, 3, 4, 1, ".ca"), DwConfig(4, 32, 4, 1)),  # gathered paths at b32, padded groups
    (16, DdsConfig(16, 4, 100, 4, 1), DwConfig(8, 16, 4, 1)),  # a program walks every output block
])
def test_other_tile_paths(b, dds, dw, poison):
    with forced_config(fwd=dds, dx=dds, dw=dw):
        run_against_dense(37, 64, 96, b, "empty_rows_cols", torch.float32, True, seed=3)


@pytest.mark.parametrize("b,I,O,dtype", [(16, 64, 96, torch.float32), (32, 64, 96, torch.float16),
                                           (64, 128, 192, torch.float32), (64, 128, 192, torch.float16)])
@pytest.mark.parametrize("pattern", ["empty_rows_cols", "single"])
def test_wide_tile_paths(b, I, O, dtype, pattern, poison):
    """Transposed accumulation (tokens as the MMA's N side): forward and dX."""
    with forced_config(fwd=DdsConfig(16, 1, 2, 4, 1, "", True), dx=DdsConfig(32, 1, 1, 4, 1, "", True)):
        run_against_dense(37, I, O, b, pattern, dtype, True, seed=5)


_TMA_SHAPES = [(32, 64, 96, torch.float16), (64, 128, 192, torch.float32), (64, 128, 192, torch.float16)]


@pytest.mark.parametrize("b,I,O,dtype", _TMA_SHAPES)
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("pattern", ["empty_rows_cols", "random"])
def test_tma_tile_paths(b, I, O, dtype, wide, pattern, poison):
    """The TMA kernels (whole-box loads at data-dependent coordinates), descriptors made on the device (every
    eager launch): forward, dX and dW (token split 2)."""
    cfg = TmaDdsConfig(16, 4, 1, wide)
    with forced_config(fwd=cfg, dx=cfg, dw=TmaDwConfig(16, 4, 1, 2 if wide else 1)):  # dW: groups of 1 and 2
        run_against_dense(37, I, O, b, pattern, dtype, True, seed=6)


@pytest.mark.parametrize("b,I,O,dtype", _TMA_SHAPES)
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("pattern", ["empty_rows_cols", "random"])
def test_tma_tile_paths_with_host_descriptors(b, I, O, dtype, wide, pattern):
    """The TMA plans with host-made descriptors (what a CUDA-graph capture passes), called directly."""
    gen = torch.Generator().manual_seed(6)
    meta = BlockSparseMeta.from_mask(make_mask(pattern, (O // b, I // b), gen), b)
    values = (torch.randn(meta.n_blocks, b, b, generator=gen) / b).to(dtype)
    x, dy, bias = (torch.randn(37, I, generator=gen).to(dtype), torch.randn(37, O, generator=gen).to(dtype),
                   torch.randn(O, generator=gen).to(dtype))
    w = values_to_dense(values.double(), meta)
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    for kind, a, ref in (("fwd", x, x.double() @ w.t() + bias.double()), ("dx", dy, dy.double() @ w)):
        p = Product(kind, meta, a, values, kind == "fwd")
        out = torch.full((37, ref.shape[1]), float("nan"), dtype=dtype)
        tuner.make_plan(TmaDdsConfig(16, 4, 1, wide), p)(a, values, bias if kind == "fwd" else a, out, host=True)
        assert rel(out, ref) < tol
    plan = tuner.make_plan(TmaDwConfig(16, 4, 1, 2 if wide else 1), Product("dw", meta, x, dy, True))
    assert plan.atomic  # 37 tokens in slices of 16: split 2 under the interpreter
    dv, db = torch.zeros(meta.n_blocks, b, b), torch.zeros(O)
    plan(x, dy, dv, db, host=True)
    _, dv_ref, db_ref = reference_grads(x.double(), dy.double(), values.double(), meta)
    assert rel(dv, dv_ref) < tol and rel(db, db_ref) < tol


def test_tma_plans_fall_back_for_misaligned_operands(poison):
    """A cached TMA plan given a 2-byte-misaligned view (same shape and strides) runs the gather kernels."""
    gen = torch.Generator().manual_seed(8)
    meta = BlockSparseMeta.from_mask(make_mask("random", (3, 2), gen), 64)
    values = torch.randn(meta.n_blocks, 64, 64, generator=gen) / 8
    with forced_config(fwd=TmaDdsConfig(16, 4, 1), dx=TmaDdsConfig(16, 4, 1), dw=TmaDwConfig(16, 4, 1, 2)):
        for misaligned in (False, True, False):
            buf = torch.randn(37 * 128 + 1, generator=gen)
            x = (buf[1:] if misaligned else buf[:-1]).view(37, 128)
            dy = torch.randn(37, 192, generator=gen)
            dense = values_to_dense(values, meta)
            assert rel(plans.dds(x, values, meta, None, forward=True), x.double() @ dense.double().t()) < 1e-5
            assert rel(plans.dds(dy, values, meta, None, forward=False), dy.double() @ dense.double()) < 1e-5
            dv, _ = plans.sampled_grad(x, dy, meta, with_bias=False)
            ref = dense_to_values(dy.double().t() @ x.double(), meta)
            assert rel(dv, ref) < 1e-5


@pytest.mark.parametrize("b", [16, 32])
def test_float32_master_values_with_fp16_input(b, poison):
    """Mixed precision: fp16 activations, fp32 values/bias read by the kernels; fp32 gradients back."""
    gen = torch.Generator().manual_seed(11)
    meta = BlockSparseMeta.from_mask(make_mask("empty_rows_cols", (96 // b, 64 // b), gen), b)
    values = (torch.randn(meta.n_blocks, b, b, generator=gen) / 8).requires_grad_()
    bias = torch.randn(96, generator=gen, requires_grad=True)
    x = torch.randn(37, 64, generator=gen).half().requires_grad_()
    y = block_sparse_linear(x, values, meta, bias)
    assert y.dtype == torch.float16
    dy = torch.randn(37, 96, generator=gen).half()
    y.backward(dy)
    assert values.grad.dtype == bias.grad.dtype == torch.float32 and x.grad.dtype == torch.float16
    # reference on the fp16-rounded values the kernel multiplies with
    v64 = values.detach().half().double().requires_grad_()
    x64 = x.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_()
    y64 = reference_linear(x64, v64, meta, b64)
    y64.backward(dy.double())
    assert rel(y, y64) < 3e-3 and rel(x.grad, x64.grad) < 3e-3
    assert rel(values.grad, v64.grad) < 3e-3 and rel(bias.grad, b64.grad) < 3e-3


def test_kernels_vs_reference_3d_input_and_empty_batch():
    meta = BlockSparseMeta.from_mask(make_mask("random", (6, 4), torch.Generator().manual_seed(4)), 16)
    values = torch.randn(meta.n_blocks, 16, 16)
    x = torch.randn(2, 7, 64)
    torch.testing.assert_close(block_sparse_linear(x, values, meta), reference_linear(x, values, meta),
                               rtol=1e-5, atol=1e-5)
    assert block_sparse_linear(torch.randn(0, 64), values, meta).shape == (0, 96)


@pytest.mark.parametrize("kernels", [True, False])
def test_dense_grad_hook(kernels, monkeypatch):
    if not kernels:
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU without the interpreter: reference path
    meta = BlockSparseMeta.from_mask(make_mask("random", (6, 4), torch.Generator().manual_seed(5)), 16)
    values = torch.randn(meta.n_blocks, 16, 16, requires_grad=True)
    x = torch.randn(21, 64)
    assert uses_kernels(x, meta) == kernels
    got = []
    y = block_sparse_linear(x, values, meta, dense_grad_hook=got.append)
    dy = torch.randn_like(y)
    y.backward(dy)
    dense = dy.t() @ x
    assert len(got) == 1 and got[0].dtype == torch.float32 and got[0].shape == (96, 64)
    torch.testing.assert_close(got[0], dense, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(values.grad, dense_to_values(dense, meta), rtol=1e-5, atol=1e-4)


# ---- reference path ---------------------------------------------------------------------------
def test_reference_grads_match_autograd(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    meta = BlockSparseMeta.from_mask(make_mask("empty_rows_cols", (5, 6), torch.Generator().manual_seed(6)), 8)
    values = torch.randn(meta.n_blocks, 8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(11, 48, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(40, dtype=torch.float64, requires_grad=True)
    y = block_sparse_linear(x, values, meta, bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    dx, dv, db = reference_grads(x.detach(), dy, values.detach(), meta)
    torch.testing.assert_close(x.grad, dx)
    torch.testing.assert_close(values.grad, dv)
    torch.testing.assert_close(bias.grad, db)
    assert bool((values_to_dense(values.detach(), meta)[:8] == 0).all())  # block row 0 is empty


@pytest.mark.parametrize("block", [Block(1, 1), Block(4, 4), Block(4, 8), Block(8, 8)])
def test_small_and_rectangular_blocks_use_reference(block):
    gen = torch.Generator().manual_seed(7)
    mask = torch.rand(32 // block.rows, 48 // block.cols, generator=gen) < 0.4
    meta = BlockSparseMeta.from_mask(mask, block)
    w = torch.randn(32, 48, generator=gen)
    values = dense_to_values(w, meta)
    x = torch.randn(9, 48, generator=gen)
    assert not uses_kernels(x, meta)
    w_masked = w * to_element_mask(mask, block)
    torch.testing.assert_close(block_sparse_linear(x, values, meta), x @ w_masked.t())


def test_autocast_casts_inputs_and_keeps_fp32_grads(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # bf16 is wrong under the interpreter: reference path
    meta = BlockSparseMeta.from_mask(make_mask("random", (6, 4), torch.Generator().manual_seed(8)), 16)
    values = torch.randn(meta.n_blocks, 16, 16, requires_grad=True)
    x = torch.randn(13, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block_sparse_linear(x, values, meta)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert values.grad.dtype == torch.float32


def test_bad_inputs_raise_before_work():
    meta = BlockSparseMeta.from_mask(torch.ones(6, 4, dtype=torch.bool), 16)
    v = torch.randn(24, 16, 16)
    with pytest.raises(ValueError, match="x has shape"):
        block_sparse_linear(torch.randn(3, 63), v, meta)
    with pytest.raises(ValueError, match="values has shape"):
        block_sparse_linear(torch.randn(3, 64), v[:5], meta)
    with pytest.raises(ValueError, match="bias has shape"):
        block_sparse_linear(torch.randn(3, 64), v, meta, torch.randn(95))
    with pytest.raises(TypeError, match="dtypes differ"):
        block_sparse_linear(torch.randn(3, 64), v.half(), meta)  # 16-bit values with a float32 x
    with pytest.raises(TypeError, match="x must be"):
        block_sparse_linear(torch.ones(3, 64, dtype=torch.int64), v, meta)
    with pytest.raises(TypeError, match="meta"):
        block_sparse_linear(torch.randn(3, 64), v, "meta")


# ---- cached launch plans (host fast path) --------------------------------------------------------
def _check_call(x, values, meta, bias, tol):
    """One forward+backward on fresh leaves vs float64 references; returns nothing, asserts."""
    x = x.detach().requires_grad_()
    values = values.detach().requires_grad_()
    bias = bias.detach().requires_grad_()
    y = block_sparse_linear(x, values, meta, bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, v64, dy64 = x.detach().double(), values.detach().double(), dy.double()
    y_ref = x64 @ values_to_dense(v64, meta).t() + bias.detach().double()
    dx, dv, db = reference_grads(x64, dy64, v64, meta)
    for got, ref in ((y, y_ref), (x.grad, dx), (values.grad, dv), (bias.grad, db)):
        assert rel(got, ref) < tol


@pytest.mark.parametrize("b", [16, 32])
def test_repeated_calls_reuse_plans(b, poison):
    """Training calls one layer many times: from the second call on, the launch plans cached on the
    metadata run the kernels. Fresh inputs every call, token counts that change and come back."""
    gen = torch.Generator().manual_seed(b)
    I, O = 4 * b, 3 * b
    meta = BlockSparseMeta.from_mask(make_mask("empty_rows_cols", (O // b, I // b), gen), b)
    for T in (40, 40, 17, 40):
        _check_call(torch.randn(T, I), torch.randn(meta.n_blocks, b, b) / b, meta, torch.randn(O), 1e-5)
    plans = meta._groups["plans"]
    assert {k[0] for k in plans} == {"plan_dds", "plan_dw"} and len(plans) == 2 * 2 + 2  # fwd/dx x 2 T, dw x 2


def test_forced_config_is_not_shadowed_by_a_cached_plan():
    """A plan cached under the default choice must not be used while another tile config is forced."""
    gen = torch.Generator().manual_seed(3)
    meta = BlockSparseMeta.from_mask(make_mask("random", (4, 4), gen), 16)
    x, v, bias = torch.randn(40, 64), torch.randn(meta.n_blocks, 16, 16) / 16, torch.randn(64)
    _check_call(x, v, meta, bias, 1e-5)
    other = DdsConfig(16, 1, 1, 4, 1)
    with forced_config(fwd=other, dx=other, dw=DwConfig(2, 16, 4, 1)):
        _check_call(x, v, meta, bias, 1e-5)
    built = list(meta._groups["plans"].values())
    dds = sorted(p.options["GROUP_K"] for p in built if "GROUP_K" in p.options)
    dws = sorted(p.options["GROUP"] for p in built if "GROUP" in p.options)
    assert dds == [1, 1, 2, 2] and dws == [2, 4]  # the default (interpreter) tiles and the forced ones


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "single"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_fallback_candidate_matches_dense(dtype, pattern, with_bias, poison):
    """The dense fallback (DenseConfig: scatter the blocks into W / gather them from dYᵀ·X around cuBLAS) forced
    for all three products gives the masked dense layer's outputs and gradients (plain torch, so it runs here)."""
    dense = DenseConfig()
    with forced_config(fwd=dense, dx=dense, dw=dense):
        run_against_dense(37, 64, 96, 16, pattern, dtype, with_bias, seed=len(pattern))


@pytest.mark.parametrize("kind", ["tma", "gather", "dense"])
def test_cached_plans_keep_no_call_tensors(kind):
    """A cached launch plan must not keep the tensors of the call that built it (activations, gradients,
    outputs): the TMA plans once did, through their lazily built fallback, which raised the peak memory of a
    BERT-base step with 64x64 blocks from 0.87x to 1.07x of dense (docs/history/blocksparse.md)."""
    import gc
    import weakref

    cfgs = {"tma": {"fwd": TmaDdsConfig(16, 4, 1), "dx": TmaDdsConfig(16, 4, 1), "dw": TmaDwConfig(16, 4, 1, 1)},
            "gather": {"fwd": INTERP_DDS[64], "dx": INTERP_DDS[64], "dw": INTERP_DW[64]},
            "dense": {"fwd": DenseConfig(), "dx": DenseConfig(), "dw": DenseConfig()}}[kind]
    gen = torch.Generator().manual_seed(2)
    meta = BlockSparseMeta.from_mask(make_mask("random", (3, 2), gen), 64)
    values = (torch.randn(meta.n_blocks, 64, 64, generator=gen) / 8).requires_grad_()
    refs = []

    def step():
        x = torch.randn(37, 128, generator=gen, requires_grad=True)
        y = block_sparse_linear(x, values, meta)
        dy = torch.randn(37, 192, generator=gen)
        y.backward(dy)
        refs.extend(weakref.ref(t) for t in (x, y, dy, x.grad))

    with forced_config(**cfgs):
        for _ in range(2):
            step()
    gc.collect()
    assert len(meta._groups["plans"]) == 3  # the plans were cached ...
    assert [r() is None for r in refs] == [True] * len(refs)  # ... and hold none of the steps' tensors


@pytest.mark.parametrize("b,tiles", [
    (16, dict(fwd=DdsConfig(16, 2, 2, 4, 1), dx=DdsConfig(16, 1, 3, 4, 1), dw=DwConfig(2, 16, 4, 1))),
    (32, dict(fwd=DdsConfig(16, 4, 1, 4, 1), dx=DdsConfig(16, 1, 2, 4, 1), dw=DwConfig(1, 16, 4, 1))),
    (32, dict(fwd=TmaDdsConfig(16, 4, 1), dx=TmaDdsConfig(16, 4, 1, True), dw=TmaDwConfig(16, 4, 1, 2))),
    (16, dict(fwd=DenseConfig(), dx=DenseConfig(), dw=DenseConfig())),
])
def test_kept_plans_follow_an_in_place_topology_rewrite(b, tiles, poison):
    """After BlockSparseMeta.rewrite_ the plans kept on the metadata (the very objects, none rebuilt: what a CUDA
    graph captured) compute the new topology's forward, dX, dW and bias gradient."""
    T, I, O = 37, 64, 96
    gen = torch.Generator().manual_seed(b)
    mask = torch.rand(O // b, I // b, generator=gen) < 0.5
    mask[0] = False                                                 # an empty block row in the first topology
    meta = BlockSparseMeta.from_mask(mask, b)

    def check() -> None:
        values = (torch.randn(meta.n_blocks, b, b, generator=gen) / b).requires_grad_()
        x = torch.randn(T, I, generator=gen, requires_grad=True)
        bias = torch.randn(O, generator=gen, requires_grad=True)
        dy = torch.randn(T, O, generator=gen)
        for _ in range(2):                                          # the second call takes the kept fast path
            values.grad = x.grad = bias.grad = None
            block_sparse_linear(x, values, meta, bias).backward(dy)
        w64 = values_to_dense(values.detach().double(), meta).requires_grad_()
        x64, b64 = x.detach().double().requires_grad_(), bias.detach().double().requires_grad_()
        y64 = torch.nn.functional.linear(x64, w64, b64)
        y64.backward(dy.double())
        assert rel(block_sparse_linear(x, values, meta, bias).detach(), y64.detach()) < 1e-5
        assert rel(x.grad, x64.grad) < 1e-5 and rel(bias.grad, b64.grad) < 1e-5
        assert rel(values.grad, dense_to_values(w64.grad, meta)) < 1e-5

    with forced_config(**tiles):
        check()
        kept = dict(meta._groups["plans"])
        assert kept and all(p.stable for p in kept.values())
        flat = mask.flatten()
        new = flat[torch.randperm(flat.numel(), generator=gen)].view(mask.shape)
        assert not torch.equal(new, mask) and meta.rewrite_(new)
        check()
        assert meta._groups["plans"].keys() == kept.keys()
        assert all(meta._groups["plans"][k] is p for k, p in kept.items())


@pytest.mark.parametrize("b,pattern,dtype", [(16, "random", torch.float32), (16, "empty_rows_cols", torch.float16),
                                             (32, "random", torch.float16), (32, "single", torch.float32)])
def test_gather_plan_with_the_output_in_three_pieces(b, pattern, dtype):
    """``gather.dds_plan(parts=3)``: the forward writes its output as three tensors (a fused query/key/value
    projection's q, k, v) and the input gradient reads dY from three, each piece its own allocation, against the
    product on the concatenated tensors. b=16 runs the gathered (GROUP_K 2) path, b=32 the single-block one."""
    from sparsetrain.kernels.blocksparse import gather

    gen = torch.Generator().manual_seed(b + len(pattern))
    T, I, O = 37, 64, 3 * 2 * b
    meta = BlockSparseMeta.from_mask(make_mask(pattern, (O // b, I // b), gen), b)
    values = torch.randn(meta.n_blocks, b, b, generator=gen).to(dtype)
    bias = torch.randn(O, generator=gen).to(dtype)
    w = values_to_dense(values.double(), meta)
    x = torch.randn(T, I, generator=gen).to(dtype)
    fwd = gather.dds_plan(meta, INTERP_DDS[b], True, True, T, x.stride(), parts=3)
    outs = [torch.full((T, O // 3), float("nan"), dtype=dtype) for _ in range(3)]
    fwd(x, values, bias, outs[0], outs[0], outs[0], x, x, outs[1], outs[2])
    assert rel(torch.cat(outs, 1), x.double() @ w.t() + bias.double()) < 2e-3
    dys = [torch.randn(T, O // 3, generator=gen).to(dtype) for _ in range(3)]
    dxp = gather.dds_plan(meta, INTERP_DDS[b], False, False, T, dys[0].stride(), parts=3)
    dx = torch.full((T, I), float("nan"), dtype=dtype)
    dxp(dys[0], values, dys[0], dx, dx, dx, dys[1], dys[2], dx, dx)
    assert rel(dx, torch.cat(dys, 1).double() @ w) < 2e-3
    with pytest.raises(ValueError, match="parts"):
        gather.dds_plan(meta, INTERP_DDS[b], True, True, T, x.stride(), epi=1, parts=3)


@pytest.mark.parametrize("b,pattern,dtype", [(16, "random", torch.float32), (16, "empty_rows_cols", torch.float16),
                                             (32, "random", torch.float16)])
def test_gather_weight_gradient_with_dy_in_three_pieces(b, pattern, dtype):
    """``gather.dw_plan(parts=3)``: the weight and bias gradients read dY from three tensors (the attention
    gradients of a fused q/k/v projection), against the reference on the concatenated dY; the token reduction
    split in two under the interpreter (float32 partial sums), as in the other weight-gradient tests."""
    from sparsetrain.kernels.blocksparse import gather

    gen = torch.Generator().manual_seed(3 * b + len(pattern))
    T, I, O = 37, 64, 3 * 2 * b
    meta = BlockSparseMeta.from_mask(make_mask(pattern, (O // b, I // b), gen), b)
    x = torch.randn(T, I, generator=gen).to(dtype)
    dys = [torch.randn(T, O // 3, generator=gen).to(dtype) for _ in range(3)]
    plan = gather.dw_plan(meta, INTERP_DW[b], True, T, x.stride(), dys[0].stride(0), x.device, parts=3)
    assert plan.atomic
    buf = torch.zeros(meta.n_blocks * b * b + O)
    dv, db = buf[: meta.n_blocks * b * b].view(meta.n_blocks, b, b), buf[meta.n_blocks * b * b:]
    plan(x, dys[0], dv, db, dys[1], dys[2])
    _, dv_ref, db_ref = reference_grads(x.double(), torch.cat(dys, 1).double(),
                                        torch.zeros(meta.n_blocks, b, b, dtype=torch.float64), meta)
    assert rel(dv, dv_ref) < 2e-3 and rel(db, db_ref) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_three_piece_products_through_the_plans(dtype, poison):
    """plans.dds_parts_forward / dds_parts_dx / sampled_grad_parts (a fused q/k/v projection at 64x64 blocks):
    the same products as on the concatenated tensors, the plans kept and reused on a second call."""
    gen = torch.Generator().manual_seed(7)
    b, T, I, O = 64, 21, 128, 3 * 128
    meta = BlockSparseMeta.from_mask(make_mask("random", (O // b, I // b), gen), b)
    assert plans.parts_native(meta) and not plans.parts_native(BlockSparseMeta.from_mask(torch.ones(4, 2, dtype=torch.bool), 16))
    values = torch.randn(meta.n_blocks, b, b, generator=gen).to(dtype)
    bias = torch.randn(O, generator=gen).to(dtype)
    w = values_to_dense(values.double(), meta)
    x = torch.randn(T, I, generator=gen).to(dtype)
    dys = [torch.randn(T, O // 3, generator=gen).to(dtype) for _ in range(3)]
    _, dv_ref, db_ref = reference_grads(x.double(), torch.cat(dys, 1).double(),
                                        torch.zeros(meta.n_blocks, b, b, dtype=torch.float64), meta)
    for _ in range(2):
        outs = plans.dds_parts_forward(x, values, meta, bias)
        assert len(outs) == 3 and all(o.shape == (T, O // 3) for o in outs)
        assert rel(torch.cat(outs, 1), x.double() @ w.t() + bias.double()) < 2e-3
        assert rel(plans.dds_parts_dx(dys, values, meta), torch.cat(dys, 1).double() @ w) < 2e-3
        dv, db = plans.sampled_grad_parts(x, dys, meta, with_bias=True)
        assert rel(dv, dv_ref) < 2e-3 and rel(db, db_ref) < 2e-3
    kept = [k for k in meta._groups["plans"] if k[0] in ("plan_dds_parts", "plan_dw_parts")]
    assert len(kept) == 3


@pytest.mark.parametrize("compiled,b", [(False, 64), (True, 64), (False, 16)])
def test_block_sparse_linear_parts_matches_the_split_output(compiled, b, poison, monkeypatch):
    """block_sparse_linear_parts (a fused q/k/v projection, float32 master values under the interpreter): the
    same three outputs as block_sparse_linear's output split, and the same gradients, eager and as the custom
    ops under torch.compile, with a loss that weighs the pieces differently; one piece unused (its gradient
    zero). Off the kernels (the model on plain CPU tensors) it is the split output itself."""
    import torch._dynamo

    from sparsetrain.kernels.blocksparse.parts import block_sparse_linear_parts, parts_native_for

    gen = torch.Generator().manual_seed(11)
    I, O = 128, 3 * 128
    meta = BlockSparseMeta.from_mask(make_mask("random", (O // b, I // b), gen), b)
    values = torch.randn(meta.n_blocks, b, b, generator=gen, requires_grad=True)
    bias = torch.randn(O, generator=gen, requires_grad=True)
    x = torch.randn(3, 7, I, generator=gen, requires_grad=True)
    gs = [torch.randn(3, 7, O // 3, generator=gen) for _ in range(3)]
    assert parts_native_for(x, meta)

    def loss(pieces, use=(0, 1, 2)):
        return sum((pieces[i] * gs[i]).sum() for i in use)

    def grads(fn, use):
        for t in (x, values, bias):
            t.grad = None
        pieces = fn(x, values, meta, bias)
        loss(pieces, use).backward()
        return [p.detach() for p in pieces], [t.grad.clone() for t in (x, values, bias)]

    plain = lambda x_, v_, m_, b_: block_sparse_linear(x_, v_, m_, b_).split(O // 3, dim=-1)  # noqa: E731
    torch._dynamo.reset()
    fn = torch.compile(block_sparse_linear_parts, backend="aot_eager", fullgraph=True) if compiled \
        else block_sparse_linear_parts
    for use in [(0, 1, 2), (0, 2)]:
        want_out, want_grads = grads(plain, use)
        got_out, got_grads = grads(fn, use)
        assert all(g.is_contiguous() for g in got_out)     # three tensors of their own, not views of one
        for got, want in zip([*got_out, *got_grads], [*want_out, *want_grads], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # plain CPU tensors: the reference path
    assert not parts_native_for(x, meta)
    out = block_sparse_linear_parts(x, values, meta, bias)
    assert out[0]._base is not None      # views of one output
    torch.testing.assert_close(torch.cat(out, -1), block_sparse_linear(x, values, meta, bias))


@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_fallback_in_three_pieces(with_bias):
    """The dense fallback's plans for a three-piece product (three GEMMs, one per piece, on CPU float32 here):
    forward into three outputs, input gradient accumulated from three dY pieces, weight and bias gradients from
    them, against the product on the concatenated tensors; Product.k counts every piece of dX's operand."""
    from sparsetrain.kernels.blocksparse import dense
    from sparsetrain.kernels.blocksparse.tuner import Product

    gen = torch.Generator().manual_seed(5)
    b, T, I, O = 16, 29, 64, 3 * 32
    meta = BlockSparseMeta.from_mask(make_mask("random", (O // b, I // b), gen), b)
    values = torch.randn(meta.n_blocks, b, b, generator=gen)
    bias = torch.randn(O, generator=gen)
    w = values_to_dense(values.double(), meta)
    x = torch.randn(T, I, generator=gen)
    dys = [torch.randn(T, O // 3, generator=gen) for _ in range(3)]
    fwd = dense.BACKEND.make_plan(dense.DenseConfig(), Product("fwd", meta, x, values, with_bias, parts=3))
    outs = [torch.full((T, O // 3), float("nan")) for _ in range(3)]
    fwd(x, values, bias if with_bias else x, outs[0], outs[0], outs[0], x, x, outs[1], outs[2])
    want = x.double() @ w.t() + (bias.double() if with_bias else 0)
    assert rel(torch.cat(outs, 1), want) < 1e-5
    p_dx = Product("dx", meta, dys[0], values, False, parts=3)
    assert p_dx.k == O and Product("fwd", meta, x, values, False, parts=3).k == I
    dx = torch.full((T, I), float("nan"))
    dense.BACKEND.make_plan(dense.DenseConfig(), p_dx)(dys[0], values, dys[0], dx, dx, dx, dys[1], dys[2], dx, dx)
    assert rel(dx, torch.cat(dys, 1).double() @ w) < 1e-5
    dw = dense.BACKEND.make_plan(dense.DenseConfig(), Product("dw", meta, x, dys[0], with_bias, parts=3))
    dv, db = torch.full_like(values, float("nan")), torch.full((O,), float("nan"))
    dw(x, dys[0], dv, db if with_bias else dv, dys[1], dys[2])
    _, dv_ref, db_ref = reference_grads(x.double(), torch.cat(dys, 1).double(), values.double(), meta)
    assert rel(dv, dv_ref) < 1e-5
    if with_bias:
        assert rel(db, db_ref) < 1e-5


_COMPILE_PIECES = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sparsetrain.kernels.blocksparse import gather
from sparsetrain.kernels.blocksparse._triton import dense_x_blocksparse_kernel as kern

names = list(kern.arg_names)
types = ["*bf16", "*bf16", "*i32", "*i32", "*i32", "*i32"] + ["*bf16"] * 8 + ["i32"] * 7
shapes = sorted({(b, c.group_k, c.wide, fwd) for b in (16, 32, 64) for c in gather.DDS_CANDIDATES[b]
                 for fwd in (True, False)})
for b, group_k, wide, fwd in shapes:
    const = dict(FORWARD=fwd, HAS_BIAS=fwd, EPI=0, BLOCK=b, GROUP_K=group_k, BLOCK_T=64, CACHE_A="", WIDE=wide,
                 A_PARTS=0 if fwd else 4, OUT_PARTS=4 if fwd else 0)
    sig = {**dict(zip(names, types)), **{n: "constexpr" for n in const}}
    try:
        triton.compile(ASTSource(fn=kern, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()}),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    except Exception as e:
        if "ptxas" in str(e).lower() and "error" not in str(e).lower():
            print("NO-PTXAS", e)
            sys.exit(3)
        print("FAILED", b, group_k, wide, fwd, repr(e)[-500:])
        sys.exit(1)
print("compiled", len(shapes))
"""


def test_three_piece_gather_kernels_compile_for_the_gpu():
    """The interpreter runs what the GPU compiler may refuse (a base pointer chosen per gathered block): every
    distinct gather tile shape that reads A or writes the output in pieces is compiled for sm_90 (Triton's own
    compiler and ptxas, no GPU needed; in a fresh process, outside the interpreter)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    res = subprocess.run([sys.executable, "-c", _COMPILE_PIECES], capture_output=True, text=True, env=env,
                         timeout=600)
    if res.returncode == 3:
        pytest.skip(f"Triton cannot compile for sm_90 here: {res.stdout[-300:]}")
    assert res.returncode == 0 and "compiled" in res.stdout, res.stdout[-1500:] + res.stderr[-1500:]
