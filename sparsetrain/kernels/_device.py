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
