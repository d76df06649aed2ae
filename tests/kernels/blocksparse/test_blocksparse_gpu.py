"""The Triton kernels on the GPU at real shapes, bf16/fp16 (``pytest -m gpu`` on the device machine): every
wide and TMA tile, cached plans, direct launches vs the dispatcher, CUDA-graph capture, the dense fallback."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from blocksparse_cases import check_dds_tiles, check_fwd_bwd, make_mask, rel

from sparsetrain.kernels import use_kernel_options
from sparsetrain.kernels.blocksparse import dense, gather, plans, tma, tuner
from sparsetrain.kernels.blocksparse.dense import DenseConfig
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.op import block_sparse_linear
from sparsetrain.kernels.blocksparse.reference import dense_to_values, reference_grads, values_to_dense
from sparsetrain.kernels.blocksparse.testing import forced_config


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
    check_fwd_bwd(x, values, bias, meta)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b", [32, 64, 128])
@pytest.mark.parametrize("pattern", ["random", "empty_rows_cols", "single"])
def test_gpu_wide_and_tma_tiles(dtype, b, pattern, poison):
    """Every transposed-accumulation and TMA candidate (forward, dX, dW) against the fp32 reference, with bias."""
    torch.backends.cuda.matmul.allow_tf32 = False
    I, O, T = 1024, 2048, 4096 + 37
    gen = torch.Generator().manual_seed(b + len(pattern))
    mask = make_mask(pattern, (O // b, I // b), gen)
    if pattern == "random":
        mask &= torch.rand(mask.shape, generator=gen) < 0.4
    meta = BlockSparseMeta.from_mask(mask, b).to("cuda")
    dds = [c for c in gather.DDS_CANDIDATES[b] if c.wide] + tma.DDS_CANDIDATES[b]
    dws = tma.DW_CANDIDATES[b]
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
            with forced_config(fwd=tma.DDS_CANDIDATES[64][0], dx=tma.DDS_CANDIDATES[64][0],
                               dw=tma.DW_CANDIDATES[64][0]):
                out["y"] = plans.dds(x, values, meta, None, forward=True)
                out["dx"] = plans.dds(dy, values, meta, None, forward=False)
                out["dv"] = plans.sampled_grad(x, dy, meta, with_bias=False)[0]
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
        check_fwd_bwd(x, values, bias, meta)
    assert len(meta._groups["plans"]) == 3 * 2  # fwd, dx, dw at each of the two token counts



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
@pytest.mark.parametrize("kind", ["gather", "tma"])
def test_gpu_direct_launches_match_the_dispatcher(kind):
    """Plans call the compiled kernel directly after the first launch: bitwise the same outputs and gradients
    as through Triton's dispatcher, over repeated calls, new buffers and a misaligned input (which must take
    the dispatcher again)."""
    b = 64
    meta = BlockSparseMeta.from_mask(torch.rand(2048 // b, 1024 // b, generator=torch.Generator().manual_seed(3))
                                     < 0.3, b).to("cuda")
    values = (torch.randn(meta.n_blocks, b, b, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cfgs = ({"fwd": gather.DDS_CANDIDATES[b][0], "dx": gather.DDS_CANDIDATES[b][0], "dw": gather.DW_CANDIDATES[b][1]}
            if kind == "gather" else
            {"fwd": tma.DDS_CANDIDATES[b][0], "dx": tma.DDS_CANDIDATES[b][0], "dw": tma.DW_CANDIDATES[b][0]})
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
        meta._groups.pop("plans", None)
        with use_kernel_options(fast_launch=enabled):
            results[enabled] = [step(x) for x in inputs for _ in range(2)]
        assert bool(_kept_launches(meta)) == enabled
    for got, ref in zip(results[True], results[False]):
        for g, r in zip(got, ref):
            assert torch.equal(g, r)


@pytest.mark.gpu
def test_gpu_cuda_graph_takes_host_descriptors():
    """Captured in a CUDA graph, the TMA plans switch to host-made descriptors while eager calls keep device-made
    ones; replays on fresh inputs copied into the static buffers give the eager outputs and gradients and match
    the fp32 reference."""
    b, T, I, O = 64, 1000, 1024, 2048
    meta = BlockSparseMeta.from_mask(torch.rand(O // b, I // b, generator=torch.Generator().manual_seed(5)) < 0.3,
                                     b).to("cuda")
    values = (torch.randn(meta.n_blocks, b, b, device="cuda", dtype=torch.bfloat16) / 8).requires_grad_()
    bias = torch.randn(O, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cfgs = {"fwd": tma.DDS_CANDIDATES[b][0], "dx": tma.DDS_CANDIDATES[b][0], "dw": tma.DW_CANDIDATES[b][0]}
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
    check_dds_tiles(meta, [DenseConfig()], I, O, b, dtype)
    x = torch.randn(1037, I, device="cuda", dtype=dtype)
    dy = torch.randn(1037, O, device="cuda", dtype=dtype)
    _, dv_ref, db_ref = reference_grads(x.float(), dy.float(), torch.zeros(meta.n_blocks, b, b, device="cuda"), meta)
    with forced_config(dw=DenseConfig()):
        dv, db = plans.sampled_grad(x, dy, meta, with_bias=True, out_dtype=torch.float32)
    plan = next(p for p in meta._groups["plans"].values() if isinstance(p, dense.DwPlan))
    assert dv.dtype == torch.float32
    assert rel(dv, dv_ref) < (1e-4 if plan.f32_out else 1e-2) and rel(db, db_ref) < 1e-4



class _WrongConfig(NamedTuple):
    """A candidate whose plan writes zeros: the fastest there is, and wrong."""

    zeros: bool = True


@pytest.mark.gpu
def test_gpu_tuning_never_chooses_a_fast_wrong_candidate():
    """Tuning on the GPU times every candidate; one whose result disagrees with the first candidate's is left out
    (with a warning) however fast it is, and the layer computes the right product."""
    import warnings

    class Zeros:
        out_width = 0

        def __init__(self, p):
            self.out_width = (p.meta.grid[0] if p.forward else p.meta.grid[1]) * p.meta.block

        def __call__(self, a, values, bias, out):
            out.zero_()

    tuner.register_backend(tuner.Backend("wrong", (_WrongConfig,), lambda p: [] if p.kind == "dw" else [_WrongConfig()],
                                         lambda cfg, p: Zeros(p)))
    try:
        gen = torch.Generator().manual_seed(3)
        meta = BlockSparseMeta.from_mask(torch.rand(64, 16, generator=gen) < 0.1, 16).to("cuda")
        x = torch.randn(4096, 256, device="cuda", dtype=torch.bfloat16)
        values = torch.randn(meta.n_blocks, 16, 16, device="cuda", dtype=torch.bfloat16) / 4
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            y = plans.dds(x, values, meta, None, forward=True)
        chosen = [v for k, v in tuner.tuned_configs().items() if "'fwd'" in k]
        assert chosen and not any("_WrongConfig" in c for c in chosen)
        assert any("disagrees" in str(w.message) for w in caught)
        assert rel(y, x.float() @ values_to_dense(values.float(), meta).t()) < 1e-2
    finally:
        tuner.unregister_backend("wrong")


@pytest.mark.gpu
@pytest.mark.parametrize("b", [16, 32, 64, 128])
def test_gpu_three_piece_products_every_candidate(b, poison):
    """A fused query/key/value projection's products in three pieces (forward writing q, k, v; input and weight
    gradients reading dq, dk, dv in place), bf16 at BERT-base's shape, every candidate the backends offer for
    them (CUDA at 16/32, gather, the dense fallback's three GEMMs; no TMA) against the fp32 reference on the
    concatenated tensors; then the custom ops compiled by inductor against the split output."""
    torch.backends.cuda.matmul.allow_tf32 = False
    from sparsetrain.kernels.blocksparse.parts import block_sparse_linear_parts
    from sparsetrain.kernels.blocksparse.tuner import Product

    I, O, T = 768, 3 * 768, 4096 + 37
    gen = torch.Generator().manual_seed(b)
    mask = torch.rand(O // b, I // b, generator=gen) < 0.2
    mask[0, 0] = True
    meta = BlockSparseMeta.from_mask(mask, b).to("cuda")
    assert plans.parts_native(meta)
    dt = torch.bfloat16
    x = torch.randn(T, I, device="cuda", dtype=dt)
    values = torch.randn(meta.n_blocks, b, b, device="cuda", dtype=dt) / b**0.5
    bias = torch.randn(O, device="cuda", dtype=dt)
    dys = [torch.randn(T, O // 3, device="cuda", dtype=dt) for _ in range(3)]
    x32, v32, dy32 = x.float(), values.float(), torch.cat(dys, 1).float()
    w = values_to_dense(v32, meta)
    y_ref = x32 @ w.t() + bias.float()
    _, dv_ref, db_ref = reference_grads(x32, dy32, v32, meta)
    backends = set()
    p_fwd = Product("fwd", meta, x, values, True, parts=3)
    for c in tuner.candidates(p_fwd):
        backends.add(tuner.backend_of(c).name)
        outs = [torch.full((T, O // 3), float("nan"), device="cuda", dtype=dt) for _ in range(3)]
        tuner.make_plan(c, p_fwd)(x, values, bias, outs[0], outs[0], outs[0], x, x, outs[1], outs[2])
        assert rel(torch.cat(outs, 1), y_ref) < 1e-2, c
    p_dx = Product("dx", meta, dys[0], values, False, parts=3)
    for c in tuner.candidates(p_dx):
        dx = torch.full((T, I), float("nan"), device="cuda", dtype=dt)
        tuner.make_plan(c, p_dx)(dys[0], values, dys[0], dx, dx, dx, dys[1], dys[2], dx, dx)
        assert rel(dx, dy32 @ w) < 1e-2, c
    p_dw = Product("dw", meta, x, dys[0], True, parts=3)
    for c in tuner.candidates(p_dw):
        dv, db = plans.run_dw(tuner.make_plan(c, p_dw), x, dys[0], meta, True, torch.float32, dys[1:])
        assert rel(dv, dv_ref) < 1e-2 and rel(db, db_ref) < 1e-2, c
    assert "tma" not in backends and {"gather", "dense"} <= backends and (b > 32 or "cuda" in backends)

    xs = x.view(1, T, I).detach().requires_grad_()
    vs = values.float().requires_grad_()
    bs = bias.float().requires_grad_()

    def run(fn):
        for t in (xs, vs, bs):
            t.grad = None
        with torch.autocast("cuda", dtype=dt):
            pieces = fn(xs, vs, meta, bs)
        sum((p.float() * g.view(1, T, -1).float()).sum() for p, g in zip(pieces, dys, strict=True)).backward()
        return [p.detach().float() for p in pieces] + [t.grad.float().clone() for t in (xs, vs, bs)]

    want = run(lambda x_, v_, m_, b_: block_sparse_linear(x_, v_, m_, b_).split(O // 3, dim=-1))
    torch._dynamo.reset()
    got = run(torch.compile(block_sparse_linear_parts, fullgraph=True))
    torch._dynamo.reset()
    for name, g, r in zip(["q", "k", "v", "dx", "dv", "db"], got, want, strict=True):
        assert rel(g, r) < 1e-2, name
