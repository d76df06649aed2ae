"""The transposable 2:4 mask on the device: :func:`transposable24` launches the Triton kernel (:mod:`._triton`)
that masks ``W`` and, in the same pass, writes what the products need (``W⊙M``, ``(W⊙M)ᵀ`` or both already in
cuSPARSELt's compressed layout). :func:`transposable24_mask` (``torch.ops.sparsetrain.transposable24_mask``)
is the mask alone as a custom op, for the masked-dense linear that ``torch.compile`` traces
(:func:`transposable24_mask_of` the same into a new tensor).
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
from torch import Tensor

from sparsetrain.kernels.semi24.patterns import NPAT, NPAT_PAD, check_weight, pattern_tensors
from sparsetrain.kernels.semi24.reference import transposable24_reference

try:  # Triton is optional: without it the 2:4 format falls back to the masked reference path.
    from sparsetrain.kernels.semi24 import _triton
except ImportError:  # pragma: no cover
    _triton = None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run for tensors on ``device`` (CUDA, or CPU under the interpreter)."""
    return _triton is not None and (device.type == "cuda" or (device.type == "cpu" and _interpret()))


class Sparsified(NamedTuple):
    """Outputs of :func:`transposable24`; fields not asked for are None."""

    mask: Tensor
    wm: Tensor | None
    wmt: Tensor | None
    packed: Tensor | None
    packed_t: Tensor | None


def transposable24(
    weight: Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    mask_out: Tensor | None = None,
    write_wm: bool = True,
    write_transposed: bool = False,
    pack: bool = False,
    pack_t: bool = False,
    tiles: tuple[int, int] = (8, 16),
) -> Sparsified:
    """Triton: transposable 2:4 mask of ``weight`` and what the products need, in one pass over it.

    Returns :class:`Sparsified`: the bool mask (written into ``mask_out`` if given); ``wm = weight ⊙ mask``
    in ``out_dtype`` (default the weight's dtype; magnitudes are ranked after rounding to it); ``wmt = wmᵀ``
    if ``write_transposed``; the cuSPARSELt compressed ``wm`` / ``wmᵀ`` if ``pack`` / ``pack_t`` (16-bit
    dtypes, both dims divisible by 64). Same choice as :func:`~sparsetrain.kernels.semi24.reference.transposable24_reference`.

    >>> r = transposable24(torch.randn(64, 64, device="cuda"))  # doctest: +SKIP
    >>> r.mask.shape, r.wm.shape  # doctest: +SKIP
    (torch.Size([64, 64]), torch.Size([64, 64]))
    """
    check_weight(weight)
    if not kernel_available(weight.device):
        raise ValueError(f"weight is on {weight.device}: the Triton kernel needs CUDA (or TRITON_INTERPRET=1)")
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    n, k = weight.shape
    out_dtype = out_dtype or weight.dtype
    if out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"out_dtype must be float16, bfloat16 or float32, got {out_dtype}")
    if (pack or pack_t) and (out_dtype == torch.float32 or n % 64 or k % 64):
        raise ValueError(f"pack/pack_t need a 16-bit out_dtype and weight dims divisible by 64, got {out_dtype}, "
                         f"weight shape {(n, k)}")
    if mask_out is None:
        mask_out = torch.empty(n, k, dtype=torch.bool, device=weight.device)
    elif (tuple(mask_out.shape) != (n, k) or mask_out.dtype != torch.bool or not mask_out.is_contiguous()
          or mask_out.device != weight.device):
        raise ValueError(f"mask_out must be a contiguous bool ({n}, {k}) tensor on {weight.device}, got "
                         f"{mask_out.dtype} {tuple(mask_out.shape)} on {mask_out.device}")
    tr, tc = (16, 8) if (pack or pack_t) else tiles
    if tr * tc < 16 or (tr * tc) & (tr * tc - 1):
        raise ValueError(f"tiles {tiles}: their product must be a power of two >= 16")
    dev = weight.device
    wm = torch.empty(n, k, dtype=out_dtype, device=dev) if write_wm else None
    wmt = torch.empty(k, n, dtype=out_dtype, device=dev) if write_transposed else None
    packed = torch.empty(n, k * 9 // 16, dtype=out_dtype, device=dev) if pack else None
    packed_t = torch.empty(k, n * 9 // 16, dtype=out_dtype, device=dev) if pack_t else None
    # Unused outputs get a 1-element dummy of the compute dtype (the kernel reads its element type).
    dummy = torch.empty(1, dtype=out_dtype, device=dev)
    half = n * k // 2
    pv, pm = (packed, packed.view(torch.int16).view(-1)[half:]) if pack else (dummy, dummy)
    ptv, ptm = (packed_t, packed_t.view(torch.int16).view(-1)[half:]) if pack_t else (dummy, dummy)
    member, bits = pattern_tensors(dev)
    grid = (-(-n // (4 * tr)), -(-k // (4 * tc)))
    _triton.transposable24_kernel[grid](
        weight, mask_out.view(torch.uint8), wm if wm is not None else dummy, wmt if wmt is not None else dummy,
        pv, pm, ptv, ptm, member, bits, n, k, weight.stride(0),
        NPAT=NPAT, NPAT_PAD=NPAT_PAD, TILES_R=tr, TILES_C=tc,
        # 16-bit pattern scoring for bf16 (measured 0.24 vs 0.42 ms for 64M weights on the H200); fp16 keeps
        # the tf32 scoring (exact for fp16 values as well).
        DOT16=out_dtype == torch.bfloat16 and dev.type == "cuda",
        WRITE_WM=write_wm, WRITE_T=write_transposed, PACK=pack, PACK_T=pack_t, num_warps=4,
    )
    return Sparsified(mask_out, wm, wmt, packed, packed_t)


# ---- torch.compile: the mask as a torch.library custom op ------------------------------------------------
# The masked-dense ("dense" mode) 2:4 linear is traced by torch.compile (see :func:`.op.semi24_dense_linear`);
# the one thing dynamo cannot trace is the Triton mask launch, so that is an opaque op mutating the mask
# buffer in place. Nothing flows back through it (the mask is not differentiable): it has no autograd formula
# and is called on the detached weight.
@torch.library.custom_op("sparsetrain::transposable24_mask", mutates_args=("mask_out",))
def transposable24_mask(weight: Tensor, mask_out: Tensor, out_dtype: torch.dtype) -> None:
    """Write the transposable 2:4 mask of ``weight`` (magnitudes ranked after rounding to ``out_dtype``, the
    compute dtype) into the contiguous bool ``mask_out``: one Triton launch on CUDA, the plain-torch reference
    (:func:`~sparsetrain.kernels.semi24.reference.transposable24_reference`) elsewhere.

    >>> w = torch.randn(8, 16); m = torch.empty(8, 16, dtype=torch.bool)
    >>> torch.ops.sparsetrain.transposable24_mask(w, m, torch.float32)
    >>> int(m.sum())
    64
    """
    _write_mask(weight, mask_out, out_dtype)


def _write_mask(weight: Tensor, mask_out: Tensor, out_dtype: torch.dtype) -> None:
    # no autocast either: the reference's pattern scores are a matmul, which CPU autocast would round to 16 bits
    with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
        if weight.is_cuda and kernel_available(weight.device):
            transposable24(weight, out_dtype=out_dtype, mask_out=mask_out, write_wm=False)
        else:
            mask_out.copy_(transposable24_reference(weight, out_dtype)[0])


@transposable24_mask.register_fake
def _(weight, mask_out, out_dtype):
    return None


@torch.library.custom_op("sparsetrain::transposable24_mask_of", mutates_args=())
def transposable24_mask_of(weight: Tensor, out_dtype: torch.dtype) -> Tensor:
    """:func:`transposable24_mask` into a new bool tensor: in a compiled step the mask is then a temporary of the
    step's own memory, used at once and not kept (a layer whose ``mask`` buffer is shared scratch).

    >>> int(torch.ops.sparsetrain.transposable24_mask_of(torch.randn(8, 16), torch.float32).sum())
    64
    """
    mask = torch.empty(weight.shape, dtype=torch.bool, device=weight.device)
    _write_mask(weight, mask, out_dtype)
    return mask


@transposable24_mask_of.register_fake
def _(weight, out_dtype):
    return weight.new_empty(weight.shape, dtype=torch.bool)
