"""Storage formats of a :class:`~sparsetrain.nn.SparseLinear` weight: the base class, its capabilities and
the registry.

A format is a small strategy object that owns *how* a layer stores and multiplies its weight; the layer
owns *which* blocks are active (its ``mask`` buffer, a bool block grid). Every format implements:

- ``setup(layer, weight, mask)``: register parameters/buffers on ``layer`` from a dense weight and mask;
- ``forward(layer, x)``: ``x @ W_effᵀ + bias`` where ``W_eff`` is zero outside the mask;
- ``dense_weight(layer)``: ``W_eff`` as a dense, detached ``(out, in)`` tensor;
- ``state_weight(layer)``: the dense tensor saved under ``weight`` in the state dict;
- ``load(layer, weight, mask)``: in-place inverse of ``state_weight`` (keeps Parameter identity, so an
  optimizer built before loading still points at the right tensors);
- ``set_mask(layer, new_mask, optimizer)``: rewrite the topology. Surviving weights and their optimizer
  moments are kept; newly active weights start at zero with zeroed moments; pruned weights are gone (or
  zero) in the weight *and* in the optimizer state, so momentum cannot revive them;
- ``weight_parameter(layer)``: the trainable Parameter holding the weight.

and says what it can do in ``caps`` (a :class:`FormatCaps`). A format that picks kernels per layer shape
overrides the classmethod :meth:`WeightFormat.plan_kernels`.

Dense-gradient capture (RigL): when ``layer.capture_dense_grad`` is True, the next backward passes
accumulate ``dL/dW_eff`` for *all* positions (active or not) into ``layer.dense_grad``.

A format is picked by its registered name (``sparsity.format=block``) or by the dotted path of a
:class:`WeightFormat` subclass (``sparsity.format=my_pkg.formats.MyFormat``); no edit to sparsetrain:

>>> from sparsetrain.nn.formats import MaskedFormat
>>> @register_format("my_masked")
... class MyMasked(MaskedFormat):
...     pass
>>> type(get_format("my_masked")).__name__
'MyMasked'
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch
from torch import Tensor, nn

from sparsetrain.sparsity.protocol import FormatCaps

__all__ = ["FORMATS", "FormatCaps", "WeightFormat", "get_format", "known_formats", "register_format",
           "is_sharded", "resolve_format", "swap_parameter", "whole", "write_whole", "zero_optimizer_state"]

#: Registered formats by name. Built-in: masked, masked_st, block, 2:4.
FORMATS: dict[str, type[WeightFormat]] = {}

_FormatT = TypeVar("_FormatT", bound="type[WeightFormat]")


class WeightFormat:
    """Base class of storage formats (see the module docstring for the contract)."""

    #: Registered name; an unregistered subclass is named by its dotted path (what :func:`get_format` takes).
    name: ClassVar[str] = "base"
    #: What the format can do; a format whose capabilities depend on its arguments overrides it per instance.
    caps: FormatCaps = FormatCaps()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:  # register_format replaces it by the short name
            cls.name = f"{cls.__module__}.{cls.__qualname__}"

    def setup(self, layer: nn.Module, weight: Tensor, mask: Tensor) -> None:
        raise NotImplementedError

    def forward(self, layer: nn.Module, x: Tensor) -> Tensor:
        raise NotImplementedError

    def dense_weight(self, layer: nn.Module) -> Tensor:
        raise NotImplementedError

    def state_weight(self, layer: nn.Module) -> Tensor:
        return self.dense_weight(layer)

    def load(self, layer: nn.Module, weight: Tensor, mask: Tensor) -> None:
        raise NotImplementedError

    def set_mask(self, layer: nn.Module, new_mask: Tensor, optimizer: torch.optim.Optimizer | None = None
                 ) -> None:
        raise NotImplementedError

    def weight_parameter(self, layer: nn.Module) -> nn.Parameter:
        raise NotImplementedError

    def active_in_parameter(self, layer: nn.Module) -> Tensor | None:
        """Where the weight Parameter holds active weights, as a bool tensor laid out like it; None: everywhere.
        Default: the Parameter is the dense ``(out, in)`` weight, active where the element mask is."""
        return layer.element_mask()

    def dense_layout(self, layer: nn.Module, t: Tensor) -> Tensor:
        """A tensor laid out like the weight Parameter (its optimizer moments, say) as the dense ``(out, in)`` tensor
        of the effective weight's positions, zero elsewhere. Default: it is laid out densely already."""
        return t

    def graph_update_key(self, layer: nn.Module) -> tuple | None:
        """None, or the identities of every tensor ``set_mask`` reads and writes where it can run inside a CUDA
        graph (no host sync, no new tensor kept): a graphed update replays while the key stays the same. Default:
        None (not graph-safe)."""
        return None

    def shrink(self, layer: nn.Module, new_mask: Tensor, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Keep the active blocks of ``new_mask`` (a subset of the mask). Default: :meth:`set_mask`."""
        self.set_mask(layer, new_mask, optimizer)

    def new_probe(self, layer: nn.Module) -> Tensor | None:
        """A leaf whose gradient becomes the dense weight gradient while ``layer.capture_dense_grad`` is on (no
        Python hook: a compiled or replayed step fills it), or None where the format fills ``dense_grad`` by a
        hook. Default: None."""
        return None

    def graph_batch_key(self, layer: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> tuple | None:
        """Layers with equal keys (not None) can take one :meth:`set_masks` call. Default: None (one by one)."""
        return None

    def set_masks(self, layers: list[nn.Module], new_masks: Tensor,
                  optimizer: torch.optim.Optimizer | None = None) -> None:
        """:meth:`set_mask` of each of ``layers`` to ``new_masks[i]``; a format may do them together."""
        for layer, mask in zip(layers, new_masks.unbind(0)):
            self.set_mask(layer, mask, optimizer)

    def current_mask(self, layer: nn.Module) -> Tensor:
        """The layer's mask as it is now: ``layer.mask`` (a format whose buffer can be shared scratch overrides)."""
        return layer.mask

    def n_active(self, layer: nn.Module) -> int:
        """Active blocks of the layer's mask (a format that keeps the count on the host answers without a sync)."""
        return int(self.current_mask(layer).sum().item())

    @classmethod
    def plan_kernels(cls, layers: dict[str, nn.Module], tokens: int) -> list[dict]:
        """Choose kernels for these layers (all of this format) at ``tokens`` rows per step; one record per
        layer for the run log. Default: nothing to plan."""
        return []

    def extra_repr(self) -> str:
        return self.name


def register_format(name: str) -> Callable[[_FormatT], _FormatT]:
    """Class decorator: make a :class:`WeightFormat` subclass available as ``format=name``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a format name must be a non-empty string, got {name!r}")

    def deco(cls: _FormatT) -> _FormatT:
        if not (isinstance(cls, type) and issubclass(cls, WeightFormat)):
            raise TypeError(f"register_format({name!r}) decorates a WeightFormat subclass, got {cls!r}")
        old = FORMATS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"format name {name!r} is already taken by {old.__module__}.{old.__qualname__}")
        cls.name = name
        FORMATS[name] = cls
        return cls
    return deco


def known_formats() -> list[str]:
    """Names of the registered formats, sorted."""
    return sorted(FORMATS)


def resolve_format(spec: str | type[WeightFormat]) -> type[WeightFormat]:
    """The format class a spec names: a registered name (``"block"``) or the dotted path of a
    :class:`WeightFormat` subclass (``"my_pkg.formats.MyFormat"``, imported here). Raises ValueError naming
    the known formats."""
    if isinstance(spec, type) and issubclass(spec, WeightFormat):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a sparsity format is a name or a dotted path, got {spec!r}")
    if spec in FORMATS:
        return FORMATS[spec]
    module_name, _, attr = spec.rpartition(".")
    hint = f"known formats: {known_formats()}, or the dotted path of a WeightFormat subclass"
    if not module_name:
        raise ValueError(f"unknown sparsity format {spec!r}; {hint}")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"unknown sparsity format {spec!r} (cannot import it: {e}); {hint}") from e
    if not (isinstance(cls, type) and issubclass(cls, WeightFormat)):
        raise ValueError(f"sparsity format {spec!r} is {cls!r}, not a WeightFormat subclass; {hint}")
    return cls


def get_format(spec: str | type[WeightFormat] | WeightFormat, **kwargs) -> WeightFormat:
    """A format instance: ``spec`` itself if it is one, else ``resolve_format(spec)(**kwargs)``."""
    if isinstance(spec, WeightFormat):
        return spec
    return resolve_format(spec)(**kwargs)


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (a Parameter or optimizer state sharded by FSDP2)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def whole(t: Tensor) -> Tensor:
    """``t`` as one whole tensor: itself, or a sharded DTensor (FSDP2) gathered from every rank. Gathering is a
    collective: every rank calls it for the same tensors in the same order."""
    return t.full_tensor() if is_sharded(t) else t


def write_whole(t: Tensor, value: Tensor) -> None:
    """``t.copy_(value)`` where ``value`` is the whole tensor; a sharded ``t`` keeps its own shard of ``value``
    (every rank holds the same ``value``: no communication)."""
    if not is_sharded(t):
        t.copy_(value)
        return
    from torch.distributed.tensor import distribute_tensor

    t.to_local().copy_(distribute_tensor(value, t.device_mesh, t.placements, src_data_rank=None).to_local())


def zero_optimizer_state(optimizer: torch.optim.Optimizer | None, param: Tensor, where: Tensor) -> None:
    """Zero every per-element optimizer state of ``param`` (Adam moments, SGD momentum...) at ``where``."""
    if optimizer is None:
        return
    state = optimizer.state.get(param)
    if not state:
        return
    for value in state.values():
        if torch.is_tensor(value) and value.shape == param.shape:
            value.masked_fill_(where.to(value.device), 0)


def swap_parameter(optimizer: torch.optim.Optimizer | None, old: Tensor, new: Tensor, convert) -> None:
    """Let ``optimizer`` train ``new`` where it trained ``old`` (same param group), with ``old``'s per-element state
    converted by ``convert`` and its other state (step counts) kept."""
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        group["params"] = [new if p is old else p for p in group["params"]]
    state = optimizer.state.pop(old, None)
    if state:
        optimizer.state[new] = {k: convert(v) if torch.is_tensor(v) and v.shape == old.shape else v
                                for k, v in state.items()}
