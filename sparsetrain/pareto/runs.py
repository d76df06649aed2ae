"""Reading runs for `sparsetrain pareto`: a run directory (or folders holding them) into a :class:`RunResult`,
and the FILE.csv tables an earlier call wrote (`CSV_COLUMNS`) back into the same."""
from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sparsetrain.training.metrics import (
    METRICS_FILE,
    SUMMARY_FILE,
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
    model: str | None = None        # the config's model as ``arch-size`` ("bert-small"), where it names one

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
        """A dense baseline (sparsity=dense, or density 1), told apart by steps, not by block; a sparse-then-dense
        run (``+dense@F``), dense at its end, is not one."""
        return (self.density is None or self.density >= 1.0) and "+dense@" not in (self.method or "")


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
    dense_from = _number(_config_get(config, "sparsity", "scheduler", "dense_from"))
    suffix = f"+dense@{dense_from:g}" if dense_from is not None else ""
    if target.rsplit(".", 1)[-1] != "PruneRegrow":
        return _class_label(target, "sparsetrain.sparsity") + suffix
    policy = _config_get(config, "sparsity", "scheduler", "policy")
    if isinstance(policy, dict) and isinstance(policy.get("_target_"), str):
        return "prune_regrow/" + _class_label(policy["_target_"], "sparsetrain.sparsity.policies") + suffix
    from sparsetrain.sparsity.policies import POLICIES

    name = "set" if policy is None else str(policy)  # PruneRegrow's default policy
    return (f"prune_regrow/{POLICIES[name].name}" if name in POLICIES else f"prune_regrow/{name}") + suffix


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
        model=_model_name(config),
    )


def _model_name(config: dict) -> str | None:
    """``arch-size`` of the config's model ("bert-base"), None where it does not name both."""
    arch, size = _config_get(config, "model", "arch"), _config_get(config, "model", "size")
    return f"{arch}-{size}" if isinstance(arch, str) and isinstance(size, str) else None


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
            step_mode=(row.get("step_mode") or "").strip() or None, model=(row.get("model") or "").strip() or None))
    return runs


def _display_path(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return str(path)


CSV_COLUMNS = ["method", "label", "target_density", "density", "block", "seed", "steps", "train_flops", "gpu_s",
               "wall_s", "final_eval_loss", "frontier", "status", "step_mode", "device", "date", "model", "path"]


# What read_table needs of a CSV; the label and frontier columns are recomputed, and tables written before the
# model column existed still read.
_TABLE_NEEDS = [c for c in CSV_COLUMNS if c not in ("label", "frontier", "model")]
