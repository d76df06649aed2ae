"""The tables of `sparsetrain pareto`: labels, Pareto frontiers, the aligned text table, FILE.csv and FILE.md."""
from __future__ import annotations

import csv
import os
from collections.abc import Callable, Sequence
from operator import attrgetter
from pathlib import Path

from sparsetrain.pareto.runs import CSV_COLUMNS, RunResult, _display_path
from sparsetrain.training.metrics import (
    format_flops,
)

# --------------------------------------------------------------------------------------------------
# Frontiers, labels and tables
# --------------------------------------------------------------------------------------------------
# Friendlier names for the built-in dynamic policies, used in the legend beside the recorded method.
_ALIASES = {"prune_regrow/random": "SET", "prune_regrow/gradient": "RigL"}


def _order(runs: Sequence[RunResult]) -> list[RunResult]:
    return sorted(runs, key=lambda r: (r.method.casefold(), -(r.nominal_density or 2.0),
                                       _block_size(r.block), r.seed or 0, r.total_train_flops or 0.0))


def _block_size(block: str | None) -> int:
    """`"16"` or `"16x16"` -> 16 (for sorting); 0 for dense or unknown."""
    head = (block or "").split("x")[0]
    return int(head) if head.isdigit() else 0


def _block_text(block: str | None) -> str:
    """`"16"` -> `"16x16"`, `"16x32"` as it is, dense -> `"-"`."""
    if not block or block == "-":
        return "-"
    return block if "x" in block else f"{block}x{block}"


def point_label(run: RunResult, with_seed: bool = False, with_model: bool = False) -> str:
    """What tells a point apart from the others of its method: steps for a dense run, density and block for a
    sparse one, the model when the runs have several (:func:`several_models`), and the seed when they have
    several seeds.

    Example:
        >>> point_label(RunResult(Path("r"), "static", 0.1, "16", 3.2, 1e15, 60.0, "finished", steps=800))
        '0.1 16x16'
    """
    text = f"{run.steps} steps" if run.dense else f"{run.nominal_density:.3g} {_block_text(run.block)}"
    if with_model and run.model:
        text = f"{run.model} {text}"
    return f"{text} s{run.seed}" if with_seed and run.seed is not None else text


def several_models(runs: Sequence[RunResult]) -> bool:
    """True when ``runs`` train more than one model (then every label names its model)."""
    return len({r.model for r in runs}) > 1


def method_cell(run: RunResult, with_model: bool) -> str:
    """The method column of the tables: ``dense (bert-small)`` where the runs have several models."""
    return f"{run.method} ({run.model})" if with_model and run.model else run.method


def frontier(runs: Sequence[RunResult], cost: Callable[[RunResult], float]) -> list[RunResult]:
    """The runs no other run beats on both cost and loss (the lower-left envelope), by increasing cost.

    Example:
        >>> [r.steps for r in frontier(dense_runs, lambda r: r.total_train_flops)]
        [200, 400, 800]
    """
    out: list[RunResult] = []
    for run in sorted(runs, key=lambda r: (cost(r), r.final_eval_loss)):
        if not out or run.final_eval_loss < out[-1].final_eval_loss:
            out.append(run)
    return out


def _time_axis(points: Sequence[RunResult]) -> tuple[str, str] | None:
    """(RunResult attribute, axis label) of the time panel: GPU-seconds when every point has them, else
    wall-clock seconds when every point has those, else None (no time panel)."""
    if points and all(r.gpu_s is not None and r.gpu_s > 0 for r in points):
        return "gpu_s", "training GPU-seconds (steps after start-up; no eval, no checkpoints)"
    if points and all(r.wall_s is not None and r.wall_s > 0 for r in points):
        return "wall_s", "training wall-clock (s)"
    return None


def _frontier_marks(runs: Sequence[RunResult]) -> dict[Path, list[str]]:
    """For each run on its method's frontier: which panels ("FLOPs", "time") it is on."""
    points = [r for r in runs if r.plottable]
    time = _time_axis(points)
    marks: dict[Path, list[str]] = {r.path: [] for r in runs}
    for method in {r.method for r in points}:
        group = [r for r in points if r.method == method]
        for r in frontier(group, attrgetter("total_train_flops")):
            marks[r.path].append("FLOPs")
        if time is not None:
            for r in frontier(group, attrgetter(time[0])):
                marks[r.path].append("time")
    return marks


def format_table(runs: Sequence[RunResult]) -> str:
    """An aligned text table, one row per run, grouped by method; unfinished runs are marked.

    Example:
        >>> print(format_table(runs))
        method  density  block  seed  steps  FLOPs    GPU s  wall s  eval loss  status    path
        dense   1.000    -      0     1000   4.10e15  640.2  812.3   3.2011     finished  runs/dense
    """
    header = ["method", "density", "block", "seed", "steps", "FLOPs", "GPU s", "wall s", "eval loss", "status",
              "path"]
    body, with_model = [], several_models(runs)
    for r in _order(runs):
        status = r.status if r.status == "finished" else f"*{r.status}"
        body.append([
            method_cell(r, with_model),
            "-" if r.density is None else f"{r.density:.3f}",
            r.block or "-",
            "-" if r.seed is None else str(r.seed),
            "-" if r.steps is None else str(r.steps),
            format_flops(r.total_train_flops),
            "-" if r.gpu_s is None else f"{r.gpu_s:.1f}",
            "-" if r.wall_s is None else f"{r.wall_s:.1f}",
            "-" if r.final_eval_loss is None else f"{r.final_eval_loss:.4f}",
            status,
            _display_path(r.path),
        ])
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *body]]
    if any(r.status != "finished" for r in runs):
        lines.append("* not finished: the point is the last eval row; runs without one are not plotted")
    return "\n".join(lines)


def _mixed(runs: Sequence[RunResult], attr: str, each: str, what: str, where: str = "") -> list[str]:
    """A warning paragraph when the runs differ in ``attr`` (their seconds do not compare): ``each`` formats
    one value's count (``{n}``, ``{v}``), ``what`` says what differs, ``where`` where to read it."""
    values = sorted({getattr(r, attr) for r in runs if getattr(r, attr)})
    if len(values) < 2:
        return []
    counts = ", ".join(each.format(n=sum(getattr(r, attr) == v for r in runs), v=v) for v in values)
    return [f"**Warning:** the runs trained {what} ({counts}{where}): their GPU-seconds do not compare.", ""]


def _mixed_runs(runs: Sequence[RunResult]) -> list[str]:
    """The warnings for runs of different step modes or devices (an H100's seconds are not an H200's)."""
    return [*_mixed(runs, "step_mode", "{n} {v}", "in different step modes", "; summary.json `step_mode`"),
            *_mixed(runs, "device", "{n} on {v}", "on different devices")]


def write_tables(runs: Sequence[RunResult], out: str | os.PathLike) -> tuple[Path, Path]:
    """Write `out` with the suffixes .csv (one row per run, `CSV_COLUMNS`, numbers unrounded) and .md (a markdown
    table, the runs on a method's frontier in bold); return both paths.

    Example:
        >>> write_tables(runs, "study/pareto.png")
        (PosixPath('study/pareto.csv'), PosixPath('study/pareto.md'))
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ordered = _order(runs)
    marks = _frontier_marks(ordered)
    with_seed, with_model = len({r.seed for r in runs}) > 1, several_models(runs)
    csv_path, md_path = out.with_suffix(".csv"), out.with_suffix(".md")
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in ordered:
            writer.writerow([r.method, point_label(r, with_seed, with_model), r.target_density, r.density, r.block, r.seed, r.steps,
                             r.total_train_flops, r.gpu_s, r.wall_s, r.final_eval_loss, " ".join(marks[r.path]),
                             r.status, r.step_mode, r.device, r.date, r.model, _display_path(r.path)])

    devices = ", ".join(sorted({r.device for r in runs if r.device})) or "device not recorded"
    dates = sorted({r.date for r in runs if r.date})
    when = (dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}") if dates else "date unknown"
    lines = [f"# Final eval loss vs training cost: {len(runs)} runs ({devices}, {when})", "",
             "GPU s: seconds of the training steps once the run is going (start-up, evaluation and checkpoints "
             "left out) x processes. **Bold**: on its method's frontier (FLOPs, time).", "",
             *_mixed_runs(runs),
             "| method | density | block | seed | steps | training FLOPs | GPU s | final eval loss | frontier | "
             "status | run |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ordered:
        loss = "-" if r.final_eval_loss is None else f"{r.final_eval_loss:.4f}"
        lines.append(" | ".join([
            f"| {method_cell(r, with_model)}", "-" if r.nominal_density is None else f"{r.nominal_density:.3g}", _block_text(r.block),
            "-" if r.seed is None else str(r.seed), "-" if r.steps is None else str(r.steps),
            format_flops(r.total_train_flops), "-" if r.gpu_s is None else f"{r.gpu_s:.1f}",
            f"**{loss}**" if marks[r.path] else loss, ", ".join(marks[r.path]) or "-", r.status,
            f"`{_display_path(r.path)}` |"]))
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return csv_path, md_path
