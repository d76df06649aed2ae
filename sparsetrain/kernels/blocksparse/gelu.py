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
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsetrain.kernels.blocksparse.epilogue import DGELU, GELU
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.op import _as_operand, _bs_backward, _bs_setup_context, op_weight_grads
from sparsetrain.kernels.blocksparse.plans import dds as _dds
from sparsetrain.kernels.blocksparse.plans import dds_epilogue
from sparsetrain.kernels.blocksparse.registry import _meta_for, op_meta_args


@torch.library.custom_op("sparsetrain::block_sparse_linear_gelu", mutates_args=())
def _linear_gelu_op(x: Tensor, values: Tensor, bias: Tensor | None, row_ptr: Tensor, col_idx: Tensor,
                    row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
                    in_features: int, block: int) -> tuple[Tensor, Tensor]:
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    shape = (*x.shape[:-1], out_features)
    pre, post = dds_epilogue(x.reshape(-1, in_features), _as_operand(values, x), meta, bias, True, GELU)
    return pre.view(shape), post.view(shape)


@_linear_gelu_op.register_fake
def _(x, values, bias, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block):
    return x.new_empty(*x.shape[:-1], out_features), x.new_empty(*x.shape[:-1], out_features)


def _linear_gelu_setup(ctx, inputs, output):
    _bs_setup_context(ctx, inputs, output)
    ctx.mark_non_differentiable(output[1])


def _linear_gelu_backward(ctx, d_pre, d_post):
    # gelu(h) is not differentiable here: its consumer (block_sparse_gelu_linear) returns dL/dh itself
    return _bs_backward(ctx, d_pre)


_linear_gelu_op.register_autograd(_linear_gelu_backward, setup_context=_linear_gelu_setup)


@torch.library.custom_op("sparsetrain::block_sparse_gelu_linear", mutates_args=())
def _gelu_linear_op(pre: Tensor, post: Tensor, values: Tensor, bias: Tensor | None, row_ptr: Tensor,
                    col_idx: Tensor, row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor,
                    out_features: int, in_features: int, block: int) -> Tensor:
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    y = _dds(post.reshape(-1, in_features), _as_operand(values, post), meta, bias, forward=True)
    return y.view(*post.shape[:-1], out_features)


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
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    shape = pre.shape
    dy, pre = dy.reshape(-1, out_features).contiguous(), pre.reshape(-1, in_features).contiguous()
    d_pre, post = dds_epilogue(dy, _as_operand(values, dy), meta, None, False, DGELU, pre)
    dv, db = op_weight_grads(post, dy, values, meta, need_b)
    return d_pre.view(shape), dv, db


@_gelu_linear_backward_op.register_fake
def _(dy, pre, values, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block,
      need_b):
    db = dy.new_empty(out_features if need_b else 0, dtype=torch.float32)
    return pre.new_empty(pre.shape), values.new_empty(values.shape), db


def _gelu_linear_setup(ctx, inputs, output):
    pre, _post, values, bias, *tensors = inputs[:10]
    ctx.save_for_backward(pre, values, *tensors)
    ctx.ints = inputs[10:]
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _gelu_linear_backward(ctx, dy):
    pre, values, *tensors = ctx.saved_tensors
    need_b = ctx.needs_input_grad[3]
    d_pre, dv, db = torch.ops.sparsetrain.block_sparse_gelu_linear_backward(dy, pre, values, *tensors, *ctx.ints,
                                                                            need_b)
    return (d_pre, None, dv, db.to(ctx.bias_dtype) if need_b else None, *([None] * 9))


_gelu_linear_op.register_autograd(_gelu_linear_backward, setup_context=_gelu_linear_setup)


def block_sparse_linear_gelu(x: Tensor, values: Tensor, meta: BlockSparseMeta,
                             bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(h, gelu(h))`` with ``h = x · W_effᵀ + bias`` (x [..., I], contiguous; the kernel path only). ``gelu(h)``
    carries no gradient: pass both to :func:`block_sparse_gelu_linear`."""
    return torch.ops.sparsetrain.block_sparse_linear_gelu(x, values.contiguous(), bias, *op_meta_args(meta))


def block_sparse_gelu_linear(pre: Tensor, post: Tensor, values: Tensor, meta: BlockSparseMeta,
                             bias: Tensor | None) -> Tensor:
    """``gelu(h) · W_effᵀ + bias`` given ``h`` (``pre``) and ``gelu(h)`` (``post``) from
    :func:`block_sparse_linear_gelu`; the gradient goes to ``h``."""
    return torch.ops.sparsetrain.block_sparse_gelu_linear(pre, post, values.contiguous(), bias, *op_meta_args(meta))


__all__ = ["block_sparse_gelu_linear", "block_sparse_linear_gelu"]
