"""Device facts the kernel launchers share."""
from __future__ import annotations

import torch

_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of a CUDA device (cached); 4 for the CPU interpreter, so grids stay small."""
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


_SMEM: dict[int, int] = {}


def smem_optin(device: torch.device) -> int:
    """Most dynamic shared memory one block may opt in to on a CUDA device, in bytes (cached)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMEM:
        props = torch.cuda.get_device_properties(idx)
        _SMEM[idx] = int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)
    return _SMEM[idx]


_CLEAR_CUBLAS = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # absent from CPU-only builds


def release_cublas_workspaces() -> bool:
    """Free the workspaces cuBLAS keeps for each handle and stream it has run on (32 MiB each on Hopper, held by
    the caching allocator to the end of the process). Timing done before training (the 2:4 dispatch's, on the
    autograd thread's handle too) leaves two such that the step never uses: 64 MiB above dense's peak. The step's
    own come back at its first product. Returns whether CUDA was asked to free them."""
    if _CLEAR_CUBLAS is None or not torch.cuda.is_initialized():
        return False
    torch.cuda.synchronize()
    _CLEAR_CUBLAS()
    return True


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU-only builds


def raw_stream(device: torch.device) -> int:
    """The current CUDA stream of ``device`` as the integer handle the kernel launchers pass. Read directly, not
    through a ``torch.cuda.Stream`` object: ``torch.cuda.current_stream`` was ~2% of a block-sparse BERT-base
    step's host profile (1080 calls in 5 steps; docs/history/blocksparse.md)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is not None:
        return _RAW_STREAM(idx)
    return torch.cuda.current_stream(idx).cuda_stream
