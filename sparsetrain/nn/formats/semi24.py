"""The ``"2:4"`` SparseLinear storage format and the shape-aware choice between 2:4 and masked dense.

Semantics are those of ``MaskedFormat(straight_through=True)`` (PyTorch's 2:4 training recipe): the layer
keeps a dense master weight Parameter, the forward uses ``W ⊙ M`` with ``M`` a transposable 2:4 mask, and the
dense gradient goes straight through to all of ``W``. On CUDA the mask is recomputed from the current weight
on every forward by one Triton pass (see :mod:`sparsetrain.kernels.semi24`) and written into ``layer.mask``
(after :meth:`Semi24Format.plan_kernels`, one buffer per layer shape: ``current_mask`` reads a layer's own);
the products go through cuSPARSELt where :func:`plan_dispatch` measured that to be faster, else dense.
Under ``torch.compile`` the dense mode (``mode="dense"``, outside dense-gradient capture) is plain torch around
one mask custom op, traced with the rest of the model; the sparse modes run eagerly (a graph break).
On CPU the format *is* the masked reference path.

How a scheduler drives it (it reads ``layer.caps``):

- ``recompute_every_forward=True`` (default, ``caps.derives_mask``): the forward computes the mask itself;
  do not call ``set_mask`` every step (it would be overwritten by the next forward).
- ``recompute_every_forward=False``: the scheduler calls ``layer.set_mask(m)`` with a transposable 2:4 mask
  and the forward uses it as given.
- Phase switch to dense: ``layer.dense_phase()`` gives an ``nn.Linear`` holding the *same* weight
  Parameter, so the optimizer and its state carry over.

>>> from sparsetrain.nn import SparseLinear
>>> layer = SparseLinear(64, 32, format="2:4")
>>> y = layer(torch.randn(5, 64))
>>> is_transposable24(layer.mask)
True
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparsetrain.kernels._runtime.eager import eager_only
from sparsetrain.kernels.semi24 import (
    MODES,
    alg_table,
    compute_dtype,
    is_transposable24,
    kernel_available,
    select_alg,
    semi24_dense_linear,
    semi24_linear,
    transposable24,
    transposable24_mask_of,
    transposable24_reference,
)
from sparsetrain.nn.formats.base import FormatCaps, register_format
from sparsetrain.nn.formats.masked import MaskedFormat
from sparsetrain.sparsity.layout import Block
from sparsetrain.sparsity.protocol import SparseLayer

if TYPE_CHECKING:  # pragma: no cover
    from sparsetrain.nn.sparse_linear import SparseLinear


@eager_only  # torch.compiler.disable on first call: importing it costs ~1 s (torch._dynamo)
def _semi24_eager(fmt, layer, x: Tensor) -> Tensor:
    """The CUDA 2:4 path (mask kernel, cuSPARSELt packing and products, per-shape plans) always runs eagerly:
    under ``torch.compile`` the layer is a graph break rather than something dynamo would have to trace."""
    if fmt.recompute_every_forward:
        return semi24_linear(x, layer.weight, layer.bias, mode=fmt.mode, mask_out=layer.mask, layer=layer)
    return semi24_linear(x, layer.weight, layer.bias, mode=fmt.mode, mask=layer.mask, layer=layer)


@register_format("2:4")
class Semi24Format(MaskedFormat):
    """Transposable 2:4 straight-through format.

    ``mode`` picks the products on CUDA: ``"24"`` (forward and input grad through cuSPARSELt), ``"24fwd"``
    (forward only), ``"dense"`` (masked dense); :func:`plan_dispatch` sets it per layer from measurements.
    """

    def __init__(self, recompute_every_forward: bool = True, mode: str = "24") -> None:
        super().__init__(straight_through=True)
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.recompute_every_forward = bool(recompute_every_forward)
        self.mode = mode

    @property
    def caps(self) -> FormatCaps:
        return FormatCaps(straight_through=True, needs_nm=True, derives_mask=self.recompute_every_forward)

    # ---- construction and topology ----------------------------------------------------------------------
    def setup(self, layer, weight, mask):
        if layer.block != Block(1, 1):
            raise ValueError(f"format '2:4' needs block 1x1 (an element mask), got block {layer.block}")
        if layer.in_features % 4 or layer.out_features % 4:
            raise ValueError(f"format '2:4' needs in_features and out_features divisible by 4, got "
                             f"in_features={layer.in_features}, out_features={layer.out_features}")
        if not self.recompute_every_forward and not bool(mask.all()) and not is_transposable24(mask):
            raise ValueError("mask is not a transposable 2:4 mask (at most 2 kept per row and per column of "
                             "every 4x4 tile)")
        super().setup(layer, weight, mask)
        # An element mask already (block 1x1): the reference path multiplies by ``layer.mask`` itself, so no copy of
        # it in the weight's dtype is kept (MaskedFormat's element-mask buffer: 4 bytes a weight, 0.34 GB at ViT-B)
        del layer._buffers["_element_mask"]
        if self.recompute_every_forward or bool(mask.all()):
            # An all-ones mask is SparseLinear's "none given": start from the weight's own 2:4 mask.
            self.recompute_mask(layer)

    def recompute_mask(self, layer) -> Tensor:
        """Write the transposable 2:4 mask of the current weight into ``layer.mask`` and return it."""
        with torch.no_grad():
            w = layer.weight.detach()
            if kernel_available(w.device) and w.is_cuda:
                transposable24(w, mask_out=layer.mask)
            else:
                layer.mask.copy_(transposable24_reference(w)[0])
        return layer.mask

    def _refresh(self, layer) -> None:
        """Nothing to refresh (MaskedFormat's load and set_mask call it): ``layer.mask`` is the element mask."""

    def element_mask(self, layer) -> Tensor:
        """``layer.mask`` in the weight's dtype, made when asked (the reference path's forward, right after the
        mask was written)."""
        return layer.mask.to(layer.weight.dtype)

    def dense_weight(self, layer) -> Tensor:
        return (layer.weight * self.current_mask(layer).to(layer.weight.dtype)).detach()

    def current_mask(self, layer) -> Tensor:
        """``layer.mask`` as given; a mask derived in every forward: the transposable 2:4 mask of the current
        weight, computed anew (``layer.mask`` holds the last forward's, or, shared, another layer's)."""
        if not self.recompute_every_forward:
            return layer.mask
        w = layer.weight.detach()
        return transposable24_mask_of(w, w.dtype)

    @staticmethod
    def share_masks(layers: dict[str, SparseLinear]) -> int:
        """Give the layers that derive their mask in every forward one ``mask`` buffer per shape and device.

        Such a mask is written and used within its layer's forward (the backward reads the masked weight, not
        the mask), so one buffer serves every layer of a shape, and a compiled step makes each mask a
        temporary of its own memory. ``current_mask`` (what checkpoints, ``density`` and ``dense_weight``
        read) then computes a layer's mask from its weight. ViT-B/16: 85 MB of masks become 5 MB. Returns the
        bytes freed. Call it after the model's last move to a device (``plan_kernels`` does; a DDP wrapper built
        before it still lists the old buffers, which then stay in memory)."""
        groups: dict[tuple, list] = {}
        for layer in layers.values():
            fmt = layer.storage
            if isinstance(fmt, Semi24Format) and fmt.recompute_every_forward and not layer.mask_is_scratch:
                groups.setdefault((tuple(layer.mask.shape), layer.mask.device), []).append(layer)
        freed = 0
        for group in (g for g in groups.values() if len(g) > 1):
            for layer in group[1:]:
                freed += layer.mask.numel() * layer.mask.element_size()
                layer._buffers["mask"] = group[0].mask
            for layer in group:
                layer.mask_is_scratch = True
        return freed

    def set_mask(self, layer, new_mask, optimizer=None):
        if not is_transposable24(new_mask):
            raise ValueError("new_mask is not a transposable 2:4 mask (at most 2 kept per row and per column "
                             "of every 4x4 tile)")
        super().set_mask(layer, new_mask, optimizer)

    # ---- compute ------------------------------------------------------------------------------------------
    def _fast_path(self, layer, x: Tensor) -> bool:
        return x.is_cuda and layer.weight.is_cuda and kernel_available(x.device)

    def forward(self, layer, x):
        if not self._fast_path(layer, x):
            # The masked reference path, exactly MaskedFormat(straight_through=True).
            if self.recompute_every_forward:
                self.recompute_mask(layer)
            return super().forward(layer, x)
        if self.mode == "dense" and not layer.capture_dense_grad and torch.compiler.is_compiling():
            # Masked dense in plain torch ops (the mask kernel a custom op): torch.compile traces it, no graph
            # break, so inductor fuses the casts and the bias-grad reduction around the two cuBLAS products.
            # Eagerly the autograd function stays faster (its one kernel writes the mask and W⊙M in the compute
            # dtype together). A layer whose mask buffer is shared scratch takes its mask as a temporary.
            return semi24_dense_linear(x, layer.weight, layer.bias, None if layer.mask_is_scratch else layer.mask,
                                       recompute=self.recompute_every_forward)
        # sparse modes and dense-gradient capture steps: the eager path (a graph break under torch.compile)
        return _semi24_eager(self, layer, x)

    @classmethod
    def plan_kernels(cls, layers: dict[str, SparseLinear], tokens: int, *, dtype: torch.dtype | None = None,
                     modes: tuple[str, ...] = MODES, margin: float = 0.02, rep_ms: float = 50.0) -> list[dict]:
        """Time 2:4 against masked dense for every distinct layer shape and set each layer's ``mode``.

        ``tokens``: rows of the layer input per step (batch x sequence). ``dtype``: compute dtype (default:
        the weight's if 16-bit, else bfloat16 as under autocast). A sparse mode is chosen only when it beats
        masked dense by more than ``margin``. Returns one record per layer for the run log: name, shape,
        tokens, ms of each mode and of plain ``F.linear``, choice, speedup of the choice over plain
        ``F.linear``, alg ids. Off CUDA nothing is timed and every layer reports the masked reference path.
        Then the layers that derive their mask share one mask buffer per shape (:meth:`share_masks`).
        """
        records = _plan_layers(layers, tokens, dtype, tuple(modes), margin, rep_ms)
        cls.share_masks(layers)
        return records

    def extra_repr(self) -> str:
        return f"2:4, mode={self.mode}" + (", recompute_every_forward" if self.recompute_every_forward else "")


def dense_phase_linear(layer: SparseLinear) -> nn.Module:
    """``layer.dense_phase()``: an ``nn.Linear`` holding the layer's own weight and bias Parameters.

    >>> sl = SparseLinear(8, 4, format="2:4"); lin = dense_phase_linear(sl)  # doctest: +SKIP
    >>> lin.weight is sl.weight  # doctest: +SKIP
    True
    """
    if not isinstance(layer, SparseLayer):
        raise TypeError(f"layer must be a SparseLinear, got {type(layer).__name__}")
    return layer.dense_phase()


# ---- shape-aware dispatch -----------------------------------------------------------------------------
def _time_modes(in_f: int, out_f: int, bias: bool, tokens: int, w_dtype: torch.dtype, dtype: torch.dtype,
                device: torch.device, modes: tuple[str, ...], rep_ms: float) -> dict[str, float]:
    """Median fwd+bwd ms of each mode (mask + compress included) and of plain ``F.linear``, on random data."""
    from triton.testing import do_bench

    w = (torch.randn(out_f, in_f, device=device, dtype=w_dtype) * in_f ** -0.5).requires_grad_()
    b = torch.zeros(out_f, device=device, dtype=w_dtype, requires_grad=True) if bias else None
    x = torch.randn(tokens, in_f, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(tokens, out_f, device=device, dtype=dtype)
    autocast = w_dtype != dtype

    def step(fn):
        def run():
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                y = fn()
            y.backward(dy)
        return run

    fns = {m: step(lambda m=m: semi24_linear(x, w, b, mode=m)) for m in modes}
    fns["linear"] = step(lambda: F.linear(x, w, b))
    grads = [x, w] + ([b] if b is not None else [])
    out = {}
    for name, fn in fns.items():
        fn()  # compile the kernel, pick cuSPARSELt algorithms
        out[name] = do_bench(fn, warmup=5, rep=rep_ms, grad_to_none=grads, return_mode="median")
    return out


def choose_mode(ms: dict[str, float], modes: tuple[str, ...], margin: float) -> str:
    """The dispatch's choice from fwd+bwd ms per mode: the fastest, unless it beats masked dense ("dense") by
    ``margin`` or less.

    >>> choose_mode({"24": 0.99, "24fwd": 1.2, "dense": 1.0}, ("24", "24fwd", "dense"), 0.02)
    'dense'
    """
    best = min(modes, key=lambda m: ms[m])
    return "dense" if best != "dense" and ms[best] > ms["dense"] * (1 - margin) else best


def plan_dispatch(
    model: nn.Module,
    tokens: int,
    *,
    dtype: torch.dtype | None = None,
    modes: tuple[str, ...] = MODES,
    margin: float = 0.02,
    rep_ms: float = 50.0,
) -> list[dict]:
    """Time 2:4 against masked dense for every distinct ``"2:4"`` layer shape of ``model`` and set each
    layer's mode (:meth:`Semi24Format.plan_kernels` on the model's 2:4 layers).

    >>> records = plan_dispatch(model, tokens=64 * 197)  # doctest: +SKIP
    """
    layers = {n: m for n, m in model.named_modules() if isinstance(getattr(m, "storage", None), Semi24Format)}
    return Semi24Format.plan_kernels(layers, tokens, dtype=dtype, modes=modes, margin=margin, rep_ms=rep_ms)


def _plan_layers(layers: dict[str, SparseLinear], tokens: int, dtype: torch.dtype | None,
                 modes: tuple[str, ...], margin: float, rep_ms: float) -> list[dict]:
    """The body of :meth:`Semi24Format.plan_kernels`."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if dtype not in (None, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be None, torch.float16 or torch.bfloat16, got {dtype!r}")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {modes!r}")
    if "dense" not in modes:
        modes = tuple(modes) + ("dense",)
    timed: dict[tuple, dict] = {}
    records = []
    for name, layer in layers.items():
        w = layer.weight
        cdt = dtype or (w.dtype if w.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)
        rec = {"name": name, "shape": (layer.out_features, layer.in_features), "tokens": tokens,
               "dtype": str(cdt).replace("torch.", "")}
        if not (w.is_cuda and kernel_available(w.device)):
            rec.update(choice="masked-reference", note="not on CUDA: nothing timed")
            records.append(rec)
            continue
        key = (layer.in_features, layer.out_features, layer.bias is not None, w.dtype, cdt, w.device)
        if key not in timed:
            ms = _time_modes(layer.in_features, layer.out_features, layer.bias is not None, tokens, w.dtype,
                             cdt, w.device, tuple(modes), rep_ms)
            timed[key] = {"ms": ms, "choice": choose_mode(ms, modes, margin)}
        t = timed[key]
        layer.storage.mode = t["choice"]
        fa = select_alg(layer.out_features, layer.in_features, tokens, cdt, w.device) if t["choice"] != "dense" \
            else None
        da = select_alg(layer.in_features, layer.out_features, tokens, cdt, w.device) if t["choice"] == "24" \
            else None
        rec.update({f"ms_{m}": t["ms"][m] for m in modes})
        rec.update(ms_linear=t["ms"]["linear"], choice=t["choice"],
                   speedup_vs_linear=t["ms"]["linear"] / t["ms"][t["choice"]],
                   alg_fwd=fa.alg_id if fa else None, alg_dx=da.alg_id if da else None)
        records.append(rec)
    return records


__all__ = ["Semi24Format", "alg_table", "choose_mode", "compute_dtype", "dense_phase_linear", "plan_dispatch"]
