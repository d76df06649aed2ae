"""Triton kernels for skinny sparse inference: ``Y = X·Wᵀ`` with ``W`` stored as bitmap + packed values.

Format (built by :func:`sparsetrain.kernels.spmm.bitmap.compress_bitmap`): ``W [M, K]`` is cut into tiles of
``BM x 64`` (``BM`` rows of ``W``, 64 input features). Per tile:

- ``bitmap`` (8 bytes per tile row): bit ``j`` of byte ``c`` of row ``r`` says whether ``W[r, 8c + j]`` != 0;
- ``values``: row by row, one 0 (the row's "zero slot") followed by the row's nonzeros, left to right;
- ``row_offsets`` (int16, ``BM``): index of each row's zero slot relative to the tile's first value;
- ``tile_offsets`` (int32): index in ``values`` of the tile's first value.

Decoding a tile ("load as sparse, compute as dense") is :func:`_tile_loads` + :func:`_assemble`. Each thread
owns 8 adjacent columns of one row (a "chunk", one bitmap byte). For every column it needs the position of
its value inside the row: 0 (the zero slot) when the bit is clear, else 1 + (set bits of the row before the
column). The chunk's part, "set bits of the row before the chunk", is two POPC instructions on the row's
64-bit bitmap under a per-chunk mask; the in-chunk part is computed for the 8 columns at once, one byte per
column, with a few multiplies (SWAR): the bits are spread to one byte each, a multiply by 0x01010101 sums
them into every higher byte, and an AND with the spread bits times 0xFF zeroes the clear columns. Each
column then costs one byte extract, one IMAD.WIDE address and one *unpredicated* 2-byte load: the zero slot
turns "absent" into an ordinary load, and the stored row offsets remove every cross-thread prefix scan
(docs/history/inference.md has the instruction counts of the versions tried). The 8 column tensors are stacked with
``tl.join`` into the dense ``[BM, 64]`` tile that ``tl.dot`` multiplies on the tensor cores: the zeros cost
math but no bytes.

Measured on an H200 this kernel runs at 0.3-0.6x of cuBLAS reading the dense fp16 weight, at every sparsity
tried: each weight element costs about 10 SASS instructions (128-row tiles) including one scattered 2-byte
load, and Nsight Compute shows the L1/TEX pipe 84% busy while DRAM is 12% busy. docs/history/inference.md has
the numbers and what could close the gap. The format is still 3-5x smaller than dense.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _popcount(v, USE_POPC: tl.constexpr):
    """Set bits of each uint32 in ``v`` (int32 result): POPC on GPUs, SWAR under the interpreter."""
    if USE_POPC:
        return libdevice.popc(v.to(tl.int32, bitcast=True))
    else:
        v = v - ((v >> 1) & 0x55555555)
        v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
        v = (v + (v >> 4)) & 0x0F0F0F0F
        return ((v * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _slot_bytes(nibble, first):
    """4 columns' value slots, one byte each: ``first + rank`` where the bit is set, 0 where it is clear.

    ``nibble`` (uint32, 4 bits) are the columns' bits; ``first`` (uint32) the slot of the first set bit.
    Also returns the number of set bits.
    """
    # bit i times 2**(7k) lands at bit i + 7k; i == k is bit 8i, and no two (i, k) pairs collide (7 > 3).
    spread = (nibble * 0x00204081) & 0x01010101
    inclusive = spread * 0x01010101  # byte j = set bits among columns 0..j (each byte <= 4: no carries)
    # present byte j: first + inclusive_j - 1; (first - 1) * spread puts first - 1 in present bytes only.
    return (inclusive & (spread * 0xFF)) + spread * (first - 1), inclusive >> 24


@triton.jit
def _column(row_ptr, slots, elem_bytes, values_ptr, J: tl.constexpr):
    """Column ``J`` (0..3) of every chunk: the value at its slot (the row's zero slot when absent)."""
    slot = (slots >> (8 * J)) & 0xFF
    # Byte address times a run-time element size: one IMAD.WIDE per element instead of a LEA pair.
    offset = slot.to(tl.uint64) * elem_bytes.to(tl.uint32).to(tl.uint64)
    return tl.load((row_ptr + offset).to(values_ptr.dtype))


@triton.jit
def _tile_meta(bitmap32_ptr, row_off_ptr, tile_off_ptr, tile, BM: tl.constexpr):
    """What decoding ``tile`` needs first: (first value index, row offsets [BM], low/high bitmap words)."""
    rows = tl.arange(0, BM)
    start = tl.load(tile_off_ptr + tile)
    row_off = tl.load(row_off_ptr + tile * BM + rows).to(tl.int32)
    word_lo = tl.load(bitmap32_ptr + tile * (2 * BM) + rows * 2).to(tl.uint32, bitcast=True)
    word_hi = tl.load(bitmap32_ptr + tile * (2 * BM) + rows * 2 + 1).to(tl.uint32, bitcast=True)
    return start, row_off, word_lo, word_hi


@triton.jit
def _tile_loads(values_ptr, start, row_off, word_lo, word_hi, elem_bytes, BM: tl.constexpr,
                USE_POPC: tl.constexpr):
    """Issues the 8 value loads of every chunk of one tile; returns the 8 column tensors [BM, 8]."""
    chunks = tl.arange(0, 8)
    row_ptr = values_ptr.to(tl.pointer_type(tl.int8)) + (start + row_off) * elem_bytes
    # Set bits of the row before each chunk: popcount of the row's two words under per-chunk masks.
    before = (chunks * 8).to(tl.uint32)  # columns of the row before the chunk
    mask_lo = tl.where(before >= 32, 0xFFFFFFFF, (1 << tl.minimum(before, 31)) - 1).to(tl.uint32)
    mask_hi = tl.where(before > 32, (1 << (tl.maximum(before, 32) - 32)) - 1, 0).to(tl.uint32)
    lo_w = word_lo[:, None]
    hi_w = word_hi[:, None]
    set_before = _popcount(lo_w & mask_lo[None, :], USE_POPC) + _popcount(hi_w & mask_hi[None, :], USE_POPC)
    # The chunk's own byte is cut from the same words (a contiguous byte load would let Triton give each
    # thread 4 adjacent chunks, and a warp's value loads would then spread over 16 rows instead of 4).
    own = tl.where((chunks < 4)[None, :], lo_w, hi_w)
    bits = (own >> ((chunks % 4) * 8).to(tl.uint32)[None, :]) & 0xFF
    first = (set_before + 1).to(tl.uint32)  # slot of the chunk's first nonzero (slot 0 is the zero)
    lo, count_lo = _slot_bytes(bits & 0xF, first)
    hi, _ = _slot_bytes(bits >> 4, first + count_lo)
    p = row_ptr[:, None]
    c0 = _column(p, lo, elem_bytes, values_ptr, 0)
    c1 = _column(p, lo, elem_bytes, values_ptr, 1)
    c2 = _column(p, lo, elem_bytes, values_ptr, 2)
    c3 = _column(p, lo, elem_bytes, values_ptr, 3)
    c4 = _column(p, hi, elem_bytes, values_ptr, 0)
    c5 = _column(p, hi, elem_bytes, values_ptr, 1)
    c6 = _column(p, hi, elem_bytes, values_ptr, 2)
    c7 = _column(p, hi, elem_bytes, values_ptr, 3)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _assemble(c0, c1, c2, c3, c4, c5, c6, c7, BM: tl.constexpr):
    """The dense [BM, 64] tile from the 8 column tensors [BM, 8] (column j of chunk c -> 8c + j)."""
    # tl.join adds a trailing axis of 2; nesting (0,4),(2,6) | (1,5),(3,7) makes the three new axes read
    # bit2, bit1, bit0 of the column, so a plain reshape puts column j of chunk c at 8c + j.
    w = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)), tl.join(tl.join(c1, c5), tl.join(c3, c7)))
    return tl.reshape(w, (BM, 64))


@triton.jit
def _multiply(acc, w, x_ptr, kt, K, offs_k, offs_n, n_ok, stride_xk, stride_xn, IEEE: tl.constexpr):
    """acc += w @ X[:, 64 kt : 64 kt + 64]ᵀ (X columns past K read as 0)."""
    k = kt * 64 + offs_k
    xt = tl.load(x_ptr + k[:, None] * stride_xk + offs_n[None, :] * stride_xn,
                 mask=(k[:, None] < K) & n_ok[None, :], other=0.0)
    if IEEE:
        return tl.dot(w, xt, acc, input_precision="ieee")
    else:
        return tl.dot(w, xt, acc)


@triton.jit
def spmm_bitmap_kernel(
    x_ptr,         # [N, K] activations (row stride stride_xn, column stride stride_xk)
    bitmap32_ptr,  # uint32 [TM, TK, BM, 2]: each tile row's 64-bit bitmap as (low word, high word)
    row_off_ptr,   # int16 [TM, TK, BM]: zero slot of each tile row, relative to the tile's first value
    values_ptr,    # values, tile by tile (row-tile major), row by row: zero slot then the nonzeros
    tile_off_ptr,  # int32 [TM, TK]: index in values of each tile's first value
    bias_ptr,      # [M] bias, read only when HAS_BIAS
    y_ptr,         # [N, M] output (row stride stride_yn, column stride stride_ym); every element written
    ws_ptr,        # fp32 [>= N * M] split-K workspace: all zeros between launches (the last program rezeroes)
    lock_ptr,      # int32 [>= TM] split-K arrival counters: all zeros between launches
    N, M, K, stride_xn, stride_xk, stride_yn, stride_ym, num_k_tiles, tiles_per_split, split_k, elem_bytes,
    BM: tl.constexpr,
    BN: tl.constexpr,        # N padded to a power of two >= 16 (tensor-core minimum)
    ATOMIC: tl.constexpr,    # split_k > 1: split_k programs share one row tile, each over tiles_per_split
    HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr,      # fp32 operands: exact fp32 products instead of tf32
    USE_POPC: tl.constexpr,  # False under the interpreter, which has no popc
):
    BK: tl.constexpr = 64
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    kt_begin = pid_s * tiles_per_split
    kt_end = tl.minimum(kt_begin + tiles_per_split, num_k_tiles)
    offs_n = tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    n_ok = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    # A hand-written software pipeline (values of tile kt+1 and metadata of kt+2 in flight while tile kt is
    # multiplied, two tiles per iteration) was measured no faster than this plain loop (docs/history/inference.md).
    for kt in range(kt_begin, kt_end):
        tile = pid_m * num_k_tiles + kt
        start, row_off, w_lo, w_hi = _tile_meta(bitmap32_ptr, row_off_ptr, tile_off_ptr, tile, BM)
        c0, c1, c2, c3, c4, c5, c6, c7 = _tile_loads(values_ptr, start, row_off, w_lo, w_hi, elem_bytes, BM,
                                                     USE_POPC)
        acc = _multiply(acc, _assemble(c0, c1, c2, c3, c4, c5, c6, c7, BM), x_ptr, kt, K, offs_k, offs_n,
                        n_ok, stride_xk, stride_xn, IEEE)
    rows = pid_m * BM + tl.arange(0, BM)
    y_mask = (rows[:, None] < M) & n_ok[None, :]
    y_ptrs = y_ptr + offs_n[None, :] * stride_yn + rows[:, None] * stride_ym
    if not ATOMIC:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        # Split-K in one launch: every program adds its partial sum into the fp32 workspace; the last one
        # to arrive for this row tile (arrival counter) reads the total, rezeroes the workspace and writes Y.
        ws_ptrs = ws_ptr + offs_n[None, :] * M + rows[:, None]
        tl.atomic_add(ws_ptrs, acc, mask=y_mask, sem="relaxed")
        tl.debug_barrier()  # all threads' adds are issued before the release below
        arrived = tl.atomic_add(lock_ptr + pid_m, 1, sem="acq_rel")
        if arrived == split_k - 1:
            # Read the total where the atomics live (L2), then rezero it for the next launch: every other
            # program of this row tile has already added, so a plain store cannot race.
            total = tl.atomic_add(ws_ptrs, tl.zeros((BM, BN), dtype=tl.float32), mask=y_mask, sem="relaxed")
            total = tl.where(y_mask, total, 0.0)  # masked-off lanes return nothing defined
            tl.store(ws_ptrs, tl.zeros((BM, BN), dtype=tl.float32), mask=y_mask)
            if HAS_BIAS:
                total += tl.load(bias_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(lock_ptr + pid_m, 0)


@triton.jit
def decode_bitmap_kernel(
    bitmap32_ptr,  # uint32 [TM, TK, BM, 2]: each tile row's 64-bit bitmap as (low word, high word)
    row_off_ptr,   # int16 [TM, TK, BM] zero slot of each tile row, relative to the tile's first value
    values_ptr,    # values (see spmm_bitmap_kernel)
    tile_off_ptr,  # int32 [TM, TK] first value of each tile
    out_ptr,       # [M, K] dense output, row stride stride_om, unit column stride; every element written
    M, K, stride_om, num_k_tiles, elem_bytes,
    BM: tl.constexpr,
    USE_POPC: tl.constexpr,
):
    """Expands the compressed weight to dense (used for N > 64, where a dense GEMM is compute-bound)."""
    pid_m = tl.program_id(0)
    kt = tl.program_id(1)
    tile = pid_m * num_k_tiles + kt
    start, row_off, w_lo, w_hi = _tile_meta(bitmap32_ptr, row_off_ptr, tile_off_ptr, tile, BM)
    c0, c1, c2, c3, c4, c5, c6, c7 = _tile_loads(values_ptr, start, row_off, w_lo, w_hi, elem_bytes, BM,
                                                 USE_POPC)
    w = _assemble(c0, c1, c2, c3, c4, c5, c6, c7, BM)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = kt * 64 + tl.arange(0, 64)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], w,
             mask=(rows[:, None] < M) & (cols[None, :] < K))


@triton.jit
def decode_pair_kernel(
    bitmap_ptr,    # int32 [TM, TK, BM]: bit p of a row = pair p (columns 2p, 2p + 1) stored
    row_off_ptr,   # int16 [TM, TK, BM]: each row's first value relative to its tile's first
    values_ptr,    # stored pairs (pair.PairWeight.values)
    tile_off_ptr,  # int32 [TM, TK]: first value of each tile
    out_ptr,       # [M, K] dense output, row stride stride_om, unit column stride; every element written
    M, K, stride_om, num_k_tiles,
    BM: tl.constexpr,
):
    """Expands a pair-bitmap weight to dense, one program per 128 x 64 tile (prefill: N > 64 tokens)."""
    pid_m = tl.program_id(0)
    kt = tl.program_id(1)
    tile = pid_m * num_k_tiles + kt
    start = tl.load(tile_off_ptr + tile).to(tl.int64)
    r = tl.arange(0, BM)
    word = tl.load(bitmap_ptr + tile * BM + r)
    row_off = tl.load(row_off_ptr + tile * BM + r).to(tl.int64)
    bits = (word[:, None] >> tl.arange(0, 32)[None, :]) & 1  # [BM, 32]
    rank = tl.cumsum(bits, axis=1) - bits                    # stored pairs before pair p in its row
    idx = start + row_off[:, None] + 2 * rank.to(tl.int64)
    present = bits != 0
    lo = tl.load(values_ptr + idx, mask=present, other=0.0)
    hi = tl.load(values_ptr + idx + 1, mask=present, other=0.0)
    w = tl.interleave(lo, hi)  # [BM, 64]: column 2p = lo, 2p + 1 = hi
    rows = pid_m * BM + r
    cols = kt * 64 + tl.arange(0, 64)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], w,
             mask=(rows[:, None] < M) & (cols[None, :] < K))


@triton.jit
def decode_csl_kernel(
    values_ptr,    # the nonzeros, tile by tile, sub-tile by sub-tile (csl.CslWeight.values)
    locs_ptr,      # uint8 per value: 16 * (r % 16) + c % 16 inside its 16 x 16 sub-tile
    sub_off_ptr,   # int16 [TM, TK, 32]: first value of each sub-tile relative to its tile's first
    tile_off_ptr,  # int32 [TM, TK]: first value of each tile
    out_ptr,       # [M, K] dense output, row stride stride_om, unit column stride; every element written
    M, K, stride_om, num_k_tiles, nnz,
    BM: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Expands a tiled-CSL weight to dense, one program per 128 x 64 tile (prefill: N > 64 tokens): zero the
    tile, then scatter its nonzeros, CHUNK at a time; a value's sub-tile is the number of sub-tile offsets at or
    below its position minus one."""
    pid_m = tl.program_id(0)
    kt = tl.program_id(1)
    tile = pid_m * num_k_tiles + kt
    rows = pid_m * BM + tl.arange(0, BM)
    cols = kt * 64 + tl.arange(0, 64)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
             tl.zeros((BM, 64), dtype=out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < K))
    tl.debug_barrier()  # the zeros land before any value of this tile (different threads write them)
    start = tl.load(tile_off_ptr + tile)
    n_tiles = tl.num_programs(0) * num_k_tiles
    end = tl.load(tile_off_ptr + tile + 1, mask=tile + 1 < n_tiles, other=nnz)
    sub_off = tl.load(sub_off_ptr + tile * 32 + tl.arange(0, 32)).to(tl.int32)
    for c0 in range(0, end - start, CHUNK):
        rel = c0 + tl.arange(0, CHUNK)
        ok = rel < end - start
        v = tl.load(values_ptr + start + rel, mask=ok, other=0.0)
        loc = tl.load(locs_ptr + start + rel, mask=ok, other=0).to(tl.int32)
        s = tl.sum((sub_off[None, :] <= rel[:, None]).to(tl.int32), axis=1) - 1
        r = pid_m * BM + (s // 4) * 16 + loc // 16
        c = kt * 64 + (s % 4) * 16 + loc % 16
        tl.store(out_ptr + r.to(tl.int64) * stride_om + c, v, mask=ok & (r < M) & (c < K))
