"""``format="block"``: a :class:`~sparsetrain.nn.SparseLinear` weight stored as its active blocks only.

The layer gets ``values = nn.Parameter([n_active, br, bc])`` — so an optimizer built on it keeps Adam
moments for the active blocks only (memory ≈ density x dense) — and the int32 block metadata as
non-persistent buffers ``_bs_*`` (moved by ``.to()``, rebuilt from ``mask`` on load). The forward runs
:func:`~sparsetrain.kernels.blocksparse.block_sparse_linear`: Triton kernels on CUDA for square blocks of
16/32/64/128; the plain-torch reference otherwise (CPU, or blocks 1/4/8 and rectangular blocks, which keep
the compressed storage and train correctly at dense-matmul speed).

>>> import torch
>>> from sparsetrain.nn import SparseLinear
>>> lin = SparseLinear.from_dense(torch.nn.Linear(64, 96), density=0.5, block=16, format="block")
>>> lin.values.shape
torch.Size([12, 16, 16])
>>> sorted(lin.state_dict())
['bias', 'mask', 'weight']
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from sparsetrain.kernels.blocksparse import BlockSparseMeta, block_sparse_linear, register_meta
from sparsetrain.kernels.blocksparse.meta import active_positions, rewrite_all_
from sparsetrain.kernels.blocksparse.probe import new_probe
from sparsetrain.kernels.blocksparse.reference import dense_to_values, values_to_dense
from sparsetrain.nn.formats.base import (
    FormatCaps,
    WeightFormat,
    is_sharded,
    register_format,
    whole,
    write_whole,
)

if TYPE_CHECKING:  # pragma: no cover
    from sparsetrain.nn.sparse_linear import SparseLinear

_PREFIX = "_bs_"


def runs_block_ops(m: nn.Module, probed: bool = False) -> bool:
    """Whether the block-sparse ops may run in place of ``m``'s forward (the fused feed-forward block, a projection
    in parts): a :class:`~sparsetrain.nn.SparseLinear` in this format with a plain ``values`` Parameter, no
    dense-gradient capture (RigL) and no module hook (a hook would not see the ops' call). ``probed``: a layer
    that captures the dense gradient through its probe in this call (:func:`block_ops_probe`) qualifies too;
    one on the hook path (no probe) never does."""
    from sparsetrain.nn.sparse_linear import SparseLinear

    return (isinstance(m, SparseLinear) and isinstance(m.storage, BlockFormat)
            and isinstance(m._parameters.get("values"), torch.Tensor)
            and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
            and (not m.capture_dense_grad or (probed and block_ops_probe(m) is not None)))


def block_ops_probe(m: SparseLinear) -> Tensor | None:
    """The probe that ``m``'s forward would hand the op in this call (:meth:`BlockFormat.forward`'s condition:
    armed for RigL's dense gradient, grad enabled, ``values`` requiring grad), or None."""
    if m.capture_dense_grad and torch.is_grad_enabled() and m._parameters["values"].requires_grad:
        return m.grad_probe
    return None


def moved_slots(old: Tensor, new: Tensor, n: int) -> Tensor:
    """Per slot of the new topology (bool block masks ``old`` and ``new`` of ``n`` active blocks each, or ``[L, R,
    C]`` stacks of them), the slot of the same block in the old one, or -1 for a block that was not active: ``[n]``
    (``[L, n]``) int64, computed on the masks' device in tensors of sizes known from ``n`` (no host sync)."""
    old_flat, new_flat = old.flatten(-2), new.flatten(-2)
    pos = active_positions(new_flat, n)
    return torch.where(old_flat.gather(-1, pos), old_flat.long().cumsum(-1).gather(-1, pos) - 1, -1)


def _move_blocks(t: Tensor, index: Tensor, fresh: Tensor) -> None:
    """Row ``i`` of ``t`` (blocks in slot order) becomes old row ``index[i]``, or zeros where ``fresh[i]`` (a block
    that was not active; :func:`moved_slots`). A sharded ``t`` (FSDP2) is gathered, moved whole, and each rank keeps
    its shard."""
    full = whole(t)
    moved = full.index_select(0, index)
    moved.masked_fill_(fresh.view(-1, *([1] * (full.dim() - 1))), 0)
    write_whole(t, moved)


def _move_stacked(ts: list[Tensor], index: Tensor, fresh: Tensor) -> None:
    """:func:`_move_blocks` of the same-shaped ``ts`` at once: ``index`` and ``fresh`` flat over ``stack(ts)``'s
    first two dimensions (layer, slot)."""
    full = torch.stack(ts)
    moved = full.flatten(0, 1).index_select(0, index)
    moved.masked_fill_(fresh.view(-1, *([1] * (full.dim() - 2))), 0)
    torch._foreach_copy_(ts, list(moved.view(full.shape).unbind(0)))


def _current(bufs: dict, meta: BlockSparseMeta) -> bool:
    """Whether ``meta`` holds the layer's index buffers (``.to()`` replaces them all): six identity checks, which
    :meth:`BlockFormat.forward` makes inline."""
    return (bufs["_bs_row_ptr"] is meta.row_ptr and bufs["_bs_col_idx"] is meta.col_idx
            and bufs["_bs_row_idx"] is meta.row_idx and bufs["_bs_col_ptr"] is meta.col_ptr
            and bufs["_bs_t_row_idx"] is meta.t_row_idx and bufs["_bs_t_slot"] is meta.t_slot)


@register_format("block")
class BlockFormat(WeightFormat):
    """Compressed block storage (values of the active blocks + CSR/transpose metadata). Topology changes keep
    the active count (the values Parameter keeps its shape, so the optimizer keeps pointing at it). Under FSDP2
    ``values`` and its moments are sharded over their first (block) dimension; a mask update gathers them, moves
    the blocks and keeps each rank's shard (``shardable``)."""

    caps = FormatCaps(keeps_count=True, shardable=True)

    # ---- metadata held on the layer -------------------------------------------------------------
    @staticmethod
    def _install_meta(layer: SparseLinear, meta: BlockSparseMeta) -> None:
        old = getattr(layer, "_bs_meta", None)
        for name in BlockSparseMeta.TENSORS:
            layer.register_buffer(_PREFIX + name, getattr(meta, name), persistent=False)
        layer._bs_meta = meta
        if meta.kernel_supported:
            register_meta(meta, replaces=old)

    @staticmethod
    def meta(layer: SparseLinear) -> BlockSparseMeta:
        """The layer's metadata; re-wrapped (no rebuild) when ``.to()`` replaced its buffers."""
        meta = layer._bs_meta
        if not _current(layer._buffers, meta):
            bufs = layer._buffers
            old, meta = meta, meta.with_tensors(**{n: bufs[_PREFIX + n] for n in BlockSparseMeta.TENSORS})
            layer._bs_meta = meta
            if meta.kernel_supported:
                register_meta(meta, replaces=old)
        return meta

    def _build_meta(self, layer: SparseLinear, mask: Tensor, device: torch.device) -> BlockSparseMeta:
        return BlockSparseMeta.from_mask(mask.to(device=device, dtype=torch.bool), layer.block)

    # ---- WeightFormat ---------------------------------------------------------------------------
    def setup(self, layer, weight, mask):
        meta = self._build_meta(layer, mask, weight.device)
        layer.values = nn.Parameter(dense_to_values(weight.detach(), meta).clone())
        self._install_meta(layer, meta)

    def forward(self, layer, x):
        # Every step goes through here: the module's dictionaries are read directly (nn.Module.__getattr__ is a
        # Python call per name) and the metadata's six index tensors compared with the buffers inline.
        meta, b = layer._bs_meta, layer._buffers
        if not (b["_bs_row_ptr"] is meta.row_ptr and b["_bs_col_idx"] is meta.col_idx  # _current(), inline
                and b["_bs_row_idx"] is meta.row_idx and b["_bs_col_ptr"] is meta.col_ptr
                and b["_bs_t_row_idx"] is meta.t_row_idx and b["_bs_t_slot"] is meta.t_slot):
            meta = self.meta(layer)
        params = layer._parameters
        try:
            values, bias = params["values"], params["bias"]
        except KeyError:  # e.g. a parametrization in place of a Parameter
            values, bias = layer.values, layer.bias
        hook = None
        if layer.capture_dense_grad and torch.is_grad_enabled() and values.requires_grad:
            if layer.grad_probe is not None:   # RigL's grow step, compiled or replayed (probe.py)
                return block_sparse_linear(x, values, meta, bias, dense_grad_probe=layer.grad_probe)

            def hook(g: Tensor, layer=layer) -> None:
                layer.dense_grad = g if layer.dense_grad is None else layer.dense_grad + g
        return block_sparse_linear(x, values, meta, bias, dense_grad_hook=hook)

    def new_probe(self, layer):
        return new_probe(layer.out_features, layer.in_features, layer.mask.device)

    def dense_weight(self, layer):
        return values_to_dense(whole(layer.values.detach()), self.meta(layer))

    def load(self, layer, weight, mask):
        values = layer.values
        meta = self._build_meta(layer, mask, values.device)
        new = dense_to_values(weight.to(device=values.device, dtype=values.dtype), meta)
        with torch.no_grad():
            layer.mask.copy_(mask.to(layer.mask.device))
            if new.shape == values.shape:
                write_whole(values, new)
            elif is_sharded(values):
                raise ValueError(f"a checkpoint with {new.shape[0]} active blocks cannot load into sharded values "
                                 f"of {values.shape[0]}: load it before the model is sharded")
            else:
                # Another active count: same Parameter object, new storage. Optimizer state built for the
                # old shape is stale; the schedulers load checkpoints before building the optimizer.
                values.data = new.contiguous()
        self._install_meta(layer, meta)

    def set_mask(self, layer, new_mask, optimizer=None):
        """Rewrite the topology keeping the active count: surviving blocks and their optimizer moments
        move to their new slots, newly active blocks start at zero with zeroed moments. The index buffers, and
        every entry list, kernel table and launch plan kept on them, are rewritten in place
        (:meth:`~sparsetrain.kernels.blocksparse.BlockSparseMeta.rewrite_`), so a CUDA graph of the step
        stays valid; where the new topology does not fit a kept table the layer gets new buffers instead.

        Everything is worked out where the layer lives, in tensors whose sizes the active count fixes: on a GPU,
        given the new mask there, the update waits for nothing (and may be captured in a CUDA graph). A GPU mask's
        count is checked on the device (a wrong count stops the process at its next sync); a host mask's here."""
        meta = self.meta(layer)
        n, dev = meta.n_blocks, layer.mask.device
        new_mask = new_mask.to(dtype=torch.bool)
        if new_mask.device.type == "cpu" or dev.type == "cpu":
            if int(new_mask.sum()) != n:
                raise ValueError(f"new_mask has {int(new_mask.sum())} active blocks but the block format keeps the "
                                 f"count constant at {n}; use set_format('masked') to change density")
        else:
            torch._assert_async(new_mask.sum() == n, f"new_mask must keep the block format's {n} active blocks")
        new_mask = new_mask.to(dev, non_blocking=True)   # from pageable host memory: staged, no sync
        src = moved_slots(layer.mask, new_mask, n)
        index, fresh = src.clamp(min=0), src < 0
        with torch.no_grad():
            _move_blocks(layer.values.data, index, fresh)
            state = optimizer.state.get(layer.values) if optimizer is not None else None
            for v in (state or {}).values():
                if torch.is_tensor(v) and v.shape == layer.values.shape:
                    _move_blocks(v, index, fresh)
            layer.mask.copy_(new_mask)
        if not meta.rewrite_(new_mask):   # in place where every kept table can follow
            self._install_meta(layer, self._build_meta(layer, new_mask, dev))

    def shrink(self, layer, new_mask, optimizer=None):
        """Gradual pruning: keep the active blocks of ``new_mask``, a subset of the mask. The values and each
        moment of the optimizer state are gathered into tensors of the new count (the same Parameter, new
        storage) and the metadata is built anew: its kernel plans are chosen again for the new shapes, a CUDA
        graph of the step is captured again, a compiled model compiles once more (then with the count dynamic).
        One host sync (the new count)."""
        dev, old = layer.mask.device, layer.mask
        new_mask = new_mask.to(dev, torch.bool)
        n = int(new_mask.sum())
        if n == self.meta(layer).n_blocks:
            return self.set_mask(layer, new_mask, optimizer)
        if n == 0 or bool((new_mask & ~old).any()):
            raise ValueError("shrink_to keeps a non-empty subset of the active blocks; the new mask has "
                             f"{n} active blocks" + (", some of them not active now" if n else ""))
        if is_sharded(layer.values):
            raise ValueError("the block format cannot change its active count while its values are sharded "
                             "(FSDP): gradual pruning needs sparsity.format=masked there")
        keep = moved_slots(old, new_mask, n)   # every kept block's slot in the old values
        with torch.no_grad():
            state = optimizer.state.get(layer.values) if optimizer is not None else None
            for key, v in list((state or {}).items()):
                if torch.is_tensor(v) and v.shape == layer.values.shape:
                    state[key] = v.index_select(0, keep)
            grad = layer.values.grad
            layer.values.data = layer.values.data.index_select(0, keep)
            layer.values.grad = None if grad is None else grad.index_select(0, keep)
            layer.mask.copy_(new_mask)
        meta = self._build_meta(layer, new_mask, dev)
        meta.estimate_plans = True   # chosen without timing anything in the step (tuner.pick)
        self._install_meta(layer, meta)
        # torch.compile keeps a module's parameter and buffer shapes static: each new count would recompile (and
        # past dynamo's recompile limit the step would run uncompiled). Let the count become a dynamic size after
        # its first change (process-wide; shapes that never change are unaffected)
        torch._dynamo.config.force_parameter_static_shapes = False
        torch._dynamo.config.force_nn_module_property_static_shapes = False

    def set_masks(self, layers: list[SparseLinear], new_masks: Tensor, optimizer=None) -> None:
        """:meth:`set_mask` of ``layers`` (equal :meth:`graph_batch_key`) to ``new_masks [L, R, C]`` together, each
        step once for all of them: the block moves of the values and of each moment in one gather, the masks and
        every kept table in one write each (the tables built together:
        :func:`~sparsetrain.kernels.blocksparse.meta.rewrite_all_`). Each layer ends as its own set_mask leaves it."""
        metas = [self.meta(m) for m in layers]
        n, dev, L = metas[0].n_blocks, layers[0].mask.device, len(layers)
        new_masks = new_masks.to(dev, torch.bool)
        if dev.type == "cpu":
            if (new_masks.sum((1, 2)) != n).any():
                raise ValueError(f"new_masks must keep the block format's {n} active blocks in every layer")
        else:
            torch._assert_async((new_masks.sum((1, 2)) == n).all(), f"new_masks must keep {n} active blocks")
        src = moved_slots(torch.stack([m.mask for m in layers]), new_masks, n)
        index = (src.clamp(min=0) + torch.arange(0, L * n, n, device=dev).unsqueeze(1)).view(-1)
        fresh = (src < 0).view(-1)
        with torch.no_grad():
            _move_stacked([m.values.data for m in layers], index, fresh)
            states = [optimizer.state.get(m.values, {}) if optimizer is not None else {} for m in layers]
            for key, v in states[0].items():
                if torch.is_tensor(v) and v.shape == layers[0].values.shape:
                    _move_stacked([s[key] for s in states], index, fresh)
            torch._foreach_copy_([m.mask for m in layers], list(new_masks.unbind(0)))
        if not rewrite_all_(metas, new_masks):
            for layer, meta, mask in zip(layers, metas, new_masks.unbind(0)):
                if not meta.rewrite_(mask):
                    self._install_meta(layer, self._build_meta(layer, mask, dev))

    def graph_batch_key(self, layer, optimizer=None):
        """Layers of equal keys (and a :meth:`graph_update_key`) can take one :meth:`set_masks`: the same grid,
        block, active count, kept tables (:meth:`~sparsetrain.kernels.blocksparse.BlockSparseMeta.batch_key`),
        values and moments (shapes and dtypes)."""
        state = optimizer.state.get(layer.values, {}) if optimizer is not None else {}
        return (type(self), self.meta(layer).batch_key(), tuple(layer.values.shape), layer.values.dtype,
                tuple((k, tuple(v.shape), v.dtype) for k, v in state.items() if torch.is_tensor(v)))

    def dense_layout(self, layer, t):
        return values_to_dense(whole(t), self.meta(layer))

    def graph_update_key(self, layer):
        """On a GPU, where every kept table is rebuilt in place, on the device, and ``values`` is whole: the
        metadata, its tensors and kept entries, ``values`` and the mask, by identity (a change means a new
        capture)."""
        meta = self.meta(layer)
        if meta.device.type != "cuda" or is_sharded(layer.values) or not meta.rewrites_in_place():
            return None
        return (id(meta), *(id(getattr(meta, n)) for n in meta.TENSORS), tuple(meta._groups),
                *(id(v) for v in meta._groups.values()), id(layer.values), layer.values.data_ptr(), id(layer.mask))

    def weight_parameter(self, layer):
        return layer.values

    def active_in_parameter(self, layer):
        return None   # values hold the active blocks only

    def n_active(self, layer) -> int:
        return self.meta(layer).n_blocks   # the count the format keeps, on the host

    def extra_repr(self) -> str:
        return "block"
