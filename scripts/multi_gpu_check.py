"""What issue 22 asks of a machine with two GPUs (NCCL), run through the real CLI; exits 1 on a failed check.

    python scripts/multi_gpu_check.py [--out runs/multi_gpu] [--steps 60] [--only ddp,fsdp,resume]
        [--recipes bert_phase1_dynamic,bert_rigl] [--extra trainer.compile=false ...]

* ddp: ``bert_dense``, ``bert_phase1_dynamic`` and ``bert_rigl`` (block format) on 2 GPUs with ``accelerate
  launch``: every mask_update row and the summary say ``ranks_masks_identical: true``; tokens/s of 2 GPUs against
  1 (the same per-GPU batch and settings, so the same step mode where both can replay CUDA graphs; target >=
  1.85x). A short check updates masks every ~20 steps where its recipe updates every ~625, so the target is taken
  on what a full-length run gets: the rate of the update-free windows with each update's measured cost spread
  over the recipe's own interval (``sparsetrain.bench._e2e_report.steady_rate``); the windows' median is printed too.
* fsdp: ``bert_rigl`` under FSDP2 (full shard, one group per BertLayer): masks identical at every update, and
  its losses follow the DDP run's (bf16: within 2%).
* resume: the FSDP and the DDP run's middle checkpoints continue on one GPU with ``trainer.grad_accum=2`` (the
  same global batch): the same mask updates (pruned counts) and losses within 2% of the two-GPU runs.

Each run's directory, command and numbers are printed; the table at the end is what the README's multi-GPU
section needs (device, date, command). Set NCCL_NVLS_ENABLE=0 (NVLink multicast off) on machines that have it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from sparsetrain.bench._e2e_report import steady_rate
from sparsetrain.bench._e2e_runs import read_run
from sparsetrain.bench._e2e_variants import Variant, recipe_facts

FSDP = ["--use_fsdp", "--fsdp_version", "2", "--fsdp_cpu_ram_efficient_loading", "false",
        "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap", "BertLayer",
        "--fsdp_reshard_after_forward", "true"]


def run(name: str, out: Path, recipe: str, processes: int, steps: int, extra: list[str] = (),
        launch: list[str] = (), dynamic: bool = True) -> Path | None:
    """One CLI run under ``accelerate launch``; its directory, or None (printed as FAIL) when it exited non-zero,
    so that one failed run does not stop the checks after it."""
    d = out / name
    several = ["--multi_gpu"] if processes > 1 and not launch else []   # DDP; FSDP comes with its own flags
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), *several,
           "--mixed_precision", "bf16", *launch, "-m", "sparsetrain.cli", "train", f"recipe={recipe}",
           f"trainer.max_steps={steps}", "trainer.log_every=10", "trainer.eval_every=0", "logger=quiet",
           f"trainer.checkpoint_every={steps // 2}", "trainer.keep_checkpoints=4",
           *([f"sparsity.scheduler.num_updates={max(2, steps // 20)}"] if dynamic else []), f"hydra.run.dir={d}",
           *extra]
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    done = subprocess.run(cmd, env=env)
    if done.returncode:
        print(f"FAIL  {name}: exit status {done.returncode}", flush=True)
        return None
    return d


def rows(d: Path) -> list[dict]:
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def summary(d: Path) -> dict:
    return json.loads((d / "summary.json").read_text())


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []
        self.table: list[tuple[str, str]] = []

    def expect(self, ok: bool, what: str) -> None:
        print(("ok    " if ok else "FAIL  ") + what, flush=True)
        if not ok:
            self.failed.append(what)


def masks_identical(c: Checks, d: Path) -> None:
    updates = [r for r in rows(d) if r.get("event") == "mask_update"]
    c.expect(bool(updates) and all(r.get("ranks_masks_identical") is True for r in updates),
             f"{d.name}: ranks_masks_identical at all {len(updates)} updates")
    c.expect(summary(d).get("ranks_masks_identical") is True, f"{d.name}: masks identical at the end")


def follows(c: Checks, a: Path, b: Path, rel: float = 0.02) -> None:
    """``b`` (resumed, or another parallelism) logs the losses and mask updates of ``a`` where both have them."""
    la = {r["step"]: r["loss"] for r in rows(a) if "loss" in r}
    lb = {r["step"]: r["loss"] for r in rows(b) if "loss" in r}
    common = sorted(set(la) & set(lb))
    worst = max((abs(la[s] - lb[s]) / abs(la[s]) for s in common), default=float("inf"))
    c.expect(bool(common) and worst <= rel, f"{b.name} follows {a.name}: losses within {worst:.2%} at {common}")
    ua = {r["step"]: r["pruned"] for r in rows(a) if r.get("event") == "mask_update"}
    ub = {r["step"]: r["pruned"] for r in rows(b) if r.get("event") == "mask_update"}
    c.expect(all(ua.get(s) == n for s, n in ub.items()), f"{b.name}: the same pruned counts as {a.name}")


def throughput(c: Checks, recipe: str, one: Path, two: Path, interval: float | None) -> None:
    """2 GPUs against 1: the target on the rate a full-length run gets (update-free windows, updates at the
    recipe's interval), with the median window rate of this short run beside it."""
    s1, s2 = steady_rate(read_run(one), interval), steady_rate(read_run(two), interval)
    median = summary(two)["tokens_per_s"] / summary(one)["tokens_per_s"]
    if s1 is None or s2 is None:
        c.expect(False, f"{recipe}: no update-free window to measure (run more --steps)")
        return
    ratio = s2["rate_at_interval"] / s1["rate_at_interval"]
    every = f"an update every {interval:.0f} steps" if interval else "no mask updates"
    c.expect(ratio >= 1.85, f"{recipe}: 2 GPUs / 1 GPU tokens/s = {ratio:.2f}x at the recipe's schedule ({every}; "
                            f"target >= 1.85x); median window of this check {median:.2f}x")
    updates = (f"; one update {1e3 * s1['update_s']:.0f} / {1e3 * s2['update_s']:.0f} ms"
               if "update_s" in s1 and "update_s" in s2 else "")
    c.table.append((recipe, f"{s1['rate_at_interval']:,.0f} | {s2['rate_at_interval']:,.0f} | {ratio:.2f}x | "
                            f"{median:.2f}x{updates} | {summary(one)['step_mode']} / {summary(two)['step_mode']}"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/multi_gpu"))
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--only", default="ddp,fsdp,resume")
    ap.add_argument("--recipes", default="bert_dense,bert_phase1_dynamic,bert_rigl", help="the DDP part's recipes")
    ap.add_argument("--extra", action="append", default=[], help="an override for every run (repeatable)")
    a = ap.parse_args()
    parts, c, steps = set(a.only.split(",")), Checks(), a.steps
    if "ddp" in parts or "resume" in parts:
        for recipe in a.recipes.split(","):
            facts = recipe_facts(Variant(recipe, recipe))
            if recipe != "bert_rigl" and "resume" in parts and "ddp" not in parts:
                continue   # the resume part needs bert_rigl's run only
            two = run(f"{recipe}_ddp2", a.out, recipe, 2, steps, a.extra, dynamic=facts["dynamic"])
            if two is None:
                c.failed.append(f"{recipe}_ddp2 did not finish")
                continue
            if facts["dynamic"]:
                masks_identical(c, two)
            if "ddp" in parts:
                one = run(f"{recipe}_gpu1", a.out, recipe, 1, steps, a.extra, dynamic=facts["dynamic"])
                if one is None:
                    c.failed.append(f"{recipe}_gpu1 did not finish")
                    continue
                throughput(c, recipe, one, two, facts.get("recipe_interval"))
    if "fsdp" in parts or "resume" in parts:
        fsdp = run("bert_rigl_fsdp2", a.out, "bert_rigl", 2, steps, [*a.extra, "trainer.compile=false"], FSDP)
        if fsdp is None:
            c.failed.append("bert_rigl_fsdp2 did not finish")
        else:
            masks_identical(c, fsdp)
            if (a.out / "bert_rigl_ddp2" / "summary.json").exists():
                follows(c, a.out / "bert_rigl_ddp2", fsdp)
    if "resume" in parts:
        for source in ("bert_rigl_fsdp2", "bert_rigl_ddp2"):
            middle = a.out / source / "checkpoints" / f"step_{steps // 2:08d}"
            if not middle.is_dir():
                c.failed.append(f"no checkpoint {middle} to resume")
                continue
            resumed = run(f"{source}_on_gpu1", a.out, "bert_rigl", 1, steps,
                          [*a.extra, "trainer.grad_accum=2", "trainer.compile=false", f"trainer.resume={middle}"])
            if resumed is None:
                c.failed.append(f"{source}_on_gpu1 did not finish")
                continue
            follows(c, a.out / source, resumed)
    if c.table:
        print("| recipe | 1 GPU tokens/s | 2 GPUs | 2 / 1 (recipe schedule) | 2 / 1 (median window of this check) "
              "| step mode 1 / 2 |")
    for name, value in c.table:
        print(f"| {name} | {value} |")
    print("all checks passed" if not c.failed else f"{len(c.failed)} failed: {c.failed}", flush=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
