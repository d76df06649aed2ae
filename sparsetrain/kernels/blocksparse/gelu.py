"""A feed-forward block's two block-sparse linears with the exact GELU between them, recomputed in the backward
instead of kept: ``y = gelu(x·W1ᵀ + b1)·W2ᵀ + b2`` as two ``torch.library`` ops.

- :func:`block_sparse_linear_gelu`: the first linear; it stores ``h = x·W1ᵀ + b1`` and ``gelu(h)`` (the
  :data:`~.epilogue.GELU` epilogue). Its gradient is the plain linear's, taken with respect to ``h``.
- :func:`block_sparse_gelu_linear`: the second linear, given ``h`` and ``gelu(h)``: the forward multiplies
  ``gelu(h)`` and keeps only ``h``; the backward's input-gradient product returns ``dL/dh = (dY·W2) * gelu'(h)``
  and ``gelu(h)`` again for the weight gradient (:data:`~.epilogue.DGELU`).

Each epilogue runs in the product's kernel or as a pass of its own after it, whichever the tuner times faster
(:func:`.plans.dds_epilogue`). Both ops run the kernels only (no reference path): :mod:`sparsetrain.nn.mlp`
takes them where every layer involved runs on the kernels.

RigL's grow step (:mod:`.probe`) takes the ``_probed`` twin of each op (a ``probe`` argument to the functions
below): the same forward; the backward also gives the probe the dense float32 weight gradient, ``dL/dhᵀ·x`` for
the first linear and ``dYᵀ·gelu(h)`` for the second (on the ``gelu(h)`` its input gradient recomputed), and
gathers the block gradient from it (:func:`.probe.grads_with_dense`).
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsetrain.kernels.blocksparse.epilogue import DGELU, GELU
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.op import _as_operand, _bs_backward, _bs_setup_context, op_weight_grads
from sparsetrain.kernels.blocksparse.plans import dds as _dds
from sparsetrain.kernels.blocksparse.plans import dds_epilogue
from sparsetrain.kernels.blocksparse.probe import _backward as _probed_backward
from sparsetrain.kernels.blocksparse.probe import _setup_context as _probed_setup
from sparsetrain.kernels.blocksparse.probe import grads_with_dense
from sparsetrain.kernels.blocksparse.registry import _meta_for, op_meta_args


def _linear_gelu(x: Tensor, values: Tensor, bias: Tensor | None, tensors: tuple, out_features: int,
                 in_features: int, block: int) -> tuple[Tensor, Tensor]:
    """The first linear's forward, probed or not: ``(h, gelu(h))``."""
    meta = _meta_for(tensors, out_features, in_features, block)
    shape = (*x.shape[:-1], out_features)
    pre, post = dds_epilogue(x.reshape(-1, in_features), _as_operand(values, x), meta, bias, True, GELU)
    return pre.view(shape), post.view(shape)


def _gelu_linear(post: Tensor, values: Tensor, bias: Tensor | None, tensors: tuple, out_features: int,
                 in_features: int, block: int) -> Tensor:
    """The second linear's forward, probed or not: ``gelu(h) · W_effᵀ + bias``."""
    meta = _meta_for(tensors, out_features, in_features, block)
    y = _dds(post.reshape(-1, in_features), _as_operand(values, post), meta, bias, forward=True)
    return y.view(*post.shape[:-1], out_features)


def _gelu_input_grad(dy: Tensor, pre: Tensor, values: Tensor, tensors: tuple, out_features: int,
                     in_features: int, block: int) -> tuple[BlockSparseMeta, Tensor, Tensor, Tensor]:
    """The second linear's input-gradient launch with the GELU-derivative epilogue: ``(meta, dY [T, O], dL/dh
    [T, I], gelu(h) [T, I])``."""
    meta = _meta_for(tensors, out_features, in_features, block)
    dy, pre = dy.reshape(-1, out_features).contiguous(), pre.reshape(-1, in_features).contiguous()
    d_pre, post = dds_epilogue(dy, _as_operand(values, dy), meta, None, False, DGELU, pre)
    return meta, dy, d_pre, post


@torch.library.custom_op("sparsetrain::block_sparse_linear_gelu", mutates_args=())
def _linear_gelu_op(x: Tensor, values: Tensor, bias: Tensor | None, row_ptr: Tensor, col_idx: Tensor,
                    row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
                    in_features: int, block: int) -> tuple[Tensor, Tensor]:
    return _linear_gelu(x, values, bias, (row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features,
                        in_features, block)


@_linear_gelu_op.register_fake
def _(x, values, bias, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block):
    return _pair_like(x, out_features)


def _pair_like(x: Tensor, out_features: int) -> tuple[Tensor, Tensor]:
    """A first-linear op's fake outputs: ``h`` and ``gelu(h)``, ``[..., out_features]``."""
    return x.new_empty(*x.shape[:-1], out_features), x.new_empty(*x.shape[:-1], out_features)


def _with_gelu_output(op, setup, backward) -> None:
    """Registers the autograd of a first-linear ``op`` ``(h, gelu(h))`` whose linear has ``setup`` and
    ``backward``: ``gelu(h)`` is not differentiable here (its consumer, block_sparse_gelu_linear, returns dL/dh
    itself), so the gradient is the linear's with respect to ``h``."""
    def setup_context(ctx, inputs, output):
        setup(ctx, inputs, output)
        ctx.mark_non_differentiable(output[1])

    def grad(ctx, d_pre, d_post):
        return backward(ctx, d_pre)

    op.register_autograd(grad, setup_context=setup_context)


_with_gelu_output(_linear_gelu_op, _bs_setup_context, _bs_backward)


@torch.library.custom_op("sparsetrain::block_sparse_gelu_linear", mutates_args=())
def _gelu_linear_op(pre: Tensor, post: Tensor, values: Tensor, bias: Tensor | None, row_ptr: Tensor,
                    col_idx: Tensor, row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor,
                    out_features: int, in_features: int, block: int) -> Tensor:
    return _gelu_linear(post, values, bias, (row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features,
                        in_features, block)


@_gelu_linear_op.register_fake
def _(pre, post, values, bias, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features,
      block):
    return post.new_empty(*post.shape[:-1], out_features)


@torch.library.custom_op("sparsetrain::block_sparse_gelu_linear_backward", mutates_args=())
def _gelu_linear_backward_op(dy: Tensor, pre: Tensor, values: Tensor, row_ptr: Tensor, col_idx: Tensor,
                             row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
                             in_features: int, block: int, need_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dL/dh, dvalues, dbias float32 or empty): one input-gradient launch with the GELU-derivative epilogue, then
    the weight gradient on the gelu(h) it wrote."""
    meta, dy, d_pre, post = _gelu_input_grad(dy, pre, values, (row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot),
                                             out_features, in_features, block)
    dv, db = op_weight_grads(post, dy, values, meta, need_b)
    return d_pre.view(pre.shape), dv, db


@_gelu_linear_backward_op.register_fake
def _(dy, pre, values, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block,
      need_b):
    db = dy.new_empty(out_features if need_b else 0, dtype=torch.float32)
    return pre.new_empty(pre.shape), values.new_empty(values.shape), db


def _gelu_linear_setup(ctx, inputs, output):
    """Both ops': ``(pre, post, values, bias[, probe], six index tensors, out, in, block)``."""
    ctx.probed = len(inputs) == 14
    pre, _post, values, bias = inputs[:4]
    ctx.save_for_backward(pre, values, *inputs[4 + ctx.probed:10 + ctx.probed])
    ctx.ints = inputs[10 + ctx.probed:]
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _gelu_linear_backward(ctx, dy):
    pre, values, *tensors = ctx.saved_tensors
    need_b = ctx.needs_input_grad[3]
    ops = torch.ops.sparsetrain
    op = ops.block_sparse_gelu_linear_probed_backward if ctx.probed else ops.block_sparse_gelu_linear_backward
    d_pre, dv, db, *dense = op(dy, pre, values, *tensors, *ctx.ints, need_b)   # dense: the probe's gradient
    return (d_pre, None, dv, db.to(ctx.bias_dtype) if need_b else None, *dense, *([None] * 9))


_gelu_linear_op.register_autograd(_gelu_linear_backward, setup_context=_gelu_linear_setup)


# ---- RigL's grow step: the same ops with a probe (probe.py), whose gradient is the dense weight gradient ------
@torch.library.custom_op("sparsetrain::block_sparse_linear_gelu_probed", mutates_args=())
def _linear_gelu_probed_op(x: Tensor, values: Tensor, bias: Tensor | None, probe: Tensor, row_ptr: Tensor,
                           col_idx: Tensor, row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor,
                           out_features: int, in_features: int, block: int) -> tuple[Tensor, Tensor]:
    return _linear_gelu(x, values, bias, (row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features,
                        in_features, block)


@_linear_gelu_probed_op.register_fake
def _(x, values, bias, probe, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features,
      block):
    return _pair_like(x, out_features)


# the probed linear's gradient with respect to h (block_sparse_linear_probed_backward): dx, dvalues, dbias and the
# probe's dense dW = dL/dhᵀ·x
_with_gelu_output(_linear_gelu_probed_op, _probed_setup, _probed_backward)


@torch.library.custom_op("sparsetrain::block_sparse_gelu_linear_probed", mutates_args=())
def _gelu_linear_probed_op(pre: Tensor, post: Tensor, values: Tensor, bias: Tensor | None, probe: Tensor,
                           row_ptr: Tensor, col_idx: Tensor, row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor,
                           t_slot: Tensor, out_features: int, in_features: int, block: int) -> Tensor:
    return _gelu_linear(post, values, bias, (row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features,
                        in_features, block)


@_gelu_linear_probed_op.register_fake
def _(pre, post, values, bias, probe, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features,
      in_features, block):
    return post.new_empty(*post.shape[:-1], out_features)


@torch.library.custom_op("sparsetrain::block_sparse_gelu_linear_probed_backward", mutates_args=())
def _gelu_linear_probed_backward_op(dy: Tensor, pre: Tensor, values: Tensor, row_ptr: Tensor, col_idx: Tensor,
                                    row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor,
                                    out_features: int, in_features: int, block: int,
                                    need_b: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dL/dh, dvalues, dbias float32 or empty, dense dW float32): the input gradient as the unprobed op's, then
    one dense ``dYᵀ·gelu(h)`` on the gelu(h) it wrote; the block gradient gathered from that."""
    meta, dy2, d_pre, post = _gelu_input_grad(dy, pre, values, (row_ptr, col_idx, row_idx, col_ptr, t_row_idx,
                                                                t_slot), out_features, in_features, block)
    _, dv, db, dense = grads_with_dense(post, values, dy2, meta, False, True, need_b, values.dtype)
    return d_pre.view(pre.shape), dv, db if need_b else dy.new_empty(0, dtype=torch.float32), dense


@_gelu_linear_probed_backward_op.register_fake
def _(dy, pre, values, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block,
      need_b):
    db = dy.new_empty(out_features if need_b else 0, dtype=torch.float32)
    dense = dy.new_empty(out_features, in_features, dtype=torch.float32)
    return pre.new_empty(pre.shape), values.new_empty(values.shape), db, dense


_gelu_linear_probed_op.register_autograd(_gelu_linear_backward, setup_context=_gelu_linear_setup)


def block_sparse_linear_gelu(x: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None,
                             probe: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(h, gelu(h))`` with ``h = x · W_effᵀ + bias`` (x [..., I], contiguous; the kernel path only). ``gelu(h)``
    carries no gradient: pass both to :func:`block_sparse_gelu_linear`. ``probe`` (:func:`.probe.new_probe`):
    its gradient is the dense ``dL/dW``."""
    if probe is None:
        return torch.ops.sparsetrain.block_sparse_linear_gelu(x, values.contiguous(), bias, *op_meta_args(meta))
    return torch.ops.sparsetrain.block_sparse_linear_gelu_probed(x, values.contiguous(), bias, probe,
                                                                 *op_meta_args(meta))


def block_sparse_gelu_linear(pre: Tensor, post: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None,
                             probe: Tensor | None = None) -> Tensor:
    """``gelu(h) · W_effᵀ + bias`` given ``h`` (``pre``) and ``gelu(h)`` (``post``) from
    :func:`block_sparse_linear_gelu`; the gradient goes to ``h``. ``probe``: as there."""
    if probe is None:
        return torch.ops.sparsetrain.block_sparse_gelu_linear(pre, post, values.contiguous(), bias,
                                                              *op_meta_args(meta))
    return torch.ops.sparsetrain.block_sparse_gelu_linear_probed(pre, post, values.contiguous(), bias, probe,
                                                                 *op_meta_args(meta))


__all__ = ["block_sparse_gelu_linear", "block_sparse_linear_gelu"]
