"""2:4 sparse-then-dense training on the GPU: correctness + timings against dense, side by side in one run.

    sparsetrain bench semi24 --out $OUT                       # env, prep, linear, vit
    sparsetrain bench semi24 --sections fp16 --out $OUT       # fp16 errors, in a process of their own

Sections (``--sections``, comma separated; each fails on its own and records its error):
  env     versions, GPU, cuSPARSELt version / max alg id
  prep    per-step weight preparation: mask kernel, fused cuSPARSELt packing, _cslt_compress, torch's tile kernel
  linear  fwd+bwd at the benchmark shapes: dense nn.Linear, torch's semi-structured peer, ours in each mode,
          with the per-step mask+compress cost and bf16 errors vs the masked-dense reference
  fp16    fp16 errors of every mode at the linear shapes (run it in its own process)
  vit     ViT-L/16 training step (224 px, batch 64 = 12608 tokens): dense vs sparse phase (dispatch, all-2:4)
  models  the linears of ViT-B/16, ViT-L/16 and ViT-H/14 at their training tokens per step, timed as the
          dispatch times them (fwd+bwd, the per-step mask and packing included, fp32 master weights under bf16
          autocast): each mode against plain F.linear, and the mode the dispatch would choose
Writes bench_semi24.json under --out and prints a short table last. Timings: triton.testing.do_bench medians.
Past measurements: docs/history/semi24.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
import traceback

import torch
import torch.nn.functional as F

from sparsetrain.kernels import semi24 as S
from sparsetrain.nn import SparseLinear
from sparsetrain.nn.formats.semi24 import plan_dispatch

DEV = "cuda"
BF = torch.bfloat16
LINEAR_SHAPES = [  # tokens, in, out
    (16384, 1024, 4096), (16384, 4096, 1024),
    (16384, 4096, 16384), (16384, 16384, 4096),
    (13008, 1024, 4096), (13008, 4096, 1024),
]
PREP_SHAPES = [(1024, 1024), (4096, 1024), (1024, 4096), (16384, 4096), (4096, 16384)]


def bench(fn, rep=50, warmup=10, **kw) -> float:
    """Median milliseconds (CUDA events, through triton.testing.do_bench)."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median", **kw)


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def env() -> dict:
    import triton
    out = {"torch": torch.__version__, "triton": triton.__version__, "gpu": torch.cuda.get_device_name(),
           "date": datetime.date.today().isoformat(), "cusparselt": torch.backends.cusparselt.version(),
           "max_alg_id": torch.backends.cusparselt.get_max_alg_id()}
    print(out)
    return out


def _prep_times(n, k):
    """Per-step weight preparation costs (ms) for one weight shape."""
    w32 = torch.randn(n, k, device=DEV)
    wb = w32.to(BF)
    r = S.transposable24(w32, out_dtype=BF, write_transposed=True)
    fns = {"cast_fp32_to_bf16": lambda: w32.to(BF),
           "mask_bf16in": lambda: S.transposable24(wb),
           "mask_fp32in_bf16out": lambda: S.transposable24(w32, out_dtype=BF),
           "mask+T_fp32in": lambda: S.transposable24(w32, out_dtype=BF, write_transposed=True),
           "fused_pack+pack_t_bf16in": lambda: S.transposable24(wb, write_wm=False, pack=True, pack_t=True),
           "fused_pack+pack_t_fp32in": lambda: S.transposable24(w32, out_dtype=BF, write_wm=False, pack=True,
                                                               pack_t=True),
           "cslt_compress": lambda: S.compress(r.wm),
           "cslt_compress_T": lambda: S.compress(r.wmt),
           "torch_tile": lambda: torch._sparse_semi_structured_tile(wb, "largest_abs_values_greedy", False)}
    out = {"pack_supported": S.pack_supported(n, k, BF, torch.device(DEV))}
    for name, fn in fns.items():
        try:
            out[name] = bench(fn, rep=20)
        except (RuntimeError, ValueError) as e:
            out[name] = repr(e)[:100]
    return out


def prep() -> dict:
    """Per-step weight preparation costs (ms) at the prep shapes."""
    out = {}
    for (n, k) in PREP_SHAPES:
        r = out[f"{n}x{k}"] = _prep_times(n, k)
        print(f"prep {n}x{k}: " + " ".join(f"{a}={v:.4f}" if isinstance(v, float) else f"{a}={v}"
                                           for a, v in r.items()), flush=True)
    return out


def _peer_step(w, x, g):
    """torch core's semi-structured path used for training: re-sparsify every step (torch's tile kernel),
    forward and input grad through the tensor subclass, weight grad dense (straight through)."""
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT as C
    ws = C.prune_dense_static_sort(w.detach(), "largest_abs_values_greedy")
    y = F.linear(x, ws)
    y.backward(g)
    return y, g.t() @ x.detach()


def _linear_errors(t, k, n, dtypes):
    """Ours vs the masked-dense fp32 reference on fresh inputs: max rel error of y, dx, dW per dtype/mode."""
    row = {}
    for dt in dtypes:
        for mode in S.MODES:
            w = (torch.randn(n, k, device=DEV, dtype=dt) * k ** -0.5).requires_grad_()
            x = torch.randn(t, k, device=DEV, dtype=dt, requires_grad=True)
            mask = torch.empty(n, k, dtype=torch.bool, device=DEV)
            y = S.semi24_linear(x, w, mode=mode, mask_out=mask)
            g = torch.randn_like(y)
            y.backward(g)
            xr, wr = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
            yr = S.semi24_linear_reference(xr, wr, mask)
            yr.backward(g.float())
            row[f"err_{str(dt)[6:]}_{mode}"] = max(rel(y, yr), rel(x.grad, xr.grad), rel(w.grad, wr.grad))
    return row


def _linear_times(t, k, n):
    """fwd+bwd ms, bf16 weights and activations (as the anchors): dense, ours per mode, prep, the peer."""
    lin = torch.nn.Linear(k, n, bias=False, device=DEV, dtype=BF)
    w = lin.weight
    x = torch.randn(t, k, device=DEV, dtype=BF, requires_grad=True)
    g = torch.randn(t, n, device=DEV, dtype=BF)
    row = {"dense_fwd": bench(lambda: lin(x)), "dense": bench(lambda: lin(x).backward(g), grad_to_none=[x, w])}
    for mode in S.MODES:
        def step(mode=mode):
            S.semi24_linear(x, w, mode=mode).backward(g)
        step()  # warm: kernel compiled, algorithms chosen
        row[f"ours_{mode}"] = bench(step, grad_to_none=[x, w])
    row["ours_24_fwd_only"] = bench(lambda: S.semi24_linear(x.detach(), w.detach(), mode="24"))

    def prep_cslt():  # mask kernel, then cuSPARSELt's own compression of W⊙M and (W⊙M)ᵀ
        r = S.transposable24(w.detach(), write_transposed=True)
        S.compress(r.wm)
        S.compress(r.wmt)
    row["pack_supported"] = S.pack_supported(n, k, BF, torch.device(DEV))
    row["ours_prep"] = bench(lambda: S.transposable24(w.detach(), write_wm=False, pack=True, pack_t=True)) \
        if row["pack_supported"] else None
    row["prep_cslt_compress"] = bench(prep_cslt)
    try:
        y, _ = _peer_step(w, x, g)
        bitmask = torch._sparse_semi_structured_tile(w.detach(), "largest_abs_values_greedy", False)[4]
        pruned = torch._sparse_semi_structured_apply_dense(w.detach(), bitmask)
        row["peer_err"] = rel(y, x.detach().float() @ pruned.float().t())
        row["peer_train"] = bench(lambda: _peer_step(w, x, g), grad_to_none=[x, w])
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        row["peer_train"] = None
        row["peer_train_error"] = repr(e)[:200]
    try:
        from torch.sparse import to_sparse_semi_structured
        wm = S.transposable24(w.detach()).wm
        ws = to_sparse_semi_structured(wm)
        xk = x.detach().t().contiguous()  # the subclass's fastest operand layout (K, T)
        row["peer_fwd_err"] = rel(ws @ xk, wm.float() @ xk.float())
        row["peer_fwd"] = bench(lambda: ws @ xk)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        row["peer_fwd"] = None
        row["peer_fwd_error"] = repr(e)[:200]
    return row


def _ratio(a, b):
    return a / b if a and b else float("nan")


def linear():
    out = {}
    for (t, k, n) in LINEAR_SHAPES:
        row = _linear_errors(t, k, n, (torch.bfloat16,))  # also fills the alg cache for these shapes
        row.update(_linear_times(t, k, n))
        out[f"{t}x{k}->{n}"] = row
        torch.cuda.empty_cache()
        err = max(v for kk, v in row.items() if kk.startswith("err_"))
        print(f"T={t} {k}->{n}: dense {row['dense']:.3f} | "
              + " ".join(f"{m} {row['dense'] / row['ours_' + m]:.3f}x" for m in S.MODES)
              + f" | prep {row['ours_prep'] or float('nan'):.3f} ms (cslt {row['prep_cslt_compress']:.3f})"
              + f" | peer train {_ratio(row['dense'], row['peer_train']):.3f}x err {row.get('peer_err', -1):.1e}"
              + f" | fwd ours {row['dense_fwd'] / row['ours_24_fwd_only']:.3f}x"
              + f" peer {_ratio(row['dense_fwd'], row['peer_fwd']):.3f}x | max err {err:.1e}", flush=True)
    out["algs"] = S.alg_table()
    return out


def fp16():
    """fp16 correctness of every mode at the benchmark shapes. Run it in its own process: a fault of the GPU
    context in fp16 (seen on the H200, docs/history/semi24.md) would lose the other sections."""
    out = {}
    for (t, k, n) in LINEAR_SHAPES:
        row = out[f"{t}x{k}->{n}"] = _linear_errors(t, k, n, (torch.float16,))
        row["pack_supported"] = S.pack_supported(n, k, torch.float16, torch.device(DEV))
        print(f"fp16 T={t} {k}->{n}: " + " ".join(f"{kk}={v:.1e}" for kk, v in row.items() if kk.startswith("err"))
              + f" pack_supported={row['pack_supported']}", flush=True)
    return out


def vit(batch=64, rep=2000):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                    image_size=224, patch_size=16, num_labels=1000, attn_implementation="sdpa")
    tokens = batch * ((224 // 16) ** 2 + 1)
    images = torch.randn(batch, 3, 224, 224, device=DEV)
    labels = torch.randint(0, 1000, (batch,), device=DEV)
    out = {"tokens": tokens, "batch": batch}

    def build(variant):
        torch.manual_seed(0)
        with torch.device(DEV):  # initialise on the GPU: CPU init of 300M parameters takes many seconds
            model = ViTForImageClassification(cfg)
        records = None
        if variant != "dense":
            enc = model.vit  # every linear of the backbone (the transformers 4 and 5 layouts alike)
            for name, mod in list(enc.named_modules()):
                if isinstance(mod, torch.nn.Linear):
                    parent = enc.get_submodule(name.rsplit(".", 1)[0])
                    setattr(parent, name.rsplit(".", 1)[1], SparseLinear.from_dense(mod, format="2:4"))
            if variant == "sparse_dispatch":
                records = plan_dispatch(model, tokens, dtype=BF, rep_ms=30)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        return model, opt, records

    def step(model, opt):
        with torch.autocast("cuda", dtype=BF):
            loss = model(pixel_values=images, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def run(variant):
        model, opt, records = build(variant.replace("_again", ""))
        losses = [step(model, opt).item() for _ in range(3)]
        ms = bench(lambda: step(model, opt), rep=rep, warmup=200)
        res = {"ms": ms, "images_per_s": batch / ms * 1e3, "first_losses": losses,
               "max_mem_gb": torch.cuda.max_memory_allocated() / 2 ** 30}
        if records:
            res["dispatch"] = records
            choices = {}
            for r in records:
                key = f"{r['shape']} {r['choice']}"
                choices[key] = choices.get(key, 0) + 1
            res["choices"] = choices
        return res

    for variant in ("dense", "sparse_dispatch", "sparse_all24", "dense_again"):
        r = out[variant] = run(variant)
        print(f"vit {variant}: {r['ms']:.1f} ms/step  {r['images_per_s']:.1f} img/s  "
              f"losses {r['first_losses']}", flush=True)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return out


def table(results: dict) -> str:
    """A markdown summary of the linear and ViT sections."""
    e = results.get("env", {})
    lines = [f"# {e.get('gpu')}  torch {e.get('torch')}  triton {e.get('triton')}  {e.get('date')}"]
    lin = results.get("linear", {})
    if isinstance(lin, dict) and "error" not in lin:
        lines.append("| tokens x in->out | dense ms | 24 | 24fwd | masked dense | prep ms | peer train | max err |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for key, r in lin.items():
            if key == "algs":
                continue
            pt = f"{r['dense'] / r['peer_train']:.3f}x" if r.get("peer_train") else "error"
            lines.append(f"| {key} | {r['dense']:.3f} | {r['dense'] / r['ours_24']:.3f}x | "
                         f"{r['dense'] / r['ours_24fwd']:.3f}x | {r['dense'] / r['ours_dense']:.3f}x | "
                         f"{r['ours_prep'] or float('nan'):.3f} | {pt} | "
                         f"{max(v for k, v in r.items() if k.startswith('err_')):.1e} |")
    rows = results.get("models", {})
    if isinstance(rows, dict) and "error" not in rows and rows:
        lines.append("| model, tokens | in->out | F.linear ms | 24 | 24fwd | masked dense | dispatch |")
        lines.append("|---|---|---|---|---|---|---|")
        for r in rows.values():
            lines.append(f"| {r['model']}, {r['tokens']} | {r['in']}->{r['out']} | {r['ms_linear']:.3f} | "
                         + " | ".join(f"{r['x_linear_' + m]:.3f}x" for m in S.MODES) + f" | {r['choice']} |")
    v = results.get("vit", {})
    if isinstance(v, dict) and "dense" in v:
        for name in ("dense", "sparse_dispatch", "sparse_all24", "dense_again"):
            if name in v:
                lines.append(f"ViT-L {name}: {v[name]['ms']:.1f} ms  {v[name]['images_per_s']:.1f} img/s  "
                             f"({v['dense']['ms'] / v[name]['ms']:.3f}x dense)")
        if "choices" in v.get("sparse_dispatch", {}):
            lines.append(f"dispatch: {v['sparse_dispatch']['choices']}")
    return "\n".join(lines)


#: model -> (tokens per step, hidden, MLP width): ViT-B/16 at the recipes' 256 images of 197 tokens, ViT-L/16 at
#: 128, ViT-H/14 at 64 images of 257
MODEL_SHAPES = {"vit_b16": (256 * 197, 768, 3072), "vit_l16": (128 * 197, 1024, 4096),
                "vit_h14": (64 * 257, 1280, 5120)}


def models(time_modes=None, margin: float = 0.02) -> dict:
    """Each distinct linear shape of the models in MODEL_SHAPES, timed by the dispatch's own timer."""
    from sparsetrain.nn.formats.semi24 import _time_modes, choose_mode

    time_modes = time_modes or _time_modes
    out = {}
    for name, (tokens, h, mlp) in MODEL_SHAPES.items():
        for k, n, what in ((h, h, "query/key/value, output"), (h, mlp, "fc1"), (mlp, h, "fc2")):
            ms = time_modes(k, n, True, tokens, torch.float32, BF, torch.device(DEV), S.MODES, 50.0)
            choice = choose_mode(ms, S.MODES, margin)
            row = {"model": name, "tokens": tokens, "in": k, "out": n, "layers": what, "choice": choice,
                   **{f"x_linear_{m}": ms["linear"] / ms[m] for m in S.MODES},
                   **{f"ms_{m}": v for m, v in ms.items()}}
            out[f"{name} {k}->{n}"] = row
            print(f"{name} T={tokens} {k}->{n} ({what}): linear {ms['linear']:.3f} ms | "
                  + " ".join(f"{m} {row['x_linear_' + m]:.3f}x" for m in S.MODES) + f" | dispatch: {choice}",
                  flush=True)
            torch.cuda.empty_cache()
    return out


SECTIONS = {"env": env, "prep": prep, "linear": linear, "fp16": fp16, "vit": vit, "models": models}


def run_section(results: dict, name: str) -> None:
    """Runs one section into ``results[name]``; an exception is printed and recorded, not raised."""
    print(f"== {name}", flush=True)
    t0 = time.time()
    try:
        results[name] = SECTIONS[name]()
    except Exception as e:  # noqa: BLE001 - keep going: one broken section must not lose the others
        traceback.print_exc()
        results[name] = {"error": repr(e)[:500]}
    print(f"   ({time.time() - t0:.1f} s)", flush=True)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sparsetrain bench semi24", description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="env,prep,linear,vit", help=f"comma separated, of {sorted(SECTIONS)}")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="", help="suffix of the json file name")
    args = ap.parse_args(argv)
    names = args.sections.split(",")
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {sorted(SECTIONS)}")
    if not torch.cuda.is_available():
        print("sparsetrain bench semi24 needs a CUDA GPU", flush=True)
        return 2
    torch.manual_seed(0)
    results: dict = {}
    os.makedirs(args.out, exist_ok=True)
    for name in names:
        run_section(results, name)
        with open(os.path.join(args.out, f"bench_semi24{args.tag}.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(table(results))
    return 0
