"""Time to quality: every evaluation of each run against the training GPU-seconds and FLOPs spent to reach it, and
the GPU-seconds each run needs to reach a target eval loss (by default the dense baseline's final one).

`sparsetrain pareto RUN_DIR... --curves [--target-loss L]` prints the table and writes ``FILE_curves.png`` (eval
loss against GPU-seconds and against FLOPs, a line per run, the target drawn) and ``FILE_curves.csv`` (every
point) beside ``--out``.

Where each number comes from, per evaluation at step ``s`` of a run (its ``metrics.jsonl`` eval rows):
- FLOPs: the row's cumulative ``train_flops`` (mask updates and RigL's dense gradients included);
- GPU-seconds: ``train_seconds(rows, s)`` times the run's processes: the seconds of the training windows up to
  ``s`` (a start-up or dense-switch window, which tunes, compiles and captures, at the next window's step time;
  mask updates and their re-captures in), so each phase of a sparse-then-dense run is charged its own time. The
  last point of a finished run is the GPU-seconds of its Pareto point.
- reaching the target: the first evaluation whose loss is at or below it (no interpolation between evaluations, so
  a run is charged up to the evaluation that showed it).
"""
from __future__ import annotations

import csv
import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparsetrain.pareto.runs import RunResult
from sparsetrain.pareto.tables import _ALIASES, _order, point_label, several_models
from sparsetrain.training.metrics import format_flops, read_metrics, read_summary, train_seconds


@dataclass(frozen=True)
class Curve:
    """One run's evaluations, in step order: ``steps``, ``gpu_s``, ``flops`` and ``loss`` of equal length."""

    run: RunResult
    steps: list[int]
    gpu_s: list[float]
    flops: list[float]
    loss: list[float]

    def reach(self, target: float) -> int | None:
        """Index of the first evaluation at or below ``target`` (None: never)."""
        return next((i for i, value in enumerate(self.loss) if value <= target), None)


def read_curve(run: RunResult) -> Curve | None:
    """The eval rows of a run directory as a :class:`Curve`; None for a run read from a table (no rows), or with
    no finite evaluation or no timed window after start-up."""
    if not (Path(run.path) / "metrics.jsonl").is_file():
        return None
    rows = read_metrics(run.path)
    processes = (read_summary(run.path) or {}).get("processes") or 1
    points = []
    for row in rows:
        loss, step = row.get("eval_loss"), row.get("step")
        if not (isinstance(loss, (int, float)) and math.isfinite(loss) and isinstance(step, int) and step > 0):
            continue
        seconds = train_seconds(rows, step)
        if seconds is None or not isinstance(row.get("train_flops"), (int, float)):
            continue
        points.append((step, seconds * processes, float(row["train_flops"]), float(loss)))
    if not points:
        return None
    points = sorted({p[0]: p for p in points}.values())   # a resumed run may log an evaluation twice: the last
    steps, gpu_s, flops, loss = (list(col) for col in zip(*points, strict=True))
    return Curve(run, steps, gpu_s, flops, loss)


def read_curves(runs: Sequence[RunResult]) -> list[Curve]:
    return [c for c in (read_curve(r) for r in _order(runs)) if c is not None]


def dense_target(runs: Sequence[RunResult]) -> float | None:
    """The dense baseline's final eval loss: of the finished dense runs, those trained longest (most FLOPs), their
    mean over seeds; None without a finished dense run."""
    dense = [r for r in runs if r.dense and r.status == "finished" and r.final_eval_loss is not None
             and math.isfinite(r.final_eval_loss) and r.total_train_flops]
    if not dense:
        return None
    longest = max(r.total_train_flops for r in dense)
    return statistics.fmean(r.final_eval_loss for r in dense if r.total_train_flops >= 0.999 * longest)


def _name(run: RunResult, with_model: bool = False) -> str:
    return f"{_ALIASES.get(run.method, run.method)} {point_label(run, with_seed=True, with_model=with_model)}"


def _with_model(curves: Sequence[Curve]) -> bool:
    return several_models([c.run for c in curves])


def reach_rows(curves: Sequence[Curve], target: float) -> list[dict]:
    """One row per run: where it reaches ``target`` (GPU-seconds, FLOPs, step), its best loss, and its GPU-seconds
    against the fastest dense run's to the same loss (``x_dense``: above 1 is sooner). Also, for every run, the same
    ratio at the run's own best loss (``x_dense_best``: dense's GPU-seconds to that loss over the run's) and
    ``speedup_for_125``: by how much the run's GPU-seconds would have to shrink for it to reach its best loss
    1.25x sooner than dense (1.25 / x_dense_best; at most 1 where it already does)."""
    dense_curves, with_model = [c for c in curves if c.run.dense], _with_model(curves)
    rows = []
    for c in curves:
        i, best = c.reach(target), c.loss.index(min(c.loss))
        dense_to_best = _fastest(dense_curves, c.loss[best])
        x_best = dense_to_best / c.gpu_s[best] if dense_to_best is not None and c.gpu_s[best] > 0 else None
        rows.append({"run": _name(c.run, with_model), "dense": c.run.dense, "evals": len(c.steps), "best_loss": c.loss[best],
                     "step": c.steps[i] if i is not None else None, "gpu_s": c.gpu_s[i] if i is not None else None,
                     "flops": c.flops[i] if i is not None else None, "x_dense_best": x_best,
                     "speedup_for_125": 1.25 / x_best if x_best else None})
    dense = [r["gpu_s"] for r in rows if r["dense"] and r["gpu_s"] is not None]
    for r in rows:
        r["x_dense"] = min(dense) / r["gpu_s"] if dense and r["gpu_s"] else None
    return rows


def _fastest(curves: Sequence[Curve], loss: float) -> float | None:
    """The fewest GPU-seconds any of ``curves`` needs to reach ``loss`` (None: none does)."""
    times = [c.gpu_s[i] for c in curves if (i := c.reach(loss)) is not None]
    return min(times) if times else None


def format_reach_table(curves: Sequence[Curve], target: float, how: str) -> str:
    """The aligned table "GPU-seconds to reach loss L"; ``how`` says where L came from."""
    head = ["run", "evals", "best eval loss", "reached at step", "GPU s", "FLOPs", "x dense (GPU s)",
            "x dense at its best", "faster for 1.25x"]
    body = []
    for r in reach_rows(curves, target):
        own = (["-", "-"] if r["dense"] or r["x_dense_best"] is None
               else [f"{r['x_dense_best']:.2f}", f"{max(1.0, r['speedup_for_125']):.2f}x"])
        if r["gpu_s"] is None:
            body.append([r["run"], str(r["evals"]), f"{r['best_loss']:.4f}", "never", "-", "-", "-", *own])
        else:
            x = f"{r['x_dense']:.2f}" if r["x_dense"] is not None else "-"
            body.append([r["run"], str(r["evals"]), f"{r['best_loss']:.4f}", str(r["step"]), f"{r['gpu_s']:.1f}",
                         format_flops(r["flops"]), x, *own])
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
    lines = [f"GPU-seconds to reach eval loss {target:.4f} ({how}); \"at its best\": dense's GPU-seconds to the run's "
             "best loss over the run's, and how much faster the run would have to be to get there 1.25x sooner",
             "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in body]
    return "\n".join(lines)


def write_curves(curves: Sequence[Curve], target: float, out: str | os.PathLike) -> tuple[Path, Path]:
    """``FILE_curves.png`` and ``FILE_curves.csv`` beside ``out`` (FILE.png); returns their paths."""
    out = Path(out)
    png, table = out.with_name(out.stem + "_curves.png"), out.with_name(out.stem + "_curves.csv")
    png.parent.mkdir(parents=True, exist_ok=True)
    with_model = _with_model(curves)
    with open(table, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "path", "step", "gpu_s", "train_flops", "eval_loss"])
        for c in curves:
            for point in zip(c.steps, c.gpu_s, c.flops, c.loss, strict=True):
                writer.writerow([_name(c.run, with_model), str(c.run.path), *point])
    fig = curves_figure(curves, target)
    fig.savefig(png, dpi=fig.dpi)
    return png, table


def curves_figure(curves: Sequence[Curve], target: float):
    """Eval loss against GPU-seconds (left) and FLOPs (right, log x): a line per run (dense runs black, a line
    style per model), the target loss as a dashed grey line."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not curves:
        raise ValueError("no run has an evaluation to draw (trainer.eval_every=0 runs have none)")
    fig = Figure(figsize=(13, 5.2), dpi=110)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    colours = iter(["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
                    "#bcbd22", "#7f7f7f"] * 10)
    with_model, dashes = _with_model(curves), iter(["-", "--", ":", "-."] * 10)
    dense_styles = {m: next(dashes) for m in sorted({c.run.model or "" for c in curves if c.run.dense})}
    for c in curves:
        style = ({"color": "black", "lw": 2.0, "ls": dense_styles[c.run.model or ""]} if c.run.dense
                 else {"color": next(colours), "lw": 1.3})
        left.plot(c.gpu_s, c.loss, marker=".", label=_name(c.run, with_model), **style)
        right.plot(c.flops, c.loss, marker=".", **style)
    for ax, xlabel in ((left, "training GPU-seconds"), (right, "training FLOPs")):
        ax.axhline(target, ls="--", color="grey", lw=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("eval loss")
        ax.grid(alpha=0.3)
    right.set_xscale("log")
    left.set_title(f"time to quality (dashed: eval loss {target:.3f})")
    right.set_title("FLOPs to quality")
    left.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig
