"""Stopping a run cleanly: a non-finite loss or gradient norm, or SIGTERM / SIGINT.

Cost of the NaN check: each step folds ``isfinite(loss)`` (and of the gradient norm) into a flag that stays
on the device, with no host sync. The flag is read (one ``.item()``, all-reduced across processes) only at
steps that synchronise anyway: log, eval, checkpoint and mask-update steps and the last step. A ``.item()``
on every step would make the host wait for the GPU every step. So a NaN stops the run at most
``trainer.log_every`` steps after it appeared, always before a mask update runs on the weights and before a
checkpoint is written: the good checkpoints stay and the error names the first non-finite step. A mask update
that runs on the device (the graphed prune-and-regrow update, one process) reads the flag there instead: on a
non-finite flag it moves nothing, and its ``metrics.jsonl`` row waits for the next read (dropped if it was gated
off), so such an update step does not synchronise.

Signals only set a flag. One process stops after the step in progress; several processes agree at the next
sync point (all must stop at the same step to write one checkpoint). A second signal of the same kind falls
back to the default handler (a second Ctrl-C kills). Exit codes follow the shell's 128 + signal number
(SIGTERM 143, SIGINT 130); a non-finite loss exits 1.
"""
from __future__ import annotations

import signal
import threading

import torch

from sparsetrain.nn.formats.base import whole
from sparsetrain.training.resume import RunDirError

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_NO_STEP = 2**62  # "no non-finite step yet", so that a max-reduction across processes yields the first one


class RunStopped(RunDirError):
    """The run stopped before ``max_steps``; ``exit_code`` is what the command should exit with. The message
    is one line saying why and how to continue."""

    exit_code = 1


class NonFiniteLoss(RunStopped):
    exit_code = 1


class WriteFailed(RunStopped):
    """A checkpoint could not be written (a full disk, say); the ones before it are intact."""

    exit_code = 1


class Interrupted(RunStopped):
    def __init__(self, message: str, signum: int) -> None:
        super().__init__(message)
        self.signum = int(signum)
        self.exit_code = 128 + self.signum


def mask_update_due(scheduler, step: int) -> bool:
    """Whether ``scheduler.step(step)`` may change masks (the guard checks the weights are finite first)."""
    if not scheduler.sparse or getattr(scheduler, "static_topology", False):
        return False
    return bool(scheduler.is_update_step(step))  # SparsityScheduler.is_update_step: False unless it says so


class Guard:
    """``observe`` every step (device only), ``poll`` at sync points, ``signal`` for a pending stop request."""

    def __init__(self, device: torch.device, processes: int, start_step: int) -> None:
        self.processes = processes
        self._count = torch.full((), start_step, dtype=torch.long, device=device)
        self._first_bad = torch.full((), -_NO_STEP, dtype=torch.long, device=device)  # -(first bad step)
        self.signal: int | None = None
        self._previous: dict[int, object] = {}
        self._held: list[dict] = []

    # -- signals --------------------------------------------------------------------------------------
    def __enter__(self) -> Guard:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signal = signum
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))

    # -- non-finite values ----------------------------------------------------------------------------
    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None) -> None:
        """Fold one optimizer step's loss (and gradient norm) into the device flag; no host sync."""
        self._count += 1
        ok = torch.isfinite(loss.detach()).all()
        if grad_norm is not None and torch.is_tensor(grad_norm):
            ok = ok & torch.isfinite(whole(grad_norm.detach()).to(ok.device)).all()   # FSDP2: a DTensor
        first = (self._first_bad == -_NO_STEP) & ~ok
        # in place: a CUDA graph that captured this step replays into the same tensors
        self._first_bad.copy_(torch.where(first, -self._count, self._first_bad))

    def all_finite(self) -> torch.Tensor:
        """0-d bool on the device: no non-finite loss or gradient norm so far (what a mask update that runs on the
        device gates itself on, where the loop does not read the flag before it)."""
        return self._first_bad == -_NO_STEP

    def hold(self, row: dict) -> None:
        """Keep the row of a mask update gated on :meth:`all_finite` until the flag is read (:meth:`release`)."""
        self._held.append(row)

    def release(self, first_bad: int | None) -> list[dict]:
        """The held rows of updates that ran: those of steps before ``first_bad`` (all where None); the others
        changed nothing (their gate was false) and are dropped."""
        rows, self._held = self._held, []
        return [r for r in rows if first_bad is None or r["step"] < first_bad]

    def poll(self) -> tuple[int | None, int | None]:
        """Read the flags (a sync; a collective when there are several processes, so every process must call
        it at the same steps). Returns (first non-finite step or None, signal every process acts on or None)."""
        flags = torch.stack([self._first_bad, torch.tensor(self.signal or 0, device=self._first_bad.device)])
        if self.processes > 1:
            import torch.distributed as dist

            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        first_bad, sig = (int(v) for v in flags.tolist())
        return (None if first_bad == -_NO_STEP else -first_bad), (sig or None)
