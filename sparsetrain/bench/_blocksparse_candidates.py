"""The ``candidates`` section of ``sparsetrain bench blocksparse``: every candidate of every registered backend for
the three products, each checked against the fp32 reference and timed alone beside dense cuBLAS (what the tuner
chooses among; a new backend shows here first)."""
from __future__ import annotations

import math

import torch

from sparsetrain.bench._blocksparse_common import DEV, ints, make_mask, rel, shapes
from sparsetrain.bench._timing import bench
from sparsetrain.kernels.blocksparse import plans, tuner
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.reference import reference_grads, values_to_dense
from sparsetrain.kernels.blocksparse.testing import forced_config, poison_outputs
from sparsetrain.kernels.blocksparse.tuner import Product


def sec_candidates(args, out: dict, rep) -> dict:
    """Every candidate of every backend for the three products, checked against the fp32 reference (outputs
    NaN-filled first) and timed alone on the same inputs, beside dense cuBLAS for the same product."""
    torch.backends.cuda.matmul.allow_tf32 = False
    T = args.tokens
    for I, O in shapes(args.shapes):
        x = torch.randn(T, I, device=DEV, dtype=torch.bfloat16)
        g = torch.randn(T, O, device=DEV, dtype=torch.bfloat16)
        wd = torch.randn(O, I, device=DEV, dtype=torch.bfloat16)
        dense = {"fwd": bench(lambda x=x, wd=wd: torch.nn.functional.linear(x, wd)),
                 "dx": bench(lambda g=g, wd=wd: g @ wd), "dw": bench(lambda g=g, x=x: g.t() @ x)}
        for b in ints(args.blocks):
            for d in (float(s) for s in args.densities.split(",")):
                meta = BlockSparseMeta.from_mask(make_mask(O, I, b, d, seed=1).to(DEV), b)
                v = torch.randn(meta.n_blocks, b, b, device=DEV, dtype=torch.bfloat16) / b**0.5
                w32 = values_to_dense(v.float(), meta)
                runs = {"fwd": (Product("fwd", meta, x, v, False), x.float() @ w32.t(),
                                lambda x=x, v=v, m=meta: plans.dds(x, v, m, None, True)),
                        "dx": (Product("dx", meta, g, v, False), g.float() @ w32,
                               lambda g=g, v=v, m=meta: plans.dds(g, v, m, None, False)),
                        "dw": (Product("dw", meta, x, g, False), reference_grads(x.float(), g.float(), v.float(), meta)[1],
                               lambda x=x, g=g, m=meta: plans.sampled_grad(x, g, m, False)[0])}
                for kind, (product, ref, run) in runs.items():
                    rows = []
                    for c in tuner.candidates(product):
                        name = tuner.backend_of(c).name
                        try:
                            with forced_config(**{kind: c}):
                                with poison_outputs():
                                    err = rel(run(), ref)
                                ms = bench(run)
                        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: next candidate
                            rows.append({"backend": name, "cfg": repr(c), "error": repr(e)[:200]})
                            continue
                        rows.append({"backend": name, "cfg": repr(c), "ms": ms, "err": err, "vs_dense": dense[kind] / ms})
                    out[f"{I}x{O} b{b} d{d} {kind}"] = {"dense_ms": dense[kind], "rows": rows}
                    ok = [r for r in rows if "ms" in r]
                    best = {}
                    for r in ok:
                        if r["backend"] not in best or r["ms"] < best[r["backend"]]["ms"]:
                            best[r["backend"]] = r
                    worst = max((1.0 if math.isnan(r["err"]) else r["err"] for r in ok), default=float("nan"))
                    rep.say(f"cand {I}x{O} b{b} d{d} {kind}: dense {dense[kind]:.3f} | " + " | ".join(
                        f"{n} {r['ms']:.3f} ms ({r['vs_dense']:.2f}x) {r['cfg']}" for n, r in best.items())
                        + f" | worst err {worst:.1e}" + ("" if worst < 1e-2 else "  FAIL"))
                rep.save()
    torch.backends.cuda.matmul.allow_tf32 = True
    return out
