"""KernelOptions: the few choices a user may make about the GPU kernels, typed and resolved once.

A run sets them from its config (``trainer.kernels.*``) at setup with :func:`set_kernel_options`; a script or
a test scopes a change with :func:`use_kernel_options`. Kernels read :func:`kernel_options` when they pick a
path. Defaults are the measured best (docs/benchmarks/); nothing here is read from the environment.

>>> with use_kernel_options(dense_fallback=False):
...     kernel_options().dense_fallback
False
>>> kernel_options().dense_fallback
True
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace

SPMM_BACKENDS = ("auto", "triton")


@dataclass(frozen=True)
class KernelOptions:
    """What a user may choose about the kernels (see each field); invalid values raise naming the field."""

    #: Time the hand-written CUDA kernels beside the Triton ones (needs ``nvcc``; off skips the JIT build).
    cuda_kernels: bool = True
    #: Let the per-shape tuner pick cuBLAS on the dense weight where the block kernels are not faster.
    dense_fallback: bool = True
    #: The dense fallback is picked only when its GPU time is below ``dense_margin`` x the best block kernel's
    #: (the tuner times GPU work only); 1.0 takes the plain fastest. In (0, 1].
    dense_margin: float = 0.85
    #: A feed-forward block whose two linears are block-sparse keeps only GELU's input for the backward and
    #: computes GELU again there (sparsetrain.nn.mlp): ~2.4-3 GB less at BERT-base and ViT-B for 1-2% of the step
    #: (H200, docs/benchmarks/e2e.md). Off: GELU is an op of its own between the two linears, its output kept.
    gelu_recompute: bool = True
    #: Launch compiled Triton kernels directly, skipping Triton's dispatcher when nothing it decides changed.
    fast_launch: bool = True
    #: Inference SpMM: ``auto`` uses the CUDA kernels where built, ``triton`` always the Triton kernel.
    spmm_backend: str = "auto"
    #: Keep the block-sparse tuner's per-shape choices on disk (``$SPARSETRAIN_CACHE/tuning``) and reuse them in
    #: later processes on the same GPU, software and kernel sources; off: every process times every shape.
    tuning_cache: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{f.name}: must be true or false, got {value!r}")
        m = self.dense_margin
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 1:
            raise ValueError(f"dense_margin: must be a number in (0, 1], got {m!r}")
        if self.spmm_backend not in SPMM_BACKENDS:
            raise ValueError(f"spmm_backend: must be one of {list(SPMM_BACKENDS)}, got {self.spmm_backend!r}")


_CURRENT = [KernelOptions()]
#: The options in force, as a one-element list: a per-launch check reads ``IN_FORCE[0]`` (a list read, where
#: :func:`kernel_options` is a Python call). Replaced, never changed in place, so an identity check tells
#: whether they changed.
IN_FORCE = _CURRENT


def kernel_options() -> KernelOptions:
    """The options in force."""
    return _CURRENT[0]


def set_kernel_options(options: KernelOptions | None = None, **changes) -> KernelOptions:
    """Put ``options`` (default: the current ones) with ``changes`` applied in force; return the previous."""
    previous = _CURRENT[0]
    base = previous if options is None else options
    if not isinstance(base, KernelOptions):
        raise TypeError(f"options must be a KernelOptions, got {type(base).__name__}")
    _CURRENT[0] = replace(base, **changes) if changes else base
    return previous


@contextmanager
def use_kernel_options(**changes) -> Iterator[KernelOptions]:
    """Apply ``changes`` inside a ``with`` block (tests, benchmarks), then restore the previous options."""
    previous = set_kernel_options(**changes)
    try:
        yield kernel_options()
    finally:
        _CURRENT[0] = previous
