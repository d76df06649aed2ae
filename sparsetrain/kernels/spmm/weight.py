"""What the compressed inference weights share: :class:`CompressedWeight` (shape, stored tensors, decode to
dense, checkpoint round trip) and the ``128 x 64`` tile grid every format cuts ``W [M, K]`` into.
"""
from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor

TILE_M, TILE_K = 128, 64  # rows x columns of W per tile (the CUDA kernels' block tile)


class CompressedWeight:
    """What the compressed inference weights share: a ``shape``, ``values`` and named ``tensors()`` that
    ``from_tensors`` turns back into the weight."""

    shape: tuple[int, int]
    values: Tensor

    @property
    def nnz(self) -> int:
        return self.values.numel()

    @property
    def sparsity(self) -> float:
        """Fraction of exact zeros in the ``M x K`` weight."""
        m, k = self.shape
        return 1.0 - self.nnz / max(m * k, 1)

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    TENSORS: ClassVar[tuple[str, ...]] = ()  # the stored tensors' field names, in constructor order

    def tensors(self) -> dict[str, Tensor]:
        """The stored tensors by name (what a checkpoint saves); see :meth:`from_tensors`."""
        return {name: getattr(self, name) for name in self.TENSORS}

    @classmethod
    def from_tensors(cls, tensors: dict[str, Tensor], shape: tuple[int, int]):
        """Inverse of :meth:`tensors`."""
        return cls(**{name: tensors[name] for name in cls.TENSORS}, shape=(int(shape[0]), int(shape[1])),
                   **cls._derived(tensors))

    @classmethod
    def _derived(cls, tensors: dict[str, Tensor]) -> dict:
        """Constructor fields read off the stored tensors (e.g. the tile height), if a format has any."""
        return {}

    def nbytes(self) -> int:
        """Bytes of all stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str):
        return type(self).from_tensors({name: t.to(device) for name, t in self.tensors().items()}, self.shape)

    def to_dense(self, use_kernel: bool | None = None) -> Tensor:
        """The exact ``[M, K]`` weight: the format's Triton decode kernel (default on CUDA; what prefill calls,
        more than 64 tokens) or plain torch ops."""
        if use_kernel is None:
            use_kernel = self.values.is_cuda
        if not use_kernel:
            return self._to_dense_torch()
        out = torch.empty(*self.shape, dtype=self.dtype, device=self.device)
        self._decode_into(out)
        return out

    def _to_dense_torch(self) -> Tensor:  # pragma: no cover - every format defines it
        raise NotImplementedError

    def _decode_into(self, out: Tensor) -> None:  # pragma: no cover - every format defines it
        """Launch the format's Triton decode kernel writing every element of ``out [M, K]``."""
        raise NotImplementedError



def padded_tiles(weight: Tensor) -> tuple[Tensor, int, int]:
    """Checks a weight to compress (2-D, fp16/bf16/fp32) and zero-pads it to whole ``128 x 64`` tiles:
    ``(padded [TM*128, TK*64], TM, TK)`` (detached)."""
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"weight must be a 2-D tensor [M, K], got {type(weight).__name__} "
                         f"{tuple(getattr(weight, 'shape', ()))}")
    if weight.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"weight dtype must be float16, bfloat16 or float32, got {weight.dtype}")
    m, k = weight.shape
    tm, tk = math.ceil(m / TILE_M), math.ceil(k / TILE_K)
    padded = weight.new_zeros(tm * TILE_M, tk * TILE_K)
    padded[:m, :k] = weight.detach()
    return padded, tm, tk

