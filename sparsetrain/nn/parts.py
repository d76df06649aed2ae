"""A linear whose output the model splits in three at once (a fused query/key/value projection):
:func:`linear_in_parts`.

Split after the product, the three pieces are views of one output, and autograd concatenates their three
gradients into one tensor for the layer's backward: a copy of the whole output gradient, every step. A
block-sparse layer on the kernels (:func:`~sparsetrain.kernels.blocksparse.plans.parts_native`: three pieces of
whole blocks) writes the three outputs as tensors of their own and reads their gradients where attention's
backward wrote them; each product runs on whichever backend that takes pieces the tuner times fastest (CUDA,
Triton gather, or three cuBLAS GEMMs). Anything else runs the layer and splits its output.
"""
from __future__ import annotations

from torch import Tensor, nn

from sparsetrain.kernels.blocksparse.parts import block_sparse_linear_parts, parts_native_for
from sparsetrain.kernels.blocksparse.plans import PARTS
from sparsetrain.nn.formats.block import BlockFormat, runs_block_ops


def linear_in_parts(layer: nn.Module, x: Tensor) -> tuple[Tensor, ...]:
    """``layer(x)`` split in :data:`~sparsetrain.kernels.blocksparse.plans.PARTS` (3) equal pieces along the last
    dimension: the same values either way; the pieces are separate tensors where the block-sparse kernels write
    them so (see the module docstring), views of one output elsewhere."""
    if runs_block_ops(layer):
        meta = BlockFormat.meta(layer)
        if parts_native_for(x, meta):   # (three pieces of whole blocks: out_features divides by PARTS)
            return block_sparse_linear_parts(x, layer.values, meta, layer.bias)
    y = layer(x)
    return y.split(y.shape[-1] // PARTS, dim=-1)


__all__ = ["linear_in_parts"]
