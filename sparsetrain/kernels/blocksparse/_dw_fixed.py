"""The CUDA weight-gradient kernel's CTA table (:func:`~._cuda_tables.dw_table`) rebuilt for a new topology where the
metadata lives, in tensors whose sizes the grid, the active count and the kept table fix: no host sync, so a mask
update on a GPU (and its CUDA graph) refills it like every other kept table.

The host builders (``_dw_rows``, ``_dw_tile_rows``) walk the topology in Python; these compute the same rows, in
the same order, with whole-tensor ops (tests compare them on random topologies):

- "tiles": blocks sorted by rectangle; a rectangle of ``L`` blocks takes ``ceil(L / cap)`` CTAs of near-equal
  counts; a row band with no block takes one bias-only CTA, otherwise its first CTA stages the whole band.
- "strips": the greedy cut (a CTA ends at ``cap`` blocks or where its strip would span ``STRIP_BLOCKS``) is a chain
  ``p -> next[p]`` from position 0, found by pointer doubling; where the strip operand is dY, the bias-only CTAs
  fill the row gaps before each CTA and after the last, in pieces of at most ``STRIP_BLOCKS`` rows.

Every row past the last with work is zero (a CTA that returns at once). The kept table has room for any topology
of its grid and active count (:func:`strips_most`, ``_tile_most``), so the rows always fit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _ceil(a: Tensor | int, b: int) -> Tensor | int:
    return (a + b - 1) // b


def _bands(n_items: int, n_bands: int, device) -> Tensor:
    """Band index of each of ``n_items`` (band ``i`` = items ``i*n//k .. (i+1)*n//k - 1``)."""
    bounds = torch.arange(1, n_bands + 1, device=device) * n_items // n_bands
    return torch.searchsorted(bounds, torch.arange(n_items, device=device), right=True)


def _ranges(owner: Tensor, values: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """Per row ``0..size-1``: the least and the largest of ``values`` whose ``owner`` it is (0 where none)."""
    lo = torch.zeros(size, dtype=torch.long, device=values.device)
    hi = torch.zeros(size, dtype=torch.long, device=values.device)
    if values.numel():
        lo.scatter_reduce_(0, owner, values, "amin", include_self=False)
        hi.scatter_reduce_(0, owner, values, "amax", include_self=False)
    return lo, hi


def _pack(rows: Tensor, owner: Tensor, order: Tensor, rr: Tensor, cc: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """The host ``_pack`` on tensors: ``rows [size, 8]`` in block units (zero rows past the used ones), the blocks
    in position order (slot ``order[k]`` at ``rr[k], cc[k]``) owned by CTA ``owner[k]``."""
    out = rows * b
    out[:, :2] = rows[:, :2]
    out[:, 3], out[:, 5] = (rows[:, 3] - rows[:, 2]) * b, (rows[:, 5] - rows[:, 4]) * b
    if order.numel() == 0:
        return out.to(torch.int32), torch.zeros(1, 4, dtype=torch.int32, device=rows.device)
    blk = torch.stack([order, (rr - rows[owner, 2]) * b, (cc - rows[owner, 4]) * b, torch.zeros_like(order)], 1)
    return out.to(torch.int32), blk.to(torch.int32)


def tile_rows(meta, with_bias: bool, cap: int, size: int, tiles: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``(cta [size, 8], blk)`` of the "tiles" layout (``_dw_tile_rows`` + ``_pack``, zero rows after) for the cut of
    the grid in ``tiles = (nr, nc)`` rectangles (``dw_tiles``)."""
    (R, C), dev, n = meta.grid, meta.device, meta.n_blocks
    nr, nc = tiles
    rr, cc = meta.row_idx.long(), meta.col_idx.long()
    cell = _bands(R, nr, dev)[rr] * nc + _bands(C, nc, dev)[cc]
    order = torch.argsort(cell, stable=True)          # blocks by rectangle, slot order inside one
    count = torch.zeros(nr * nc, dtype=torch.long, device=dev).index_add_(0, cell, torch.ones_like(cell))
    parts = _ceil(count, cap)
    cstart = count.cumsum(0) - count
    band_parts = parts.view(nr, nc).sum(1)
    units = torch.cat([parts.view(nr, nc), ((band_parts == 0) & with_bias).long().view(nr, 1)], 1).reshape(-1)
    ends = units.cumsum(0)
    ustart = ends - units
    t = torch.arange(size, device=dev)
    unit = torch.searchsorted(ends, t, right=True)
    used = unit < units.numel()
    unit = unit.clamp(max=units.numel() - 1)
    q, band, j = t - ustart[unit], unit // (nc + 1), unit % (nc + 1)
    bias_only = used & (j == nc)
    cid = (band * nc + j).clamp(max=nr * nc - 1)
    L, P = count[cid], parts[cid].clamp(min=1)
    first = cstart[cid] + q * L // P
    n_in = (q + 1) * L // P - q * L // P
    # the CTA of each block position: its rectangle's first CTA + the part its place in the rectangle falls in
    pcell = cell[order]
    w = torch.arange(n, device=dev) - cstart[pcell]
    owner = ustart[(pcell // nc) * (nc + 1) + pcell % nc] + ((w + 1) * parts[pcell] - 1) // count[pcell].clamp(min=1)
    a_lo, a_hi = _ranges(owner, rr[order], size)
    b_lo, b_hi = _ranges(owner, cc[order], size)
    blocks = used & ~bias_only
    rows = torch.stack([first, n_in, a_lo, a_hi + 1, b_lo, b_hi + 1, torch.zeros_like(t), torch.zeros_like(t)], 1)
    rows = rows * blocks.long().unsqueeze(1)
    lo, hi = band * R // nr, (band + 1) * R // nr
    if with_bias:   # a band's first CTA stages and sums the whole band; a band without blocks takes a bias-only CTA
        band_first = blocks & (t == ustart[band * (nc + 1)])
        span = torch.stack([lo, hi], 1)
        rows[:, 2:4] = torch.where(band_first.unsqueeze(1), span, rows[:, 2:4])
        rows[:, 6:8] = torch.where((band_first | bias_only).unsqueeze(1), span, rows[:, 6:8])
        rows[:, 2:4] = torch.where(bias_only.unsqueeze(1), span, rows[:, 2:4])
    return _pack(rows, owner, order, rr[order], cc[order], meta.block)


def _chain(strip: Tensor, cap: int, span: int, size: int) -> Tensor:
    """Starts of the greedy groups over positions ``0..n-1`` (``strip`` non-decreasing): a group from ``p`` ends at
    ``min(p + cap, first k with strip[k] >= strip[p] + span)``. ``[size + 1]`` positions, ``n`` past the last."""
    n, dev = strip.numel(), strip.device
    nxt = torch.minimum(torch.arange(n, device=dev) + cap, torch.searchsorted(strip, strip + span))
    jump = F.pad(nxt, (0, 1), value=n)                 # position n leads to itself
    i = torch.arange(size + 1, device=dev)
    pos = torch.zeros(size + 1, dtype=torch.long, device=dev)
    for k in range(max(1, int(size).bit_length())):
        pos = torch.where((i >> k) & 1 == 1, jump[pos], pos)
        jump = jump[jump]
    return pos


def strips_most(meta, cap: int, strip_blocks: int) -> int:
    """No topology of this grid and active count needs more "strips" CTAs: at most ``n // cap + ceil(S / w) + 1``
    groups (a group ends at ``cap`` blocks or after ``w`` strip positions of ``S``), and bias-only CTAs in at most
    ``ceil(R / w)`` pieces plus one per gap (one before each group, one after the last)."""
    (R, C), n = meta.grid, meta.n_blocks
    groups = n // cap + _ceil(max(R, C), strip_blocks) + 1
    return 2 * groups + _ceil(R, strip_blocks) + 1


def strip_rows(meta, with_bias: bool, cap: int, size: int, strip_blocks: int, x_whole: bool
               ) -> tuple[Tensor, Tensor]:
    """``(cta [size, 8], blk)`` of the "strips" layout (``_dw_rows`` + ``_pack``, zero rows after)."""
    R, dev, n = meta.grid[0], meta.device, meta.n_blocks
    if x_whole:
        order, rr, cc = torch.arange(n, device=dev), meta.row_idx.long(), meta.col_idx.long()
        strip = rr
    else:
        order, rr = meta.t_slot.long(), meta.t_row_idx.long()
        cc = torch.searchsorted(meta.col_ptr[1:].long(), torch.arange(n, device=dev), right=True)
        strip = cc
    starts = _chain(strip, cap, strip_blocks, size)[:-1]
    ends = F.pad(starts, (0, 1), value=n)[1:]
    real = starts < n
    n_groups = real.sum()
    first, cnt = starts.clamp(max=max(n - 1, 0)), (ends - starts) * real
    s_of = F.pad(strip, (0, 1))
    s0, s1 = s_of[first] * real, (s_of[(ends - 1).clamp(min=0)] + 1) * real
    group = torch.arange(size, device=dev)
    owner_group = torch.searchsorted(ends, torch.arange(n, device=dev), right=True)   # the group of each position
    if x_whole:
        return _strip_rows_dy(meta, with_bias, size, strip_blocks, (order, rr, cc, owner_group),
                              (first, cnt, s0, s1, real), n_groups)
    one = torch.ones_like(n_groups)
    ng = torch.maximum(n_groups, one)
    blo, bhi = (group * R // ng, (group + 1) * R // ng) if with_bias else (group * 0, group * 0)
    keep = (group < ng) & ((cnt > 0) | (bhi > blo))
    rows = torch.stack([first * real, cnt, group * 0, group * 0 + R, s0, s1, blo, bhi], 1)
    rank = keep.long().cumsum(0) - 1                 # kept rows move up, in order (the others to a spare row)
    out = rows.new_zeros(size + 1, 8).index_copy_(0, torch.where(keep, rank, size), rows)[:size]
    return _pack(out, rank[owner_group], order, rr, cc, meta.block)


def _strip_rows_dy(meta, with_bias, size, w, blocks, groups, n_groups):
    """The "strips" rows where dY is cut in strips of block rows: bias-only CTAs fill each gap before a group (when
    its strip with the gap would span more than ``w`` rows) and after the last group, in pieces of ``w`` rows."""
    (order, rr, cc, owner_group), (first, cnt, s0, s1, real) = blocks, groups
    R, C = meta.grid
    dev = s0.device
    g = torch.arange(size, device=dev)
    last = real & (g == n_groups - 1)
    lo0 = F.pad(s1, (1, 0))[:-1]                      # each group starts where the one before it ended
    gap = real & (s1 - torch.minimum(lo0, s0) > w) & (lo0 < s0)
    n_gap = torch.where(gap, _ceil(s0 - lo0, w), 0) if with_bias else torch.zeros_like(g)
    lo = torch.where(gap, s0, lo0)
    hi = torch.where(last & (R - torch.minimum(lo, s0) <= w), R, s1)
    end = torch.where(n_groups > 0, (hi * last).sum(), 0)        # where the last group's bias range ends
    n_tail = _ceil(R - end, w) if with_bias else end * 0
    units = torch.cat([(n_gap + 1) * real, n_tail.view(1)])
    ends = units.cumsum(0)
    t = g
    unit = torch.searchsorted(ends, t, right=True).clamp(max=size)
    used = t < ends[-1]
    unit_c = unit.clamp(max=size - 1)
    q = t - (ends - units)[unit]
    is_tail = unit == size
    own = ~is_tail & (q == n_gap[unit_c])             # the group's own CTA follows its gap pieces
    piece_lo = torch.where(is_tail, end + q * w, lo0[unit_c] + q * w)
    piece_hi = torch.minimum(piece_lo + w, torch.where(is_tail, torch.full_like(t, R), s0[unit_c]))
    u = unit_c
    own_row = torch.stack([first[u], cnt[u], torch.minimum(lo[u], s0[u]), torch.maximum(hi[u], s1[u]),
                           t * 0, t * 0 + C, lo[u], hi[u]], 1)
    if not with_bias:
        own_row[:, 6] = own_row[:, 7] = own_row[:, 2]
    piece = torch.stack([t * 0, t * 0, piece_lo, piece_hi, t * 0, t * 0, piece_lo, piece_hi], 1)
    rows = torch.where(own.unsqueeze(1), own_row, piece) * used.long().unsqueeze(1)
    owner = (ends - units)[owner_group] + n_gap[owner_group]
    return _pack(rows, owner, order, rr, cc, meta.block)
