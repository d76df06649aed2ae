"""2:4 kernels: the Triton mask kernel vs its plain-torch reference (CPU interpreter), the mask custom op and
the traceable masked-dense linear (``semi24_dense_linear``) on CPU, and on the device (``pytest -m gpu``) the
fused cuSPARSELt packing, algorithm choice and linear vs the masked-dense reference."""
import pytest
import torch

from sparsetrain.kernels.semi24 import (
    NPAT,
    PATTERNS,
    SPARSE_DTYPES,
    compress,
    cslt_pack_reference,
    cslt_unpack_reference,
    is_transposable24,
    select_alg,
    semi24_dense_linear,
    semi24_linear,
    semi24_linear_reference,
    sparse_mm_t,
    transposable24,
    transposable24_mask,
    transposable24_reference,
)


def _tiles(x: torch.Tensor) -> torch.Tensor:
    n, k = x.shape
    return x.reshape(n // 4, 4, k // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)


def _all_valid_patterns() -> torch.Tensor:
    """Independent enumeration: every 16-bit set whose 4x4 tile has two ones per row and per column."""
    b = torch.arange(1 << 16)
    cells = ((b[:, None] >> torch.arange(16)) & 1).reshape(-1, 4, 4)
    ok = (cells.sum(1) == 2).all(1) & (cells.sum(2) == 2).all(1)
    return cells[ok].reshape(-1, 16).float()


def _chosen_vs_best(weight: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = _tiles(weight.abs().double().cpu())
    chosen = (a * _tiles(mask.cpu()).double()).sum(1)
    best = (a @ _all_valid_patterns().double().t()).max(1).values
    return chosen, best


def test_pattern_table_is_complete():
    assert NPAT == 90 and len(set(PATTERNS)) == 90
    indep = {int(sum(int(v) << i for i, v in enumerate(row))) for row in _all_valid_patterns().long()}
    assert indep == set(PATTERNS)


@pytest.mark.parametrize("shape", [(8, 8), (32, 48)])
def test_reference_keeps_most_magnitude(shape):
    w = torch.randn(shape)
    mask, wm = transposable24_reference(w)
    assert is_transposable24(mask) and int(mask.sum()) == w.numel() // 2
    chosen, best = _chosen_vs_best(w, mask)
    torch.testing.assert_close(chosen, best, rtol=1e-6, atol=0)
    assert torch.equal(wm, w * mask)


@pytest.mark.parametrize("shape", [(16, 64), (48, 80), (64, 136)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_matches_reference(shape, dtype):
    w = torch.randn(shape, dtype=dtype)
    mask, wm, wmt, _, _ = transposable24(w, write_transposed=True, out_dtype=torch.float16)
    ref_mask, ref_wm = transposable24_reference(w, out_dtype=torch.float16)
    assert is_transposable24(mask) and int(mask.sum()) == w.numel() // 2
    # magnitudes are ranked after rounding to fp16; their sums are exact in fp32: the same choice, ties too
    assert torch.equal(mask, ref_mask)
    chosen, best = _chosen_vs_best(w.half(), mask)
    torch.testing.assert_close(chosen, best, rtol=1e-6, atol=0)
    assert torch.equal(wm, (w * mask).half()) and torch.equal(wm, ref_wm)
    assert torch.equal(wmt, wm.t())


def test_kernel_writes_into_mask_out_and_rejects_bad_input():
    w = torch.randn(16, 32, dtype=torch.float16)
    out = torch.zeros(16, 32, dtype=torch.bool)
    mask = transposable24(w, mask_out=out).mask
    assert mask is out and torch.equal(out, transposable24_reference(w)[0])
    with pytest.raises(ValueError, match="2-D"):
        transposable24(torch.randn(2, 16, 32))
    with pytest.raises(ValueError, match="multiples of 4"):
        transposable24(torch.randn(6, 32))
    with pytest.raises(TypeError, match="dtype"):
        transposable24(torch.ones(16, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="mask_out"):
        transposable24(w, mask_out=torch.zeros(16, 16, dtype=torch.bool))
    with pytest.raises(ValueError, match="divisible by 64"):
        transposable24(w, pack=True)


@pytest.mark.parametrize("shape", [(64, 64), (128, 192), (192, 128)])
def test_kernel_packs_like_the_reference_and_unpacks(shape):
    w = torch.randn(shape, dtype=torch.float16)
    r = transposable24(w, pack=True, pack_t=True)
    assert r.wmt is None and torch.equal(r.mask, transposable24_reference(w)[0])
    ref = cslt_pack_reference(r.wm, r.mask)
    ref_t = cslt_pack_reference(r.wm.t().contiguous(), r.mask.t().contiguous())
    assert torch.equal(r.packed.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(r.packed_t.view(torch.int16), ref_t.view(torch.int16))
    assert torch.equal(cslt_unpack_reference(r.packed, *shape), r.wm)
    assert torch.equal(cslt_unpack_reference(r.packed_t, shape[1], shape[0]), r.wm.t())


# ---- the mask custom op and the traceable dense mode (CPU) -----------------------------------------------
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.float16, torch.float16)])
def test_mask_op_writes_the_reference_mask(dtype, out_dtype):
    w = torch.randn(32, 48, dtype=dtype)
    out = torch.zeros(32, 48, dtype=torch.bool)
    ret = torch.ops.sparsetrain.transposable24_mask(w, out, out_dtype)
    assert ret is None
    assert torch.equal(out, transposable24_reference(w, out_dtype)[0])
    out2 = torch.ones(32, 48, dtype=torch.bool)
    transposable24_mask(w, out2, out_dtype)  # the CustomOpDef itself: the same op
    assert torch.equal(out2, out) and is_transposable24(out) and int(out.sum()) == w.numel() // 2


def test_mask_op_fake_registration():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    w, m = torch.randn(16, 32), torch.zeros(16, 32, dtype=torch.bool)
    result = torch.library.opcheck(torch.ops.sparsetrain.transposable24_mask.default, (w, m, torch.float32))
    assert all(v == "SUCCESS" for v in result.values()), result
    with FakeTensorMode():
        fw, fm = torch.empty(16, 32), torch.empty(16, 32, dtype=torch.bool)
        assert torch.ops.sparsetrain.transposable24_mask(fw, fm, torch.bfloat16) is None
        assert isinstance(fm, FakeTensor) and fm.shape == (16, 32) and fm.dtype == torch.bool


def _dense_linear_case(bias: bool, lead=(3, 5), in_f=64, out_f=32):
    x = torch.randn(*lead, in_f, requires_grad=True)
    w = torch.randn(out_f, in_f, requires_grad=True)
    b = torch.randn(out_f, requires_grad=True) if bias else None
    return x, w, b


def _grads(y, g, *ts):
    y.backward(g)
    out = [t.grad.clone() if t is not None else None for t in ts]
    for t in ts:
        if t is not None:
            t.grad = None
    return out


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("recompute", [True, False])
def test_dense_linear_equals_reference(bias, recompute):
    x, w, b = _dense_linear_case(bias)
    given = transposable24_reference(torch.randn_like(w))[0]  # some other transposable mask
    mask = given.clone() if not recompute else torch.zeros_like(given)
    y = semi24_dense_linear(x, w, b, mask, recompute=recompute)
    want_mask = transposable24_reference(w)[0] if recompute else given
    assert torch.equal(mask, want_mask)  # recompute: written in place; else used as given, untouched
    g = torch.randn_like(y)
    got = [y.detach(), *_grads(y, g, x, w, b)]
    yr = semi24_linear_reference(x, w, want_mask, b)
    want = [yr.detach(), *_grads(yr, g, x, w, b)]
    for a, e in zip(got, want):
        if e is None:
            assert a is None
        else:
            torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6)
    # the semantics, spelled out: dx = dY (W⊙M), dW = dYᵀ x dense to ALL of W (straight-through), db = Σ dY
    g2, x2 = g.reshape(-1, 32), x.detach().reshape(-1, 64)
    torch.testing.assert_close(got[1].reshape(-1, 64), g2 @ (w.detach() * want_mask), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[2], g2.t() @ x2, rtol=1e-5, atol=1e-5)
    assert (got[2][~want_mask] != 0).any()
    if bias:
        torch.testing.assert_close(got[3], g2.sum(0), rtol=1e-5, atol=1e-5)


def test_dense_linear_ranks_in_the_autocast_dtype():
    x, w, b = _dense_linear_case(True)
    mask = torch.zeros(32, 64, dtype=torch.bool)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = semi24_dense_linear(x, w, b, mask)
    assert y.dtype == torch.bfloat16
    assert torch.equal(mask, transposable24_reference(w, torch.bfloat16)[0])
    yr = torch.nn.functional.linear(x.bfloat16(), (w * mask).bfloat16(), b.bfloat16())
    assert torch.equal(y, yr)
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


@pytest.mark.parametrize("autocast", [False, True])
def test_dense_linear_compiles_without_graph_break(autocast):
    import torch._dynamo

    def fn(x, w, b, m):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return semi24_dense_linear(x, w, b, m)

    torch._dynamo.reset()
    x, w, b = _dense_linear_case(True)
    mask = torch.zeros(32, 64, dtype=torch.bool)
    explain = torch._dynamo.explain(fn)(x, w, b, mask)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    ops = [n.target for n in explain.graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.sparsetrain.transposable24_mask.default in ops
    # compiled (aot_eager: functionalized, the mutation of the mask written back) == eager
    mask.zero_()
    y = torch.compile(fn, backend="aot_eager", fullgraph=True)(x, w, b, mask)
    dtype = torch.bfloat16 if autocast else torch.float32
    assert torch.equal(mask, transposable24_reference(w, dtype)[0])
    g = torch.randn_like(y)
    got = [y.detach(), *_grads(y, g, x, w, b)]
    mask2 = torch.zeros_like(mask)
    ye = fn(x, w, b, mask2)
    want = [ye.detach(), *_grads(ye, g, x, w, b)]
    assert torch.equal(mask2, mask)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()


# ---- on the device ---------------------------------------------------------------------------------------
def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# fp16 ids let the device run bf16 first and fp16 in its own process (pytest -m gpu -k fp16)
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 1024), (4096, 16384)])
@pytest.mark.parametrize("dtype", DTYPES + [pytest.param(torch.float32, id="fp32")])
def test_gpu_kernel_matches_reference(shape, dtype):
    w = torch.randn(shape, device="cuda", dtype=dtype)
    mask, wm, wmt, _, _ = transposable24(w, write_transposed=True, out_dtype=torch.bfloat16)
    ref_mask, ref_wm = transposable24_reference(w, out_dtype=torch.bfloat16)
    assert is_transposable24(mask) and int(mask.sum()) == w.numel() // 2
    assert torch.equal(mask, ref_mask)
    assert torch.equal(wm, ref_wm) and torch.equal(wmt, wm.t())
    if dtype == torch.float32:  # fp32 compute dtype: ranked at tf32 precision, optimal to ~1e-3
        mask32, wm32 = transposable24(w)[:2]
        assert is_transposable24(mask32) and torch.equal(wm32, w * mask32)
        chosen, best = _chosen_vs_best(w, mask32)
        assert (chosen >= best * (1 - 2e-3)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1024, 4096), (4096, 1024), (4096, 16384), (192, 320)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_pack_equals_cusparselt_compress(shape, dtype):
    w = torch.randn(shape, device="cuda", dtype=dtype)
    r = transposable24(w, pack=True, pack_t=True)
    assert torch.equal(r.packed.view(torch.int16), compress(r.wm).view(torch.int16))
    assert torch.equal(r.packed_t.view(torch.int16), compress(r.wm.t().contiguous()).view(torch.int16))
    if dtype in SPARSE_DTYPES:  # products only where cuSPARSELt is used (fp16 faulted the H200 context)
        x = torch.randn(512, shape[1], device="cuda", dtype=dtype)
        y = sparse_mm_t(r.packed, x, select_alg(shape[0], shape[1], 512, dtype))
        assert _rel(y, x.float() @ r.wm.float().t()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["24", "24fwd", "dense"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,in_f,out_f,bias", [(16384, 1024, 4096, True), (16384, 4096, 1024, False),
                                                     (13001, 1024, 4096, True), (1000, 4096, 16384, True)])
def test_gpu_linear_matches_masked_dense(mode, dtype, tokens, in_f, out_f, bias):
    w = (torch.randn(out_f, in_f, device="cuda") * in_f ** -0.5).requires_grad_()
    b = torch.randn(out_f, device="cuda", requires_grad=True) if bias else None
    x = torch.randn(tokens, in_f, device="cuda", dtype=dtype, requires_grad=True)
    mask = torch.empty(out_f, in_f, dtype=torch.bool, device="cuda")
    with torch.autocast("cuda", dtype=dtype):
        y = semi24_linear(x, w, b, mode=mode, mask_out=mask)
    assert y.dtype == dtype and y.shape == (tokens, out_f)
    assert torch.equal(mask, transposable24_reference(w, out_dtype=dtype)[0])
    g = torch.randn_like(y)
    y.backward(g)
    xr, wr = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    br = b.detach().clone().requires_grad_() if bias else None
    yr = semi24_linear_reference(xr, wr, mask, br)
    yr.backward(g.float())
    assert _rel(y, yr) < 1e-2
    assert _rel(x.grad, xr.grad) < 1e-2
    assert _rel(w.grad, wr.grad) < 1e-2 and w.grad.dtype == torch.float32
    if bias:
        assert _rel(b.grad, br.grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,tokens", [(4096, 1024, 12608), (1024, 4096, 13008)])
def test_gpu_selected_alg_is_correct_on_fresh_data(m, k, tokens):
    choice = select_alg(m, k, tokens, torch.bfloat16)
    assert choice is not None and choice.rel_err < 1e-2
    am = transposable24(torch.randn(m, k, device="cuda", dtype=torch.bfloat16)).wm
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    y = sparse_mm_t(compress(am), x, choice)
    assert _rel(y, x.float() @ am.float().t()) < 1e-2
