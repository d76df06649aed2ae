"""One run per run directory: a run holds an exclusive lock on ``RUN_DIR/.sparsetrain.lock`` from before it
reads the directory until it ends, so that a second run started in the same directory (by mistake, or a sweep
pointed at one dir) is refused in one line instead of replacing the live run's metrics or checkpoints.

The lock is an ``flock`` on the file, which the kernel releases when the process ends, however it ends (kill -9
included): a crashed run never blocks the next one. The file names its holder (pid, host, start time); a run
that ends normally removes it, so a file found unlocked was left by a run that crashed, and the next run says
so and takes it over. Only the main process of a multi-process run takes the lock (the others share its
directory by design).
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from sparsetrain.training.resume import RunDirError

LOCK_FILE = ".sparsetrain.lock"


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _describe(holder: dict) -> str:
    if not holder:
        return "another run"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return f"another run (pid {holder.get('pid')} on {holder.get('host')}, started {started})"


class RunDirLock:
    """``with RunDirLock(run_dir):`` hold the run directory for one run; raises :class:`RunDirError` naming
    ``hydra.run.dir`` when another live run holds it. ``enabled=False`` (processes other than the main one)
    holds nothing."""

    def __init__(self, run_dir: Path, enabled: bool = True) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.enabled = enabled
        self._fd: int | None = None
        self.created_dir = False

    def __enter__(self) -> RunDirLock:
        if not self.enabled:
            return self
        try:
            import fcntl
        except ImportError:   # no flock on this platform: runs are not protected from each other
            return self
        run_dir = self.path.parent
        self.created_dir = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        while True:
            left = self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirError(f"hydra.run.dir: {run_dir} is in use by {_describe(_holder(self.path))}; wait "
                                  f"for it to end, or choose another hydra.run.dir") from None
            try:   # the holder before us may have removed the file between our open and our lock: take the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        if left and (holder := _holder(self.path)):
            print(f"note: {run_dir} was held by a run that did not end cleanly (pid {holder.get('pid')} on "
                  f"{holder.get('host')}); this run takes it over", flush=True)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        try:   # removed while still held: a waiting run then finds the file gone and opens a new one
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)   # releases the flock
            self._fd = None
        run_dir = self.path.parent
        if self.created_dir and not any(run_dir.iterdir()):
            run_dir.rmdir()   # a run refused before it wrote anything leaves no directory behind
