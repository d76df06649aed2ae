"""Whole state dicts of a model sharded by FSDP2 (``fully_shard``: Parameters and optimizer moments are DTensors
sharded over their first dimension), so that checkpoints are the same files on any number of processes.

* Saving gathers every sharded tensor on every rank (a collective, in the same order everywhere); a
  :class:`~sparsetrain.nn.SparseLinear` gathers its compressed values itself and saves its dense weight + mask.
* Loading gives each rank its own shard of the whole tensors (no communication: every rank reads the file).

Without sharded tensors every function is the plain ``state_dict`` / ``load_state_dict``.

>>> import torch
>>> model = torch.nn.Linear(2, 2)
>>> sorted(full_model_state(model))
['bias', 'weight']
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from sparsetrain.nn.formats.base import is_sharded, whole

__all__ = ["prepare_fsdp", "shard_tied_modules", "full_model_state", "full_optimizer_state", "load_full_model_state",
           "load_full_optimizer_state", "model_is_sharded", "whole"]


def model_is_sharded(model: nn.Module) -> bool:
    """Whether any Parameter of ``model`` is a DTensor (FSDP2)."""
    return any(is_sharded(p) for p in model.parameters())


def _shard_like(value: Tensor, like: Tensor) -> Tensor:
    """This rank's shard of the whole ``value``, placed as ``like`` (a DTensor) is."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)


def full_model_state(model: nn.Module) -> dict[str, Tensor]:
    """``model.state_dict()`` with every sharded tensor gathered whole, on the CPU. Every rank must call it."""
    return {k: whole(v.detach()).cpu() for k, v in model.state_dict().items()}


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every sharded moment gathered whole, on the CPU: the state dict one
    process would have. Every rank must call it."""
    state = optimizer.state_dict()
    gathered = {i: {k: whole(v).cpu() if torch.is_tensor(v) else v for k, v in s.items()}
                for i, s in state["state"].items()}
    return {**state, "state": gathered}


def load_full_model_state(model: nn.Module, state: dict[str, Tensor]) -> None:
    """``model.load_state_dict(state)`` for whole tensors: a sharded Parameter or buffer takes this rank's shard
    (a SparseLinear shards its values itself)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))   # a tied Parameter under each of its names
    tensors.update(model.named_buffers(remove_duplicate=False))
    model.load_state_dict({k: _shard_like(v, tensors[k]) if k in tensors and is_sharded(tensors[k]) else v
                           for k, v in state.items()})


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state)`` for whole tensors: the moments of a sharded Parameter become this
    rank's shard of them."""
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not is_sharded(p):
                continue
            s = optimizer.state.get(p, {})
            for k, v in s.items():
                if torch.is_tensor(v) and not is_sharded(v) and v.shape == p.shape:
                    s[k] = _shard_like(v, p)


def prepare_fsdp(accelerator, model: nn.Module) -> None:
    """Under accelerate's FSDP, before the optimizer is built: refuse a setup that the sparse layers cannot train
    under (ValueError naming the accelerate setting; nothing is written yet), then shard the modules that share
    Parameters as one group (:func:`shard_tied_modules`). Nothing happens without FSDP."""
    import os

    from accelerate.utils import DistributedType

    from sparsetrain.sparsity.protocol import sparse_layers

    state = accelerator.state
    if state.distributed_type != DistributedType.FSDP:
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":   # what `accelerate launch` sets
            raise ValueError(f"accelerate config distributed_type: FSDP runs on GPUs only; this run is on "
                             f"{accelerator.device.type}, where accelerate would train with DDP instead: drop "
                             f"FSDP from the accelerate config (or --use_fsdp) or run on GPUs")
        return
    plugin = state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ValueError("accelerate config fsdp_config.fsdp_version: 1 flattens each unit's parameters into one "
                         "FlatParameter, which the sparse layers' formats cannot address; use fsdp_version: 2 "
                         "(accelerate launch --fsdp_version 2)")
    if plugin.cpu_ram_efficient_loading:
        raise ValueError("accelerate config fsdp_config.fsdp_cpu_ram_efficient_loading: true reloads the model by "
                         "parameter name, which a SparseLinear's state dict (dense weight + mask) does not match; "
                         "set it to false (accelerate launch --fsdp_cpu_ram_efficient_loading false)")
    if type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy":   # FSDP2's no-offload policy is OffloadPolicy()
        raise ValueError("accelerate config fsdp_config.fsdp_offload_params: true keeps the sparse values on the "
                         "CPU, away from their block index on the GPU; set it to false")
    for name, layer in sparse_layers(model).items():
        if not layer.caps.shardable:
            raise ValueError(f"sparsity.format: {layer.format_name!r} (layer {name}) cannot be sharded by FSDP; "
                             f"use sparsity.format=block, or DDP (no FSDP in the accelerate config)")
    shard_tied_modules(model, accelerator)


def shard_tied_modules(model: nn.Module, accelerator) -> None:
    """``fully_shard`` each set of modules that register the same Parameter as one group, before accelerate
    shards the rest. FSDP2 refuses a Parameter seen by two groups, and accelerate (1.15) groups the input with the
    output embedding but not BERT's ``cls.predictions``, whose ``bias`` is also ``decoder.bias``: "Parameter
    'cls.predictions.decoder.bias' is shared with a parameter already managed by another FSDP group", dense BERT
    included. Here word embeddings and ``cls.predictions`` (the decoder inside) become one group; accelerate's
    own grouping of the output embedding would take the decoder again, so for that one call the model reports
    no output embedding."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(module)
    groups: list[list[nn.Module]] = []
    for sharing in (mods for mods in owners.values() if len(mods) > 1):   # merge groups that share a module
        touching = [g for g in groups if any(m in g for m in sharing)]
        merged = [m for g in touching for m in g] + [m for m in sharing if not any(m in g for g in touching)]
        groups = [g for g in groups if g not in touching] + [merged]
    if not groups:
        return
    plugin = accelerator.state.fsdp_plugin
    mesh = getattr(accelerator, "torch_device_mesh", None)
    kwargs = {"mp_policy": plugin.mixed_precision_policy or MixedPrecisionPolicy(), "reshard_after_forward": False,
              "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None}
    sharded_here = set()
    for group in groups:   # as accelerate shards its tail group: used at both ends of the forward, kept gathered
        roots = [m for m in group if not any(m is not o and _contains(o, m) for o in group)]
        if not any(isinstance(m, FSDPModule) for m in roots):
            fully_shard(roots, **kwargs)
            sharded_here.update(id(m) for m in group)
    output = getattr(model, "get_output_embeddings", lambda: None)()
    if output is not None and id(output) in sharded_here and not isinstance(output, FSDPModule):
        def no_output_embedding_once():   # accelerate's one call; then the class's method again
            del model.get_output_embeddings
            return None

        model.get_output_embeddings = no_output_embedding_once


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())
