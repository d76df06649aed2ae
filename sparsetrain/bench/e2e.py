"""End-to-end training throughput: dense and sparse variants through the real training loop, eager, CUDA graph and
compiled + CUDA graph.

    sparsetrain bench e2e --out $OUT --json $OUT/e2e.json --plot $OUT/e2e.png
    sparsetrain bench e2e --variants dense,static_b16 --modes graph --steps 40 --breakdown none
    sparsetrain bench e2e --model vit --variants dense,static_b16 --modes compiled
    sparsetrain bench e2e --recipe-map "tiny=quickstart:sparsity=static trainer=cpu_small" --variants tiny

Each variant in each mode is one ``python -m sparsetrain.cli train`` process (fresh memory statistics and tuner
caches) with the same overrides: ``trainer.max_steps``, ``batch_size``, no eval, no periodic checkpoints, quiet
logger, and the mode's: ``trainer.cuda_graph=false`` (eager), ``true`` (graph) or ``true`` with
``trainer.compile=true`` (compiled: torch.compile's fused kernels inside the whole-step graph). The table reads each run's summary.json
(median window throughput, graph captures / eager steps) and metrics.jsonl (peak memory, window times, mask
updates). For a dynamic variant the cost of one mask update is derived from the windows: the mean step time of
windows that contain an update minus that of windows that do not, times the steps per window (window 1, the
warm-up, is left out), then amortised over the recipe's own interval (its ``max_steps / num_updates``) as a
share of the update-free step time. ``--breakdown`` adds, per variant and mode, one profiled run (in a process
of its own) that splits three steps into kernel categories and host gaps (:mod:`sparsetrain.bench._e2e_breakdown`).
docs/benchmarks/e2e.md explains the columns.

This module is the command (:func:`parse_args`, :func:`main`); what runs is :mod:`sparsetrain.bench._e2e_variants`,
running it :mod:`sparsetrain.bench._e2e_runs`, the table and plot :mod:`sparsetrain.bench._e2e_report`.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from sparsetrain.bench._child import Stopped
from sparsetrain.bench._e2e_breakdown import format_breakdown, profile_child
from sparsetrain.bench._e2e_report import FLOPS_NOTE, NOTE, format_table, plot, uneven_windows
from sparsetrain.bench._e2e_runs import RESULTS_FILE, Bench
from sparsetrain.bench._e2e_variants import DEFAULT_BATCH, DEFAULT_VARIANTS, MODES, Variant
from sparsetrain.bench._gpu_clock import clock_lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sparsetrain bench e2e", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(DEFAULT_VARIANTS), default="bert", help="bert (BERT-base), bert_large, vit (ViT-B/16), vit_large")
    p.add_argument("--variants", help="comma separated (default: the model's variants and every --recipe-map)")
    p.add_argument("--recipe-map", action="append", default=[], type=Variant.parse, metavar="NAME=RECIPE[:OVR]",
                   help="add or replace a variant: a recipe and space-separated overrides")
    p.add_argument("--baseline", default="dense", help="the variant ratios are taken against")
    p.add_argument("--modes", default="eager,graph,compiled", help="comma separated: eager, graph, compiled")
    p.add_argument("--extra", action="append", default=[], help="more overrides for every run (space separated)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, help="per-step batch (default: 256)")
    p.add_argument("--seq", type=int, default=128, help="data.seq_len of text models")
    p.add_argument("--log-every", type=int, default=10, help="steps per measured window")
    p.add_argument("--updates", type=int, help="mask updates of dynamic variants in the run (default: chosen "
                                                "so that updates fall inside windows, with update-free windows)")
    p.add_argument("--breakdown", default="dense,static_b16", help="variants profiled per kernel category "
                                                                   "(none: skip)")
    p.add_argument("--profile-at", type=int, default=5, help="the breakdown profiles steps N..N+2")
    p.add_argument("--out", help="run directories (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep run directories (checkpoints are always deleted)")
    p.add_argument("--resume", action="store_true", help="reuse finished runs of the same command in --out")
    p.add_argument("--repeat", type=int, default=1, help="rounds: every variant and mode runs once per round, "
                   "rounds one after another; each ratio is taken within its round, and the table shows its mean "
                   "and range over the rounds (a drift of the GPU's clock reaches every variant alike)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG bar chart here")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown {bad}; use some of {','.join(MODES)}")
    if args.steps < 1 or args.log_every < 1 or args.repeat < 1:
        p.error("--steps, --log-every and --repeat must be >= 1")
    table = {v.name: v for v in (*DEFAULT_VARIANTS[args.model], *args.recipe_map)}
    names = args.variants.split(",") if args.variants else list(table)
    if unknown := [n for n in names if n not in table]:
        p.error(f"--variants: unknown {unknown}; known: {sorted(table)} (add one with --recipe-map)")
    args.variant_list = [table[n] for n in names]
    args.breakdown = [] if args.breakdown in ("", "none") else [b for b in args.breakdown.split(",") if b in names]
    args.batch = args.batch or DEFAULT_BATCH[args.model]
    args.extra = [o for chunk in args.extra for o in chunk.split()]
    return args


def main(argv: list[str]) -> int:
    if argv[:1] == ["--profile-child"]:
        return profile_child(argv[1])
    args = parse_args(argv)
    bench = Bench(args, argv)
    try:
        rows = bench.run()
    except Stopped as stop:
        bench.save()
        print(f"\n{stop} (the running run and its processes were ended); finished runs are kept in "
              f"{bench.out / RESULTS_FILE}: the same command with --out {bench.out} --resume goes on from there",
              file=sys.stderr)
        return 128 + stop.signum
    print("\n==== end-to-end training throughput ====")
    print(format_table(rows))
    gemm = bench.results.get("env", {}).get("bf16_gemm_tflops")
    if any(r.get("model_tflops") for r in rows):
        print(FLOPS_NOTE.format(f"{gemm:.0f} TFLOP/s" if gemm else "not measured: no CUDA GPU"))
    if any(r.get("update") for r in rows):
        print(NOTE)
    for line in uneven_windows(bench.results.get("runs", [])) + clock_lines(bench.results.get("runs", []),
                                                                            args.baseline):
        print(line)
    if bench.results["breakdown"]:
        print("\n==== per-step breakdown (ms per step, 3 profiled steps; head: FLOPs share from sparsetrain.flops, "
              "not timed) ====")
        print(format_breakdown(bench.results["breakdown"]))
    if args.json:
        Path(args.json).write_text(json.dumps(bench.results, indent=1, default=str))
        print(f"wrote {args.json}")
    if args.plot:
        env = bench.results.get("env", {})
        plot(rows, args.plot, f"{args.model}, batch {args.batch}, {args.steps} steps, {env.get('gpu', 'CPU')}")
        print(f"wrote {args.plot}")
    failed = any(r.get("error") for r in rows) or any(b.get("error") for b in bench.results["breakdown"].values())
    if failed:
        print(f"logs of the failed runs: {bench.out}")
    elif not args.keep and not args.out:
        shutil.rmtree(bench.out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
