"""Curve plots of a run: loss and density against step, from `metrics.jsonl`, into `curves.png`."""
from __future__ import annotations

import math
import os
from pathlib import Path

from sparsetrain.training.metrics import METRICS_FILE, read_metrics, read_summary

CURVES_FILE = "curves.png"


def _run_label(run_dir: Path) -> str:
    summary = read_summary(run_dir) or {}
    parts = [run_dir.name] + [str(summary[k]) for k in ("method", "recipe") if summary.get(k)]
    if isinstance(summary.get("density"), (int, float)):
        parts.append(f"density {summary['density']:.3g}")
    return " | ".join(parts)


def plot_run(run_dir: str | os.PathLike) -> Path:
    """Plot `run_dir/metrics.jsonl` into `run_dir/curves.png`; return its path.

    Top panel: train loss and eval loss vs step (non-finite train losses are marked with red x at
    the top edge). Bottom panel: overall density vs step, with mask-update steps marked.

    Example:
        >>> plot_run("runs/demo")
        PosixPath('runs/demo/curves.png')
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"run_dir {str(run_dir)!r} has no rows in {METRICS_FILE}")
    train = [r for r in rows if "loss" in r and "event" not in r]
    evals = [r for r in rows if "eval_loss" in r and "event" not in r]
    updates = [r["step"] for r in rows if r.get("event") == "mask_update"]
    dens = [r for r in train if isinstance(r.get("density"), (int, float))]

    # Figure + Agg canvas directly, not pyplot: no global backend switch, no display needed.
    fig = Figure(figsize=(9, 6.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax_loss, ax_dens = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    fig.suptitle(_run_label(run_dir))

    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1, alpha=0.8,
                     color="tab:blue", label="train loss")
        bad = [r["step"] for r in train if isinstance(r["loss"], float) and not math.isfinite(r["loss"])]
        if bad:
            # Non-finite losses leave a gap in the line; mark them so divergence is visible.
            ax_loss.plot(bad, [1.0] * len(bad), "x", color="red", ms=7, clip_on=False,
                         transform=ax_loss.get_xaxis_transform(), label=f"non-finite loss ({len(bad)})")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", ms=4, lw=1.5,
                     color="tab:orange", label="eval loss")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("Loss")
    ax_loss.grid(alpha=0.3)
    if train or evals:
        ax_loss.legend(loc="upper right")

    if dens:
        ax_dens.plot([r["step"] for r in dens], [r["density"] for r in dens], lw=1.5, color="tab:green",
                     label="density")
    else:
        ax_dens.text(0.5, 0.5, "no density logged", ha="center", va="center", transform=ax_dens.transAxes)
    if updates:
        # Few updates: one faint line each. Many: short ticks along the bottom edge instead.
        if len(updates) <= 60:
            for i, s in enumerate(updates):
                ax_dens.axvline(s, color="gray", lw=0.8, alpha=0.5, ls="--",
                                label=f"mask update ({len(updates)})" if i == 0 else None)
        else:
            ax_dens.plot(updates, [0.0] * len(updates), "|", color="gray", ms=10,
                         transform=ax_dens.get_xaxis_transform(), label=f"mask update ({len(updates)})")
    ax_dens.set_xlabel("step")
    ax_dens.set_ylabel("density of sparse layers")
    ax_dens.set_title("Density")
    ax_dens.grid(alpha=0.3)
    if dens or updates:
        ax_dens.legend(loc="upper right")

    out = run_dir / CURVES_FILE
    fig.savefig(out, dpi=110)
    return out
