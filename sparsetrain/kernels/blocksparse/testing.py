"""Hooks for tests and benchmarks: pin tile choices, skip timing, NaN-fill kernel outputs, replace the timer.

Each is a context manager that restores the previous state on exit; the tuner and the launch drivers read
:data:`HOOKS`. Nothing here changes what a kernel computes.

>>> from sparsetrain.kernels.blocksparse.gather import DdsConfig
>>> with forced_config(fwd=DdsConfig(16, 1, 1, 4, 1)), poison_outputs():
...     HOOKS.poison
True
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field


@dataclass
class Hooks:
    #: ``{"fwd" | "dx" | "dw": config}``: tile choices that bypass the tuner.
    forced: dict = field(default_factory=dict)
    #: False: take the first candidate instead of timing them (quick correctness runs).
    tune: bool = True
    #: Fill kernel outputs with NaN before the launch, so an element a kernel failed to write shows.
    poison: bool = False
    #: ``timer(config, launch) -> ms`` used instead of ``triton.testing.do_bench``; also times on a CPU.
    timer: Callable[[object, Callable[[], object]], float] | None = None


HOOKS = Hooks()


@contextmanager
def _set(**changes) -> Iterator[None]:
    old = {k: getattr(HOOKS, k) for k in changes}
    for k, v in changes.items():
        setattr(HOOKS, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(HOOKS, k, v)


def forced_config(**configs) -> AbstractContextManager[None]:
    """Pin tile choices, e.g. ``forced_config(fwd=DdsConfig(...), dx=..., dw=DwConfig(...))``: every candidate
    must be correct, since tuning may pick any of them."""
    return _set(forced={**HOOKS.forced, **configs})


def untuned() -> AbstractContextManager[None]:
    """Take each product's first candidate instead of timing them all (the first is a tuned default)."""
    return _set(tune=False)


def poison_outputs(on: bool = True) -> AbstractContextManager[None]:
    """Fill kernel outputs with NaN before each launch (a test of full coverage, not of speed)."""
    return _set(poison=on)


def use_timer(timer: Callable[[object, Callable[[], object]], float]) -> AbstractContextManager[None]:
    """Time candidates with ``timer(config, launch)`` (any device): lets a CPU test drive the tuner's choice."""
    return _set(timer=timer)
