"""The GPU's SM clock and power while a benchmark run keeps it busy, read through NVML on a thread of the bench's own.

Two runs of the same kernels can differ by the clock alone: an H200 at its 700 W cap held 1,650-1,725 MHz in the 2:4
phase's step against 1,755-1,860 in dense's (2026-11-29), the whole 4-5% between them. ``bench e2e`` says so under
its table. Samples are kept while the GPU is busy (NVML's utilisation >= ``busy``%), so compiling and idle gaps
do not count. Without NVML (the ``nvidia-ml-py`` package, ``import pynvml``) nothing is sampled.
"""
from __future__ import annotations

import threading

SW_POWER_CAP = 0x4   # NVML's clocks event (throttle) reason: the software power cap (nvmlClocksThrottleReasonSwPowerCap)


def nvml_handle(uuid: str | None = None):
    """NVML's handle of the GPU with this CUDA ``uuid`` (default: CUDA device 0 of this process), or None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if uuid is None:
            import torch

            uuid = str(torch.cuda.get_device_properties(0).uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
    except Exception:  # noqa: BLE001 - no NVML, no GPU, another driver: the bench runs without clocks
        return None


def _reasons(nvml, handle) -> int:
    get = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    return int(get(handle))


class ClockSampler:
    """``with ClockSampler(handle) as clock: <run>``, then ``clock.summary()``: the busy samples' mean SM clock (MHz)
    and power (W), and the share of them under the software power cap. ``handle`` None: a sampler that samples
    nothing (``summary()`` is None)."""

    def __init__(self, handle, period: float = 0.1, busy: int = 90) -> None:
        self.handle, self.period, self.busy = handle, period, busy
        self.samples: list[tuple[float, float, bool]] = []   # (MHz, W, power-capped)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """One reading, kept if the GPU was busy."""
        import pynvml as nvml

        h = self.handle
        if nvml.nvmlDeviceGetUtilizationRates(h).gpu < self.busy:
            return
        self.samples.append((float(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)),
                             nvml.nvmlDeviceGetPowerUsage(h) / 1e3, bool(_reasons(nvml, h) & SW_POWER_CAP)))

    def _loop(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a failed reading is a missing sample, never a failed run
                continue

    def __enter__(self) -> ClockSampler:
        if self.handle is not None:
            self._thread = threading.Thread(target=self._loop, name="gpu-clock", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def summary(self) -> dict | None:
        if not self.samples:
            return None
        n = len(self.samples)
        return {"clock_mhz": sum(s[0] for s in self.samples) / n, "power_w": sum(s[1] for s in self.samples) / n,
                "power_capped": sum(s[2] for s in self.samples) / n, "clock_samples": n}


def clock_lines(runs: list[dict], baseline: str, tolerance: float = 0.02) -> list[str]:
    """Under the table: each run's busy clock, power and power-capped share; a run whose clock differs from its
    round's ``baseline`` run's by more than ``tolerance`` is marked, its ratio holds the clock too."""
    runs = [r for r in runs if r.get("clock_mhz")]
    if not runs:
        return []
    base = {(r.get("round", 1), r["mode"]): r["clock_mhz"] for r in runs if r["variant"] == baseline}
    parts = []
    for r in runs:
        rnd = f" r{r['round']}" if r.get("round", 1) > 1 else ""
        ref = base.get((r.get("round", 1), r["mode"]))
        mark = (f" ({r['clock_mhz'] / ref - 1:+.1%} against {baseline})"
                if ref and abs(r["clock_mhz"] / ref - 1) > tolerance else "")
        parts.append(f"{r['variant']} {r['mode']}{rnd} {r['clock_mhz']:,.0f} MHz, {r['power_w']:.0f} W, "
                     f"{r['power_capped']:.0%} capped{mark}")
    return ["GPU clock while busy (NVML, every 0.1 s; 'capped': samples under the software power cap): "
            + "; ".join(parts)]
