"""A block-sparse layer whose output is three tensors (a fused query/key/value projection):
:func:`block_sparse_linear_parts`, its autograd function and its ``torch.library`` custom ops
(``sparsetrain::block_sparse_linear_parts`` and its backward), on the pieces' products of :mod:`.plans`.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.op import (
    _as_operand,
    _autocast_dtype,
    _bs_setup_context,
    _check,
    _functorch_active,
    _not_aliasing,
    block_sparse_linear,
    uses_kernels,
)
from sparsetrain.kernels.blocksparse.plans import (
    PARTS,
    dds_parts_dx,
    dds_parts_forward,
    parts_native,
    sampled_grad_parts,
)
from sparsetrain.kernels.blocksparse.registry import _meta_for, op_meta_args


class BlockSparseLinearPartsFn(torch.autograd.Function):
    """:class:`~.op.BlockSparseLinearFn` with the output as :data:`~.plans.PARTS` tensors (``plans.dds_parts_forward``)
    and their gradients read in place (``plans.dds_parts_dx``, ``plans.sampled_grad_parts``): no concatenation of
    the pieces' gradients in the backward."""

    @staticmethod
    def forward(ctx, x2d: Tensor, values: Tensor, bias: Tensor | None, meta: BlockSparseMeta):
        ctx.values_dtype = values.dtype
        values = _as_operand(values, x2d).contiguous()
        ctx.save_for_backward(x2d, values)
        ctx.meta, ctx.bias_dtype = meta, (bias.dtype if bias is not None else None)
        return tuple(dds_parts_forward(x2d, values, meta, bias))

    @staticmethod
    def backward(ctx, *dys: Tensor):
        x2d, values = ctx.saved_tensors
        dx, dv, db = _parts_backward(x2d, values, dys, ctx.meta, *ctx.needs_input_grad[:3])
        if dv is not None and dv.dtype != ctx.values_dtype:
            dv = dv.to(ctx.values_dtype)
        return dx, dv, (db.to(ctx.bias_dtype) if db is not None else None), None


def _pieces(dys, width: int, like: Tensor) -> list[Tensor]:
    """The pieces' gradients as [T, width] tensors of one row stride, unit column stride (zeros for a piece
    autograd gave none: an output not used)."""
    out = [torch.zeros(like.shape[0], width, dtype=like.dtype, device=like.device) if d is None
           else d.reshape(-1, width) for d in dys]
    if any(d.stride() != (width, 1) for d in out):
        out = [d.contiguous() for d in out]
    return out


def _parts_backward(x2d: Tensor, values: Tensor, dys, meta: BlockSparseMeta, need_x: bool, need_v: bool,
                    need_b: bool) -> tuple:
    """``(dx, dvalues, dbias float32)`` of a three-piece layer; None where not asked for."""
    width = meta.out_features // PARTS
    dys = _pieces(dys, width, next(d for d in dys if d is not None))
    dx = dds_parts_dx(dys, values, meta) if need_x else None
    dv = db = None
    if need_v:
        dv, db = sampled_grad_parts(x2d, dys, meta, with_bias=need_b, out_dtype=torch.float32)
    if need_b and db is None:
        db = torch.cat([d.sum(0, dtype=torch.float32) for d in dys])
    return dx, dv, db


@torch.library.custom_op("sparsetrain::block_sparse_linear_parts", mutates_args=())
def _bs_parts_op(x: Tensor, values: Tensor, bias: Tensor | None, row_ptr: Tensor, col_idx: Tensor,
                 row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
                 in_features: int, block: int) -> list[Tensor]:
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    outs = dds_parts_forward(x.reshape(-1, in_features), _as_operand(values, x).contiguous(), meta, bias)
    return [o.view(*x.shape[:-1], out_features // PARTS) for o in outs]


@_bs_parts_op.register_fake
def _(x, values, bias, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block):
    return [x.new_empty(*x.shape[:-1], out_features // PARTS) for _ in range(PARTS)]


@torch.library.custom_op("sparsetrain::block_sparse_linear_parts_backward", mutates_args=())
def _bs_parts_backward_op(dys: list[Tensor], x: Tensor, values: Tensor, row_ptr: Tensor, col_idx: Tensor,
                          row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
                          in_features: int, block: int, need_x: bool, need_v: bool,
                          need_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dvalues, dbias float32) of :func:`_bs_parts_op`; a gradient not asked for comes back empty."""
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    lead = dys[0].shape[:-1]
    x2d = x.reshape(-1, in_features)
    dx, dv, db = _parts_backward(x2d, _as_operand(values, x).contiguous(), dys, meta, need_x, need_v, need_b)
    dx = dx.view(*lead, in_features) if need_x else x.new_empty(0)
    dv = dv.to(values.dtype) if need_v else values.new_empty(0)
    if not need_b:
        db = x.new_empty(0, dtype=torch.float32)
    elif need_v:
        db = _not_aliasing(db, dv)
    return dx, dv, db


@_bs_parts_backward_op.register_fake
def _(dys, x, values, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block,
      need_x, need_v, need_b):
    dx = x.new_empty(*dys[0].shape[:-1], in_features) if need_x else x.new_empty(0)
    dv = values.new_empty(values.shape) if need_v else values.new_empty(0)
    db = x.new_empty(out_features, dtype=torch.float32) if need_b else x.new_empty(0, dtype=torch.float32)
    return dx, dv, db


def _bs_parts_backward(ctx, dys):
    x, values, *tensors = ctx.saved_tensors
    need_x, need_v, need_b = ctx.needs_input_grad[:3]
    like = next(d for d in dys if d is not None)
    dys = [torch.zeros_like(like) if d is None else d for d in dys]
    dx, dv, db = torch.ops.sparsetrain.block_sparse_linear_parts_backward(
        dys, x, values, *tensors, *ctx.ints, need_x, need_v, need_b)
    return (dx if need_x else None, dv if need_v else None, db.to(ctx.bias_dtype) if need_b else None,
            None, None, None, None, None, None, None, None, None)


_bs_parts_op.register_autograd(_bs_parts_backward, setup_context=_bs_setup_context)


def parts_native_for(x: Tensor, meta: BlockSparseMeta) -> bool:
    """Whether :func:`block_sparse_linear_parts` writes the pieces as separate tensors for this input (the
    kernels run it and :func:`.plans.parts_native` holds); else it splits one output."""
    return uses_kernels(x, meta) and parts_native(meta) and not _functorch_active() and x.numel() > 0


def block_sparse_linear_parts(x: Tensor, values: Tensor, meta: BlockSparseMeta,
                              bias: Tensor | None = None) -> tuple[Tensor, ...]:
    """:func:`block_sparse_linear` with its output as :data:`~.plans.PARTS` tensors ``[..., O / PARTS]`` (a fused
    query/key/value projection's q, k and v). Where :func:`parts_native_for` holds, the kernels write them as
    separate tensors and the backward reads their gradients in place: the gradients are not concatenated into
    one ``[..., O]`` tensor first. Elsewhere the one output is split (views), with the same values."""
    _check(x, values, meta, bias)
    if meta.out_features % PARTS:
        raise ValueError(f"out_features={meta.out_features} does not split into {PARTS} parts")
    cast = _autocast_dtype(x.device.type)
    if cast is not None:
        x = x.to(cast)
    if not parts_native_for(x, meta):
        return block_sparse_linear(x, values, meta, bias).split(meta.out_features // PARTS, dim=-1)
    lead = x.shape[:-1]
    if torch.compiler.is_compiling():
        return tuple(torch.ops.sparsetrain.block_sparse_linear_parts(
            x.contiguous(), values.contiguous(), bias, *op_meta_args(meta)))
    outs = BlockSparseLinearPartsFn.apply(x.reshape(-1, meta.in_features).contiguous(), values, bias, meta)
    return tuple(o.view(*lead, meta.out_features // PARTS) for o in outs)
