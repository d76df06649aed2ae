"""The 2:4 straight-through linear: :func:`semi24_linear` and its autograd function.

The forward of a 2:4 straight-through linear layer is ``y = x (W ⊙ M)ᵀ + b`` where ``M`` is a *transposable*
2:4 mask of the dense master weight ``W`` (every 4x4 tile keeps exactly 2 per row and 2 per column, so both
``W ⊙ M`` and its transpose are 2:4 along their rows). Three products per step:

- forward ``y  = x  (W⊙M)ᵀ``: sparse ``W⊙M`` (cuSPARSELt);
- input grad ``dx = dy (W⊙M)``: sparse ``(W⊙M)ᵀ`` (cuSPARSELt, hence the transposable mask);
- weight grad ``dW = dyᵀ x``: dense (cuBLAS), passed straight through to the whole dense ``W``.

Modes: ``"24"`` (forward and input grad sparse), ``"24fwd"`` (forward sparse only), ``"dense"`` (masked dense).
:func:`semi24_dense_linear` is the ``"dense"`` mode in plain traceable torch (the mask through one custom op), so
that under ``torch.compile`` inductor fuses the casts and reductions around the products.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsetrain.kernels.semi24.cusparselt import (
    CSLT_ALIGN,
    SPARSE_DTYPES,
    compress,
    cslt_available,
    pack_supported,
    pad_rows,
    pad_tokens,
    select_alg,
    sparse_mm_t,
)
from sparsetrain.kernels.semi24.mask import transposable24, transposable24_mask, transposable24_mask_of

MODES = ("24", "24fwd", "dense")


class Semi24LinearFn(torch.autograd.Function):
    """``y = x2d @ (W⊙M)ᵀ + b`` with a straight-through dense gradient to ``W``.

    ``packed``/``packed_t`` (cuSPARSELt forms of ``W⊙M`` and ``(W⊙M)ᵀ``) select the sparse products;
    when one is None that product runs dense on ``wm``. ``weight`` is the dense master Parameter: it is only
    used to give ``dW`` its dtype. ``layer_box[0]``, when given, receives ``dW`` in ``dense_grad`` if its
    ``capture_dense_grad`` is set (RigL-style dense-gradient capture).
    """

    @staticmethod
    def forward(ctx, x2d, weight, bias, wm, packed, packed_t, fwd_alg, dx_alg, layer_box):
        t = x2d.shape[0]
        if packed is not None:
            xp = pad_rows(x2d, pad_tokens(t))
            # the bias is added in cuSPARSELt's epilogue (checked against the reference by the GPU tests)
            y = sparse_mm_t(packed, xp, fwd_alg, bias)
            y = y[:t] if xp.shape[0] != t else y
        else:
            y = F.linear(x2d, wm, bias)
        ctx.save_for_backward(x2d, packed_t if packed_t is not None else wm)
        ctx.sparse_dx = packed_t is not None
        ctx.dx_alg, ctx.layer_box = dx_alg, layer_box
        ctx.w_dtype, ctx.has_bias = weight.dtype, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, w_for_dx = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            if ctx.sparse_dx:
                t = dy.shape[0]
                dyp = pad_rows(dy, pad_tokens(t))
                dx = sparse_mm_t(w_for_dx, dyp, ctx.dx_alg)
                dx = dx[:t] if dyp.shape[0] != t else dx
            else:
                dx = dy @ w_for_dx
        if ctx.needs_input_grad[1]:
            g = dy.t() @ x2d  # dense: the straight-through gradient reaches pruned weights too
            layer = ctx.layer_box[0] if ctx.layer_box else None
            if layer is not None and layer.capture_dense_grad:
                layer.dense_grad = g.float() if layer.dense_grad is None else layer.dense_grad + g.float()
            dw = g.to(ctx.w_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.sum(0)
        return dx, dw, db, None, None, None, None, None, None


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a linear layer computes in: the autocast dtype when autocast is on for x's device."""
    dev = x.device.type
    try:
        on = torch.is_autocast_enabled(dev)
    except TypeError:  # pragma: no cover - torch < 2.4
        on = torch.is_autocast_enabled() if dev == "cuda" else False
    if on:
        try:
            return torch.get_autocast_dtype(dev)
        except AttributeError:  # pragma: no cover
            return torch.get_autocast_gpu_dtype()
    return x.dtype


def semi24_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    mode: str = "24",
    mask: Tensor | None = None,
    mask_out: Tensor | None = None,
    layer=None,
) -> Tensor:
    """2:4 straight-through linear on CUDA: ``x @ (W⊙M)ᵀ + b`` with ``dW`` dense to all of ``W``.

    ``M`` is computed from ``weight`` (:func:`transposable24`, written into ``mask_out`` if given) unless a
    ``mask`` is passed. ``mode``: ``"24"`` forward and input grad through cuSPARSELt, ``"24fwd"`` forward
    only, ``"dense"`` masked dense (cuBLAS). Sparse modes need a compute dtype in ``SPARSE_DTYPES`` (autocast
    or input dtype) and both weight dims divisible by 16; otherwise the product runs dense with the same
    mask. Where :func:`pack_supported`, the mask kernel writes the compressed operands itself.

    >>> y = semi24_linear(torch.randn(100, 64, device="cuda", dtype=torch.bfloat16),
    ...                   torch.randn(32, 64, device="cuda", dtype=torch.bfloat16))  # doctest: +SKIP
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {weight.shape[1]}")
    if not x.is_cuda or not weight.is_cuda:
        raise ValueError("semi24_linear needs CUDA tensors; on CPU use the masked reference format")
    dtype = compute_dtype(x)
    n, k = weight.shape
    sparse_ok = (dtype in SPARSE_DTYPES and n % CSLT_ALIGN == 0 and k % CSLT_ALIGN == 0
                 and cslt_available())
    if not sparse_ok:
        mode = "dense"
    x2d = x.reshape(-1, k).to(dtype)
    tokens = x2d.shape[0]
    fwd_alg = dx_alg = None
    if mode != "dense":
        fwd_alg = select_alg(n, k, tokens, dtype, x.device)
        dx_alg = select_alg(k, n, tokens, dtype, x.device) if mode == "24" else None
        if fwd_alg is None:  # no correct cuSPARSELt configuration for this shape
            mode = "dense"
    sparse_dx = mode == "24" and dx_alg is not None
    with torch.no_grad():
        if mask is None and mode != "dense" and pack_supported(n, k, dtype, x.device):
            # one pass: mask, and W ⊙ M / (W ⊙ M)ᵀ straight into cuSPARSELt's compressed layout
            r = transposable24(weight.detach(), out_dtype=dtype, mask_out=mask_out, write_wm=not sparse_dx,
                               pack=True, pack_t=sparse_dx)
            wm, packed, packed_t = r.wm, r.packed, r.packed_t
        else:
            if mask is None:
                r = transposable24(weight.detach(), out_dtype=dtype, mask_out=mask_out, write_transposed=sparse_dx)
                wm, wmt = r.wm, r.wmt
            else:
                wm = (weight.detach() * mask).to(dtype)
                wmt = wm.t().contiguous() if sparse_dx else None
            packed = compress(wm) if mode != "dense" else None
            packed_t = compress(wmt) if sparse_dx else None
    b = bias.to(dtype) if bias is not None else None
    with torch.autocast(x.device.type, enabled=False):
        y = Semi24LinearFn.apply(x2d, weight, b, wm, packed, packed_t,
                                 fwd_alg, dx_alg, [layer] if layer is not None else None)
    return y.reshape(*x.shape[:-1], n)


def semi24_dense_linear(x: Tensor, weight: Tensor, bias: Tensor | None, mask_out: Tensor | None, *,
                        recompute: bool = True) -> Tensor:
    """The ``"dense"`` mode of :func:`semi24_linear` in plain torch ops that ``torch.compile`` traces.

    ``y = x (W⊙M)ᵀ + b`` with ``dW = dyᵀ x`` straight through to all of ``W``, ``dx = dy (W⊙M)``,
    ``db = Σ dy``. ``recompute``: ``M`` is the transposable 2:4 mask of ``weight`` (ranked in the compute dtype,
    as :func:`semi24_linear` does), written into ``mask_out`` by the custom op :func:`.mask.transposable24_mask`
    (the Triton kernel on CUDA, the reference elsewhere), or into a temporary of its own when ``mask_out`` is
    None (:func:`.mask.transposable24_mask_of`); else ``mask_out`` is the mask used as given. Products run in the
    compute dtype (autocast's, else x's), like :func:`semi24_linear`.

    >>> m = torch.empty(8, 16, dtype=torch.bool)
    >>> semi24_dense_linear(torch.randn(3, 16), torch.randn(8, 16), None, m).shape
    torch.Size([3, 8])
    """
    dtype = compute_dtype(x)
    if recompute and mask_out is None:
        mask_out = transposable24_mask_of(weight.detach(), dtype)
    elif recompute:
        transposable24_mask(weight.detach(), mask_out, dtype)
    elif mask_out is None:
        raise ValueError("semi24_dense_linear: recompute=False needs the mask in mask_out")
    # forward: W ⊙ M ; backward: identity to the dense weight (straight-through estimator)
    w_eff = weight + (weight * mask_out.to(weight.dtype) - weight).detach()
    return F.linear(x.to(dtype), w_eff.to(dtype), bias.to(dtype) if bias is not None else None)
