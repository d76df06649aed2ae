"""Launch plumbing the skinny-SpMM kernels share (Triton and CUDA): split-K sizing, the fp32 split-K workspace,
X alignment for the CUDA kernels, and per-weight cached tile lengths."""
from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsetrain.kernels._runtime import cuda_build
from sparsetrain.kernels._runtime.device import num_sms, raw_stream

CSRC = Path(__file__).resolve().parent / "csrc"

MAX_TOKENS = 64  # largest N the skinny kernels take
# Blocks per multiprocessor the CUDA kernels' split-K aims for: 4 / 8 / 16 measured within 3-10% of each other on
# an H200, 8 the best on the smaller shape (docs/history/inference.md).
CUDA_WAVES = 8
_WORKSPACE: dict[tuple, tuple[Tensor, Tensor]] = {}


def workspace(device: torch.device, n_elems: int, n_locks: int, stream: int | None = None) -> tuple[Tensor, Tensor]:
    """Zeroed fp32 split-K workspace + arrival counters, one pair per (device, stream); kernels leave them 0.

    Calls on one stream are ordered, so sharing is safe; concurrent calls on one stream cannot happen.
    """
    if stream is None:
        stream = raw_stream(device) if device.type == "cuda" else 0
    key = (device, stream)
    ws, locks = _WORKSPACE.get(key, (None, None))
    if ws is None or ws.numel() < n_elems or locks.numel() < n_locks:
        ws = torch.zeros(max(n_elems, 0 if ws is None else ws.numel()), dtype=torch.float32, device=device)
        n_locks = max(n_locks, 0 if locks is None else locks.numel())
        locks = torch.zeros(n_locks, dtype=torch.int32, device=device)
        _WORKSPACE[key] = (ws, locks)
    return ws, locks


def split_k_for(tm: int, tk: int, split_k: int | None, waves: float, device: torch.device) -> tuple[int, int]:
    """(split_k, tiles_per_split): enough programs for ``waves`` per multiprocessor unless ``split_k`` is given;
    no empty splits."""
    if split_k is None:
        split_k = max(1, min(tk, math.ceil(waves * num_sms(device) / tm)))
    if not 1 <= split_k <= tk:
        raise ValueError(f"split_k must be in 1..{tk}, got {split_k}")
    tiles_per_split = math.ceil(tk / split_k)
    return math.ceil(tk / tiles_per_split), tiles_per_split


class CudaLaunch(NamedTuple):
    """What a CUDA skinny-SpMM call needs besides the weight."""

    x2: Tensor
    y: Tensor
    ws: Tensor
    locks: Tensor
    bias: Tensor | None
    split_k: int
    tiles_per_split: int
    stream: int


def prepare_cuda(x2: Tensor, m: int, tm: int, tk: int, bias: Tensor | None, split_k: int | None,
                 waves: float) -> CudaLaunch:
    """Checks N, makes X 16-byte aligned with a row stride divisible by 8 (a padded copy if needed), sizes
    split-K, allocates Y and gets the workspace; casts the bias to X's dtype."""
    n, k = x2.shape
    if not 1 <= n <= MAX_TOKENS:
        raise ValueError(f"x must have 1..{MAX_TOKENS} rows for the sparse kernel, got {n}")
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        kp = -(-k // 8) * 8
        x2 = F.pad(x2, (0, kp - k)) if kp != k else x2.clone(memory_format=torch.contiguous_format)
    split_k, tiles_per_split = split_k_for(tm, tk, split_k, waves, x2.device)
    y = torch.empty(n, m, dtype=x2.dtype, device=x2.device)
    stream = raw_stream(x2.device)
    ws, locks = workspace(x2.device, MAX_TOKENS * m, tm, stream) if split_k > 1 else (y, y)
    if bias is not None and (bias.dtype != x2.dtype or not bias.is_contiguous()):
        bias = bias.to(x2.dtype).contiguous()
    return CudaLaunch(x2, y, ws, locks, bias, split_k, tiles_per_split, stream)


def max_tile_len(weight) -> int:
    """Longest tile's stored-value count (sizes the CUDA kernels' shared-memory buffers). Computed once per weight
    object (one device sync) and cached on it; :class:`~sparsetrain.inference.SparseInferenceLinear` keeps it
    across the weight views it makes each call, so a forward never syncs (and CUDA-graph capture works)."""
    cached = getattr(weight, "_max_tile_len", None)
    if cached is None:
        flat = weight.tile_offsets.reshape(-1).long()
        if flat.numel() == 0:
            cached = 0
        else:
            last = weight.values.numel() - int(flat[-1])
            inner = int((flat[1:] - flat[:-1]).max()) if flat.numel() > 1 else 0
            cached = max(last, inner)
        weight._max_tile_len = cached
    return cached


def aligned(weight) -> bool:
    """The CUDA kernels copy a weight's tensors with 16-byte loads: each must start 16-byte aligned (fresh
    allocations do; views into a larger buffer may not)."""
    return all(t.data_ptr() % 16 == 0 for t in weight.tensors().values())


def launch_cuda(fn, name: str, format_ptrs: tuple[int, int, int], weight, x2: Tensor, bias: Tensor | None,
                split_k: int | None, waves: float) -> Tensor:
    """Runs one of the ``csrc`` skinny-SpMM launchers, whose arguments are X, the format's three tensors,
    ``tile_offsets``, the bias and outputs, then the sizes (see ``sparsetrain_spmm_bitmap``); returns Y."""
    if not aligned(weight):
        raise ValueError(f"{name}: the weight's tensors must be 16-byte aligned (tensors made by compress or "
                         ".to() are)")
    m, k = weight.shape
    tm, tk = weight.tile_offsets.shape
    run = prepare_cuda(x2, m, tm, tk, bias, split_k, waves)
    rc = fn(run.x2.data_ptr(), *format_ptrs, weight.tile_offsets.data_ptr(),
            run.bias.data_ptr() if run.bias is not None else 0, run.y.data_ptr(), run.ws.data_ptr(),
            run.locks.data_ptr(), weight.values.numel(), x2.shape[0], m, k, run.x2.stride(0), run.y.stride(0),
            tm, tk, run.tiles_per_split, run.split_k, max_tile_len(weight), int(x2.dtype == torch.bfloat16),
            run.stream)
    if rc != 0:
        raise RuntimeError(f"{name} CUDA launch failed with code {rc}")
    return run.y


def cuda_usable(x2: Tensor, weight, lib: str) -> bool:
    """Whether the ``csrc/<lib>.cu`` skinny-SpMM kernel takes this call: CUDA, fp16/bf16, 1..64 tokens, the
    weight's tensors 16-byte aligned, the library built."""
    if (not x2.is_cuda or x2.dtype not in (torch.float16, torch.bfloat16) or not 1 <= x2.shape[0] <= MAX_TOKENS
            or not aligned(weight)):
        return False
    return cuda_build.load(CSRC / f"{lib}.cu", x2.device) is not None


def run_cuda(lib: str, format_ptrs: tuple[int, int, int], weight, x2: Tensor, bias: Tensor | None,
             split_k: int | None) -> Tensor:
    """Loads ``csrc/<lib>.cu`` (built on first use), checks X's dtype against the weight's and launches its
    ``sparsetrain_<lib>`` entry point through :func:`launch_cuda` (split-K aimed at ``CUDA_WAVES``)."""
    so = cuda_build.load(CSRC / f"{lib}.cu", x2.device)
    if so is None:
        raise RuntimeError(f"the CUDA kernel {lib} is unavailable here (no nvcc or no GPU)")
    if x2.dtype != weight.dtype:
        raise TypeError(f"x dtype {x2.dtype} differs from the weight dtype {weight.dtype}")
    return launch_cuda(getattr(so, f"sparsetrain_{lib}"), lib, format_ptrs, weight, x2, bias, split_k, CUDA_WAVES)
