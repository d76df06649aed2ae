"""Host-built index tables of the CUDA kernels (``csrc/bs_dds.cu``, ``csrc/bs_dw.cu``), derived from a
:class:`~.meta.BlockSparseMeta` and cached on it. Plain torch, so they are tested anywhere.

Each table has a size that a mask update of the same active count can keep (the entry lists at their largest, the
weight-gradient CTA table with room to spare, in its "tiles" layout for any topology), and a rule in
:data:`~.meta.REFILL`, so :meth:`~.meta.BlockSparseMeta.rewrite_` refills them in place and a CUDA graph that
launched these kernels stays valid; a new topology that outgrows the CTA table takes new metadata instead.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsetrain.kernels.blocksparse import _dw_fixed
from sparsetrain.kernels.blocksparse.meta import FITS, REFILL, keep_as_is, same_builder

STRIP_BLOCKS = 32  # widest strip a "strips" CTA of the weight-gradient kernel stages of its strip operand (blocks)
# Longest side of a "tiles" rectangle (blocks): both staged widths at most 56 * 16 columns take
# 2 * 2 * 32 * 2 * (896 + 8) = 231424 bytes of shared memory at 32 tokens a chunk (the sm_90 opt-in limit is
# 232448), and a row band's bias columns (at most 896) fit the kernel's 512 threads x 2 columns.
TILE_SIDE = 56
# Expected blocks of the largest "tiles" rectangle, as a fraction of a CTA's cap: room for the spread of a
# topology (at density 0.1, 96 expected blocks; 128 is 3.4 standard deviations above); a fuller rectangle
# takes several CTAs.
TILE_FILL = 0.75

DwLayout = Literal["strips", "tiles"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def entry_info(meta, forward: bool) -> Tensor:
    """``[E, 4]`` int32 per entry of the padded entry list (``meta.padded_entries(forward, 1, fixed=True)``): offset
    of its block in ``values`` (elements; -1 = padding), its column in the dense operand, its output column, and 1
    where it is the last entry of its output block (the kernel stores there). The list's tail past its last real
    entry is padding that no warp range reaches. Cached on the metadata."""
    key = ("bs_dds_info", forward)
    if key not in meta._groups:
        _, kidx, slot, oblk = meta.padded_entries(forward, 1, fixed=True)
        b, E = meta.block, oblk.numel()
        # int32 throughout, out of place (the same build runs batched over layers of one shape, under vmap)
        offset = slot * (b * b)
        if meta.n_blocks * b * b <= 2**31:   # no offset overflows: a padding entry's -b*b clamps to -1
            offset = offset.clamp(min=-1)
        else:
            offset = offset.masked_fill(slot < 0, -1)
        last = F.pad(oblk[1:] != oblk[:-1], (0, 1), value=True) if E else oblk.new_zeros(0, dtype=torch.bool)
        info = torch.stack([offset, kidx * b, oblk * b, last.to(torch.int32)], 1)
        meta._groups[key] = info
    return meta._groups[key]


def warp_ranges(meta, forward: bool, n_ranges: int) -> Tensor:
    """:func:`warp_bounds` of the entry list of ``entry_info(meta, forward)``, cached on the metadata."""
    key = ("bs_wbound", forward, n_ranges)
    if key not in meta._groups:
        meta._groups[key] = warp_bounds(meta.padded_entries(forward, 1, fixed=True)[0], n_ranges,
                                        meta._arange(n_ranges + 1))
    return meta._groups[key]


def warp_bounds(pptr: Tensor, n_ranges: int, steps: Tensor | None = None) -> Tensor:
    """First entry of each of ``n_ranges`` warp ranges (+ the end), cut at output-block boundaries so that the
    entry counts are as even as the blocks allow. ``steps``: ``arange(n_ranges + 1)`` (int64), where the caller
    has one."""
    if steps is None:
        steps = torch.arange(n_ranges + 1, device=pptr.device, dtype=torch.long)
    # no host sync: the total stays on the device. The targets are worked out in int64 and stored in pptr's dtype
    # (searchsorted then compares like with like); each is at most pptr[-1], so every index is in range.
    targets = (steps * pptr[-1]).div(n_ranges, rounding_mode="floor").to(pptr.dtype)
    return pptr[torch.searchsorted(pptr, targets)].to(torch.int32)


def ks_table(meta, forward: bool, ob: int, kp: int) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """Per-warp flat entry lists of the K-streamed kernel: ``(info [E, 2], wstart [n_warps + 1],
    counts [n_warps, n_parts, ob], n_parts, n_out)``. Warp ``w`` owns output blocks ``w*ob .. w*ob + ob - 1`` and
    walks its entries in (K part, output block, k) order; ``info`` = (value offset, column inside the part)."""
    key = ("bs_ks", forward, ob, kp)
    if key not in meta._groups:
        b, dev = meta.block, meta.device
        if forward:
            out_blk, kidx, slot = meta.as_long("row_idx"), meta.as_long("col_idx"), meta._arange(meta.n_blocks)
            n_out, k = meta.grid[0], meta.in_features
        else:   # the column of each transposed entry (no repeat_interleave: its size would wait for the device)
            out_blk, kidx, slot = meta.as_long("t_col"), meta.t_row_idx.long(), meta.t_slot.long()
            n_out, k = meta.grid[1], meta.out_features
        n_parts, n_warps = _cdiv(k, kp), _cdiv(n_out, ob)
        gw, jj, part = out_blk // ob, out_blk % ob, kidx * b // kp
        cell = (gw * n_parts + part) * ob + jj
        order = torch.argsort(cell * (k // b) + kidx, stable=True)
        info = torch.stack([slot * b * b, kidx * b - part * kp], dim=1)[order].to(torch.int32).contiguous()
        if info.numel() == 0:
            info = torch.zeros(1, 2, dtype=torch.int32, device=dev)
        wstart = F.pad(_count(gw, n_warps).cumsum(0), (1, 0))
        counts = _count(cell, n_warps * n_parts * ob).to(torch.int32)
        meta._groups[key] = (info, wstart.to(torch.int32), counts.contiguous(), n_parts, n_out)
    return meta._groups[key]


def _count(idx: Tensor, size: int) -> Tensor:
    """``bincount(idx, minlength=size)`` for ``idx < size``, in a tensor of a size known on the host (a CUDA
    ``bincount`` reads the largest index back first: a host sync)."""
    return torch.zeros(size, dtype=torch.long, device=idx.device).index_add(0, idx, torch.ones_like(idx))


def dw_table(meta, with_bias: bool, cap: int, layout: DwLayout = "strips") -> tuple[Tensor, Tensor, int, int]:
    """CTA table of the weight-gradient kernel: ``(cta [n_cta, 8], blk [n_blocks, 4], a_width, b_width)``, the CTA
    rows followed by :func:`dw_room` empty ones (no blocks, no bias columns: such a CTA returns at once) that a
    later topology may fill (:meth:`~.meta.BlockSparseMeta.rewrite_`). Cached on the metadata, with the number
    of CTAs that hold work (:func:`dw_ctas_used`).

    ``cta`` rows: first block, count (at most ``cap``), dY column range (start, width), X column range, bias
    column range (disjoint over the CTAs, together every dY column once where ``with_bias``, each inside its CTA's
    dY range; a bias-only CTA with no blocks covers rows no block CTA takes). ``blk`` rows: slot, column of its
    dY block / X block in the staged ranges, 0. ``a_width``, ``b_width``: :func:`dw_widths`. Built on the host
    from the index arrays, once per topology. The ``layout`` decides which blocks share a CTA:

    - ``"strips"`` (:func:`_dw_rows`): the narrower of X and dY is staged whole, the other as a strip of at most
      STRIP_BLOCKS block rows (dY) or columns (X);
    - ``"tiles"`` (:func:`_dw_tile_rows`): the block grid cut in rectangles (:func:`dw_tiles`); a CTA stages the
      dY and X columns its blocks span in one rectangle.
    """
    key = ("bs_dw_table", with_bias, cap, layout)
    if key in meta._groups:
        return meta._groups[key]
    cta, blk, _, _ = DW_LAYOUTS[layout].rows(meta, with_bias, cap)
    used = cta.shape[0]
    room = dw_room(used, DW_LAYOUTS[layout].most(meta, cap))
    table = (torch.cat([cta, cta.new_zeros(room, 8)]), blk, *dw_widths(meta, cap, layout))
    meta._groups[key] = table
    meta._groups[("bs_dw_used", with_bias, cap, layout)] = used
    return table


def dw_widths(meta, cap: int, layout: DwLayout = "strips") -> tuple[int, int]:
    """The staged widths ``(a_width, b_width)`` the weight-gradient kernel launches with: the widest any topology
    of this grid and active count can need, so a mask update never outgrows them (strips: the strip side at most
    STRIP_BLOCKS blocks, the other side whole; tiles: the largest rectangle's sides). The kernel's shared memory
    is ``2 * 2 * tc * (a_width + 8 + b_width + 8)`` bytes."""
    return DW_LAYOUTS[layout].widths(meta, cap)


def dw_room(n_cta: int, most: int = 0) -> int:
    """Empty CTA rows kept after a table of ``n_cta`` CTAs, for the topologies of later mask updates: a quarter
    more (at least 8), or up to ``most`` where a layout bounds the CTAs of every topology."""
    return max(8, n_cta // 4, most - n_cta)


def dw_ctas_used(meta, with_bias: bool, cap: int, layout: DwLayout = "strips") -> int:
    """CTAs of ``dw_table(meta, with_bias, cap, layout)`` that held work when it was built (the token split is
    chosen for them)."""
    dw_table(meta, with_bias, cap, layout)
    return meta._groups[("bs_dw_used", with_bias, cap, layout)]


def dw_tiles(grid: tuple[int, int], n_blocks: int, cap: int) -> tuple[int, int]:
    """``(nr, nc)`` of the "tiles" layout: the ``R`` block rows cut in ``nr`` bands of near-equal height
    (``i * R // nr``), the ``C`` block columns in ``nc``. Among the cuts whose largest rectangle
    (``ceil(R/nr) x ceil(C/nc)``) expects at most ``TILE_FILL * cap`` blocks at the grid's density and has sides
    of at most TILE_SIDE, the one that stages the fewest block columns (``nc * R + nr * C``: the sum of every
    rectangle's sides), then the one of fewest rectangles, then of more row bands (more CTAs share the bias sums).

    >>> dw_tiles((192, 48), 922, 128)   # 768 -> 3072 at density 0.1: 5 x 2 rectangles of at most 39 x 24
    (5, 2)
    """
    R, C = grid
    target = TILE_FILL * cap * R * C   # expected blocks <= target / (R * C) in r x c cells: r * c * n <= target
    best = None
    for nr in range(_cdiv(R, TILE_SIDE), R + 1):
        if best is not None and nr * C + R > best[0][0]:   # staged columns only grow from here
            break
        r = _cdiv(R, nr)
        c = max(1, min(C, TILE_SIDE, int(target // (r * n_blocks)) if n_blocks else C))
        nc = _cdiv(C, c)
        score = (nc * R + nr * C, nr * nc, -nr)
        if best is None or score < best[0]:
            best = (score, nr, nc)
    return best[1], best[2]


def _dw_rows(meta, with_bias: bool, cap: int) -> tuple[Tensor, Tensor, int, int]:
    """The CTA rows of the "strips" layout of :func:`dw_table`, without its spare rows: the blocks walked in the
    order of the strip operand's block index (rows: CSR order, dY strips; columns: transpose order, X strips)
    and cut into CTAs of at most ``cap`` blocks whose strip spans at most ``STRIP_BLOCKS`` blocks."""
    R, C = meta.grid[0], meta.grid[1]
    rows_full_x = _x_whole(meta)
    if rows_full_x:
        order = list(range(meta.n_blocks))
        rr, cc = meta.row_idx.tolist(), meta.col_idx.tolist()
        strip = rr
    else:
        order = meta.t_slot.tolist()
        rr = meta.t_row_idx.tolist()
        counts = (meta.col_ptr[1:] - meta.col_ptr[:-1]).tolist()
        cc = [c for c, k in enumerate(counts) for _ in range(k)]
        strip = cc
    n = len(order)
    groups, k = [], 0  # (first, count, strip lo, strip hi) in block units
    while k < n:
        first, s0 = k, strip[k]
        while k < n and k - first < cap and strip[k] - s0 < STRIP_BLOCKS:
            k += 1
        groups.append((first, k - first, s0, strip[k - 1] + 1))
    ctas = []  # first, n, a_lo, a_hi, b_lo, b_hi, bias_lo, bias_hi (block units)
    if rows_full_x:
        prev_hi = 0
        for i, (first, cnt, s0, s1) in enumerate(groups):
            lo = prev_hi
            if s1 - min(lo, s0) > STRIP_BLOCKS:  # empty rows before this group: bias-only CTAs take them
                while lo < s0:
                    hi = min(s0, lo + STRIP_BLOCKS)
                    ctas.append([0, 0, lo, hi, 0, 0, lo, hi])
                    lo = hi
            hi = max(s1, lo)
            if i == len(groups) - 1 and R - min(lo, s0) <= STRIP_BLOCKS:
                hi = R
            ctas.append([first, cnt, min(lo, s0), max(hi, s1), 0, C, lo, hi])
            prev_hi = hi
        while prev_hi < R:  # rows after the last group's reach
            hi = min(R, prev_hi + STRIP_BLOCKS)
            ctas.append([0, 0, prev_hi, hi, 0, 0, prev_hi, hi])
            prev_hi = hi
        if not with_bias:
            ctas = [c for c in ctas if c[1] > 0]
            for c in ctas:
                c[6] = c[7] = c[2]
    else:
        ng = max(1, len(groups))
        for i, (first, cnt, s0, s1) in enumerate(groups or [(0, 0, 0, 0)]):
            blo, bhi = (i * R // ng, (i + 1) * R // ng) if with_bias else (0, 0)
            ctas.append([first, cnt, 0, R, s0, s1, blo, bhi])
        ctas = [c for c in ctas if c[1] > 0 or c[7] > c[6]]
    return _pack(meta, ctas, order, rr, cc)


def _x_whole(meta) -> bool:
    """The "strips" orientation: X (the narrower or equal side) staged whole and dY in strips of block rows;
    else dY whole and X in strips of block columns."""
    return meta.in_features <= meta.out_features


def _strip_widths(meta, cap: int) -> tuple[int, int]:
    b, (R, C) = meta.block_rows, meta.grid
    if _x_whole(meta):
        return min(STRIP_BLOCKS, R) * b, C * b
    return R * b, min(STRIP_BLOCKS, C) * b


def _dw_tile_rows(meta, with_bias: bool, cap: int) -> tuple[Tensor, Tensor, int, int]:
    """The CTA rows of the "tiles" layout of :func:`dw_table`, without its spare rows: rectangle by rectangle
    (row band, then column band), one CTA per rectangle, or several of near-equal counts cut in row order where it
    holds more than ``cap`` blocks; each stages the rows and columns its blocks span. With bias, the first CTA
    of each row band stages the whole band and sums its bias columns (a bias-only CTA where the band holds no
    block)."""
    R, C = meta.grid
    nr, nc = dw_tiles(meta.grid, meta.n_blocks, cap)
    rr, cc = meta.row_idx.tolist(), meta.col_idx.tolist()   # slot order is (row, column) order
    row_band = [i for i in range(nr) for _ in range(i * R // nr, (i + 1) * R // nr)]
    col_band = [j for j in range(nc) for _ in range(j * C // nc, (j + 1) * C // nc)]
    cells = [[[] for _ in range(nc)] for _ in range(nr)]
    for s, (r, c) in enumerate(zip(rr, cc)):
        cells[row_band[r]][col_band[c]].append(s)
    ctas, order = [], []  # CTA rows as in _dw_rows (block units); the slots in block position order
    for i, band in enumerate(cells):
        band_first = len(ctas)
        for slots in band:
            parts = _cdiv(len(slots), cap)
            for q in range(parts):
                part = slots[q * len(slots) // parts:(q + 1) * len(slots) // parts]
                ctas.append([len(order), len(part), rr[part[0]], rr[part[-1]] + 1,
                             min(cc[s] for s in part), max(cc[s] for s in part) + 1, 0, 0])
                order += part
        if with_bias:
            lo, hi = i * R // nr, (i + 1) * R // nr
            if len(ctas) > band_first:
                ctas[band_first][2:4] = ctas[band_first][6:8] = [lo, hi]
            else:
                ctas.append([0, 0, lo, hi, 0, 0, lo, hi])
    return _pack(meta, ctas, order, [rr[s] for s in order], [cc[s] for s in order])


def _tile_widths(meta, cap: int) -> tuple[int, int]:
    (R, C), b = meta.grid, meta.block_rows
    nr, nc = dw_tiles(meta.grid, meta.n_blocks, cap)
    return _cdiv(R, nr) * b, _cdiv(C, nc) * b


def _tile_most(meta, cap: int) -> int:
    """No topology of this grid and active count needs more "tiles" CTAs: a rectangle of ``k > 0`` blocks takes
    ``ceil(k / cap) <= 1 + (k - 1) // cap`` CTAs and a band without blocks one (it has ``nc`` empty rectangles)."""
    nr, nc = dw_tiles(meta.grid, meta.n_blocks, cap)
    return nr * nc + meta.n_blocks // cap


def _pack(meta, ctas: list[list[int]], order: list[int], rr: list[int], cc: list[int]
          ) -> tuple[Tensor, Tensor, int, int]:
    """``(cta, blk, a_width, b_width)`` of CTA rows in block units (first, count, dY block range, X block range,
    bias block range) over the blocks in position order (slot ``order[k]`` at block row ``rr[k]``, column
    ``cc[k]``; the CTAs with blocks take consecutive positions in table order): offsets and widths in columns, the
    widths those of the widest staged ranges."""
    b, dev = meta.block, meta.device
    rows = torch.tensor(ctas or [[0] * 8], dtype=torch.long)
    # the CTA of each block position: the CTAs with blocks cover consecutive positions in table order
    owner = torch.repeat_interleave(torch.arange(rows.shape[0]), rows[:, 1])
    blk = torch.zeros(len(order), 4, dtype=torch.long)
    if order:
        blk[:, 0] = torch.tensor(order)
        blk[:, 1] = (torch.tensor(rr) - rows[owner, 2]) * b
        blk[:, 2] = (torch.tensor(cc) - rows[owner, 4]) * b
    a_width = int((rows[:, 3] - rows[:, 2]).max()) * b if ctas else b
    b_width = int((rows[:, 5] - rows[:, 4]).max()) * b if ctas else b
    out = rows * b
    out[:, :2] = rows[:, :2]
    out[:, 3], out[:, 5] = (rows[:, 3] - rows[:, 2]) * b, (rows[:, 5] - rows[:, 4]) * b
    return (out.to(device=dev, dtype=torch.int32),
            (blk if order else torch.zeros(1, 4, dtype=torch.long)).to(device=dev, dtype=torch.int32),
            a_width, b_width or b)


class _Layout(NamedTuple):
    rows: Callable    # (meta, with_bias, cap) -> (cta, blk, a_width, b_width), no spare rows
    widths: Callable  # (meta, cap) -> the staged widths any topology of the grid and active count fits
    most: Callable    # (meta, cap) -> CTAs no such topology exceeds (0: no bound)


#: The CTA layouts of the weight-gradient kernel, by the name a tuner config carries.
DW_LAYOUTS: dict[str, _Layout] = {
    "strips": _Layout(_dw_rows, _strip_widths, lambda meta, cap: _dw_fixed.strips_most(meta, cap, STRIP_BLOCKS)),
    "tiles": _Layout(_dw_tile_rows, _tile_widths, _tile_most),
}


def _refill_dw_table(new, key: tuple, value) -> list[tuple[Tensor, Tensor]] | None:
    """The new topology's CTA rows in the kept table, built where it lives (:mod:`._dw_fixed`): the table has room
    for every topology of its grid and active count, and the staged widths are the largest any needs
    (:func:`dw_widths`). A table kept from before that room was reserved is refilled from the host build, if the
    rows fit."""
    cta, blk, aw, bw = value
    _, with_bias, cap, layout = key
    if cta.shape[0] >= DW_LAYOUTS[layout].most(new, cap):
        if layout == "tiles":
            fresh, fresh_blk = _dw_fixed.tile_rows(new, with_bias, cap, cta.shape[0], dw_tiles(new.grid, new.n_blocks, cap))
        else:
            fresh, fresh_blk = _dw_fixed.strip_rows(new, with_bias, cap, cta.shape[0], STRIP_BLOCKS, _x_whole(new))
        return [(cta, fresh), (blk, fresh_blk)] if fresh_blk.shape == blk.shape else None
    if new.device.type != "cpu":
        return None
    fresh, fresh_blk, new_aw, new_bw = DW_LAYOUTS[key[3]].rows(new, key[1], key[2])
    if fresh.shape[0] > cta.shape[0] or new_aw > aw or new_bw > bw or fresh_blk.shape != blk.shape:
        return None
    return [(cta, torch.cat([fresh, fresh.new_zeros(cta.shape[0] - fresh.shape[0], 8)])), (blk, fresh_blk)]


REFILL.update({
    "bs_dds_info": same_builder(entry_info),
    "bs_wbound": same_builder(warp_ranges),
    "bs_ks": same_builder(ks_table),
    "bs_dw_table": _refill_dw_table,
    "bs_dw_used": keep_as_is,
})
FITS["bs_dw_table"] = lambda meta, key, value: value[0].shape[0] >= DW_LAYOUTS[key[3]].most(meta, key[2])
