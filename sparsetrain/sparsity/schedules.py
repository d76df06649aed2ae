"""When masks change and by how much: pure, typed, frozen schedule objects.

Steps are *optimizer* steps (one per gradient-accumulation cycle), counted from 0.

>>> s = UpdateSchedule(start=0, end=1000, interval=100)
>>> [t for t in range(1001) if s.is_update_step(t)][:3]
[100, 200, 300]
>>> CosineDecay(init=0.5, end_step=1000)(0), round(CosineDecay(init=0.5, end_step=1000)(500), 3)
(0.5, 0.25)
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class UpdateSchedule:
    """Update the pattern every ``interval`` steps in ``(start, end)``: steps start+interval, ... < end.

    ``UpdateSchedule.from_num_updates(n, start, end)`` spaces ``n`` updates evenly (Graphcore: 160).
    """

    start: int = 0
    end: int = 1
    interval: int = 1
    max_updates: int | None = None

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"update interval must be >= 1, got {self.interval}")
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"update window must satisfy 0 <= start <= end, got start={self.start}, end={self.end}")

    @classmethod
    def from_num_updates(cls, num_updates: int, start: int, end: int) -> UpdateSchedule:
        if num_updates < 1:
            raise ValueError(f"num_updates must be >= 1, got {num_updates}")
        span = end - start
        if span < num_updates + 1:
            raise ValueError(f"num_updates={num_updates} does not fit in steps [{start}, {end}) "
                             f"(need at least {num_updates + 1} steps)")
        return cls(start=start, end=end, interval=max(1, span // (num_updates + 1)), max_updates=num_updates)

    def is_update_step(self, step: int) -> bool:
        k, r = divmod(step - self.start, self.interval)
        return self.start < step < self.end and r == 0 and (self.max_updates is None or k <= self.max_updates)

    def num_updates(self) -> int:
        n = max(0, (self.end - 1 - self.start) // self.interval)
        return n if self.max_updates is None else min(n, self.max_updates)


def _progress(step: int, start: int, end: int) -> float:
    """Fraction of the way from ``start`` to ``end``, clipped to [0, 1]."""
    span = max(1, end - start)
    return min(max(step - start, 0), span) / span


@dataclass(frozen=True)
class Constant:
    """Drop fraction that never changes."""

    value: float = 0.3

    def __call__(self, step: int) -> float:
        return self.value


@dataclass(frozen=True)
class CosineDecay:
    """``init`` decayed to ``final`` along half a cosine between ``start_step`` and ``end_step`` (RigL/Graphcore)."""

    init: float = 0.5
    end_step: int = 1
    final: float = 0.0
    start_step: int = 0

    def __call__(self, step: int) -> float:
        t = _progress(step, self.start_step, self.end_step)
        return self.final + 0.5 * (self.init - self.final) * (1 + math.cos(math.pi * t))


@dataclass(frozen=True)
class LinearDecay:
    """``init`` decayed linearly to ``final`` between ``start_step`` and ``end_step``."""

    init: float = 0.5
    end_step: int = 1
    final: float = 0.0
    start_step: int = 0

    def __call__(self, step: int) -> float:
        return self.init + (self.final - self.init) * _progress(step, self.start_step, self.end_step)


DROP_SCHEDULES = {"constant": Constant, "cosine": CosineDecay, "linear": LinearDecay}


def make_drop_schedule(kind: str, init: float, end_step: int, start_step: int = 0, final: float = 0.0):
    """Build a drop-fraction schedule by name: ``constant``, ``cosine`` or ``linear``."""
    if not 0.0 <= init <= 1.0:
        raise ValueError(f"drop_fraction must be in [0, 1], got {init}")
    if kind == "constant":
        return Constant(init)
    if kind in DROP_SCHEDULES:
        return DROP_SCHEDULES[kind](init=init, end_step=end_step, final=final, start_step=start_step)
    raise ValueError(f"unknown drop_schedule {kind!r}; choose one of {sorted(DROP_SCHEDULES)}")


@dataclass(frozen=True)
class CubicDensity:
    """Zhu & Gupta (2017) gradual pruning: density goes from ``initial`` to ``final`` as
    ``s_t = s_f + (s_i - s_f)(1 - (t - t0)/(n Δt))³`` in sparsity, between ``start`` and ``end``."""

    initial: float = 1.0
    final: float = 0.1
    start: int = 0
    end: int = 1

    def __call__(self, step: int) -> float:
        if step <= self.start:
            return self.initial
        if step >= self.end:
            return self.final
        frac = (step - self.start) / max(1, self.end - self.start)
        s_i, s_f = 1.0 - self.initial, 1.0 - self.final
        return 1.0 - (s_f + (s_i - s_f) * (1.0 - frac) ** 3)
