"""The Triton TMA backend (Hopper, 32-128 blocks): :func:`~._triton.dense_x_blocksparse_tma_kernel` and
:func:`~._triton.sampled_grad_tma_kernel`, whose operand tiles the Tensor Memory Accelerator fetches as whole
boxes at data-dependent coordinates (no per-thread gather addresses).

Eager launches give the kernels raw pointers and the kernels make their tensor descriptors on the device (in
global scratch memory from Triton's allocator): host-made descriptors would be encoded by Triton at every
launch, which costs more host time than it saves GPU time. Under CUDA-graph capture the plans pass host-made
descriptors instead: a graph pays the encoding once, at capture, the kernels run at least as fast with them,
and a captured graph keeps the operands' addresses fixed anyway (docs/history/blocksparse.md).
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from sparsetrain.kernels._runtime.triton_launch import KernelLaunch
from sparsetrain.kernels.blocksparse import gather
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.tuner import Backend, Product, interpreting


class TmaDdsConfig(NamedTuple):
    """Tiles of the TMA dense x block-sparse kernel (one output block per program)."""

    block_t: int
    num_warps: int
    num_stages: int
    wide: bool = False


class TmaDwConfig(NamedTuple):
    """Tiles of the TMA sampled weight-gradient kernel (``group`` blocks of one block row per program, sharing
    each dY tile)."""

    block_t: int
    num_warps: int
    num_stages: int
    group: int = 1


_W = True
DDS_CANDIDATES = {
    32: [TmaDdsConfig(128, 4, 4), TmaDdsConfig(256, 8, 4)],
    64: [TmaDdsConfig(256, 4, 3, _W), TmaDdsConfig(128, 4, 4, _W), TmaDdsConfig(128, 4, 2, _W),
         TmaDdsConfig(256, 4, 2, _W)],
    128: [TmaDdsConfig(128, 8, 3), TmaDdsConfig(64, 4, 4), TmaDdsConfig(256, 8, 2, _W)],
}
DW_CANDIDATES = {
    32: [TmaDwConfig(128, 4, 4), TmaDwConfig(64, 4, 4), TmaDwConfig(128, 4, 2), TmaDwConfig(128, 4, 3, 2)],
    64: [TmaDwConfig(64, 4, 4), TmaDwConfig(64, 8, 3), TmaDwConfig(128, 4, 3), TmaDwConfig(128, 8, 3),
         TmaDwConfig(32, 4, 3), TmaDwConfig(32, 4, 3, 2), TmaDwConfig(64, 8, 2, 2)],
    128: [TmaDwConfig(64, 8, 3), TmaDwConfig(32, 4, 4)],
}

_THREAD = threading.local()


def host_desc(device: torch.device) -> bool:
    """Whether this launch takes host-made descriptors: on a CUDA device while a graph is being captured."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _tma_scratch(size: int, alignment: int, stream: int | None) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_context(device: torch.device) -> None:
    """Host-made descriptors are encoded at launch with the driver API, which fails ("invalid device context")
    in a thread where no CUDA runtime call has made the context current yet (seen in the autograd engine's
    backward thread): make it current once per thread."""
    if device.type != "cuda":
        return
    done = getattr(_THREAD, "devices", None)
    if done is None:
        done = _THREAD.devices = set()
    if device.index not in done:
        torch.cuda.set_device(device)
        done.add(device.index)


def _ensure_scratch() -> None:
    """Device-made descriptors live in global scratch memory that Triton asks an allocator for at launch.
    Triton keeps the allocator in a context variable, which every thread (e.g. the autograd engine's backward
    thread) starts without: install ours once per thread unless one is set."""
    if getattr(_THREAD, "scratch", False):
        return
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)
    _THREAD.scratch = True


def rows_ok(t: Tensor) -> bool:
    """Whether the TMA can read ``t`` row by row (unit column stride, 16-byte aligned start and rows)."""
    return ((t.is_cuda or interpreting()) and t.shape[0] > 0 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def operands_ok(a: Tensor, values: Tensor) -> bool:
    """Whether the TMA dense x block-sparse kernel can take these operands (values in A's dtype too)."""
    return (rows_ok(a) and values.dtype == a.dtype and values.shape[0] > 0 and values.is_contiguous()
            and values.data_ptr() % 16 == 0)


def _hopper(t: Tensor) -> bool:
    return not interpreting() and torch.cuda.get_device_capability(t.device)[0] >= 9


class _Launches:
    """The kernel's launch for each descriptor kind (the kind changes the arguments and a constexpr)."""

    __slots__ = ("fn", "grid", "kwargs", "by_flag")

    def __init__(self, fn, grid: tuple[int, ...], kwargs: dict):
        self.fn, self.grid, self.kwargs, self.by_flag = fn, grid, kwargs, {}

    def __call__(self, flag: bool, *args) -> None:
        launch = self.by_flag.get(flag)
        if launch is None:
            launch = self.by_flag[flag] = KernelLaunch(self.fn, self.grid, {**self.kwargs, "HOST_DESC": flag})
        launch(*args)


class _WithFallback:
    """An operand the TMA cannot take (e.g. a 2-byte-misaligned view with the tuned shape and strides) runs the
    gather plan instead, built on first need from integers only: a closure over the planning call's tensors
    would keep them (the first batch's activations and output, per layer) alive as long as the plan."""

    __slots__ = ()
    #: follows BlockSparseMeta.rewrite_: the grid depends on the shapes only, the kernels read the index tensors
    #: and the fixed-size groups, and the fallback is a stable gather plan
    stable = True

    def _fall_back(self, *ptrs: Tensor) -> None:
        if not isinstance(self.fallback, gather.TritonPlan):
            self.fallback = self.fallback()
        self.fallback(*ptrs)


class DdsPlan(_WithFallback):
    """A launch of :func:`~._triton.dense_x_blocksparse_tma_kernel`."""

    __slots__ = ("cfg", "meta", "T", "K", "n_out", "idx", "fallback", "out_width", "launch")

    def __init__(self, a: Tensor, meta: BlockSparseMeta, cfg: TmaDdsConfig, forward: bool, has_bias: bool,
                 fallback: Callable[[], gather.TritonPlan]):
        from sparsetrain.kernels.blocksparse._triton import dense_x_blocksparse_tma_kernel

        self.cfg, self.meta, self.fallback = cfg, meta, fallback
        self.T, self.K = a.shape
        self.n_out = meta.grid[0] if forward else meta.grid[1]
        self.idx = ((meta.row_ptr, meta.col_idx, meta.col_idx) if forward
                    else (meta.col_ptr, meta.t_row_idx, meta.t_slot))
        self.out_width = self.n_out * meta.block
        grid = (gather.cdiv(self.T, cfg.block_t) * self.n_out,)
        self.launch = _Launches(dense_x_blocksparse_tma_kernel, grid, dict(
            FORWARD=forward, HAS_BIAS=has_bias, BLOCK=meta.block, BLOCK_T=cfg.block_t, WIDE=cfg.wide,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages))

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor, host: bool | None = None) -> None:
        """``host``: descriptor kind (default: :func:`host_desc`; tests pass it to run both kinds anywhere)."""
        if not operands_ok(a, values):
            self._fall_back(a, values, bias, out)
            return
        B, cfg = self.meta.block, self.cfg
        if host is None:
            host = host_desc(a.device)
        if host:
            from triton.tools.tensor_descriptor import TensorDescriptor

            _ensure_context(a.device)
            a_arg = TensorDescriptor(a, [self.T, self.K], [a.stride(0), 1], [cfg.block_t, B])
            v_arg = TensorDescriptor(values, [values.shape[0] * B, B], [B, 1], [B, B])
        else:
            _ensure_scratch()
            a_arg, v_arg = a, values
        self.launch(host, a_arg, v_arg, *self.idx, bias, out, self.T, self.K, a.stride(0), values.shape[0],
                    out.stride(0), self.n_out)


class DwPlan(_WithFallback):
    """A launch of :func:`~._triton.sampled_grad_tma_kernel`; its fallback is the gather plan with the same
    groups and token split (so the same output buffers)."""

    __slots__ = ("cfg", "meta", "T", "groups", "t_per_split", "fallback", "atomic", "launch")

    def __init__(self, x: Tensor, meta: BlockSparseMeta, cfg: TmaDwConfig, with_bias: bool,
                 fallback: Callable[[], gather.TritonPlan]):
        from sparsetrain.kernels.blocksparse._triton import sampled_grad_tma_kernel

        self.cfg, self.meta, self.T, self.fallback = cfg, meta, x.shape[0], fallback
        self.groups = meta.dw_groups(cfg.group, fixed=True)
        split = gather._choose_split(meta.dw_groups_used(cfg.group), self.T, cfg.block_t, x.device)
        self.t_per_split = gather.cdiv(gather.cdiv(self.T, split), cfg.block_t) * cfg.block_t
        self.atomic = split > 1
        self.launch = _Launches(sampled_grad_tma_kernel, (self.groups[4] * split,), dict(
            HAS_DBIAS=with_bias, BLOCK=meta.block, BLOCK_T=cfg.block_t, SPLIT=split, GROUP=cfg.group,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages))

    def __call__(self, x: Tensor, dy: Tensor, dv: Tensor, db: Tensor, host: bool | None = None) -> None:
        if not (rows_ok(x) and rows_ok(dy)):
            self._fall_back(x, dy, dv, db)
            return
        B, cfg, T = self.meta.block, self.cfg, self.T
        grow, gstart, gcount, gfirst, n_groups = self.groups
        if host is None:
            host = host_desc(x.device)
        if host:
            from triton.tools.tensor_descriptor import TensorDescriptor

            _ensure_context(x.device)
            x_arg = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [cfg.block_t, B])
            dy_arg = TensorDescriptor(dy, list(dy.shape), [dy.stride(0), 1], [cfg.block_t, B])
        else:
            _ensure_scratch()
            x_arg, dy_arg = x, dy
        self.launch(host, x_arg, dy_arg, grow, gstart, gcount, gfirst, self.meta.col_idx, dv, db, T, x.shape[1],
                    dy.shape[1], x.stride(0), dy.stride(0), n_groups, self.t_per_split)


def _candidates(p: Product) -> list:
    if p.parts:   # the tensor descriptors describe one tensor
        return []
    if p.kind == "dw":
        ok = rows_ok(p.a) and rows_ok(p.b) and _hopper(p.a)
        return list(DW_CANDIDATES.get(p.block, [])) if ok else []
    return list(DDS_CANDIDATES.get(p.block, [])) if operands_ok(p.a, p.b) and _hopper(p.a) else []


def _make_plan(cfg: TmaDdsConfig | TmaDwConfig, p: Product) -> DdsPlan | DwPlan:
    meta, T = p.meta, p.a.shape[0]
    if p.kind == "dw":
        return DwPlan(p.a, meta, cfg, p.bias, functools.partial(
            gather.dw_plan, meta, gather.DwConfig(cfg.group, cfg.block_t, cfg.num_warps, cfg.num_stages),
            p.bias, T, p.a.stride(), p.b.stride(0), p.a.device))
    return DdsPlan(p.a, meta, cfg, p.forward, p.bias, functools.partial(
        gather.dds_plan, meta, gather.DDS_CANDIDATES[meta.block][0], p.forward, p.bias, T, p.a.stride()))


BACKEND = Backend("tma", (TmaDdsConfig, TmaDwConfig), _candidates, _make_plan)
