"""Block-sparse linear on a GPU: correctness (bf16 + fp16 vs the plain-torch reference) and timings of ours vs dense
cuBLAS ``nn.Linear`` vs torch's ``bsr_dense_mm`` (forward only: it has no backward), parameter + Adam memory and a
BERT-base MLM training step. Ratios are measured side by side in one run.

    sparsetrain bench blocksparse --out $OUT --plot $OUT/blocksparse_linear.png
    sparsetrain bench blocksparse --sections env,bert --bert-blocks 16,64 --bert-graph --bert-profile
    sparsetrain bench blocksparse --replot run1.json run2.json --plot linear.png     # no GPU needed

Sections (``--sections``, comma separated; each fails on its own and records its error):
  env         GPU, versions, bf16 GEMM TFLOP/s, copy bandwidth
  check       every product at the first (untimed) candidate vs the fp32 reference, outputs NaN-filled first
  linear      fwd, bwd, fwd+bwd per shape, block size and density: eager wall, GPU busy time and CUDA-graph
              replay, the dX / dW products alone, the peer's forward; ratios vs dense
  memory      fp32 parameters + AdamW state (+ block metadata) vs dense
  bert        BERT-base MLM step, dense vs 90%-sparse encoder linears (``--bert-*`` options)
  host        host (Python + launch) cost per call at 64 tokens, with ``fast_launch`` on and off
  candidates  every candidate of every backend, each checked and timed alone beside dense cuBLAS
Writes ``bench_blocksparse.json`` under ``--out`` after every section. Past measurements:
docs/history/blocksparse.md.
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

from sparsetrain.bench._blocksparse_bert import sec_bert, state_bytes
from sparsetrain.bench._blocksparse_candidates import sec_candidates
from sparsetrain.bench._blocksparse_common import DEV, ints, make_mask, rel, shapes
from sparsetrain.bench._blocksparse_plot import load_rows, merge_linear, plot_linear
from sparsetrain.bench._timing import bench, gpu_time, graph_time
from sparsetrain.kernels import use_kernel_options
from sparsetrain.kernels.blocksparse import plans, tuner
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.op import block_sparse_linear
from sparsetrain.kernels.blocksparse.reference import reference_grads, values_to_dense
from sparsetrain.kernels.blocksparse.testing import poison_outputs, untuned


class Report:
    """What a run measured so far (``results``) and said (``log``); saved after every section."""

    def __init__(self, out_dir: str, argv: list[str]):
        self.results: dict = {}
        self.log: list[str] = []
        os.makedirs(out_dir, exist_ok=True)   # --out may name a directory that does not exist yet
        self.path = os.path.join(out_dir, "bench_blocksparse.json")
        self.argv = argv

    def say(self, msg: str) -> None:
        print(msg, flush=True)
        self.log.append(msg)

    def save(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"results": self.results, "log": self.log, "argv": self.argv}, f, indent=1, default=str)


# ---- sections -------------------------------------------------------------------------------------
def sec_env(args, rep: Report) -> dict:
    import triton

    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t = bench(lambda: a @ a)
    x = torch.empty(2 * 1024**3, device=DEV, dtype=torch.uint8)
    y = torch.empty_like(x)
    tc = bench(lambda: y.copy_(x))
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "sms": torch.cuda.get_device_properties(0).multi_processor_count,
           "bf16_gemm_tflops": 2 * 8192**3 / t / 1e9, "copy_TBps": 2 * 2 * 1024**3 / (tc * 1e-3) / 1e12,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    rep.say(f"{out['gpu']} torch {out['torch']} triton {out['triton']} SMs {out['sms']}: "
            f"bf16 GEMM {out['bf16_gemm_tflops']:.0f} TFLOP/s, copy {out['copy_TBps']:.2f} TB/s")
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


def sec_check(args, rep: Report) -> dict:
    out, worst = {}, 0.0
    T = 8192 + 37  # not a multiple of any tile

    def record(name, r):
        nonlocal worst
        out[name] = r
        bad = [k for k, e in r.items() if not (e < 1e-2)]
        worst = max([worst] + [1.0 if math.isnan(e) else e for e in r.values()])
        rep.say(f"check {name}: " + " ".join(f"{k} {e:.1e}" for k, e in r.items()) + (f"  FAIL {bad}" if bad else ""))

    torch.backends.cuda.matmul.allow_tf32 = False
    with untuned(), poison_outputs():
        for dtype in (torch.bfloat16, torch.float16):
            dn = str(dtype).replace("torch.", "")
            for I, O in ((1024, 4096), (4096, 1024), (768, 3072)):
                for b in (16, 32, 64, 128):
                    for d in (0.1, 0.5):
                        mask = make_mask(O, I, b, d, seed=b + int(100 * d))
                        record(f"{dn} {I}->{O} b{b} d{d}", _check_one(T, I, O, b, mask, dtype, bias=d > 0.3))
            I, O = 512, 1024  # special topologies at a smaller shape
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
    torch.backends.cuda.matmul.allow_tf32 = True
    rep.say(f"check: worst relative error {worst:.2e} ({'PASS' if worst < 1e-2 else 'FAIL'}, threshold 1e-2)")
    return {"cases": out, "worst": worst}


def _time_dense(T, I, O) -> dict:
    lin = torch.nn.Linear(I, O, bias=False, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)
    fwd = bench(lambda: lin(x))
    y = lin(x)
    bwd = bench(lambda: torch.autograd.grad(y, (x, lin.weight), g, retain_graph=True))
    fb = bench(lambda: lin(x).backward(g), grad_to_none=[x, lin.weight])
    gpu = gpu_time(lambda: torch.autograd.grad(lin(x), (x, lin.weight), g))
    xg, wg = x.detach().requires_grad_(), lin.weight.detach().requires_grad_()  # fresh leaves for the capture
    graph = graph_time(lambda: torch.autograd.grad(torch.nn.functional.linear(xg, wg), (xg, wg), g))
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fb, "fwd_bwd_gpu": gpu, "fwd_bwd_graph": graph}


def _peer(meta, v, x, y, b) -> dict:
    """torch's ``bsr_dense_mm`` forward: W (BSR) @ Xᵀ with X given as a contiguous (I, T) tensor."""
    try:
        from torch.sparse._triton_ops import bsr_dense_mm

        wb = values_to_dense(v.detach(), meta).to_sparse_bsr((b, b))
        xt = x.detach().t().contiguous()
        err = rel(bsr_dense_mm(wb, xt).t(), y.detach().float())
        return {"fwd": bench(lambda: bsr_dense_mm(wb, xt)), "err_vs_ours": err}
    except Exception as e:  # noqa: BLE001 - keep going: the peer is optional
        return {"error": repr(e)[:200]}


def _time_ours(T, I, O, b, d) -> dict:
    meta = BlockSparseMeta.from_mask(make_mask(O, I, b, d, seed=1).to(DEV), b)
    v = (torch.randn(meta.n_blocks, b, b, device=DEV, dtype=torch.bfloat16) / b**0.5).requires_grad_()
    x = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)
    y = block_sparse_linear(x, v, meta)
    torch.autograd.grad(y, (x, v), g, retain_graph=True)  # tunes fwd / dx / dw once
    fwd = bench(lambda: block_sparse_linear(x, v, meta))
    bwd = bench(lambda: torch.autograd.grad(y, (x, v), g, retain_graph=True))
    fb = bench(lambda: block_sparse_linear(x, v, meta).backward(g), grad_to_none=[x, v])
    gpu = gpu_time(lambda: torch.autograd.grad(block_sparse_linear(x, v, meta), (x, v), g))
    xg, vg = x.detach().requires_grad_(), v.detach().requires_grad_()
    graph = graph_time(lambda: torch.autograd.grad(block_sparse_linear(xg, vg, meta), (xg, vg), g))
    xd, gd, vd = x.detach(), g.detach(), v.detach()
    dx_only = bench(lambda: plans.dds(gd, vd, meta, None, forward=False))
    dw_only = bench(lambda: plans.sampled_grad(xd, gd, meta, with_bias=False))
    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fb, "fwd_bwd_gpu": gpu, "fwd_bwd_graph": graph,
            "dx_kernel": dx_only, "dw_kernel": dw_only, "n_blocks": meta.n_blocks, "density": meta.density,
            "peer": _peer(meta, v, x, y, b)}


def sec_linear(args, rep: Report) -> dict:
    out = rep.results.setdefault("linear", {})
    T = args.tokens
    for I, O in shapes(args.shapes):
        shp = f"{I}x{O}"
        dense = _time_dense(T, I, O)
        row = {"dense": dense}
        rep.say(f"dense {T}x{I}->{O}: fwd {dense['fwd']:.3f} bwd {dense['bwd']:.3f} fwd+bwd {dense['fwd_bwd']:.3f} "
                f"ms (GPU {dense['fwd_bwd_gpu']:.3f}, graph {dense['fwd_bwd_graph'] or 0:.3f})")
        for b in ints(args.blocks):
            for d in (float(s) for s in args.densities.split(",")):
                try:
                    r = _time_ours(T, I, O, b, d)
                except Exception as e:  # noqa: BLE001 - one failing configuration must not end the run
                    traceback.print_exc()
                    row[f"b{b}_d{d}"] = {"error": repr(e)[:300]}
                    continue
                s = r["speedup"] = {k: dense[k] / r[k] for k in ("fwd", "bwd", "fwd_bwd", "fwd_bwd_gpu")}
                s["fwd_bwd_graph"] = (dense["fwd_bwd_graph"] / r["fwd_bwd_graph"]
                                      if dense["fwd_bwd_graph"] and r["fwd_bwd_graph"] else None)
                pf = r["peer"].get("fwd")
                s["peer_fwd"] = dense["fwd"] / pf if pf else None
                row[f"b{b}_d{d}"] = r
                rep.say(f"  b{b} d{d}: fwd {r['fwd']:.3f} ({s['fwd']:.2f}x) bwd {r['bwd']:.3f} ({s['bwd']:.2f}x) "
                        f"fwd+bwd {r['fwd_bwd']:.3f} ({s['fwd_bwd']:.2f}x) GPU {r['fwd_bwd_gpu']:.3f} "
                        f"({s['fwd_bwd_gpu']:.2f}x) graph {r['fwd_bwd_graph'] or 0:.3f} ({s['fwd_bwd_graph'] or 0:.2f}x)"
                        f" [dx {r['dx_kernel']:.3f} dw {r['dw_kernel']:.3f}] | peer fwd "
                        f"{pf if pf is None else round(pf, 3)} ms ({s['peer_fwd'] or 0:.2f}x)")
        out[shp] = row
        out["tuned"] = tuner.tuned_configs()
        rep.save()
    return out


def sec_memory(args, rep: Report) -> dict:
    from sparsetrain.nn import SparseLinear

    out = {}
    for I, O in ((1024, 4096), (4096, 16384)):
        lin = torch.nn.Linear(I, O, device=DEV)
        x = torch.randn(64, I, device=DEV)
        rows = {}
        for name, mod in [("dense", lin)] + [
                (f"block{b}", SparseLinear.from_dense(lin, density=0.1, block=b, format="block")) for b in (16, 64)]:
            opt = torch.optim.AdamW(mod.parameters(), lr=1e-3)
            mod(x).square().mean().backward()
            opt.step()
            rows[name] = state_bytes(mod, opt)
        for row in rows.values():
            row["ratio_vs_dense"] = row["total"] / rows["dense"]["total"]
        out[f"{I}x{O}"] = rows
        rep.say(f"memory {I}->{O} fp32 params+AdamW (+metadata): " + ", ".join(
            f"{k} {v['total'] / 2**20:.2f} MiB ({v['ratio_vs_dense']:.3f}x)" for k, v in rows.items()))
    return out


def sec_host(args, rep: Report) -> dict:
    """Host cost per call at a tiny token count (a few µs of GPU work, so many back-to-back calls measure the
    host): forward, forward+backward, fp32 master values under bf16 autocast through ``SparseLinear``, dense
    beside them; and the same with ``fast_launch`` off (every launch through Triton's dispatcher)."""
    from sparsetrain.nn import SparseLinear

    out = {}
    T, I, O, b, d = 64, 1024, 4096, 64, 0.1
    meta = BlockSparseMeta.from_mask(make_mask(O, I, b, d, seed=1).to(DEV), b)
    v = (torch.randn(meta.n_blocks, b, b, device=DEV, dtype=torch.bfloat16) / b**0.5).requires_grad_()
    bias = torch.randn(O, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(T, I, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)
    dense = torch.nn.Linear(I, O, device=DEV, dtype=torch.bfloat16)
    dense32 = torch.nn.Linear(I, O, device=DEV)
    lin = SparseLinear.from_dense(torch.nn.Linear(I, O, device=DEV), density=d, block=b, format="block")
    xa = torch.randn(T, I, device=DEV, requires_grad=True)

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

    def autocast(module):
        def run():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = module(xa)
            y.backward(g)
        return run

    calls = {"fwd": fwd, "fwd_bwd": lambda: block_sparse_linear(x, v, meta, bias).backward(g),
             "module_autocast_fwd_bwd": autocast(lin), "dense_fwd_bwd": lambda: dense(x).backward(g),
             "dense_autocast_fwd_bwd": autocast(dense32)}
    for fast in (True, False):  # read at every launch: the cached plans serve both
        with use_kernel_options(fast_launch=fast):
            for name, fn in calls.items():
                if not fast and name.startswith("dense"):
                    continue
                key = name + ("" if fast else "_dispatcher") + "_us"
                out[key] = [wall_us(fn) for _ in range(3)]
                rep.say(f"host {key[:-3]}: " + " / ".join(f"{u:.1f}" for u in out[key]) + " µs per call (3 repeats)")
    return out


SECTIONS = {"env": sec_env, "check": sec_check, "linear": sec_linear, "memory": sec_memory,
            "bert": lambda args, rep: sec_bert(args, rep.say), "host": sec_host,
            "candidates": lambda args, rep: sec_candidates(args, rep.results.setdefault("candidates", {}), rep)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparsetrain bench blocksparse",
                                description="Block-sparse linear on a GPU: correctness and timings vs dense cuBLAS.")
    p.add_argument("--sections", default="env,check,memory,bert,linear", help=f"of {','.join(SECTIONS)}")
    p.add_argument("--shapes", default="768x3072,3072x768,1024x4096,4096x1024,4096x16384,16384x4096",
                   help="in x out features, comma separated")
    p.add_argument("--blocks", default="16,32,64")
    p.add_argument("--densities", default="0.5,0.25,0.1")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--bert-blocks", default="16", help="block sizes of the sparse BERT variants (density 0.1)")
    p.add_argument("--bert-profile", action="store_true", help="top GPU kernels of each BERT step")
    p.add_argument("--bert-graph", action="store_true", help="also time each BERT step replayed from a CUDA graph")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory of bench_blocksparse.json")
    p.add_argument("--plot", metavar="PNG", help="plot the linear section (fwd+bwd vs dense against density)")
    p.add_argument("--replot", nargs="+", metavar="JSON", help="only plot these earlier runs' linear sections "
                   "(later files' rows replace earlier ones'); needs --plot, no GPU")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.replot:
        if not args.plot:
            raise SystemExit("--replot needs --plot PNG")
        plot_linear(*load_rows(args.replot), args.plot)
        print(f"wrote {args.plot}")
        return 0
    rep = Report(args.out, ["sparsetrain", "bench", "blocksparse", *argv])
    t0, failed = time.time(), False
    for name in args.sections.split(","):
        rep.say(f"== {name}")
        try:
            rep.results[name] = SECTIONS[name](args, rep)
        except Exception as e:  # noqa: BLE001 - sections fail independently
            traceback.print_exc()
            rep.results[name] = {"error": repr(e)[:500]}
            rep.say(f"{name}: ERROR {e!r}"[:300])
            failed = True
        rep.say(f"   ({time.time() - t0:.0f} s so far)")
        rep.save()
    if args.plot and "linear" in rep.results:
        plot_linear(merge_linear({}, rep.results["linear"]), rep.results.get("env", {}), args.plot, args.tokens)
        rep.say(f"wrote {args.plot}")
    print("\n==== summary ====")
    for line in rep.log:
        if "FAIL" in line or not line.startswith(("check ", "==", "   (")):
            print(line)
    return 1 if failed or any("FAIL" in line for line in rep.log) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
