"""GPU timing helpers shared by the benchmarks: median wall time, GPU busy time, CUDA-graph replay time, CUDA-event
means and a per-kernel profile. All in milliseconds; every function needs a CUDA device."""
from __future__ import annotations

import traceback
from collections.abc import Callable

import torch


def bench(fn: Callable[[], object], grad_to_none=None, warmup: int = 25, rep: int = 100) -> float:
    """Median wall time of one call of ``fn`` (``triton.testing.do_bench``: CUDA events, L2 flushed between
    calls)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def gpu_time(fn: Callable[[], object], iters: int = 20) -> float:
    """GPU busy time of one call of ``fn``: the summed durations of every kernel, memset and copy it launches
    (torch.profiler), averaged over ``iters`` calls. Unlike :func:`bench` it leaves out the gaps where the GPU
    waits for the host, so a host-bound call shows what its kernels cost."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
    return us / iters / 1e3


def graph_time(fn: Callable[[], object]) -> float | None:
    """Wall time of one replay of ``fn`` captured in a CUDA graph: what a call costs once the host work of
    launching it is gone (CUDA graphs, ``torch.compile(mode="reduce-overhead")``). None if it cannot be captured.
    Its autograd leaves must be fresh (first used here): older ones keep the default stream of their gradient
    nodes, which a capture on another stream cannot depend on."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return bench(graph.replay)
    except Exception:  # noqa: BLE001 - reported as missing, the eager numbers still stand
        traceback.print_exc()
        return None


def cuda_ms(fn: Callable[[], object], n: int) -> tuple[float, object]:
    """(mean time per call of ``fn`` over ``n`` back-to-back calls, timed with CUDA events; the last result)."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    last = None
    for _ in range(n):
        last = fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n, last


def kernel_profile(fn: Callable[[], object], label: str, say: Callable[[str], None] = print) -> dict[str, float]:
    """GPU time per kernel name per call of ``fn`` (over 2 calls, torch.profiler); says the total and the top
    kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    attr = "self_device_time_total" if hasattr(ka[0], "self_device_time_total") else "self_cuda_time_total"
    per: dict[str, float] = {}
    for e in ka:
        per[e.key] = per.get(e.key, 0.0) + getattr(e, attr) / 2e3
    rows = sorted(ka, key=lambda e: getattr(e, attr), reverse=True)
    say(f"{label} profile: {sum(per.values()):.2f} ms of kernels per step; top kernels (ms/step):")
    for e in rows[:12]:
        say(f"    {getattr(e, attr) / 2e3:7.3f}  {e.count // 2:4d}x  {e.key[:90]}")
    return per
