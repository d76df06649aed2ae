"""Swap ``nn.Linear`` layers of any model (BERT, ViT, any transformers model) for SparseLinear, and back.

>>> from transformers import BertConfig, BertForMaskedLM
>>> model = BertForMaskedLM(BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
...                                    intermediate_size=128, vocab_size=100))
>>> layers = sparsify(model, targets=["*.intermediate.dense"], density=0.25, block=16)
>>> list(layers)
['bert.encoder.layer.0.intermediate.dense']
"""
from __future__ import annotations

import fnmatch
import zlib
from collections.abc import Sequence

import torch
from torch import nn

from sparsetrain.nn.formats.base import WeightFormat, resolve_format
from sparsetrain.nn.sparse_linear import SparseLinear
from sparsetrain.sparsity.distributions import layer_densities
from sparsetrain.sparsity.layout import Block, BlockLike, check_density, grid_shape

#: Layers that stay dense unless named explicitly: embeddings, the MLM head / classifier, poolers.
#: (Norms and biases are never sparsified: only nn.Linear weights are.)
DEFAULT_EXCLUDE = ("*embeddings*", "*cls.predictions*", "*lm_head*", "*classifier*", "*pooler*")


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def select_linears(model: nn.Module, targets: Sequence[str] = ("*",),
                   exclude: Sequence[str] = DEFAULT_EXCLUDE) -> dict[str, nn.Linear]:
    """The ``nn.Linear`` modules whose fully-qualified names match a target glob and no exclude glob."""
    if isinstance(targets, str) or isinstance(exclude, str):
        raise TypeError("targets and exclude must be lists of globs, not a single string")
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    chosen = {n: m for n, m in linears.items() if _matches(n, targets) and not _matches(n, exclude)}
    for pattern in targets:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in linears):
            raise ValueError(f"targets entry {pattern!r} matches no nn.Linear layer in {type(model).__name__} "
                             f"(examples of layer names: {list(linears)[:4]})")
    if not chosen:
        raise ValueError(f"targets {list(targets)} with exclude {list(exclude)} select no layer of "
                         f"{type(model).__name__}")
    return chosen


def sparsify(
    model: nn.Module,
    targets: Sequence[str] = ("*",),
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    *,
    density: float | dict[str, float] = 1.0,
    distribution: str = "uniform",
    density_overrides: dict[str, float] | None = None,
    block: BlockLike = 1,
    format: str | type[WeightFormat] | WeightFormat = "masked",
    init: str = "random",
    seed: int = 0,
) -> dict[str, SparseLinear]:
    """Replace the selected linears in place; return ``{name: SparseLinear}``.

    ``density`` is a global target spread by ``distribution`` (uniform / er / erk) with
    ``density_overrides`` ({glob: density}), or an explicit ``{name: density}``. Initial masks are random
    (seeded per layer from ``seed`` and the layer name, so identical on every rank) or by magnitude.
    ``format`` is a registered name, the dotted path of a WeightFormat subclass, the class or an instance.
    """
    block = Block.parse(block)
    if not isinstance(format, WeightFormat):
        format = resolve_format(format)  # a bad name fails before any layer is swapped
    chosen = select_linears(model, targets, exclude)
    for name, lin in chosen.items():
        try:
            grid_shape(lin.weight.shape, block)
        except ValueError as e:
            raise ValueError(f"block {block} does not divide layer {name} {tuple(lin.weight.shape)}") from e
    shapes = {n: tuple(m.weight.shape) for n, m in chosen.items()}
    if isinstance(density, dict):
        densities = {n: check_density(density.get(n, 1.0), f"density[{n!r}]") for n in chosen}
    else:
        densities = layer_densities(shapes, check_density(density), distribution, density_overrides)
    out = {}
    for name, lin in chosen.items():
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        layer = SparseLinear.from_dense(lin, density=densities[name], block=block, format=format,
                                        generator=gen, init=init)
        model.set_submodule(name, layer)
        out[name] = layer
    return out


def densify(model: nn.Module) -> nn.Module:
    """Replace every SparseLinear by an ``nn.Linear`` carrying its weight with zeros. In place; returns model."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, SparseLinear):
            model.set_submodule(name, mod.to_dense())
    return model
