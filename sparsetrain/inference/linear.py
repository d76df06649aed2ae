"""SparseInferenceLinear: ``nn.Linear`` for inference with its weight stored compressed (or dense below the
measured break-even sparsity); the compressed tensors are buffers, so they move with ``.to()`` and live in the
state dict.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparsetrain.kernels.spmm import (
    BREAK_EVEN_SPARSITY,
    FORMATS,
    CompressedWeight,
    CslWeight,
    PairWeight,
    SparseInferenceWeight,
    compress,
    max_tile_len,
    spmm_infer,
)

MODES = ("auto", "compressed", "dense")
# The compressed weight classes by format name (what a layer's ``fmt`` and a checkpoint's index record).
WEIGHT_CLASSES = {"bitmap": SparseInferenceWeight, "csl": CslWeight, "pair": PairWeight}


def weight_sparsity(weight: Tensor) -> float:
    """Fraction of exact zeros. Example: ``weight_sparsity(torch.tensor([[0., 1.]]))`` is 0.5."""
    return float((weight == 0).sum()) / max(weight.numel(), 1)


class SparseInferenceLinear(nn.Module):
    """``nn.Linear`` for inference with its weight stored compressed (or dense below break-even).

    The compressed tensors are buffers (they move with ``.to()`` / ``.half()`` and live in the state dict).
    Example: ``layer = SparseInferenceLinear.from_linear(pruned_linear); y = layer(x)``.
    """

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None = None,
                 compressed: CompressedWeight | None = None, dense_weight: Tensor | None = None):
        super().__init__()
        if (compressed is None) == (dense_weight is None):
            raise ValueError("give exactly one of compressed and dense_weight")
        self.in_features, self.out_features = in_features, out_features
        self.block_m = compressed.block_m if compressed is not None else 0
        self.fmt = compressed.fmt if compressed is not None else "dense"
        if compressed is not None:
            if compressed.shape != (out_features, in_features):
                raise ValueError(f"compressed weight has shape {compressed.shape}, "
                                 f"expected {(out_features, in_features)}")
            for name, t in compressed.tensors().items():
                self.register_buffer(name, t)
            self.dense_weight = None
            # The kernels size shared memory by the longest tile: computed once here (one sync), not per call.
            self._max_tile_len = max_tile_len(compressed)
        else:
            self.register_buffer("dense_weight", dense_weight)
        self.register_buffer("bias", bias)

    @property
    def is_compressed(self) -> bool:
        return self.dense_weight is None

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if self.is_compressed:  # new tile offsets may have a different longest tile
            self.__dict__.pop("_cw", None)
            self._max_tile_len = None
            self._max_tile_len = max_tile_len(self.compressed_weight())

    def compressed_weight(self) -> CompressedWeight:
        """The compressed weight as a kernel argument; a view of this module's buffers, rebuilt only when
        they are replaced (``.to()``, ``.half()``, ``load_state_dict``)."""
        bufs = tuple(getattr(self, name) for name in WEIGHT_CLASSES[self.fmt].TENSORS)
        cached = self.__dict__.get("_cw")
        if cached is not None and all(a is b for a, b in zip(cached[0], bufs)):
            return cached[1]
        shape = (self.out_features, self.in_features)
        w = WEIGHT_CLASSES[self.fmt].from_tensors(dict(zip(WEIGHT_CLASSES[self.fmt].TENSORS, bufs)), shape)
        if self._max_tile_len is not None:
            w._max_tile_len = self._max_tile_len
        self.__dict__["_cw"] = (bufs, w)
        return w

    @classmethod
    def from_linear(cls, linear: nn.Linear, min_sparsity: float = 0.5, block_m: int = 128,
                    mode: str = "auto", fmt: str = "auto") -> SparseInferenceLinear:
        """Wraps ``linear``; its weight is compressed when its sparsity >= ``min_sparsity`` and

        - ``mode="auto"``: also >= ``BREAK_EVEN_SPARSITY`` (measured: below it cuBLAS on the dense weight is
          faster, so the dense weight is kept);
        - ``mode="compressed"``: always (2.5-6x smaller weights; for N <= 16 tokens on an H200 0.8-1.1x of cuBLAS
          with the bitmap/CSL formats, 1.2-1.6x with ``fmt="pair"`` at 90% sparsity: docs/history/inference.md);
        - ``mode="dense"``: never.

        ``fmt``: the compressed format, "bitmap", "csl", "pair" (more bytes, faster decode) or "auto" (the one of
        bitmap and CSL with fewer bytes; see ``compress``).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if not 0.0 <= min_sparsity <= 1.0:
            raise ValueError(f"min_sparsity must be in [0, 1], got {min_sparsity}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        auto = max(min_sparsity, BREAK_EVEN_SPARSITY)
        threshold = {"auto": auto, "compressed": min_sparsity, "dense": 2.0}[mode]
        if weight_sparsity(weight) >= threshold:
            return cls(linear.in_features, linear.out_features, bias,
                       compressed=compress(weight, block_m=block_m, fmt=fmt))
        return cls(linear.in_features, linear.out_features, bias, dense_weight=weight.clone())

    def forward(self, x: Tensor) -> Tensor:
        if self.is_compressed:
            return spmm_infer(x, self.compressed_weight(), self.bias)
        return F.linear(x, self.dense_weight, self.bias)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the dense weight (zeros included)."""
        weight = self.compressed_weight().to_dense() if self.is_compressed else self.dense_weight
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        if not self.is_compressed:
            return f"in_features={self.in_features}, out_features={self.out_features}, dense"
        w = self.compressed_weight()
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"sparsity={w.sparsity:.3f}, format={self.fmt}, bytes={w.nbytes()}")
