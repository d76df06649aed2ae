"""Benchmark of the compressed skinny SpMM (GPU): ours vs dense cuBLAS (F.linear) vs cuSPARSE CSR, side by side.

Every configuration is first checked against the plain-torch reference on fresh random inputs (relative
error), then timed with ``triton.testing.do_bench(..., return_mode="median")``. Weights are rotated among
enough copies to exceed twice the L2 cache, as in a real decode step where each layer's weight is read once.

    sparsetrain bench inference --out $OUT              # correctness + the table (Flash-LLM shapes, 3 formats)
    sparsetrain bench inference --prefill --out $OUT    # prefill path: weight expansion + a 512-token linear
    sparsetrain bench inference --profile pair          # 5 launches of one kernel, e.g. under Nsight Compute:
    ncu --kernel-name regex:spmm_ --metrics <list> sparsetrain bench inference --profile pair

Writes ``bench_inference.json`` (or ``bench_prefill.json``) under --out and prints tables last;
``scripts/plot_inference.py`` draws the speed-vs-sparsity figure from it. Past measurements:
docs/history/inference.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from sparsetrain.kernels.spmm import bitmap as si
from sparsetrain.kernels.spmm import csl as sc
from sparsetrain.kernels.spmm import op
from sparsetrain.kernels.spmm import pair as sp

SHAPES = [(28672, 7168), (7168, 28672), (9216, 36864), (36864, 9216), (4096, 14336), (14336, 4096)]
SPARSITIES = [0.5, 0.7, 0.8, 0.9]
TOKENS = [8, 16, 32, 64]


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run under TRITON_INTERPRET=1 only


def bench(fn) -> float:
    """Median milliseconds (do_bench with CUDA events; a plain timer in the CPU smoke run)."""
    if DEV == "cpu":
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def random_sparse(m: int, k: int, sparsity: float, dtype=torch.float16) -> torch.Tensor:
    """Unstructured: N(0, 1) weights with a uniformly random fraction `sparsity` set to zero (the positions
    magnitude pruning of such a matrix would pick are uniformly random too)."""
    w = torch.randn(m, k, device=DEV, dtype=dtype)
    w.masked_fill_(torch.rand(m, k, device=DEV) < sparsity, 0)
    return w


def n_copies(nbytes: int) -> int:
    if DEV == "cpu":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2**20)
    return max(1, min(6, math.ceil(2 * l2 / max(nbytes, 1)) + 1))


class Rotating:
    """Calls fn(item) on the next of several copies, so repeated timing runs do not hit in L2."""

    def __init__(self, items, fn):
        self.items, self.fn, self.i = items, fn, 0

    def __call__(self):
        self.i = (self.i + 1) % len(self.items)
        return self.fn(self.items[self.i])


def clone_weight(cw):
    """A copy of a compressed weight (any format) in fresh, 16-byte-aligned allocations."""
    return type(cw).from_tensors({k: v.clone() for k, v in cw.tensors().items()}, cw.shape)


def rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def copy_bandwidth() -> float:
    a = torch.empty(2**29 if DEV == "cuda" else 2**20, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * a.numel() / ms / 1e9  # TB/s, bytes read + written


def check(cw, dtype, n, bias=True) -> float:
    m, k = cw.shape
    x = torch.randn(n, k, device=DEV, dtype=dtype)
    b = torch.randn(m, device=DEV, dtype=dtype) if bias else None
    y = op.spmm_infer(x, cw, b)
    return rel_err(y, op.spmm_reference(x, cw, b))


def run_point(m, k, s, tokens, with_csr=True, dtype=torch.float16):
    """All timings for one (shape, sparsity): dense, CSR and ours at each N."""
    w = random_sparse(m, k, s, dtype)
    t0 = time.perf_counter()
    cw = op.compress(w)
    if DEV == "cuda":
        torch.cuda.synchronize()
    compress_s = time.perf_counter() - t0
    exact = bool(torch.equal(cw.to_dense(), w))
    dense_copies = [w] + [w.clone() for _ in range(n_copies(w.numel() * 2) - 1)]
    ours_copies = [cw] + [clone_weight(cw) for _ in range(n_copies(cw.nbytes()) - 1)]
    csr = w.to_sparse_csr() if with_csr and DEV == "cuda" else None
    rows = []
    cuda_ok = DEV == "cuda" and si.cuda_kernel_usable(torch.zeros(1, k, device=DEV, dtype=dtype), cw)
    csl = sc.compress_csl(w)
    csl_ok = DEV == "cuda" and sc.cuda_usable(torch.zeros(1, k, device=DEV, dtype=dtype), csl)
    csl_copies = ([csl] + [sc.CslWeight.from_tensors({a: b.clone() for a, b in csl.tensors().items()}, csl.shape)
                           for _ in range(n_copies(csl.nbytes()) - 1)]) if csl_ok else []
    pair = sp.compress_pair(w)
    pair_ok = DEV == "cuda" and sp.cuda_usable(torch.zeros(1, k, device=DEV, dtype=dtype), pair)
    pair_copies = ([pair] + [clone_weight(pair) for _ in range(n_copies(pair.nbytes()) - 1)]) if pair_ok else []
    for n in tokens:
        x = torch.randn(n, k, device=DEV, dtype=dtype)
        ref = op.spmm_reference(x, cw)
        err_t = rel_err(si.spmm_triton(x, cw), ref)
        err_c = rel_err(si.spmm_cuda(x, cw), ref) if cuda_ok else None
        t_dense = bench(Rotating(dense_copies, lambda wt, x=x: F.linear(x, wt)))
        t_triton = bench(Rotating(ours_copies, lambda c, x=x: si.spmm_triton(x, c)))
        t_cuda = bench(Rotating(ours_copies, lambda c, x=x: si.spmm_cuda(x, c))) if cuda_ok else None
        t_ours = t_cuda if t_cuda is not None else t_triton
        err_csl = rel_err(sc.spmm_csl_cuda(x, csl), ref) if csl_ok else None
        t_csl = bench(Rotating(csl_copies, lambda c, x=x: sc.spmm_csl_cuda(x, c))) if csl_ok else None
        err_pair = rel_err(sp.spmm_pair_cuda(x, pair), ref) if pair_ok else None
        t_pair = bench(Rotating(pair_copies, lambda c, x=x: sp.spmm_pair_cuda(x, c))) if pair_ok else None
        t_csr = None
        if csr is not None:
            xt = x.t().contiguous()
            t_csr = bench(lambda csr=csr, xt=xt: torch.sparse.mm(csr, xt))
        rows.append({"M": m, "K": k, "sparsity": s, "N": n, "dense_ms": t_dense, "ours_ms": t_ours,
                     "cuda_ms": t_cuda, "triton_ms": t_triton, "triton_speedup": t_dense / t_triton,
                     "csr_ms": t_csr, "speedup": t_dense / t_ours,
                     "csr_speedup": (t_dense / t_csr) if t_csr else None,
                     "rel_err": err_c if err_c is not None else err_t, "rel_err_triton": err_t,
                     "ours_TBps": cw.nbytes() / t_ours / 1e9, "dense_TBps": w.numel() * 2 / t_dense / 1e9,
                     "bytes_per_elem": cw.nbytes() / (m * k), "ideal_bytes_per_elem": 0.125 + 2 * (1 - s),
                     "compress_s": compress_s, "to_dense_exact": exact,
                     "csl_ms": t_csl, "csl_speedup": (t_dense / t_csl) if t_csl else None, "rel_err_csl": err_csl,
                     "csl_bytes_per_elem": csl.nbytes() / (m * k), "csl_exact": bool(torch.equal(csl.to_dense(), w)),
                     "pair_ms": t_pair, "pair_speedup": (t_dense / t_pair) if t_pair else None,
                     "rel_err_pair": err_pair, "pair_bytes_per_elem": pair.nbytes() / (m * k),
                     "pair_exact": bool(torch.equal(pair.to_dense(), w))})
    t_decode = bench(Rotating(ours_copies, lambda c: c.to_dense()))
    for r in rows:
        r["decode_to_dense_ms"] = t_decode
    del dense_copies, ours_copies, csr, csl_copies, pair_copies
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return rows


def env() -> dict:
    import triton
    cuda = DEV == "cuda"
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu (interpreter smoke run)",
            "torch": torch.__version__, "triton": triton.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count if cuda else 0,
            "config": dict(si.CONFIG), "break_even_sparsity": op.BREAK_EVEN_SPARSITY}


def edge_weight(m: int, k: int, dtype) -> torch.Tensor:
    """Empty tiles (first 128 rows, last 64 columns zero), one fully dense tile, 90% elsewhere."""
    w = random_sparse(m, k, 0.9, dtype)
    w[:128] = 0
    w[:, -64:] = 0
    w[128:256, :64] = torch.randn(128, 64, device=DEV, dtype=dtype)
    return w


def correctness() -> list[dict]:
    """Every kernel vs the plain-torch reference on fresh random inputs (CUDA kernel where built)."""
    out = []
    dtypes = (torch.float16, torch.bfloat16) if DEV == "cuda" else (torch.float16,)
    shapes = [(4096, 4160), (1000, 3001), (384, 200)] if DEV == "cuda" else [(100, 300)]
    for dtype in dtypes:
        cases = [((m, k), s, random_sparse(m, k, s, dtype)) for (m, k) in shapes for s in (0.5, 0.9)]
        cases.append(((1024, 1024), "edge", edge_weight(1024, 1024, dtype)))
        for (m, k), s, w in cases:
            cw = op.compress(w)
            for n in (1, 5, 13, 16, 33, 64):
                x = torch.randn(n, k, device=DEV, dtype=dtype)
                b = torch.randn(m, device=DEV, dtype=dtype)
                ref = op.spmm_reference(x, cw, b)
                row = {"dtype": str(dtype), "M": m, "K": k, "sparsity": s, "N": n,
                       "rel_err": rel_err(op.spmm_infer(x, cw, b), ref),
                       "rel_err_triton": rel_err(si.spmm_triton(x, cw, b), ref)}
                if DEV == "cuda" and si.cuda_kernel_usable(x, cw):
                    for split in (1, 3):
                        row[f"rel_err_cuda_split{split}"] = rel_err(si.spmm_cuda(x, cw, b, split_k=split), ref)
                    xs = torch.randn(n, k + 3, device=DEV, dtype=dtype)[:, 1:k + 1]  # misaligned view
                    row["rel_err_cuda_view"] = rel_err(si.spmm_cuda(xs, cw), op.spmm_reference(xs, cw))
                    cl = sc.compress_csl(w)
                    for split in (1, 3, None):
                        row[f"rel_err_csl_split{split}"] = rel_err(sc.spmm_csl_cuda(x, cl, b, split_k=split), ref)
                    row["rel_err_csl_view"] = rel_err(sc.spmm_csl_cuda(xs, cl), op.spmm_reference(xs, cw))
                    pw = sp.compress_pair(w)
                    for split in (1, 3, None):
                        row[f"rel_err_pair_split{split}"] = rel_err(sp.spmm_pair_cuda(x, pw, b, split_k=split), ref)
                    row["rel_err_pair_view"] = rel_err(sp.spmm_pair_cuda(xs, pw), op.spmm_reference(xs, cw))
                out.append(row)
    return out


def prefill_expand() -> list[dict]:
    """Prefill (more than 64 tokens) expands the compressed weight and calls cuBLAS: the expansion in plain
    torch vs the Triton decode kernels, and a 512-token linear through it vs dense, per format."""
    rows = []
    print("format shape sparsity | expand torch ms | expand Triton ms | 512-token linear: dense / via torch / "
          "spmm_infer (Triton expansion) ms")
    for fmt, make in (("csl", sc.compress_csl), ("pair", sp.compress_pair), ("bitmap", op.compress)):
        for (m, k) in ((14336, 4096), (4096, 14336)):
            for s in (0.8, 0.9):
                w = random_sparse(m, k, s)
                c = make(w)
                assert torch.equal(c.to_dense(use_kernel=True), w) and torch.equal(c.to_dense(use_kernel=False), w)
                x = torch.randn(512, k, device=DEV, dtype=torch.float16)
                r = {"fmt": fmt, "M": m, "K": k, "sparsity": s,
                     "expand_torch": bench(lambda c=c: c.to_dense(use_kernel=False)),
                     "expand_triton": bench(lambda c=c: c.to_dense(use_kernel=True)),
                     "dense": bench(lambda x=x, w=w: F.linear(x, w)),
                     "via_torch": bench(lambda x=x, c=c: F.linear(x, c.to_dense(use_kernel=False))),
                     "spmm_infer": bench(lambda x=x, c=c: op.spmm_infer(x, c))}
                rows.append(r)
                print(f"{fmt} {m}x{k} {s} | {r['expand_torch']:.3f} | {r['expand_triton']:.3f} | {r['dense']:.3f} "
                      f"/ {r['via_torch']:.3f} ({r['dense'] / r['via_torch']:.2f}x) / {r['spmm_infer']:.3f} "
                      f"({r['dense'] / r['spmm_infer']:.2f}x)", flush=True)
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sparsetrain bench inference", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-csr", action="store_true", help="leave cuSPARSE CSR out of the table")
    ap.add_argument("--prefill", action="store_true",
                    help="only the prefill path: weight expansion (torch vs Triton) and a 512-token linear")
    ap.add_argument("--profile", choices=["triton", "cuda", "csl", "pair"],
                    help="only launch that kernel 5 times (28672x7168, N=16), e.g. under ncu")
    ap.add_argument("--profile-sparsity", type=float, default=0.9)
    ap.add_argument("--shapes", default="all", help="'all' or e.g. 28672x7168,4096x14336")
    ap.add_argument("--sparsities", default=",".join(map(str, SPARSITIES)))
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.profile:
        profile(args.profile, args.profile_sparsity)
        return 0
    info = env()
    if args.prefill:
        info["prefill"] = prefill_expand()
        save(args.out, "bench_prefill.json", info)
        return 0
    info["copy_TBps"] = copy_bandwidth()
    print(json.dumps(info))
    info["correctness"] = correctness()
    worst = max(v for r in info["correctness"] for key, v in r.items() if key.startswith("rel_err"))
    print(f"correctness vs reference ({len(info['correctness'])} cases, fp16/bf16, N=1..64, every kernel): "
          f"worst rel err {worst:.2e}", flush=True)
    shapes = SHAPES if args.shapes == "all" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    rows = info["rows"] = []
    name = "bench_inference.json"
    for (m, k) in shapes:
        for s in map(float, args.sparsities.split(",")):
            rows += run_point(m, k, s, list(map(int, args.tokens.split(","))), with_csr=not args.no_csr)
            r = [x for x in rows if x["M"] == m and x["K"] == k and x["sparsity"] == s]
            print(f"{m}x{k} s={s}: " + " ".join(f"N{x['N']}:{x['speedup']:.2f}x" for x in r), flush=True)
            save(args.out, name, info)  # after every point: a run cut short keeps what it measured
    save(args.out, name, info)
    print_table(info["rows"])
    print_formats(info["rows"])
    return 0


def profile(kernel: str, sparsity: float) -> None:
    """Five launches of one kernel on a 28672x7168 weight at N = 16 (weights compressed and kernels built
    first), a target for Nsight Compute."""
    m, k = (28672, 7168) if DEV == "cuda" else (256, 128)
    w = random_sparse(m, k, sparsity)
    cw, cl, pw = op.compress(w), sc.compress_csl(w), sp.compress_pair(w)
    x = torch.randn(16, k, device=DEV, dtype=torch.float16)
    fn = {"triton": lambda: si.spmm_triton(x, cw), "cuda": lambda: si.spmm_cuda(x, cw),
          "csl": lambda: sc.spmm_csl_cuda(x, cl), "pair": lambda: sp.spmm_pair_cuda(x, pw)}[kernel]
    for _ in range(5):
        fn()


def save(out: str, name: str, info: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, name), "w") as f:
        json.dump(info, f, indent=1)


def print_table(rows) -> None:
    print("\n| M x K | s | N | dense ms | CSR ms | ours ms | ours/dense | Triton kernel ms (vs dense) | CSR vs dense "
          "| ours TB/s | B/elem (ideal) | rel err | CSL ms (vs dense) | CSL B/elem | CSL err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        csr = f"{r['csr_ms']:.3f}" if r["csr_ms"] else "-"
        csr_x = f"{r['csr_speedup']:.2f}x" if r["csr_speedup"] else "-"
        print(f"| {r['M']}x{r['K']} | {r['sparsity']:.0%} | {r['N']} | {r['dense_ms']:.4f} | {csr} | "
              f"{r['ours_ms']:.4f} | **{r['speedup']:.2f}x** | {r['triton_ms']:.4f} ({r['triton_speedup']:.2f}x) | "
              f"{csr_x} | {r['ours_TBps']:.2f} | "
              f"{r['bytes_per_elem']:.3f} ({r['ideal_bytes_per_elem']:.3f}) | {r['rel_err']:.1e} | "
              + (f"{r['csl_ms']:.4f} (**{r['csl_speedup']:.2f}x**) | {r['csl_bytes_per_elem']:.3f} | {r['rel_err_csl']:.1e} |"
                 if r.get("csl_ms") else f"- | {r['csl_bytes_per_elem']:.3f} | - |"))


def print_formats(rows) -> None:
    """The three compressed formats side by side: speed vs dense cuBLAS and bytes per weight element."""
    print("\n| M x K | s | N | dense ms | bitmap x (B/elem) | CSL x (B/elem) | pair x (B/elem) |")
    print("|---|---|---|---|---|---|---|")

    def cell(x, b):
        return f"{x:.2f}x ({b:.3f})" if x else f"- ({b:.3f})"

    for r in rows:
        print(f"| {r['M']}x{r['K']} | {r['sparsity']:.0%} | {r['N']} | {r['dense_ms']:.4f} | "
              f"{cell(r['speedup'], r['bytes_per_elem'])} | {cell(r.get('csl_speedup'), r['csl_bytes_per_elem'])} | "
              f"{cell(r.get('pair_speedup'), r['pair_bytes_per_elem'])} |")
