"""The Triton gather backend: :func:`~._triton.dense_x_blocksparse_kernel` (forward, input gradient) and
:func:`~._triton.sampled_grad_kernel` (weight gradient) for every kernel block size, and under the Triton
interpreter (its small tiles are the only candidates there, so CPU tests run these kernels).

A :class:`TritonPlan` fixes everything a launch needs besides the data pointers (tile config, grid, every
integer argument, the metadata tensors, the weight gradient's token split); it is built once per topology,
token count, strides and dtypes and kept on the metadata, so a steady-state call is a dictionary lookup, one
output allocation and a direct call of the compiled kernel (:class:`~sparsetrain.kernels._runtime.
triton_launch.KernelLaunch`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from sparsetrain.kernels._runtime.device import num_sms
from sparsetrain.kernels._runtime.triton_launch import KernelLaunch
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.tuner import Backend, Product, interpreting


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class DdsConfig(NamedTuple):
    """Tiles of the dense x block-sparse kernel (forward and input gradient)."""

    block_t: int
    group_k: int
    blocks_per_prog: int  # output column blocks walked by one program
    num_warps: int
    num_stages: int
    cache_a: str = ""     # ".ca": gathered A tiles also cached in L1 (re-read by the same program)
    wide: bool = False    # group_k 1 only: accumulate the output transposed, [B, block_t] (tokens as the MMA's N)


class DwConfig(NamedTuple):
    """Tiles of the sampled weight-gradient kernel."""

    group: int
    block_t: int
    num_warps: int
    num_stages: int


# Up to 10 candidates per kernel and block size (each costs a compile and a short benchmark once). The ``wide``
# ones accumulate the transposed product, so that the MMA's N side is the 128-256 tokens instead of the block
# edge (an m64n64k16 wgmma does 16 MACs per shared-memory byte it reads, m64n256k16 26); they are offered where
# the tuner picks them on an H200 (docs/history/blocksparse.md).
_C = DdsConfig
_W = True
DDS_CANDIDATES = {
    16: [_C(128, 4, 8, 4, 3), _C(128, 4, 8, 4, 3, ".ca"), _C(128, 2, 8, 4, 4, ".ca"), _C(128, 2, 1, 4, 4),
         _C(128, 8, 16, 4, 3, ".ca"), _C(128, 4, 8, 8, 3), _C(128, 2, 8, 8, 2), _C(64, 4, 32, 4, 4, ".ca")],
    32: [_C(128, 2, 4, 4, 3), _C(128, 2, 8, 4, 3, ".ca"), _C(128, 1, 8, 4, 4, ".ca"), _C(128, 1, 1, 4, 4),
         _C(256, 1, 4, 8, 4), _C(128, 1, 4, 8, 3), _C(128, 1, 4, 8, 2), _C(64, 2, 16, 4, 4, ".ca")],
    64: [_C(128, 1, 4, 4, 3), _C(128, 1, 8, 4, 3, ".ca"), _C(256, 1, 2, 8, 3), _C(128, 1, 1, 4, 3),
         _C(128, 1, 4, 8, 3), _C(128, 1, 4, 8, 2), _C(64, 1, 16, 4, 4, ".ca"), _C(256, 1, 8, 8, 3, ".ca"),
         _C(128, 1, 4, 4, 4, "", _W), _C(256, 1, 2, 8, 4)],
    128: [_C(128, 1, 2, 8, 3), _C(64, 1, 8, 4, 3, ".ca"), _C(64, 1, 1, 4, 4), _C(128, 1, 1, 8, 2),
          _C(256, 1, 2, 8, 2, "", _W), _C(128, 1, 2, 8, 3, "", _W)],
}
DW_CANDIDATES = {
    16: [DwConfig(4, 128, 4, 3), DwConfig(8, 128, 8, 3), DwConfig(4, 64, 4, 4), DwConfig(8, 64, 4, 4),
         DwConfig(8, 128, 4, 3), DwConfig(8, 64, 8, 2)],
    32: [DwConfig(2, 128, 4, 3), DwConfig(4, 128, 8, 3), DwConfig(2, 64, 4, 4), DwConfig(4, 64, 4, 4),
         DwConfig(2, 128, 8, 2)],
    64: [DwConfig(1, 128, 4, 3), DwConfig(2, 128, 8, 3), DwConfig(1, 64, 4, 4), DwConfig(2, 64, 4, 4),
         DwConfig(1, 128, 8, 2), DwConfig(1, 64, 8, 3), DwConfig(1, 256, 8, 2), DwConfig(1, 256, 4, 3)],
    128: [DwConfig(1, 64, 8, 3), DwConfig(1, 128, 8, 3)],
}
# Under the interpreter: small tiles; b16 exercises the gathered (GROUP_K > 1) path, b32 the scalar one,
# and 2 output blocks per program exercise the in-loop store.
INTERP_DDS = {16: _C(16, 2, 2, 4, 1), 32: _C(16, 1, 2, 4, 1), 64: _C(16, 1, 2, 4, 1), 128: _C(16, 1, 2, 4, 1)}
INTERP_DW = {16: DwConfig(4, 16, 4, 1), 32: DwConfig(2, 16, 4, 1), 64: DwConfig(1, 16, 4, 1),
             128: DwConfig(1, 16, 4, 1)}


class TritonPlan:
    """One launch of one kernel with everything but the data pointers fixed: ``args`` holds the kernel's
    arguments with ``None`` at the positions listed in ``ptr_pos`` (filled per call)."""

    __slots__ = ("kernel", "grid", "args", "ptr_pos", "options", "out_width", "atomic", "stable", "launch",
                 "native_epilogue")

    def __init__(self, kernel, grid: tuple[int, ...], args: list, ptr_pos: tuple[int, ...], options: dict, *,
                 out_width: int = 0, atomic: bool = False, stable: bool = False, native_epilogue: bool = False):
        self.kernel, self.grid, self.args, self.ptr_pos, self.options = kernel, grid, args, ptr_pos, options
        self.out_width, self.atomic = out_width, atomic
        #: built with Product.epi: called with the epilogue's two more tensors (aux, out2)
        self.native_epilogue = native_epilogue
        #: its grid and integer arguments hold for any topology of the active count, and its tensors are
        #: refilled by BlockSparseMeta.rewrite_: the plan (and a CUDA graph that captured it) follows an update
        self.stable = stable
        self.launch = KernelLaunch(kernel, grid, options)

    def __call__(self, *ptrs: Tensor) -> None:
        """``ptrs`` fill ``ptr_pos`` in order; positions left out get the last tensor given (pointers the kernel
        does not read under its options: an epilogue plan called without the epilogue's tensors)."""
        args = list(self.args)
        if len(ptrs) < len(self.ptr_pos):
            ptrs = (*ptrs, *(ptrs[-1],) * (len(self.ptr_pos) - len(ptrs)))
        for pos, t in zip(self.ptr_pos, ptrs):
            args[pos] = t
        self.launch(*args)


def _choose_split(n_groups: int, T: int, block_t: int, device: torch.device) -> int:
    """Token slices for the weight gradient: enough programs for ~4 per multiprocessor, while each slice
    keeps at least 4 reduction steps."""
    if interpreting() or device.type != "cuda":
        return 2 if T >= 2 * block_t else 1  # exercise the atomic path in CPU tests
    split, target = 1, 4 * num_sms(device)
    while split < 64 and n_groups * split < target and cdiv(T, 2 * split) >= 4 * block_t:
        split *= 2
    return split


def dds_plan(meta: BlockSparseMeta, cfg: DdsConfig, forward: bool, has_bias: bool, T: int,
             a_strides: tuple[int, int], epi: int = 0, parts: int = 0) -> TritonPlan:
    """The launch plan of :func:`~._triton.dense_x_blocksparse_kernel` for one tile (built from integers only,
    so a plan made later, e.g. a TMA plan's fallback, keeps no call's tensors). ``parts`` (0 or 3): the layer's
    output is three tensors of equal width (the forward writes them, the input gradient reads dY from them); the
    plan is then called ``plan(a, values, bias, out, out, out, a1, a2, out1, out2)`` with the pieces (forward:
    ``out, out1, out2``; input gradient: ``a, a1, a2``) and ``a_strides`` / the output's row stride are a piece's."""
    from sparsetrain.kernels.blocksparse._triton import dense_x_blocksparse_kernel

    B = meta.block
    n_out = meta.grid[0] if forward else meta.grid[1]
    ptr, kidx, slot, oidx = meta.padded_entries(forward, cfg.group_k, fixed=True)
    n_ranges = cdiv(n_out, cfg.blocks_per_prog)
    grid = (cdiv(T, cfg.block_t) * n_ranges,)
    args = [None, None, ptr, kidx, slot, oidx, None, None, None, None, None, None, None, None,
            T, a_strides[0], a_strides[1], n_out * B // (parts if forward and parts else 1), n_out, n_ranges,
            cfg.blocks_per_prog]
    if parts and (parts != 3 or epi or meta.grid[0] % parts):
        raise ValueError(f"dds_plan: parts={parts} (3 pieces of whole blocks, no epilogue)")
    opts = dict(FORWARD=forward, HAS_BIAS=has_bias, EPI=epi, BLOCK=B, GROUP_K=cfg.group_k, BLOCK_T=cfg.block_t,
                CACHE_A=cfg.cache_a, WIDE=cfg.wide and cfg.group_k == 1, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, A_PARTS=0 if forward or not parts else meta.grid[0] // parts,
                OUT_PARTS=meta.grid[0] // parts if forward and parts else 0)
    # called plan(a, values, bias, out) or, with an epilogue, plan(a, values, bias, out, aux, out2); an unused
    # pointer argument is given out's (the kernel does not touch it)
    return TritonPlan(dense_x_blocksparse_kernel, grid, args, (0, 1, 6, 7, 8, 9, 10, 11, 12, 13), opts,
                      out_width=n_out * B,
                      stable=True, native_epilogue=True)


def dw_plan(meta: BlockSparseMeta, cfg: DwConfig, with_bias: bool, T: int, x_strides: tuple[int, int],
            dy_stride: int, device: torch.device, parts: int = 0) -> TritonPlan:
    """The launch plan of :func:`~._triton.sampled_grad_kernel` for one tile (from integers only), called
    ``plan(x, dy, dv, db)``; with ``parts`` = 3 (dY as three tensors of equal width, ``dy_stride`` a piece's row
    stride) ``plan(x, dy, dv, db, dy1, dy2)``."""
    from sparsetrain.kernels.blocksparse._triton import sampled_grad_kernel

    grow, gstart, gcount, gfirst, n_groups = meta.dw_groups(cfg.group, fixed=True)
    split = _choose_split(meta.dw_groups_used(cfg.group), T, cfg.block_t, device)   # for the groups with work
    t_per_split = cdiv(cdiv(T, split), cfg.block_t) * cfg.block_t
    if parts and (parts != 3 or meta.grid[0] % parts):
        raise ValueError(f"dw_plan: parts={parts} (3 pieces of whole blocks)")
    args = [None, None, grow, gstart, gcount, gfirst, meta.col_idx, None, None, None, None,
            T, x_strides[0], x_strides[1], dy_stride, n_groups, t_per_split]
    opts = dict(HAS_DBIAS=with_bias, BLOCK=meta.block, GROUP=cfg.group, BLOCK_T=cfg.block_t, SPLIT=split,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages, DY_PARTS=meta.grid[0] // parts if parts else 0)
    return TritonPlan(sampled_grad_kernel, (n_groups * split,), args, (0, 1, 7, 8, 9, 10), opts, atomic=split > 1,
                      stable=True)


def _candidates(p: Product) -> list:
    if interpreting() or not p.a.is_cuda:
        return [(INTERP_DW if p.kind == "dw" else INTERP_DDS)[p.block]]
    return list((DW_CANDIDATES if p.kind == "dw" else DDS_CANDIDATES)[p.block])


def _make_plan(cfg: DdsConfig | DwConfig, p: Product) -> TritonPlan:
    T = p.a.shape[0]
    if p.kind == "dw":
        return dw_plan(p.meta, cfg, p.bias, T, p.a.stride(), p.b.stride(0), p.a.device, parts=p.parts)
    return dds_plan(p.meta, cfg, p.forward, p.bias, T, p.a.stride(), p.epi, parts=p.parts)


BACKEND = Backend("gather", (DdsConfig, DwConfig), _candidates, _make_plan)
