"""Model surgery for inference: :func:`to_inference` swaps pruned ``nn.Linear`` layers for
:class:`~sparsetrain.inference.linear.SparseInferenceLinear`, :func:`to_dense_linears` swaps them back.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from sparsetrain.inference.linear import SparseInferenceLinear, weight_sparsity


@dataclass(frozen=True)
class LayerSwap:
    """One ``nn.Linear`` that :func:`to_inference` replaced."""

    name: str
    shape: tuple[int, int]
    sparsity: float
    compressed: bool   # False: kept dense inside SparseInferenceLinear (below break-even)
    dense_bytes: int
    stored_bytes: int


def set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Replaces the submodule at the qualified ``name`` of ``model`` with ``module``."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _selected(name: str, targets: Sequence[str] | None) -> bool:
    return targets is None or any(fnmatch.fnmatchcase(name, pattern) for pattern in targets)


def to_inference(model: nn.Module, min_sparsity: float = 0.5, targets: Sequence[str] | None = None,
                 block_m: int = 128, mode: str = "auto", fmt: str = "auto") -> tuple[nn.Module, list[LayerSwap]]:
    """Swaps (in place) every ``nn.Linear`` with weight sparsity >= ``min_sparsity`` (and whose qualified name
    matches one of the ``targets`` globs, if given) for a :class:`SparseInferenceLinear`; ``mode`` as in
    :meth:`SparseInferenceLinear.from_linear` ("auto" keeps dense weights below the measured break-even),
    ``fmt`` the compressed format ("auto": per layer, the one with fewer bytes).

    Returns the model and one :class:`LayerSwap` per swapped layer.
    Example: ``model, swaps = to_inference(model, targets=["*.mlp.*"], mode="compressed")``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(targets, str):
        raise TypeError("targets must be a sequence of glob strings, not one string")
    swaps = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not _selected(name, targets):
            continue
        sparsity = weight_sparsity(module.weight)
        if sparsity < min_sparsity:
            continue
        layer = SparseInferenceLinear.from_linear(module, min_sparsity, block_m, mode, fmt)
        set_module(model, name, layer)
        stored = (layer.compressed_weight().nbytes() if layer.is_compressed
                  else layer.dense_weight.numel() * layer.dense_weight.element_size())
        swaps.append(LayerSwap(name, tuple(module.weight.shape), sparsity, layer.is_compressed,
                               module.weight.numel() * module.weight.element_size(), stored))
    return model, swaps


def to_dense_linears(model: nn.Module) -> nn.Module:
    """Inverse of :func:`to_inference` (in place): every SparseInferenceLinear back to ``nn.Linear``."""
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseInferenceLinear):
            set_module(model, name, module.to_linear())
    return model
