"""Block-sparse kernels vs the plain-torch reference and vs dense F.linear with the masked weight.

On the CPU the kernels run under TRITON_INTERPRET=1 (set by conftest) at small shapes in fp32/fp16;
``@pytest.mark.gpu`` tests run bf16/fp16 at real shapes on the device machine (``pytest -m gpu``).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sparsetrain.kernels.blocksparse as bs
from sparsetrain.kernels.blocksparse import (
    BlockSparseMeta,
    DdsConfig,
    DwConfig,
    TmaDdsConfig,
    TmaDwConfig,
    block_sparse_linear,
    forced_config,
    uses_kernels,
)
from sparsetrain.kernels.blocksparse_reference import (
    dense_to_values,
    reference_grads,
    reference_linear,
    values_to_dense,
)
from sparsetrain.sparsity.layout import Block, to_element_mask


def make_mask(pattern: str, grid: tuple[int, int], gen: torch.Generator) -> torch.Tensor:
    R, C = grid
    if pattern == "random":
        m = torch.rand(R, C, generator=gen) < 0.5
        m[R // 2, C // 2] = True
    elif pattern == "empty_rows_cols":  # block row 0 and block column 1 hold nothing
        m = torch.rand(R, C, generator=gen) < 0.7
        m[0] = False
        m[:, 1] = False
        m[R - 1, 0] = True
    elif pattern == "dense":
        m = torch.ones(R, C, dtype=torch.bool)
    elif pattern == "single":
        m = torch.zeros(R, C, dtype=torch.bool)
        m[R - 1, C - 1] = True
    else:
        raise ValueError(pattern)
    return m


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite values (an output element was not written?)"
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run_against_dense(T, I, O, b, pattern, dtype, with_bias, seed=0):
    """Our forward/backward vs F.linear on the dense masked weight (float64 autograd), fresh inputs."""
    gen = torch.Generator().manual_seed(seed)
    mask = make_mask(pattern, (O // b, I // b), gen)
    meta = BlockSparseMeta.from_mask(mask, b)
    w = torch.randn(O, I, generator=gen) / I**0.5
    values = dense_to_values(w, meta).to(dtype).requires_grad_()
    x = torch.randn(T, I, generator=gen).to(dtype).requires_grad_()
    bias = torch.randn(O, generator=gen).to(dtype).requires_grad_() if with_bias else None
    assert uses_kernels(x, meta)
    y = block_sparse_linear(x, values, meta, bias)
    dy = torch.randn(T, O, generator=gen).to(dtype)
    y.backward(dy)

    em = to_element_mask(mask, Block(b, b)).double()
    w64 = (values_to_dense(values.detach(), meta).double() * em).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    b64 = bias.detach().double().requires_grad_() if with_bias else None
    y64 = F.linear(x64, w64, b64)
    y64.backward(dy.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    assert rel(y, y64) < tol
    assert rel(x.grad, x64.grad) < tol
    assert rel(values.grad, dense_to_values(w64.grad, meta)) < tol
    if with_bias:
        assert rel(bias.grad, b64.grad) < tol


@pytest.fixture
def poison():
    bs.POISON_OUTPUTS = True
    yield
    bs.POISON_OUTPUTS = False


@pytest.fixture
def no_tuning():
    """GPU tests use each block size's first tile candidate (the benchmark's --check-all-configs checks
    every candidate); tuning them all here would compile every variant."""
    bs.TUNE = False
    yield
    bs.TUNE = True


# ---- metadata ---------------------------------------------------------------------------------
def test_meta_matches_mask():
    mask = make_mask("empty_rows_cols", (6, 5), torch.Generator().manual_seed(1))
    meta = BlockSparseMeta.from_mask(mask, 16)
    pos = [(r, c) for r in range(6) for c in range(5) if mask[r, c]]  # row-major = slot order
    assert meta.n_blocks == len(pos) and (meta.out_features, meta.in_features) == (96, 80)
    assert [(int(r), int(c)) for r, c in zip(meta.row_idx, meta.col_idx)] == pos
    assert meta.row_ptr.tolist() == [0] + torch.cumsum(mask.sum(1), 0).tolist()
    # transpose metadata: per block column, rows ascending, each entry naming the slot of (row, col)
    for c in range(5):
        entries = range(int(meta.col_ptr[c]), int(meta.col_ptr[c + 1]))
        rows = [int(meta.t_row_idx[e]) for e in entries]
        assert rows == [r for r in range(6) if mask[r, c]]
        for e, r in zip(entries, rows):
            assert pos[int(meta.t_slot[e])] == (r, c)
    assert all(t.dtype == torch.int32 for t in (meta.row_ptr, meta.col_idx, meta.col_ptr, meta.t_slot))


@pytest.mark.parametrize("group", [1, 3, 4])
def test_dw_groups_cover_every_slot_once(group):
    mask = make_mask("empty_rows_cols", (7, 9), torch.Generator().manual_seed(2))
    meta = BlockSparseMeta.from_mask(mask, 16)
    grow, gstart, gcount, gfirst, n = meta.dw_groups(group)
    assert grow.numel() == n
    covered = []
    for r, s, k in zip(grow.tolist(), gstart.tolist(), gcount.tolist()):
        assert 0 <= k <= group
        covered += list(range(s, s + k))
        assert all(int(meta.row_idx[i]) == r for i in range(s, s + k))
    assert sorted(covered) == list(range(meta.n_blocks))
    assert sorted(grow[gfirst.bool()].tolist()) == list(range(7))  # one first group per row, empty rows too


@pytest.mark.parametrize("forward", [True, False])
@pytest.mark.parametrize("group_k", [1, 4])
def test_padded_entries(forward, group_k):
    mask = make_mask("empty_rows_cols", (7, 9), torch.Generator().manual_seed(9))
    meta = BlockSparseMeta.from_mask(mask, 16)
    ptr, kidx, slot, out = meta.padded_entries(forward, group_k)
    grid = mask if forward else mask.t()
    for j in range(grid.shape[0]):
        lo, hi = int(ptr[j]), int(ptr[j + 1])
        assert hi - lo >= group_k and (hi - lo) % group_k == 0 and bool((out[lo:hi] == j).all())
        real = [(int(k), int(s)) for k, s in zip(kidx[lo:hi], slot[lo:hi]) if s >= 0]
        assert [k for k, _ in real] == grid[j].nonzero().flatten().tolist()
        for k, s in real:  # the slot holds block (j, k) of W (forward) or (k, j) (transpose)
            r, c = (j, k) if forward else (k, j)
            assert (int(meta.row_idx[s]), int(meta.col_idx[s])) == (r, c)


def test_meta_rejects_bad_mask():
    with pytest.raises(TypeError, match="mask"):
        BlockSparseMeta.from_mask(torch.ones(2, 2), 16)
    with pytest.raises(ValueError, match="mask"):
        BlockSparseMeta.from_mask(torch.ones(2, dtype=torch.bool), 16)


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


@pytest.mark.parametrize("b,I,O,dtype", [(32, 64, 96, torch.float16), (64, 128, 192, torch.float32),
                                           (64, 128, 192, torch.float16)])
@pytest.mark.parametrize("wide", [False, True])
@pytest.mark.parametrize("pattern", ["empty_rows_cols", "random"])
@pytest.mark.parametrize("host_desc", [False, True])
def test_tma_tile_paths(b, I, O, dtype, wide, pattern, host_desc, poison, monkeypatch):
    """The TMA kernels (whole-box loads at data-dependent coordinates): forward, dX and dW (token split 2), with
    descriptors made on the device or on the host."""
    monkeypatch.setattr(bs, "TMA_HOST_DESC", host_desc)
    cfg = TmaDdsConfig(16, 4, 1, wide)
    with forced_config(fwd=cfg, dx=cfg, dw=TmaDwConfig(16, 4, 1, 2 if wide else 1)):  # dW: groups of 1 and 2
        run_against_dense(37, I, O, b, pattern, dtype, True, seed=6)


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
            assert rel(bs._dds(x, values, meta, None, forward=True), x.double() @ dense.double().t()) < 1e-5
            assert rel(bs._dds(dy, values, meta, None, forward=False), dy.double() @ dense.double()) < 1e-5
            dv, _ = bs._sampled_grad(x, dy, meta, with_bias=False)
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
    forced = [p for k, p in meta._groups["plans"].items() if k[2]]
    assert forced and all(p.options.get("GROUP_K", 1) == 1 for p in forced)
    assert any(p.options.get("GROUP") == 2 for p in forced)


# ---- GPU: bf16 / fp16 at real shapes ------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [16, 32, 64, 128])
@pytest.mark.parametrize("I,O", [(1024, 4096), (4096, 1024)])
def test_gpu_real_shapes(dtype, b, I, O, poison, no_tuning):
    torch.backends.cuda.matmul.allow_tf32 = False
    T = 4096 + 37
    gen = torch.Generator().manual_seed(b + I)
    mask = torch.rand(O // b, I // b, generator=gen) < 0.1
    mask[0, 0] = True
    meta = BlockSparseMeta.from_mask(mask, b).to("cuda")
    x = torch.randn(T, I, device="cuda", dtype=dtype, requires_grad=True)
    values = (torch.randn(meta.n_blocks, b, b, device="cuda", dtype=dtype) / b**0.5).requires_grad_()
    bias = torch.randn(O, device="cuda", dtype=dtype, requires_grad=True)
    y = block_sparse_linear(x, values, meta, bias)
    dy = torch.randn_like(y)
    y.backward(dy)
    x32, v32 = x.detach().float(), values.detach().float()
    y_ref = x32 @ values_to_dense(v32, meta).t() + bias.detach().float()
    dx, dv, db = reference_grads(x32, dy.float(), v32, meta)
    for got, ref in ((y, y_ref), (x.grad, dx), (values.grad, dv), (bias.grad, db)):
        assert rel(got, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [32, 64, 128])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "single"])
@pytest.mark.parametrize("host_desc", [False, True])
def test_gpu_wide_and_tma_tiles(dtype, b, pattern, host_desc, poison, monkeypatch):
    """Every transposed-accumulation and TMA candidate (forward, dX, dW) against the fp32 reference, with bias."""
    torch.backends.cuda.matmul.allow_tf32 = False
    monkeypatch.setattr(bs, "TMA_HOST_DESC", host_desc)
    I, O, T = 1024, 2048, 4096 + 37
    gen = torch.Generator().manual_seed(b + len(pattern))
    mask = make_mask(pattern, (O // b, I // b), gen)
    if pattern == "random":
        mask &= torch.rand(mask.shape, generator=gen) < 0.4
    meta = BlockSparseMeta.from_mask(mask, b).to("cuda")
    dds = [c for c in bs._DDS_CANDIDATES[b] if c.wide] + bs._TMA_CANDIDATES[b]
    dws = bs._TMA_DW_CANDIDATES[b]
    assert dds and dws
    x = torch.randn(T, I, device="cuda", dtype=dtype, requires_grad=True)
    values = (torch.randn(meta.n_blocks, b, b, device="cuda", dtype=dtype) / b**0.5).requires_grad_()
    bias = torch.randn(O, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(T, O, device="cuda", dtype=dtype)
    x32, v32 = x.detach().float(), values.detach().float()
    y_ref = x32 @ values_to_dense(v32, meta).t() + bias.detach().float()
    dx, dv, db = reference_grads(x32, dy.float(), v32, meta)
    for i in range(max(len(dds), len(dws))):
        c, w = dds[i % len(dds)], dws[i % len(dws)]
        x.grad = values.grad = bias.grad = None
        with forced_config(fwd=c, dx=c, dw=w):
            y = block_sparse_linear(x, values, meta, bias)
            y.backward(dy)
        for name, got, ref in (("y", y, y_ref), ("dx", x.grad, dx), ("dv", values.grad, dv), ("db", bias.grad, db)):
            assert rel(got, ref) < 1e-2, (name, c, w)


@pytest.mark.gpu
def test_gpu_tma_launch_in_a_fresh_thread():
    """The TMA kernels need Triton's scratch allocator, which is per thread (a context variable): a new thread,
    like the autograd engine's backward thread, starts without it."""
    import threading

    meta = BlockSparseMeta.from_mask(torch.rand(64, 16) < 0.2, 64).to("cuda")
    values = torch.randn(meta.n_blocks, 64, 64, device="cuda", dtype=torch.bfloat16) / 8
    x = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(300, 4096, device="cuda", dtype=torch.bfloat16)
    out = {}

    def work():
        try:
            with forced_config(fwd=bs._TMA_CANDIDATES[64][0], dx=bs._TMA_CANDIDATES[64][0],
                               dw=bs._TMA_DW_CANDIDATES[64][0]):
                out["y"] = bs._dds(x, values, meta, None, forward=True)
                out["dx"] = bs._dds(dy, values, meta, None, forward=False)
                out["dv"] = bs._sampled_grad(x, dy, meta, with_bias=False)[0]
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            out["error"] = e

    th = threading.Thread(target=work)
    th.start()
    th.join()
    assert "error" not in out, out.get("error")
    w = values_to_dense(values.float(), meta)
    assert rel(out["y"], x.float() @ w.t()) < 1e-2
    assert rel(out["dx"], dy.float() @ w) < 1e-2
    assert rel(out["dv"], reference_grads(x.float(), dy.float(), values.float(), meta)[1]) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [16, 64])
def test_gpu_cached_plans_repeated_calls(dtype, b, poison, no_tuning):
    """Launches from cached plans stay right across calls: fresh inputs each call, the token count
    changing and coming back, and a 2-byte-misaligned input (Triton specializes on pointer alignment)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    I, O = 1024, 4096
    gen = torch.Generator().manual_seed(b)
    mask = torch.rand(O // b, I // b, generator=gen) < 0.1
    meta = BlockSparseMeta.from_mask(mask, b).to("cuda")
    for T, misaligned in ((4133, False), (4133, False), (300, False), (4133, True), (4133, False)):
        buf = torch.randn(T * I + 1, device="cuda", dtype=dtype)
        x = (buf[1:] if misaligned else buf[:-1]).view(T, I).detach().requires_grad_()
        values = (torch.randn(meta.n_blocks, b, b, device="cuda", dtype=dtype) / b**0.5).requires_grad_()
        bias = torch.randn(O, device="cuda", dtype=dtype, requires_grad=True)
        y = block_sparse_linear(x, values, meta, bias)
        dy = torch.randn_like(y)
        y.backward(dy)
        x32, v32 = x.detach().float(), values.detach().float()
        y_ref = x32 @ values_to_dense(v32, meta).t() + bias.detach().float()
        dx, dv, db = reference_grads(x32, dy.float(), v32, meta)
        for got, ref in ((y, y_ref), (x.grad, dx), (values.grad, dv), (bias.grad, db)):
            assert rel(got, ref) < 1e-2
    assert len(meta._groups["plans"]) == 3 * 2  # fwd, dx, dw at each of the two token counts


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [16, 32])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "dense", "single"])
def test_gpu_cuda_dds_every_tile(dtype, b, pattern, poison):
    """Every tile of the CUDA X-stationary kernel (csrc/bs_dds.cu), forward X·Wᵀ and input gradient dY·W, vs
    the fp32 reference on fresh inputs: token counts that are not a multiple of the tile (and T = 5), empty
    block rows and columns, density 1, a single block, no bias / bias in the activation dtype / fp32 bias,
    values in the activation dtype and fp32 master values."""
    from sparsetrain.kernels import _blocksparse_cuda as cuda_dds

    torch.backends.cuda.matmul.allow_tf32 = False
    I, O = 512, 1024
    gen = torch.Generator().manual_seed(b + len(pattern))
    meta = BlockSparseMeta.from_mask(make_mask(pattern, (O // b, I // b), gen), b).to("cuda")
    probe = torch.empty(1, O, device="cuda", dtype=dtype)
    tiles = cuda_dds.candidates(probe, b, O)
    assert len(tiles) == len(cuda_dds.CANDIDATES), "the CUDA kernel did not build or a tile does not fit"
    _check_dds_tiles(meta, tiles, I, O, b, dtype)
    plans = list(meta._groups["plans"].values())
    assert len(plans) == 16 * len(tiles) and all(isinstance(p, cuda_dds.CudaDdsPlan) for p in plans)


def _check_dds_tiles(meta, tiles, I, O, b, dtype):
    """Forward and input gradient through each forced tile vs the fp32 reference: T = 1037 and 5, no bias /
    bias in the activation dtype / fp32 bias, values in the activation dtype and fp32 master values."""
    for T in (1000 + 37, 5):
        x = torch.randn(T, I, device="cuda", dtype=dtype)
        g = torch.randn(T, O, device="cuda", dtype=dtype)
        for cfg in tiles:
            for vdt in (dtype, torch.float32):
                values = (torch.randn(meta.n_blocks, b, b, device="cuda") / b**0.5).to(vdt)
                w = values_to_dense(values.float(), meta)
                for bdt in (None, dtype, torch.float32):
                    bias = None if bdt is None else torch.randn(O, device="cuda").to(bdt)
                    with forced_config(fwd=cfg, dx=cfg):
                        y = bs._dds(x, values, meta, bias, forward=True)
                        dx = bs._dds(g, values, meta, None, forward=False)
                    y_ref = x.float() @ w.t() + (0 if bias is None else bias.float())
                    assert rel(y, y_ref) < 1e-2, (cfg, T, vdt, bdt)
                    assert rel(dx, g.float() @ w) < 1e-2, (cfg, T, vdt)


def test_cuda_dds_entry_info_and_warp_ranges():
    """The host side of the CUDA X-stationary kernel (plain torch, so it runs here): the per-entry info
    (value offset / -1 for padding, column of the dense operand, output column, last-of-block flag) and the
    warp ranges, which must be cut at output-block boundaries and cover every entry once."""
    from sparsetrain.kernels._blocksparse_cuda import entry_info, warp_bounds

    mask = torch.tensor([[1, 0, 1], [0, 0, 0], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    meta = BlockSparseMeta.from_mask(mask, 16)
    fwd = entry_info(meta, forward=True).tolist()
    # forward: per block row (output block), the active block columns; row 1 is empty -> one padding entry
    assert fwd == [[0, 0, 0, 0], [256, 32, 0, 1], [-1, 0, 16, 1], [512, 16, 32, 0], [768, 32, 32, 1],
                   [1024, 0, 48, 0], [1280, 16, 48, 0], [1536, 32, 48, 1]]
    # input gradient: per block column, the block rows (transpose metadata), slots as stored
    dx = entry_info(meta, forward=False).tolist()
    slots = {(r, c): s for s, (r, c) in enumerate(mask.nonzero().tolist())}
    expect = []
    for c in range(3):
        rows = [r for r in range(4) if mask[r, c]]
        for i, r in enumerate(rows):
            expect.append([slots[(r, c)] * 256, r * 16, c * 16, int(i == len(rows) - 1)])
    assert dx == expect
    pptr = meta.padded_entries(True, 1)[0]
    for n in (1, 2, 3, 5, 16):
        wb = warp_bounds(pptr, n).tolist()
        assert wb[0] == 0 and wb[-1] == len(fwd) and wb == sorted(wb) and len(wb) == n + 1
        assert set(wb) <= set(pptr.tolist())  # every range starts at an output block's first entry


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "dense", "single"])
@pytest.mark.parametrize("I,O", [(512, 1024), (1024, 512)])  # X staged whole / dY staged whole
def test_gpu_cuda_dw_every_tile(dtype, pattern, I, O):
    """Every tile of the CUDA weight-gradient kernel (csrc/bs_dw.cu) vs the fp32 reference on fresh inputs,
    with and without the fused bias gradient, at token counts that are not a multiple of the chunk."""
    from sparsetrain.kernels import _blocksparse_cuda as cuda_dds

    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator().manual_seed(len(pattern) + I)
    meta = BlockSparseMeta.from_mask(make_mask(pattern, (O // 16, I // 16), gen), 16).to("cuda")
    for T in (3000 + 7, 5):
        x = torch.randn(T, I, device="cuda", dtype=dtype)
        dy = torch.randn(T, O, device="cuda", dtype=dtype)
        tiles = cuda_dds.dw_candidates(x, dy, meta, True)
        assert len(tiles) == len(cuda_dds.DW_CANDIDATES), "the CUDA kernel did not build or a tile does not fit"
        v = torch.zeros(meta.n_blocks, 16, 16, device="cuda")
        _, dv_ref, db_ref = reference_grads(x.float(), dy.float(), v, meta)
        for cfg in tiles:
            for with_bias in (True, False):
                with forced_config(dw=cfg):
                    dv, db = bs._sampled_grad(x, dy, meta, with_bias=with_bias)
                assert rel(dv, dv_ref) < 1e-4, (cfg, T, with_bias)
                if with_bias:
                    assert rel(db, db_ref) < 1e-4, (cfg, T)
    plans = list(meta._groups["plans"].values())
    assert plans and all(isinstance(p, cuda_dds.CudaDwPlan) for p in plans)


def test_cuda_dw_table_covers_every_block_and_bias_column():
    """The weight-gradient kernel's CTA table (plain torch, runs here): every block in exactly one CTA at
    offsets inside that CTA's staged column ranges, strips no wider than STRIP_BLOCKS, and bias ranges that
    partition the output features and lie inside each CTA's staged dY columns; both orientations, empty rows."""
    from sparsetrain.kernels._blocksparse_cuda import STRIP_BLOCKS, dw_table

    gen = torch.Generator().manual_seed(0)
    for O, I in ((1024, 512), (512, 1024), (4096, 1024), (1024, 4096)):
        for d in (0.02, 0.1, 0.5, 1.0):
            mask = torch.rand(O // 16, I // 16, generator=gen) < d
            mask[: mask.shape[0] // 3] = False  # a run of empty block rows
            meta = BlockSparseMeta.from_mask(mask, 16)
            for with_bias in (True, False):
                cta, blk, aw, bw = dw_table(meta, with_bias, 128)
                c, b = cta.tolist(), blk.tolist()
                assert sum(x[1] for x in c) == meta.n_blocks
                assert sorted(x[0] for x in b[: meta.n_blocks]) == list(range(meta.n_blocks))
                for x in c:
                    assert x[1] <= 128 and x[3] <= aw and x[5] <= bw
                    assert min(x[3], x[5]) <= STRIP_BLOCKS * 16  # one operand is a strip
                    for k in range(x[0], x[0] + x[1]):
                        s, ao, bo, _ = b[k]
                        r, cc = int(meta.row_idx[s]), int(meta.col_idx[s])
                        assert (x[2] + ao, x[4] + bo) == (r * 16, cc * 16)
                        assert 0 <= ao < x[3] and 0 <= bo < x[5]
                if with_bias:
                    pos = 0
                    for lo, hi in sorted((x[6], x[7]) for x in c if x[7] > x[6]):
                        assert lo == pos
                        pos = hi
                    assert pos == O
                    assert all(x[2] <= x[6] and x[7] <= x[2] + x[3] for x in c if x[7] > x[6])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "dense", "single"])
def test_gpu_cuda_k_streamed_every_tile(dtype, pattern, poison):
    """The K-streamed CUDA tiles (large K, 16x16 blocks), forward and input gradient, vs the fp32 reference:
    K = 1552 and 1600 (the last K part partial), output-block groups that do not fill the last CTA, T = 1037
    and 5, no bias / 16-bit / fp32 bias, fp32 master values."""
    from sparsetrain.kernels import _blocksparse_cuda as cuda_dds

    torch.backends.cuda.matmul.allow_tf32 = False
    I, O, b = 1552, 1600, 16
    gen = torch.Generator().manual_seed(len(pattern))
    meta = BlockSparseMeta.from_mask(make_mask(pattern, (O // b, I // b), gen), b).to("cuda")
    tiles = cuda_dds.ks_candidates(torch.empty(1, I, device="cuda", dtype=dtype), b, I)
    assert len(tiles) == len(cuda_dds.KS_CANDIDATES), "the CUDA kernel did not build or a tile does not fit"
    _check_dds_tiles(meta, tiles, I, O, b, dtype)
    plans = list(meta._groups["plans"].values())
    assert plans and all(isinstance(p, cuda_dds.CudaKsPlan) for p in plans)


def test_k_streamed_tables():
    """The K-streamed kernel's per-warp entry lists (plain torch, runs here): every active block once per
    product, each warp's entries in (K part, output block, k) order with counts that match, offsets right."""
    from sparsetrain.kernels._blocksparse_cuda import ks_table

    gen = torch.Generator().manual_seed(1)
    mask = torch.rand(13, 21, generator=gen) < 0.3
    mask[2] = False
    meta = BlockSparseMeta.from_mask(mask, 16)
    slots = {(r, c): s for s, (r, c) in enumerate(mask.nonzero().tolist())}
    for forward in (True, False):
        for ob, kp in ((4, 256), (2, 64)):
            info, wstart, counts, n_parts, n_out = ks_table(meta, forward, ob, kp)
            k = meta.in_features if forward else meta.out_features
            assert n_out == (13 if forward else 21) and n_parts == -(-k // kp)
            info, wstart = info.tolist(), wstart.tolist()
            counts = counts.view(-1, n_parts, ob).tolist()
            assert wstart[-1] == meta.n_blocks and len(wstart) == -(-n_out // ob) + 1
            seen = []
            for w in range(len(wstart) - 1):
                e = wstart[w]
                for p in range(n_parts):
                    for j in range(ob):
                        o = w * ob + j
                        ks = [kk for kk in range(k // 16) if o < n_out and kk * 16 // kp == p
                              and (mask[o, kk] if forward else mask[kk, o])]
                        assert counts[w][p][j] == len(ks)
                        for kk in ks:
                            s = slots[(o, kk) if forward else (kk, o)]
                            assert info[e] == [s * 256, kk * 16 - p * kp]
                            seen.append(s)
                            e += 1
                assert e == wstart[w + 1]
            assert sorted(seen) == list(range(meta.n_blocks))


def test_ctypes_signatures_match_the_cuda_sources():
    """Every launcher in ``_cuda.SIGNATURES`` is declared in a ``csrc/*.cu`` file with exactly those argument
    types (a wrong count crashed the process on the GPU once: ctypes cannot check it)."""
    import ctypes
    import re

    from sparsetrain.kernels._runtime import cuda_build as _cuda

    src = "".join(p.read_text() for p in sorted((Path(bs.__file__).parent / "csrc").glob("*.cu")))
    kinds = {"long long": ctypes.c_longlong, "int": ctypes.c_int}
    for name, argtypes in _cuda.SIGNATURES.items():
        m = re.search(rf"\bint {name}\(([^)]*)\)", src)
        assert m, f"{name} is not declared in csrc/"
        params = [" ".join(p.split()[:-1]) for p in m.group(1).split(",")]
        assert [kinds[p] for p in params] == argtypes, name


def _kept_launches(meta: BlockSparseMeta) -> list:
    """The KernelLaunch objects of a meta's cached plans that hold a compiled kernel (direct calls)."""
    from sparsetrain.kernels._runtime.triton_launch import KernelLaunch

    out = []
    for plan in meta._groups.get("plans", {}).values():
        launch = getattr(plan, "launch", None)
        for kl in (launch.by_flag.values() if hasattr(launch, "by_flag") else [launch]):
            if isinstance(kl, KernelLaunch) and kl.compiled is not None:
                out.append(kl)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gather", "tma", "tma_host_desc"])
def test_gpu_direct_launches_match_the_dispatcher(kind, monkeypatch):
    """Plans call the compiled kernel directly after the first launch: bitwise the same outputs and gradients
    as through Triton's dispatcher, over repeated calls, new buffers and a misaligned input (which must take
    the dispatcher again)."""
    from sparsetrain.kernels._runtime import triton_launch as _triton_launch

    monkeypatch.setattr(bs, "TMA_HOST_DESC", kind == "tma_host_desc")
    b = 64
    meta = BlockSparseMeta.from_mask(torch.rand(2048 // b, 1024 // b, generator=torch.Generator().manual_seed(3))
                                     < 0.3, b).to("cuda")
    values = (torch.randn(meta.n_blocks, b, b, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cfgs = ({"fwd": bs._DDS_CANDIDATES[b][0], "dx": bs._DDS_CANDIDATES[b][0], "dw": bs._DW_CANDIDATES[b][1]}
            if kind == "gather" else
            {"fwd": bs._TMA_CANDIDATES[b][0], "dx": bs._TMA_CANDIDATES[b][0], "dw": bs._TMA_DW_CANDIDATES[b][0]})
    buf = torch.randn(777 * 1024 + 8, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(777, 2048, device="cuda", dtype=torch.bfloat16)

    def step(x):
        x = x.detach().requires_grad_()
        values.grad = bias.grad = None
        with forced_config(**cfgs):
            y = block_sparse_linear(x, values, meta, bias)
            y.backward(dy)
        return [t.clone() for t in (y, x.grad, values.grad, bias.grad)]

    inputs = [buf[:777 * 1024].view(777, 1024), buf[8:].view(777, 1024).clone(), buf[1:777 * 1024 + 1].view(777, 1024)]
    results = {}
    for enabled in (False, True):
        monkeypatch.setattr(_triton_launch, "ENABLED", enabled)
        meta._groups.pop("plans", None)
        results[enabled] = [step(x) for x in inputs for _ in range(2)]
        assert bool(_kept_launches(meta)) == enabled
    for got, ref in zip(results[True], results[False]):
        for g, r in zip(got, ref):
            assert torch.equal(g, r)


@pytest.mark.gpu
def test_gpu_cuda_graph_takes_host_descriptors(monkeypatch):
    """Captured in a CUDA graph, the TMA plans switch to host-made descriptors (TMA_HOST_DESC_IN_GRAPHS, the
    default) while eager calls keep device-made ones; replays on fresh inputs copied into the static buffers give
    the eager outputs and gradients and match the fp32 reference."""
    monkeypatch.setattr(bs, "TMA_HOST_DESC", False)
    b, T, I, O = 64, 1000, 1024, 2048
    meta = BlockSparseMeta.from_mask(torch.rand(O // b, I // b, generator=torch.Generator().manual_seed(5)) < 0.3,
                                     b).to("cuda")
    values = (torch.randn(meta.n_blocks, b, b, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    bias = torch.randn(O, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cfgs = {"fwd": bs._TMA_CANDIDATES[b][0], "dx": bs._TMA_CANDIDATES[b][0], "dw": bs._TMA_DW_CANDIDATES[b][0]}
    x_s = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    dy_s = torch.randn(T, O, device="cuda", dtype=torch.bfloat16)

    def step():
        x = x_s.detach().requires_grad_()
        with forced_config(**cfgs):
            y = block_sparse_linear(x, values, meta, bias)
            return (y, *torch.autograd.grad(y, (x, values, bias), dy_s))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()  # builds and caches the plans (device-made descriptors)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    tma_plans = [p for p in meta._groups["plans"].values() if hasattr(getattr(p, "launch", None), "by_flag")]
    assert len(tma_plans) == 3 and all(set(p.launch.by_flag) == {False, True} for p in tma_plans)
    w = values_to_dense(values.detach().float(), meta)
    for seed in range(2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x_s.copy_(torch.randn(T, I, device="cuda", generator=gen))
        dy_s.copy_(torch.randn(T, O, device="cuda", generator=gen))
        graph.replay()
        eager = step()
        xf, gf = x_s.float(), dy_s.float()
        refs = (xf @ w.t() + bias.float(), gf @ w, dense_to_values(gf.t() @ xf, meta), gf.sum(0))
        for got, e, ref in zip(static_out, eager, refs):
            assert rel(got, e) < 1e-3 and rel(got, ref) < 1e-2


def test_tma_descriptor_kind_follows_graph_capture(monkeypatch):
    """Host-made TMA descriptors: always with TMA_HOST_DESC; otherwise only on a CUDA device while a graph is
    being captured, unless TMA_HOST_DESC_IN_GRAPHS is off. CPU tensors (the interpreter) never ask CUDA."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    monkeypatch.setattr(bs, "TMA_HOST_DESC", False)
    monkeypatch.setattr(bs, "TMA_HOST_DESC_IN_GRAPHS", True)
    assert not bs._host_desc(cuda) and not bs._host_desc(cpu)
    capturing[0] = True
    assert bs._host_desc(cuda) and not bs._host_desc(cpu)
    monkeypatch.setattr(bs, "TMA_HOST_DESC_IN_GRAPHS", False)
    assert not bs._host_desc(cuda)
    monkeypatch.setattr(bs, "TMA_HOST_DESC", True)
    capturing[0] = False
    assert bs._host_desc(cuda) and bs._host_desc(cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "single"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_dense_fallback_candidate_matches_dense(dtype, pattern, with_bias, poison):
    """The dense fallback (DenseConfig: scatter the blocks into W / gather them from dYᵀ·X around cuBLAS) forced
    for all three products gives the masked dense layer's outputs and gradients (plain torch, so it runs here)."""
    dense = bs.DenseConfig()
    with forced_config(fwd=dense, dx=dense, dw=dense):
        run_against_dense(37, 64, 96, 16, pattern, dtype, with_bias, seed=len(pattern))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [16, 64])
def test_gpu_dense_fallback_candidate(dtype, b, poison):
    """The dense fallback on the GPU vs the fp32 reference: forward and input gradient through the same cases
    as the CUDA tiles (bias kinds, fp32 master values), and the weight gradient with float32 output."""
    torch.backends.cuda.matmul.allow_tf32 = False
    I, O = 512, 1024
    gen = torch.Generator().manual_seed(b)
    meta = BlockSparseMeta.from_mask(make_mask("random", (O // b, I // b), gen), b).to("cuda")
    _check_dds_tiles(meta, [bs.DenseConfig()], I, O, b, dtype)
    x = torch.randn(1037, I, device="cuda", dtype=dtype)
    dy = torch.randn(1037, O, device="cuda", dtype=dtype)
    _, dv_ref, db_ref = reference_grads(x.float(), dy.float(), torch.zeros(meta.n_blocks, b, b, device="cuda"), meta)
    with forced_config(dw=bs.DenseConfig()):
        dv, db = bs._sampled_grad(x, dy, meta, with_bias=True, out_dtype=torch.float32)
    plan = next(p for p in meta._groups["plans"].values() if isinstance(p, bs._DenseDwPlan))
    assert dv.dtype == torch.float32
    assert rel(dv, dv_ref) < (1e-4 if plan.f32_out else 1e-2) and rel(db, db_ref) < 1e-4


@pytest.mark.parametrize("kind", ["tma", "gather", "dense"])
def test_cached_plans_keep_no_call_tensors(kind):
    """A cached launch plan must not keep the tensors of the call that built it (activations, gradients,
    outputs): the TMA plans once did, through their lazily built fallback, which raised the peak memory of a
    BERT-base step with 64x64 blocks from 0.87x to 1.07x of dense (docs/blocksparse.md, round 7)."""
    import gc
    import weakref

    cfgs = {"tma": {"fwd": TmaDdsConfig(16, 4, 1), "dx": TmaDdsConfig(16, 4, 1), "dw": TmaDwConfig(16, 4, 1, 1)},
            "gather": {"fwd": bs._INTERP_DDS[64], "dx": bs._INTERP_DDS[64], "dw": bs._INTERP_DW[64]},
            "dense": {"fwd": bs.DenseConfig(), "dx": bs.DenseConfig(), "dw": bs.DenseConfig()}}[kind]
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


def test_dense_fallback_is_offered_on_cuda_unless_turned_off(monkeypatch):
    """The tuner's candidate lists get the dense fallback for CUDA tensors only, and not with
    SPARSETRAIN_DENSE_FALLBACK=0 (DENSE_FALLBACK False)."""
    cpu = torch.empty(2, 2)
    cuda_like = torch.empty(2, 2, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t.device.type in ("cuda", "meta")))
    assert bs._dense_candidates(cpu) == [] and bs._dense_candidates(cuda_like) == [bs.DenseConfig()]
    monkeypatch.setattr(bs, "DENSE_FALLBACK", False)
    assert bs._dense_candidates(cuda_like) == []


def test_tuner_takes_the_dense_fallback_only_by_a_margin():
    """The tuner times GPU time only; the dense fallback also costs host work, so it must beat the best block
    kernel by DENSE_MARGIN to be chosen. Among block kernels the fastest wins."""
    a, b = bs.DdsConfig(64, 1, 1, 4, 2), bs.DdsConfig(128, 1, 1, 4, 2)
    dense = bs.DenseConfig()
    near = bs.DENSE_MARGIN * 1.0 + 0.01  # dense a little faster than the best kernel, not by the margin
    assert bs._choose([(a, 1.2), (b, 1.0), (dense, near)]) == b
    assert bs._choose([(dense, near), (a, 1.0)]) == a
    assert bs._choose([(a, 1.0), (dense, bs.DENSE_MARGIN - 0.01)]) == dense
    assert bs._choose([(dense, 5.0)]) == dense
    assert bs._choose([(a, 0.9), (b, 1.0)]) == a


def test_dense_margin_from_the_environment_is_checked(monkeypatch):
    monkeypatch.delenv("SPARSETRAIN_DENSE_MARGIN", raising=False)
    assert bs._margin_from_env("SPARSETRAIN_DENSE_MARGIN", 0.85) == 0.85
    monkeypatch.setenv("SPARSETRAIN_DENSE_MARGIN", "1")
    assert bs._margin_from_env("SPARSETRAIN_DENSE_MARGIN", 0.85) == 1.0
    for bad in ("abc", "0", "1.5", "nan"):
        monkeypatch.setenv("SPARSETRAIN_DENSE_MARGIN", bad)
        with pytest.raises(ValueError, match="SPARSETRAIN_DENSE_MARGIN"):
            bs._margin_from_env("SPARSETRAIN_DENSE_MARGIN", 0.85)


def test_raw_stream_reads_the_device_index(monkeypatch):
    from sparsetrain.kernels._runtime import device as _device

    monkeypatch.setattr(_device, "_RAW_STREAM", lambda idx: 1000 + idx)
    assert _device.raw_stream(torch.device("cuda", 3)) == 1003


@pytest.mark.gpu
def test_gpu_raw_stream_is_the_current_stream():
    from sparsetrain.kernels._runtime.device import raw_stream

    dev = torch.device("cuda", torch.cuda.current_device())
    assert raw_stream(dev) == torch.cuda.current_stream(dev).cuda_stream
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert raw_stream(dev) == side.cuda_stream != torch.cuda.default_stream(dev).cuda_stream
        assert raw_stream(torch.device("cuda")) == side.cuda_stream


def test_dense_fallback_report_pairs_best_kernel_and_dense_times(monkeypatch):
    a, b, dense = bs.DdsConfig(64, 1, 1, 4, 2), bs.DdsConfig(128, 1, 1, 4, 2), bs.DenseConfig()
    monkeypatch.setattr(bs, "_TIMED", {("k1",): [(a, 0.3), (b, 0.2), (dense, 0.25)], ("k2",): [(a, 0.4)],
                                       ("k3",): [(a, 0.5), (dense, 0.1)]})
    monkeypatch.setattr(bs, "_TUNED", {("k1",): b, ("k2",): a, ("k3",): dense})
    assert bs.dense_fallback_report() == [
        {"key": "('k1',)", "kernel_ms": 0.2, "dense_ms": 0.25, "chosen": "kernel"},
        {"key": "('k3',)", "kernel_ms": 0.5, "dense_ms": 0.1, "chosen": "dense"}]
