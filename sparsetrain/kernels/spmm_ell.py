"""Row-per-lane steps ("ell"): the inference format for very sparse weights decoded on CUDA cores.

``W [M, K]`` is cut into *instances* of 32 rows (one warp, one row per lane) by 256 columns (a *window*: a
column fits one byte). Inside an instance the nonzeros are grouped into *steps*. A step holds at most one
nonzero per row (lane), and whole columns: every nonzero of a column sits in the same step. A step is stored
as a 32-bit mask of its lanes, and its nonzeros as (value, column byte) pairs in lane order. Steps come from a
first-fit packing of the window's columns, the fullest first (:func:`compress_ell`). Each instance's step
count is padded with empty steps to a multiple of 4 (the kernel reads four masks with one 16-byte load).

Bytes per element: ``3 (1 - s)`` for the nonzeros, plus 4 bytes per step and 8 per instance. At 90% a
32 x 256 instance has ~26 nonzeros per row and needs ~36-44 steps: ~0.32 B/elem, inside the bitmap bound
``0.125 + 2 (1 - s)`` (0.325).

Why it exists: the tensor-core kernels expand every weight element (bitmap, pair) or a dense shared-memory
tile (CSL) before the ``mma``, so their work grows with the elements, not the nonzeros, and their shared
memory traffic is ~4 bytes per element. Here each lane owns one output row and the kernel
(``csrc/spmm_ell.cu``) does work per nonzero: per step a lane reads its nonzero, fetches that column of X
(16 tokens) from shared memory and does 8 packed half2 FMAs. Because a step holds whole columns, lanes that
share a column read the same shared-memory address (a broadcast), so a step touches ~10 distinct columns at
90% instead of 32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from sparsetrain.kernels.spmm_csl import CompressedWeight

LANES = 32  # rows per instance (one warp)
WINDOW = 256  # columns per instance (one-byte column index)
STEP_ALIGN = 4  # steps per 16-byte mask load
MAX_TOKENS = 16  # the kernel holds 16 tokens per lane


@dataclass
class EllWeight(CompressedWeight):
    """A weight ``[M, K]`` in the row-per-lane step format (see the module docstring).

    Attributes:
        masks: int32 ``[S + 8]``: each step's lanes (bit ``l``: row ``32 g + l``), instance by instance (row
            group major, window minor); 8 trailing zeros let the kernel read ahead.
        values: the nonzeros, step by step, lane order inside a step.
        cols: uint8, one per value: its column inside the window.
        step_offsets: int32 ``[G * W + 1]``: each instance's first step (a multiple of 4).
        entry_offsets: int32 ``[G * W + 1]``: each instance's first value.
        shape: ``(M, K)``.
    """

    masks: Tensor
    values: Tensor
    cols: Tensor
    step_offsets: Tensor
    entry_offsets: Tensor
    shape: tuple[int, int]
    block_m: int = LANES
    fmt: str = "ell"

    TENSORS: ClassVar[tuple[str, ...]] = ("masks", "values", "cols", "step_offsets", "entry_offsets")

    @property
    def grid(self) -> tuple[int, int]:
        """(row groups of 32, windows of 256)."""
        m, k = self.shape
        return math.ceil(m / LANES), math.ceil(k / WINDOW)

    def _decode_into(self, out: Tensor) -> None:
        out.copy_(self._to_dense_torch())

    def _to_dense_torch(self) -> Tensor:
        m, k = self.shape
        n_groups, n_win = self.grid
        n_steps = int(self.step_offsets[-1])
        masks = self.masks[:n_steps].long() & 0xFFFFFFFF
        bits = (masks.unsqueeze(1) >> torch.arange(LANES, device=masks.device)) & 1  # [S, 32]
        step, lane = bits.nonzero(as_tuple=True)  # step-major, lanes ascending: the values' order
        inst = torch.searchsorted(self.step_offsets.long(), step, right=True) - 1
        rows = (inst // n_win) * LANES + lane
        cols = (inst % n_win) * WINDOW + self.cols.long()
        dense = torch.zeros(n_groups * LANES, n_win * WINDOW, dtype=self.dtype, device=self.device)
        dense[rows, cols] = self.values
        return dense[:m, :k].contiguous()


def _first_fit(colmask: Tensor) -> tuple[Tensor, Tensor]:
    """Packs each instance's columns into steps, first fit, the most populated column first.

    ``colmask``: int64 ``[I, 256]``, bit ``l`` set where lane ``l`` has a nonzero in that column. Returns
    ``(busy, step_of)``: int64 ``[I, T]`` masks of the steps (a prefix of each row is used) and int64 ``[I,
    256]`` the step of each column (-1 for empty columns)."""
    n_inst = colmask.shape[0]
    dev = colmask.device
    pop = torch.zeros_like(colmask)
    for b in range(LANES):
        pop += (colmask >> b) & 1
    order = torch.argsort(-pop, dim=1, stable=True)
    sorted_masks = colmask.gather(1, order)
    n_cols = int((pop > 0).sum(1).max()) if n_inst else 0
    cap = int(pop.sum(1).max()) // LANES * 2 + 8 if n_inst else 0  # grows below when too small
    busy = torch.zeros(n_inst, cap, dtype=torch.int64, device=dev)
    step_sorted = torch.full((n_inst, WINDOW), -1, dtype=torch.int64, device=dev)
    rows = torch.arange(n_inst, device=dev)
    for j in range(n_cols):
        cm = sorted_masks[:, j]
        free = (busy & cm.unsqueeze(1)) == 0
        while not bool(free.any(1).all()):
            busy = torch.cat([busy, torch.zeros_like(busy)], 1)
            free = (busy & cm.unsqueeze(1)) == 0
        t = free.to(torch.int8).argmax(1)
        busy[rows, t] |= cm
        step_sorted[:, j] = torch.where(cm != 0, t, -1)
    step_of = torch.empty_like(step_sorted).scatter_(1, order, step_sorted)
    return busy, step_of


def compress_ell(weight: Tensor) -> EllWeight:
    """Builds the row-per-lane step format of a 2-D float weight on its own device (see the module docstring;
    on a GPU a 28672 x 7168 weight takes well under a second)."""
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor, got {getattr(weight, 'shape', type(weight))}")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"weight dtype must be float16, bfloat16 or float32, got {weight.dtype}")
    weight = weight.detach()
    m, k = weight.shape
    dev = weight.device
    n_groups, n_win = math.ceil(m / LANES), math.ceil(k / WINDOW)
    padded = torch.zeros(n_groups * LANES, n_win * WINDOW, dtype=weight.dtype, device=dev)
    padded[:m, :k] = weight
    inst_view = padded.view(n_groups, LANES, n_win, WINDOW).permute(0, 2, 3, 1)  # [G, W, 256, 32]
    place = torch.ones(LANES, dtype=torch.int64, device=dev) << torch.arange(LANES, device=dev)
    colmask = ((inst_view != 0).long() * place).sum(-1).reshape(-1, WINDOW)  # [I, 256]
    busy, step_of = _first_fit(colmask)

    used = (busy != 0).sum(1)  # steps are used as a prefix
    padded_steps = (used + STEP_ALIGN - 1) // STEP_ALIGN * STEP_ALIGN
    step_offsets = torch.zeros(colmask.shape[0] + 1, dtype=torch.int64, device=dev)
    step_offsets[1:] = torch.cumsum(padded_steps, 0)
    keep = torch.arange(busy.shape[1], device=dev) < padded_steps.unsqueeze(1)
    if busy.shape[1] < (int(padded_steps.max()) if padded_steps.numel() else 0):
        busy = torch.cat([busy, torch.zeros(busy.shape[0], STEP_ALIGN, dtype=busy.dtype, device=dev)], 1)
        keep = torch.arange(busy.shape[1], device=dev) < padded_steps.unsqueeze(1)
    masks = busy[keep]
    masks = torch.where(masks >= 2**31, masks - 2**32, masks).to(torch.int32)
    masks = torch.cat([masks, masks.new_zeros(8)])

    g, w, c, lane = (inst_view != 0).nonzero(as_tuple=True)
    inst = g * n_win + w
    step = step_of[inst, c]
    order = torch.argsort((inst * busy.shape[1] + step) * LANES + lane)
    values = padded[(g * LANES + lane)[order], (w * WINDOW + c)[order]]
    if values.numel() >= 2**31 or int(step_offsets[-1]) >= 2**31:
        raise ValueError(f"weight has {values.numel()} nonzeros; the int32 offsets allow < 2**31")
    per_inst = torch.bincount(inst, minlength=colmask.shape[0])
    entry_offsets = torch.zeros(colmask.shape[0] + 1, dtype=torch.int64, device=dev)
    entry_offsets[1:] = torch.cumsum(per_inst, 0)
    return EllWeight(masks.contiguous(), values.contiguous(), c[order].to(torch.uint8).contiguous(),
                     step_offsets.to(torch.int32), entry_offsets.to(torch.int32), (m, k))


def ell_bytes(weight: EllWeight) -> int:
    """Bytes stored (the same as ``weight.nbytes()``; named for symmetry with the other formats)."""
    return weight.nbytes()


WARPS = 8  # row groups per CUDA block (csrc/spmm_ell.cu)
CUDA_BLOCKS = 6  # blocks per multiprocessor the split-K aims for
MAX_WINDOWS = 12  # windows per split: 96 KB of X in shared memory at 16 tokens


def split_for(weight: EllWeight, device: torch.device, split_k: int | None = None) -> tuple[int, int]:
    """``(windows per split, split_k)``: enough blocks for ``CUDA_BLOCKS`` per multiprocessor unless ``split_k``
    is given; no empty splits."""
    from sparsetrain.kernels._device import num_sms

    n_groups, n_win = weight.grid
    if split_k is None:
        split_k = max(1, min(n_win, math.ceil(CUDA_BLOCKS * num_sms(device) / math.ceil(n_groups / WARPS))))
        split_k = max(split_k, math.ceil(n_win / MAX_WINDOWS))
    if not 1 <= split_k <= n_win:
        raise ValueError(f"split_k must be in 1..{n_win}, got {split_k}")
    wins = math.ceil(n_win / split_k)
    return wins, math.ceil(n_win / wins)


def cuda_usable(x2: Tensor, weight: EllWeight) -> bool:
    """Whether :func:`spmm_ell_cuda` takes this call: CUDA, fp16/bf16 as the weight, 1..16 tokens, the library
    built."""
    if (not x2.is_cuda or x2.dtype not in (torch.float16, torch.bfloat16) or x2.dtype != weight.dtype
            or not 1 <= x2.shape[0] <= MAX_TOKENS or weight.masks.data_ptr() % 16):
        return False
    from sparsetrain.kernels import _cuda
    return _cuda.load("spmm_ell", x2.device) is not None


def spmm_ell_cuda(x2: Tensor, weight: EllWeight, bias: Tensor | None = None, split_k: int | None = None) -> Tensor:
    """``x2 [N, K] @ Wᵀ (+ bias)`` through ``csrc/spmm_ell.cu``; ``1 <= N <= 16``; returns ``[N, M]``."""
    from sparsetrain.kernels import _cuda, _launch

    n, k = x2.shape
    m, kw = weight.shape
    if k != kw:
        raise ValueError(f"x has {k} columns, the weight {kw}")
    if not 1 <= n <= MAX_TOKENS:
        raise ValueError(f"x must have 1..{MAX_TOKENS} rows for the ell kernel, got {n}")
    if x2.dtype != weight.dtype:
        raise TypeError(f"x dtype {x2.dtype} differs from the weight dtype {weight.dtype}")
    so = _cuda.load("spmm_ell", x2.device)
    if so is None:
        raise RuntimeError("the CUDA kernel spmm_ell is unavailable here (no nvcc or no GPU)")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    n_groups, n_win = weight.grid
    wins, split = split_for(weight, x2.device, split_k)
    grid_m = math.ceil(n_groups / WARPS)
    y = torch.empty(n, m, dtype=x2.dtype, device=x2.device)
    stream = torch.cuda.current_stream(x2.device).cuda_stream
    ws, locks = _launch.workspace(x2.device, _launch.MAX_TOKENS * m, grid_m, stream) if split > 1 else (y, y)
    if bias is not None and (bias.dtype != x2.dtype or not bias.is_contiguous()):
        bias = bias.to(x2.dtype).contiguous()
    rc = so.sparsetrain_spmm_ell(
        x2.data_ptr(), weight.masks.data_ptr(), weight.values.data_ptr(), weight.cols.data_ptr(),
        weight.step_offsets.data_ptr(), weight.entry_offsets.data_ptr(), bias.data_ptr() if bias is not None else 0,
        y.data_ptr(), ws.data_ptr(), locks.data_ptr(), n, m, k, x2.stride(0), y.stride(0), n_groups, n_win, wins,
        split, int(x2.dtype == torch.bfloat16), stream)
    if rc != 0:
        raise RuntimeError(f"spmm_ell CUDA launch failed with code {rc}")
    return y


def spmm_ell_chunked(x2: Tensor, weight: EllWeight, bias: Tensor | None = None) -> Tensor:
    """:func:`spmm_ell_cuda` for any ``N``: 16 tokens per launch (the kernel holds 16 per lane), so ``N`` tokens
    read the weight ``ceil(N / 16)`` times; returns ``[N, M]``."""
    n = x2.shape[0]
    if n <= MAX_TOKENS:
        return spmm_ell_cuda(x2, weight, bias)
    return torch.cat([spmm_ell_cuda(x2[i:i + MAX_TOKENS], weight, bias) for i in range(0, n, MAX_TOKENS)])
