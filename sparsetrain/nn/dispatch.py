"""Per-shape kernel planning for a whole model: each storage format that picks kernels by layer shape (today
``2:4``: cuSPARSELt or masked dense) times them once, before training.

>>> records = plan_dispatch(model, tokens=batch_size * seq_len)  # doctest: +SKIP
"""
from __future__ import annotations

from torch import nn

from sparsetrain.kernels._runtime.device import release_cublas_workspaces
from sparsetrain.nn.formats.base import WeightFormat
from sparsetrain.nn.sparse_linear import SparseLinear


def plan_dispatch(model: nn.Module, tokens: int) -> list[dict]:
    """Run :meth:`WeightFormat.plan_kernels` of every format in ``model`` on its layers, with ``tokens`` rows
    of layer input per step; return the records (one per planned layer, for the run log), ``[]`` when no
    layer's format plans. The timing's cuBLAS workspaces are freed after it (none is the step's)."""
    groups: dict[type[WeightFormat], dict[str, SparseLinear]] = {}
    for name, module in model.named_modules():
        if isinstance(module, SparseLinear):
            groups.setdefault(type(module.storage), {})[name] = module
    records = [record for fmt, layers in groups.items() for record in fmt.plan_kernels(layers, tokens)]
    if records:
        release_cublas_workspaces()
    return records
