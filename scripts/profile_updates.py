"""Where a mask update's time goes on a GPU: BERT (mini or base) MLM, every encoder linear 90% sparse in blocks
(`format=block`), bf16 autocast, fused AdamW. For SET and RigL it times a plain training step and one mask update
(the scheduler hook alone), and profiles one update: host-device syncs, copies, kernel launches, the GPU's kernel
time, and the host functions that take the most time.

    python scripts/profile_updates.py [--model base|mini] [--block 16] [--batch 256] [--seq 128] [--out FILE.json]
        [--streams 1,8] [--together 1,0]

``--streams``: the parallel branches of the captured update (``GraphedUpdate.STREAMS``), one measurement each.
``--together``: 1, layers of one shape updated together over their stack (``GraphedUpdate.BATCH``); 0, one by one.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sparsetrain.models import build_model
from sparsetrain.nn import sparsify
from sparsetrain.sparsity import SET, PruneRegrow, RigL
from sparsetrain.sparsity.graphed import GraphedUpdate

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def _setup(policy, a):
    torch.manual_seed(0)
    model = build_model("bert", a.model, vocab_size=30522, seq_len=a.seq, attn_implementation="sdpa").cuda()
    sparsify(model, density=0.1, block=a.block, format="block")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    sched = PruneRegrow(policy=policy, drop_fraction=0.3, drop_schedule="constant", interval=5)
    sched.attach(model, opt, total_steps=10_000)
    return model, opt, sched


def _step(model, opt, x) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _counts(prof) -> dict:
    events = prof.key_averages()
    count = {e.key: e.count for e in events}
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") if events else 0
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)[:8]
    return {"host_events": "\n".join(f"{e.self_cpu_time_total:9.0f} us  x{e.count:<4} {e.key[:70]}" for e in host),
            "syncs": sum(count.get(k, 0) for k in SYNCS),
            "copies": sum(v for k, v in count.items() if k.startswith("cudaMemcpy")),
            "launches": sum(count.get(k, 0) for k in LAUNCHES),
            "kernel_ms": kernel_us / 1e3}


def measure(policy, a) -> dict:
    model, opt, sched = _setup(policy, a)
    x = torch.randint(0, 30522, (a.batch, a.seq), device="cuda")
    step_ms, update_ms, detail = [], [], {}
    for step in range(1, 31):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _step(model, opt, x)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        watch = step == 25   # an update step (interval 5), well after warm-up
        prof_ctx = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if watch else None
        host = cProfile.Profile() if step == 20 else None
        if prof_ctx:
            prof_ctx.__enter__()
        if host:
            host.enable()
        rec = sched.step(step)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if host:
            host.disable()
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(10)
            detail["host_top"] = text.getvalue()
        if prof_ctx:
            prof_ctx.__exit__(None, None, None)
            detail.update(_counts(prof_ctx))
        if step > 10:
            (update_ms if rec else step_ms).append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))
    step_med = sorted(s for s, _ in step_ms)[len(step_ms) // 2]
    upd_med = sorted(u for _, u in update_ms)[len(update_ms) // 2]
    return {"policy": type(policy).__name__, "streams": GraphedUpdate.STREAMS, "together": GraphedUpdate.BATCH,
            "layers": len(sched.layers), "step_ms": step_med,
            "update_ms": upd_med, "update_in_steps": upd_med / step_med, **detail}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="base", choices=["base", "mini", "small", "medium"])
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--out", default=None, help="append the rows to this JSON-lines file")
    p.add_argument("--streams", default=str(GraphedUpdate.STREAMS), help="comma list of branch counts to compare")
    p.add_argument("--together", default="1", help="comma list of 1 (same-shape layers together) / 0 (one by one)")
    a = p.parse_args()
    rows = []
    for together in (bool(int(s)) for s in a.together.split(",")):
        for streams in (int(s) for s in a.streams.split(",")):
            GraphedUpdate.STREAMS, GraphedUpdate.BATCH = streams, together
            for policy in (SET(), RigL()):
                rows.append(measure(policy, a))
                torch.cuda.empty_cache()
    print(f"\nBERT-{a.model}, {a.batch}x{a.seq} tokens, 90% sparse {a.block}x{a.block} blocks, format=block, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'policy':<6} {'together':>8} {'streams':>7} {'layers':>6} {'step ms':>8} {'update ms':>10} {'= steps':>8} {'syncs':>6} {'copies':>7} "
          f"{'launches':>9} {'GPU kernel ms':>14}")
    for r in rows:
        print(f"{r['policy']:<6} {str(r['together']):>8} {r['streams']:>7} {r['layers']:>6} {r['step_ms']:>8.2f} {r['update_ms']:>10.2f} "
              f"{r['update_in_steps']:>8.2f} {r.get('syncs', 0):>6} {r.get('copies', 0):>7} {r.get('launches', 0):>9} "
              f"{r.get('kernel_ms', 0):>14.3f}")
    for r in rows[:2]:
        print(f"== {r['policy']}: host events by own time in one update (torch profiler)\n{r.get('host_events', '')}")
        print(f"== {r['policy']}: host functions by own time in one update\n{r.get('host_top', '')[-2500:]}")
    if a.out:
        with open(a.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**vars(a), **{k: v for k, v in r.items() if k not in ("host_top", "host_events")}})
                        + "\n")


if __name__ == "__main__":
    main()
