"""The CUDA "X-stationary" dense x block-sparse kernel (``csrc/bs_dds.cu``) as extra tile candidates of
:func:`sparsetrain.kernels.blocksparse._dds` (forward ``X·Wᵀ`` and input gradient ``dY·W``).

One CTA holds a whole token tile of the dense operand (``[16·mt, K]``) in shared memory and walks every output
block of its range over it, so the dense operand is read once per tile instead of once per active block (the
Triton kernel's gather). The launch plan fixes everything but the data pointers, like the Triton plans, and
the tuner (``blocksparse._pick``) times these candidates beside the Triton ones: the faster one is kept per
shape, so adding them never makes a layer slower than before. 16x16 and 32x32 blocks, fp16/bf16 activations.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from sparsetrain.kernels._runtime.device import num_sms, raw_stream, smem_optin

CSRC = Path(__file__).resolve().parent / "csrc"

BLOCKS = (16, 32)


class CudaDdsConfig(NamedTuple):
    """A tile of the CUDA kernel: ``mt`` x 16 token rows per CTA, output blocks cut into ``splits`` CTA ranges
    (each re-reads the token tile); ``half``: half the warps per CTA (less shared memory beside the token
    tile, so a taller tile fits at large K)."""

    mt: int
    splits: int
    half: int = 0


_C = CudaDdsConfig
CANDIDATES = (_C(4, 1), _C(2, 1), _C(4, 2), _C(1, 1), _C(4, 1, 1), _C(2, 1, 1), _C(1, 1, 1))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _lib(device: torch.device):
    from sparsetrain.kernels._runtime import cuda_build as _cuda

    return _cuda.load(CSRC / "bs_dds.cu", device)  # argument types: _cuda.SIGNATURES


def _rows16(t: Tensor) -> Tensor:
    """``t`` as the CUDA kernels read a row-major operand: unit column stride, row stride a multiple of 8
    elements, 16-byte aligned start (a copy only when it is not)."""
    if t.stride(-1) != 1 or t.stride(0) % 8:
        return t.contiguous() if t.stride(-1) != 1 else t.clone(memory_format=torch.contiguous_format)
    return t.clone() if t.data_ptr() % 16 else t


def candidates(a: Tensor, block: int, k: int) -> list[CudaDdsConfig]:
    """The CUDA tiles that can run this product here (none off-GPU, for fp32 activations, other blocks, or
    without nvcc); only tiles whose shared memory fits the device."""
    if not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16) or block not in BLOCKS:
        return []
    so = _lib(a.device)
    if so is None:
        return []
    limit = smem_optin(a.device)
    return [c for c in CANDIDATES if 0 < so.sparsetrain_bs_dds_smem(block, c.mt, c.half, k) <= limit]


def entry_info(meta, forward: bool) -> Tensor:
    """``[E, 4]`` int32 per entry of the padded entry list (``meta.padded_entries(forward, 1)``): offset of its
    block in ``values`` (elements; -1 = padding), its column in the dense operand, its output column, and 1
    where it is the last entry of its output block (the kernel stores there). Cached on the metadata."""
    key = ("bs_dds_info", forward)
    if key not in meta._groups:
        _, kidx, slot, oblk = meta.padded_entries(forward, 1)
        b = meta.block
        slot, oblk = slot.long(), oblk.long()
        last = torch.ones_like(oblk)
        if oblk.numel() > 1:
            last[:-1] = (oblk[1:] != oblk[:-1]).long()
        info = torch.stack([torch.where(slot >= 0, slot * b * b, -1), kidx.long() * b, oblk * b, last], dim=1)
        meta._groups[key] = info.to(torch.int32).contiguous()
    return meta._groups[key]


def warp_bounds(pptr: Tensor, n_ranges: int) -> Tensor:
    """First entry of each of ``n_ranges`` warp ranges (+ the end), cut at output-block boundaries so that the
    entry counts are as even as the blocks allow."""
    ptr = pptr.long()  # no host sync: the total stays on the device
    targets = torch.div(torch.arange(n_ranges + 1, device=ptr.device, dtype=torch.long) * ptr[-1], n_ranges,
                        rounding_mode="floor")
    idx = torch.searchsorted(ptr, targets).clamp(max=ptr.numel() - 1)
    return ptr[idx].to(torch.int32).contiguous()


class CudaDdsPlan:
    """One launch of ``bs_dds`` with everything but the data pointers fixed (called like the Triton plans:
    ``plan(a, values, bias_or_placeholder, out)``)."""

    __slots__ = ("fn", "info", "wbound", "t", "k", "block", "cfg", "trans", "has_bias", "extra")

    def __init__(self, a: Tensor, meta, cfg: CudaDdsConfig, forward: bool, has_bias: bool):
        so = _lib(a.device)
        if so is None:
            raise RuntimeError("the CUDA kernel bs_dds is unavailable here")
        self.fn = so.sparsetrain_bs_dds
        block = meta.block
        warps = so.sparsetrain_bs_dds_warps(block, cfg.mt, cfg.half)
        if warps <= 0:
            raise ValueError(f"bs_dds: no tile {cfg} for {block}x{block} blocks")
        pptr = meta.padded_entries(forward, 1)[0]
        self.info = entry_info(meta, forward)
        self.wbound = warp_bounds(pptr, cfg.splits * warps)
        self.t, self.k = a.shape
        self.block, self.cfg, self.trans, self.has_bias = block, cfg, not forward, has_bias
        n_out = meta.grid[0] if forward else meta.grid[1]
        self.extra = n_out * block  # output width (what blocksparse._dds allocates)

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor) -> None:
        a, values, b_ptr, b_f32 = _operands(a, values, bias, self.has_bias)
        rc = self.fn(a.data_ptr(), values.data_ptr(), self.info.data_ptr(), self.wbound.data_ptr(), b_ptr,
                     out.data_ptr(), self.t, self.k, a.stride(0), out.stride(0), self.block, self.cfg.mt,
                     self.cfg.half, self.cfg.splits, int(self.trans), int(a.dtype == torch.bfloat16), b_f32,
                     raw_stream(a.device))
        if rc != 0:
            raise RuntimeError(f"bs_dds launch failed with code {rc} ({self.cfg})")


def _operands(a: Tensor, values: Tensor, bias: Tensor, has_bias: bool) -> tuple[Tensor, Tensor, int, int]:
    """What the dense x block-sparse launchers pass: values in A's dtype (fp32 master weights under autocast:
    one cast of the active blocks), 16-byte aligned operands (a copy when not), the bias pointer and whether it
    is fp32 (a 16-bit bias must be A's dtype)."""
    if values.dtype != a.dtype:
        values = values.to(a.dtype)
    if values.data_ptr() % 16 or not values.is_contiguous():
        values = values.contiguous() if not values.is_contiguous() else values.clone()
    a = _rows16(a)
    b_ptr, b_f32 = 0, 0
    if has_bias:
        if bias.dtype not in (torch.float32, a.dtype) or not bias.is_contiguous():
            bias = bias.float().contiguous()
        b_ptr, b_f32 = bias.data_ptr(), int(bias.dtype == torch.float32)
    return a, values, b_ptr, b_f32


# ---- the K-streamed variant for large K (16x16 blocks) --------------------------------------------------
class CudaKsConfig(NamedTuple):
    """The K-streamed CUDA tile (``bs_dds_ks_kernel``): ``ob`` output blocks per warp (4: 8 warps, 2: 16)."""

    ob: int


KS_CANDIDATES = (CudaKsConfig(4), CudaKsConfig(2))
KS_MIN_K = 1536  # below this the X-stationary tiles keep a 64-token tile of the whole K (and win)


def _ks_shape(so, ob: int) -> tuple[int, int, int, int]:
    tm, warps, kp = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    smem = so.sparsetrain_bs_dds_ks_shape(ob, ctypes.byref(tm), ctypes.byref(warps), ctypes.byref(kp))
    return tm.value, warps.value, kp.value, smem


def ks_candidates(a: Tensor, block: int, k: int) -> list[CudaKsConfig]:
    """K-streamed tiles for this product: 16x16 blocks, K >= KS_MIN_K, fp16/bf16 on a GPU with the library."""
    if not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16) or block != 16 or k < KS_MIN_K:
        return []
    so = _lib(a.device)
    if so is None:
        return []
    return [c for c in KS_CANDIDATES if 0 < _ks_shape(so, c.ob)[3] <= smem_optin(a.device)]


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


class CudaKsPlan:
    """One launch of ``bs_dds_ks`` (called like the other dense x block-sparse plans)."""

    __slots__ = ("fn", "tables", "t", "k", "cfg", "trans", "has_bias", "grid_y", "extra")

    def __init__(self, a: Tensor, meta, cfg: CudaKsConfig, forward: bool, has_bias: bool):
        so = _lib(a.device)
        if so is None:
            raise RuntimeError("the CUDA kernel bs_dds is unavailable here")
        self.fn = so.sparsetrain_bs_dds_ks
        _, warps, kp, _ = _ks_shape(so, cfg.ob)
        self.tables = ks_table(meta, forward, cfg.ob, kp)
        n_out = self.tables[4]
        self.grid_y = _cdiv(_cdiv(n_out, cfg.ob), warps)
        self.t, self.k = a.shape
        self.cfg, self.trans, self.has_bias = cfg, not forward, has_bias
        self.extra = n_out * meta.block

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor) -> None:
        a, values, b_ptr, b_f32 = _operands(a, values, bias, self.has_bias)
        info, wstart, counts, n_parts, n_out = self.tables
        rc = self.fn(a.data_ptr(), values.data_ptr(), info.data_ptr(), wstart.data_ptr(), counts.data_ptr(), b_ptr,
                     out.data_ptr(), self.t, self.k, a.stride(0), out.stride(0), n_parts, n_out, self.cfg.ob,
                     self.grid_y, int(self.trans), int(a.dtype == torch.bfloat16), b_f32,
                     raw_stream(a.device))
        if rc != 0:
            raise RuntimeError(f"bs_dds_ks launch failed with code {rc} ({self.cfg})")


# ---- the sampled weight gradient at 16x16 blocks (csrc/bs_dw.cu) ------------------------------------------
class CudaDwConfig(NamedTuple):
    """Tokens per staged chunk of the CUDA weight-gradient kernel (16 or 32)."""

    tc: int


DW_CANDIDATES = (CudaDwConfig(32), CudaDwConfig(16))
STRIP_BLOCKS = 32  # widest column strip a CTA stages of its strip operand (in blocks)


def _dw_lib(device: torch.device):
    from sparsetrain.kernels._runtime import cuda_build as _cuda

    return _cuda.load(CSRC / "bs_dw.cu", device)


def dw_table(meta, with_bias: bool, cap: int) -> tuple[Tensor, Tensor, int, int]:
    """CTA table of the weight-gradient kernel: ``(cta [n_cta, 8], blk [n_blocks, 4], a_width, b_width)``.

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
    table = (torch.tensor([[c[0], c[1], c[2] * b, (c[3] - c[2]) * b, c[4] * b, (c[5] - c[4]) * b, c[6] * b,
                            c[7] * b] for c in ctas] or [[0] * 8], dtype=torch.int32, device=dev),
             torch.tensor(blk or [[0, 0, 0, 0]], dtype=torch.int32, device=dev), a_width, b_width)
    meta._groups[key] = table
    return table


def _dw_cap(so) -> int:
    w = ctypes.c_int()
    return so.sparsetrain_bs_dw_cap(ctypes.byref(w))


def dw_candidates(x: Tensor, dy: Tensor, meta, with_bias: bool) -> list[CudaDwConfig]:
    """The CUDA weight-gradient tiles that can run here: 16x16 blocks, fp16/bf16, shared memory that fits."""
    if (not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16) or dy.dtype != x.dtype
            or meta.block_rows != 16 or meta.block_cols != 16 or meta.n_blocks == 0):
        return []
    so = _dw_lib(x.device)
    if so is None:
        return []
    _, _, aw, bw = dw_table(meta, with_bias, _dw_cap(so))
    limit = smem_optin(x.device)
    return [c for c in DW_CANDIDATES if 2 * 2 * c.tc * (aw + 8 + bw + 8) <= limit]


class CudaDwPlan:
    """One launch of ``bs_dw``; called like the Triton weight-gradient plans: ``plan(x, dy, dv, db_or_dv)``
    with ``dv`` (and ``db``) zeroed fp32 (``extra`` > 1 tells ``blocksparse._run_dw`` to allocate them so)."""

    __slots__ = ("fn", "cta", "blk", "aw", "bw", "t", "tc", "splits", "tps", "with_bias", "extra")

    def __init__(self, x: Tensor, meta, cfg: CudaDwConfig, with_bias: bool):
        so = _dw_lib(x.device)
        if so is None:
            raise RuntimeError("the CUDA kernel bs_dw is unavailable here")
        self.fn = so.sparsetrain_bs_dw
        self.cta, self.blk, self.aw, self.bw = dw_table(meta, with_bias, _dw_cap(so))
        self.t, self.tc, self.with_bias = x.shape[0], cfg.tc, with_bias
        n_cta = self.cta.shape[0]
        splits = max(1, min(_cdiv(2 * num_sms(x.device), n_cta), self.t // (4 * cfg.tc)))
        self.tps = _cdiv(_cdiv(self.t, splits), cfg.tc) * cfg.tc  # tokens per split, a multiple of tc
        self.splits = _cdiv(self.t, self.tps)
        self.extra = 2  # outputs must be zeroed fp32 (atomics)

    def __call__(self, x: Tensor, dy: Tensor, dv: Tensor, db: Tensor) -> None:
        x, dy = _rows16(x), _rows16(dy)
        rc = self.fn(x.data_ptr(), dy.data_ptr(), self.cta.data_ptr(), self.blk.data_ptr(), dv.data_ptr(),
                     db.data_ptr() if self.with_bias else 0, self.t, x.stride(0), dy.stride(0), self.cta.shape[0],
                     self.splits, self.tps, self.aw, self.bw, self.tc, int(x.dtype == torch.bfloat16),
                     raw_stream(x.device))
        if rc != 0:
            raise RuntimeError(f"bs_dw launch failed with code {rc}")
