"""Block-sparse kernels on a GPU: correctness (bf16 + fp16 vs the plain-torch reference) and timings of
ours vs dense cuBLAS ``nn.Linear`` vs torch's ``bsr_dense_mm`` (forward only: it has no backward), plus
parameter + Adam memory and a BERT-base MLM training step. Ratios are measured side by side in one run.

    PYTHONUNBUFFERED=1 python scripts/bench_blocksparse.py --check-all-configs --bert-profile

Writes ``$OUT/bench_blocksparse.json`` (or ./ when OUT is unset) and prints a short table last.
Options: ``--shapes 1024x4096,4096x1024`` (in x out), ``--blocks 16,32,64``, ``--densities 0.5,0.25,0.1``,
``--tokens 16384``, ``--check-all-configs`` (run every tile candidate through the correctness check),
``--sections host`` (per-call Python/launch cost at a tiny token count).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import sparsetrain.kernels.blocksparse as bs
from sparsetrain.kernels.blocksparse import BlockSparseMeta, block_sparse_linear
from sparsetrain.kernels.blocksparse_reference import reference_grads, values_to_dense
from sparsetrain.sparsity.layout import Block, n_active_blocks, random_mask

DEV = "cuda"
R: dict = {}
LOG: list[str] = []


def say(msg: str) -> None:
    print(msg, flush=True)
    LOG.append(msg)


def bench(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median")


def gpu_time(fn, iters: int = 20) -> float:
    """GPU busy time of one call of ``fn`` in ms: the summed durations of every kernel, memset and copy it
    launches (torch.profiler), averaged over ``iters`` calls. Unlike ``bench`` it leaves out the gaps where the
    GPU waits for the host, so a host-bound call shows what its kernels cost."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    return us / iters / 1e3


def graph_time(fn) -> float | None:
    """Wall time of one replay of ``fn`` captured in a CUDA graph (ms): what a call costs once the host work of
    launching it is gone (CUDA graphs, ``torch.compile(mode="reduce-overhead")``). None if it cannot be captured.
    Its autograd leaves must be fresh (first used here): older ones keep the default stream of their gradient
    nodes, which a capture on another stream cannot depend on."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return bench(graph.replay)
    except Exception:  # noqa: BLE001 - reported as missing, the eager numbers still stand
        traceback.print_exc()
        return None


def make_mask(out_f: int, in_f: int, b: int, density: float, seed: int) -> torch.Tensor:
    k = n_active_blocks((out_f, in_f), Block(b, b), density)
    return random_mask((out_f // b, in_f // b), k, torch.Generator().manual_seed(seed))


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    if not torch.isfinite(a).all():
        return float("nan")
    den = ref.norm().item()
    return (a - ref).norm().item() / den if den > 0 else (a - ref).norm().item()


@triton.jit
def _l2_read_kernel(x_ptr, out_ptr, n, ITERS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        start = ((pid + i * nprog) * BLOCK) % n
        acc += tl.load(x_ptr + start + tl.arange(0, BLOCK))
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def l2_read_bandwidth() -> float:
    """TB/s that all SMs together read from a 16 MB buffer resident in L2 (each program sums 64 blocks of 16 KB
    and stores one float): the L2 ceiling of the round-9 count in docs/blocksparse.md."""
    block, iters = 4096, 64
    x = torch.randn(4 * 1024**2, device=DEV)  # 16 MB: a multiple of the block, well inside L2
    grid = 16 * torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(grid, device=DEV)
    t = bench(lambda: _l2_read_kernel[(grid,)](x, out, x.numel(), ITERS=iters, BLOCK=block, num_warps=8))
    return grid * iters * block * 4 / (t * 1e-3) / 1e12


# ---- sections -------------------------------------------------------------------------------------
def sec_env(args) -> dict:
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t = bench(lambda: a @ b)
    x = torch.empty(2 * 1024**3, device=DEV, dtype=torch.uint8)
    y = torch.empty_like(x)
    tc = bench(lambda: y.copy_(x))
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "bf16_gemm_tflops": 2 * 8192**3 / t / 1e9, "copy_TBps": 2 * 2 * 1024**3 / (tc * 1e-3) / 1e12,
           "l2_read_TBps": l2_read_bandwidth(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    say(f"{out['gpu']} torch {out['torch']} triton {out['triton']} SMs {out['sms']}: "
        f"bf16 GEMM {out['bf16_gemm_tflops']:.0f} TFLOP/s, copy {out['copy_TBps']:.2f} TB/s, "
        f"L2 read {out['l2_read_TBps']:.2f} TB/s")
    return out


def _check_one(T, I, O, b, mask, dtype, bias=True) -> dict:
    meta = BlockSparseMeta.from_mask(mask.to(DEV), b)
    x = torch.randn(T, I, device=DEV, dtype=dtype, requires_grad=True)
    v = (torch.randn(meta.n_blocks, b, b, device=DEV, dtype=dtype) / b**0.5).requires_grad_()
    bb = torch.randn(O, device=DEV, dtype=dtype, requires_grad=True) if bias else None
    y = block_sparse_linear(x, v, meta, bb)
    g = torch.randn_like(y)
    y.backward(g)
    with torch.no_grad():
        x32, v32, g32 = x.detach().float(), v.detach().float(), g.float()
        yr = x32 @ values_to_dense(v32, meta).t() + (bb.detach().float() if bias else 0)
        dxr, dvr, dbr = reference_grads(x32, g32, v32, meta)
    r = {"y": rel(y, yr), "dx": rel(x.grad, dxr), "dv": rel(v.grad, dvr)}
    if bias:
        r["db"] = rel(bb.grad, dbr)
    return r


def sec_check(args) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    bs.TUNE = False  # first candidate everywhere here; --check-all-configs covers the others
    bs.POISON_OUTPUTS = True  # every kernel output starts as NaN: an unwritten element fails the check
    out, worst = {}, 0.0
    T = 8192 + 37  # not a multiple of any tile

    def record(name, r):
        nonlocal worst
        out[name] = r
        bad = [k for k, e in r.items() if not (e < 1e-2)]
        worst = max([worst] + [1.0 if math.isnan(e) else e for e in r.values()])
        say(f"check {name}: " + " ".join(f"{k} {e:.1e}" for k, e in r.items()) + (f"  FAIL {bad}" if bad else ""))

    for dtype in (torch.bfloat16, torch.float16):
        dn = str(dtype).replace("torch.", "")
        for (I, O) in ((1024, 4096), (4096, 1024), (768, 3072)):
            for b in (16, 32, 64, 128):
                for d in (0.1, 0.5):
                    mask = make_mask(O, I, b, d, seed=b + int(100 * d))
                    record(f"{dn} {I}->{O} b{b} d{d}", _check_one(T, I, O, b, mask, dtype, bias=d > 0.3))
        # special topologies at a smaller shape
        I, O = 512, 1024
        for b in (16, 64):
            m = make_mask(O, I, b, 0.3, seed=7)
            m[: m.shape[0] // 4] = False      # empty block rows
            m[:, 1::3] = False                # empty block columns
            record(f"{dn} empty rows+cols b{b}", _check_one(T, I, O, b, m, dtype))
            record(f"{dn} dense b{b}", _check_one(T, I, O, b, torch.ones(O // b, I // b, dtype=torch.bool), dtype))
            one = torch.zeros(O // b, I // b, dtype=torch.bool)
            one[3, 2] = True
            record(f"{dn} single block b{b}", _check_one(T, I, O, b, one, dtype))
            record(f"{dn} T=5 b{b}", _check_one(5, I, O, b, make_mask(O, I, b, 0.25, seed=3), dtype))
    if args.check_all_configs:
        for b in (16, 32, 64, 128):
            mask = make_mask(4096, 1024, b, 0.25, seed=11)
            from sparsetrain.kernels import _blocksparse_cuda as cuda_dds

            probe = torch.empty(1, 1024, device=DEV, dtype=torch.bfloat16)
            for c in [*cuda_dds.candidates(probe, b, 4096), *bs._DDS_CANDIDATES[b]]:
                with bs.forced_config(fwd=c, dx=c):
                    record(f"bf16 b{b} dds {tuple(c)}", _check_one(T, 1024, 4096, b, mask, torch.bfloat16, False))
            for c in bs._DW_CANDIDATES[b]:
                with bs.forced_config(dw=c):
                    record(f"bf16 b{b} dw {tuple(c)}", _check_one(T, 1024, 4096, b, mask, torch.bfloat16, False))
    bs.POISON_OUTPUTS = False
    bs.TUNE = True
    torch.backends.cuda.matmul.allow_tf32 = True
    say(f"check: worst relative error {worst:.2e} ({'PASS' if worst < 1e-2 else 'FAIL'}, threshold 1e-2)")
    return {"cases": out, "worst": worst}


def _time_dense(T, I, O):
    lin = torch.nn.Linear(I, O, bias=False, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)
    fwd = bench(lambda: lin(x))
    y = lin(x)
    bwd = bench(lambda: torch.autograd.grad(y, (x, lin.weight), g, retain_graph=True))

    def step():
        lin(x).backward(g)
    fb = bench(step, grad_to_none=[x, lin.weight])
    gpu = gpu_time(lambda: torch.autograd.grad(lin(x), (x, lin.weight), g))
    xg, wg = x.detach().requires_grad_(), lin.weight.detach().requires_grad_()  # leaves first used on the
    graph = graph_time(lambda: torch.autograd.grad(F.linear(xg, wg), (xg, wg), g))  # capture stream
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fb, "fwd_bwd_gpu": gpu, "fwd_bwd_graph": graph}


def _time_ours(T, I, O, b, d):
    mask = make_mask(O, I, b, d, seed=1)
    meta = BlockSparseMeta.from_mask(mask.to(DEV), b)
    v = (torch.randn(meta.n_blocks, b, b, device=DEV, dtype=torch.bfloat16) / b**0.5).requires_grad_()
    x = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)
    y = block_sparse_linear(x, v, meta)
    torch.autograd.grad(y, (x, v), g, retain_graph=True)  # tunes fwd / dx / dw once
    fwd = bench(lambda: block_sparse_linear(x, v, meta))
    bwd = bench(lambda: torch.autograd.grad(y, (x, v), g, retain_graph=True))

    def step():
        block_sparse_linear(x, v, meta).backward(g)
    fb = bench(step, grad_to_none=[x, v])
    gpu = gpu_time(lambda: torch.autograd.grad(block_sparse_linear(x, v, meta), (x, v), g))
    xg, vg = x.detach().requires_grad_(), v.detach().requires_grad_()
    graph = graph_time(lambda: torch.autograd.grad(block_sparse_linear(xg, vg, meta), (xg, vg), g))
    xd, gd = x.detach(), g.detach()
    dx_only = bench(lambda: bs._dds(gd, v.detach(), meta, None, forward=False))
    dw_only = bench(lambda: bs._sampled_grad(xd, gd, meta, with_bias=False))
    # the peer, as in shared/bench/anchors.py: W (BSR) @ Xᵀ with X given as a contiguous (I, T) tensor
    peer = None
    try:
        from torch.sparse._triton_ops import bsr_dense_mm

        w = values_to_dense(v.detach(), meta)
        wb = w.to_sparse_bsr((b, b))
        xt = x.detach().t().contiguous()
        yp = bsr_dense_mm(wb, xt)
        perr = rel(yp.t(), y.detach().float())
        peer = {"fwd": bench(lambda: bsr_dense_mm(wb, xt)), "err_vs_ours": perr}
    except Exception as e:  # noqa: BLE001 - keep going: the peer is optional
        peer = {"error": repr(e)[:200]}
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fb, "fwd_bwd_gpu": gpu, "fwd_bwd_graph": graph,
            "dx_kernel": dx_only, "dw_kernel": dw_only,
            "n_blocks": meta.n_blocks, "density": meta.density, "peer": peer}


def sec_linear(args) -> dict:
    out = {}
    T = args.tokens
    for shp in args.shapes.split(","):
        I, O = (int(s) for s in shp.split("x"))
        dense = _time_dense(T, I, O)
        row = {"dense": dense}
        say(f"dense {T}x{I}->{O}: fwd {dense['fwd']:.3f} bwd {dense['bwd']:.3f} fwd+bwd {dense['fwd_bwd']:.3f} ms"
            f" (GPU {dense['fwd_bwd_gpu']:.3f}, graph {dense['fwd_bwd_graph'] or 0:.3f})")
        for b in (int(s) for s in args.blocks.split(",")):
            for d in (float(s) for s in args.densities.split(",")):
                try:
                    r = _time_ours(T, I, O, b, d)
                except Exception as e:  # noqa: BLE001 - one failing configuration must not end the run
                    traceback.print_exc()
                    row[f"b{b}_d{d}"] = {"error": repr(e)[:300]}
                    continue
                r["speedup"] = {k: dense[k] / r[k] for k in ("fwd", "bwd", "fwd_bwd", "fwd_bwd_gpu")}
                r["speedup"]["fwd_bwd_graph"] = (dense["fwd_bwd_graph"] / r["fwd_bwd_graph"]
                                                 if dense["fwd_bwd_graph"] and r["fwd_bwd_graph"] else None)
                pf = r["peer"].get("fwd")
                r["speedup"]["peer_fwd"] = dense["fwd"] / pf if pf else None
                row[f"b{b}_d{d}"] = r
                say(f"  b{b} d{d}: fwd {r['fwd']:.3f} ({r['speedup']['fwd']:.2f}x) bwd {r['bwd']:.3f} "
                    f"({r['speedup']['bwd']:.2f}x) fwd+bwd {r['fwd_bwd']:.3f} ({r['speedup']['fwd_bwd']:.2f}x)"
                    f" GPU {r['fwd_bwd_gpu']:.3f} ({r['speedup']['fwd_bwd_gpu']:.2f}x)"
                    f" graph {r['fwd_bwd_graph'] or 0:.3f} ({r['speedup']['fwd_bwd_graph'] or 0:.2f}x)"
                    f" [dx {r['dx_kernel']:.3f} dw {r['dw_kernel']:.3f}] | peer fwd "
                    f"{pf if pf is None else round(pf, 3)} ms ({r['speedup']['peer_fwd'] or 0:.2f}x)")
        out[shp] = row
        out["tuned"] = bs.tuned_configs()
        R["linear"] = out
        save()
    return out


def _state_bytes(module: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    bufs = sum(t.numel() * t.element_size() for t in module.buffers())
    return {"params": params, "adam_state": state, "buffers": bufs, "total": params + state + bufs}


def sec_memory(args) -> dict:
    from sparsetrain.nn import SparseLinear

    out = {}
    for (I, O) in ((1024, 4096), (4096, 16384)):
        lin = torch.nn.Linear(I, O, device=DEV)
        x = torch.randn(64, I, device=DEV)
        rows = {}
        for name, mod in [("dense", lin)] + [
                (f"block{b}", SparseLinear.from_dense(lin, density=0.1, block=b, format="block")) for b in (16, 64)]:
            opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
            mod(x).square().mean().backward()
            opt.step()
            rows[name] = _state_bytes(mod, opt)
        for row in rows.values():
            row["ratio_vs_dense"] = row["total"] / rows["dense"]["total"]
        out[f"{I}x{O}"] = rows
        say(f"memory {I}->{O} fp32 params+AdamW (+metadata): " + ", ".join(
            f"{k} {v['total'] / 2**20:.2f} MiB ({v['ratio_vs_dense']:.3f}x)" for k, v in rows.items()))
    return out


def _cuda_ms(fn, n: int):
    """(mean ms per call of ``fn`` over ``n`` back-to-back calls, timed with CUDA events; the last call's result)."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(n):
        last = fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n, last


def _host_profile(fn, label: str, calls: int = 5, top: int = 25) -> str:
    """cProfile of ``calls`` calls of ``fn`` (synchronized at the end), the ``top`` functions by own time; says and
    returns the table."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    say(f"{label} cProfile of {calls} steps (by own time):\n{buf.getvalue()}")
    return buf.getvalue()


def _kernel_profile(fn, label: str) -> dict[str, float]:
    """GPU time per kernel name (ms per call of ``fn``, over 2 calls, torch profiler); says the total and the top
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    per = {}
    for e in ka:
        per[e.key] = per.get(e.key, 0.0) + getattr(e, attr) / 2e3
    rows = sorted(ka, key=lambda e: getattr(e, attr), reverse=True)
    say(f"{label} profile: {sum(per.values()):.2f} ms of kernels per step; top kernels (ms/step):")
    for e in rows[:12]:
        say(f"    {getattr(e, attr) / 2e3:7.3f}  {e.count // 2:4d}x  {e.key[:90]}")
    return per


def _graphed_step_ms(model, ids, labels, n: int, profile_label: str | None = None
                     ) -> tuple[float, float, float, dict | None]:
    """The whole training step (bf16-autocast forward, backward, fused capturable AdamW) replayed from one CUDA
    graph: the GPU-side step time, without the host's per-op work (the eager step is host-bound on slow hosts).
    Returns (mean ms per replay, the last replay's loss, mean ms of the same step run eagerly, the replays' kernel
    profile when ``profile_label`` is given). The kernels were tuned by the eager steps before; the autocast cache
    is off, as capture needs."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True, capturable=True)

    def body():
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        return loss

    def eager():
        opt.zero_grad(set_to_none=True)
        body()

    for _ in range(3):
        eager()
    eager_ms = _cuda_ms(eager, n)[0]  # the graph's settings (no autocast cache, capturable AdamW), run eagerly

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            body()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = body()
    for _ in range(3):
        graph.replay()
    ms = _cuda_ms(graph.replay, n)[0]
    prof = _kernel_profile(graph.replay, profile_label) if profile_label else None
    loss = static_loss.item()
    del graph, opt
    return ms, loss, eager_ms, prof


def sec_bert(args) -> dict:
    from transformers import BertConfig, BertForMaskedLM

    from sparsetrain.nn import SparseLinear

    out = {}
    seen = {r["key"] for r in bs.dense_fallback_report()}  # products tuned by earlier sections are not this one's
    B, S = 64, 128
    kinds = ["dense"] + [f"block{b}_d0.1" for b in (int(v) for v in args.bert_blocks.split(","))]
    for kind in kinds:
        torch.manual_seed(0)
        torch.cuda.empty_cache()
        cfg = BertConfig()
        model = BertForMaskedLM(cfg).to(DEV).train()
        n_swapped = 0
        if kind != "dense":
            for name, mod in list(model.named_modules()):
                for child_name, child in list(mod.named_children()):
                    full = f"{name}.{child_name}"
                    if isinstance(child, torch.nn.Linear) and ".encoder.layer." in full:
                        blk = int(kind.split("_")[0][len("block"):])
                        setattr(mod, child_name, SparseLinear.from_dense(child, density=0.1, block=blk,
                                                                         format="block"))
                        n_swapped += 1
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, cfg.vocab_size, (B, S), device=DEV)
        labels = ids.masked_fill(torch.rand(B, S, device=DEV) > 0.15, -100)

        def step(model=model, opt=opt, ids=ids, labels=labels):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for _ in range(5):
            loss = step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        n = 20
        ms, loss = _cuda_ms(step, n)
        peak = torch.cuda.max_memory_allocated()
        st = _state_bytes(model, opt)
        if args.bert_profile:  # where the step's GPU time goes: top kernels
            out.setdefault("profile", {})[kind] = _kernel_profile(step, f"bert {kind}")
        if args.bert_cprofile:  # where the step's host time goes: Python functions and torch calls
            out.setdefault("cprofile", {})[kind] = _host_profile(step, f"bert {kind}")
        if args.bert_graph:
            loss = loss.detach()  # an eager autograd graph kept alive would pin AccumulateGrad to the eager stream
            try:
                graph_ms, graph_loss, same_eager_ms, graph_prof = _graphed_step_ms(
                    model, ids, labels, n, f"bert {kind} graph" if args.bert_profile else None)
            except Exception as e:  # noqa: BLE001 - the eager numbers of this section still stand
                traceback.print_exc()
                say(f"bert {kind}: CUDA-graph capture FAILED: {e!r}"[:300])
                args.bert_graph = False
            else:
                out.setdefault("graph_ms", {})[kind] = graph_ms
                out.setdefault("graph_settings_eager_ms", {})[kind] = same_eager_ms
                if graph_prof:
                    out.setdefault("graph_profile", {})[kind] = graph_prof
                    eager_prof = out["profile"][kind]
                    diff = sorted(set(eager_prof) | set(graph_prof),
                                  key=lambda k: graph_prof.get(k, 0.0) - eager_prof.get(k, 0.0), reverse=True)
                    say(f"bert {kind}: kernels slower in the graph than eager (ms/step, graph - eager):")
                    for key in diff[:8]:
                        say(f"    {graph_prof.get(key, 0.0) - eager_prof.get(key, 0.0):+7.3f}  {key[:90]}")
                say(f"bert {kind}: whole step (fwd+bwd+AdamW) replayed from one CUDA graph: {graph_ms:.2f} ms/step, "
                    f"loss after {2 * n + 9} more steps {graph_loss:.3f}; the same step eagerly (no autocast cache, "
                    f"capturable AdamW): {same_eager_ms:.2f} ms")
        fallback = [r for r in bs.dense_fallback_report() if r["key"] not in seen]
        seen.update(r["key"] for r in fallback)
        out[kind] = {"step_ms": ms, "tokens_per_s": B * S / (ms * 1e-3), "peak_bytes": peak,
                     "loss": loss.item(), "swapped_linears": n_swapped, **st, "dense_fallback": fallback}
        if fallback:
            say(f"bert {kind}: dense fallback chosen for {sum(r['chosen'] == 'dense' for r in fallback)} of "
                f"{len(fallback)} tuned products; largest kernel/dense GPU-time ratio "
                f"{max(r['kernel_ms'] / r['dense_ms'] for r in fallback):.2f}")
        say(f"bert {kind}: {ms:.2f} ms/step, {B * S / (ms * 1e-3):,.0f} tok/s, peak {peak / 2**30:.2f} GiB, "
            f"params+adam {st['total'] / 2**20:.0f} MiB, loss {loss.item():.3f}, swapped {n_swapped}")
        del model, opt, step
    d = out["dense"]
    if args.bert_graph:
        for kind in kinds[1:]:
            r = out["graph_ms"]["dense"] / out["graph_ms"][kind]
            out[f"graph_ratio_{kind}"] = r
            say(f"bert ratio {kind}/dense, whole step from a CUDA graph (no host work): tokens/s {r:.2f}x")
    for kind in kinds[1:]:
        s = out[kind]
        r = out[f"ratio_{kind}"] = {"tokens_per_s": s["tokens_per_s"] / d["tokens_per_s"],
                                    "peak": s["peak_bytes"] / d["peak_bytes"], "params_adam": s["total"] / d["total"]}
        say(f"bert ratio {kind}/dense: tokens/s {r['tokens_per_s']:.2f}x, peak memory {r['peak']:.2f}x, "
            f"params+adam {r['params_adam']:.2f}x (fp32 weights, bf16 autocast, fused AdamW)")
    return out


def sec_kernels(args) -> dict:
    """One launch of each kernel per configuration, untuned (first candidates): a target for ncu."""
    bs.TUNE = False
    T = args.tokens
    for shp in args.shapes.split(","):
        I, O = (int(s) for s in shp.split("x"))
        for b in (int(s) for s in args.blocks.split(",")):
            for d in (float(s) for s in args.densities.split(",")):
                meta = BlockSparseMeta.from_mask(make_mask(O, I, b, d, seed=1).to(DEV), b)
                v = torch.randn(meta.n_blocks, b, b, device=DEV, dtype=torch.bfloat16) / b**0.5
                x = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
                g = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)
                bs._dds(x, v, meta, None, forward=True)
                bs._dds(g, v, meta, None, forward=False)
                bs._sampled_grad(x, g, meta, with_bias=False)
                torch.cuda.synchronize()
                say(f"kernels {shp} b{b} d{d}: launched fwd, dx, dw")
    bs.TUNE = True
    return {}


def sec_candidates(args) -> dict:
    """Every forward / input-gradient tile candidate (Triton gather and TMA, the CUDA X-stationary and K-streamed
    kernels) timed alone on the same inputs, each checked against the fp32 reference, beside dense cuBLAS for the
    same product."""
    from sparsetrain.kernels import _blocksparse_cuda as cuda_dds

    torch.backends.cuda.matmul.allow_tf32 = False
    bs.POISON_OUTPUTS = True
    out, T = {}, args.tokens
    for shp in args.shapes.split(","):
        I, O = (int(s) for s in shp.split("x"))
        x = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
        g = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)
        wd = torch.randn(O, I, device=DEV, dtype=torch.bfloat16)
        dense = {"fwd": bench(lambda x=x, wd=wd: torch.nn.functional.linear(x, wd)),
                 "dx": bench(lambda g=g, wd=wd: g @ wd), "dw": bench(lambda g=g, x=x: g.t() @ x)}
        for b in (int(s) for s in args.blocks.split(",")):
            for d in (float(s) for s in args.densities.split(",")):
                meta = BlockSparseMeta.from_mask(make_mask(O, I, b, d, seed=1).to(DEV), b)
                v = torch.randn(meta.n_blocks, b, b, device=DEV, dtype=torch.bfloat16) / b**0.5
                w32 = values_to_dense(v.float(), meta)
                dw_ref = reference_grads(x.float(), g.float(), v.float(), meta)[1]
                for kind, a, ref in (("fwd", x, x.float() @ w32.t()), ("dx", g, g.float() @ w32), ("dw", x, dw_ref)):
                    if kind == "dw":
                        cands = [*cuda_dds.dw_candidates(x, g, meta, False), *bs._DW_CANDIDATES[b],
                                 *bs._dense_candidates(x)]

                        def run(x=x, g=g, m=meta):
                            return bs._sampled_grad(x, g, m, with_bias=False)[0]
                    else:
                        cands = [*cuda_dds.candidates(a, b, a.shape[1]),
                                 *cuda_dds.ks_candidates(a, b, a.shape[1]),
                                 *bs._tma_candidates(a, v, b, kind == "fwd"), *bs._DDS_CANDIDATES[b],
                                 *bs._dense_candidates(a)]

                        def run(a=a, v=v, m=meta, f=kind == "fwd"):
                            return bs._dds(a, v, m, None, forward=f)
                    rows = []
                    for c in cands:
                        try:
                            with bs.forced_config(**{kind: c}):
                                err = rel(run(), ref)
                                bs.POISON_OUTPUTS = False
                                ms = bench(run)
                                bs.POISON_OUTPUTS = True
                        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: next candidate
                            bs.POISON_OUTPUTS = True
                            rows.append({"cfg": repr(c), "error": repr(e)[:200]})
                            continue
                        rows.append({"cfg": repr(c), "cuda": type(c).__name__.startswith("Cuda"), "ms": ms,
                                     "err": err, "vs_dense": dense[kind] / ms})
                    ok = [r for r in rows if "ms" in r]
                    bt = min((r for r in ok if not r["cuda"] and "wide=True" not in r["cfg"]
                              and r["cfg"] != "DenseConfig()"), key=lambda r: r["ms"], default=None)
                    fb = next((r for r in ok if r["cfg"] == "DenseConfig()"), None)
                    bw = min((r for r in ok if "wide=True" in r["cfg"]), key=lambda r: r["ms"], default=None)
                    bc = min((r for r in ok if r["cuda"]), key=lambda r: r["ms"], default=None)
                    worst = max((r["err"] for r in ok), default=float("nan"))
                    out[f"{shp} b{b} d{d} {kind}"] = {"dense_ms": dense[kind], "rows": rows}

                    def fmt(r):
                        return "-" if r is None else f"{r['ms']:.3f} ms ({r['vs_dense']:.2f}x) {r['cfg']}"
                    say(f"cand {shp} b{b} d{d} {kind}: dense {dense[kind]:.3f} | triton {fmt(bt)} | wide {fmt(bw)}"
                        f" | cuda {fmt(bc)} | dense fallback {fmt(fb)}"
                        f" | worst err {worst:.1e}" + ("  FAIL" if not worst < 1e-2 else ""))
                R["candidates"] = out
                save()
    bs.POISON_OUTPUTS = False
    torch.backends.cuda.matmul.allow_tf32 = True
    return out


def sec_host(args) -> dict:
    """Host (Python + launch) cost per call at a tiny token count, where the GPU work is a few µs and the
    wall time of many back-to-back calls is the host time: ``block_sparse_linear`` forward, forward +
    backward (bf16, and fp32 master values under bf16 autocast through ``SparseLinear``), dense
    ``nn.Linear`` beside it, a bare Triton dispatch, and a cProfile breakdown of the fwd+bwd."""
    import cProfile
    import io
    import pstats

    from sparsetrain.nn import SparseLinear

    out = {}
    T, I, O, b, d = 64, 1024, 4096, 64, 0.1
    mask = make_mask(O, I, b, d, seed=1)
    meta = BlockSparseMeta.from_mask(mask.to(DEV), b)
    v = (torch.randn(meta.n_blocks, b, b, device=DEV, dtype=torch.bfloat16) / b**0.5).requires_grad_()
    bias = torch.randn(O, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)
    dense = torch.nn.Linear(I, O, device=DEV, dtype=torch.bfloat16)
    lin = SparseLinear.from_dense(torch.nn.Linear(I, O, device=DEV), density=d, block=b, format="block")
    xa = torch.randn(T, I, device=DEV, requires_grad=True)
    ga = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)

    def wall_us(fn, n=400) -> float:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e6

    def fwd():
        with torch.no_grad():
            block_sparse_linear(x, v, meta, bias)

    def fwd_bwd():
        block_sparse_linear(x, v, meta, bias).backward(g)

    def dense_fwd_bwd():
        dense(x).backward(g)

    def module_autocast():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = lin(xa)
        y.backward(ga)

    def dense_autocast():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = dense32(xa)
        y.backward(ga)

    dense32 = torch.nn.Linear(I, O, device=DEV)
    for name, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd), ("module_autocast_fwd_bwd", module_autocast),
                     ("dense_fwd_bwd", dense_fwd_bwd), ("dense_autocast_fwd_bwd", dense_autocast)):
        out[name + "_us"] = [wall_us(fn) for _ in range(3)]
        say(f"host {name}: " + " / ".join(f"{u:.1f}" for u in out[name + "_us"]) + " µs per call (3 repeats)")
    # the same calls with every launch through Triton's dispatcher (no direct calls of the compiled kernels)
    from sparsetrain.kernels._runtime import triton_launch as _triton_launch

    enabled, _triton_launch.ENABLED = _triton_launch.ENABLED, False
    meta._groups.pop("plans", None)
    try:
        for name, fn in (("fwd_dispatcher", fwd), ("fwd_bwd_dispatcher", fwd_bwd)):
            out[name + "_us"] = [wall_us(fn) for _ in range(3)]
            say(f"host {name}: " + " / ".join(f"{u:.1f}" for u in out[name + "_us"]) + " µs per call (3 repeats)")
    finally:
        _triton_launch.ENABLED = enabled
        meta._groups.pop("plans", None)
    # pieces: one bare Triton dispatch of the forward kernel, the same through a cached _Plan (a direct call of
    # the compiled kernel after the first), allocations
    from sparsetrain.kernels._blocksparse_triton import dense_x_blocksparse_kernel

    o = torch.empty(T, O, device=DEV, dtype=torch.bfloat16)
    ptr, kidx, slot, oidx = meta.padded_entries(True, 1)

    def bare_launch():
        dense_x_blocksparse_kernel[(8,)](x, v, ptr, kidx, slot, oidx, bias, o, T, x.stride(0), 1, o.stride(0),
                                         O // b, O // b // 4, 4, FORWARD=True, HAS_BIAS=True, BLOCK=b, GROUP_K=1,
                                         BLOCK_T=64, CACHE_A="", num_warps=4, num_stages=3)

    def empty_op():
        torch.empty(T, O, device=DEV, dtype=torch.bfloat16)

    def zeros_op():
        torch.zeros(T, O, device=DEV, dtype=torch.bfloat16)

    plan = bs._Plan(dense_x_blocksparse_kernel, (8,), [None, None, ptr, kidx, slot, oidx, None, None, T,
                    x.stride(0), 1, o.stride(0), O // b, O // b // 4, 4], (0, 1, 6, 7),
                    dict(FORWARD=True, HAS_BIAS=True, BLOCK=b, GROUP_K=1, BLOCK_T=64, CACHE_A="", num_warps=4,
                         num_stages=3))

    def plan_launch():
        plan(x, v, bias, o)

    for name, fn in (("bare_triton_dispatch", bare_launch), ("plan_launch", plan_launch),
                     ("torch_empty", empty_op), ("torch_zeros", zeros_op)):
        out[name + "_us"] = [wall_us(fn, 1000) for _ in range(3)]
        say(f"host {name}: " + " / ".join(f"{u:.1f}" for u in out[name + "_us"]) + " µs per call")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        fwd_bwd()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
    out["cprofile_fwd_bwd_300"] = buf.getvalue()
    print(buf.getvalue()[-6000:])
    return out


def save() -> None:
    """Write everything measured so far (called after each section and each linear shape, so a run cut
    short by its time limit still leaves its numbers)."""
    path = os.path.join(os.environ.get("OUT", "."), "bench_blocksparse.json")
    with open(path, "w") as f:
        json.dump({"results": R, "log": LOG, "argv": sys.argv}, f, indent=1, default=str)


SECTIONS = {"env": sec_env, "check": sec_check, "linear": sec_linear, "memory": sec_memory, "bert": sec_bert,
            "kernels": sec_kernels, "host": sec_host, "candidates": sec_candidates}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="env,check,memory,bert,linear")
    p.add_argument("--shapes", default="768x3072,3072x768,1024x4096,4096x1024,4096x16384,16384x4096")
    p.add_argument("--blocks", default="16,32,64")
    p.add_argument("--densities", default="0.5,0.25,0.1")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--check-all-configs", action="store_true")
    p.add_argument("--bert-profile", action="store_true")
    p.add_argument("--bert-cprofile", action="store_true", help="cProfile of 5 eager BERT steps (host time)")
    p.add_argument("--bert-graph", action="store_true",
                   help="also time each BERT step replayed from one CUDA graph (GPU time without host work)")
    p.add_argument("--bert-blocks", default="16", help="block sizes of the sparse BERT variants (density 0.1)")
    p.add_argument("--tma", choices=["all", "off", "forward"], default="all",
                   help="TMA kernels as tuner candidates: for all three products (the default), none (gather kernels "
                        "only), or the forward only")
    p.add_argument("--tma-host-desc", action="store_true", help="TMA descriptors made on the host")
    args = p.parse_args()
    if args.tma == "off":
        bs._TMA_CANDIDATES.clear()
        bs._TMA_DW_CANDIDATES.clear()
    bs.TMA_BACKWARD = args.tma == "all"
    bs.TMA_HOST_DESC = args.tma_host_desc
    t0 = time.time()
    for name in args.sections.split(","):
        say(f"== {name}")
        try:
            R[name] = SECTIONS[name](args)
        except Exception as e:  # noqa: BLE001 - sections fail independently
            traceback.print_exc()
            R[name] = {"error": repr(e)[:500]}
            say(f"{name}: ERROR {e!r}"[:300])
        say(f"   ({time.time() - t0:.0f} s so far)")
        save()
    print("\n==== summary ====")
    for line in LOG:
        if "FAIL" in line or not line.startswith(("check ", "==", "   (")):
            print(line)


if __name__ == "__main__":
    main()
