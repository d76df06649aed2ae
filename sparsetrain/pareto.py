"""Compare finished runs: final eval loss against training cost (FLOPs and wall-clock seconds).

`sparsetrain pareto RUN_DIR... [--out FILE.png]` collects run directories (or folders holding them up
to three levels down, such as Hydra's multirun/DATE/TIME/0, 1, ...), prints one aligned table row per
run and plots one curve per method, each point annotated with its density.

Where each number comes from, per run:
- finished runs (`summary.json` present): method, density, block, steps, total train FLOPs and wall
  seconds from the summary; the final eval loss from the summary, else from the last eval row;
- unfinished runs (no summary): the point is the last eval row of `metrics.jsonl` (its `eval_loss`,
  `train_flops` and `elapsed_s`), so loss and cost are measured at the same step; the method and
  density fall back to the run's `config.yaml` (or `.hydra/config.yaml` of older runs) and to the last
  logged density. An unfinished run with no eval row is listed in the table but not plotted.
- labels: the summary's `method`, e.g. `prune_regrow/random` (SET), `prune_regrow/gradient` (RigL),
  `prune_regrow/GradEMA` (a user's policy class). Summaries written before policies were labelled by
  class gave a RigL/SET subclass its parent's label; for those the config's policy class is used.

Example:
    >>> runs = collect_runs(["multirun/2026-11-21/10-00-00", "runs/dense"])
    >>> print(format_table(runs))
    >>> plot_pareto(runs, "pareto.png")
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sparsetrain.training.metrics import (
    METRICS_FILE,
    SUMMARY_FILE,
    format_flops,
    read_metrics,
    read_summary,
)

# Folders inside a run or multirun folder that never hold runs.
_SKIP_DIRS = {".hydra", "wandb", "checkpoints", "__pycache__"}


@dataclass(frozen=True)
class RunResult:
    """One run's outcome, as read from its directory (None where the run did not record it)."""

    path: Path
    method: str
    density: float | None
    block: str | None
    final_eval_loss: float | None
    total_train_flops: float | None
    wall_s: float | None
    status: str
    steps: int | None = None

    @property
    def plottable(self) -> bool:
        """True when the run has a finite eval loss and a positive FLOP count to place it on the plot."""
        return (self.final_eval_loss is not None and math.isfinite(self.final_eval_loss)
                and self.total_train_flops is not None and self.total_train_flops > 0)


# --------------------------------------------------------------------------------------------------
# Finding and reading runs
# --------------------------------------------------------------------------------------------------
def _is_run_dir(path: Path) -> bool:
    return (path / METRICS_FILE).is_file() or (path / SUMMARY_FILE).is_file()


def _sort_key(path: Path) -> tuple:
    # Numbered multirun jobs sort as numbers (2 before 10), other names alphabetically after them.
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


def _find_run_dirs(path: Path, depth: int = 3) -> list[Path]:
    """`path` itself if it is a run dir, else run dirs up to `depth` levels below it.

    Three levels cover Hydra's default multirun layout given from its root: multirun/DATE/TIME/N/.
    """
    if _is_run_dir(path):
        return [path]
    if depth == 0:
        return []
    found: list[Path] = []
    children = [p for p in path.iterdir() if p.is_dir() and p.name not in _SKIP_DIRS]
    for child in sorted(children, key=_sort_key):
        found.extend(_find_run_dirs(child, depth - 1))
    return found


def _run_config(run_dir: Path) -> dict:
    """The run's resolved config: `config.yaml` (written by sparsetrain), else `.hydra/config.yaml` (runs
    written before sparsetrain wrote its own); `{}` when neither parses. Read with `yaml.safe_load`: plain
    data, nothing executed."""
    import yaml  # PyYAML comes with omegaconf; only needed for the fallbacks

    for path in (run_dir / "config.yaml", run_dir / ".hydra" / "config.yaml"):
        if not path.is_file():
            continue
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError:
            continue
        if isinstance(data, dict):
            return data
    return {}


def _config_get(config: dict, *keys: str) -> object:
    node: object = config
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _class_label(target: str, module: str) -> str:
    """The `name` of a sparsetrain class given by its `_target_`, or the class name of any other (whose module
    is never imported here: a label needs no user code)."""
    import importlib

    cls_name = target.rsplit(".", 1)[-1]
    label = getattr(getattr(importlib.import_module(module), cls_name, None), "name", None)
    return label if target.startswith("sparsetrain.") and isinstance(label, str) else cls_name


def _method_from_scheduler(config: dict) -> str | None:
    """`describe()` of the scheduler the config builds, worked out without building it: `prune_regrow/<policy
    label>` (built-ins `random`, `gradient`; any other policy class by its class name) or the scheduler's name."""
    target = _config_get(config, "sparsity", "scheduler", "_target_")
    if not isinstance(target, str) or not target:
        return None
    if target.rsplit(".", 1)[-1] != "PruneRegrow":
        return _class_label(target, "sparsetrain.sparsity.schedulers")
    policy = _config_get(config, "sparsity", "scheduler", "policy")
    if isinstance(policy, dict) and isinstance(policy.get("_target_"), str):
        return "prune_regrow/" + _class_label(policy["_target_"], "sparsetrain.sparsity.policies")
    from sparsetrain.sparsity.policies import POLICIES

    name = "set" if policy is None else str(policy)  # PruneRegrow's default policy
    return f"prune_regrow/{POLICIES[name].name}" if name in POLICIES else f"prune_regrow/{name}"


def _method_from_config(config: dict) -> str | None:
    """Best-effort label for a run without summary.json (the summary's `method` is authoritative)."""
    method = _method_from_scheduler(config)
    for keys in (("method",), ("sparsity", "method"), ("sparsity", "name")):
        value = _config_get(config, *keys)
        method = method or (value if isinstance(value, str) and value else None)
    for keys in (("sparsity", "policy", "_target_"), ("sparsity", "_target_")):  # configs of older runs
        value = _config_get(config, *keys)
        method = method or (value.rsplit(".", 1)[-1] if isinstance(value, str) and value else None)
    return method


# Summaries written before policies were labelled by class called every RigL or SET subclass by its parent's
# label; for those runs the config tells the policy's class.
_PARENT_LABELS = ("prune_regrow/gradient", "prune_regrow/random")


def _method(summary: dict | None, config: dict) -> str:
    method = summary.get("method") if summary else None
    if method in _PARENT_LABELS:
        from_config = _method_from_scheduler(config) or ""
        return from_config if from_config.startswith("prune_regrow/") else method
    return str(method or _method_from_config(config) or "unknown")


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _last(rows: list[dict], key: str) -> object:
    return next((r[key] for r in reversed(rows) if r.get(key) is not None), None)


def read_run(run_dir: str | os.PathLike) -> RunResult:
    """Read one run directory into a RunResult (see the module docstring for the fallbacks).

    Example:
        >>> read_run("multirun/2026-11-21/10-00-00/0").final_eval_loss
        3.41
    """
    run_dir = Path(run_dir)
    summary = read_summary(run_dir)
    rows = read_metrics(run_dir)
    evals = [r for r in rows if _number(r.get("eval_loss")) is not None and "event" not in r]
    steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
    config = _run_config(run_dir) if not summary or summary.get("method") in (None, "", *_PARENT_LABELS) else {}

    def pick(summary_key: str, fallback: object) -> object:
        value = summary.get(summary_key) if summary else None
        return fallback if value is None else value

    if summary is not None:
        loss = pick("final_eval_loss", evals[-1]["eval_loss"] if evals else None)
        flops = pick("total_train_flops", _last(rows, "train_flops"))
        wall = summary.get("wall_s")
        status = str(summary.get("status", "unknown"))
    else:
        # Unfinished: use the last eval row for loss and cost together (same step).
        last_eval = evals[-1] if evals else {}
        loss = last_eval.get("eval_loss")
        flops = last_eval.get("train_flops", _last(rows, "train_flops"))
        wall = last_eval.get("elapsed_s", _last(rows, "elapsed_s"))
        status = "unfinished"

    density = pick("density", _last(rows, "density"))
    if density is None:
        density = _config_get(config, "sparsity", "density")
    block = pick("block", _config_get(config, "sparsity", "block"))
    run_steps = pick("steps", max(steps) if steps else None)
    return RunResult(
        path=run_dir,
        method=_method(summary, config),
        density=_number(density),
        block=None if block is None else str(block),
        final_eval_loss=_number(loss),
        total_train_flops=_number(flops),
        wall_s=_number(wall),
        status=status,
        steps=int(run_steps) if _number(run_steps) is not None else None,
    )


def collect_runs(paths: Sequence[str | os.PathLike]) -> list[RunResult]:
    """Read every run under `paths` (run dirs, or folders searched up to three levels deep,
    which covers Hydra's multirun/DATE/TIME/N layout).

    Raises ValueError naming the first path that does not exist or holds no run.

    Example:
        >>> [r.method for r in collect_runs(["runs/dense", "multirun/2026-11-21/10-00-00"])]
        ['dense', 'static', 'static']
    """
    if isinstance(paths, (str, os.PathLike)):
        raise TypeError("paths must be a list of paths, not a single path")
    if not paths:
        raise ValueError("paths is empty: give at least one run dir or multirun folder")
    run_dirs: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise ValueError(f"run path {str(raw)!r} is not a directory")
        found = _find_run_dirs(path)
        if not found:
            raise ValueError(
                f"run path {str(raw)!r} holds no run: no {METRICS_FILE} or {SUMMARY_FILE} in it "
                "or up to three levels below"
            )
        run_dirs.extend(found)
    unique = list(dict.fromkeys(p.resolve() for p in run_dirs))  # the same run given twice counts once
    return [read_run(p) for p in unique]


# --------------------------------------------------------------------------------------------------
# Table and plot
# --------------------------------------------------------------------------------------------------
def _display_path(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)


def _order(runs: Sequence[RunResult]) -> list[RunResult]:
    return sorted(runs, key=lambda r: (r.method.casefold(), -(r.density if r.density is not None else 2.0),
                                       r.total_train_flops or 0.0))


def format_table(runs: Sequence[RunResult]) -> str:
    """An aligned text table, one row per run, grouped by method; unfinished runs are marked.

    Example:
        >>> print(format_table(runs))
        method  density  block  steps  FLOPs    wall s  eval loss  status    path
        dense   1.000    -      1000   4.10e15  812.3   3.2011     finished  runs/dense
    """
    header = ["method", "density", "block", "steps", "FLOPs", "wall s", "eval loss", "status", "path"]
    body = []
    for r in _order(runs):
        status = r.status if r.status == "finished" else f"*{r.status}"
        body.append([
            r.method,
            "-" if r.density is None else f"{r.density:.3f}",
            r.block or "-",
            "-" if r.steps is None else str(r.steps),
            format_flops(r.total_train_flops),
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


def plot_pareto(runs: Sequence[RunResult], out: str | os.PathLike) -> Path:
    """Plot final eval loss vs total training FLOPs (log x) and, when every plotted run has timing,
    vs wall-clock seconds (log x when they span a decade); one curve per method, points sorted by FLOPs and labelled with density.

    Raises ValueError when no run has a finite eval loss and a FLOP count.

    Example:
        >>> plot_pareto(collect_runs(["multirun/2026-11-21/10-00-00"]), "pareto.png")
        PosixPath('pareto.png')
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = [r for r in runs if r.plottable]
    if not points:
        raise ValueError("runs: none has a finite final eval loss and train FLOPs to plot")
    methods = sorted({r.method for r in points}, key=str.casefold)
    timed = all(r.wall_s is not None and r.wall_s > 0 for r in points)

    # Figure + Agg canvas directly, not pyplot: no global backend switch, no display needed.
    fig = Figure(figsize=(13, 5.5) if timed else (7.5, 5.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 2 if timed else 1, sharey=True, squeeze=False)[0]
    panels = [("total_train_flops", "total training FLOPs"), ("wall_s", "training wall-clock (s)")]
    markers = "osD^vP*Xhp<>"
    for ax, (attr, xlabel) in zip(axes, panels):
        for i, method in enumerate(methods):
            group = sorted((r for r in points if r.method == method), key=lambda r: r.total_train_flops)
            xs = [getattr(r, attr) for r in group]
            ys = [r.final_eval_loss for r in group]
            (line,) = ax.plot(xs, ys, marker=markers[i % len(markers)], ms=7, lw=1.5, label=method,
                              color=f"C{i % 10}")
            # Unfinished runs get a hollow marker so they are not mistaken for final results.
            open_pts = [(x, y) for x, y, r in zip(xs, ys, group) if r.status != "finished"]
            if open_pts:
                ax.plot(*zip(*open_pts), ls="none", marker=markers[i % len(markers)], ms=11,
                        mfc="white", mec=line.get_color(), mew=1.5, zorder=3)
            for x, y, r in zip(xs, ys, group):
                if r.density is not None:
                    ax.annotate(f"{r.density:.2g}", (x, y), textcoords="offset points", xytext=(5, 5),
                                fontsize=8, color=line.get_color())
        # FLOPs: always log x. Wall seconds: log only when the runs span a decade; over a narrower
        # range a log axis gets unreadable tick labels (5.1x10^1, 5.2x10^1, ...).
        xs_all = [getattr(r, attr) for r in points]
        if attr == "total_train_flops" or max(xs_all) >= 10 * min(xs_all):
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("final eval loss")
    axes[0].set_title("Loss vs training FLOPs")
    if timed:
        axes[1].set_title("Loss vs wall-clock time")
    axes[-1].legend(title="method (labels: density)", fontsize=9, title_fontsize=9, loc="best")
    n_open = sum(r.status != "finished" for r in points)
    suffix = f"; hollow markers: {n_open} unfinished" if n_open else ""
    title = f"Final eval loss vs training cost ({len(points)} runs{suffix})"
    if not timed:
        title += "\n(no wall-clock panel: not every plotted run recorded its wall time)"
    fig.suptitle(title)

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    """`sparsetrain pareto RUN_DIR... [--out FILE.png]`: print the table, write the plot.

    Returns 0 on success, 1 when no run can be plotted, 2 on a bad path.

    Example:
        >>> main(["multirun/2026-11-21/10-00-00", "--out", "pareto.png"])
        0
    """
    parser = argparse.ArgumentParser(prog="sparsetrain pareto", description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run dirs or multirun folders")
    parser.add_argument("--out", default="pareto.png", help="PNG to write (default: ./pareto.png)")
    args = parser.parse_args(argv)
    try:
        runs = collect_runs(args.run_dirs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(runs))
    try:
        out = plot_pareto(runs, args.out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
