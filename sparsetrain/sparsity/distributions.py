"""Per-layer densities that meet a global budget: uniform, Erdős–Rényi (ER) and ERK. Pure functions.

>>> shapes = {"a": (512, 512), "b": (2048, 512), "c": (10, 512)}
>>> d = erk(shapes, density=0.1)
>>> round(sum(d[n] * shapes[n][0] * shapes[n][1] for n in d) / sum(o * i for o, i in shapes.values()), 4)
0.1
"""
from __future__ import annotations

import fnmatch
import math

from sparsetrain.sparsity.layout import check_density

Shapes = dict[str, tuple[int, ...]]


def uniform(shapes: Shapes, density: float) -> dict[str, float]:
    """Every layer at the same density."""
    check_density(density)
    return {name: float(density) for name in shapes}


def _scaled(shapes: Shapes, density: float, raw: dict[str, float]) -> dict[str, float]:
    """RigL's solver: density_l = eps * raw_l, with layers whose density would pass 1 made dense and the
    remaining budget re-balanced over the other layers until no layer passes 1."""
    check_density(density)
    numel = {n: math.prod(s) for n, s in shapes.items()}
    total = sum(numel.values())
    dense: set[str] = set()
    while True:
        budget = density * total - sum(numel[n] for n in dense)
        free = [n for n in shapes if n not in dense]
        if not free:
            return {n: 1.0 for n in shapes}
        eps = budget / sum(raw[n] * numel[n] for n in free)
        over = [n for n in free if eps * raw[n] > 1.0]
        if not over:
            out = {n: 1.0 for n in dense}
            out.update({n: max(eps * raw[n], 0.0) for n in free})
            return out
        # make the layer with the largest raw density dense and solve again (RigL does one at a time)
        dense.add(max(over, key=lambda n: raw[n]))


def erdos_renyi(shapes: Shapes, density: float) -> dict[str, float]:
    """ER: density ∝ (n_in + n_out) / (n_in · n_out) for a 2-D weight."""
    raw = {n: (s[0] + s[1]) / (s[0] * s[1]) for n, s in shapes.items()}
    return _scaled(shapes, density, raw)


def erk(shapes: Shapes, density: float) -> dict[str, float]:
    """ERK: density ∝ sum(shape) / prod(shape) (equals ER for linear layers; kernels count for convs)."""
    raw = {n: sum(s) / math.prod(s) for n, s in shapes.items()}
    return _scaled(shapes, density, raw)


DISTRIBUTIONS = {"uniform": uniform, "er": erdos_renyi, "erk": erk}


def layer_densities(shapes: Shapes, density: float, distribution: str = "uniform",
                    overrides: dict[str, float] | None = None) -> dict[str, float]:
    """Densities per layer name. ``overrides`` maps name globs to fixed densities; those layers are taken
    out of the budget and the distribution spreads the rest so the global density still holds."""
    if distribution not in DISTRIBUTIONS:
        raise ValueError(f"unknown distribution {distribution!r}; choose one of {sorted(DISTRIBUTIONS)}")
    check_density(density)
    fixed: dict[str, float] = {}
    for pattern, d in (overrides or {}).items():
        check_density(d, f"density_overrides[{pattern!r}]")
        hits = [n for n in shapes if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"density_overrides key {pattern!r} matches no sparsified layer")
        for n in hits:
            fixed[n] = float(d)
    rest = {n: s for n, s in shapes.items() if n not in fixed}
    if not rest:
        return fixed
    total = sum(math.prod(s) for s in shapes.values())
    budget = density * total - sum(fixed[n] * math.prod(shapes[n]) for n in fixed)
    rest_total = sum(math.prod(s) for s in rest.values())
    rest_density = budget / rest_total
    if not 0.0 < rest_density <= 1.0:
        raise ValueError(f"density_overrides leave density {rest_density:.3f} for the other layers; "
                         f"the global density {density} cannot be met")
    out = DISTRIBUTIONS[distribution](rest, rest_density)
    out.update(fixed)
    return out
