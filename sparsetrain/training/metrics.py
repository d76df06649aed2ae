"""Run metrics: metrics.jsonl, a progress bar and summary.json (plots: :mod:`.plots`; wandb: :mod:`.tracking`).

A run directory holds `metrics.jsonl` (one JSON object per line, each with an integer `"step"`),
`summary.json` (written once at the end) and, when tracking is on, `wandb/`. The row contract:

- train rows: `step, loss, lr, train_flops (cumulative), tokens_per_s | samples_per_s, density,
  elapsed_s (cumulative training wall seconds, eval and checkpoints excluded)`, optional `peak_mem_gb` (GiB,
  the allocated peak since the loop started) and `reserved_gb` (GiB the allocator held from the device at most
  in this log window, CUDA graphs' private pools included; freed blocks are returned after the startup window), and
  `startup: true` on a window that holds a process's first steps or the first after a dense switch (kernel
  tuning, compilation, a first CUDA-graph capture; :func:`train_seconds` charges them at the next window's rate);
- eval rows: `step, eval_loss, train_flops, elapsed_s`, optional `eval_accuracy`;
- event rows: `step, event` (e.g. `"mask_update"` with `pruned, regrown, drop_fraction`).
  Readers ignore keys they do not know.

Non-finite floats: the file is strict JSON (readable by jq, pandas, JavaScript), so NaN and the
infinities are written as the strings `"NaN"`, `"Infinity"`, `"-Infinity"` rather than as null; a
diverged loss then stays visible in the file (`"loss": "NaN"`) and cannot be confused with a missing
value. `read_metrics` turns these strings back into floats.

Example:
    >>> log = MetricsLogger("runs/demo")
    >>> log.log({"step": 10, "loss": 3.2, "lr": 1e-4, "density": 0.1})
    >>> read_metrics("runs/demo")[-1]["loss"]
    3.2
"""
from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from sparsetrain._files import atomic_write_text

if TYPE_CHECKING:  # annotations are strings here (__future__), so Self costs nothing at run time
    from typing_extensions import Self

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"

_NONFINITE_TO_STR = {math.inf: "Infinity", -math.inf: "-Infinity"}
NONFINITE_MARKERS = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


# --------------------------------------------------------------------------------------------------
# JSON encoding shared by metrics.jsonl and summary.json
# --------------------------------------------------------------------------------------------------
def json_value(value: Any, key: str) -> Any:
    """Convert one value to strict-JSON types; tensors and numpy scalars become Python numbers."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        return _NONFINITE_TO_STR.get(value, value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_value(v, f"{key}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v, key) for v in value]
    # torch tensors and numpy scalars: a one-element value becomes its Python number. Checked by
    # duck typing so this module imports neither torch nor numpy.
    if hasattr(value, "item") and getattr(value, "size", None) is not None:
        try:
            return json_value(value.item(), key)
        except (ValueError, RuntimeError):
            pass
    raise TypeError(f"value for key {key!r} has type {type(value).__name__}, which cannot be written as JSON")


def _dumps(obj: dict) -> str:
    encoded = {str(k): json_value(v, str(k)) for k, v in obj.items()}
    return json.dumps(encoded, allow_nan=False)


def _decode_row(row: dict) -> dict:
    """Turn the non-finite markers of a flat row back into floats."""
    return {k: NONFINITE_MARKERS.get(v, v) if isinstance(v, str) else v for k, v in row.items()}


def check_row(row: Any) -> None:
    if not isinstance(row, dict):
        raise TypeError(f"row must be a dict, got {type(row).__name__}")
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"row['step'] must be an int, got {step!r} in row {row!r}")


# --------------------------------------------------------------------------------------------------
# metrics.jsonl
# --------------------------------------------------------------------------------------------------
class MetricsLogger:
    """Append-only writer of `run_dir/metrics.jsonl`, one flushed line per row, main process only.

    On other processes (`is_main_process=False`) `log` does nothing and no file is created, so the
    training loop can call it unconditionally.

    Example:
        >>> with MetricsLogger("runs/demo", is_main_process=accelerator.is_main_process) as log:
        ...     log.log({"step": 1, "loss": 2.5, "lr": 1e-3})
    """

    def __init__(self, run_dir: str | os.PathLike, is_main_process: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.is_main_process = bool(is_main_process)
        self._file = None
        if self.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # Append: a resumed run continues the same file (after `truncate_after`).
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (open for the logger's life)

    def log(self, row: dict) -> None:
        """Append one row (a flat dict with an int `"step"`) and flush it to disk."""
        check_row(row)
        if self._file is None:
            return
        line = _dumps(row)  # encode before writing: a bad value raises without leaving a partial line
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def truncate_after(run_dir: str | os.PathLike, step: int) -> int:
        """Drop every row with `row["step"] > step` from `run_dir/metrics.jsonl`; return rows kept.

        Call it on the main process when resuming from a checkpoint taken at `step`, before opening
        a `MetricsLogger`, so rows logged after that checkpoint by the interrupted run are not
        duplicated. Kept lines are copied byte for byte; a line that does not parse (the partial last
        line of a killed run) is dropped; a row without a `"step"` is kept. The rewrite is atomic.
        A missing file is not an error (nothing was logged yet): returns 0.

        Example:
            >>> MetricsLogger.truncate_after("runs/demo", step=500)
            42
        """
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {step!r}")
        path = Path(run_dir) / METRICS_FILE
        if not path.exists():
            return 0
        kept = []
        for line, row in _parsed_lines(path):
            row_step = row.get("step")
            if isinstance(row_step, (int, float)) and row_step > step:
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
        atomic_write_text(path, "".join(kept))
        return len(kept)


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """Rows of `run_dir/metrics.jsonl`, in file order, with non-finite markers turned into floats.

    Lines that do not parse (a partial last line) are skipped. A missing file gives `[]`.

    Example:
        >>> [r["eval_loss"] for r in read_metrics("runs/demo") if "eval_loss" in r]
        [4.1, 3.7]
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    return [_decode_row(row) for _, row in _parsed_lines(path)]


def _parsed_lines(path: Path):
    """(line, row) for every line of a metrics file that parses to a JSON object (a killed run's partial
    last line does not)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                yield line, row


# --------------------------------------------------------------------------------------------------
# Progress bar
# --------------------------------------------------------------------------------------------------
def _format_rate(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.1f}"


def _format_postfix_value(key: str, value: Any) -> str:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)
    if key == "lr":
        return f"{value:.2e}"
    if key.endswith("_per_s"):
        return _format_rate(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


class Progress:
    """A tqdm bar on stderr over training steps, showing loss, lr and throughput.

    `update` takes the absolute step (not an increment), so a resumed run passes `initial` and the
    same step counter the loop uses.

    Example:
        >>> bar = Progress(total_steps=1000, initial=0, disable=not accelerator.is_main_process)
        >>> bar.update(10, loss=3.21, lr=1e-4, tokens_per_s=52000.0)
        >>> bar.close()
    """

    def __init__(self, total_steps: int, initial: int = 0, disable: bool = False) -> None:
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ValueError(f"total_steps must be an int >= 0, got {total_steps!r}")
        if isinstance(initial, bool) or not isinstance(initial, int) or not 0 <= initial <= total_steps:
            raise ValueError(f"initial must be an int in [0, total_steps={total_steps}], got {initial!r}")
        self._bar = tqdm(
            total=total_steps, initial=initial, disable=disable, file=sys.stderr, unit="step",
            dynamic_ncols=True, desc="train",
        )

    @property
    def n(self) -> int:
        return int(self._bar.n)

    def update(self, step: int, **postfix: Any) -> None:
        """Move the bar to `step` and show `postfix` (e.g. loss=..., lr=..., tokens_per_s=...)."""
        if postfix:
            shown = {key: _format_postfix_value(key, value) for key, value in postfix.items()}
            self._bar.set_postfix(shown, refresh=False)  # the update below refreshes once
        self._bar.update(step - self._bar.n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------------
def write_summary(run_dir: str | os.PathLike, **fields: Any) -> Path:
    """Write `fields` as `run_dir/summary.json` atomically; return its path.

    Example:
        >>> write_summary("runs/demo", status="finished", method="static", density=0.1, steps=1000)
        PosixPath('runs/demo/summary.json')
    """
    path = Path(run_dir) / SUMMARY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    encoded = {k: json_value(v, k) for k, v in fields.items()}
    atomic_write_text(path, json.dumps(encoded, indent=2, allow_nan=False) + "\n")
    return path


def read_summary(run_dir: str | os.PathLike) -> dict | None:
    """`run_dir/summary.json` as a dict (non-finite markers decoded), or None when absent."""
    path = Path(run_dir) / SUMMARY_FILE
    if not path.exists():
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise TypeError(f"{path} does not hold a JSON object")
    return _decode_row(data)


def format_flops(value: float | None) -> str:
    """Compact scientific notation that `float()` reads back: 1.23e15 (or '-' for None)."""
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    exponent = math.floor(math.log10(abs(value)))
    mantissa = value / 10**exponent
    if round(abs(mantissa), 2) >= 10:  # 9.999e14 rounds to 10.00: carry into the exponent
        mantissa, exponent = mantissa / 10, exponent + 1
    return f"{mantissa:.2f}e{exponent}"


def format_seconds(seconds: float | None) -> str:
    """'2h03m', '12m34s' or '45.2s' (or '-' for None)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_summary(summary: dict) -> str:
    """Two short lines describing a finished run, for the end of the training log.

    Example:
        >>> print(format_summary({"status": "finished", "method": "static", "density": 0.1, "steps": 100}))
        finished: method=static density=0.100
          steps 100 | wall - | final eval loss - | train FLOPs - | throughput -
    """
    head = [str(summary.get("status", "unknown")) + ":"]
    for key in ("method", "recipe"):
        if summary.get(key):
            head.append(f"{key}={summary[key]}")
    if isinstance(summary.get("density"), (int, float)):
        head.append(f"density={summary['density']:.3f}")
    if summary.get("block"):
        head.append(f"block={summary['block']}")

    loss = summary.get("final_eval_loss")
    rate_key = next((k for k in ("tokens_per_s", "samples_per_s") if summary.get(k) is not None), None)
    rate = f"{_format_rate(summary[rate_key])} {rate_key.split('_')[0]}/s" if rate_key else "-"
    body = [
        f"steps {summary.get('steps', '-')}",
        f"wall {format_seconds(summary.get('wall_s'))}",
        f"final eval loss {loss:.4f}" if isinstance(loss, (int, float)) else "final eval loss -",
        f"train FLOPs {format_flops(summary.get('total_train_flops'))}",
        f"throughput {rate}",
    ]
    if isinstance(summary.get("update_s"), (int, float)):   # measured from the run's windows (update_cost)
        body.append(f"one mask update {summary['update_s'] * 1e3:.0f} ms = {summary['update_steps']:.1f} steps")
    return " ".join(head) + "\n  " + " | ".join(body)


def last_eval(rows: list[dict], step: int) -> dict | None:
    """The ``eval_*`` values of the last evaluation row at or before ``step`` (None if there is none)."""
    evals = [r for r in rows if "eval_loss" in r and r.get("step", 0) <= step]
    return {k: v for k, v in evals[-1].items() if k.startswith("eval_")} if evals else None


def window_rate(run_dir: str | os.PathLike, key: str) -> float | None:
    """Median of ``key`` (a throughput) over the logged rows: robust to the first, warm-up window."""
    vals = sorted(r[key] for r in read_metrics(run_dir) if key in r)
    return vals[len(vals) // 2] if vals else None


def train_seconds(rows: Sequence[dict], steps: int | None = None) -> float | None:
    """Training GPU-seconds of a run's first ``steps`` steps (default: up to its last train row), window by window,
    so a run whose step time changes (sparse, then dense) pays each phase's own time; None without a timed window.

    A window is the steps between two train rows, its seconds the difference of their ``elapsed_s`` (no eval or
    checkpoint in it). The first window and those marked ``startup`` (a process's first steps, also after a resume
    or the dense switch: tuning, compiling, a first capture) are charged at the next timed window's step time.
    Mask updates and their re-captures stay in. Past the last window: the last timed window's step time.

    Example:
        >>> rows = [{"step": 10, "loss": 3.1, "elapsed_s": 9.0, "startup": True},
        ...         {"step": 20, "loss": 2.9, "elapsed_s": 10.0},
        ...         {"step": 30, "loss": 2.8, "elapsed_s": 12.0}]
        >>> train_seconds(rows)       # steps 1-10 at the 0.1 s per step of steps 11-20, then 1 s and 2 s
        4.0
        >>> train_seconds(rows, 25)   # half of the third window
        3.0
    """
    windows = _timed_windows(rows)
    if not (rates := [w[3] for w in windows if w[3] is not None]):
        return None
    total = windows[-1][1] if steps is None else steps
    seconds = 0.0
    for i, (start, end, own, per_step) in enumerate(windows):
        if start >= total:
            break
        if per_step is None:   # a start-up window: its steps at the next timed window's step time
            own = next((w[3] for w in windows[i + 1:] if w[3] is not None), rates[-1]) * (end - start)
        seconds += own * (min(end, total) - start) / (end - start)   # a share of the window ``steps`` ends in
    return seconds + max(0, total - windows[-1][1]) * rates[-1]


def _timed_windows(rows: Sequence[dict]) -> list[tuple[int, int, float, float | None]]:
    """``(first step - 1, last step, seconds, seconds per step or None for a start-up window)`` per train window."""
    train = [r for r in rows if isinstance(r.get("step"), int) and "loss" in r and "event" not in r
             and "eval_loss" not in r and isinstance(r.get("elapsed_s"), (int, float))]
    windows, prev_step, prev_s = [], 0, 0.0
    for i, row in enumerate(train):
        if row["step"] > prev_step:
            own = row["elapsed_s"] - prev_s
            timed = i > 0 and not row.get("startup")
            windows.append((prev_step, row["step"], own, own / (row["step"] - prev_step) if timed else None))
        prev_step, prev_s = row["step"], row["elapsed_s"]
    return windows


# --------------------------------------------------------------------------------------------------
# What one mask update costs, measured from the run's own windows (the run summary, `bench e2e`)
# --------------------------------------------------------------------------------------------------
def run_windows(rows: Sequence[dict], rate_key: str) -> list[list]:
    """The training rows' windows as ``[end_step, steps, seconds]`` (seconds from the cumulative ``elapsed_s``)."""
    train = sorted((r for r in rows if rate_key in r and "event" not in r), key=lambda r: r["step"])
    windows, prev_step, prev_s = [], 0, 0.0
    for r in train:
        windows.append([r["step"], r["step"] - prev_step, r["elapsed_s"] - prev_s])
        prev_step, prev_s = r["step"], r["elapsed_s"]
    return windows


def update_cost(windows: list[list], updates: list[int]) -> dict | None:
    """Seconds one mask update adds, from window times: Σ over windows holding updates of (window seconds −
    its steps × the mean step time of update-free windows) / updates in them. Window 1 (warm-up) is left out,
    and so is a window that holds only the two steps after an update (its eager step, its re-capture)."""
    hit = [(steps, sec, n) for end, steps, sec in windows[1:]
           if (n := sum(end - steps < u <= end for u in updates))]
    clean = [windows[i][1:] for i in clean_windows(windows, updates)]
    if not hit or not clean:
        return None
    step_s = sum(sec for _, sec in clean) / sum(steps for steps, _ in clean)
    cost = sum(sec - steps * step_s for steps, sec, _ in hit) / sum(n for *_, n in hit)
    return {"update_s": cost, "clean_step_s": step_s, "update_windows": len(hit), "clean_windows": len(clean)}


def clean_windows(windows: list[list], updates: list[int]) -> list[int]:
    """Indices of the windows after the first (warm-up) that hold no mask update and neither of the two steps
    after one (its eager step, its re-capture)."""
    return [i for i, (end, steps, _) in enumerate(windows) if i > 0
            and not any(end - steps < u + k <= end for u in updates for k in (0, 1, 2))]


def update_cost_fields(rows: Sequence[dict], rate_key: str) -> dict[str, float | None]:
    """``update_s`` (seconds one mask update adds to the run, :func:`update_cost`) and ``update_steps`` (the same
    in steps of the run's update-free windows), None where the run has no update or no update-free window."""
    updates = [r["step"] for r in rows if r.get("event") == "mask_update"]
    cost = update_cost(run_windows(rows, rate_key), updates) if updates else None
    if cost is None:
        return {"update_s": None, "update_steps": None}
    return {"update_s": cost["update_s"], "update_steps": cost["update_s"] / cost["clean_step_s"]}
