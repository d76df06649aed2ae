"""Durable, atomic file writes: the one mechanism behind every file the package writes (metrics, summaries,
checkpoints, the data cache).

A file is written to a temp file beside it, flushed to disk, renamed over the target and its folder flushed,
so a reader (a plot, the Pareto tool, a resumed run) never sees half a file, even after a kill mid-write.
The temp file is created with mode 0666 minus the umask (not ``tempfile.mkstemp``'s 0600, which the rename
would keep), so a written file gets the mode a plain ``open(path, "w")`` gives it: 0644 under umask 022.

>>> import tempfile; d = Path(tempfile.mkdtemp())
>>> atomic_write_text(d / "a.txt", "hello"); (d / "a.txt").read_text()
'hello'
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "atomic_write_text", "fsync_path"]


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's data or a folder's entries to disk (a no-op where a folder cannot be opened or fsynced)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory
    finally:
        os.close(fd)


def _temp_beside(path: Path) -> tuple[int, Path]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temp file next to {path}")


def atomic_write(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Replace ``path`` atomically and durably with what ``write(tmp_path)`` writes to a temp file beside it
    (e.g. ``lambda p: torch.save(obj, p)``). Concurrent writers: each file is whole, the last rename wins."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(path)
    os.close(fd)
    try:
        write(tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        if tmp.exists():
            tmp.unlink()
        raise
    fsync_path(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write` of a UTF-8 text."""
    atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))
