"""The dense fallback backend: scatter the active blocks into a dense ``W`` and call cuBLAS (forward, input
gradient), or compute the dense ``dYᵀ·X`` and gather the active blocks (weight gradient).

The tuner times it beside the block kernels, so a layer whose blocks are small and dense (16x16 at 50%, where
the kernels run at about a third of dense speed) runs near dense speed instead. It is a *fallback*: chosen only
when it beats the best block kernel by ``KernelOptions.dense_margin``, and offered only while
``KernelOptions.dense_fallback`` is on. Parameters and optimizer state stay compressed; only the step's
transient buffers are dense.
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

    __slots__ = ("meta", "forward", "has_bias", "out_width")
    stable = True   # reads the index tensors at every call: follows BlockSparseMeta.rewrite_

    def __init__(self, meta: BlockSparseMeta, forward: bool, has_bias: bool):
        self.meta, self.forward, self.has_bias = meta, forward, has_bias
        self.out_width = (meta.grid[0] if forward else meta.grid[1]) * meta.block

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor) -> None:
        w = values_to_dense(values.to(a.dtype), self.meta)
        if not self.forward:
            torch.mm(a, w, out=out)
        elif self.has_bias:
            torch.addmm(bias.to(a.dtype), a, w.t(), out=out)
        else:
            torch.mm(a, w.t(), out=out)


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

    def __call__(self, x: Tensor, dy: Tensor, dv: Tensor, db: Tensor) -> None:
        if dv.dtype == torch.float32 and self.f32_out and x.dtype != torch.float32:
            g = torch.mm(dy.t(), x, out_dtype=torch.float32)
        else:
            g = torch.mm(dy.t(), x)
        dv.copy_(dense_to_values(g, self.meta))
        if self.with_bias:
            torch.sum(dy, 0, dtype=torch.float32, out=db)


def _candidates(p: Product) -> list[DenseConfig]:
    return [DenseConfig()] if p.a.is_cuda and not interpreting() and kernel_options().dense_fallback else []


def _make_plan(cfg: DenseConfig, p: Product) -> DdsPlan | DwPlan:
    if p.kind == "dw":
        return DwPlan(p.a, p.meta, p.bias)
    return DdsPlan(p.meta, p.forward, p.bias)


BACKEND = Backend("dense", (DenseConfig,), _candidates, _make_plan, fallback=True)
