"""The CUDA "X-stationary" dense x block-sparse kernel (``csrc/bs_dds.cu``) as extra tile candidates of
:func:`sparsetrain.kernels.blocksparse._dds` (forward ``X·Wᵀ`` and input gradient ``dY·W``).

One CTA holds a whole token tile of the dense operand (``[16·mt, K]``) in shared memory and walks every output
block of its range over it, so the dense operand is read once per tile instead of once per active block (the
Triton kernel's gather). The launch plan fixes everything but the data pointers, like the Triton plans, and
the tuner (``blocksparse._pick``) times these candidates beside the Triton ones: the faster one is kept per
shape, so adding them never makes a layer slower than before. 16x16 and 32x32 blocks, fp16/bf16 activations.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

BLOCKS = (16, 32)
_SMEM: dict[int, int] = {}


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
    from sparsetrain.kernels import _cuda

    return _cuda.load("bs_dds", device)  # argument types: _cuda.SIGNATURES


def _smem_limit(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMEM:
        props = torch.cuda.get_device_properties(idx)
        _SMEM[idx] = int(getattr(props, "shared_memory_per_block_optin", 0) or 48 * 1024)
    return _SMEM[idx]


def candidates(a: Tensor, block: int, k: int) -> list[CudaDdsConfig]:
    """The CUDA tiles that can run this product here (none off-GPU, for fp32 activations, other blocks, or
    without nvcc); only tiles whose shared memory fits the device."""
    if not a.is_cuda or a.dtype not in (torch.float16, torch.bfloat16) or block not in BLOCKS:
        return []
    so = _lib(a.device)
    if so is None:
        return []
    limit = _smem_limit(a.device)
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
        if values.dtype != a.dtype:  # fp32 master weights under autocast: one cast of the active blocks
            values = values.to(a.dtype)
        if values.data_ptr() % 16 or not values.is_contiguous():
            values = values.contiguous() if not values.is_contiguous() else values.clone()
        if a.data_ptr() % 16 or a.stride(0) % 8 or a.stride(1) != 1:
            a = a.contiguous() if a.stride(1) != 1 or a.stride(0) % 8 else a.clone()
        b_ptr, b_f32 = 0, 0
        if self.has_bias:
            if bias.dtype not in (torch.float32, a.dtype) or not bias.is_contiguous():
                bias = bias.float().contiguous()
            b_ptr, b_f32 = bias.data_ptr(), int(bias.dtype == torch.float32)
        rc = self.fn(a.data_ptr(), values.data_ptr(), self.info.data_ptr(), self.wbound.data_ptr(), b_ptr, out.data_ptr(), self.t, self.k, a.stride(0), out.stride(0),
                     self.block, self.cfg.mt, self.cfg.half, self.cfg.splits, int(self.trans), int(a.dtype == torch.bfloat16),
                     b_f32, torch.cuda.current_stream(a.device).cuda_stream)
        if rc != 0:
            raise RuntimeError(f"bs_dds launch failed with code {rc} ({self.cfg})")
