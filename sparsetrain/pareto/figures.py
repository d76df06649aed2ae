"""The figure of `sparsetrain pareto`: loss against FLOPs and against GPU-seconds, each method's frontier drawn."""
from __future__ import annotations

import os
from collections.abc import Sequence
from operator import attrgetter
from pathlib import Path

from sparsetrain._plot_labels import label_points
from sparsetrain.pareto.runs import RunResult
from sparsetrain.pareto.tables import _ALIASES, _block_size, _time_axis, frontier, point_label, several_models

# --------------------------------------------------------------------------------------------------
# The plot
# --------------------------------------------------------------------------------------------------
_MARKERS = {0: "*", 1: "o", 16: "s", 64: "^"}   # by block size; 0: dense


_OTHER_MARKERS = "DvP<>hpX"


_MARKER_SIZE = 7.0


def _marker(run: RunResult) -> str:
    size = 0 if run.dense else _block_size(run.block)
    return _MARKERS.get(size, _OTHER_MARKERS[size % len(_OTHER_MARKERS)])


def pareto_figure(runs: Sequence[RunResult]):
    """The figure `plot_pareto` saves: loss vs FLOPs (log x) and, when every plotted run has timing, loss vs
    GPU-seconds (wall seconds for runs that lack them); a colour per method (dense in black), a marker per block
    size, each method's frontier as a line, every point labelled (:func:`point_label`) without overlaps.

    Raises ValueError when no run has a finite eval loss and a FLOP count.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    points = [r for r in runs if r.plottable]
    if not points:
        raise ValueError("runs: none has a finite final eval loss and train FLOPs to plot")
    methods = sorted({r.method for r in points}, key=lambda m: (m != "dense", m.casefold()))
    colors = {m: f"C{i % 10}" for i, m in enumerate(m for m in methods if m != "dense")} | {"dense": "black"}
    time = _time_axis(points)
    panels = [("total_train_flops", "total training FLOPs")] + ([time] if time else [])
    with_seed, with_model = len({r.seed for r in points}) > 1, several_models(points)

    # Figure + Agg canvas directly, not pyplot: no global backend switch, no display needed.
    height = min(14.0, max(7.5, 4.0 + 0.06 * len(points)))   # room for the labels of a crowded study
    fig = Figure(figsize=(8 * len(panels), height), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (attr, xlabel) in zip(axes, panels):
        for method in methods:
            group = [r for r in points if r.method == method]
            best = frontier(group, attrgetter(attr))
            ax.plot([getattr(r, attr) for r in best], [r.final_eval_loss for r in best], color=colors[method],
                    lw=1.6, alpha=0.85, zorder=2)
            for run in group:
                on_frontier = run in best
                ax.plot(getattr(run, attr), run.final_eval_loss, ls="none", marker=_marker(run), ms=_MARKER_SIZE,
                        color=colors[method], alpha=1.0 if on_frontier else 0.45, zorder=3,
                        mfc="white" if run.status != "finished" else colors[method])
        # FLOPs: always log x. Seconds: log only when the runs span a decade; over a narrower range a log axis
        # gets unreadable tick labels (5.1x10^1, 5.2x10^1, ...).
        xs = [getattr(r, attr) for r in points]
        if attr == "total_train_flops" or max(xs) >= 10 * min(xs):
            ax.set_xscale("log")
        ax.margins(x=0.12, y=0.12)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("final eval loss")
    axes[0].set_title("Loss vs training FLOPs")
    if time:
        axes[1].set_title("Loss vs " + ("GPU-seconds" if time[0] == "gpu_s" else "wall-clock time"))

    handles = [Line2D([], [], color=colors[m], lw=1.6, label=f"{_ALIASES[m]} ({m})" if m in _ALIASES else m)
               for m in methods]
    blocks = sorted({(_block_size(r.block) if not r.dense else 0, _marker(r), r.dense) for r in points})
    handles += [Line2D([], [], ls="none", marker=mk, ms=_MARKER_SIZE, color="gray",
                       label="dense" if dense else f"{size}x{size} blocks" + (" (unstructured)" if size == 1 else ""))
                for size, mk, dense in blocks]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5), fontsize=9,
               title="colour: method, its frontier as a line (faded points: off it; hollow: unfinished); marker: "
                     "block size; labels: density and block, or steps for dense" + (", s: seed" if with_seed else ""),
               title_fontsize=9)
    devices = ", ".join(sorted({r.device for r in points if r.device}))
    dates = sorted({r.date for r in points if r.date})
    where = ", ".join(x for x in (devices, dates[-1] if dates else "") if x)
    title = f"Final eval loss vs training cost ({len(points)} runs{'; ' + where if where else ''})"
    if not time:
        title += "\n(no time panel: not every plotted run recorded its training time)"
    fig.suptitle(title)

    # Labels last, in display units: the layout must not move the axes afterwards.
    fig.draw_without_rendering()
    fig.set_layout_engine("none")
    for ax, (attr, _) in zip(axes, panels):
        order = sorted(points, key=lambda r: (getattr(r, attr), r.final_eval_loss))
        items = [(getattr(r, attr), r.final_eval_loss, point_label(r, with_seed, with_model), colors[r.method]) for r in order]
        label_points(fig, ax, items, marker_px=_MARKER_SIZE * fig.dpi / 72)
    return fig


def plot_pareto(runs: Sequence[RunResult], out: str | os.PathLike) -> Path:
    """Save :func:`pareto_figure` of `runs` as the PNG `out` (and nothing else: `write_tables` writes the CSV and
    markdown table).

    Raises ValueError when no run has a finite eval loss and a FLOP count.

    Example:
        >>> plot_pareto(collect_runs(["multirun/2026-11-21/10-00-00"]), "pareto.png")
        PosixPath('pareto.png')
    """
    fig = pareto_figure(runs)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=fig.dpi)
    return out
