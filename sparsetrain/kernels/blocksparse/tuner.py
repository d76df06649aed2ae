"""Backends and the per-shape choice among their tile candidates.

A :class:`Backend` is one way to compute the products of a block-sparse linear layer — ``fwd`` (``X·Wᵀ``),
``dx`` (``dY·W``) and ``dw`` (``dYᵀ·X`` at the active blocks): the CUDA kernels, the Triton TMA kernels, the
Triton gather kernels, the dense cuBLAS fallback. For a :class:`Product` it offers tile configurations
(``candidates``) and builds the launch plan of one (``make_plan``). The tuner lists the candidates of every
registered backend in registration order, times each once per shape key on the GPU and keeps the fastest;
where nothing is timed (the Triton interpreter, CUDA-graph capture, :func:`~.testing.untuned`) the first
candidate is the choice; where a topology was built by gradual pruning's shrink
(``BlockSparseMeta.estimate_plans``) the choice comes from the same product's timings at another density
(:func:`_estimate`). Choices timed on a GPU are also kept on disk (``KernelOptions.tuning_cache``,
:mod:`sparsetrain.kernels._runtime.tuning_cache`), so a later process on the same GPU, software and kernel
sources reuses them instead of timing again; under the test hooks nothing is read or written there. Adding a
backend is a config type, two functions and one call::

    class MyConfig(NamedTuple):
        tile: int

    register_backend(Backend("mine", (MyConfig,), candidates=my_candidates, make_plan=my_plan), before="gather")

A plan for ``fwd``/``dx`` is called ``plan(a, values, bias_or_a, out)`` and has ``out_width`` (the output's
columns); one for ``dw`` is called ``plan(x, dy, dvalues, dbias_or_dvalues)`` and has ``atomic`` (True: the
outputs are zero-filled float32 and the plan adds partial sums into them). A plan for a product with
``parts`` (a three-piece layer) takes the other pieces after those: ``plan(a, values, bias, out, aux, out2,
a1, a2, out1, out2)`` (fwd and dx; ``aux``/``out2`` unused) and ``plan(x, dy, dvalues, dbias, dy1, dy2)``. A plan must not keep the tensors
of the call that built it: it lives as long as the topology.
"""
from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from sparsetrain.kernels._runtime import tuning_cache
from sparsetrain.kernels._runtime.options import IN_FORCE, kernel_options
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.testing import HOOKS, poison_outputs

KINDS = ("fwd", "dx", "dw")


@dataclass(frozen=True, eq=False)
class Product:
    """One product to plan: its kind, the topology and the operands of the call being planned (read for their
    shapes, strides, dtypes and device only)."""

    kind: str  # "fwd", "dx" or "dw"
    meta: BlockSparseMeta
    a: Tensor  # fwd and dw: X [T, I]; dx: dY [T, O] (the dense operand, unit column stride)
    b: Tensor  # fwd and dx: values [n_blocks, B, B]; dw: dY [T, O]
    bias: bool  # fwd: a bias is added; dw: the bias gradient is fused; dx: always False
    epi: int = 0  # fwd and dx: the epilogue (sparsetrain.kernels.blocksparse.epilogue), 0 for none
    #: 3: the layer's output is three tensors of equal width (plans.PARTS): fwd writes them, dx and dw read dY as
    #: three pieces (``a``, resp. ``b``, is the first); 0: one tensor. A backend that cannot offers no candidate.
    parts: int = 0

    @property
    def forward(self) -> bool:
        return self.kind == "fwd"

    @property
    def k(self) -> int:
        """fwd and dx: the reduction width (the dense operand's columns, every piece counted)."""
        return self.a.shape[1] * (self.parts if self.parts and self.kind == "dx" else 1)

    @property
    def block(self) -> int:
        return self.meta.block


@dataclass(frozen=True)
class Backend:
    """A way to compute the products: see the module docstring."""

    name: str
    #: The config classes whose plans this backend builds (a config's type names its backend).
    config_types: tuple[type, ...]
    #: ``candidates(product) -> [config, ...]``: the tiles that can run this product here (often none).
    candidates: Callable[[Product], Sequence]
    #: ``make_plan(config, product) -> plan``.
    make_plan: Callable[[object, Product], Callable]
    #: A fallback (dense cuBLAS) is chosen only when it beats the best block kernel by
    #: ``KernelOptions.dense_margin``: the tuner times GPU time, and a fallback costs more host work per call.
    fallback: bool = False


_BACKENDS: list[Backend] = []
_BY_CONFIG: dict[type, Backend] = {}
_GENERATION = [0]  # bumped by every registry change: cached choices and plans then no longer match


def register_backend(backend: Backend, *, before: str | None = None) -> None:
    """Offer ``backend``'s candidates to the tuner, after the registered ones or before the one named
    ``before``; one of the same name is replaced. Choices made so far are forgotten."""
    unregister_backend(backend.name)
    names = [b.name for b in _BACKENDS]
    if before is not None and before not in names:
        raise KeyError(f"no backend {before!r}; registered: {names}")
    _BACKENDS.insert(len(names) if before is None else names.index(before), backend)
    for t in backend.config_types:
        _BY_CONFIG[t] = backend
    _forget()


def unregister_backend(name: str) -> None:
    """Remove the backend called ``name`` (if registered); choices made so far are forgotten."""
    for b in [b for b in _BACKENDS if b.name == name]:
        _BACKENDS.remove(b)
        for t in b.config_types:
            _BY_CONFIG.pop(t, None)
        _forget()


def backends() -> tuple[Backend, ...]:
    """The registered backends, in the order their candidates are listed."""
    return tuple(_BACKENDS)


def backend_of(config) -> Backend:
    """The backend that builds plans for ``config``."""
    try:
        return _BY_CONFIG[type(config)]
    except KeyError:
        raise TypeError(f"no registered backend takes {type(config).__name__} configs") from None


def candidates(p: Product) -> list:
    """Every registered backend's candidates for ``p``, in registration order."""
    return [c for b in _BACKENDS for c in b.candidates(p)]


def config_key(config) -> tuple:
    """What tells configs apart: they are tuples, and two backends' could be equal."""
    return type(config), config


def make_plan(config, p: Product):
    return backend_of(config).make_plan(config, p)


def _forget() -> None:
    _GENERATION[0] += 1
    _TUNED.clear()
    _TIMED.clear()
    _ESTIMATED.clear()


def interpreting() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (``TRITON_INTERPRET=1``): nothing is timed then."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def density_bucket(meta: BlockSparseMeta) -> int:
    # half-octave buckets: 1.0 -> 0, 0.5 -> 2, 0.25 -> 4, 0.1 -> 7
    return min(16, round(-2 * math.log2(max(meta.density, 1e-6))))


def option_key() -> tuple:
    """What decides a choice besides shapes and dtypes: the options that change the candidates or the pick,
    and the registry. Part of every kept choice's key."""
    o = kernel_options()
    return o.cuda_kernels, o.dense_fallback, o.dense_margin, _GENERATION[0]


def state() -> tuple:
    """Everything that steers a choice or a plan besides the call itself: the options object, the registry
    generation and the test hooks (the forced configs copied). Comparing a kept state with the current one needs
    no Python call while nothing changed (tuple equality tries identity first), so a caller that keeps plans
    compares ``(IN_FORCE[0], GENERATION[0], HOOKS.tune, HOOKS.forced, HOOKS.timer, HOOKS.poison)`` with it,
    inline."""
    h = HOOKS
    return IN_FORCE[0], _GENERATION[0], h.tune, dict(h.forced), h.timer, h.poison


#: The registry generation as a one-element list (read by :func:`state`'s inline users).
GENERATION = _GENERATION
_STEERING: list = [None, None]  # [the state it was computed in, the steering tuple]


def steering() -> tuple:
    """:func:`option_key` and the test hooks: part of every cached plan's key (a forced or untimed choice
    must not be served a plan cached under another). Computed again only when :func:`state` changed."""
    h, kept = HOOKS, _STEERING
    if (IN_FORCE[0], _GENERATION[0], h.tune, h.forced, h.timer) != kept[0]:
        kept[1] = (*option_key(), h.tune, tuple(h.forced.items()) if h.forced else (), h.timer)
        kept[0] = state()[:5]
    return kept[1]


_TUNED: dict[tuple, object] = {}
_TIMED: dict[tuple, list[tuple[object, float]]] = {}  # the timings behind each choice (benchmark reports)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _do_bench(config, launch: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(launch, warmup=5, rep=20, return_mode="median")


#: The kernel sources a kept choice depends on: their hash is part of the choice file's name.
_SOURCES = (Path(__file__).resolve().parent, Path(tuning_cache.__file__).resolve().parent)
_FILES: dict[int, tuning_cache.ChoiceFile] = {}  # device index -> its choice file, opened at its first pick


def _choice_file(device: torch.device) -> tuning_cache.ChoiceFile | None:
    """Where ``device``'s choices are kept across processes, or None with ``KernelOptions.tuning_cache`` off."""
    if not kernel_options().tuning_cache:
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _FILES:
        _FILES[index] = tuning_cache.choice_file("blocksparse", torch.device("cuda", index), _SOURCES)
    return _FILES[index]


def _disk_key(kind: str, key: tuple) -> str | None:
    """A choice's key in the file: :func:`option_key` with the backends' names in place of the registry
    generation (a count of this process's registry changes)."""
    o = kernel_options()
    names = [b.name for b in _BACKENDS]
    return tuning_cache.stable_key((kind, *key, o.cuda_kernels, o.dense_fallback, float(o.dense_margin), names))


def _config_types() -> dict[type, str]:
    return {t: b.name for t, b in _BY_CONFIG.items()}


def pick(kind: str, key: tuple, device: torch.device, cands: Sequence, launch: Callable[[object], object],
         estimate: bool = False):
    """The config for product ``kind`` at shape ``key``: forced, else (timed once per key and kept, in this
    process and on disk) the fastest of ``cands``; ``launch(config)`` must run the whole product. Where nothing
    can be timed, ``cands[0]``. ``estimate``: where the key is not on disk but the same product was timed at
    another density, nothing is timed (:func:`_estimate`)."""
    forced = HOOKS.forced.get(kind)
    if forced is not None:
        return forced
    timer = HOOKS.timer
    if timer is None and (interpreting() or device.type != "cuda"):
        return cands[0]
    full = (kind, *key, *option_key())
    if full in _TUNED:
        return _TUNED[full]
    if not HOOKS.tune or len(cands) == 1 or _capturing(device):
        return cands[0]
    kept = _choice_file(device) if timer is None else None  # a test's timer neither reads nor writes the disk
    disk_key = _disk_key(kind, key) if kept is not None else None
    if disk_key:
        hit = kept.lookup(disk_key, _config_types())
        # only a config offered here (a candidate may depend on what the key does not say, e.g. nvcc present)
        if hit is not None and any(config_key(c) == config_key(hit[0]) for c in cands):
            _TUNED[full], _TIMED[full] = hit
            return hit[0]
    if estimate and (guess := _estimate(kind, key, cands)) is not None:
        return guess
    timed = time_candidates(kind, key, cands, launch, timer or _do_bench, check=timer is None)
    if not timed:
        raise RuntimeError(f"no {kind} kernel configuration could run for {key}")
    best = choose(timed)
    _TUNED[full], _TIMED[full] = best, timed
    if disk_key:
        kept.store(disk_key, best, timed, _config_types())
    return best


#: Where the density bucket sits in a product's key (plans.py: block, tokens, the two widths, the bucket, ...).
BUCKET = 4
_ESTIMATED: set[tuple] = set()   # kept choices that were estimated, not timed


def _estimate(kind: str, key: tuple, cands: Sequence):
    """The choice for ``key`` from the timings of the same product at the nearest density timed in this process
    (or read from disk): each block kernel's time scaled by the ratio of the densities (its work is the active
    blocks), the dense fallback's kept, then :func:`choose`. None where no such timing exists. Gradual pruning's
    new counts are planned this way inside training, which then times nothing (the estimate is not written to
    disk)."""
    tail, n, near = option_key(), len(key), None
    for full, timed in _TIMED.items():
        k = full[1:1 + n]
        if (full in _ESTIMATED or full[0] != kind or full[1 + n:] != tail or len(k) != n
                or k[:BUCKET] != key[:BUCKET] or k[BUCKET + 1:] != key[BUCKET + 1:]):
            continue
        if near is None or abs(k[BUCKET] - key[BUCKET]) < abs(near[0] - key[BUCKET]):
            near = k[BUCKET], timed
    if near is None:
        return None
    offered, scale = {config_key(c) for c in cands}, 2.0 ** ((near[0] - key[BUCKET]) / 2)
    timed = [(c, ms if backend_of(c).fallback else ms * scale) for c, ms in near[1] if config_key(c) in offered]
    if not timed:
        return None
    full = (kind, *key, *tail)
    _TUNED[full], _TIMED[full] = choose(timed), timed
    _ESTIMATED.add(full)
    return _TUNED[full]


def estimated_count() -> int:
    """How many kept choices were estimated from another density's timings rather than timed."""
    return len(_ESTIMATED)


#: Largest relative difference (Frobenius) between a candidate's result and the first candidate's that still
#: counts as the same product: kernels differ in summation order and in where they round to 16 bits.
AGREE_REL = 5e-2


def time_candidates(kind: str, key: tuple, cands: Sequence, launch: Callable[[object], object],
                    timer: Callable[[object, Callable[[], object]], float], check: bool = True) -> list:
    """``[(config, ms), ...]`` of the candidates that ran. With ``check`` each candidate's result (its outputs
    NaN-filled before the launch) is first set against that of the first one that ran, and one that disagrees (beyond :data:`AGREE_REL`) is not timed, so it
    can never be chosen, and is named in a warning: timing alone cannot tell a fast wrong kernel from a fast
    right one."""
    timed, reference = [], None
    for cfg in cands:
        try:
            if check:
                with poison_outputs():   # outputs NaN-filled first: an element a candidate fails to write shows
                    result = _outputs(launch(cfg))
                if reference is None:   # a copy: the forward and dX reuse one output buffer across candidates
                    reference = (cfg, [None if t is None else t.detach().clone() for t in result])
                elif (err := _disagreement(result, reference[1])) > AGREE_REL:
                    import warnings

                    warnings.warn(f"sparsetrain: the {kind} candidate {cfg!r} disagrees with {reference[0]!r} at "
                                  f"{key} (relative difference {err:.3g}); it is left out", stacklevel=3)
                    continue
            timed.append((cfg, timer(cfg, lambda c=cfg: launch(c))))
        except Exception:  # noqa: BLE001, S112 - e.g. out of shared memory for this tile: try the next
            continue
    return timed


def _outputs(result) -> list:
    """A launch's result as a list of its output tensors (None where one was not asked for)."""
    return list(result) if isinstance(result, tuple) else [result]


#: Elements compared at a time: the float32 work of a comparison stays ~50 MB whatever the output's size (the
#: first step tunes while its activations are held; whole float32 copies of a 50,432 x 3,072 output were 1.9 GB).
_CHUNK = 1 << 22


def _disagreement(a: list, b: list) -> float:
    """The largest relative difference ``|x - y| / |y|`` (Frobenius norms, float32) over the pairs of tensors,
    computed in chunks; inf where ``x`` holds a NaN (an element the candidate did not write) or an inf."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            continue
        xf, yf = x.detach().reshape(-1), y.detach().reshape(-1)
        diff_sq = torch.zeros((), dtype=torch.float32, device=y.device)
        ref_sq = torch.zeros((), dtype=torch.float32, device=y.device)
        for i in range(0, yf.numel(), _CHUNK):
            yc = yf[i:i + _CHUNK].float()
            diff_sq += (xf[i:i + _CHUNK].float() - yc).square().sum()
            ref_sq += yc.square().sum()
        diff, scale = float(diff_sq.sqrt()), float(ref_sq.sqrt()) or 1.0
        worst = max(worst, diff / scale if math.isfinite(diff) else math.inf)
    return worst


def choose(timed: Sequence[tuple[object, float]], margin: float | None = None):
    """The fastest of ``(config, ms)``; a fallback backend's config only if it beats the best block kernel by
    ``margin`` (default ``KernelOptions.dense_margin``)."""
    margin = kernel_options().dense_margin if margin is None else margin
    kernels = [(ms, i) for i, (cfg, ms) in enumerate(timed) if not backend_of(cfg).fallback]
    dense = [(ms, i) for i, (cfg, ms) in enumerate(timed) if backend_of(cfg).fallback]
    if not kernels:
        return timed[min(dense)[1]][0]
    best_ms, best_i = min(kernels)
    if dense and min(dense)[0] < margin * best_ms:
        return timed[min(dense)[1]][0]
    return timed[best_i][0]


def choice_counts() -> dict[str, int]:
    """How many tuned products (a product kind at one shape) each backend runs, timed in this process or read from
    disk, ``{backend name: count}``: e.g. how many went to the dense fallback (cuBLAS)."""
    return dict(Counter(backend_of(cfg).name for cfg in _TUNED.values()))


def tuned_configs() -> dict[str, str]:
    """The choices made so far, timed in this process or read from disk, ``{key: config}`` (for benchmark
    reports)."""
    return {repr(k): repr(v) for k, v in _TUNED.items()}


def dense_fallback_report(tuned: dict | None = None, timed: dict | None = None) -> list[dict]:
    """Per tuned product: the best block kernel's and the dense fallback's GPU time and which was chosen (for
    benchmark reports; ``tuned``/``timed`` default to the tuner's own records)."""
    tuned, timed = _TUNED if tuned is None else tuned, _TIMED if timed is None else timed
    rows = []
    for key, times in timed.items():
        if key in _ESTIMATED:
            continue
        dense = [ms for cfg, ms in times if backend_of(cfg).fallback]
        kernels = [ms for cfg, ms in times if not backend_of(cfg).fallback]
        if dense and kernels:
            rows.append({"key": repr(key), "kernel_ms": min(kernels), "dense_ms": min(dense),
                         "chosen": "dense" if backend_of(tuned[key]).fallback else "kernel"})
    return rows
