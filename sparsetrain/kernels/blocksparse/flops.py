"""What each block-sparse custom op costs in FLOPs, for torch's ``FlopCounterMode`` (``torch.utils.flop_counter``).

Registered with the ops (:mod:`.op`, :mod:`.parts`, :mod:`.gelu`, :mod:`.probe`): a product with the active blocks
costs ``2 * tokens * active weights`` (the stored values, ``values.numel()``), as ``sparsetrain flops`` counts it.
Two readers: a user's own FLOP counting over a sparse model (an MFU figure), and torch.compile's partitioner under
``trainer.activation_memory_budget`` < 1, which ranks what it may recompute in the backward by these counts: an op
without a formula counts as 1 FLOP, so the block-sparse products looked free to recompute there.
"""
from __future__ import annotations

import math

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula


def _tokens(shape, features: int) -> int:
    return math.prod(shape) // max(features, 1)


def _product(x_shape, values_shape, in_features: int) -> int:
    return 2 * _tokens(x_shape, in_features) * math.prod(values_shape)


def _forward(x_shape, values_shape, bias, *rest, out_shape=None, **kwargs) -> int:
    """``(x, values, bias[, probe], six index tensors, out_features, in_features, block)``: one product."""
    return _product(x_shape, values_shape, rest[-2])


def _gelu_forward(pre_shape, post_shape, values_shape, bias, *rest, out_shape=None, **kwargs) -> int:
    """``block_sparse_gelu_linear`` (and ``_probed``, the probe in ``rest``): the product of gelu(h) (its input
    features are h's)."""
    return _product(post_shape, values_shape, rest[-2])


def _backward(dy_shape, x_shape, values_shape, *rest, out_shape=None, **kwargs) -> int:
    """``(dy, x, values, six index tensors, out, in, block, need_x, need_v, need_b)``: the input gradient and the
    weight gradient, each a product with the active blocks, as asked."""
    in_features, need_x, need_v = rest[7], rest[9], rest[10]
    return (bool(need_x) + bool(need_v)) * _product(x_shape, values_shape, in_features)


def _dense(x_shape, rest) -> int:
    """The dense weight gradient of a probed backward ``(..., x, values, six index tensors, out, in, ...)``:
    ``2 * tokens * out * in``."""
    out_features, in_features = rest[6], rest[7]
    return 2 * _tokens(x_shape, in_features) * out_features * in_features


def _probed_backward(dy_shape, x_shape, values_shape, *rest, out_shape=None, **kwargs) -> int:
    """As :func:`_backward`, plus the dense weight gradient RigL's grow step reads: ``2 * tokens * out * in``."""
    return _backward(dy_shape, x_shape, values_shape, *rest) + _dense(x_shape, rest)


def _gelu_backward(dy_shape, pre_shape, values_shape, *rest, out_shape=None, **kwargs) -> int:
    """``block_sparse_gelu_linear_backward``: the input gradient (GELU's derivative in its store) and the weight
    gradient, always both."""
    return 2 * _product(pre_shape, values_shape, rest[7])


def _gelu_probed_backward(dy_shape, pre_shape, values_shape, *rest, out_shape=None, **kwargs) -> int:
    """``block_sparse_gelu_linear_probed_backward``: as :func:`_gelu_backward`, plus the dense weight gradient."""
    return _gelu_backward(dy_shape, pre_shape, values_shape, *rest) + _dense(pre_shape, rest)


def register() -> None:
    """Register the formulas (once: a second call leaves them as they are)."""
    from sparsetrain.kernels.blocksparse import gelu, parts, probe  # noqa: F401  (they define the ops)

    ops = torch.ops.sparsetrain
    formulas = {ops.block_sparse_linear: _forward, ops.block_sparse_linear_parts: _forward,
                ops.block_sparse_linear_gelu: _forward, ops.block_sparse_gelu_linear: _gelu_forward,
                ops.block_sparse_linear_probed: _forward, ops.block_sparse_linear_gelu_probed: _forward,
                ops.block_sparse_gelu_linear_probed: _gelu_forward,
                ops.block_sparse_linear_backward: _backward, ops.block_sparse_linear_parts_backward: _backward,
                ops.block_sparse_gelu_linear_backward: _gelu_backward,
                ops.block_sparse_linear_probed_backward: _probed_backward,
                ops.block_sparse_gelu_linear_probed_backward: _gelu_probed_backward}
    for op, formula in formulas.items():
        if op not in flop_registry:
            register_flop_formula(op)(formula)
