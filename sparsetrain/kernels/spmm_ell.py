"""Row-per-lane steps ("ell"): the inference format for very sparse weights decoded on CUDA cores.

``W [M, K]`` is cut into *instances* of 32 rows (one warp, one row per lane) by 256 columns (a *window*: a
column fits one byte). Inside an instance the nonzeros are grouped into *steps*. A step has one slot per row
(lane) and holds whole columns: every nonzero of a column sits in the same step. Steps come from a first-fit
packing of the window's columns, the fullest first (:func:`compress_ell`). Steps are stored in *groups* of 4:
per lane its 4 slots' values (8 bytes) and column bytes (4 bytes), lane after lane, so a warp reads a group
with two coalesced loads and no index arithmetic. An idle slot holds value 0 (and column 0). Each instance's
step count is padded to a multiple of 4.

Bytes per element: ``96 / 8192`` per step of a 32 x 256 instance (3 bytes per slot) plus 4 bytes per
instance. At 90% sparsity a random instance has ~26 nonzeros per row and ~41-44 steps: ~0.5 B/elem (the
pair bitmap stores 0.47, dense 2).

Why it exists: the tensor-core kernels expand every weight element (bitmap, pair) or a dense shared-memory
tile (CSL) before the ``mma``, so their instructions grow with the elements, not the nonzeros. Here each lane
owns one output row and the kernel (``csrc/spmm_ell.cu``) works per step: per step a lane fetches its column
of X (16 tokens) from shared memory and does 8 packed half2 FMAs. Because a step holds whole columns, lanes
that share a column read the same shared-memory address (a broadcast), so a step touches ~10 distinct columns
at 90% instead of 32. A first version stored only the nonzeros (a lane mask per step, values located by a
popcount): fewer bytes (0.32 B/elem at 90%) but each group's loads waited on its mask, and it measured
0.83-0.95x of dense at N = 16 on an H200 (docs/inference.md, round 7).
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
GROUP = 4  # steps per group (a lane's 8-byte value load and 4-byte column load)
MAX_TOKENS = 16  # the kernel holds 16 tokens per lane


@dataclass
class EllWeight(CompressedWeight):
    """A weight ``[M, K]`` in the row-per-lane step format (see the module docstring).

    Attributes:
        values: ``[Q * 32 * 4]``: group ``q``, lane ``l``, slot ``u`` at ``(32 q + l) * 4 + u``; 0 where idle.
            Groups are stored instance by instance (row group major, window minor).
        cols: uint8, the same layout: each slot's column inside its window.
        group_offsets: int32 ``[G * W + 1]``: each instance's first group.
        shape: ``(M, K)``.
    """

    values: Tensor
    cols: Tensor
    group_offsets: Tensor
    shape: tuple[int, int]
    block_m: int = LANES
    fmt: str = "ell"

    TENSORS: ClassVar[tuple[str, ...]] = ("values", "cols", "group_offsets")

    @property
    def nnz(self) -> int:
        """Nonzero weights (the slots holding a nonzero value; one device sync)."""
        return int((self.values != 0).sum())

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
        slot = (self.values != 0).nonzero(as_tuple=True)[0]
        q, lane = slot // (LANES * GROUP), slot // GROUP % LANES
        inst = torch.searchsorted(self.group_offsets.long(), q, right=True) - 1
        rows = (inst // n_win) * LANES + lane
        cols = (inst % n_win) * WINDOW + self.cols[slot].long()
        dense = torch.zeros(n_groups * LANES, n_win * WINDOW, dtype=self.dtype, device=self.device)
        dense[rows, cols] = self.values[slot]
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
    exact zeros are dropped)."""
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
    groups = (used + GROUP - 1) // GROUP
    group_offsets = torch.zeros(colmask.shape[0] + 1, dtype=torch.int64, device=dev)
    group_offsets[1:] = torch.cumsum(groups, 0)
    n_slots = int(group_offsets[-1]) * LANES * GROUP
    if n_slots >= 2**31:
        raise ValueError(f"weight needs {n_slots} slots; the int32 offsets allow < 2**31")

    g, w, c, lane = (inst_view != 0).nonzero(as_tuple=True)
    inst = g * n_win + w
    step = group_offsets[inst] * GROUP + step_of[inst, c]  # the instance's steps, counted globally
    slot = ((step // GROUP) * LANES + lane) * GROUP + step % GROUP
    values = torch.zeros(n_slots, dtype=weight.dtype, device=dev)
    cols = torch.zeros(n_slots, dtype=torch.uint8, device=dev)
    values[slot] = padded[g * LANES + lane, w * WINDOW + c]
    cols[slot] = c.to(torch.uint8)
    return EllWeight(values, cols, group_offsets.to(torch.int32), (m, k))


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
    """Whether :func:`spmm_ell_cuda` takes this call: CUDA, fp16/bf16 as the weight, 1..16 tokens, the weight's
    values 8-byte and columns 4-byte aligned (fresh allocations are), the library built."""
    if (not x2.is_cuda or x2.dtype not in (torch.float16, torch.bfloat16) or x2.dtype != weight.dtype
            or not 1 <= x2.shape[0] <= MAX_TOKENS or weight.values.data_ptr() % 8 or weight.cols.data_ptr() % 4):
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
    if weight.values.data_ptr() % 8 or weight.cols.data_ptr() % 4:
        raise ValueError("spmm_ell: the weight's values must be 8-byte and its columns 4-byte aligned (tensors made "
                         "by compress or .to() are)")
    rc = so.sparsetrain_spmm_ell(
        x2.data_ptr(), weight.values.data_ptr(), weight.cols.data_ptr(), weight.group_offsets.data_ptr(),
        bias.data_ptr() if bias is not None else 0, y.data_ptr(), ws.data_ptr(), locks.data_ptr(), n, m, k,
        x2.stride(0), y.stride(0), n_groups, n_win, wins, split, int(x2.dtype == torch.bfloat16), stream)
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
