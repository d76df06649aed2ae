"""The compressed block-sparse weight: which ``b x b`` blocks of ``W [O, I]`` exist, as int32 index arrays.

The values live in ``values [n_blocks, b, b]``, the active blocks in row-major block order (slot ``s`` is the
``s``-th active block of the grid read row by row). :class:`BlockSparseMeta` holds

- ``row_ptr [R+1]``, ``col_idx [n]``, ``row_idx [n]``: CSR over block rows (forward ``Y = X·Wᵀ``);
- ``col_ptr [C+1]``, ``t_row_idx [n]``, ``t_slot [n]``: the *transpose* metadata, CSR over block columns,
  each entry naming its block row and its slot in ``values`` (input gradient ``dX = dY·W`` without a
  transposed copy of the values).

It is built from the layer's bool block mask ``[O/b, I/b]``; everything derived from it (entry lists, CUDA tables,
launch plans) is cached on it. A new topology of the same active count is written into it in place
(:meth:`BlockSparseMeta.rewrite_`: the index tensors, and every derived list and table, refilled by the rules in
:data:`REFILL`), so launch plans and CUDA graphs that read them stay valid; otherwise a new metadata is built
and what was cached goes with the old one.

>>> import torch
>>> meta = BlockSparseMeta.from_mask(torch.tensor([[True, False], [True, True]]), 16)
>>> meta.n_blocks, meta.grid, meta.col_idx.tolist()
(3, (2, 2), [0, 0, 1])
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class BlockShape(Protocol):
    rows: int
    cols: int


def block_shape(block: int | tuple[int, int] | BlockShape) -> tuple[int, int]:
    """``(rows, cols)`` of a block given as an edge, a pair, or an object with ``rows``/``cols``. The kernels
    know no layout type of the layers above them: any of these spellings will do."""
    if hasattr(block, "rows") and hasattr(block, "cols"):
        shape = (block.rows, block.cols)
    elif isinstance(block, int):
        shape = (block, block)
    elif isinstance(block, (tuple, list)) and len(block) == 2:
        shape = tuple(block)
    else:
        raise ValueError(f"block must be an int, a (rows, cols) pair or a Block, got {block!r}")
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape):
        raise ValueError(f"block edges must be positive ints, got {block!r}")
    return int(shape[0]), int(shape[1])


#: Square block edges the kernels take; other blocks (1, 4, 8, rectangular) run the plain-torch reference.
KERNEL_BLOCKS = (16, 32, 64, 128)


@dataclass(eq=False)
class BlockSparseMeta:
    """Index arrays of a block-sparse ``[out_features, in_features]`` weight (see the module docstring)."""

    out_features: int
    in_features: int
    block_rows: int
    block_cols: int
    n_blocks: int
    row_ptr: Tensor
    col_idx: Tensor
    row_idx: Tensor
    col_ptr: Tensor
    t_row_idx: Tensor
    t_slot: Tensor
    _groups: dict = field(default_factory=dict, repr=False)
    # Only on the transient metadata that rewrite_ builds (never on one that is kept, whose tensors may change
    # under it): int64 twins of its index arrays and one arange, so that the lists refilled from it cast and
    # count nothing again (:meth:`as_long`, :meth:`_arange`).
    _scratch: dict = field(default_factory=dict, repr=False)
    # rewrites_in_place's answer and the kept entries it was given for (by identity; a dict's entries too)
    _fits: tuple = field(default=(), repr=False)
    #: plans for this topology are chosen from the timings of the nearest density measured (gradual pruning)
    estimate_plans: bool = field(default=False, repr=False)

    TENSORS: ClassVar[tuple[str, ...]] = ("row_ptr", "col_idx", "row_idx", "col_ptr", "t_row_idx", "t_slot")

    @classmethod
    def from_mask(cls, mask: Tensor, block: int | tuple[int, int] | BlockShape,
                  n_blocks: int | None = None, *, keep_scratch: bool = False) -> BlockSparseMeta:
        """Build the metadata from a bool block mask ``[O/br, I/bc]`` (on the mask's device). ``block`` is an
        edge, a ``(rows, cols)`` pair, or anything with ``rows`` and ``cols`` (``sparsetrain.sparsity.Block``).
        ``n_blocks``: the mask's active count where the caller knows it; then every size is known on the host and
        the build waits for nothing on a GPU (it is not checked: a wrong count builds wrong lists).
        ``keep_scratch``: keep the int64 arrays of the build on the result (:attr:`_scratch`; :meth:`rewrite_`'s
        transient metadata only)."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
        if mask.dim() != 2:
            raise ValueError(f"mask must be a 2-D block grid, got shape {tuple(mask.shape)}")
        br, bc = block_shape(block)
        R, C = mask.shape
        n = int(mask.sum()) if n_blocks is None else int(n_blocks)
        pos = active_positions(mask.reshape(-1), n)   # row-major order = slot order
        rows, cols = pos // C, pos % C
        # the transpose order (per column, rows ascending) is the slots stably sorted by column, as slots ascend
        # by row: the sort gives each entry's slot and, as its values, its column
        t_col, t_slot = torch.sort(cols, stable=True)
        # one range for both pointer arrays, long enough for the entry lists a rewrite refills (see _arange)
        steps = torch.arange(n + max(R, C) + 1, device=mask.device)
        i32 = torch.int32
        row_idx = rows.to(i32)
        meta = cls(R * br, C * bc, br, bc, n,
                   torch.searchsorted(rows, steps[:R + 1], out_int32=True), cols.to(i32), row_idx,
                   torch.searchsorted(t_col, steps[:C + 1], out_int32=True), row_idx[t_slot], t_slot.to(i32))
        if keep_scratch:
            meta._scratch = {"row_idx": rows, "col_idx": cols, "t_col": t_col, "arange": steps}
        return meta

    def rewrite_(self, mask: Tensor) -> bool:
        """Install the topology of ``mask`` (a bool block mask with this one's grid and active count) in place:
        the six index tensors, every derived list or table kept here and so every kept launch plan keep their
        storage and read the new topology, so kernels captured in a CUDA graph stay valid. Each kept entry is
        rebuilt for the new topology by its :data:`REFILL` rule first; where one cannot follow (no rule, a plan
        that is not ``stable``, a table the new topology outgrows) nothing is changed and the result is False:
        the caller then builds a new metadata.

        The new topology is built where this metadata lives, in lists of sizes known from the grid and the active
        count: a GPU rewrite waits for nothing, and the mask's count is checked only on the CPU (on a GPU the
        caller keeps it)."""
        mask = mask.to(self.device)
        # new never leaves here: the int64 arrays of its build serve the refills below
        new = BlockSparseMeta.from_mask(mask, (self.block_rows, self.block_cols),
                                        n_blocks=None if mask.device.type == "cpu" else self.n_blocks,
                                        keep_scratch=True)
        if new.grid != self.grid or new.n_blocks != self.n_blocks:
            raise ValueError(f"rewrite_ keeps the grid {self.grid} and {self.n_blocks} active blocks; the new "
                             f"mask has grid {new.grid} and {new.n_blocks}")
        copies = self._refills(new)
        if copies is None or any(dst.shape != src.shape for dst, src in copies):
            return False
        with torch.no_grad():
            _copy_into(copies)
        for hook in REWRITTEN:
            hook(self)
        return True

    def _refills(self, new: BlockSparseMeta) -> list[tuple[Tensor, Tensor]] | None:
        """``(kept tensor, its content for new's topology)`` of the index tensors and every kept entry (its
        :data:`REFILL` rule), or None where an entry cannot follow."""
        copies = [(getattr(self, n), getattr(new, n)) for n in self.TENSORS]
        for key, value in self._groups.items():
            rule = REFILL.get(_kind(key))
            pairs = rule(new, key, value) if rule is not None else None
            if pairs is None:
                return None
            copies += pairs
        return copies

    def kept_tensors(self) -> list[Tensor]:
        """The index tensors, then the tensors of every kept entry in its order (what :meth:`rewrite_` may write)."""
        out = [getattr(self, n) for n in self.TENSORS]
        for value in self._groups.values():
            out += [t for t in (value if isinstance(value, tuple) else (value,)) if isinstance(t, Tensor)]
        return out

    def batch_key(self) -> tuple:
        """Metadata with equal keys keep the same entries in tensors of the same shapes and dtypes: one
        :func:`rewrite_all_` builds their new topologies together."""
        return (self.grid, self.block_rows, self.block_cols, self.n_blocks, str(self.device), tuple(self._groups),
                tuple((tuple(t.shape), t.dtype) for t in self.kept_tensors()))

    def rewrites_in_place(self) -> bool:
        """Whether :meth:`rewrite_` refills every kept entry for any topology of this grid and active count: every
        kind has a rule, and its :data:`FITS` condition holds (the lists are the fixed-size ones, the plans are
        stable, the tables have room). Asked again for the same entries, it answers from the last time."""
        seen = tuple((key, id(value), tuple(map(id, value.values())) if isinstance(value, dict) else ())
                     for key, value in self._groups.items())
        if not self._fits or self._fits[0] != seen:
            self._fits = (seen, all(_kind(key) in REFILL and FITS.get(_kind(key), _always)(self, key, value)
                                    for key, value in self._groups.items()))
        return self._fits[1]

    @property
    def grid(self) -> tuple[int, int]:
        return self.out_features // self.block_rows, self.in_features // self.block_cols

    @property
    def block(self) -> int:
        """Edge of a square block (raises for rectangular blocks)."""
        if self.block_rows != self.block_cols:
            raise ValueError(f"block {self.block_rows}x{self.block_cols} is not square")
        return self.block_rows

    @property
    def density(self) -> float:
        R, C = self.grid
        return self.n_blocks / max(1, R * C)

    @property
    def device(self) -> torch.device:
        return self.row_ptr.device

    @property
    def kernel_supported(self) -> bool:
        """Square blocks of 16/32/64/128 run on the Triton kernels; others use the reference path."""
        return self.block_rows == self.block_cols and self.block_rows in KERNEL_BLOCKS

    def with_tensors(self, **tensors: Tensor) -> BlockSparseMeta:
        """Same topology, index tensors replaced (e.g. after ``module.to(device)``); caches are dropped."""
        return replace(self, **tensors, _groups={}, _scratch={}, _fits=())

    def to(self, device: torch.device | str) -> BlockSparseMeta:
        return self.with_tensors(**{k: getattr(self, k).to(device) for k in self.TENSORS})

    def as_long(self, name: str) -> Tensor:
        """An index array as int64 (for indexing): ``name`` one of :attr:`TENSORS`, or ``"t_col"``, the block
        column of each entry of the transpose lists. Kept from the build on a rewrite's transient metadata."""
        kept = self._scratch.get(name)
        if kept is not None:
            return kept
        if name == "t_col":
            return torch.searchsorted(self.col_ptr[1:].long(), self._arange(self.n_blocks), right=True)
        return getattr(self, name).long()

    def _arange(self, size: int, dtype: torch.dtype = torch.long) -> Tensor:
        """``torch.arange(size)`` on this metadata's device; on a rewrite's transient metadata a view of the range
        its build made (one per dtype for every list it refills, where that one is long enough)."""
        steps = self._scratch.get("arange")
        if steps is None or steps.numel() < size:
            return torch.arange(size, dtype=dtype, device=self.device)
        if dtype != steps.dtype:
            if ("arange", dtype) not in self._scratch:
                self._scratch[("arange", dtype)] = steps.to(dtype)
            steps = self._scratch[("arange", dtype)]
        return steps[:size]

    def padded_entries(self, forward: bool, group_k: int, fixed: bool = False
                       ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Entry lists of the dense x block-sparse kernel, per output column block, each padded to a
        multiple of ``group_k`` (at least one group, so empty output blocks are written too):
        ``(ptr [n_out+1], kidx, slot (-1 = padding), out_block)``. Forward: per block row of W (CSR);
        input gradient: per block column (the transpose metadata). ``fixed``: the lists are allocated at the
        largest size any topology of this active count needs (``n_blocks + n_out * group_k``; the tail past
        ``ptr[-1]`` is padding with ``out_block = n_out``), so :meth:`rewrite_` can refill them in place.
        Cached per ``(forward, group_k, fixed)``."""
        key = ("dds", forward, group_k, fixed)
        if key not in self._groups:
            i32, n = torch.int32, self.n_blocks
            # per entry in list order: its output block (int64, an index), column block and slot (int32)
            if forward:
                ptr, out_of, kidx, slot = self.row_ptr, self.as_long("row_idx"), self.col_idx, self._arange(n, i32)
            else:
                ptr, out_of, kidx, slot = self.col_ptr, self.as_long("t_col"), self.t_row_idx, self.t_slot
            ptr, kidx, slot = ptr.to(i32), kidx.to(i32), slot.to(i32)   # (no-ops for this class's int32 arrays)
            n_out = ptr.numel() - 1
            padded = (ptr[1:] - ptr[:-1]).clamp(min=1)   # ceil(max(count, 1) / group_k) * group_k
            if group_k > 1:
                padded = (padded + (group_k - 1)).div(group_k, rounding_mode="floor").mul(group_k)
            pptr = F.pad(padded.cumsum(0, dtype=i32), (1, 0))
            # fixed: every size from the grid and the count, no host sync; the tail's out_block is n_out
            total = n + n_out * group_k if fixed else int(pptr[-1])
            # each entry moves from ptr[o] + i to pptr[o] + i; the padding keeps kidx 0 and slot -1
            dest = (pptr - ptr)[out_of] + self._arange(n)
            # (out of place: the same build runs batched over layers of one shape, under vmap)
            pk = torch.zeros(total, dtype=i32, device=self.device).scatter(0, dest, kidx)
            ps = torch.full((total,), -1, dtype=i32, device=self.device).scatter(0, dest, slot)
            out_block = torch.searchsorted(pptr[1:], self._arange(total, i32), right=True, out_int32=True)
            self._groups[key] = (pptr, pk, ps, out_block)
        return self._groups[key]

    def dw_groups_used(self, group: int) -> int:
        """How many groups of :meth:`dw_groups` ``(group, fixed=True)`` held work when the lists were built (a
        host int: what a plan chooses its token split for; a later :meth:`rewrite_` leaves it, a tiling choice)."""
        self.dw_groups(group, fixed=True)
        key = ("dw_used", group)
        if key not in self._groups:
            counts = (self.row_ptr[1:] - self.row_ptr[:-1]).long()
            self._groups[key] = int(((counts + group - 1) // group).clamp(min=1).sum())
        return self._groups[key]

    def dw_groups(self, group: int, fixed: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """Groups of up to ``group`` consecutive active blocks of one block row, for the weight-gradient
        kernel: ``(row, first_slot, count, is_first_of_row, n_groups)``. Every block row has at least one
        group (count 0 when empty) so that the fused bias gradient covers it. ``fixed``: allocated at the
        largest count any topology of this active count needs (``R + n_blocks // group``; padding groups have
        count -1 and do nothing), so :meth:`rewrite_` can refill them in place and the launch grid stays; every
        size is then known on the host (no sync on a GPU). Cached per ``(group, fixed)``."""
        key = ("dw", group, fixed)
        if key not in self._groups:
            R, _ = self.grid
            ptr = self.row_ptr.long()
            ng = ((ptr[1:] - ptr[:-1] + group - 1) // group).clamp(min=1)
            ends = ng.cumsum(0)
            if fixed:
                total = R + self.n_blocks // group
                q = self._arange(total)
                grow = torch.searchsorted(ends, q, right=True)
            else:
                total = int(ends[-1])
                grow = torch.repeat_interleave(self._arange(R), ng)
                q = self._arange(total)
            pad = grow >= R                          # fixed lists: the groups past the last one with work
            grow = grow.clamp(max=R - 1)
            chunk = q - (ends - ng)[grow]
            gstart = ptr[grow] + chunk * group
            gcount = (ptr[grow + 1] - gstart).clamp(0, group)
            first = (chunk == 0).long()
            grow, gstart, first = (t.masked_fill(pad, 0) for t in (grow, gstart, first))
            i32 = torch.int32
            self._groups[key] = (grow.to(i32), gstart.to(i32), gcount.masked_fill(pad, -1).to(i32), first.to(i32),
                                 total)
        return self._groups[key]


def active_positions(flat: Tensor, n: int) -> Tensor:
    """Positions of the ``n`` True entries of a flat bool tensor (of each row of a ``[L, N]`` one), ascending
    (int64), computed in tensors of sizes known on the host: no host sync on a GPU, unlike ``nonzero``: one stable
    sort puts the True entries first, in their order. (Where ``flat`` holds more than ``n``, the first ``n``;
    fewer, False positions follow.)"""
    return torch.sort(flat, dim=-1, descending=True, stable=True).indices[..., :n]


class _CannotBatch(Exception):
    pass


def rewrite_all_(metas: list[BlockSparseMeta], masks: Tensor) -> bool:
    """:meth:`~BlockSparseMeta.rewrite_` of ``metas`` (equal :meth:`~BlockSparseMeta.batch_key`) to the block masks
    ``masks [L, R, C]`` (``masks[i]`` for ``metas[i]``), the new topologies built together: the build runs once
    under ``torch.func.vmap``, so each of its ops is one kernel for the L layers, and every kept tensor is written
    in one ``_foreach_copy_``. Each layer ends with exactly the tables its own ``rewrite_`` writes. False where
    nothing was written (an entry that cannot follow, an op vmap cannot batch): the caller rewrites one by one."""
    first = metas[0]
    if any(m.batch_key() != first.batch_key() for m in metas):
        raise ValueError("rewrite_all_ takes metadata of one batch_key")
    where: list[int] = []      # per refilled tensor: its place in kept_tensors()

    def build(mask: Tensor) -> list[Tensor]:
        new = BlockSparseMeta.from_mask(mask, (first.block_rows, first.block_cols), n_blocks=first.n_blocks,
                                        keep_scratch=True)
        pairs, kept = first._refills(new), {id(t): j for j, t in enumerate(first.kept_tensors())}
        if pairs is None or any(id(dst) not in kept or dst.shape != src.shape for dst, src in pairs):
            raise _CannotBatch
        where[:] = [kept[id(dst)] for dst, _ in pairs]
        return [src for _, src in pairs]

    fallback = torch._C._functorch._is_vmap_fallback_enabled()
    torch._C._functorch._set_vmap_fallback_enabled(False)   # an op without a batch rule: an error, not a loop
    try:
        with warnings.catch_warnings():   # searchsorted's shared (unbatched) values are an expanded view
            warnings.filterwarnings("ignore", message=".*non-contiguous.*", category=UserWarning)
            built = torch.func.vmap(build)(masks.to(first.device))
    except _CannotBatch:
        return False
    except RuntimeError as e:   # an op vmap has no batch rule for (with the fallback off): one by one
        if "vmap" not in str(e) and "atching rule" not in str(e):
            raise
        return False
    finally:
        torch._C._functorch._set_vmap_fallback_enabled(fallback)
    copies = []
    for i, meta in enumerate(metas):
        kept = meta.kept_tensors()
        copies += [(kept[j], src[i]) for j, src in zip(where, built)]
    with torch.no_grad():
        _copy_into(copies)
    for meta in metas:
        for hook in REWRITTEN:
            hook(meta)
    return True


def _kind(key) -> str:
    return key[0] if isinstance(key, tuple) else key


def _copy_into(copies: list[tuple[Tensor, Tensor]]) -> None:
    """``dst.copy_(src)`` for every pair, in one ``_foreach_copy_`` per device and dtype of the kept tensors.
    Sources on the host are joined in one host buffer first, which goes over in one ``non_blocking`` transfer
    (pageable memory, which the driver stages before the call returns: no host sync, and the buffer may go)."""
    by_kind: dict[tuple, list[tuple[Tensor, Tensor]]] = {}
    for dst, src in copies:
        by_kind.setdefault((dst.device, dst.dtype, src.device == dst.device), []).append((dst, src))
    for (device, dtype, local), pairs in by_kind.items():
        dsts = [dst for dst, _ in pairs]
        if local:
            parts = [_shaped(src.to(dtype), dst.shape) for dst, src in pairs]
        else:
            flat = torch.cat([src.reshape(-1).to("cpu", dtype) for _, src in pairs]).to(device, non_blocking=True)
            parts = [_shaped(part, dst.shape) for part, dst in zip(flat.split([d.numel() for d in dsts]), dsts)]
        torch._foreach_copy_(dsts, parts)


def _shaped(t: Tensor, shape: torch.Size) -> Tensor:
    return t if t.shape == shape else t.view(shape)   # (a view of the same shape would be a dispatched op)


def same_builder(build):
    """A :data:`REFILL` rule for a cached tensor or tuple that ``build(new_meta, *key[1:])`` makes again for the
    new topology with the same sizes: its tensors pair up."""
    def rule(new: BlockSparseMeta, key: tuple, value) -> list[tuple[Tensor, Tensor]]:
        fresh = build(new, *key[1:])
        fresh, value = ((x,) if isinstance(x, Tensor) else x for x in (fresh, value))
        return [(a, b) for a, b in zip(value, fresh, strict=True) if isinstance(a, Tensor)]
    return rule


def keep_as_is(new: BlockSparseMeta, key, value) -> list:
    """A :data:`REFILL` rule for a value kept as it is (a tiling choice made for the first topology)."""
    return []


def _stable_plans(new: BlockSparseMeta, key: str, value: dict) -> list | None:
    """Kept plans (or fast calls holding them) follow where each says ``stable``: it reads only the index
    tensors and the refilled lists, with a launch that depends on no topology."""
    plans = value.values() if key == "plans" else (p for c in value.values() for p in (c.fwd, c.dx, *c.dw))
    return [] if all(p is None or getattr(p, "stable", False) for p in plans) else None


#: For kinds whose :data:`REFILL` rule may refuse a topology: ``fits(meta, key, value)``, True where it refills
#: every topology of this grid and active count (:meth:`BlockSparseMeta.rewrites_in_place`).
FITS: dict[str, object] = {}


def _always(meta, key, value) -> bool:
    return True

#: Called with a metadata after :meth:`BlockSparseMeta.rewrite_` changed its topology (e.g. the custom ops'
#: registry, which finds a metadata by its tensors' addresses, makes sure those now lead to this one).
REWRITTEN: list = []

#: How each kind of entry kept in ``BlockSparseMeta._groups`` (its key, or its key's first item) follows
#: :meth:`BlockSparseMeta.rewrite_`: ``rule(new_meta, key, value) -> [(kept tensor, its new content), ...]``, or
#: None where it cannot. ``new_meta`` lives on the host, ``value`` where the metadata does: a rule builds the new
#: content from ``new_meta`` alone (it may read the kept tensors' shapes, never compute with them). A backend that
#: keeps a table of its own on the metadata registers a rule here.
REFILL: dict[str, object] = {
    "dds": lambda new, key, value: (same_builder(BlockSparseMeta.padded_entries)(new, key, value)
                                    if key[-1] is True else None),   # the exact lists' sizes vary
    "dw": lambda new, key, value: (same_builder(BlockSparseMeta.dw_groups)(new, key, value)
                                   if key[-1] is True else None),
    "dw_used": keep_as_is,
    "block_index": lambda new, key, value: [(value[0], new.as_long("row_idx")), (value[1], new.as_long("col_idx"))],
    "plans": _stable_plans,
    "calls": _stable_plans,
}
FITS.update({
    "dds": lambda meta, key, value: key[-1] is True,    # the fixed-size lists; the exact ones change size
    "dw": lambda meta, key, value: key[-1] is True,
    "plans": lambda meta, key, value: _stable_plans(meta, key, value) is not None,
    "calls": lambda meta, key, value: _stable_plans(meta, key, value) is not None,
})
