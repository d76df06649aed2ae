"""Host-built index tables of the CUDA kernels (``csrc/bs_dds.cu``, ``csrc/bs_dw.cu``), derived from a
:class:`~.meta.BlockSparseMeta` and cached on it. Plain torch, so they are tested anywhere.

Each table has a size that a mask update of the same active count can keep (the entry lists at their largest, the
weight-gradient CTA table with room to spare), and a rule in :data:`~.meta.REFILL`, so
:meth:`~.meta.BlockSparseMeta.rewrite_` refills them in place and a CUDA graph that launched these kernels stays
valid; a new topology that outgrows the CTA table takes new metadata instead.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsetrain.kernels.blocksparse.meta import REFILL, keep_as_is, same_builder

STRIP_BLOCKS = 32  # widest column strip a CTA of the weight-gradient kernel stages of its strip operand (blocks)


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
        b = meta.block
        slot, oblk = slot.long(), oblk.long()
        last = torch.ones_like(oblk)
        if oblk.numel() > 1:
            last[:-1] = (oblk[1:] != oblk[:-1]).long()
        info = torch.stack([torch.where(slot >= 0, slot * b * b, -1), kidx.long() * b, oblk * b, last], dim=1)
        meta._groups[key] = info.to(torch.int32).contiguous()
    return meta._groups[key]


def warp_ranges(meta, forward: bool, n_ranges: int) -> Tensor:
    """:func:`warp_bounds` of the entry list of ``entry_info(meta, forward)``, cached on the metadata."""
    key = ("bs_wbound", forward, n_ranges)
    if key not in meta._groups:
        meta._groups[key] = warp_bounds(meta.padded_entries(forward, 1, fixed=True)[0], n_ranges)
    return meta._groups[key]


def warp_bounds(pptr: Tensor, n_ranges: int) -> Tensor:
    """First entry of each of ``n_ranges`` warp ranges (+ the end), cut at output-block boundaries so that the
    entry counts are as even as the blocks allow."""
    ptr = pptr.long()  # no host sync: the total stays on the device
    targets = torch.div(torch.arange(n_ranges + 1, device=ptr.device, dtype=torch.long) * ptr[-1], n_ranges,
                        rounding_mode="floor")
    idx = torch.searchsorted(ptr, targets).clamp(max=ptr.numel() - 1)
    return ptr[idx].to(torch.int32).contiguous()


def ks_table(meta, forward: bool, ob: int, kp: int) -> tuple[Tensor, Tensor, Tensor, int, int]:
    """Per-warp flat entry lists of the K-streamed kernel: ``(info [E, 2], wstart [n_warps + 1],
    counts [n_warps, n_parts, ob], n_parts, n_out)``. Warp ``w`` owns output blocks ``w*ob .. w*ob + ob - 1`` and
    walks its entries in (K part, output block, k) order; ``info`` = (value offset, column inside the part)."""
    key = ("bs_ks", forward, ob, kp)
    if key not in meta._groups:
        b, dev = meta.block, meta.device
        if forward:
            out_blk, kidx = meta.row_idx.long(), meta.col_idx.long()
            slot = torch.arange(meta.n_blocks, device=dev)
            n_out, k = meta.grid[0], meta.in_features
        else:
            counts_c = (meta.col_ptr[1:] - meta.col_ptr[:-1]).long()
            out_blk = torch.repeat_interleave(torch.arange(meta.grid[1], device=dev), counts_c)
            kidx, slot = meta.t_row_idx.long(), meta.t_slot.long()
            n_out, k = meta.grid[1], meta.out_features
        n_parts, n_warps = _cdiv(k, kp), _cdiv(n_out, ob)
        gw, jj, part = out_blk // ob, out_blk % ob, kidx * b // kp
        cell = (gw * n_parts + part) * ob + jj
        order = torch.argsort(cell * (k // b) + kidx, stable=True)
        info = torch.stack([slot * b * b, kidx * b - part * kp], dim=1)[order].to(torch.int32).contiguous()
        if info.numel() == 0:
            info = torch.zeros(1, 2, dtype=torch.int32, device=dev)
        wstart = torch.zeros(n_warps + 1, dtype=torch.long, device=dev)
        wstart[1:] = torch.bincount(gw, minlength=n_warps).cumsum(0)
        counts = torch.bincount(cell, minlength=n_warps * n_parts * ob).to(torch.int32)
        meta._groups[key] = (info, wstart.to(torch.int32), counts.contiguous(), n_parts, n_out)
    return meta._groups[key]


def dw_table(meta, with_bias: bool, cap: int) -> tuple[Tensor, Tensor, int, int]:
    """CTA table of the weight-gradient kernel: ``(cta [n_cta, 8], blk [n_blocks, 4], a_width, b_width)``, the CTA
    rows followed by :func:`dw_room` empty ones (no blocks, no bias columns: such a CTA returns at once) that a
    later topology may fill (:meth:`~.meta.BlockSparseMeta.rewrite_`). Cached on the metadata, with the number
    of CTAs that hold work (:func:`dw_ctas_used`).

    Orientation: the narrower of X (``in_features``) and dY (``out_features``) is staged whole per token chunk;
    the blocks are walked in the order of the other one's block index (rows: CSR order, dY strips; columns:
    transpose order, X strips) and cut into CTAs of at most ``cap`` blocks whose strip spans at most
    ``STRIP_BLOCKS`` blocks. ``cta`` rows: first block, count, dY column range (start, width), X column range,
    bias column range (disjoint over the CTAs, inside the dY range; bias-only CTAs with no blocks cover rows no
    block CTA can take). ``blk`` rows: slot, column of its dY strip / X strip in the staged ranges, 0.
    Built on the host from the index arrays, once per topology (cached on the metadata)."""
    key = ("bs_dw_table", with_bias, cap)
    if key in meta._groups:
        return meta._groups[key]
    cta, blk, _, _ = _dw_rows(meta, with_bias, cap)
    used = cta.shape[0]
    table = (torch.cat([cta, cta.new_zeros(dw_room(used), 8)]), blk, *dw_widths(meta))
    meta._groups[key] = table
    meta._groups[("bs_dw_used", with_bias, cap)] = used
    return table


def dw_widths(meta) -> tuple[int, int]:
    """The staged widths ``(a_width, b_width)`` the weight-gradient kernel launches with: the widest any topology
    of this grid can need (the strip side at most STRIP_BLOCKS blocks, the other side whole), so a mask update
    never outgrows them. Its shared memory is ``2 * 2 * tc * (a_width + 8 + b_width + 8)`` bytes."""
    b, (R, C) = meta.block_rows, meta.grid
    if meta.in_features <= meta.out_features:   # X staged whole, dY strips by block row
        return min(STRIP_BLOCKS, R) * b, C * b
    return R * b, min(STRIP_BLOCKS, C) * b


def dw_room(n_cta: int) -> int:
    """Empty CTA rows kept after a table of ``n_cta`` CTAs, for the topologies of later mask updates."""
    return max(8, n_cta // 4)


def dw_ctas_used(meta, with_bias: bool, cap: int) -> int:
    """CTAs of ``dw_table(meta, with_bias, cap)`` that held work when it was built (the token split is chosen
    for them)."""
    dw_table(meta, with_bias, cap)
    return meta._groups[("bs_dw_used", with_bias, cap)]


def _dw_rows(meta, with_bias: bool, cap: int) -> tuple[Tensor, Tensor, int, int]:
    """The CTA rows of :func:`dw_table` without its spare rows."""
    b, R, C = meta.block, meta.grid[0], meta.grid[1]
    rows_full_x = meta.in_features <= meta.out_features  # X staged whole, dY strips by block row
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
    blk = []
    pos_cta = {}
    for ci, c in enumerate(ctas):
        for k in range(c[0], c[0] + c[1]):
            pos_cta[k] = ci
    for k in range(n):
        c = ctas[pos_cta[k]]
        blk.append([order[k], (rr[k] - c[2]) * b, (cc[k] - c[4]) * b, 0])
    a_width = max((c[3] - c[2]) * b for c in ctas) if ctas else b
    b_width = max(((c[5] - c[4]) * b for c in ctas), default=b) or b
    dev = meta.device
    return (torch.tensor([[c[0], c[1], c[2] * b, (c[3] - c[2]) * b, c[4] * b, (c[5] - c[4]) * b, c[6] * b,
                           c[7] * b] for c in ctas] or [[0] * 8], dtype=torch.int32, device=dev),
            torch.tensor(blk or [[0, 0, 0, 0]], dtype=torch.int32, device=dev), a_width, b_width)


def _refill_dw_table(new, key: tuple, value) -> list[tuple[Tensor, Tensor]] | None:
    """The new topology's CTA rows in the kept table, if they fit: no more CTAs than its rows (the staged widths
    are the largest any topology needs, :func:`dw_widths`)."""
    cta, blk, aw, bw = value
    fresh, fresh_blk, new_aw, new_bw = _dw_rows(new, key[1], key[2])
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
