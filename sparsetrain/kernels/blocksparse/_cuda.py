"""The CUDA backend (``csrc/bs_dds.cu``, ``csrc/bs_dw.cu``; 16x16 and 32x32 blocks, fp16/bf16 activations,
built by ``nvcc`` on first use unless ``KernelOptions.cuda_kernels`` is off).

- ``bs_dds`` ("X-stationary", forward ``X·Wᵀ`` and input gradient ``dY·W``): one CTA holds a whole token tile
  of the dense operand (``[16·mt, K]``) in shared memory and walks every output block of its range over it, so
  the dense operand is read once per tile instead of once per active block (the Triton kernel's gather).
- ``bs_dds_ks`` (K-streamed, 16x16 blocks, large K): the same product with the K dimension streamed in parts,
  where a token tile of the whole K no longer fits beside a useful number of warps.
- ``bs_dw`` (weight gradient at 16x16 blocks): CTAs of up to ``cap`` blocks, each staging a range of X columns
  and one of dY columns; two table layouts (strips: the narrower operand whole; tiles: rectangles of the block
  grid) are separate candidates.

The plans fix everything but the data pointers, like the Triton plans, and the tuner times these candidates
beside the others, so a shape keeps whichever is fastest. Every kernel takes the dense operand or the output in
three pieces (a fused query/key/value projection, ``Product.parts``): the piece of a 16-byte chunk is chosen
from its column.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from sparsetrain.kernels._runtime.device import num_sms, raw_stream, smem_optin
from sparsetrain.kernels.blocksparse._cuda_tables import (
    DwLayout,
    _cdiv,
    dw_ctas_used,
    dw_table,
    dw_widths,
    entry_info,
    ks_table,
    warp_ranges,
)
from sparsetrain.kernels.blocksparse.tuner import Backend, Product, interpreting

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


class CudaDdsPlan:
    """One launch of ``bs_dds`` with everything but the data pointers fixed (called like the Triton plans:
    ``plan(a, values, bias_or_placeholder, out)``, with an epilogue ``plan(a, values, bias, out, aux, out2)``,
    :mod:`.epilogue`; with ``parts``: ``plan(a, values, bias, out, aux, out2, a1, a2, out1, out2)``)."""

    __slots__ = ("fn", "info", "wbound", "t", "k", "block", "cfg", "trans", "has_bias", "out_width", "epi",
                 "widths")
    stable = True   # its tables are kept on the metadata and refilled by BlockSparseMeta.rewrite_
    native_epilogue = True

    def __init__(self, a: Tensor, meta, cfg: CudaDdsConfig, forward: bool, has_bias: bool, epi: int = 0,
                 parts: int = 0):
        so = _lib(a.device)
        if so is None:
            raise RuntimeError("the CUDA kernel bs_dds is unavailable here")
        self.fn = so.sparsetrain_bs_dds
        block = meta.block
        warps = so.sparsetrain_bs_dds_warps(block, cfg.mt, cfg.half)
        if warps <= 0:
            raise ValueError(f"bs_dds: no tile {cfg} for {block}x{block} blocks")
        self.info = entry_info(meta, forward)
        self.wbound = warp_ranges(meta, forward, cfg.splits * warps)
        self.block, self.cfg, self.trans, self.has_bias = block, cfg, not forward, has_bias
        n_out = meta.grid[0] if forward else meta.grid[1]
        self.out_width = n_out * block
        self.t, self.k, self.widths = a.shape[0], *_piece_widths(a, self.out_width, forward, parts)
        self.epi = epi

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor, aux: Tensor | None = None,
                 out2: Tensor | None = None, *pieces: Tensor) -> None:
        a, values, b_ptr, b_f32 = _operands(a, values, bias, self.has_bias)
        aux_ptr, out2_ptr = _epilogue_ptrs(self.epi, out, aux, out2)
        ptrs, _alive = _piece_ptrs(self.widths, a, out, pieces)
        rc = self.fn(a.data_ptr(), values.data_ptr(), self.info.data_ptr(), self.wbound.data_ptr(), b_ptr,
                     out.data_ptr(), aux_ptr, out2_ptr, *ptrs, self.t, self.k, a.stride(0), out.stride(0),
                     self.block, self.cfg.mt, self.cfg.half, self.cfg.splits, int(self.trans),
                     int(a.dtype == torch.bfloat16), b_f32, self.epi, *self.widths, raw_stream(a.device))
        if rc != 0:
            raise RuntimeError(f"bs_dds launch failed with code {rc} ({self.cfg})")


def _piece_widths(a: Tensor, out_width: int, forward: bool, parts: int) -> tuple[int, tuple[int, int]]:
    """The reduction width K and the (A, out) piece widths a launch passes (0: one tensor): a three-piece
    product's input gradient reads A (``a`` is its first piece), its forward writes the output in pieces."""
    if not parts:
        return a.shape[1], (0, 0)
    if forward:
        return a.shape[1], (0, out_width // parts)
    return a.shape[1] * parts, (a.shape[1], 0)


def _piece_ptrs(widths: tuple[int, int], a: Tensor, out: Tensor, pieces) -> tuple:
    """The pointers of A's pieces 1, 2 and out's (0 where one tensor), and the tensors they point into (kept
    alive by the caller until the launch): pieces = (a1, a2, out1, out2), of the first piece's shape and strides
    (A's pieces as the kernels read a row-major operand, :func:`_rows16`)."""
    if widths == (0, 0):
        return (0, 0, 0, 0), ()
    first, mine = (a, [_rows16(p) for p in pieces[:2]]) if widths[0] else (out, pieces[2:4])
    if len(pieces) != 4 or any(p.shape != first.shape or p.stride() != first.stride() or p.dtype != first.dtype
                               or p.data_ptr() % 16 for p in mine):
        raise ValueError("a three-piece product's pieces must have the first piece's shape, strides and dtype, "
                         "16-byte aligned")
    ptrs = [p.data_ptr() for p in mine]
    return ((*ptrs, 0, 0) if widths[0] else (0, 0, *ptrs)), mine


def _epilogue_ptrs(epi: int, out: Tensor, aux: Tensor | None, out2: Tensor | None) -> tuple[int, int]:
    """The epilogue's pointers (0 where unused); ``aux`` and ``out2`` must be laid out as ``out``."""
    if not epi:
        return 0, 0
    for name, t in (("out2", out2), ("aux", aux if epi == 2 else out)):
        if t is None or t.stride() != out.stride() or t.dtype != out.dtype or t.shape != out.shape:
            raise ValueError(f"bs_dds epilogue {epi}: {name} must have out's shape, strides and dtype")
    return (aux.data_ptr() if epi == 2 else 0), out2.data_ptr()


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


class CudaKsPlan:
    """One launch of ``bs_dds_ks`` (called like the other dense x block-sparse plans)."""

    __slots__ = ("fn", "tables", "t", "k", "cfg", "trans", "has_bias", "grid_y", "out_width", "epi", "widths")
    stable = True
    native_epilogue = True

    def __init__(self, a: Tensor, meta, cfg: CudaKsConfig, forward: bool, has_bias: bool, epi: int = 0,
                 parts: int = 0):
        so = _lib(a.device)
        if so is None:
            raise RuntimeError("the CUDA kernel bs_dds is unavailable here")
        self.fn = so.sparsetrain_bs_dds_ks
        _, warps, kp, _ = _ks_shape(so, cfg.ob)
        self.tables = ks_table(meta, forward, cfg.ob, kp)
        n_out = self.tables[4]
        self.grid_y = _cdiv(_cdiv(n_out, cfg.ob), warps)
        self.cfg, self.trans, self.has_bias = cfg, not forward, has_bias
        self.out_width = n_out * meta.block
        self.t, self.k, self.widths = a.shape[0], *_piece_widths(a, self.out_width, forward, parts)
        self.epi = epi

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor, aux: Tensor | None = None,
                 out2: Tensor | None = None, *pieces: Tensor) -> None:
        a, values, b_ptr, b_f32 = _operands(a, values, bias, self.has_bias)
        aux_ptr, out2_ptr = _epilogue_ptrs(self.epi, out, aux, out2)
        ptrs, _alive = _piece_ptrs(self.widths, a, out, pieces)
        info, wstart, counts, n_parts, n_out = self.tables
        rc = self.fn(a.data_ptr(), values.data_ptr(), info.data_ptr(), wstart.data_ptr(), counts.data_ptr(), b_ptr,
                     out.data_ptr(), aux_ptr, out2_ptr, *ptrs, self.t, self.k, a.stride(0), out.stride(0), n_parts,
                     n_out, self.cfg.ob, self.grid_y, int(self.trans), int(a.dtype == torch.bfloat16), b_f32,
                     self.epi, *self.widths, raw_stream(a.device))
        if rc != 0:
            raise RuntimeError(f"bs_dds_ks launch failed with code {rc} ({self.cfg})")


class CudaDwConfig(NamedTuple):
    """A launch of the CUDA weight-gradient kernel: tokens per staged chunk (16 or 32) and the CTA layout of
    its table (``"strips"`` or ``"tiles"``, :func:`~._cuda_tables.dw_table`)."""

    tc: int
    layout: DwLayout = "strips"


DW_CANDIDATES = (CudaDwConfig(32), CudaDwConfig(16), CudaDwConfig(32, "tiles"), CudaDwConfig(16, "tiles"))


def _dw_lib(device: torch.device):
    from sparsetrain.kernels._runtime import cuda_build as _cuda

    return _cuda.load(CSRC / "bs_dw.cu", device)


def _dw_cap(so) -> int:
    w = ctypes.c_int()
    return so.sparsetrain_bs_dw_cap(ctypes.byref(w))


def dw_candidates(x: Tensor, dy: Tensor, meta, with_bias: bool) -> list[CudaDwConfig]:
    """The CUDA weight-gradient launches that can run here: 16x16 blocks, fp16/bf16, shared memory of the
    layout's widths that fits."""
    if (not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16) or dy.dtype != x.dtype
            or meta.block_rows != 16 or meta.block_cols != 16 or meta.n_blocks == 0):
        return []
    so = _dw_lib(x.device)
    if so is None:
        return []
    cap, limit = _dw_cap(so), smem_optin(x.device)
    # the widths a plan launches with (no table built for a tile not chosen)
    return [c for c in DW_CANDIDATES if dw_smem(c.tc, *dw_widths(meta, cap, c.layout)) <= limit]


def dw_smem(tc: int, a_width: int, b_width: int) -> int:
    """Shared memory of a ``bs_dw`` launch (bytes): two stages of ``tc`` token rows of both staged ranges, each
    row padded by 8 halves (as ``sparsetrain_bs_dw`` sets its strides)."""
    return 2 * 2 * tc * (a_width + 8 + b_width + 8)


def dw_splits(t: int, tc: int, n_cta: int, sms: int) -> int:
    """Token splits of a ``bs_dw`` launch: as many as one wave holds (one CTA per multiprocessor: 512 threads of
    128 registers), at least 4 chunks each. A CTA's work is its blocks over its tokens, so one wave of longer
    CTAs beats two waves of shorter ones (and the second wave's CTAs add their partial sums with atomics too)."""
    return max(1, min(sms // max(1, n_cta), t // (4 * tc)))


class CudaDwPlan:
    """One launch of ``bs_dw``; called like the Triton weight-gradient plans: ``plan(x, dy, dv, db_or_dv)``
    with ``dv`` (and ``db``) zeroed fp32 (``atomic``)."""

    __slots__ = ("fn", "cta", "blk", "aw", "bw", "t", "tc", "splits", "tps", "with_bias", "atomic")
    stable = True   # its CTA table has room for later topologies (an empty CTA returns at once)

    def __init__(self, x: Tensor, meta, cfg: CudaDwConfig, with_bias: bool):
        so = _dw_lib(x.device)
        if so is None:
            raise RuntimeError("the CUDA kernel bs_dw is unavailable here")
        self.fn = so.sparsetrain_bs_dw
        cap = _dw_cap(so)
        self.cta, self.blk, self.aw, self.bw = dw_table(meta, with_bias, cap, cfg.layout)
        self.t, self.tc, self.with_bias = x.shape[0], cfg.tc, with_bias
        n_cta = dw_ctas_used(meta, with_bias, cap, cfg.layout)   # the split is chosen for the CTAs with work
        splits = dw_splits(self.t, cfg.tc, n_cta, num_sms(x.device))
        self.tps = _cdiv(_cdiv(self.t, splits), cfg.tc) * cfg.tc  # tokens per split, a multiple of tc
        self.splits = _cdiv(self.t, self.tps)
        self.atomic = True  # the outputs are zeroed fp32: CTAs add partial sums with atomics

    def __call__(self, x: Tensor, dy: Tensor, dv: Tensor, db: Tensor, *more_dy: Tensor) -> None:
        x, dy = _rows16(x), _rows16(dy)
        widths = (dy.shape[1], 0) if more_dy else (0, 0)   # dY in pieces: read as the "A" of _piece_ptrs
        (p1, p2, _, _), _alive = _piece_ptrs(widths, dy, dy, (*more_dy, dy, dy))
        rc = self.fn(x.data_ptr(), dy.data_ptr(), self.cta.data_ptr(), self.blk.data_ptr(), dv.data_ptr(),
                     db.data_ptr() if self.with_bias else 0, p1, p2, self.t, x.stride(0), dy.stride(0),
                     self.cta.shape[0], self.splits, self.tps, self.aw, self.bw, self.tc,
                     int(x.dtype == torch.bfloat16), widths[0], raw_stream(x.device))
        if rc != 0:
            raise RuntimeError(f"bs_dw launch failed with code {rc}")


def _candidates(p: Product) -> list:
    if interpreting():
        return []
    if p.kind == "dw":
        return dw_candidates(p.a, p.b, p.meta, p.bias)
    return [*candidates(p.a, p.block, p.k), *ks_candidates(p.a, p.block, p.k)]


_DDS_PLANS = {CudaDdsConfig: CudaDdsPlan, CudaKsConfig: CudaKsPlan}


def _make_plan(cfg: CudaDdsConfig | CudaKsConfig | CudaDwConfig, p: Product):
    if p.kind == "dw":
        return CudaDwPlan(p.a, p.meta, cfg, p.bias)
    return _DDS_PLANS[type(cfg)](p.a, p.meta, cfg, p.forward, p.bias, p.epi, p.parts)


BACKEND = Backend("cuda", (CudaDdsConfig, CudaKsConfig, CudaDwConfig), _candidates, _make_plan)
