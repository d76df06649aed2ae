"""Checkpoints under ``RUN_DIR/checkpoints/step_XXXXXXXX``: model, optimizer, scaler and per-process RNG state,
plus the sparsity scheduler, LR schedule, data position and the run's resolved config. The model and optimizer
files are those of one process on any number of processes: under DDP they are the same on every rank, under
FSDP2 every rank gathers the shards (:mod:`sparsetrain.training.sharded`) and each takes its shard on load.

Written so that nothing written can be lost or execute code:

* every file is a ``torch.save`` of tensors and plain containers, and every load uses ``weights_only=True``
  (a checkpoint holding any other object is refused, never unpickled);
* files are written into ``.tmp_step_X``, fsynced, the directory renamed to ``step_X`` and the parent fsynced:
  a ``step_X`` dir is complete or absent. ``meta.json`` lists every file with its size and SHA-256, so a file
  truncated or corrupted later is noticed before anything is loaded (and a resume takes the checkpoint before);
* rotation renames an old checkpoint to ``.trash_step_X`` before deleting it, and leftovers of an
  interrupted write or rotation (``.tmp_*``, ``.trash_*``, a ``step_X`` without its state) are removed by
  :func:`remove_partial` when the next run starts.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sparsetrain._files import fsync_path
from sparsetrain.training import sharded

STATE_FILE = "sparsetrain_state.pt"
META_FILE = "meta.json"
MODEL_FILE = "pytorch_model.bin"
OPTIMIZER_FILE = "optimizer.bin"
SCALER_FILE = "scaler.pt"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
_LEFTOVER = re.compile(r"^\.(tmp|trash)_step_\d{8}$")


class CheckpointError(RuntimeError):
    pass


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (its partial files were removed); the message is one line, and
    ``disk_full`` says whether the device ran out of space."""

    def __init__(self, message: str, disk_full: bool) -> None:
        super().__init__(message)
        self.disk_full = disk_full


def _rng_file(rank: int) -> str:
    return f"rng_state_{rank}.pt"


# ---- reading --------------------------------------------------------------------------------------
def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first (leftovers of interrupted writes are ignored)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir()
             if p.is_dir() and _STEP_DIR.match(p.name) and (p / STATE_FILE).is_file() and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def safe_load(path: Path, what: str = "checkpoint file") -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; anything else (a pickled object, a truncated or
    corrupt file) raises :class:`CheckpointError` in one line. Never executes code from the file."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except Exception as e:  # UnpicklingError for foreign objects, RuntimeError/EOFError for truncated zips
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{what} {path} cannot be loaded safely (only tensors and plain containers are "
                              f"accepted): {first}") from None


def read_meta(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: unreadable {META_FILE} ({e})") from None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    return digest.hexdigest()


def check_intact(path: Path) -> None:
    """Every file ``meta.json`` lists exists with its recorded size and SHA-256 (checkpoints written before the
    checksums: sizes only); a damaged file raises CheckpointError. A dir given by hand without ``meta.json`` is
    not checked here (its files are still loaded safely)."""
    if not (path / META_FILE).is_file():
        return
    meta = read_meta(path)
    for name, size in (meta.get("files") or {}).items():
        f = path / name
        if not f.is_file() or f.stat().st_size != size:
            have = f.stat().st_size if f.is_file() else "missing"
            raise CheckpointError(f"checkpoint {path}: {name} is damaged ({have} bytes, written {size})")
    for name, digest in (meta.get("sha256") or {}).items():
        if _sha256(path / name) != digest:
            raise CheckpointError(f"checkpoint {path}: {name} is damaged (its content does not match the SHA-256 "
                                  f"written with it)")


def read_state(path: Path) -> dict[str, Any]:
    """The checkpoint's own state (step, sparsity, LR schedule, data position, config), after checking that
    every file of the checkpoint is intact."""
    check_intact(path)
    state = safe_load(path / STATE_FILE, "checkpoint state")
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"checkpoint state {path / STATE_FILE} is not a sparsetrain state")
    return state


# ---- writing --------------------------------------------------------------------------------------
def _save(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    fsync_path(path)


def rng_state() -> dict[str, Any]:
    """This process's random states as tensors and plain values (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, keys.tolist(), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():   # this process's GPU only: a resume may run on a machine with fewer GPUs
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if torch.cuda.is_available() and cuda is not None:
        device = torch.cuda.current_device()
        if isinstance(cuda, (list, tuple)):   # written before: one state per GPU of the machine that wrote it
            cuda = cuda[device] if device < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)


def save_checkpoint(accelerator, model, optimizer, root: Path, step: int, scheduler, extra: dict[str, Any],
                    keep: int) -> Path:
    """Write ``root/step_XXXXXXXX`` atomically (see the module docstring); keep the newest ``keep``. A checkpoint
    of the same step already there (a run resumed from an older one) is replaced. A write that fails (a full
    disk, say) removes what it wrote and raises :class:`CheckpointWriteError`; older checkpoints stay as they are."""
    main = accelerator.is_main_process
    final, tmp = root / f"step_{step:08d}", root / f".tmp_step_{step:08d}"
    try:
        if main:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        accelerator.wait_for_everyone()
        _write_files(accelerator, model, optimizer, tmp)
        if main:
            state = {"step": step, "sparsity": scheduler.state_dict() if scheduler.sparse else None,
                     "processes": accelerator.num_processes, **extra}
            _save(state, tmp / STATE_FILE)
            _write_meta(tmp, step, scheduler.name)
    except (OSError, RuntimeError) as e:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointWriteError(*_write_failure(e, root, final)) from e
    if main:
        _publish(tmp, final, root, keep)
    accelerator.wait_for_everyone()
    return final


def _write_files(accelerator, model, optimizer, tmp: Path) -> None:
    """Model, optimizer and scaler (main process) and every process's random state, into ``tmp``."""
    main = accelerator.is_main_process
    inner = accelerator.unwrap_model(model)
    if sharded.model_is_sharded(inner):   # FSDP2: every rank gathers, the files are those of one process
        model_state = sharded.full_model_state(inner)
        optimizer_state = sharded.full_optimizer_state(getattr(optimizer, "optimizer", optimizer))
    else:
        model_state = accelerator.get_state_dict(model)
        optimizer_state = optimizer.state_dict() if main else None
    _save(rng_state(), tmp / _rng_file(accelerator.process_index))
    if main:
        _save(model_state, tmp / MODEL_FILE)
        _save(optimizer_state, tmp / OPTIMIZER_FILE)
        if accelerator.scaler is not None:
            _save(accelerator.scaler.state_dict(), tmp / SCALER_FILE)
    accelerator.wait_for_everyone()


def _write_meta(tmp: Path, step: int, sparsity: str) -> None:
    """meta.json: every file's size and SHA-256, read back from the disk (what a resume will read)."""
    files = sorted(tmp.iterdir())
    meta = tmp / META_FILE
    meta.write_text(json.dumps({"step": step, "sparsity": sparsity, "files": {p.name: p.stat().st_size for p in files},
                                "sha256": {p.name: _sha256(p) for p in files}}) + "\n")
    fsync_path(meta)
    fsync_path(tmp)


def _publish(tmp: Path, final: Path, root: Path, keep: int) -> None:
    """Rename the written checkpoint into place (replacing one of the same step), then rotate old ones."""
    if final.exists():
        replaced = root / f".trash_{final.name}"
        os.replace(final, replaced)
        os.replace(tmp, final)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_path(root)
    for old in list_checkpoints(root)[:-keep]:
        trash = root / f".trash_{old.name}"
        os.replace(old, trash)          # one atomic step: the checkpoint is whole or gone
        fsync_path(root)
        shutil.rmtree(trash, ignore_errors=True)


def _write_failure(error: BaseException, root: Path, final: Path) -> tuple[str, bool]:
    """One line for a checkpoint that could not be written, and whether the disk is full (torch reports that as
    ``basic_ios::clear: iostream error`` or ``unexpected pos``: the free space against the last checkpoint's size
    tells)."""
    try:
        free = shutil.disk_usage(root if root.exists() else root.parent).free
    except OSError:
        free = None
    previous = list_checkpoints(root)
    needed = sum(p.stat().st_size for p in previous[-1].iterdir()) if previous else 0
    full = getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or (
        free is not None and free < max(needed, 64 * 2**20))
    what = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    space = f"{free / 2**20:,.0f} MiB free" if free is not None else "free space unknown"
    if needed:
        space += f", the last checkpoint took {needed / 2**20:,.0f} MiB"
    if full:
        return f"no space left on the device of {root} to write {final.name} ({space})", True
    return f"could not write {final.name} under {root}: {what} ({space})", False


def load_model_state(inner, path: Path, key: str | None = None) -> None:
    """Load the checkpoint's weights and masks into the (unwrapped) model: every sparse layer takes the mask in the
    file and rebuilds its format's storage for it (``SparseLinear._load_from_state_dict``). Loaded with
    weights_only=True; a tensor of another shape raises :class:`CheckpointError` (led by ``key`` if given)."""
    model_state = safe_load(path / MODEL_FILE, "model state")
    if sharded.model_is_sharded(inner):   # FSDP2: each rank takes its shard of the whole tensors
        sharded.load_full_model_state(inner, model_state)
        return
    try:
        inner.load_state_dict(model_state)
    except RuntimeError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        detail = "; ".join(lines[1:4]) or (lines[0] if lines else type(e).__name__)
        hint = (" (the position table: model.max_position_embeddings must be the checkpoint's)"
                if "position_embeddings" in detail else "")
        lead = f"{key}: " if key else ""
        raise CheckpointError(f"{lead}checkpoint {path} does not fit this run's model{hint}: {detail}") from None


def load_checkpoint(accelerator, model, optimizer, path: Path, saved_processes: int) -> None:
    """Restore model, optimizer, scaler and this process's RNG state (every file with weights_only=True).
    Sparsity/LR/data state is read by the caller from :func:`read_state`."""
    inner = accelerator.unwrap_model(model)
    load_model_state(inner, path)
    optimizer_state = safe_load(path / OPTIMIZER_FILE, "optimizer state")
    if sharded.model_is_sharded(inner):   # FSDP2: each rank takes its shard of the whole tensors
        sharded.load_full_optimizer_state(getattr(optimizer, "optimizer", optimizer), optimizer_state)
    else:
        optimizer.load_state_dict(optimizer_state)
    if accelerator.scaler is not None and (path / SCALER_FILE).is_file():
        accelerator.scaler.load_state_dict(safe_load(path / SCALER_FILE, "scaler state"))
    rank = accelerator.process_index
    rng = path / _rng_file(rank if rank < saved_processes else 0)
    if not rng.is_file():
        raise CheckpointError(f"checkpoint {path} has no {rng.name} (written by an older sparsetrain?)")
    set_rng_state(safe_load(rng, "random state"))


def remove_partial(root: Path) -> list[str]:
    """Delete leftovers of an interrupted checkpoint write or rotation; return their names."""
    if not root.is_dir():
        return []
    removed = []
    for p in sorted(root.iterdir()):
        partial = _STEP_DIR.match(p.name) and not ((p / STATE_FILE).is_file() and (p / META_FILE).is_file())
        if p.is_dir() and (partial or _LEFTOVER.match(p.name)):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    if removed:
        fsync_path(root)
    return removed


def set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint to ``.damaged_step_X`` (kept for inspection, no longer listed or resumed)."""
    target = path.with_name(f".damaged_{path.name}")
    if target.exists():
        shutil.rmtree(target, ignore_errors=True)
    os.replace(path, target)
    return target
