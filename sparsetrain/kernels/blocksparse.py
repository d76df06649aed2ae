"""Block-sparse linear layer with compressed storage: ``y = x · W_effᵀ + b`` where only the active
``b x b`` blocks of ``W [O, I]`` exist in memory.

Storage: ``values [n_blocks, b, b]`` (the active blocks in row-major block order: slot ``s`` is the
``s``-th active block of the grid read row by row) and a :class:`BlockSparseMeta` of int32 index arrays:

- ``row_ptr [R+1]``, ``col_idx [n]``, ``row_idx [n]``: CSR over block rows (forward ``Y = X·Wᵀ``);
- ``col_ptr [C+1]``, ``t_row_idx [n]``, ``t_slot [n]``: the *transpose* metadata, CSR over block columns,
  each entry naming its block row and its slot in ``values`` (input gradient ``dX = dY·W`` without a
  transposed copy of the values).

It is rebuilt from the layer's bool block mask ``[O/b, I/b]`` only when the topology changes.

On CUDA (or under ``TRITON_INTERPRET=1``) with square blocks of 16, 32, 64 or 128 the three products run
as Triton kernels (:mod:`._blocksparse_triton`); for 16x16 and 32x32 blocks on a GPU with ``nvcc`` the CUDA
kernels of :mod:`._blocksparse_cuda` are timed beside them and used where faster (docs/blocksparse.md, round 4),
and for 32-128 blocks on Hopper the TMA kernels (round 5);
otherwise the plain-torch reference
(:mod:`.blocksparse_reference`) computes the same function through a dense scatter, so the same layer
trains on a CPU and with small blocks (1, 4, 8), only without the speed-up.

>>> import torch
>>> mask = torch.rand(6, 4) < 0.5
>>> meta = BlockSparseMeta.from_mask(mask, 16)                       # W is 96 x 64
>>> values = torch.randn(meta.n_blocks, 16, 16)
>>> block_sparse_linear(torch.randn(37, 64), values, meta).shape
torch.Size([37, 96])
"""
from __future__ import annotations

import functools
import math
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsetrain.kernels import _blocksparse_cuda as _cuda_dds
from sparsetrain.kernels._blocksparse_cuda import (
    CudaDdsConfig,
    CudaDdsPlan,
    CudaDwConfig,
    CudaDwPlan,
    CudaKsConfig,
    CudaKsPlan,
)
from sparsetrain.kernels._runtime.device import num_sms
from sparsetrain.kernels._runtime.triton_launch import KernelLaunch
from sparsetrain.kernels.blocksparse_reference import dense_to_values, values_to_dense
from sparsetrain.sparsity.layout import Block

KERNEL_BLOCKS = (16, 32, 64, 128)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# ---- compressed format ------------------------------------------------------------------------------
@dataclass(eq=False)
class BlockSparseMeta:
    """Index arrays of a block-sparse ``[out_features, in_features]`` weight (see the module docstring)."""

    out_features: int
    in_features: int
    block_rows: int
    block_cols: int
    n_blocks: int
    row_ptr: Tensor
    col_idx: Tensor
    row_idx: Tensor
    col_ptr: Tensor
    t_row_idx: Tensor
    t_slot: Tensor
    _groups: dict = field(default_factory=dict, repr=False)

    TENSORS: ClassVar[tuple[str, ...]] = ("row_ptr", "col_idx", "row_idx", "col_ptr", "t_row_idx", "t_slot")

    @classmethod
    def from_mask(cls, mask: Tensor, block: Block | int | str | tuple[int, int]) -> BlockSparseMeta:
        """Build the metadata from a bool block mask ``[O/br, I/bc]`` (on the mask's device)."""
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask))}")
        if mask.dim() != 2:
            raise ValueError(f"mask must be a 2-D block grid, got shape {tuple(mask.shape)}")
        blk = Block.parse(block)
        R, C = mask.shape
        dev = mask.device
        rows, cols = mask.nonzero(as_tuple=True)  # row-major order = slot order
        n = int(rows.numel())
        row_ptr = torch.zeros(R + 1, dtype=torch.int64, device=dev)
        row_ptr[1:] = mask.sum(1).cumsum(0)
        col_ptr = torch.zeros(C + 1, dtype=torch.int64, device=dev)
        col_ptr[1:] = mask.sum(0).cumsum(0)
        slot_of = torch.full((R, C), -1, dtype=torch.int64, device=dev)
        slot_of[rows, cols] = torch.arange(n, device=dev)
        t_cols, t_rows = mask.t().nonzero(as_tuple=True)  # column-major order: per column, rows ascending
        i32 = torch.int32
        return cls(R * blk.rows, C * blk.cols, blk.rows, blk.cols, n,
                   row_ptr.to(i32), cols.to(i32), rows.to(i32),
                   col_ptr.to(i32), t_rows.to(i32), slot_of[t_rows, t_cols].to(i32))

    @property
    def grid(self) -> tuple[int, int]:
        return self.out_features // self.block_rows, self.in_features // self.block_cols

    @property
    def block(self) -> int:
        """Edge of a square block (raises for rectangular blocks)."""
        if self.block_rows != self.block_cols:
            raise ValueError(f"block {self.block_rows}x{self.block_cols} is not square")
        return self.block_rows

    @property
    def density(self) -> float:
        R, C = self.grid
        return self.n_blocks / max(1, R * C)

    @property
    def device(self) -> torch.device:
        return self.row_ptr.device

    @property
    def kernel_supported(self) -> bool:
        """Square blocks of 16/32/64/128 run on the Triton kernels; others use the reference path."""
        return self.block_rows == self.block_cols and self.block_rows in KERNEL_BLOCKS

    def with_tensors(self, **tensors: Tensor) -> BlockSparseMeta:
        """Same topology, index tensors replaced (e.g. after ``module.to(device)``); caches are dropped."""
        return replace(self, **tensors, _groups={})

    def to(self, device: torch.device | str) -> BlockSparseMeta:
        return self.with_tensors(**{k: getattr(self, k).to(device) for k in self.TENSORS})

    def padded_entries(self, forward: bool, group_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Entry lists of the dense x block-sparse kernel, per output column block, each padded to a
        multiple of ``group_k`` (at least one group, so empty output blocks are written too):
        ``(ptr [n_out+1], kidx, slot (-1 = padding), out_block)``. Forward: per block row of W (CSR);
        input gradient: per block column (the transpose metadata). Cached per ``(forward, group_k)``."""
        key = ("dds", forward, group_k)
        if key not in self._groups:
            if forward:
                ptr, kidx = self.row_ptr.long(), self.col_idx.long()
                slot = torch.arange(self.n_blocks, device=self.device)
            else:
                ptr, kidx, slot = self.col_ptr.long(), self.t_row_idx.long(), self.t_slot.long()
            n_out = ptr.numel() - 1
            counts = ptr[1:] - ptr[:-1]
            padded = ((counts + group_k - 1) // group_k).clamp(min=1) * group_k
            pptr = torch.zeros(n_out + 1, dtype=torch.long, device=self.device)
            pptr[1:] = padded.cumsum(0)
            out_block = torch.repeat_interleave(torch.arange(n_out, device=self.device), padded)
            pos = torch.arange(out_block.numel(), device=self.device) - pptr[out_block]
            real = pos < counts[out_block]
            src = (ptr[out_block] + pos).clamp(max=max(self.n_blocks - 1, 0))
            if self.n_blocks == 0:
                pk, ps = torch.zeros_like(pos), torch.full_like(pos, -1)
            else:
                pk = torch.where(real, kidx[src], 0)
                ps = torch.where(real, slot[src], -1)
            i32 = torch.int32
            self._groups[key] = (pptr.to(i32), pk.to(i32), ps.to(i32), out_block.to(i32))
        return self._groups[key]

    def dw_groups(self, group: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
        """Groups of up to ``group`` consecutive active blocks of one block row, for the weight-gradient
        kernel: ``(row, first_slot, count, is_first_of_row, n_groups)``. Every block row has at least one
        group (count 0 when empty) so that the fused bias gradient covers it. Cached per ``group``."""
        key = ("dw", group)
        if key not in self._groups:
            R, _ = self.grid
            ptr = self.row_ptr.long()
            counts = ptr[1:] - ptr[:-1]
            ng = ((counts + group - 1) // group).clamp(min=1)
            total = int(ng.sum())
            grow = torch.repeat_interleave(torch.arange(R, device=self.device), ng)
            chunk = torch.arange(total, device=self.device) - torch.repeat_interleave(ng.cumsum(0) - ng, ng)
            gstart = ptr[grow] + chunk * group
            gcount = (ptr[grow + 1] - gstart).clamp(0, group)
            i32 = torch.int32
            self._groups[key] = (grow.to(i32), gstart.to(i32), gcount.to(i32), (chunk == 0).to(i32), total)
        return self._groups[key]


# ---- tile choice: a small per-shape tuning cache --------------------------------------------------
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


# Up to 10 candidates per kernel and block size (each costs a compile and a short benchmark once). The
# ``wide`` ones (round 5) accumulate the transposed product, so that the MMA's N side is the 128-256 tokens
# instead of the block edge (an m64n64k16 wgmma does 16 MACs per shared-memory byte it reads, m64n256k16 26);
# kept where the tuner picked them on the H200 (docs/blocksparse.md, round 5).
_C = DdsConfig
_W = True
_DDS_CANDIDATES = {
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
_DW_CANDIDATES = {
    16: [DwConfig(4, 128, 4, 3), DwConfig(8, 128, 8, 3), DwConfig(4, 64, 4, 4), DwConfig(8, 64, 4, 4),
         DwConfig(8, 128, 4, 3), DwConfig(8, 64, 8, 2)],
    32: [DwConfig(2, 128, 4, 3), DwConfig(4, 128, 8, 3), DwConfig(2, 64, 4, 4), DwConfig(4, 64, 4, 4),
         DwConfig(2, 128, 8, 2)],
    64: [DwConfig(1, 128, 4, 3), DwConfig(2, 128, 8, 3), DwConfig(1, 64, 4, 4), DwConfig(2, 64, 4, 4),
         DwConfig(1, 128, 8, 2), DwConfig(1, 64, 8, 3)],
    128: [DwConfig(1, 64, 8, 3), DwConfig(1, 128, 8, 3)],
}
# Under the interpreter: small tiles; b16 exercises the gathered (GROUP_K > 1) path, b32 the scalar one,
# and 2 output blocks per program exercise the in-loop store.
_INTERP_DDS = {16: _C(16, 2, 2, 4, 1), 32: _C(16, 1, 2, 4, 1), 64: _C(16, 1, 2, 4, 1), 128: _C(16, 1, 2, 4, 1)}
_INTERP_DW = {16: DwConfig(4, 16, 4, 1), 32: DwConfig(2, 16, 4, 1), 64: DwConfig(1, 16, 4, 1),
              128: DwConfig(1, 16, 4, 1)}


class TmaDdsConfig(NamedTuple):
    """Tiles of the TMA variant of the dense x block-sparse kernel (one output block per program)."""

    block_t: int
    num_warps: int
    num_stages: int
    wide: bool = False


_TMA_CANDIDATES = {
    32: [TmaDdsConfig(128, 4, 4), TmaDdsConfig(256, 8, 4)],
    64: [TmaDdsConfig(256, 4, 3, _W), TmaDdsConfig(128, 4, 4, _W), TmaDdsConfig(128, 4, 2, _W),
         TmaDdsConfig(256, 4, 2, _W)],
    128: [TmaDdsConfig(128, 8, 3), TmaDdsConfig(64, 4, 4), TmaDdsConfig(256, 8, 2, _W)],
}


class TmaDwConfig(NamedTuple):
    """Tiles of the TMA variant of the sampled weight-gradient kernel (``group`` blocks of one block row per
    program, sharing each dY tile)."""

    block_t: int
    num_warps: int
    num_stages: int
    group: int = 1


_TMA_DW_CANDIDATES = {
    32: [TmaDwConfig(128, 4, 4), TmaDwConfig(64, 4, 4), TmaDwConfig(128, 4, 2), TmaDwConfig(128, 4, 3, 2)],
    64: [TmaDwConfig(64, 4, 4), TmaDwConfig(64, 8, 3), TmaDwConfig(128, 4, 3), TmaDwConfig(128, 8, 3),
         TmaDwConfig(32, 4, 3), TmaDwConfig(32, 4, 3, 2), TmaDwConfig(64, 8, 2, 2)],
    128: [TmaDwConfig(64, 8, 3), TmaDwConfig(32, 4, 4)],
}


_THREAD = threading.local()
# Both read once from the environment (SPARSETRAIN_TMA_HOST_DESC=1, SPARSETRAIN_TMA_BACKWARD=0) or set here.
# True: the TMA kernels get host-made descriptors (Triton encodes them at every launch); False: they make them
# on the device (global scratch from Triton's allocator). See docs/blocksparse.md, round 5.
TMA_HOST_DESC = os.environ.get("SPARSETRAIN_TMA_HOST_DESC", "0") == "1"
# Under CUDA-graph capture the TMA kernels take host-made descriptors whatever TMA_HOST_DESC says
# (SPARSETRAIN_TMA_HOST_DESC_GRAPHS=0: they follow TMA_HOST_DESC). Encoding them costs host time at every eager
# launch, but a graph pays it once at capture, and the kernels run at least as fast with them (round 7: a replay
# took 0.181 ms where the eager kernels with device-made ones took 0.184 ms of GPU time; docs/blocksparse.md). The
# descriptors hold the operands' addresses, which a captured graph keeps fixed anyway.
TMA_HOST_DESC_IN_GRAPHS = os.environ.get("SPARSETRAIN_TMA_HOST_DESC_GRAPHS", "1") != "0"
# Offer the TMA kernels to the tuner for the backward products (dX, dW) too (SPARSETRAIN_TMA_BACKWARD=0: the
# forward only). One early run showed slower eager fwd+bwd wall times with them at 10% density; a later run of
# both settings side by side had the same kind of outlier with the gather backward (host-bound eager calls vary
# run to run) and TMA faster or within 1% in all 12 rows (docs/blocksparse.md, round 5).
TMA_BACKWARD = os.environ.get("SPARSETRAIN_TMA_BACKWARD", "1") != "0"


def _host_desc(device: torch.device) -> bool:
    """Whether this launch of a TMA kernel takes host-made descriptors (read at every call)."""
    return TMA_HOST_DESC or (TMA_HOST_DESC_IN_GRAPHS and device.type == "cuda"
                             and torch.cuda.is_current_stream_capturing())


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


def _ensure_tma_scratch() -> None:
    """The TMA kernels make their descriptors on the device, in global scratch memory that Triton asks an
    allocator for at launch. Triton keeps the allocator in a context variable, which every thread (e.g. the
    autograd engine's backward thread) starts without: install ours once per thread unless one is set."""
    if getattr(_THREAD, "scratch", False):
        return
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_tma_scratch)
    _THREAD.scratch = True


def _rows_tma_ok(t: Tensor) -> bool:
    return ((t.is_cuda or interpreting()) and t.shape[0] > 0 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and (t.stride(0) * t.element_size()) % 16 == 0)


def _tma_ok(a: Tensor, values: Tensor) -> bool:
    """Whether the TMA kernel can take these operands (16-byte aligned rows, values in A's dtype)."""
    return (_rows_tma_ok(a) and values.dtype == a.dtype and values.shape[0] > 0 and values.is_contiguous()
            and values.data_ptr() % 16 == 0)


def _hopper(t: Tensor) -> bool:
    return not interpreting() and torch.cuda.get_device_capability(t.device)[0] >= 9


def _tma_dw_candidates(x: Tensor, dy: Tensor, B: int) -> list[TmaDwConfig]:
    if not (TMA_BACKWARD and _rows_tma_ok(x) and _rows_tma_ok(dy) and _hopper(x)):
        return []
    return list(_TMA_DW_CANDIDATES.get(B, []))


def _tma_candidates(a: Tensor, values: Tensor, B: int, forward: bool) -> list[TmaDdsConfig]:
    if not ((forward or TMA_BACKWARD) and _tma_ok(a, values) and _hopper(a)):
        return []
    return list(_TMA_CANDIDATES.get(B, []))

_TUNED: dict[tuple, NamedTuple] = {}
_TIMED: dict[tuple, list[tuple[NamedTuple, float]]] = {}  # the tuner's timings per key (benchmark reports)
_FORCED: dict[str, NamedTuple] = {}
# Tests and the benchmark set this to fill kernel outputs with NaN first, so an unwritten element shows.
POISON_OUTPUTS = False
# False: take each block size's first candidate instead of timing them (quick correctness runs).
TUNE = True


@contextmanager
def forced_config(**configs: NamedTuple) -> Iterator[None]:
    """Pin tile choices, e.g. ``forced_config(fwd=DdsConfig(...), dx=..., dw=DwConfig(...))`` (tests,
    benchmarks: every candidate must be correct, since tuning may pick any of them)."""
    old = dict(_FORCED)
    _FORCED.update(configs)
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(old)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tuned_configs() -> dict[str, str]:
    """The tile choices made so far, ``{key: config}`` (for benchmark reports)."""
    return {repr(k): repr(v) for k, v in _TUNED.items()}


def dense_fallback_report() -> list[dict]:
    """Per tuned product: the best block kernel's and the dense fallback's GPU time and which was chosen (for
    benchmark reports)."""
    rows = []
    for key, timed in _TIMED.items():
        dense = [ms for cfg, ms in timed if isinstance(cfg, DenseConfig)]
        kernels = [ms for cfg, ms in timed if not isinstance(cfg, DenseConfig)]
        if dense and kernels:
            rows.append({"key": repr(key), "kernel_ms": min(kernels), "dense_ms": min(dense),
                         "chosen": "dense" if isinstance(_TUNED[key], DenseConfig) else "kernel"})
    return rows


def _density_bucket(meta: BlockSparseMeta) -> int:
    # half-octave buckets: 1.0 -> 0, 0.5 -> 2, 0.25 -> 4, 0.1 -> 7
    return min(16, round(-2 * math.log2(max(meta.density, 1e-6))))


def _pick(kind: str, key: tuple, device: torch.device, candidates: list, interp: NamedTuple, launch: Callable):
    """Best candidate for ``key`` (timed once per key with do_bench, then cached); ``launch(cfg)`` must
    run the whole operation. The interpreter and CUDA-graph capture take a fixed choice."""
    if kind in _FORCED:
        return _FORCED[kind]
    if interpreting() or device.type != "cuda":
        return interp
    full = (kind,) + key
    if full in _TUNED:
        return _TUNED[full]
    if not TUNE or len(candidates) == 1 or torch.cuda.is_current_stream_capturing():
        return candidates[0]
    from triton.testing import do_bench

    timed = []
    for cfg in candidates:
        try:
            timed.append((cfg, do_bench(lambda c=cfg: launch(c), warmup=5, rep=20, return_mode="median")))
        except Exception:  # noqa: BLE001, S112 - e.g. out of shared memory for this tile: try the next
            continue
    if not timed:
        raise RuntimeError(f"no {kind} kernel configuration could run for {key}")
    best = _choose(timed)
    _TUNED[full] = best
    _TIMED[full] = timed
    return best


def _margin_from_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a number in (0, 1], got {raw!r}")
    return value


# The dense fallback must beat the best block kernel by this factor of GPU time to be chosen: the tuner times GPU
# time only, while the fallback's scatter/gather also costs host work (allocations, index ops) that an eager
# training step pays. SPARSETRAIN_DENSE_MARGIN=1 takes the plain fastest (docs/blocksparse.md, round 8).
DENSE_MARGIN = _margin_from_env("SPARSETRAIN_DENSE_MARGIN", 0.85)


def _choose(timed: list[tuple[NamedTuple, float]]) -> NamedTuple:
    """The fastest of ``(config, ms)``; the dense fallback only if it beats the best block kernel by
    :data:`DENSE_MARGIN`."""
    kernels = [(ms, i) for i, (cfg, ms) in enumerate(timed) if not isinstance(cfg, DenseConfig)]
    dense = [(ms, i) for i, (cfg, ms) in enumerate(timed) if isinstance(cfg, DenseConfig)]
    if not kernels:
        return timed[min(dense)[1]][0]
    best_ms, best_i = min(kernels)
    if dense and min(dense)[0] < DENSE_MARGIN * best_ms:
        return timed[min(dense)[1]][0]
    return timed[best_i][0]


def _choose_split(n_groups: int, T: int, block_t: int, device: torch.device) -> int:
    """Token slices for the weight gradient: enough programs for ~4 per multiprocessor, while each slice
    keeps at least 4 reduction steps."""
    if interpreting() or device.type != "cuda":
        return 2 if T >= 2 * block_t else 1  # exercise the atomic path in CPU tests
    split, target = 1, 4 * num_sms(device)
    while split < 64 and n_groups * split < target and triton_cdiv(T, 2 * split) >= 4 * block_t:
        split *= 2
    return split


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---- the dense fallback as a tuner candidate ---------------------------------------------------------
class DenseConfig(NamedTuple):
    """The dense fallback as a tile candidate of every product: scatter the active blocks into a dense ``W``
    and call cuBLAS (forward, input gradient), or compute the dense ``dYᵀ·X`` and gather the active blocks
    (weight gradient). The tuner times it beside the block kernels, so a layer whose blocks are small and dense
    (16x16 at 50%: the kernels run at ~0.35x of dense there, docs/blocksparse.md round 7) runs near dense speed
    instead. Parameters and optimizer state stay compressed; only the step's transient buffers are dense."""


# Offer the dense fallback to the tuner (SPARSETRAIN_DENSE_FALLBACK=0: only the block kernels, e.g. to time them).
DENSE_FALLBACK = os.environ.get("SPARSETRAIN_DENSE_FALLBACK", "1") != "0"


def _dense_candidates(t: Tensor) -> list[DenseConfig]:
    return [DenseConfig()] if t.is_cuda and DENSE_FALLBACK else []


class _DenseDdsPlan:
    """:class:`DenseConfig` for the forward / input gradient (called like the kernel plans)."""

    __slots__ = ("meta", "forward", "has_bias", "extra")

    def __init__(self, meta: BlockSparseMeta, forward: bool, has_bias: bool):
        self.meta, self.forward, self.has_bias = meta, forward, has_bias
        self.extra = (meta.grid[0] if forward else meta.grid[1]) * meta.block

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor) -> None:
        w = values_to_dense(values.to(a.dtype), self.meta)
        if not self.forward:
            torch.mm(a, w, out=out)
        elif self.has_bias:
            torch.addmm(bias.to(a.dtype), a, w.t(), out=out)
        else:
            torch.mm(a, w.t(), out=out)


class _DenseDwPlan:
    """:class:`DenseConfig` for the weight gradient: ``dYᵀ·X`` by cuBLAS (float32 output where the active
    blocks are float32 and this torch has ``mm(out_dtype=)``), then a gather of the active blocks."""

    __slots__ = ("meta", "with_bias", "extra", "f32_out")

    def __init__(self, x: Tensor, meta: BlockSparseMeta, with_bias: bool):
        self.meta, self.with_bias, self.extra = meta, with_bias, 1  # extra: no token split
        try:
            probe = torch.zeros(8, 8, dtype=x.dtype, device=x.device)
            self.f32_out = torch.mm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError):
            self.f32_out = False

    def __call__(self, x: Tensor, dy: Tensor, dv: Tensor, db: Tensor) -> None:
        if dv.dtype == torch.float32 and self.f32_out and x.dtype != torch.float32:
            g = torch.mm(dy.t(), x, out_dtype=torch.float32)
        else:
            g = torch.mm(dy.t(), x)
        dv.copy_(dense_to_values(g, self.meta))
        if self.with_bias:
            torch.sum(dy, 0, dtype=torch.float32, out=db)


# ---- cached launch plans ----------------------------------------------------------------------------
# Everything a launch needs besides the data pointers (tile config, grid, every integer argument, the
# metadata tensors, the dW split) depends only on the topology, the token count, the strides and the
# dtypes. It is worked out once per such key into a _Plan kept on the metadata (``meta._groups["plans"]``,
# dropped with it when the topology changes); a steady-state call then does one dict lookup, one output
# allocation and the launch, which calls the compiled kernel directly after the first time
# (:class:`~sparsetrain.kernels._runtime.triton_launch.KernelLaunch`: 8.4 instead of 18.5 µs per launch on the H200
# host with Triton 3.6, docs/blocksparse.md round 6).
class _Plan:
    """One launch of one kernel with everything but the data pointers fixed: ``args`` holds the kernel's
    arguments with ``None`` at the positions listed in ``ptr_pos`` (filled per call)."""

    __slots__ = ("kernel", "grid", "args", "ptr_pos", "options", "extra", "launch")

    def __init__(self, kernel, grid: tuple[int, ...], args: list, ptr_pos: tuple[int, ...], options: dict,
                 extra=None):
        self.kernel, self.grid, self.args, self.ptr_pos, self.options = kernel, grid, args, ptr_pos, options
        self.extra = extra  # launcher-specific: output width (dds) or token split (dW)
        self.launch = KernelLaunch(kernel, grid, options)

    def __call__(self, *ptrs: Tensor) -> None:
        args = list(self.args)
        for pos, t in zip(self.ptr_pos, ptrs):
            args[pos] = t
        self.launch(*args)


class _TmaKernelLaunches:
    """The launch of a TMA kernel for each descriptor kind (``host``: :func:`_host_desc` at the call; the kind
    decides the arguments)."""

    __slots__ = ("fn", "grid", "kwargs", "by_flag")

    def __init__(self, fn, grid: tuple[int, ...], kwargs: dict):
        self.fn, self.grid, self.kwargs, self.by_flag = fn, grid, kwargs, {}

    def __call__(self, flag: bool, *args) -> None:
        launch = self.by_flag.get(flag)
        if launch is None:
            launch = self.by_flag[flag] = KernelLaunch(self.fn, self.grid, {**self.kwargs, "HOST_DESC": flag})
        launch(*args)


class _TmaLaunch:
    """What the two TMA plans share: the lazily built fallback plan for operands the TMA cannot take."""

    __slots__ = ()

    def _fall_back(self, *ptrs: Tensor) -> None:
        if not isinstance(self.fallback, _Plan):
            self.fallback = self.fallback()
        self.fallback(*ptrs)


class _TmaPlan(_TmaLaunch):
    """A launch of :func:`dense_x_blocksparse_tma_kernel`: the tensor descriptors are built per call (they hold
    the data pointers); an operand the TMA cannot take (e.g. a 2-byte-misaligned view, same shape and strides
    as the tuned one) runs the ``fallback`` plan instead."""

    __slots__ = ("cfg", "meta", "forward", "has_bias", "T", "K", "n_out", "idx", "grid", "fallback", "extra",
                 "launch")

    def __init__(self, a: Tensor, meta: BlockSparseMeta, cfg: TmaDdsConfig, forward: bool, has_bias: bool,
                 fallback: Callable[[], _Plan]):
        self.cfg, self.meta, self.forward, self.has_bias = cfg, meta, forward, has_bias
        self.T, self.K = a.shape
        self.n_out = meta.grid[0] if forward else meta.grid[1]
        self.idx = ((meta.row_ptr, meta.col_idx, meta.col_idx) if forward
                    else (meta.col_ptr, meta.t_row_idx, meta.t_slot))
        self.grid = (triton_cdiv(self.T, cfg.block_t) * self.n_out,)
        self.fallback = fallback
        self.extra = self.n_out * meta.block
        from sparsetrain.kernels._blocksparse_triton import dense_x_blocksparse_tma_kernel

        self.launch = _TmaKernelLaunches(dense_x_blocksparse_tma_kernel, self.grid, dict(
            FORWARD=forward, HAS_BIAS=has_bias, BLOCK=meta.block, BLOCK_T=cfg.block_t, WIDE=cfg.wide,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages))

    def __call__(self, a: Tensor, values: Tensor, bias: Tensor, out: Tensor) -> None:
        if not _tma_ok(a, values):
            self._fall_back(a, values, bias, out)
            return
        B, cfg = self.meta.block, self.cfg
        host = _host_desc(a.device)
        if host:
            from triton.tools.tensor_descriptor import TensorDescriptor

            _ensure_context(a.device)
            a_arg = TensorDescriptor(a, [self.T, self.K], [a.stride(0), 1], [cfg.block_t, B])
            v_arg = TensorDescriptor(values, [values.shape[0] * B, B], [B, 1], [B, B])
        else:
            _ensure_tma_scratch()
            a_arg, v_arg = a, values
        self.launch(host, a_arg, v_arg, *self.idx, bias, out, self.T, self.K, a.stride(0), values.shape[0], out.stride(0),
                    self.n_out)


class _TmaDwPlan(_TmaLaunch):
    """A launch of :func:`sampled_grad_tma_kernel` (descriptors built per call); operands the TMA cannot take
    run ``fallback``, the gather-kernel plan with the same groups and token split (same output buffers)."""

    __slots__ = ("cfg", "meta", "with_bias", "T", "groups", "split", "t_per_split", "fallback", "extra", "launch")

    def __init__(self, x: Tensor, meta: BlockSparseMeta, cfg: TmaDwConfig, with_bias: bool,
                 fallback: Callable[[], _Plan]):
        self.cfg, self.meta, self.with_bias, self.T = cfg, meta, with_bias, x.shape[0]
        self.groups = meta.dw_groups(cfg.group)
        self.split = _choose_split(self.groups[4], self.T, cfg.block_t, x.device)
        self.t_per_split = triton_cdiv(triton_cdiv(self.T, self.split), cfg.block_t) * cfg.block_t
        self.fallback = fallback
        self.extra = self.split
        from sparsetrain.kernels._blocksparse_triton import sampled_grad_tma_kernel

        self.launch = _TmaKernelLaunches(sampled_grad_tma_kernel, (self.groups[4] * self.split,), dict(
            HAS_DBIAS=with_bias, BLOCK=meta.block, BLOCK_T=cfg.block_t, SPLIT=self.split, GROUP=cfg.group,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages))

    def __call__(self, x: Tensor, dy: Tensor, dv: Tensor, db: Tensor) -> None:
        if not (_rows_tma_ok(x) and _rows_tma_ok(dy)):
            self._fall_back(x, dy, dv, db)
            return
        B, cfg, T = self.meta.block, self.cfg, self.T
        grow, gstart, gcount, gfirst, n_groups = self.groups
        host = _host_desc(x.device)
        if host:
            from triton.tools.tensor_descriptor import TensorDescriptor

            _ensure_context(x.device)
            x_arg = TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [cfg.block_t, B])
            dy_arg = TensorDescriptor(dy, list(dy.shape), [dy.stride(0), 1], [cfg.block_t, B])
        else:
            _ensure_tma_scratch()
            x_arg, dy_arg = x, dy
        self.launch(host, x_arg, dy_arg, grow, gstart, gcount, gfirst, self.meta.col_idx, dv, db, T, x.shape[1], dy.shape[1],
                    x.stride(0), dy.stride(0), n_groups, self.t_per_split)


def _plan_key(kind: str, *parts) -> tuple:
    """Key of a cached plan: the shape/dtype ``parts`` plus what steers ``_pick`` (forced configs, TUNE)."""
    return (kind, TUNE, tuple(_FORCED.items()) if _FORCED else ()) + parts


def _plans(meta: BlockSparseMeta) -> dict:
    plans = meta._groups.get("plans")
    if plans is None:
        plans = meta._groups["plans"] = {}
    return plans


def _keep_plan(meta: BlockSparseMeta, key: tuple, plan: _Plan) -> None:
    plans = _plans(meta)
    if len(plans) >= 256:  # e.g. a new token count every batch: bound the cache, rebuilding is cheap
        plans.clear()
    plans[key] = plan


def _may_cache(device: torch.device) -> bool:
    # while capturing a CUDA graph _pick takes the first candidate untimed: not a choice to keep
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


# ---- launchers ------------------------------------------------------------------------------------
def _gather_dds_plan(meta: BlockSparseMeta, cfg: DdsConfig, forward: bool, has_bias: bool, T: int,
                     a_strides: tuple[int, int], out_stride: int) -> _Plan:
    """The launch plan of the gather kernel (:func:`dense_x_blocksparse_kernel`) for one tile."""
    from sparsetrain.kernels._blocksparse_triton import dense_x_blocksparse_kernel

    B = meta.block
    n_out = meta.grid[0] if forward else meta.grid[1]
    ptr, kidx, slot, oidx = meta.padded_entries(forward, cfg.group_k)
    n_ranges = triton_cdiv(n_out, cfg.blocks_per_prog)
    grid = (triton_cdiv(T, cfg.block_t) * n_ranges,)
    args = [None, None, ptr, kidx, slot, oidx, None, None,
            T, a_strides[0], a_strides[1], out_stride, n_out, n_ranges, cfg.blocks_per_prog]
    opts = dict(FORWARD=forward, HAS_BIAS=has_bias, BLOCK=B, GROUP_K=cfg.group_k, BLOCK_T=cfg.block_t,
                CACHE_A=cfg.cache_a, WIDE=cfg.wide and cfg.group_k == 1, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    return _Plan(dense_x_blocksparse_kernel, grid, args, (0, 1, 6, 7), opts, extra=n_out * B)


def _gather_dw_plan(meta: BlockSparseMeta, cfg: DwConfig, with_bias: bool, T: int, x_strides: tuple[int, int],
                    dy_stride: int, device: torch.device) -> _Plan:
    """The launch plan of the gather weight-gradient kernel (:func:`sampled_grad_kernel`) for one tile."""
    from sparsetrain.kernels._blocksparse_triton import sampled_grad_kernel

    grow, gstart, gcount, gfirst, n_groups = meta.dw_groups(cfg.group)
    split = _choose_split(n_groups, T, cfg.block_t, device)
    t_per_split = triton_cdiv(triton_cdiv(T, split), cfg.block_t) * cfg.block_t
    args = [None, None, grow, gstart, gcount, gfirst, meta.col_idx, None, None,
            T, x_strides[0], x_strides[1], dy_stride, n_groups, t_per_split]
    opts = dict(HAS_DBIAS=with_bias, BLOCK=meta.block, GROUP=cfg.group, BLOCK_T=cfg.block_t, SPLIT=split,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return _Plan(sampled_grad_kernel, (n_groups * split,), args, (0, 1, 7, 8), opts, extra=split)


def _dds(a: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None, forward: bool) -> Tensor:
    """``a [T, K] · B`` with ``B = Wᵀ`` (forward) or ``B = W`` (input gradient)."""
    T = a.shape[0]
    has_bias = bias is not None
    pkey = _plan_key("plan_dds", forward, T, a.stride(0), a.stride(1), a.dtype, values.dtype,
                     bias.dtype if has_bias else None, a.device)
    plan = _plans(meta).get(pkey)
    if plan is not None:  # the steady state of training: one allocation and one direct launch
        out = torch.empty(T, plan.extra, dtype=a.dtype, device=a.device)
        if POISON_OUTPUTS:
            out.fill_(float("nan"))
        plan(a, values, bias if has_bias else a, out)
        return out

    B = meta.block
    n_out = meta.grid[0] if forward else meta.grid[1]
    out = torch.empty(T, n_out * B, dtype=a.dtype, device=a.device)
    if POISON_OUTPUTS:
        out.fill_(float("nan"))
    if T == 0:
        return out

    def make_plan(cfg: DdsConfig | CudaDdsConfig | CudaKsConfig | TmaDdsConfig | DenseConfig
                  ) -> _Plan | CudaDdsPlan | CudaKsPlan | _TmaPlan | _DenseDdsPlan:
        if isinstance(cfg, DenseConfig):
            return _DenseDdsPlan(meta, forward, has_bias)
        if isinstance(cfg, TmaDdsConfig):
            # the fallback is built from integers only: a closure over this call's tensors would keep them (the
            # first batch's activations and output, per layer) alive as long as the plan
            return _TmaPlan(a, meta, cfg, forward, has_bias, functools.partial(
                _gather_dds_plan, meta, _DDS_CANDIDATES[B][0], forward, has_bias, T, a.stride(), out.stride(0)))
        if isinstance(cfg, CudaDdsConfig):
            return CudaDdsPlan(a, meta, cfg, forward, has_bias)
        if isinstance(cfg, CudaKsConfig):
            return CudaKsPlan(a, meta, cfg, forward, has_bias)
        return _gather_dds_plan(meta, cfg, forward, has_bias, T, a.stride(), out.stride(0))

    built: dict = {}  # one plan per candidate while tuning (timing must not include building it)

    def launch(cfg: DdsConfig | CudaDdsConfig | CudaKsConfig) -> Tensor:
        if cfg not in built:
            built[cfg] = make_plan(cfg)
        built[cfg](a, values, bias if has_bias else a, out)
        return out

    key = (B, 1 << max(0, T - 1).bit_length(), meta.in_features if forward else meta.out_features, n_out * B,
           _density_bucket(meta), a.dtype, values.dtype, has_bias)
    cands = [*_cuda_dds.candidates(a, B, a.shape[1]), *_cuda_dds.ks_candidates(a, B, a.shape[1]),
             *_tma_candidates(a, values, B, forward), *_DDS_CANDIDATES[B], *_dense_candidates(a)]
    cfg = _pick("fwd" if forward else "dx", key, a.device, cands, _INTERP_DDS[B], launch)
    plan = built.get(cfg) or make_plan(cfg)
    plan(a, values, bias if has_bias else a, out)
    if _may_cache(a.device):
        _keep_plan(meta, pkey, plan)
    return out


def _sampled_grad(x: Tensor, dy: Tensor, meta: BlockSparseMeta, with_bias: bool,
                  out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor | None]:
    """``dvalues = blocks of dYᵀ·X at the active positions`` and, fused, ``dbias = Σ_t dY`` (float32).
    ``dvalues`` comes back in ``out_dtype`` when the reduction is not split, else in float32."""
    T = x.shape[0]
    dev = x.device
    pkey = _plan_key("plan_dw", T, x.stride(0), x.stride(1), dy.stride(0), x.dtype, dy.dtype, out_dtype,
                     with_bias, dev)
    plan = _plans(meta).get(pkey)
    if plan is None:
        B = meta.block

        def make_plan(cfg: DwConfig | CudaDwConfig | TmaDwConfig | DenseConfig
                      ) -> _Plan | CudaDwPlan | _TmaDwPlan | _DenseDwPlan:
            if isinstance(cfg, DenseConfig):
                return _DenseDwPlan(x, meta, with_bias)
            if isinstance(cfg, TmaDwConfig):  # fallback from integers only (see _dds)
                return _TmaDwPlan(x, meta, cfg, with_bias, functools.partial(
                    _gather_dw_plan, meta, DwConfig(cfg.group, cfg.block_t, cfg.num_warps, cfg.num_stages),
                    with_bias, T, x.stride(), dy.stride(0), dev))
            if isinstance(cfg, CudaDwConfig):
                return CudaDwPlan(x, meta, cfg, with_bias)
            return _gather_dw_plan(meta, cfg, with_bias, T, x.stride(), dy.stride(0), dev)

        built: dict = {}

        def launch(cfg: DwConfig) -> tuple[Tensor, Tensor | None]:
            if cfg not in built:
                built[cfg] = make_plan(cfg)
            return _run_dw(built[cfg], x, dy, meta, with_bias, out_dtype)

        key = (B, 1 << max(0, T - 1).bit_length(), meta.in_features, meta.out_features, _density_bucket(meta),
               x.dtype, out_dtype, with_bias)
        cands = [*_cuda_dds.dw_candidates(x, dy, meta, with_bias), *_tma_dw_candidates(x, dy, B),
                 *_DW_CANDIDATES[B], *_dense_candidates(x)]
        cfg = _pick("dw", key, dev, cands, _INTERP_DW[B], launch)
        plan = built.get(cfg) or make_plan(cfg)
        if T > 0 and _may_cache(dev):
            _keep_plan(meta, pkey, plan)
    return _run_dw(plan, x, dy, meta, with_bias, out_dtype)


def _run_dw(plan: _Plan, x: Tensor, dy: Tensor, meta: BlockSparseMeta, with_bias: bool,
            out_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """Allocate the outputs of one weight-gradient launch and run it. Split reductions add float32
    partial sums with atomics into zeroed memory; dvalues and dbias then share ONE zero-filled buffer (one
    fill instead of two)."""
    B, n, O, dev = meta.block_rows, meta.n_blocks, meta.out_features, x.device
    split = plan.extra
    db = None
    if split > 1:
        buf = torch.zeros(n * B * B + (O if with_bias else 0), dtype=torch.float32, device=dev)
        dv = buf[: n * B * B].view(n, B, B)
        if with_bias:
            db = buf[n * B * B:]
    else:
        dv = torch.empty(n, B, B, dtype=out_dtype, device=dev)
        if POISON_OUTPUTS:
            dv.fill_(float("nan"))
        if with_bias:
            db = torch.zeros(O, dtype=torch.float32, device=dev)
    if x.shape[0] == 0:
        return dv.zero_(), db
    plan(x, dy, dv, db if db is not None else dv)
    return dv, db


# ---- autograd -------------------------------------------------------------------------------------
class BlockSparseLinearFn(torch.autograd.Function):
    """``y = x2d · W_effᵀ + bias`` on the Triton kernels. ``dense_grad_hook`` (or None): when given, the
    backward computes the full dense ``dW = dYᵀ·X`` with one dense matmul, passes it (float32, ``[O, I]``)
    to the hook, and takes the block gradient from it instead of running the sampled kernel."""

    @staticmethod
    def forward(ctx, x2d: Tensor, values: Tensor, bias: Tensor | None, meta: BlockSparseMeta,
                dense_grad_hook: Callable[[Tensor], None] | None) -> Tensor:
        ctx.values_dtype = values.dtype
        if values.dtype == torch.float32 and x2d.dtype in (torch.float16, torch.bfloat16):
            # fp32 master values, 16-bit activations: one cast of the active blocks per step, shared by the
            # forward and the input gradient (the CUDA tiles take 16-bit values; Triton reads half the bytes)
            values = values.to(x2d.dtype)
        ctx.save_for_backward(x2d, values)
        ctx.meta, ctx.hook = meta, dense_grad_hook
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return _dds(x2d, values, meta, bias, forward=True)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2d, values = ctx.saved_tensors
        meta = ctx.meta
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        need_x, need_v, need_b = ctx.needs_input_grad[:3]
        dx = _dds(dy, values, meta, None, forward=False) if need_x else None
        dv = db = None
        if ctx.hook is not None:
            dense = torch.mm(dy.t(), x2d).float()  # one dense matmul, only on capture steps
            ctx.hook(dense)
            dv = dense_to_values(dense, meta).to(ctx.values_dtype) if need_v else None
        elif need_v:
            dv, db32 = _sampled_grad(x2d, dy, meta, with_bias=need_b, out_dtype=ctx.values_dtype)
            if dv.dtype != ctx.values_dtype:  # only when the token reduction was split (float32 partial sums)
                dv = dv.to(ctx.values_dtype)
            if need_b:
                db = db32 if db32.dtype == ctx.bias_dtype else db32.to(ctx.bias_dtype)
        if need_b and db is None:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dv, db, None, None


# ---- torch.compile: the kernels as torch.library custom ops ---------------------------------------------
# Under torch.compile the kernel path goes through these opaque ops (dynamo cannot trace the Triton launches and
# their plan caches). The metadata travels as its six index tensors; the BlockSparseMeta (with its derived
# entry lists and launch plans) is looked up by their data pointers, so it is built once per topology. The
# registry's metas hold their tensors, so no other tensor can be allocated at those addresses while an entry
# lives: a pointer match is the same topology (the block format never rewrites index tensors in place).
_OP_METAS: dict[tuple, BlockSparseMeta] = {}
OP_META_BUILDS = [0]  # how many metas the ops built (tests and benchmarks read it)


def register_meta(meta: BlockSparseMeta) -> None:
    """Makes ``meta`` (and the entry lists and launch plans it caches) the one the custom ops use for its
    tensors: an eager step before ``torch.compile(mode="reduce-overhead")`` then builds them outside the
    CUDA-graph memory pool. The block format registers every meta it installs."""
    key = tuple(getattr(meta, n).data_ptr() for n in BlockSparseMeta.TENSORS) + (
        meta.out_features, meta.in_features, meta.block_rows)
    if len(_OP_METAS) >= 4096:
        _OP_METAS.clear()
    _OP_METAS[key] = meta


def _meta_for(tensors: tuple[Tensor, ...], out_features: int, in_features: int, block: int) -> BlockSparseMeta:
    key = tuple(t.data_ptr() for t in tensors) + (out_features, in_features, block)
    meta = _OP_METAS.get(key)
    if meta is None:
        if len(_OP_METAS) >= 4096:  # mostly replaced topologies: drop them all (live ones are rebuilt once)
            _OP_METAS.clear()
        meta = BlockSparseMeta(out_features, in_features, block, block, int(tensors[1].numel()), *tensors)
        _OP_METAS[key] = meta
        OP_META_BUILDS[0] += 1
    return meta


@torch.library.custom_op("sparsetrain::block_sparse_linear", mutates_args=())
def _bs_linear_op(x: Tensor, values: Tensor, bias: Tensor | None, row_ptr: Tensor, col_idx: Tensor,
                  row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
                  in_features: int, block: int) -> Tensor:
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    return _dds(x, values, meta, bias, forward=True)


@_bs_linear_op.register_fake
def _(x, values, bias, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block):
    return x.new_empty(x.shape[0], out_features)


@torch.library.custom_op("sparsetrain::block_sparse_linear_backward", mutates_args=())
def _bs_linear_backward_op(dy: Tensor, x: Tensor, values: Tensor, row_ptr: Tensor, col_idx: Tensor,
                           row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
                           in_features: int, block: int, need_x: bool, need_v: bool,
                           need_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dvalues, dbias float32); a gradient not asked for comes back as an empty tensor."""
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dx = _dds(dy, values, meta, None, forward=False) if need_x else dy.new_empty(0)
    dv, db = values.new_empty(0), dy.new_empty(0, dtype=torch.float32)
    if need_v:
        dv, db32 = _sampled_grad(x, dy, meta, with_bias=need_b, out_dtype=values.dtype)
        dv = dv.to(values.dtype)
        if need_b:  # a split reduction returns dv and db as views of one buffer: outputs may not alias
            db = db32.clone() if dv.untyped_storage().data_ptr() == db32.untyped_storage().data_ptr() else db32
    if need_b and db.numel() == 0:
        db = dy.sum(0, dtype=torch.float32)
    return dx, dv, db


@_bs_linear_backward_op.register_fake
def _(dy, x, values, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block,
      need_x, need_v, need_b):
    dx = dy.new_empty(dy.shape[0], in_features) if need_x else dy.new_empty(0)
    dv = values.new_empty(values.shape) if need_v else values.new_empty(0)
    db = dy.new_empty(out_features, dtype=torch.float32) if need_b else dy.new_empty(0, dtype=torch.float32)
    return dx, dv, db


def _bs_setup_context(ctx, inputs, output):
    x, values, bias, *tensors = inputs[:9]
    ctx.save_for_backward(x, values, *tensors)
    ctx.ints = inputs[9:]
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _bs_backward(ctx, dy):
    x, values, *tensors = ctx.saved_tensors
    need_x, need_v, need_b = ctx.needs_input_grad[:3]
    dx, dv, db = torch.ops.sparsetrain.block_sparse_linear_backward(
        dy, x, values, *tensors, *ctx.ints, need_x, need_v, need_b)
    return (dx if need_x else None, dv if need_v else None, db.to(ctx.bias_dtype) if need_b else None,
            None, None, None, None, None, None, None, None, None)


_bs_linear_op.register_autograd(_bs_backward, setup_context=_bs_setup_context)


@torch.compiler.disable
def _eager_with_hook(x2d: Tensor, values: Tensor, bias: Tensor | None, meta: BlockSparseMeta,
                     hook: Callable[[Tensor], None]) -> Tensor:
    """The autograd-function path outside the compiled graph (a graph break on dense-gradient capture steps)."""
    return BlockSparseLinearFn.apply(x2d, values, bias, meta, hook)


class _DenseGradHook(torch.autograd.Function):
    """Identity on the dense weight whose backward hands the incoming gradient to a hook (reference path)."""

    @staticmethod
    def forward(ctx, w: Tensor, hook: Callable[[Tensor], None]) -> Tensor:
        ctx.hook = hook
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.hook(grad.detach().float())
        return grad, None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4
        enabled = torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()
    if not enabled:
        return None
    try:
        return torch.get_autocast_dtype(device_type)
    except AttributeError:  # torch < 2.4
        return torch.get_autocast_gpu_dtype() if device_type == "cuda" else torch.get_autocast_cpu_dtype()


def uses_kernels(x: Tensor, meta: BlockSparseMeta) -> bool:
    """True when :func:`block_sparse_linear` runs the Triton kernels for this input."""
    return (meta.kernel_supported and (x.is_cuda or interpreting()) and x.dtype in _KERNEL_DTYPES
            and meta.out_features * meta.in_features < 2**31)  # block offsets are int32 in the kernels


def _check(x: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None) -> None:
    if not isinstance(meta, BlockSparseMeta):
        raise TypeError(f"meta must be a BlockSparseMeta, got {type(meta).__name__}")
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != meta.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}; its last dimension must be in_features={meta.in_features}")
    want = (meta.n_blocks, meta.block_rows, meta.block_cols)
    if not isinstance(values, Tensor) or tuple(values.shape) != want:
        raise ValueError(f"values has shape {tuple(getattr(values, 'shape', ()))}, expected {want}")
    if bias is not None and tuple(bias.shape) != (meta.out_features,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({meta.out_features},)")
    for name, t in (("values", values), ("bias", bias), ("meta", meta.row_ptr)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def block_sparse_linear(x: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None = None, *,
                        dense_grad_hook: Callable[[Tensor], None] | None = None) -> Tensor:
    """``x · W_effᵀ + bias`` with ``W_eff`` given by compressed ``values`` and ``meta``; ``x [..., I]``.

    ``values`` and ``bias`` have ``x``'s dtype, or float32 with a 16-bit ``x`` (mixed precision: the
    active blocks are cast to ``x``'s dtype once per step, shared by the forward and the input gradient, and
    the gradients come back in float32). Under autocast only ``x`` is cast. ``dense_grad_hook(g)``, when given,
    receives the dense ``dL/dW_eff`` (float32 ``[O, I]``) during backward — the flag RigL's grow step needs.

    >>> meta = BlockSparseMeta.from_mask(torch.ones(2, 2, dtype=torch.bool), 16)
    >>> block_sparse_linear(torch.randn(5, 32), torch.randn(4, 16, 16), meta).shape
    torch.Size([5, 32])
    """
    _check(x, values, meta, bias)
    cast = _autocast_dtype(x.device.type)
    if cast is not None:
        x = x.to(cast)
    ok = (x.dtype, torch.float32)
    if values.dtype not in ok or (bias is not None and bias.dtype not in ok):
        raise TypeError(f"dtypes differ: x {x.dtype}, values {values.dtype}, "
                        f"bias {None if bias is None else bias.dtype} (values/bias must be x's dtype or float32)")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, meta.in_features)
    if uses_kernels(x2d, meta):
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        if torch.compiler.is_compiling() and dense_grad_hook is None:  # opaque op for dynamo / inductor
            y = torch.ops.sparsetrain.block_sparse_linear(
                x2d, values.contiguous(), bias, *(getattr(meta, n) for n in BlockSparseMeta.TENSORS),
                meta.out_features, meta.in_features, meta.block)
        elif torch.compiler.is_compiling():  # RigL capture steps: the hook is Python, run this layer eagerly
            y = _eager_with_hook(x2d, values.contiguous(), bias, meta, dense_grad_hook)
        else:
            y = BlockSparseLinearFn.apply(x2d, values.contiguous(), bias, meta, dense_grad_hook)
    else:
        w = values_to_dense(values, meta).to(x.dtype)
        bias = bias.to(x.dtype) if bias is not None else None
        if dense_grad_hook is not None and torch.is_grad_enabled() and w.requires_grad:
            w = _DenseGradHook.apply(w, dense_grad_hook)
        y = F.linear(x2d, w, bias)
    return y.reshape(*lead, meta.out_features)
