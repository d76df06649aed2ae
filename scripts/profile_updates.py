"""Cost of mask updates on a GPU: BERT-base MLM, all encoder linears 90% sparse in 16x16 blocks
(`format=block`), bf16 autocast, AdamW. Times a plain training step, a RigL update step (dense-gradient capture in
the backward + the update) and a SET update, and profiles one update.

    python scripts/profile_updates.py [--block 16] [--batch 64] [--seq 128]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from sparsetrain.models import build_model
from sparsetrain.nn import sparsify
from sparsetrain.sparsity import SET, PruneRegrow, RigL


def measure(policy, a) -> tuple[str, float, float, float]:
    dev = "cuda"
    torch.manual_seed(0)
    model = build_model("bert", "base", vocab_size=30522, seq_len=a.seq, attn_implementation="sdpa").to(dev)
    sparsify(model, density=0.1, block=a.block, format="block")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    sched = PruneRegrow(policy=policy, drop_fraction=0.3, drop_schedule="constant", interval=5)
    sched.attach(model, opt, total_steps=1000)
    x = torch.randint(0, 30522, (a.batch, a.seq), device=dev)
    step_ms, update_ms = [], []
    for step in range(1, 31):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        prof = cProfile.Profile() if step == 25 else None
        if prof:
            prof.enable()
        rec = sched.step(step)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if prof:
            prof.disable()
            print(f"== profile of one {type(policy).__name__} update (step 25)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        if step > 10:
            (update_ms if rec else step_ms).append(((t1 - t0) * 1e3, (t2 - t1) * 1e3))

    def median(v):
        return sorted(v)[len(v) // 2]

    return (type(policy).__name__, median([s for s, _ in step_ms]), median([s for s, _ in update_ms]),
            median([u for _, u in update_ms]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=128)
    a = p.parse_args()
    rows = []
    for policy in (SET(), RigL()):
        rows.append(measure(policy, a))
        torch.cuda.empty_cache()
    print(f"\nBERT-base, {a.batch}x{a.seq} tokens, 90% sparse {a.block}x{a.block} blocks, format=block, "
          f"{torch.cuda.get_device_name()}")
    print(f"{'policy':<6} {'plain step ms':>14} {'update-step fwd+bwd+opt ms':>27} {'mask update ms':>15}")
    for name, plain, upd_step, upd in rows:
        print(f"{name:<6} {plain:>14.2f} {upd_step:>27.2f} {upd:>15.2f}")


if __name__ == "__main__":
    main()
