"""Experiment tracking (wandb) through Accelerate's trackers: start, log metric rows, finish.

Rows are the ones written to metrics.jsonl (see :mod:`sparsetrain.training.metrics`); tracking is optional and
off by default (``logger.wandb.enabled``).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sparsetrain.training.metrics import NONFINITE_MARKERS, check_row, json_value

WANDB_MODES = ("offline", "online", "disabled")


def _uses_wandb(accelerator: Any) -> bool:
    return any(str(getattr(t, "value", t)) == "wandb" or getattr(t, "name", None) == "wandb"
               for t in getattr(accelerator, "log_with", None) or [])


def init_tracking(
    accelerator: Any,
    project: str,
    run_dir: str | os.PathLike,
    config: dict,
    mode: str = "offline",
    name: str | None = None,
    enabled: bool = True,
    run_id: str | None = None,
) -> str | None:
    """Start wandb tracking through Accelerate's trackers, writing under `run_dir/wandb/`; return the wandb
    run id (None when not enabled).

    The accelerator must come from `Accelerator(log_with="wandb", project_dir=run_dir)`. `mode` is
    `"offline"` (default: works with no network and no API key; upload later with `wandb sync`),
    `"online"` (needs a logged-in user) or `"disabled"`. wandb's own console messages are silenced and
    its stdout/stderr capture is off, unless WANDB_SILENT / WANDB_CONSOLE are already set.
    `enabled=False` does nothing. `run_id` continues that run (a resumed training run keeps its wandb run:
    the id is stored in its checkpoints); None starts a new one.

    Example:
        >>> acc = Accelerator(log_with="wandb", project_dir="runs/demo")
        >>> init_tracking(acc, "sparsetrain", "runs/demo", {"density": 0.1}, name="static-0.1")
    """
    if not enabled:
        return None
    if mode not in WANDB_MODES:
        raise ValueError(f"mode must be one of {WANDB_MODES}, got {mode!r}")
    if not isinstance(project, str) or not project:
        raise ValueError(f"project must be a non-empty string, got {project!r}")
    if not isinstance(config, dict):
        raise TypeError(f"config must be a dict (OmegaConf.to_container(cfg)), got {type(config).__name__}")
    if not _uses_wandb(accelerator):
        raise ValueError('accelerator was not created with log_with="wandb" (or pass enabled=False)')
    try:
        import wandb  # noqa: F401  (checked here so a missing install fails with a clear message)
    except ImportError as e:
        raise ImportError("tracking needs the wandb package (or pass enabled=False)") from e

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    os.environ["WANDB_MODE"] = mode
    os.environ["WANDB_DIR"] = str(run_dir)
    os.environ.setdefault("WANDB_SILENT", "true")
    # Console capture off: wandb otherwise wraps stdout/stderr, which fights tqdm and Hydra's logging.
    os.environ.setdefault("WANDB_CONSOLE", "off")
    init_kwargs = {"dir": str(run_dir), "name": name or run_dir.name, "mode": mode}
    if run_id is not None:
        init_kwargs.update(id=str(run_id), resume="allow")
    accelerator.init_trackers(project, config=json_value(config, "config"), init_kwargs={"wandb": init_kwargs})
    try:  # only the main process holds the run (Accelerate starts trackers there)
        run = getattr(accelerator.get_tracker("wandb", unwrap=True), "id", None)
    except ValueError:
        run = None
    return str(run) if isinstance(run, str) and run else run_id


def log_tracking(accelerator: Any, row: dict, step: int) -> None:
    """Send one metrics row to the trackers at `step`.

    `step` and None values are dropped; an event row's keys are prefixed with the event name
    (`{"event": "mask_update", "pruned": 8}` -> `mask_update/pruned`) so events get their own panels.

    Example:
        >>> log_tracking(acc, {"step": 10, "loss": 3.2, "lr": 1e-4}, step=10)
    """
    check_row({"step": step})
    if not getattr(accelerator, "trackers", None):
        return
    event = row.get("event")
    prefix = f"{event}/" if isinstance(event, str) else ""
    values = {}
    for key, value in row.items():
        if key in ("step", "event") or value is None:
            continue
        value = json_value(value, key)
        if isinstance(value, str) and value in NONFINITE_MARKERS:
            value = NONFINITE_MARKERS[value]  # wandb plots NaN as a gap: keep the float
        values[prefix + key] = value
    if values:
        accelerator.log(values, step=step)


def end_tracking(accelerator: Any) -> None:
    """Finish every tracker (flushes wandb's offline run files) and forget them.

    Trackers are removed from `accelerator.trackers`, so a later `accelerator.end_training()` does not
    finish them a second time.
    """
    trackers = list(getattr(accelerator, "trackers", None) or [])
    for tracker in trackers:
        tracker.finish()
    if trackers:
        accelerator.trackers.clear()
    if any(getattr(t, "name", "") == "wandb" for t in trackers):
        import wandb

        # run.finish() only informs wandb's service process, which writes the rest of the offline run file on its
        # own time (a full test run once read a file holding just its header); teardown waits until it is done.
        wandb.teardown()
