"""Epilogues of the dense x block-sparse products: elementwise work done on a product's output as it is stored
(in the kernel, or as one pass of its own after it).

Two, for a feed-forward block ``Linear -> GELU -> Linear`` that keeps only GELU's input for the backward
(:mod:`sparsetrain.kernels.blocksparse.gelu`), GELU being the exact (erf) one:

- :data:`GELU` (the first linear's forward): ``out = x·Wᵀ + b`` (GELU's input, kept for the backward) and
  ``out2 = gelu(out)`` (the second linear's input);
- :data:`DGELU` (the second linear's input gradient): with ``aux`` = GELU's input, ``out = (dY·W) * gelu'(aux)``
  (the gradient of GELU's input) and ``out2 = gelu(aux)`` (GELU's output again, for the second linear's weight
  gradient: recomputed instead of kept).

Both work on the product rounded to its 16-bit dtype, in float32, as the unfused ops do. ``aux`` and ``out2`` are
laid out as ``out``. The CUDA and Triton gather kernels can run them in their output store; a plan of another
backend, or one whose own epilogue times slower, is wrapped in :class:`EpiloguePlan` (the product, then one
elementwise pass).
"""
from __future__ import annotations

import torch
from torch import Tensor

NONE, GELU, DGELU = 0, 1, 2
NAMES = {NONE: "none", GELU: "gelu", DGELU: "dgelu"}
_PASS_BLOCK = 1024


def reference(out: Tensor, aux: Tensor | None, epi: int) -> tuple[Tensor, Tensor]:
    """The epilogue in plain torch, on a finished product ``out``: ``(out, out2)`` (new tensors)."""
    if epi == GELU:
        return out, torch.nn.functional.gelu(out.float()).to(out.dtype)
    if epi == DGELU:
        p = aux.float()
        return (torch.ops.aten.gelu_backward(out.float(), p).to(out.dtype),
                torch.nn.functional.gelu(p).to(out.dtype))
    raise ValueError(f"unknown epilogue {epi!r}")


def apply(out: Tensor, aux: Tensor | None, out2: Tensor, epi: int) -> None:
    """The epilogue as a pass of its own over a finished product ``out`` (in place; writes ``out2``): the Triton
    kernel where kernels run (CUDA, the interpreter), plain torch otherwise."""
    from sparsetrain.kernels.blocksparse.tuner import interpreting

    if out.numel() == 0:
        return
    if (out.is_cuda or interpreting()) and out.is_contiguous() and out2.is_contiguous() and (
            epi != DGELU or aux.is_contiguous()):
        from sparsetrain.kernels.blocksparse._triton import gelu_epilogue_kernel

        n = out.numel()
        gelu_epilogue_kernel[(_cdiv(n, _PASS_BLOCK),)](out, aux if epi == DGELU else out, out2, n, EPI=epi,
                                                              BLOCK=_PASS_BLOCK)
        return
    o, o2 = reference(out, aux, epi)
    out.copy_(o)
    out2.copy_(o2)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class EpiloguePlan:
    """A dense x block-sparse plan without an epilogue of its own, and :func:`apply` after it: called like the
    plans with one, ``plan(a, values, bias, out, aux, out2)``."""

    __slots__ = ("inner", "epi")
    native_epilogue = False

    def __init__(self, inner, epi: int):
        self.inner, self.epi = inner, epi

    @property
    def stable(self) -> bool:
        return getattr(self.inner, "stable", False)

    @property
    def out_width(self) -> int:
        return self.inner.out_width

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor, aux: Tensor | None,
                 out2: Tensor) -> None:
        self.inner(a, values, bias, out)
        apply(out, aux, out2, self.epi)
