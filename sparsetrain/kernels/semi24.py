"""Transposable 2:4 sparsity for training: mask + compress every step, products through cuSPARSELt.

The forward of a 2:4 straight-through linear layer is ``y = x (W ⊙ M)ᵀ + b`` where ``M`` is a *transposable*
2:4 mask of the dense master weight ``W`` (every 4x4 tile keeps exactly 2 per row and 2 per column, so both
``W ⊙ M`` and its transpose are 2:4 along their rows). Three products per step:

- forward ``y  = x  (W⊙M)ᵀ``: sparse ``W⊙M`` (cuSPARSELt);
- input grad ``dx = dy (W⊙M)``: sparse ``(W⊙M)ᵀ`` (cuSPARSELt, hence the transposable mask);
- weight grad ``dW = dyᵀ x``: dense (cuBLAS), passed straight through to the whole dense ``W``.

Pieces in this file:

- ``_transposable24_kernel`` (Triton): one pass over ``W`` that picks, per 4x4 tile, the transposable pattern
  keeping the largest sum of ``|w|`` (all 90 patterns scored at once with a tiny ``tl.dot``), and writes the
  bool mask and, as asked, ``W⊙M``, ``(W⊙M)ᵀ``, or ``W⊙M`` and ``(W⊙M)ᵀ`` already in cuSPARSELt's compressed
  layout (values + metadata), which replaces two ``torch._cslt_compress`` calls.
- :func:`transposable24_reference`, :func:`cslt_pack_reference`: the same in plain torch (tests compare).
- :func:`pack_supported`: a once-per-shape check of the kernel's packing against ``torch._cslt_compress``.
- cuSPARSELt helpers and :func:`select_alg`: per-shape choice of the cuSPARSELt algorithm, timed once and
  checked against a dense product (some alg ids give wrong results: pytorch issue 155333).
- :class:`Semi24LinearFn` and :func:`semi24_linear`: the autograd function in three modes,
  ``"24"`` (forward and input grad sparse), ``"24fwd"`` (forward sparse only), ``"dense"`` (masked dense).

>>> w = torch.randn(64, 128)
>>> mask, wm = transposable24_reference(w)
>>> int(mask.view(16, 4, 32, 4).sum(dim=3).max()), int(mask.view(16, 4, 32, 4).sum(dim=1).max())
(2, 2)
"""
from __future__ import annotations

import itertools
import os
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # Triton is optional: without it the format falls back to the masked reference path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

MODES = ("24", "24fwd", "dense")
# Token counts are padded to a multiple of this before a cuSPARSELt product (dense operand rows).
TOKEN_ALIGN = 16
# cuSPARSELt's structured operand wants both dims divisible by 16 for 16-bit types.
CSLT_ALIGN = 16
# Add the bias inside the cuSPARSELt epilogue (checked against the reference by the GPU tests).
FUSE_BIAS = True
# Compute dtypes that take the cuSPARSELt path (others run masked dense with the same mask). fp16 is out:
# on the H200 (cuSPARSELt 0.8, torch 2.11, 2026-11-21) each of three runs had an illegal-instruction fault of
# the CUDA context in its first sweep of the fp16 alg ids, and such a fault cannot be caught.
SPARSE_DTYPES = (torch.bfloat16,)

# ---- the 90 transposable 2:4 patterns of a 4x4 tile ------------------------------------------------------
_PAIRS = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]


def _pattern_bits() -> list[int]:
    """Every 4x4 0/1 tile with two ones per row and per column, as 16-bit sets (bit 4*row + col).

    Order is lexicographic in the (row0, row1, row2, row3) column pairs: the kernel and the reference both
    break score ties towards the first pattern in this list.
    """
    out = []
    for rows in itertools.product(range(6), repeat=4):
        cols = [0, 0, 0, 0]
        bits = 0
        for i, p in enumerate(rows):
            for j in _PAIRS[p]:
                cols[j] += 1
                bits |= 1 << (4 * i + j)
        if cols == [2, 2, 2, 2]:
            out.append(bits)
    return out


PATTERNS = _pattern_bits()
NPAT = len(PATTERNS)  # 90
NPAT_PAD = 128  # tl.arange / tl.dot want a power of two
_PATTERN_CACHE: dict[tuple, tuple[Tensor, Tensor]] = {}


def _pattern_tensors(device: torch.device) -> tuple[Tensor, Tensor]:
    """(16, NPAT_PAD) float32 cell-membership matrix and (NPAT_PAD,) int32 bit sets, cached per device."""
    key = (device.type, device.index)
    if key not in _PATTERN_CACHE:
        bits = torch.zeros(NPAT_PAD, dtype=torch.int32)
        bits[:NPAT] = torch.tensor(PATTERNS, dtype=torch.int32)
        cells = torch.arange(16, dtype=torch.int32)
        member = ((bits[None, :] >> cells[:, None]) & 1).to(torch.float32)
        _PATTERN_CACHE[key] = (member.to(device), bits.to(device))
    return _PATTERN_CACHE[key]


# ---- plain-torch reference ------------------------------------------------------------------------------
def transposable24_reference(weight: Tensor, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Transposable 2:4 mask keeping, in every 4x4 tile, the pattern with the largest sum of ``|w|``.

    Magnitudes are those of the weight rounded to ``out_dtype`` (default the weight's dtype): the matrix
    that is actually multiplied. Returns ``(mask, weight.to(out_dtype) * mask)``.

    >>> m, wm = transposable24_reference(torch.randn(8, 8))
    >>> m.shape, int(m.sum())
    (torch.Size([8, 8]), 32)
    """
    _check_weight(weight)
    n, k = weight.shape
    member, bits = _pattern_tensors(weight.device)
    w = weight.detach().to(out_dtype or weight.dtype)
    tiles = w.abs().float().reshape(n // 4, 4, k // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    best = torch.argmax(tiles @ member[:, :NPAT], dim=1)  # first maximum, like tl.argmax(tie_break_left)
    cells = torch.arange(16, device=weight.device, dtype=torch.int32)
    keep = ((bits[best][:, None] >> cells[None, :]) & 1).bool()
    mask = keep.reshape(n // 4, k // 4, 4, 4).permute(0, 2, 1, 3).reshape(n, k)
    return mask, w * mask


def is_transposable24(mask: Tensor) -> bool:
    """True if every 4x4 tile of the (out, in) bool mask keeps at most 2 per row and at most 2 per column."""
    if mask.dim() != 2 or mask.shape[0] % 4 or mask.shape[1] % 4:
        return False
    n, k = mask.shape
    t = mask.reshape(n // 4, 4, k // 4, 4).to(torch.int8)
    return bool((t.sum(dim=3) <= 2).all()) and bool((t.sum(dim=1) <= 2).all())


def _check_weight(weight: Tensor) -> None:
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (out, in), got shape {tuple(weight.shape)}")
    if weight.shape[0] % 4 or weight.shape[1] % 4:
        raise ValueError(f"weight shape {tuple(weight.shape)}: both dims must be multiples of 4 for 4x4 tiles")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"weight dtype must be float16, bfloat16 or float32, got {weight.dtype}")


# ---- cuSPARSELt compressed layout (cuSPARSELt 0.8, sm90), as plain torch ---------------------------------
# Read off cuSPARSELt's own output on an H200 (designed inputs, then bit-exact on random ones; see
# docs/semi24.md). A 2:4 (along rows) matrix (N, K) compresses to N*K*9/16 elements of its dtype:
#   values   [0, N*K/2): row-major (N, K/2), the two kept values of every group of 4 in column order;
#   metadata [N*K/2, ...): N*K/16 int16 words, one 4-bit code per group, idx0 | idx1 << 2 (idx0 < idx1),
#            code q at bits 4*(q % 4) of word q // 4, where for row r and group c of a row (kg = K/4 groups)
#            q = 128*t + (rr//8 | (cc//4) << 1 | (cc%4) << 2 | (rr%8) << 4),  rr = r%16, cc = c%8,
#            t = ((r//64) * (kg//8) + c//8) * 4 + (r//16) % 4   (needs N % 64 == 0 and K % 32 == 0).
# Other cuSPARSELt versions or GPUs may differ: :func:`pack_supported` checks against _cslt_compress once.
def cslt_pack_reference(wm: Tensor, mask: Tensor) -> Tensor:
    """cuSPARSELt compressed form of ``wm`` (2:4 along rows, kept cells given by ``mask``), plain torch."""
    n, k = wm.shape
    if n % 64 or k % 32:
        raise ValueError(f"wm shape {(n, k)}: the packed layout needs rows % 64 == 0 and cols % 32 == 0")
    g = mask.reshape(n, k // 4, 4)
    if not bool((g.sum(-1) == 2).all()):
        raise ValueError("mask must keep exactly 2 of every group of 4 along rows")
    idx = torch.argsort((~g).to(torch.int8) * 4 + torch.arange(4, device=wm.device, dtype=torch.int8),
                        dim=2, stable=True)[..., :2].sort(dim=2).values
    vals = torch.gather(wm.reshape(n, k // 4, 4), 2, idx).reshape(-1)
    code = (idx[..., 0] | (idx[..., 1] << 2)).reshape(-1)
    kg = k // 4
    r = torch.arange(n, device=wm.device)[:, None]
    c = torch.arange(kg, device=wm.device)[None, :]
    rr, cc = r % 16, c % 8
    t = ((r // 64) * (kg // 8) + c // 8) * 4 + (r // 16) % 4
    q = (128 * t + ((rr // 8) | ((cc // 4) << 1) | ((cc % 4) << 2) | ((rr % 8) << 4))).reshape(-1)
    nib = torch.zeros_like(code)
    nib[q] = code
    words = (nib.reshape(-1, 4) << (4 * torch.arange(4, device=wm.device))).sum(1)
    words = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
    out = torch.empty(n * k * 9 // 16, dtype=wm.dtype, device=wm.device)
    out[: n * k // 2] = vals
    out.view(torch.int16)[n * k // 2:] = words
    return out.view(n, k * 9 // 16)


def cslt_unpack_reference(packed: Tensor, n: int, k: int) -> Tensor:
    """Inverse of :func:`cslt_pack_reference`: the dense (n, k) matrix, zeros outside the kept cells."""
    flat = packed.reshape(-1)
    vals = flat[: n * k // 2].reshape(n, k // 4, 2)
    words = flat.view(torch.int16)[n * k // 2:].to(torch.int32) & 0xFFFF
    nib = ((words[:, None] >> (4 * torch.arange(4, device=packed.device))) & 15).reshape(-1)
    kg = k // 4
    r = torch.arange(n, device=packed.device)[:, None]
    c = torch.arange(kg, device=packed.device)[None, :]
    rr, cc = r % 16, c % 8
    t = ((r // 64) * (kg // 8) + c // 8) * 4 + (r // 16) % 4
    code = nib[128 * t + ((rr // 8) | ((cc // 4) << 1) | ((cc % 4) << 2) | ((rr % 8) << 4))]
    idx = torch.stack([code & 3, code >> 2], dim=-1).long()
    out = torch.zeros(n, kg, 4, dtype=packed.dtype, device=packed.device)
    out.scatter_(2, idx, vals)
    return out.reshape(n, k)


# ---- Triton kernel --------------------------------------------------------------------------------------
if triton is not None:

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
    def _transposable24_kernel(
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
        # cuSPARSELt packing (layout in the comment above cslt_pack_reference). Programs are 64 rows x 32
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


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run for tensors on ``device`` (CUDA, or CPU under the interpreter)."""
    return triton is not None and (device.type == "cuda" or (device.type == "cpu" and _interpret()))


class Sparsified(NamedTuple):
    """Outputs of :func:`transposable24`; fields not asked for are None."""

    mask: Tensor
    wm: Tensor | None
    wmt: Tensor | None
    packed: Tensor | None
    packed_t: Tensor | None


def transposable24(
    weight: Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    mask_out: Tensor | None = None,
    write_wm: bool = True,
    write_transposed: bool = False,
    pack: bool = False,
    pack_t: bool = False,
    tiles: tuple[int, int] = (8, 16),
) -> Sparsified:
    """Triton: transposable 2:4 mask of ``weight`` and what the products need, in one pass over it.

    Returns :class:`Sparsified`: the bool mask (written into ``mask_out`` if given); ``wm = weight ⊙ mask``
    in ``out_dtype`` (default the weight's dtype; magnitudes are ranked after rounding to it); ``wmt = wmᵀ``
    if ``write_transposed``; the cuSPARSELt compressed ``wm`` / ``wmᵀ`` if ``pack`` / ``pack_t`` (16-bit
    dtypes, both dims divisible by 64). Same choice as :func:`transposable24_reference`.

    >>> r = transposable24(torch.randn(64, 64, device="cuda"))  # doctest: +SKIP
    >>> r.mask.shape, r.wm.shape  # doctest: +SKIP
    (torch.Size([64, 64]), torch.Size([64, 64]))
    """
    _check_weight(weight)
    if not kernel_available(weight.device):
        raise ValueError(f"weight is on {weight.device}: the Triton kernel needs CUDA (or TRITON_INTERPRET=1)")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n, k = weight.shape
    out_dtype = out_dtype or weight.dtype
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if (pack or pack_t) and (out_dtype == torch.float32 or n % 64 or k % 64):
        raise ValueError(f"pack/pack_t need a 16-bit out_dtype and weight dims divisible by 64, got {out_dtype}, "
                         f"weight shape {(n, k)}")
    if mask_out is None:
        mask_out = torch.empty(n, k, dtype=torch.bool, device=weight.device)
    elif (tuple(mask_out.shape) != (n, k) or mask_out.dtype != torch.bool or not mask_out.is_contiguous()
          or mask_out.device != weight.device):
        raise ValueError(f"mask_out must be a contiguous bool ({n}, {k}) tensor on {weight.device}, got "
                         f"{mask_out.dtype} {tuple(mask_out.shape)} on {mask_out.device}")
    tr, tc = (16, 8) if (pack or pack_t) else tiles
    if tr * tc < 16 or (tr * tc) & (tr * tc - 1):
        raise ValueError(f"tiles {tiles}: their product must be a power of two >= 16")
    dev = weight.device
    wm = torch.empty(n, k, dtype=out_dtype, device=dev) if write_wm else None
    wmt = torch.empty(k, n, dtype=out_dtype, device=dev) if write_transposed else None
    packed = torch.empty(n, k * 9 // 16, dtype=out_dtype, device=dev) if pack else None
    packed_t = torch.empty(k, n * 9 // 16, dtype=out_dtype, device=dev) if pack_t else None
    # Unused outputs get a 1-element dummy of the compute dtype (the kernel reads its element type).
    dummy = torch.empty(1, dtype=out_dtype, device=dev)
    half = n * k // 2
    pv, pm = (packed, packed.view(torch.int16).view(-1)[half:]) if pack else (dummy, dummy)
    ptv, ptm = (packed_t, packed_t.view(torch.int16).view(-1)[half:]) if pack_t else (dummy, dummy)
    member, bits = _pattern_tensors(dev)
    grid = (triton.cdiv(n, 4 * tr), triton.cdiv(k, 4 * tc))
    _transposable24_kernel[grid](
        weight, mask_out.view(torch.uint8), wm if wm is not None else dummy, wmt if wmt is not None else dummy,
        pv, pm, ptv, ptm, member, bits, n, k, weight.stride(0),
        NPAT=NPAT, NPAT_PAD=NPAT_PAD, TILES_R=tr, TILES_C=tc,
        # 16-bit pattern scoring for bf16 (measured 0.24 vs 0.42 ms for 64M weights on the H200); fp16 keeps
        # the tf32 scoring that was run there (exact for fp16 values as well).
        DOT16=out_dtype == torch.bfloat16 and dev.type == "cuda",
        WRITE_WM=write_wm, WRITE_T=write_transposed, PACK=pack, PACK_T=pack_t, num_warps=4,
    )
    return Sparsified(mask_out, wm, wmt, packed, packed_t)


# ---- cuSPARSELt -----------------------------------------------------------------------------------------
def cslt_available() -> bool:
    """cuSPARSELt is usable through torch on this machine."""
    if not torch.cuda.is_available() or not hasattr(torch, "_cslt_sparse_mm"):
        return False
    try:
        return bool(torch.backends.cusparselt.is_available())
    except (AttributeError, RuntimeError):  # pragma: no cover - old torch
        return False


def compress(wm: Tensor) -> Tensor:
    """cuSPARSELt compressed form (values + metadata) of a 2:4 (along rows) matrix, as a 2-D tensor."""
    packed = torch._cslt_compress(wm)
    # Newer torch returns (rows, cols'); older returns 1-D and newer products assert 2-D input.
    return packed if packed.dim() == 2 else packed.view(wm.shape[0], -1)


@dataclass(frozen=True)
class AlgChoice:
    """A cuSPARSELt algorithm id checked on one product shape (``ms``/``rel_err`` as measured)."""

    alg_id: int
    ms: float | None = None
    rel_err: float | None = None


def sparse_mm_t(packed: Tensor, x2d: Tensor, choice: AlgChoice, bias: Tensor | None = None) -> Tensor:
    """``x2d @ Aᵀ (+ bias)`` for the 2:4 matrix ``A (M, K)`` held in ``packed``; ``x2d`` is (T, K) row-major.

    cuSPARSELt computes ``A @ x2dᵀ`` (x2dᵀ read as a transposed operand, no copy) and writes it column-major,
    which is ``(T, M)`` row-major: exactly the next layer's input layout. On the H200 this layout was the
    fastest (or within 0.01x of it) at 7 of 8 shapes probed; at A = 4096x1024 the (M, T) result layouts ran
    0.86x of dense against 0.71x, but would need a transpose copy (docs/semi24.md).
    """
    return torch._cslt_sparse_mm(packed, x2d.t(), bias, transpose_result=True, alg_id=choice.alg_id)


def pad_tokens(t: int) -> int:
    return -(-t // TOKEN_ALIGN) * TOKEN_ALIGN


def _pad_rows(x2d: Tensor, rows: int) -> Tensor:
    if x2d.shape[0] == rows and x2d.is_contiguous() and x2d.data_ptr() % 16 == 0:
        return x2d
    out = x2d.new_zeros(rows, x2d.shape[1])
    out[: x2d.shape[0]].copy_(x2d)
    return out


def _max_alg_candidates() -> int:
    try:
        m = torch.backends.cusparselt.get_max_alg_id()
    except (AttributeError, RuntimeError):  # pragma: no cover
        m = None
    return int(m) if m else 64  # unknown: try ids until cuSPARSELt refuses one


_ALG_CACHE: dict[tuple, AlgChoice | None] = {}


def select_alg(m: int, k: int, tokens: int, dtype: torch.dtype, device: torch.device | None = None, *,
               rep_ms: float = 10.0, tol: float = 1e-2) -> AlgChoice | None:
    """Fastest correct cuSPARSELt algorithm id for ``x (tokens, k) @ Aᵀ`` with ``A (m, k)`` 2:4. Cached.

    Every alg id (0, 1, ... until cuSPARSELt refuses one) is run on fresh random data and kept only if its
    relative error against a float32 dense product of the same masked matrix is below ``tol``; the fastest
    kept one wins. ``None`` when none is correct or ``dtype`` is not in ``SPARSE_DTYPES`` (the caller then goes
    dense). cuSPARSELt's own search is not used: its proposal on the H200 (alg 17, split-K -1, mode 2) was
    followed by an illegal-instruction fault of the context.
    """
    if dtype not in SPARSE_DTYPES:
        return None
    device = torch.device(device or "cuda")
    tp = pad_tokens(tokens)
    key = (m, k, tp, dtype, device.index)
    if key in _ALG_CACHE:
        return _ALG_CACHE[key]
    from triton.testing import do_bench

    am = transposable24(torch.randn(m, k, device=device, dtype=dtype)).wm
    packed = compress(am)
    x = torch.randn(tp, k, device=device, dtype=dtype)
    ref = x.float() @ am.float().t()
    best: AlgChoice | None = None
    for alg in range(_max_alg_candidates()):
        cand = AlgChoice(alg)
        try:
            y = sparse_mm_t(packed, x, cand)
        except RuntimeError:
            break  # past the last alg id of this cuSPARSELt
        err = ((y.float() - ref).norm() / ref.norm()).item()
        if not err < tol:  # also rejects NaN
            continue
        ms = do_bench(lambda c=cand: sparse_mm_t(packed, x, c), warmup=2, rep=rep_ms, return_mode="median")
        if best is None or ms < best.ms:
            best = AlgChoice(alg, ms, err)
    _ALG_CACHE[key] = best
    return best


_PACK_OK: dict[tuple, bool] = {}


def pack_supported(n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the Triton kernel's cuSPARSELt packing is usable for (n, k) weights: 16-bit dtype, dims
    divisible by 64, and, once per shape/dtype/device, bit-identical to ``torch._cslt_compress`` of W and Wᵀ
    on fresh random data (the layout is undocumented; any other cuSPARSELt or GPU falls back here).
    ``SPARSETRAIN_SEMI24_PACK=0`` in the environment turns the fused packing off."""
    if (os.environ.get("SPARSETRAIN_SEMI24_PACK", "1") == "0" or dtype not in (torch.float16, torch.bfloat16)
            or n % 64 or k % 64 or device.type != "cuda"):
        return False
    key = (n, k, dtype, device.index, torch.backends.cusparselt.version())
    if key not in _PACK_OK:
        try:
            # No exact zeros in the probe: where a kept cell holds 0, cuSPARSELt may encode the group with
            # other (equally zero) positions, a different byte string for the same matrix. Measured on an H200:
            # 64M-element bf16 randn draws a few exact zeros, and every byte difference sat in such a group
            # (the cuSPARSELt products were identical), which is why those shapes used to fall back.
            w = torch.randn(n, k, device=device, dtype=dtype)
            w = torch.where(w == 0, torch.ones((), device=device, dtype=dtype), w)
            r = transposable24(w, pack=True, pack_t=True)
            ok = (torch.equal(r.packed.view(torch.int16), compress(r.wm).view(torch.int16))
                  and torch.equal(r.packed_t.view(torch.int16), compress(r.wm.t().contiguous()).view(torch.int16)))
        except (RuntimeError, ValueError) as e:  # e.g. a Triton build error: keep training on the slow path
            warnings.warn(f"semi24: fused cuSPARSELt packing unavailable ({e!r:.200}); using _cslt_compress",
                          stacklevel=2)
            ok = False
        if not ok:
            warnings.warn(f"semi24: fused packing differs from _cslt_compress for {(n, k)} {dtype}; "
                          "using _cslt_compress for this shape", stacklevel=2)
        _PACK_OK[key] = ok
    return _PACK_OK[key]


def alg_table() -> list[dict]:
    """The cached choices, for the run log."""
    return [{"m": k[0], "k": k[1], "tokens_padded": k[2], "dtype": str(k[3]).replace("torch.", ""),
             "alg_id": v.alg_id if v else None, "ms": v.ms if v else None, "rel_err": v.rel_err if v else None} for k, v in _ALG_CACHE.items()]


# ---- autograd -------------------------------------------------------------------------------------------
class Semi24LinearFn(torch.autograd.Function):
    """``y = x2d @ (W⊙M)ᵀ + b`` with a straight-through dense gradient to ``W``.

    ``packed``/``packed_t`` (cuSPARSELt forms of ``W⊙M`` and ``(W⊙M)ᵀ``) select the sparse products;
    when one is None that product runs dense on ``wm``. ``weight`` is the dense master Parameter: it is only
    used to give ``dW`` its dtype. ``layer_box[0]``, when given, receives ``dW`` in ``dense_grad`` if its
    ``capture_dense_grad`` is set (RigL-style dense-gradient capture).
    """

    @staticmethod
    def forward(ctx, x2d, weight, bias, wm, packed, packed_t, fwd_alg, dx_alg, layer_box):
        t = x2d.shape[0]
        if packed is not None:
            xp = _pad_rows(x2d, pad_tokens(t))
            y = sparse_mm_t(packed, xp, fwd_alg, bias if FUSE_BIAS else None)
            y = y[:t] if xp.shape[0] != t else y
            if bias is not None and not FUSE_BIAS:
                y = y + bias
        else:
            y = F.linear(x2d, wm, bias)
        ctx.save_for_backward(x2d, packed_t if packed_t is not None else wm)
        ctx.sparse_dx = packed_t is not None
        ctx.dx_alg, ctx.layer_box = dx_alg, layer_box
        ctx.w_dtype, ctx.has_bias = weight.dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, w_for_dx = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if ctx.sparse_dx:
                t = dy.shape[0]
                dyp = _pad_rows(dy, pad_tokens(t))
                dx = sparse_mm_t(w_for_dx, dyp, ctx.dx_alg)
                dx = dx[:t] if dyp.shape[0] != t else dx
            else:
                dx = dy @ w_for_dx
        if ctx.needs_input_grad[1]:
            g = dy.t() @ x2d  # dense: the straight-through gradient reaches pruned weights too
            layer = ctx.layer_box[0] if ctx.layer_box else None
            if layer is not None and layer.capture_dense_grad:
                layer.dense_grad = g.float() if layer.dense_grad is None else layer.dense_grad + g.float()
            dw = g.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None, None, None, None, None, None


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a linear layer computes in: the autocast dtype when autocast is on for x's device."""
    dev = x.device.type
    try:
        on = torch.is_autocast_enabled(dev)
    except TypeError:  # pragma: no cover - torch < 2.4
        on = torch.is_autocast_enabled() if dev == "cuda" else False
    if on:
        try:
            return torch.get_autocast_dtype(dev)
        except AttributeError:  # pragma: no cover
            return torch.get_autocast_gpu_dtype()
    return x.dtype


def semi24_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    mode: str = "24",
    mask: Tensor | None = None,
    mask_out: Tensor | None = None,
    layer=None,
) -> Tensor:
    """2:4 straight-through linear on CUDA: ``x @ (W⊙M)ᵀ + b`` with ``dW`` dense to all of ``W``.

    ``M`` is computed from ``weight`` (:func:`transposable24`, written into ``mask_out`` if given) unless a
    ``mask`` is passed. ``mode``: ``"24"`` forward and input grad through cuSPARSELt, ``"24fwd"`` forward
    only, ``"dense"`` masked dense (cuBLAS). Sparse modes need a compute dtype in ``SPARSE_DTYPES`` (autocast
    or input dtype) and both weight dims divisible by 16; otherwise the product runs dense with the same
    mask. Where :func:`pack_supported`, the mask kernel writes the compressed operands itself.

    >>> y = semi24_linear(torch.randn(100, 64, device="cuda", dtype=torch.bfloat16),
    ...                   torch.randn(32, 64, device="cuda", dtype=torch.bfloat16))  # doctest: +SKIP
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    if not x.is_cuda or not weight.is_cuda:
        raise ValueError("semi24_linear needs CUDA tensors; on CPU use the masked reference format")
    dtype = compute_dtype(x)
    n, k = weight.shape
    sparse_ok = (dtype in SPARSE_DTYPES and n % CSLT_ALIGN == 0 and k % CSLT_ALIGN == 0
                 and cslt_available())
    if not sparse_ok:
        mode = "dense"
    x2d = x.reshape(-1, k).to(dtype)
    tokens = x2d.shape[0]
    fwd_alg = dx_alg = None
    if mode != "dense":
        fwd_alg = select_alg(n, k, tokens, dtype, x.device)
        dx_alg = select_alg(k, n, tokens, dtype, x.device) if mode == "24" else None
        if fwd_alg is None:  # no correct cuSPARSELt configuration for this shape
            mode = "dense"
    sparse_dx = mode == "24" and dx_alg is not None
    with torch.no_grad():
        if mask is None and mode != "dense" and pack_supported(n, k, dtype, x.device):
            # one pass: mask, and W ⊙ M / (W ⊙ M)ᵀ straight into cuSPARSELt's compressed layout
            r = transposable24(weight.detach(), out_dtype=dtype, mask_out=mask_out, write_wm=not sparse_dx,
                               pack=True, pack_t=sparse_dx)
            wm, packed, packed_t = r.wm, r.packed, r.packed_t
        else:
            if mask is None:
                r = transposable24(weight.detach(), out_dtype=dtype, mask_out=mask_out, write_transposed=sparse_dx)
                wm, wmt = r.wm, r.wmt
            else:
                wm = (weight.detach() * mask).to(dtype)
                wmt = wm.t().contiguous() if sparse_dx else None
            packed = compress(wm) if mode != "dense" else None
            packed_t = compress(wmt) if sparse_dx else None
    b = bias.to(dtype) if bias is not None else None
    with torch.autocast(x.device.type, enabled=False):
        y = Semi24LinearFn.apply(x2d, weight, b, wm, packed, packed_t,
                                 fwd_alg, dx_alg, [layer] if layer is not None else None)
    return y.reshape(*x.shape[:-1], n)


def semi24_linear_reference(x: Tensor, weight: Tensor, mask: Tensor, bias: Tensor | None = None) -> Tensor:
    """Plain-torch reference: straight-through masked dense linear (what ``MaskedFormat`` computes)."""
    w_eff = weight + (weight * mask - weight).detach()
    return F.linear(x, w_eff, bias)
