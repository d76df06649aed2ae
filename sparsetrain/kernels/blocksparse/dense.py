"""The dense fallback backend: scatter the active blocks into a dense ``W`` and call cuBLAS (forward, input
gradient), or compute the dense ``dYᵀ·X`` and gather the active blocks (weight gradient).

The tuner times it beside the block kernels, so a layer whose blocks are small and dense (16x16 at 50%, where
the kernels run at about a third of dense speed) runs near dense speed instead. It is a *fallback*: chosen only
when it beats the best block kernel by ``KernelOptions.dense_margin``, and offered only while
``KernelOptions.dense_fallback`` is on. Parameters and optimizer state stay compressed; only the step's
transient buffers are dense. A three-piece product (``Product.parts``) runs as three GEMMs, one per piece (the
input gradient accumulates into one output), so no piece is copied.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from sparsetrain.kernels._runtime.options import kernel_options
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.reference import dense_to_values, values_to_dense
from sparsetrain.kernels.blocksparse.tuner import Backend, Product, interpreting


class DenseConfig(NamedTuple):
    """The dense fallback as a tile candidate of every product (it has no tiles of its own)."""


class DdsPlan:
    """The dense fallback for the forward / input gradient (called like the kernel plans)."""

    __slots__ = ("meta", "forward", "has_bias", "out_width", "parts")
    stable = True   # reads the index tensors at every call: follows BlockSparseMeta.rewrite_

    def __init__(self, meta: BlockSparseMeta, forward: bool, has_bias: bool, parts: int = 0):
        self.meta, self.forward, self.has_bias, self.parts = meta, forward, has_bias, parts
        self.out_width = (meta.grid[0] if forward else meta.grid[1]) * meta.block

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor, aux: Tensor | None = None,
                 out2: Tensor | None = None, *pieces: Tensor) -> None:
        w = values_to_dense(values.to(a.dtype), self.meta)
        if self.parts:
            self._in_parts(w, a, bias, out, pieces)
        elif not self.forward:
            torch.mm(a, w, out=out)
        elif self.has_bias:
            torch.addmm(bias.to(a.dtype), a, w.t(), out=out)
        else:
            torch.mm(a, w.t(), out=out)

    def _in_parts(self, w: Tensor, a: Tensor, bias: Tensor, out: Tensor, pieces) -> None:
        """pieces = (a1, a2, out1, out2): forward ``out_p = a · W_pᵀ (+ b_p)``; input gradient
        ``out = Σ_p a_p · W_p`` (W_p: the rows of piece p)."""
        rows = w.shape[0] // self.parts
        if self.forward:
            for p, o in enumerate((out, *pieces[2:4])):
                wp = w[p * rows:(p + 1) * rows].t()
                if self.has_bias:
                    torch.addmm(bias[p * rows:(p + 1) * rows].to(a.dtype), a, wp, out=o)
                else:
                    torch.mm(a, wp, out=o)
            return
        torch.mm(a, w[:rows], out=out)
        for p, ap in enumerate(pieces[:2], start=1):
            out.addmm_(ap, w[p * rows:(p + 1) * rows])


class DwPlan:
    """The dense fallback for the weight gradient: ``dYᵀ·X`` by cuBLAS (float32 output where the active blocks
    are float32 and this torch has ``mm(out_dtype=)``), then a gather of the active blocks."""

    __slots__ = ("meta", "with_bias", "atomic", "f32_out")
    stable = True

    def __init__(self, x: Tensor, meta: BlockSparseMeta, with_bias: bool):
        self.meta, self.with_bias, self.atomic = meta, with_bias, False
        try:
            probe = torch.zeros(8, 8, dtype=x.dtype, device=x.device)
            self.f32_out = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError):
            self.f32_out = False

    def __call__(self, x: Tensor, dy: Tensor, dv: Tensor, db: Tensor, *more_dy: Tensor) -> None:
        dys = (dy, *more_dy)   # dY in pieces (a three-piece product): one GEMM each
        if dv.dtype == torch.float32 and self.f32_out and x.dtype != torch.float32:
            gs = [torch.mm(d.t(), x, out_dtype=torch.float32) for d in dys]
        else:
            gs = [torch.mm(d.t(), x) for d in dys]
        dv.copy_(dense_to_values(gs[0] if len(gs) == 1 else torch.cat(gs), self.meta))
        if self.with_bias:
            width = dy.shape[1]
            for p, d in enumerate(dys):
                torch.sum(d, 0, dtype=torch.float32, out=db[p * width:(p + 1) * width])


def _candidates(p: Product) -> list[DenseConfig]:
    return [DenseConfig()] if p.a.is_cuda and not interpreting() and kernel_options().dense_fallback else []


def _make_plan(cfg: DenseConfig, p: Product) -> DdsPlan | DwPlan:
    if p.kind == "dw":
        return DwPlan(p.a, p.meta, p.bias)
    return DdsPlan(p.meta, p.forward, p.bias, p.parts)


BACKEND = Backend("dense", (DenseConfig,), _candidates, _make_plan, fallback=True)
