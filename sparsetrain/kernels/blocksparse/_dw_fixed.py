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
    return (a + (b - 1)) // b


def _band(x: Tensor, n_items: int, n_bands: int) -> Tensor:
    """Band of each item ``x`` (band ``i`` = items ``i*n//k .. (i+1)*n//k - 1``): the largest ``i`` with
    ``i*n//k <= x``, i.e. ``i*n < (x+1)*k``."""
    return (x * n_bands + (n_bands - 1)) // n_items


def _ranges(owner: Tensor, rc: Tensor, size: int) -> Tensor:
    """Per row ``0..size-1``: the least row and column of the blocks ``rc [n, 2]`` whose ``owner`` it is, then the
    largest row and column negated (0 where none): one ``amin`` over both."""
    out = torch.zeros(size, 4, dtype=rc.dtype, device=rc.device)
    if rc.numel():
        out = out.scatter_reduce(0, owner.unsqueeze(1).expand(-1, 4), torch.cat([rc, -rc], 1), "amin",
                                 include_self=False)
    return out


def _blocks(order: Tensor, rc: Tensor, lo: Tensor, b: int) -> Tensor:
    """The ``blk`` rows of the host ``_pack``: slot ``order[k]`` at block ``rc[k] = (row, col)``, its offsets
    (elements) from ``lo [n, 2]``, the least staged row and column (blocks) of its CTA, then 0."""
    if order.numel() == 0:
        return torch.zeros(1, 4, dtype=torch.int32, device=order.device)
    off = (rc - lo) * b
    return F.pad(torch.cat([order.unsqueeze(1).to(off.dtype), off], 1), (0, 1)).to(torch.int32)


def _pack(rows: Tensor, owner: Tensor, order: Tensor, rc: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """The host ``_pack`` on tensors: ``rows [size, 8]`` in block units (zero rows past the used ones; its columns
    3 and 5 are overwritten), the blocks in position order (slot ``order[k]`` at block ``rc[k]``) owned by CTA
    ``owner[k]``."""
    blk = _blocks(order, rc, rows[owner, 2:5:2], b)
    rows[:, 3:6:2].sub_(rows[:, 2:5:2])                # a_hi, b_hi -> a_len, b_len
    # first and count stay in blocks, the rest in elements
    return torch.cat([rows[:, :2], rows[:, 2:] * b], 1).to(torch.int32), blk


def tile_rows(meta, with_bias: bool, cap: int, size: int, tiles: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """``(cta [size, 8], blk)`` of the "tiles" layout (``_dw_tile_rows`` + ``_pack``, zero rows after) for the cut of
    the grid in ``tiles = (nr, nc)`` rectangles (``dw_tiles``)."""
    (R, C), dev, n = meta.grid, meta.device, meta.n_blocks
    nr, nc = tiles
    rr, cc = meta.row_idx.long(), meta.col_idx.long()
    cell = _band(rr, R, nr) * nc + _band(cc, C, nc)
    pcell, order = torch.sort(cell, stable=True)      # blocks by rectangle, slot order inside one
    bound = torch.searchsorted(pcell, torch.arange(nr * nc + 1, device=dev))     # each rectangle's first position
    cstart, count = bound[:-1], bound[1:] - bound[:-1]
    parts = _ceil(count, cap)
    band_parts = parts.view(nr, nc).sum(1)
    empty_band = (band_parts == 0) if with_bias else torch.zeros_like(band_parts)
    units = torch.cat([parts.view(nr, nc), empty_band.view(nr, 1)], 1).reshape(-1)
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
    qL = q * L
    fq = qL // P
    first = cstart[cid] + fq
    n_in = (qL + L) // P - fq
    # the CTA of each block position: its rectangle's first CTA + the part its place in the rectangle falls in
    w = torch.arange(n, device=dev) - cstart[pcell]
    owner = ustart[pcell + pcell // nc] + ((w + 1) * parts[pcell] - 1) // count[pcell].clamp(min=1)
    rc = torch.stack([rr, cc], 1)[order]
    lo_hi = _ranges(owner, rc, size)
    hi = 1 - lo_hi[:, 2:]                             # one past the largest row and column
    blocks = used & ~bias_only
    zero = torch.zeros_like(t)
    rows = torch.stack([first, n_in, lo_hi[:, 0], hi[:, 0], lo_hi[:, 1], hi[:, 1], zero, zero], 1)
    rows *= blocks.unsqueeze(1)
    if with_bias:   # a band's first CTA stages and sums the whole band; a band without blocks takes a bias-only CTA
        whole = (blocks & (t == ustart[band * (nc + 1)])) | bias_only
        span = torch.stack([band, band + 1], 1) * R // nr
        staged = rows.view(size, 2, 4)[:, :, 2:4]     # columns 2:4 (staged rows) and 6:8 (bias rows) at once
        staged.copy_(torch.where(whole.view(size, 1, 1), span.unsqueeze(1), staged))
    return _pack(rows, owner, order, rc, meta.block)


def _chain(s_of: Tensor, cap: int, span: int, size: int, most: int) -> Tensor:
    """Starts of the greedy groups over positions ``0..n-1`` (``s_of[:n]`` the non-decreasing strip, ``s_of[n]`` past
    its last value): a group from ``p`` ends at ``min(p + cap, first k with strip[k] >= strip[p] + span)``.
    ``[size + 1]`` positions, ``n`` past the last; no topology has more than ``most`` groups."""
    n, dev = s_of.numel() - 1, s_of.device
    # the next group's start from each position 0..n; position n (s_of[n] + span is past every strip) leads to itself
    jump = torch.minimum(torch.arange(cap, n + 1 + cap, device=dev), torch.searchsorted(s_of[:n], s_of + span))
    # pointer doubling on the answer: with jump = next^(2^k), the starts 2^k .. 2^(k+1)-1 are jump of the starts
    # 0 .. 2^k-1 (each round appends them); 2^k_max >= most + 1 starts, the ones after are all n
    k_max = max(1, int(min(most, size)).bit_length())
    pos = torch.zeros(1, dtype=torch.long, device=dev)
    for k in range(k_max):
        pos = torch.cat([pos, jump[pos]])
        if k + 1 < k_max:
            jump = jump[jump]
    return pos[:size + 1] if pos.numel() > size else F.pad(pos, (0, size + 1 - pos.numel()), value=n)


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
    (R, C), dev, n, b = meta.grid, meta.device, meta.n_blocks, meta.block
    pos = torch.arange(n, device=dev)
    if x_whole:     # dY in strips of block rows: the blocks in CSR order
        order, rr, cc = pos, meta.row_idx, meta.col_idx
        strip, s_end = rr, R
    else:           # X in strips of block columns: the blocks in transpose order
        order, rr = meta.t_slot, meta.t_row_idx
        cc = meta.col_idx[order]
        strip, s_end = cc, C
    s_of = F.pad(strip, (0, 1), value=s_end)           # the strip of each position; position n: one past the last
    # at most n // cap groups end at the cap, ceil(s_end / w) at the strip width (their strips >= w apart), and the last
    chain = _chain(s_of, cap, strip_blocks, size, n // cap + _ceil(s_end, strip_blocks) + 1)
    starts, ends = chain[:-1], chain[1:]               # groups past the last start and end at n
    cnt = ends - starts
    s0, s1 = s_of[starts], s_of[ends - 1] + 1          # s0 = s_end past the last group
    owner_group = torch.searchsorted(ends, pos, right=True)     # the group of each position
    rc = torch.stack([rr, cc], 1)
    if x_whole:
        return _strip_rows_dy(meta, with_bias, size, strip_blocks, (order, rc, owner_group),
                              (chain, cnt, s0, s1))
    zero = torch.zeros_like(cnt)
    if n == 0:      # no block (known on the host): one bias-only CTA over all rows, or none
        rows = torch.zeros(size, 8, dtype=torch.long, device=dev)
        if with_bias:
            rows[0, 3] = rows[0, 7] = R
        return _pack(rows, pos, order, rc, b)
    real = starts < n                                  # one CTA per group, kept in place; bias rows cut in even bands
    if with_bias:
        ng = real.sum().clamp(min=1)
        bias = torch.arange(0, (size + 1) * R, R, device=dev) // ng
        blo, bhi = bias[:-1], bias[1:]
    else:
        blo = bhi = zero
    rows = torch.stack([starts, cnt, zero, torch.full_like(zero, R), s0, s1, blo, bhi], 1)
    blk = _blocks(order, rc, rows[owner_group, 2:5:2], b)
    rows[:, 2:].mul_(b)
    rows[:, 5].sub_(rows[:, 4])                        # b_hi -> b_len
    return (rows * real.unsqueeze(1)).to(torch.int32), blk   # zero rows past the last group


def _strip_rows_dy(meta, with_bias, size, w, blocks, groups):
    """The "strips" rows where dY is cut in strips of block rows: bias-only CTAs fill each gap before a group (when
    its strip with the gap would span more than ``w`` rows) and after the last group, in pieces of ``w`` rows.

    Group ``g`` takes ``units[g]`` rows: its gap pieces, then its own CTA. The pieces after the last group are
    the "tail" unit at ``g = n_groups`` (a group with no CTA of its own, its strip starting at ``s0 = R``)."""
    (order, rc, owner_group), (chain, cnt, s0, s1) = blocks, groups
    (R, C), b, n = meta.grid, meta.block, meta.n_blocks
    # real[g]: g is a group; edge[g]: g-1 is a group, g is not (the tail); edge[g + 1]: g is the last group
    flags = F.pad(chain < n, (1, 0), value=True)
    edge = flags[:-1] ^ flags[1:]
    real, tail, last = flags[1:-1], edge[:-1], edge[1:]
    p = F.pad(s1, (1, 0))[:-1]                        # each group starts where the one before it ended
    gap = s1 - p > w                                  # (then p < s0: a group's strip spans at most w rows)
    lo = torch.where(gap, s0, p)
    a_lo = torch.minimum(lo, s0)
    hi = s1.masked_fill(last & (a_lo >= R - w), R)   # the last group takes the rows after it if they fit
    start = F.pad(hi, (1, 0))[:-1]                    # where the pieces start: p, or the last group's hi at the tail
    zero = torch.zeros_like(cnt)
    n_piece = _ceil(s0 - start, w) * (gap | tail) if with_bias else zero
    units = n_piece + real
    ends = units.cumsum(0)
    t = torch.arange(size, device=s0.device)
    u = torch.searchsorted(ends[:-1], t, right=True)   # the group of each row (rows past the last: group size-1)
    used = t < ends[-1]
    bias = (lo, hi) if with_bias else (a_lo, a_lo)
    # per group: its own CTA's row (columns 2..7 and the pieces' range in elements), its first row, its pieces
    table = torch.stack([chain[:-1], cnt, a_lo, hi, zero, torch.full_like(zero, C), *bias, start, s0,
                         ends - units, n_piece], 1)
    blk = _blocks(order, rc, table[owner_group, 2:5:2], b)
    table[:, 2:10].mul_(b)
    row = table[u]
    q = t - row[:, 10]                                # the row's place in its group's units
    piece_lo = row[:, 8] + q * (w * b)
    piece_hi = torch.minimum(piece_lo + w * b, row[:, 9])
    piece = torch.stack([zero, zero, piece_lo, piece_hi, zero, zero, piece_lo, piece_hi], 1)
    rows = torch.where((q == row[:, 11]).unsqueeze(1), row[:, :8], piece)   # the own CTA follows the pieces
    rows[:, 3].sub_(rows[:, 2])                       # a_hi -> a_len
    return (rows * used.unsqueeze(1)).to(torch.int32), blk   # zero rows past the last
