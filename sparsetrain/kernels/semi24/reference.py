"""Plain-torch references of the 2:4 pieces: the transposable mask, cuSPARSELt's compressed layout, the linear.

Tests compare the Triton kernel and the cuSPARSELt products with these on fresh random inputs.

>>> w = torch.randn(64, 128)
>>> mask, wm = transposable24_reference(w)
>>> int(mask.view(16, 4, 32, 4).sum(dim=3).max()), int(mask.view(16, 4, 32, 4).sum(dim=1).max())
(2, 2)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsetrain.kernels.semi24.patterns import NPAT, check_weight, pattern_tensors


def transposable24_reference(weight: Tensor, out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """Transposable 2:4 mask keeping, in every 4x4 tile, the pattern with the largest sum of ``|w|``.

    Magnitudes are those of the weight rounded to ``out_dtype`` (default the weight's dtype): the matrix
    that is actually multiplied. Returns ``(mask, weight.to(out_dtype) * mask)``.

    >>> m, wm = transposable24_reference(torch.randn(8, 8))
    >>> m.shape, int(m.sum())
    (torch.Size([8, 8]), 32)
    """
    check_weight(weight)
    n, k = weight.shape
    member, bits = pattern_tensors(weight.device)
    w = weight.detach().to(out_dtype or weight.dtype)
    tiles = w.abs().float().reshape(n // 4, 4, k // 4, 4).permute(0, 2, 1, 3).reshape(-1, 16)
    best = torch.argmax(tiles @ member[:, :NPAT], dim=1)  # first maximum, like tl.argmax(tie_break_left)
    cells = torch.arange(16, device=weight.device, dtype=torch.int32)
    keep = ((bits[best][:, None] >> cells[None, :]) & 1).bool()
    mask = keep.reshape(n // 4, k // 4, 4, 4).permute(0, 2, 1, 3).reshape(n, k)
    return mask, w * mask


def is_transposable24(mask: Tensor) -> bool:
    """True if every 4x4 tile of the (out, in) bool mask keeps at most 2 per row and at most 2 per column."""
    if mask.dim() != 2 or mask.shape[0] % 4 or mask.shape[1] % 4:
        return False
    n, k = mask.shape
    t = mask.reshape(n // 4, 4, k // 4, 4).to(torch.int8)
    return bool((t.sum(dim=3) <= 2).all()) and bool((t.sum(dim=1) <= 2).all())


# cuSPARSELt's compressed layout (cuSPARSELt 0.8, sm90):
# Read off cuSPARSELt's own output on an H200 (designed inputs, then bit-exact on random ones; see
# docs/history/semi24.md). A 2:4 (along rows) matrix (N, K) compresses to N*K*9/16 elements of its dtype:
#   values   [0, N*K/2): row-major (N, K/2), the two kept values of every group of 4 in column order;
#   metadata [N*K/2, ...): N*K/16 int16 words, one 4-bit code per group, idx0 | idx1 << 2 (idx0 < idx1),
#            code q at bits 4*(q % 4) of word q // 4, where for row r and group c of a row (kg = K/4 groups)
#            q = 128*t + (rr//8 | (cc//4) << 1 | (cc%4) << 2 | (rr%8) << 4),  rr = r%16, cc = c%8,
#            t = ((r//64) * (kg//8) + c//8) * 4 + (r//16) % 4   (needs N % 64 == 0 and K % 32 == 0).
# Other cuSPARSELt versions or GPUs may differ: :func:`~sparsetrain.kernels.semi24.cusparselt.pack_supported` checks against _cslt_compress once.
def cslt_pack_reference(wm: Tensor, mask: Tensor) -> Tensor:
    """cuSPARSELt compressed form of ``wm`` (2:4 along rows, kept cells given by ``mask``), plain torch."""
    n, k = wm.shape
    if n % 64 or k % 32:
        raise ValueError(f"wm shape {(n, k)}: the packed layout needs rows % 64 == 0 and cols % 32 == 0")
    g = mask.reshape(n, k // 4, 4)
    if not bool((g.sum(-1) == 2).all()):
        raise ValueError("mask must keep exactly 2 of every group of 4 along rows")
    idx = torch.argsort((~g).to(torch.int8) * 4 + torch.arange(4, device=wm.device, dtype=torch.int8),
                        dim=2, stable=True)[..., :2].sort(dim=2).values
    vals = torch.gather(wm.reshape(n, k // 4, 4), 2, idx).reshape(-1)
    code = (idx[..., 0] | (idx[..., 1] << 2)).reshape(-1)
    kg = k // 4
    r = torch.arange(n, device=wm.device)[:, None]
    c = torch.arange(kg, device=wm.device)[None, :]
    rr, cc = r % 16, c % 8
    t = ((r // 64) * (kg // 8) + c // 8) * 4 + (r // 16) % 4
    q = (128 * t + ((rr // 8) | ((cc // 4) << 1) | ((cc % 4) << 2) | ((rr % 8) << 4))).reshape(-1)
    nib = torch.zeros_like(code)
    nib[q] = code
    words = (nib.reshape(-1, 4) << (4 * torch.arange(4, device=wm.device))).sum(1)
    words = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
    out = torch.empty(n * k * 9 // 16, dtype=wm.dtype, device=wm.device)
    out[: n * k // 2] = vals
    out.view(torch.int16)[n * k // 2:] = words
    return out.view(n, k * 9 // 16)


def cslt_unpack_reference(packed: Tensor, n: int, k: int) -> Tensor:
    """Inverse of :func:`cslt_pack_reference`: the dense (n, k) matrix, zeros outside the kept cells."""
    flat = packed.reshape(-1)
    vals = flat[: n * k // 2].reshape(n, k // 4, 2)
    words = flat.view(torch.int16)[n * k // 2:].to(torch.int32) & 0xFFFF
    nib = ((words[:, None] >> (4 * torch.arange(4, device=packed.device))) & 15).reshape(-1)
    kg = k // 4
    r = torch.arange(n, device=packed.device)[:, None]
    c = torch.arange(kg, device=packed.device)[None, :]
    rr, cc = r % 16, c % 8
    t = ((r // 64) * (kg // 8) + c // 8) * 4 + (r // 16) % 4
    code = nib[128 * t + ((rr // 8) | ((cc // 4) << 1) | ((cc % 4) << 2) | ((rr % 8) << 4))]
    idx = torch.stack([code & 3, code >> 2], dim=-1).long()
    out = torch.zeros(n, kg, 4, dtype=packed.dtype, device=packed.device)
    out.scatter_(2, idx, vals)
    return out.reshape(n, k)


def semi24_linear_reference(x: Tensor, weight: Tensor, mask: Tensor, bias: Tensor | None = None) -> Tensor:
    """Plain-torch reference: straight-through masked dense linear (what ``MaskedFormat`` computes)."""
    w_eff = weight + (weight * mask - weight).detach()
    return F.linear(x, w_eff, bias)
