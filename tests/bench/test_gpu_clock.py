"""The GPU clock under ``bench e2e``'s table: NVML read on a thread, busy samples only (a fake NVML on the CPU)."""
import sys
import time
import types

import pytest

from sparsetrain.bench import _gpu_clock as gc


@pytest.fixture
def fake_nvml(monkeypatch):
    """A pynvml whose readings come from ``state`` (util %, MHz, mW, reasons), as NVML's would."""
    state = {"util": 100, "mhz": 1800, "mw": 690_000, "reasons": gc.SW_POWER_CAP, "uuids": []}
    nvml = types.SimpleNamespace(
        NVML_CLOCK_SM=1,
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: state["uuids"].append(uuid) or "h",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=state["util"]),
        nvmlDeviceGetClockInfo=lambda h, kind: state["mhz"] if kind == 1 else 0,
        nvmlDeviceGetPowerUsage=lambda h: state["mw"],
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: state["reasons"],
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return state


def test_busy_samples_give_the_clock_power_and_capped_share(fake_nvml):
    assert gc.nvml_handle("c55c3c8c") == "h" and fake_nvml["uuids"] == ["GPU-c55c3c8c"]
    clock = gc.ClockSampler("h")
    clock.sample()                                       # busy, capped
    fake_nvml.update(mhz=1980, mw=300_000, reasons=0)
    clock.sample()                                       # busy, not capped
    fake_nvml.update(util=5, mhz=345)
    clock.sample()                                       # idle (compiling): not kept
    assert clock.summary() == {"clock_mhz": 1890.0, "power_w": 495.0, "power_capped": 0.5, "clock_samples": 2}
    assert gc.ClockSampler("h").summary() is None        # nothing busy, nothing to say


def test_the_thread_samples_while_a_run_is_active_and_stops(fake_nvml):
    with gc.ClockSampler("h", period=0.01) as clock:
        time.sleep(0.2)
    n = len(clock.samples)
    assert n >= 3 and not clock._thread.is_alive()
    time.sleep(0.05)
    assert len(clock.samples) == n                       # stopped with the run
    with gc.ClockSampler(None) as none:                  # no NVML: no thread, no samples
        time.sleep(0.02)
    assert none._thread is None and none.summary() is None


def test_no_nvml_means_no_handle(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)     # import pynvml raises ImportError
    assert gc.nvml_handle("x") is None


def test_a_clock_that_differs_from_the_baselines_is_marked():
    runs = [{"variant": "dense", "mode": "compiled", "round": 1, "clock_mhz": 1800.0, "power_w": 690.0,
             "power_capped": 0.9},
            {"variant": "semi24", "mode": "compiled", "round": 1, "clock_mhz": 1700.0, "power_w": 695.0,
             "power_capped": 1.0},
            {"variant": "static_b64", "mode": "compiled", "round": 1, "clock_mhz": 1790.0, "power_w": 550.0,
             "power_capped": 0.0},
            {"variant": "failed", "mode": "compiled", "error": "boom"}]
    (line,) = gc.clock_lines(runs, "dense")
    assert "semi24 compiled 1,700 MHz, 695 W, 100% capped (-5.6% against dense)" in line
    assert "static_b64 compiled 1,790 MHz, 550 W, 0% capped;" not in line and "0% capped" in line
    assert "(-0.6%" not in line and "failed" not in line
    assert gc.clock_lines([{"variant": "dense", "mode": "eager"}], "dense") == []
