"""Checkpoints: Accelerate state (model, optimizer, RNG, scaler) + sparsity scheduler state + LR schedule +
data position, written atomically (temp dir, then rename) under ``RUN_DIR/checkpoints/step_XXXXXXXX``."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "sparsetrain_state.pt"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    pass


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (temp dirs of interrupted writes are ignored)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def find_resume(resume: str | None, root: Path) -> Path | None:
    """``None`` -> no resume; ``"auto"`` -> latest checkpoint under ``root`` (None if there is none);
    a path -> that checkpoint (it must be complete)."""
    if resume is None:
        return None
    if resume == "auto":
        ckpts = list_checkpoints(root)
        return ckpts[-1] if ckpts else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"trainer.resume: {path} is not a sparsetrain checkpoint (no {STATE_FILE})")
    return path


def read_state(path: Path) -> dict[str, Any]:
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)


def check_compatible(state: dict[str, Any], path: Path, scheduler) -> None:
    """A sparse run refuses a checkpoint that has no sparsity state (its masks would be invented)."""
    sp = state.get("sparsity")
    if scheduler.sparse and not sp:
        raise CheckpointError(f"checkpoint {path} has no sparsity state, but this run uses "
                              f"{scheduler.name!r}: refusing to resume with invented masks")
    if sp and sp.get("name") != scheduler.name:
        raise CheckpointError(f"checkpoint {path} holds sparsity state of {sp.get('name')!r}, this run uses "
                              f"{scheduler.name!r}")


def save_checkpoint(accelerator, root: Path, step: int, scheduler, extra: dict[str, Any], keep: int) -> Path:
    """Write ``root/step_XXXXXXXX`` atomically; keep the newest ``keep`` checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp_step_{step:08d}"
    if final.exists():
        return final
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=False)
    if accelerator.is_main_process:
        state = {"step": step, "sparsity": scheduler.state_dict() if scheduler.sparse else None, **extra}
        torch.save(state, tmp / STATE_FILE)
        (tmp / "meta.json").write_text(json.dumps({"step": step, "sparsity": scheduler.name}) + "\n")
        os.replace(tmp, final)
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(accelerator, path: Path) -> None:
    """Restore model, optimizer, scaler and RNG states (sparsity/LR/data state is read by the caller)."""
    accelerator.load_state(str(path))
