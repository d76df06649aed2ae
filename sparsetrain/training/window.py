"""One logging window of the training loop: what a train row of metrics.jsonl reports about the steps since the
last one.

A step adds its loss on the device (:meth:`Window.add`: no host sync); the window is read once, when its row is
written (:meth:`Window.close`: one ``.item()`` of the loss averaged over processes). A checkpoint stores the host
sums and the device sum as they are (:meth:`Window.state`), so that a resumed run adds the same float32 values in
the same order as an uninterrupted one.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def _new_sums() -> dict[str, float]:
    return {"loss": 0.0, "steps": 0, "items": 0, "time": 0.0}


class Window:
    """Running sums (``steps``, ``items`` of all processes, host ``time``) and the device loss of one window;
    ``track_memory``: the CUDA allocator's peaks go into the row (``peak_mem_gb`` since the loop started,
    ``reserved_gb`` of this window)."""

    def __init__(self, device: torch.device, track_memory: bool) -> None:
        self.sums = _new_sums()
        self.loss = torch.zeros((), device=device)
        self.track_memory = track_memory
        self.peak_mem = 0.0   # GiB since the loop started: the statistics are reset after each window's row

    def restore(self, sums: dict, loss: torch.Tensor | None) -> None:
        """Continue a checkpoint's window (``state``'s two values)."""
        self.sums = sums
        if torch.is_tensor(loss):
            self.loss = loss.to(self.loss.device)

    def state(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> tuple[dict, torch.Tensor]:
        """The host sums and the device loss (``reduce``: averaged over processes) for a checkpoint."""
        return dict(self.sums), reduce(self.loss.clone()).cpu()

    @property
    def steps(self) -> int:
        return self.sums["steps"]

    def add(self, loss: torch.Tensor, items: int) -> None:
        """One step: its loss (a device tensor) and the items (tokens or samples) all processes read."""
        self.loss += loss                                   # summed on device: no sync per step
        self.sums["steps"] += 1
        self.sums["items"] += items

    def add_time(self, seconds: float) -> None:
        self.sums["time"] += seconds

    def start_loop(self) -> None:
        if self.track_memory:
            torch.cuda.reset_peak_memory_stats()

    def close(self, reduce: Callable[[torch.Tensor], torch.Tensor]) -> tuple[float, float, dict, float]:
        """Read the window: ``(mean loss, items per second, memory fields, wait)``, ``wait`` the seconds the host
        waited for the GPU work it had queued ahead (counted in the window's time and the run's)."""
        t_sync = time.perf_counter()
        self.sums["loss"] += float(reduce(self.loss.clone()).item())
        wait = time.perf_counter() - t_sync
        self.sums["time"] += wait
        self.loss.zero_()
        memory = {}
        if self.track_memory:
            self.peak_mem = max(self.peak_mem, torch.cuda.max_memory_allocated() / 2**30)   # since the reset
            # what the allocator held from the device in this window: with CUDA graphs the graphs' private pools,
            # which the allocated statistics stop counting after capture
            memory = {"peak_mem_gb": self.peak_mem, "reserved_gb": torch.cuda.max_memory_reserved() / 2**30}
        sums = self.sums
        return sums["loss"] / max(1, sums["steps"]), sums["items"] / max(sums["time"], 1e-9), memory, wait

    def reset(self, startup: bool) -> None:
        """A new window, after its row was logged; ``startup``: the closed window held tuning and compiling."""
        if self.track_memory:
            if startup:   # blocks freed by tuning and compiling go back to the device
                torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()      # the next row's reserved_gb: its window only
        self.sums = _new_sums()
