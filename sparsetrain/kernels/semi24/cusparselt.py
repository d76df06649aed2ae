"""cuSPARSELt through torch: compressing a 2:4 operand, the sparse product, and the per-shape choices made once
(the algorithm id, whether the mask kernel's own packing is usable).

cuSPARSELt's own algorithm search is not used (see :func:`select_alg`); some alg ids give wrong results
(pytorch issue 155333), so every candidate is checked against a dense product before it is timed.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from sparsetrain.kernels.semi24.mask import transposable24

# Token counts are padded to a multiple of this before a cuSPARSELt product (dense operand rows).
TOKEN_ALIGN = 16
# cuSPARSELt's structured operand wants both dims divisible by 16 for 16-bit types.
CSLT_ALIGN = 16
# Compute dtypes that take the cuSPARSELt path (others run masked dense with the same mask). fp16 is out:
# on the H200 (cuSPARSELt 0.8, torch 2.11) sweeping the fp16 alg ids faults the CUDA context (illegal
# instruction), and such a fault cannot be caught (docs/history/semi24.md).
SPARSE_DTYPES = (torch.bfloat16,)


def cslt_available() -> bool:
    """cuSPARSELt is usable through torch on this machine."""
    if not torch.cuda.is_available() or not hasattr(torch, "_cslt_sparse_mm"):
        return False
    try:
        return bool(torch.backends.cusparselt.is_available())
    except (AttributeError, RuntimeError):  # pragma: no cover - old torch
        return False


def compress(wm: Tensor) -> Tensor:
    """cuSPARSELt compressed form (values + metadata) of a 2:4 (along rows) matrix, as a 2-D tensor."""
    packed = torch._cslt_compress(wm)
    # Newer torch returns (rows, cols'); older returns 1-D and newer products assert 2-D input.
    return packed if packed.dim() == 2 else packed.view(wm.shape[0], -1)


@dataclass(frozen=True)
class AlgChoice:
    """A cuSPARSELt algorithm id checked on one product shape (``ms``/``rel_err`` as measured)."""

    alg_id: int
    ms: float | None = None
    rel_err: float | None = None


def sparse_mm_t(packed: Tensor, x2d: Tensor, choice: AlgChoice, bias: Tensor | None = None) -> Tensor:
    """``x2d @ Aᵀ (+ bias)`` for the 2:4 matrix ``A (M, K)`` held in ``packed``; ``x2d`` is (T, K) row-major.

    cuSPARSELt computes ``A @ x2dᵀ`` (x2dᵀ read as a transposed operand, no copy) and writes it column-major,
    which is ``(T, M)`` row-major: exactly the next layer's input layout. On the H200 this layout was the
    fastest (or within 0.01x of it) at 7 of 8 shapes probed; at A = 4096x1024 the (M, T) result layouts ran
    0.86x of dense against 0.71x, but would need a transpose copy (docs/history/semi24.md).
    """
    return torch._cslt_sparse_mm(packed, x2d.t(), bias, transpose_result=True, alg_id=choice.alg_id)


def pad_tokens(t: int) -> int:
    """``t`` rounded up to a multiple of ``TOKEN_ALIGN``."""
    return -(-t // TOKEN_ALIGN) * TOKEN_ALIGN


def pad_rows(x2d: Tensor, rows: int) -> Tensor:
    """``x2d`` itself if it already has ``rows`` rows, contiguous and 16-byte aligned, else a zero-padded copy."""
    if x2d.shape[0] == rows and x2d.is_contiguous() and x2d.data_ptr() % 16 == 0:
        return x2d
    out = x2d.new_zeros(rows, x2d.shape[1])
    out[: x2d.shape[0]].copy_(x2d)
    return out


def _max_alg_candidates() -> int:
    try:
        m = torch.backends.cusparselt.get_max_alg_id()
    except (AttributeError, RuntimeError):  # pragma: no cover
        m = None
    return int(m) if m else 64  # unknown: try ids until cuSPARSELt refuses one


_ALG_CACHE: dict[tuple, AlgChoice | None] = {}


def select_alg(m: int, k: int, tokens: int, dtype: torch.dtype, device: torch.device | None = None, *,
               rep_ms: float = 10.0, tol: float = 1e-2) -> AlgChoice | None:
    """Fastest correct cuSPARSELt algorithm id for ``x (tokens, k) @ Aᵀ`` with ``A (m, k)`` 2:4. Cached.

    Every alg id (0, 1, ... until cuSPARSELt refuses one) is run on fresh random data and kept only if its
    relative error against a float32 dense product of the same masked matrix is below ``tol``; the fastest
    kept one wins. ``None`` when none is correct or ``dtype`` is not in ``SPARSE_DTYPES`` (the caller then goes
    dense). cuSPARSELt's own search is not used: its proposal on the H200 (alg 17, split-K -1, mode 2) was
    followed by an illegal-instruction fault of the context.
    """
    if dtype not in SPARSE_DTYPES:
        return None
    device = torch.device(device or "cuda")
    tp = pad_tokens(tokens)
    key = (m, k, tp, dtype, device.index)
    if key in _ALG_CACHE:
        return _ALG_CACHE[key]
    from triton.testing import do_bench

    am = transposable24(torch.randn(m, k, device=device, dtype=dtype)).wm
    packed = compress(am)
    x = torch.randn(tp, k, device=device, dtype=dtype)
    ref = x.float() @ am.float().t()
    best: AlgChoice | None = None
    for alg in range(_max_alg_candidates()):
        cand = AlgChoice(alg)
        try:
            y = sparse_mm_t(packed, x, cand)
        except RuntimeError:
            break  # past the last alg id of this cuSPARSELt
        err = ((y.float() - ref).norm() / ref.norm()).item()
        if not err < tol:  # also rejects NaN
            continue
        ms = do_bench(lambda c=cand: sparse_mm_t(packed, x, c), warmup=2, rep=rep_ms, return_mode="median")
        if best is None or ms < best.ms:
            best = AlgChoice(alg, ms, err)
    _ALG_CACHE[key] = best
    return best


_PACK_OK: dict[tuple, bool] = {}


def pack_supported(n: int, k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the Triton kernel's cuSPARSELt packing is usable for (n, k) weights: 16-bit dtype, dims
    divisible by 64, and, once per shape/dtype/device, bit-identical to ``torch._cslt_compress`` of W and Wᵀ
    on fresh random data (the layout is undocumented; any other cuSPARSELt or GPU falls back here). Where it is
    not, :func:`compress` (``torch._cslt_compress``) packs the masked weight instead."""
    if dtype not in (torch.float16, torch.bfloat16) or n % 64 or k % 64 or device.type != "cuda":
        return False
    key = (n, k, dtype, device.index, torch.backends.cusparselt.version())
    if key not in _PACK_OK:
        try:
            # No exact zeros in the probe: where a kept cell holds 0, cuSPARSELt may encode the group with
            # other (equally zero) positions, a different byte string for the same matrix (the products are
            # identical). A 64M-element bf16 randn draws a few exact zeros (docs/history/semi24.md).
            w = torch.randn(n, k, device=device, dtype=dtype)
            w = torch.where(w == 0, torch.ones((), device=device, dtype=dtype), w)
            r = transposable24(w, pack=True, pack_t=True)
            ok = (torch.equal(r.packed.view(torch.int16), compress(r.wm).view(torch.int16))
                  and torch.equal(r.packed_t.view(torch.int16), compress(r.wm.t().contiguous()).view(torch.int16)))
        except (RuntimeError, ValueError) as e:  # e.g. a Triton build error: keep training on the slow path
            warnings.warn(f"semi24: fused cuSPARSELt packing unavailable ({e!r:.200}); using _cslt_compress",
                          stacklevel=2)
            ok = False
        if not ok:
            warnings.warn(f"semi24: fused packing differs from _cslt_compress for {(n, k)} {dtype}; "
                          "using _cslt_compress for this shape", stacklevel=2)
        _PACK_OK[key] = ok
    return _PACK_OK[key]


def alg_table() -> list[dict]:
    """The cached choices, for the run log."""
    return [{"m": k[0], "k": k[1], "tokens_padded": k[2], "dtype": str(k[3]).replace("torch.", ""),
             "alg_id": v.alg_id if v else None, "ms": v.ms if v else None, "rel_err": v.rel_err if v else None}
            for k, v in _ALG_CACHE.items()]
