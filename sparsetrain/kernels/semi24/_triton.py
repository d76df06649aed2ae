"""Triton kernel of the transposable 2:4 mask: one pass over ``W`` that picks, per 4x4 tile, the pattern keeping
the largest sum of ``|w|`` (all 90 patterns scored at once with a tiny ``tl.dot``) and writes the bool mask
and, as asked, ``W⊙M``, ``(W⊙M)ᵀ``, or ``W⊙M`` and ``(W⊙M)ᵀ`` already in cuSPARSELt's compressed layout
(values + metadata), which replaces two ``torch._cslt_compress`` calls. The launcher is
:func:`sparsetrain.kernels.semi24.mask.transposable24`; :mod:`.reference` holds the same in plain torch.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _first_last(x):
    """Lowest and highest set bit of 4-bit sets that hold exactly two bits."""
    lo = tl.where((x & 1) != 0, 0, tl.where((x & 2) != 0, 1, 2))
    hi = tl.where((x & 8) != 0, 3, tl.where((x & 4) != 0, 2, 1))
    return lo, hi

@triton.jit
def _count3(x):
    """Set bits among the low three of x."""
    return (x & 1) + ((x >> 1) & 1) + ((x >> 2) & 1)

@triton.jit
def transposable24_kernel(
    w_ptr,      # (N, K) dense weight, any float dtype; row stride stride_w, unit column stride
    mask_ptr,   # (N, K) uint8 view of the bool mask to write (1 = kept), contiguous
    wm_ptr,     # (N, K) W ⊙ M in the compute dtype, contiguous; written when WRITE_WM (sets the dtype)
    wmt_ptr,    # (K, N) (W ⊙ M)ᵀ, compute dtype, contiguous; written when WRITE_T
    pv_ptr,     # (N, K/2) cuSPARSELt values of W ⊙ M (compute dtype); written when PACK
    pm_ptr,     # (N*K/16,) int16 cuSPARSELt metadata words of W ⊙ M; written when PACK
    ptv_ptr,    # (K, N/2) cuSPARSELt values of (W ⊙ M)ᵀ; written when PACK_T
    ptm_ptr,    # (N*K/16,) int16 cuSPARSELt metadata words of (W ⊙ M)ᵀ; written when PACK_T
    pat_ptr,    # (16, NPAT_PAD) float32 0/1: column p marks the 16 cells kept by pattern p
    bits_ptr,   # (NPAT_PAD,) int32: pattern p as a bit set, bit 4*row + col
    N, K, stride_w,
    NPAT: tl.constexpr, NPAT_PAD: tl.constexpr,
    TILES_R: tl.constexpr, TILES_C: tl.constexpr,
    DOT16: tl.constexpr,
    WRITE_WM: tl.constexpr, WRITE_T: tl.constexpr, PACK: tl.constexpr, PACK_T: tl.constexpr,
):
    # Each program owns TILES_R x TILES_C tiles of 4x4; data is held as [tile, cell] so that scoring
    # all patterns of all tiles is one [tiles, 16] x [16, patterns] product on the tensor cores.
    t = tl.arange(0, TILES_R * TILES_C)
    cell = tl.arange(0, 16)
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r.to(tl.int64) * (4 * TILES_R) + 4 * (t // TILES_C)[:, None] + (cell // 4)[None, :]
    cols = pid_c.to(tl.int64) * (4 * TILES_C) + 4 * (t % TILES_C)[:, None] + (cell % 4)[None, :]
    inside = (rows < N) & (cols < K)  # N, K are multiples of 4: tiles are wholly in or out
    w = tl.load(w_ptr + rows * stride_w + cols, mask=inside, other=0.0)
    # Rank the magnitudes of the matrix that is multiplied (w rounded to the compute dtype). fp16/bf16
    # values are exact in tf32 and in 16-bit operands, and their 8-term sums exact in fp32, so kernel and
    # reference choose identically; an fp32 compute dtype is ranked at tf32 precision on the GPU.
    w = w.to(wm_ptr.dtype.element_ty)
    p = tl.arange(0, NPAT_PAD)
    member = tl.load(pat_ptr + cell[:, None] * NPAT_PAD + p[None, :])
    if DOT16:  # bf16 operands: 0/1 times |w| is exact, products accumulate in fp32
        a = tl.abs(w)
        scores = tl.dot(a, member.to(a.dtype), out_dtype=tl.float32)
    else:
        scores = tl.dot(tl.abs(w.to(tl.float32)), member)
    scores = tl.where(p[None, :] < NPAT, scores, float("-inf"))  # padding patterns never win
    best = tl.argmax(scores, axis=1, tie_break_left=True)
    bits = tl.load(bits_ptr + best)
    keep = ((bits[:, None] >> cell[None, :]) & 1) != 0
    tl.store(mask_ptr + rows * K + cols, keep.to(tl.uint8), mask=inside)
    wm = tl.where(keep, w, 0.0)
    if WRITE_WM:
        tl.store(wm_ptr + rows * K + cols, wm, mask=inside)
    if WRITE_T:
        tl.store(wmt_ptr + cols * N + rows, wm, mask=inside)
    # cuSPARSELt packing (layout: the comment above reference.cslt_pack_reference). Programs are 64 rows x 32
    # cols (TILES_R=16, TILES_C=8): t = tr*8 + tc has bits tr3 tr2 tr1 tr0 tc2 tc1 tc0.
    ci = (cell // 4)[None, :]
    cj = (cell % 4)[None, :]
    if PACK:
        # value slot = kept cells left of this one in its tile row
        slot = _count3(((bits[:, None] >> (4 * ci)) & 15) & ((1 << cj) - 1))
        tl.store(pv_ptr + rows * (K // 2) + 2 * (cols // 4) + slot, wm, mask=inside & keep)
        i4 = tl.arange(0, 4)
        lo, hi = _first_last((bits[:, None] >> (4 * i4[None, :])) & 15)  # [tiles, tile row]
        code = (lo | (hi << 2)) << (4 * (((t >> 4) & 1) | (((t >> 2) & 1) << 1)))[:, None]
        # one int16 word gathers the codes of tiles that differ in t bits 2 and 4
        code = tl.sum(tl.reshape(code, (16, 2, 16)), axis=1)
        code = tl.sum(tl.reshape(code, (4, 2, 32)), axis=1)
        rs = tl.arange(0, 4)[:, None]
        j = tl.arange(0, 32)[None, :]
        word = ((pid_r * (K // 32) + pid_c) * 4 + rs) * 32 + (j // 4) % 4 + 16 * (j // 16) + 4 * (j % 4)
        tl.store(pm_ptr + word, code.to(tl.int16))
    if PACK_T:
        colbits = (((bits[:, None] >> cj) & 1) | (((bits[:, None] >> (4 + cj)) & 1) << 1)
                   | (((bits[:, None] >> (8 + cj)) & 1) << 2) | (((bits[:, None] >> (12 + cj)) & 1) << 3))
        slot_t = _count3(colbits & ((1 << ci) - 1))
        tl.store(ptv_ptr + cols * (N // 2) + 2 * (rows // 4) + slot_t, wm, mask=inside & keep)
        j4 = tl.arange(0, 4)[None, :]
        cb = (((bits[:, None] >> j4) & 1) | (((bits[:, None] >> (4 + j4)) & 1) << 1)
              | (((bits[:, None] >> (8 + j4)) & 1) << 2) | (((bits[:, None] >> (12 + j4)) & 1) << 3))
        lo, hi = _first_last(cb)  # [tiles, tile column] = rows of the transpose
        code = (lo | (hi << 2)) << (4 * (((t >> 1) & 1) | (((t >> 5) & 1) << 1)))[:, None]
        code = tl.sum(tl.reshape(code, (32, 2, 8)), axis=1)   # t bit 1
        code = tl.sum(tl.reshape(code, (2, 2, 64)), axis=1)   # t bit 5
        tr3 = tl.arange(0, 2)[:, None]
        c = tl.arange(0, 64)[None, :]  # bits: tr1 tr0 tc2 tc0 j j
        rt = 2 * pid_c + ((c >> 3) & 1)
        ct = 2 * pid_r + tr3
        word = ((((rt // 4) * (N // 32) + ct) * 4 + rt % 4) * 32
                + ((c >> 4) & 3) + 4 * (4 * ((c >> 2) & 1) + (c & 3)))
        tl.store(ptm_ptr + word, code.to(tl.int16))
