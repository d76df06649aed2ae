"""The feed-forward block ``fc2(gelu(fc1(x)))`` (exact GELU): :func:`gelu_mlp`, with GELU recomputed in the
backward where both linears are block-sparse and ``trainer.kernels.gelu_recompute`` is on.

Unfused, the step keeps GELU's input ``h`` and its output ``gelu(h)`` for the backward: two ``[tokens, 4H]``
tensors per layer. With ``gelu_recompute`` (both linears :class:`~sparsetrain.nn.SparseLinear` in the ``block``
format, on the kernels: CUDA or the Triton interpreter) only ``h`` is kept: ``fc1``'s product stores ``h`` and
``gelu(h)``, and ``fc2``'s input gradient returns the gradient of ``h`` and ``gelu(h)`` again for its weight
gradient (:mod:`sparsetrain.kernels.blocksparse.gelu`; in the kernels' epilogues or in a pass of their own,
whichever the tuner times faster). Same outputs and gradients up to float rounding; BERT-base at 256 x 128
tokens holds ~2 GB less, for a few percent of step time (docs/benchmarks/e2e.md). RigL's grow step, which captures
each linear's dense weight gradient through its probe (:mod:`sparsetrain.kernels.blocksparse.probe`), takes the
fused ops' probed twins. Anything else (dense linears, another format, the plain-torch reference path, a capture
without a probe (the Python hook path), a module hook on either linear, the option off) runs the plain modules.

The BERT and ViT models that :mod:`sparsetrain.models` builds call this from their feed-forward blocks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparsetrain.kernels._runtime.options import IN_FORCE
from sparsetrain.kernels.blocksparse.op import _autocast_dtype, uses_kernels
from sparsetrain.nn.formats.block import BlockFormat, block_ops_probe, runs_block_ops


def fusable(x: Tensor, fc1: nn.Module, fc2: nn.Module) -> bool:
    """Whether :func:`gelu_mlp` takes the fused ops for this input (the kernels take ``x`` in float32 as well as
    in the 16-bit dtype autocast casts it to, so the answer is the same before the cast)."""
    if not (IN_FORCE[0].gelu_recompute and runs_block_ops(fc1, probed=True) and runs_block_ops(fc2, probed=True)):
        return False
    m1, m2 = BlockFormat.meta(fc1), BlockFormat.meta(fc2)
    if m1.out_features != m2.in_features or x.shape[-1] != m1.in_features or x.numel() == 0:
        return False
    return uses_kernels(x, m1) and uses_kernels(x, m2) and not torch._C._are_functorch_transforms_active()


def gelu_mlp(x: Tensor, fc1: nn.Module, fc2: nn.Module) -> Tensor:
    """``fc2(gelu(fc1(x)))`` with the exact GELU; GELU recomputed in the backward where :func:`fusable`."""
    return fused_gelu_mlp(x, fc1, fc2) if fusable(x, fc1, fc2) else fc2(F.gelu(fc1(x)))


def fused_gelu_mlp(x: Tensor, fc1: nn.Module, fc2: nn.Module) -> Tensor:
    """:func:`gelu_mlp` on the fused ops, for a block that is :func:`fusable` (``x`` cast as autocast casts a
    linear's input); a linear that captures the dense gradient passes its probe."""
    from sparsetrain.kernels.blocksparse.gelu import block_sparse_gelu_linear, block_sparse_linear_gelu

    cast = _autocast_dtype(x.device.type)
    if cast is not None and x.dtype != cast:
        x = x.to(cast)
    m1, m2 = BlockFormat.meta(fc1), BlockFormat.meta(fc2)
    pre, post = block_sparse_linear_gelu(x.contiguous(), fc1.values, m1, fc1.bias, block_ops_probe(fc1))
    return block_sparse_gelu_linear(pre, post, fc2.values, m2, fc2.bias, block_ops_probe(fc2))


__all__ = ["fusable", "fused_gelu_mlp", "gelu_mlp"]
