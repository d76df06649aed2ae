"""Compare finished runs: final eval loss against training FLOPs and against GPU-seconds.

`sparsetrain pareto RUN_DIR... [--out FILE.png]` collects run directories (or folders holding them up
to three levels down, such as Hydra's multirun/DATE/TIME/0, 1, ...) and the FILE.csv tables of earlier calls
(a study run in parts, on several machines or days), prints one aligned table row per run, and writes FILE.png (two panels: loss vs FLOPs, loss vs GPU-seconds; each method's Pareto frontier
drawn, every point labelled: steps for dense runs, density and block for sparse ones) with FILE.csv and
FILE.md beside it. `--dense-steps` prints instead the `trainer.max_steps` values of the dense runs that
match the sparse runs' FLOPs and GPU-seconds (the Pareto study's second stage, docs/pareto.md).

Where each number comes from, per run:
- finished runs (`summary.json` present): method, density, block, steps, total train FLOPs, wall
  seconds and `train_s` from the summary; the final eval loss from the summary, else from the last eval row;
- GPU-seconds: `train_s` (the training steps once the run is going: start-up, evaluation and checkpoints
  left out; `sparsetrain.training.metrics.train_seconds`) times the run's processes; runs written before
  the summary had it get it from their rows;
- unfinished runs (no summary): the point is the last eval row of `metrics.jsonl` (its `eval_loss`,
  `train_flops` and `elapsed_s`), so loss and cost are measured at the same step; the method and
  density fall back to the run's `config.yaml` (or `.hydra/config.yaml` of older runs) and to the last
  logged density. An unfinished run with no eval row is listed in the table but not plotted.
- labels: the summary's `method`, e.g. `prune_regrow/random` (SET), `prune_regrow/gradient` (RigL),
  `prune_regrow/GradEMA` (a user's policy class). Summaries written before policies were labelled by
  class gave a RigL/SET subclass its parent's label; for those the config's policy class is used.
  The seed comes from the run's config.

Example:
    >>> runs = collect_runs(["multirun/2026-11-21/10-00-00", "runs/dense"])
    >>> print(format_table(runs))
    >>> plot_pareto(runs, "pareto.png")      # and pareto.csv, pareto.md beside it
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from operator import attrgetter
from pathlib import Path

from sparsetrain._plot_labels import label_points
from sparsetrain.training.metrics import (
    METRICS_FILE,
    SUMMARY_FILE,
    format_flops,
    read_metrics,
    read_summary,
    train_seconds,
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
    gpu_s: float | None = None      # seconds of training steps after start-up x processes
    seed: int | None = None
    device: str | None = None
    date: str | None = None         # when the run last wrote its summary (or metrics), YYYY-MM-DD
    target_density: float | None = None   # what the config asked for (`density` is what the layers reached)
    step_mode: str | None = None    # the summary's `step_mode`: "cuda_graph" or "eager"

    @property
    def nominal_density(self) -> float | None:
        """The config's density where known (0.1, where whole 64x64 blocks reach 0.094), else the reached one."""
        return self.density if self.target_density is None else self.target_density

    @property
    def plottable(self) -> bool:
        """True when the run has a finite eval loss and a positive FLOP count to place it on the plot."""
        return (self.final_eval_loss is not None and math.isfinite(self.final_eval_loss)
                and self.total_train_flops is not None and self.total_train_flops > 0)

    @property
    def dense(self) -> bool:
        """Every layer dense at the end (sparsity=dense, or density 1): told apart by steps, not by block."""
        return self.density is None or self.density >= 1.0


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
    config = _run_config(run_dir)

    def pick(summary_key: str, fallback: object) -> object:
        value = summary.get(summary_key) if summary else None
        return fallback if value is None else value

    run_steps = pick("steps", max(steps) if steps else None)
    if summary is not None:
        loss = pick("final_eval_loss", evals[-1]["eval_loss"] if evals else None)
        flops = pick("total_train_flops", _last(rows, "train_flops"))
        wall = summary.get("wall_s")
        train_s = pick("train_s", train_seconds(rows, run_steps) if isinstance(run_steps, int) else None)
        status = str(summary.get("status", "unknown"))
    else:
        # Unfinished: use the last eval row for loss and cost together (same step).
        last_eval = evals[-1] if evals else {}
        loss = last_eval.get("eval_loss")
        flops = last_eval.get("train_flops", _last(rows, "train_flops"))
        wall = last_eval.get("elapsed_s", _last(rows, "elapsed_s"))
        at = last_eval.get("step")
        train_s = train_seconds([r for r in rows if r.get("step", 0) <= at], at) if at else None
        status = "unfinished"
    processes = _number(pick("processes", 1)) or 1.0
    train_s = _number(train_s)
    written = run_dir / (SUMMARY_FILE if summary is not None else METRICS_FILE)
    date = datetime.fromtimestamp(written.stat().st_mtime).strftime("%Y-%m-%d") if written.is_file() else None

    density = pick("density", _last(rows, "density"))
    if density is None:
        density = _config_get(config, "sparsity", "density")
    block = pick("block", _config_get(config, "sparsity", "block"))
    seed = _config_get(config, "seed")
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
        gpu_s=None if train_s is None else train_s * processes,
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        device=str(summary["device"]) if summary and summary.get("device") else None,
        date=date,
        target_density=_number(_config_get(config, "sparsity", "density")),
        step_mode=str(summary["step_mode"]) if summary and summary.get("step_mode") else None,
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
    tabled: list[RunResult] = []
    for raw in paths:
        path = Path(raw)
        if path.suffix.lower() == ".csv" and path.is_file():
            tabled.extend(read_table(path))
            continue
        if not path.is_dir():
            raise ValueError(f"run path {str(raw)!r} is not a directory (nor a .csv table `pareto` wrote)")
        found = _find_run_dirs(path)
        if not found:
            raise ValueError(
                f"run path {str(raw)!r} holds no run: no {METRICS_FILE} or {SUMMARY_FILE} in it "
                "or up to three levels below"
            )
        run_dirs.extend(found)
    unique = list(dict.fromkeys(p.resolve() for p in run_dirs))  # the same run given twice counts once
    runs = [read_run(p) for p in unique]
    read = {_display_path(r.path) for r in runs}
    kept: dict[str, RunResult] = {}
    for r in tabled:   # a run read from its directory wins over a table's row of it; a table's repeat counts once
        if str(r.path) not in read:
            kept.setdefault(str(r.path), r)
    return runs + list(kept.values())


def _cell(row: dict, key: str, kind: type, where: str) -> object:
    text = (row.get(key) or "").strip()
    if not text:
        return None
    try:
        return kind(float(text)) if kind is int else kind(text)
    except ValueError:
        raise ValueError(f"{where}: column {key!r} holds {text!r}, not a number") from None


def read_table(path: str | os.PathLike) -> list[RunResult]:
    """The runs of a FILE.csv that `sparsetrain pareto` wrote (`CSV_COLUMNS`), as plain data: no run directory
    is read, and nothing in the file is evaluated. Each run's `path` is the one the table recorded.

    Raises ValueError naming the file and the first missing column or malformed cell.

    Example:
        >>> runs = read_table("docs/benchmarks/pareto_bert_small_h200.csv")   # then plotted with new runs
    """
    path = Path(path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _TABLE_NEEDS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not a table `sparsetrain pareto` wrote: no column {missing[0]!r}")
        rows = list(reader)
    runs = []
    for i, row in enumerate(rows, start=2):
        where = f"{path}, line {i}"
        if not (row.get("path") or "").strip() or not (row.get("method") or "").strip():
            raise ValueError(f"{where}: the run has no path or no method")
        runs.append(RunResult(
            path=Path(row["path"].strip()), method=row["method"].strip(),
            density=_cell(row, "density", float, where), block=(row.get("block") or "").strip() or None,
            final_eval_loss=_cell(row, "final_eval_loss", float, where),
            total_train_flops=_cell(row, "train_flops", float, where), wall_s=_cell(row, "wall_s", float, where),
            status=(row.get("status") or "").strip() or "finished", steps=_cell(row, "steps", int, where),
            gpu_s=_cell(row, "gpu_s", float, where), seed=_cell(row, "seed", int, where),
            device=(row.get("device") or "").strip() or None, date=(row.get("date") or "").strip() or None,
            target_density=_cell(row, "target_density", float, where),
            step_mode=(row.get("step_mode") or "").strip() or None))
    return runs


# --------------------------------------------------------------------------------------------------
# Frontiers, labels and tables
# --------------------------------------------------------------------------------------------------
# Friendlier names for the built-in dynamic policies, used in the legend beside the recorded method.
_ALIASES = {"prune_regrow/random": "SET", "prune_regrow/gradient": "RigL"}


def _display_path(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)


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


def point_label(run: RunResult, with_seed: bool = False) -> str:
    """What tells a point apart from the others of its method: steps for a dense run, density and block for a
    sparse one, and the seed when the runs have several.

    Example:
        >>> point_label(RunResult(Path("r"), "static", 0.1, "16", 3.2, 1e15, 60.0, "finished", steps=800))
        '0.1 16x16'
    """
    text = f"{run.steps} steps" if run.dense else f"{run.nominal_density:.3g} {_block_text(run.block)}"
    return f"{text} s{run.seed}" if with_seed and run.seed is not None else text


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
    body = []
    for r in _order(runs):
        status = r.status if r.status == "finished" else f"*{r.status}"
        body.append([
            r.method,
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


CSV_COLUMNS = ["method", "label", "target_density", "density", "block", "seed", "steps", "train_flops", "gpu_s",
               "wall_s", "final_eval_loss", "frontier", "status", "step_mode", "device", "date", "path"]
# What read_table needs of a CSV; the label and frontier columns are recomputed.
_TABLE_NEEDS = [c for c in CSV_COLUMNS if c not in ("label", "frontier")]


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
    with_seed = len({r.seed for r in runs}) > 1
    csv_path, md_path = out.with_suffix(".csv"), out.with_suffix(".md")
    with open(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_COLUMNS)
        for r in ordered:
            writer.writerow([r.method, point_label(r, with_seed), r.target_density, r.density, r.block, r.seed, r.steps,
                             r.total_train_flops, r.gpu_s, r.wall_s, r.final_eval_loss, " ".join(marks[r.path]),
                             r.status, r.step_mode, r.device, r.date, _display_path(r.path)])

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
            f"| {r.method}", "-" if r.nominal_density is None else f"{r.nominal_density:.3g}", _block_text(r.block),
            "-" if r.seed is None else str(r.seed), "-" if r.steps is None else str(r.steps),
            format_flops(r.total_train_flops), "-" if r.gpu_s is None else f"{r.gpu_s:.1f}",
            f"**{loss}**" if marks[r.path] else loss, ", ".join(marks[r.path]) or "-", r.status,
            f"`{_display_path(r.path)}` |"]))
    md_path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return csv_path, md_path


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
    with_seed = len({r.seed for r in points}) > 1

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
        items = [(getattr(r, attr), r.final_eval_loss, point_label(r, with_seed), colors[r.method]) for r in order]
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


# --------------------------------------------------------------------------------------------------
# The study's second stage: dense baselines at matched FLOPs and GPU-seconds
# --------------------------------------------------------------------------------------------------
def dense_steps(runs: Sequence[RunResult], tolerance: float = 0.05, max_factor: float = 2.0
                ) -> list[tuple[int, str]]:
    """Step counts of the dense runs still to run so that dense meets the sparse runs at equal cost:
    `(steps, why)` by increasing steps.

    Dense FLOPs and seconds per step come from the finished dense runs among `runs` (medians over them), the
    targets from the finished sparse ones: the median training FLOPs of each density, and the median GPU-seconds
    of each (density, block) group over its methods and seeds. A target within `tolerance` of a dense run that
    exists (or of a smaller target kept before it) is dropped; steps are capped at `max_factor` x the longest
    dense run. Raises ValueError when `runs` hold no finished dense or sparse run.

    Example:
        >>> dense_steps(collect_runs(["study"]))
        [(219, 'FLOPs of density 0.1 (6.7e+14)'), (316, 'FLOPs of density 0.25 (9.7e+14)'), ...]
    """
    done = [r for r in runs if r.status == "finished" and r.steps and r.total_train_flops]
    dense = [r for r in done if r.method == "dense"]   # not sparse-then-dense, which also ends at density 1
    sparse = [r for r in done if not r.dense]
    if not dense or not sparse:
        raise ValueError("runs: the dense steps need a finished dense run (the reference) and finished sparse "
                         f"runs; found {len(dense)} dense and {len(sparse)} sparse")
    flops_per_step = statistics.median(r.total_train_flops / r.steps for r in dense)
    timed = [r for r in dense if r.gpu_s]
    s_per_step = statistics.median(r.gpu_s / r.steps for r in timed) if timed else None
    targets: list[tuple[float, str]] = []
    for density in sorted({r.nominal_density for r in sparse}, reverse=True):
        flops = statistics.median(r.total_train_flops for r in sparse if r.nominal_density == density)
        targets.append((flops / flops_per_step, f"FLOPs of density {density:g} ({flops:.2g})"))
    if s_per_step:
        groups = sorted({(r.nominal_density, _block_size(r.block)) for r in sparse if r.gpu_s},
                        key=lambda g: (-g[0], g[1]))
        for density, size in groups:
            seconds = statistics.median(r.gpu_s for r in sparse if r.gpu_s and r.nominal_density == density
                                        and _block_size(r.block) == size)
            targets.append((seconds / s_per_step, f"GPU-seconds of {density:g} {size}x{size} ({seconds:.1f} s)"))
    longest = max(r.steps for r in dense)
    kept = sorted({r.steps for r in dense})
    chosen: list[tuple[int, str]] = []
    for raw, why in sorted(targets):
        steps = max(1, min(round(raw), round(max_factor * longest)))
        if all(abs(steps - k) > tolerance * k for k in kept):
            kept.append(steps)
            chosen.append((steps, why))
    return chosen


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
    parser = argparse.ArgumentParser(prog="sparsetrain pareto", description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run dirs, multirun folders, or FILE.csv tables an earlier call wrote")
    parser.add_argument("--out", default="pareto.png",
                        help="PNG to write; FILE.csv and FILE.md go beside it (default: ./pareto.png)")
    parser.add_argument("--dense-steps", action="store_true",
                        help="print the trainer.max_steps of the dense runs that match the sparse runs' FLOPs and "
                             "GPU-seconds, comma separated, and write nothing")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
