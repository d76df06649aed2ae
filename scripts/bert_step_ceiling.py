"""How much faster can a BERT-base MLM training step get when only its encoder linears get faster?

Times, in one process on one GPU (bf16 autocast, SDPA attention, fused AdamW, batch x seq tokens):
  dense            the plain model;
  free_linears     every encoder linear (72) replaced by a zero-FLOP stand-in that still reads its input and
                   writes its output (a slice/tile of x times a learnable scalar): the step time a sparse kernel
                   of infinite speed would give, so dense / free_linears is the ceiling of any linear speedup;
  block b16 / b64  encoder linears 90% sparse through the block-sparse kernels (format="block");
and the encoder linears alone (fwd+bwd of the 6 shapes x 12 layers, dense cuBLAS). Prints a table last.

    python scripts/bert_step_ceiling.py [--batch 64] [--seq 128] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

from sparsetrain.models import build_model
from sparsetrain.nn import sparsify
from sparsetrain.nn.sparsify import select_linears


class FreeLinear(nn.Module):
    """Zero-FLOP stand-in for nn.Linear(i, o): y = tile/slice of x along features, times a scalar."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.i, self.o = lin.in_features, lin.out_features
        self.scale = nn.Parameter(torch.ones((), device=lin.weight.device))

    def forward(self, x):
        if self.o <= self.i:
            y = x[..., : self.o]
        else:
            y = x.repeat(*([1] * (x.dim() - 1)), self.o // self.i)
        return y * self.scale


def swap_free(model):
    for name in list(select_linears(model)):
        parent = model.get_submodule(name.rsplit(".", 1)[0])
        leaf = name.rsplit(".", 1)[1]
        setattr(parent, leaf, FreeLinear(getattr(parent, leaf)))


OPT = {"fused": True, "clip": None}  # set from the command line


def make_opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=OPT["fused"], foreach=None if OPT["fused"] else True)


def step_ms(model, batch, seq, steps=30, warm=10):
    opt = make_opt(model)
    x = torch.randint(0, 30522, (batch, seq), device="cuda")
    times = []
    for s in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if OPT["clip"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), OPT["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if s >= warm:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], torch.cuda.max_memory_allocated() / 2**30


def profile_steps(model, batch, seq, label, steps=3):
    from torch.profiler import ProfilerActivity, profile

    opt = make_opt(model)
    x = torch.randint(0, 30522, (batch, seq), device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    print(f"== {label}: top GPU kernels over {steps} steps")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def linears_ms(model, tokens):
    import triton.testing
    total = 0.0
    shapes = {}
    for lin in select_linears(model).values():
        shapes[(lin.in_features, lin.out_features)] = shapes.get((lin.in_features, lin.out_features), 0) + 1
    for (i, o), count in shapes.items():
        w = torch.randn(o, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        x = torch.randn(tokens, i, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, o, device="cuda", dtype=torch.bfloat16)

        def fb(w=w, x=x, g=g):
            F.linear(x, w).backward(g)

        total += count * triton.testing.do_bench(fb, warmup=10, rep=50, return_mode="median")
    return total, shapes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile each model (the block kernels run as the sparsetrain custom op)")
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead (CUDA graphs)")
    ap.add_argument("--variants", default="dense,free_linears,block_b16,block_b64,dense_again")
    ap.add_argument("--profile", action="store_true", help="print each variant's top GPU kernels (3 steps)")
    ap.add_argument("--optimizer", choices=["fused", "foreach"], default="fused",
                    help="AdamW implementation (the CLI's recipes use torch's default, foreach)")
    ap.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ each step (the CLI: 1.0)")
    a = ap.parse_args()
    OPT.update(fused=a.optimizer == "fused", clip=a.clip)
    rows = {}
    for variant in a.variants.split(","):
        torch.manual_seed(0)
        torch.cuda.reset_peak_memory_stats()
        model = build_model("bert", "base", vocab_size=30522, seq_len=a.seq, attn_implementation="sdpa").cuda()
        if variant == "free_linears":
            swap_free(model)
        elif variant.startswith("block"):
            sparsify(model, density=0.1, block=int(variant[-2:]), format="block")
        if a.compile:
            step_ms(model, a.batch, a.seq, steps=2, warm=1)  # one eager step first (tunes, builds the metas)
            t0 = time.perf_counter()
            model = torch.compile(model, mode=a.compile_mode)
        ms, peak = step_ms(model, a.batch, a.seq)
        if a.profile:
            profile_steps(model, a.batch, a.seq, variant)
        if a.compile:
            rows.setdefault("_compile_s", {})[variant] = time.perf_counter() - t0
            from sparsetrain.kernels.blocksparse import OP_META_BUILDS
            print(f"  block-sparse metadata objects built by the custom ops so far: {OP_META_BUILDS[0]}")
        rows[variant] = {"step_ms": ms, "peak_gb": peak}
        print(f"{variant}: {ms:.2f} ms/step, peak {peak:.2f} GB", flush=True)
        del model
        torch.cuda.empty_cache()
    model = build_model("bert", "base", vocab_size=30522, seq_len=a.seq, attn_implementation="sdpa").cuda()
    lin_ms, shapes = linears_ms(model, a.batch * a.seq)
    compile_s = rows.pop("_compile_s", None)
    dense = sum(rows[v]["step_ms"] for v in ("dense", "dense_again") if v in rows) / sum(
        v in rows for v in ("dense", "dense_again"))
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "batch": a.batch, "seq": a.seq,
            "rows": rows, "encoder_linears_fwd_bwd_ms": lin_ms, "compiled": a.compile, "compile_mode": a.compile_mode, "optimizer": a.optimizer, "clip": a.clip, "compile_s": compile_s,
            "linear_shapes": {f"{i}->{o}": c for (i, o), c in shapes.items()},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bert_step_ceiling.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(f"\nencoder linears alone (dense cuBLAS, fwd+bwd, {sum(shapes.values())} layers): {lin_ms:.2f} ms "
          f"= {lin_ms / dense:.0%} of the dense step")
    print("| variant | ms/step | tokens/s | vs dense | peak GB |")
    print("|---|---|---|---|---|")
    for k, r in rows.items():
        tps = a.batch * a.seq / r["step_ms"] * 1e3
        print(f"| {k} | {r['step_ms']:.2f} | {tps:,.0f} | {dense / r['step_ms']:.2f}x | {r['peak_gb']:.2f} |")


if __name__ == "__main__":
    main()
