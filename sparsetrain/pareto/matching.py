"""`sparsetrain pareto --dense-steps`: the dense run lengths that match the sparse runs' FLOPs and GPU-seconds."""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from sparsetrain.pareto.runs import RunResult
from sparsetrain.pareto.tables import _block_size


# --------------------------------------------------------------------------------------------------
# The study's second stage: dense baselines at matched FLOPs and GPU-seconds
# --------------------------------------------------------------------------------------------------
def dense_steps(runs: Sequence[RunResult], tolerance: float = 0.05, max_factor: float = 2.0
                ) -> list[tuple[int, str]]:
    """Step counts of the dense runs still to run so that dense meets the sparse runs at equal cost:
    `(steps, why)` by increasing steps.

    Dense FLOPs and seconds per step come from the finished dense runs among `runs` (medians over them), the
    targets from the finished sparse ones: the median training FLOPs of each density, and the median GPU-seconds
    of each (density, block) group over its methods and seeds. A target within `tolerance` of a dense run that
    exists (or of a smaller target kept before it) is dropped; steps are capped at `max_factor` x the longest
    dense run. Raises ValueError when `runs` hold no finished dense or sparse run.

    Example:
        >>> dense_steps(collect_runs(["study"]))
        [(219, 'FLOPs of density 0.1 (6.7e+14)'), (316, 'FLOPs of density 0.25 (9.7e+14)'), ...]
    """
    done = [r for r in runs if r.status == "finished" and r.steps and r.total_train_flops]
    dense = [r for r in done if r.method == "dense"]   # not sparse-then-dense, which also ends at density 1
    sparse = [r for r in done if not r.dense]
    if not dense or not sparse:
        raise ValueError("runs: the dense steps need a finished dense run (the reference) and finished sparse "
                         f"runs; found {len(dense)} dense and {len(sparse)} sparse")
    flops_per_step = statistics.median(r.total_train_flops / r.steps for r in dense)
    timed = [r for r in dense if r.gpu_s]
    s_per_step = statistics.median(r.gpu_s / r.steps for r in timed) if timed else None
    targets: list[tuple[float, str]] = []
    for density in sorted({r.nominal_density for r in sparse}, reverse=True):
        flops = statistics.median(r.total_train_flops for r in sparse if r.nominal_density == density)
        targets.append((flops / flops_per_step, f"FLOPs of density {density:g} ({flops:.2g})"))
    if s_per_step:
        groups = sorted({(r.nominal_density, _block_size(r.block)) for r in sparse if r.gpu_s},
                        key=lambda g: (-g[0], g[1]))
        for density, size in groups:
            seconds = statistics.median(r.gpu_s for r in sparse if r.gpu_s and r.nominal_density == density
                                        and _block_size(r.block) == size)
            targets.append((seconds / s_per_step, f"GPU-seconds of {density:g} {size}x{size} ({seconds:.1f} s)"))
    longest = max(r.steps for r in dense)
    kept = sorted({r.steps for r in dense})
    chosen: list[tuple[int, str]] = []
    for raw, why in sorted(targets):
        steps = max(1, min(round(raw), round(max_factor * longest)))
        if all(abs(steps - k) > tolerance * k for k in kept):
            kept.append(steps)
            chosen.append((steps, why))
    return chosen
