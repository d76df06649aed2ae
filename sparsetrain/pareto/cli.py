"""The `sparsetrain pareto` command: read the runs, print the table, write the figure and tables."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from sparsetrain.pareto.curves import dense_target, format_reach_table, read_curves, write_curves
from sparsetrain.pareto.figures import plot_pareto
from sparsetrain.pareto.matching import dense_steps
from sparsetrain.pareto.runs import collect_runs
from sparsetrain.pareto.tables import _mixed_runs, format_table, write_tables


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """`sparsetrain pareto RUN_DIR... [--out FILE.png] [--dense-steps]`: print the table, write the plot, CSV
    and markdown table; with `--dense-steps`, print only the dense baselines' step counts (comma separated, for
    `trainer.max_steps=...` of a Hydra multirun) and say on stderr what each one matches.

    Returns 0 on success, 1 when no run can be plotted (or no dense step count is left), 2 on a bad path.

    Example:
        >>> main(["multirun/2026-11-21/10-00-00", "--out", "pareto.png"])
        0
    """
    parser = argparse.ArgumentParser(prog="sparsetrain pareto", description="Compare finished runs: final eval loss "
                                     "against training FLOPs and against GPU-seconds.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run dirs, multirun folders, or FILE.csv tables an earlier call wrote")
    parser.add_argument("--out", default="pareto.png",
                        help="PNG to write; FILE.csv and FILE.md go beside it (default: ./pareto.png)")
    parser.add_argument("--dense-steps", action="store_true",
                        help="print the trainer.max_steps of the dense runs that match the sparse runs' FLOPs and "
                             "GPU-seconds, comma separated, and write nothing")
    parser.add_argument("--curves", action="store_true",
                        help="also every evaluation of each run: print the GPU-seconds each needs to reach the target "
                             "loss and write FILE_curves.png / FILE_curves.csv (eval loss vs GPU-seconds and FLOPs)")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="with --curves: the eval loss to reach (default: the dense baseline's final one)")
    args = parser.parse_args(argv)
    try:
        runs = collect_runs(args.run_dirs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dense_steps:
        try:
            chosen = dense_steps(runs)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        for steps, why in chosen:
            print(f"dense {steps} steps: {why}", file=sys.stderr)
        if not chosen:
            print("error: every dense baseline has been run already", file=sys.stderr)
            return 1
        print(",".join(str(steps) for steps, _ in chosen))
        return 0
    print(format_table(runs))
    for line in _mixed_runs(runs):
        if line:
            print(line.replace("**", ""), file=sys.stderr)
    try:
        out = plot_pareto(runs, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    csv_path, md_path = write_tables(runs, out)
    print(f"wrote {out}, {csv_path.name}, {md_path.name}")
    return _curves(runs, out, args.target_loss) if args.curves else 0


def _curves(runs, out, target_loss: float | None) -> int:
    """``--curves``: the time-to-quality table printed, the curves drawn beside ``out``."""
    target, how = target_loss, "--target-loss"
    if target is None:
        target, how = dense_target(runs), "the dense baseline's final eval loss"
    if target is None:
        print("error: --curves: no finished dense run to take the target loss from; give --target-loss",
              file=sys.stderr)
        return 1
    found = read_curves(runs)
    try:
        png, table = write_curves(found, target, out)
    except ValueError as e:
        print(f"error: --curves: {e}", file=sys.stderr)
        return 1
    print(format_reach_table(found, target, how))
    print(f"wrote {png.name}, {table.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
