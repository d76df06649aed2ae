"""Child processes that never outlive the bench that started them.

A bench run is a ``sparsetrain train`` process, and that process starts its own (data-loader workers,
torch.compile's compile workers). When the bench is stopped (``timeout``, a batch scheduler's SIGTERM, Ctrl-C)
or a run passes ``--timeout``, every one of them has to go: one left behind keeps training on the GPU and
silently slows every run measured after it. So each child starts a process group of its own, and
:func:`run_child` ends the whole group when the run times out, when the bench receives SIGTERM, SIGINT or
SIGHUP (then :class:`Stopped` is raised, after the group is gone), and after a normal exit (stragglers).

Ending a group is SIGTERM first (the trainer's stop guard ends at a step boundary), then SIGKILL after
:data:`GRACE_S` seconds. Only SIGKILL of the bench itself cannot be handled; its children then run to their end.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

GRACE_S = 10.0  # seconds a child group gets between SIGTERM and SIGKILL
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class Stopped(Exception):
    """The bench received a stop signal while a child ran; the child's process group has been ended."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def end_group(proc: subprocess.Popen, grace: float = GRACE_S) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL to what is left of it after ``grace`` seconds; reaps ``proc``.
    Nothing is sent when the group has no live process left."""
    deadline = time.monotonic() + grace
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None and not group_alive(proc.pid):
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        while sig == signal.SIGTERM and time.monotonic() < deadline:
            if proc.poll() is not None and not group_alive(proc.pid):
                break
            time.sleep(0.05)
    proc.wait()


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` is still running (zombies, which hold nothing, do not count)."""
    proc_fs = Path("/proc")
    if not (proc_fs / "self" / "stat").is_file():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc_fs.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        if fields[2] == str(pgid) and fields[0] not in "ZX":  # fields after the name: state, ppid, pgrp, ...
            return True
    return False


def run_child(cmd: Sequence[str], stdout: IO, timeout: float | None = None, env: dict | None = None,
              grace: float = GRACE_S) -> int | None:
    """Run ``cmd`` in a new process group with its output (stdout and stderr) in ``stdout``; its exit code, or
    None when it ran past ``timeout`` seconds (its group has then been ended). A stop signal to this process
    ends the child's group and raises :class:`Stopped`; the previous signal handlers are restored either way."""
    stop: list[int] = []
    ending = False

    def on_signal(signum, _frame):
        stop.append(signum)
        if not ending:  # a second signal while the group is being ended must not interrupt that
            raise Stopped(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # handlers can only be set there
        previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    proc = None
    rc = None
    try:
        proc = subprocess.Popen(list(cmd), stdout=stdout, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        rc = proc.wait(timeout=timeout)
    except (subprocess.TimeoutExpired, Stopped):
        rc = None
    finally:
        ending = True
        if proc is not None:
            end_group(proc, grace)  # after a normal exit this only sweeps up what the child left behind
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop:
        raise Stopped(stop[0])
    return rc
