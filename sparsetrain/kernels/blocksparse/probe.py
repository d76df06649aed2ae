"""The dense weight gradient of a block-sparse layer as autograd's own output (RigL's grow step).

RigL scores the inactive blocks by the dense ``dL/dW = dYᵀ·X`` of the step before an update. A Python hook cannot
run inside a compiled graph or a replayed CUDA graph, so here that gradient comes out as the gradient of a
*probe*: a float32 ``[O, I]`` leaf of zero strides (one element in memory, :func:`new_probe`) that takes no part
in the forward and whose gradient the backward sets to the dense product. autograd accumulates it over
micro-batches into ``probe.grad``; ``torch.compile`` sees an opaque custom op; a CUDA graph that captured the step
replays into the same ``probe.grad`` tensor. The backward costs one dense matmul more than the plain layer's, and
takes the block gradient from it instead of running the sampled kernel.

>>> from sparsetrain.kernels.blocksparse import BlockSparseMeta, block_sparse_linear
>>> meta = BlockSparseMeta.from_mask(torch.tensor([[True, False]]), 16)     # W is 16 x 32, one block active
>>> probe = new_probe(16, 32, torch.device("cpu"))
>>> values = torch.randn(1, 16, 16, requires_grad=True)
>>> block_sparse_linear(torch.randn(5, 32), values, meta, dense_grad_probe=probe).sum().backward()
>>> probe.grad.shape, bool((probe.grad[:, 16:] != 0).any())               # inactive block's gradient too
(torch.Size([16, 32]), True)
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.plans import dds as _dds
from sparsetrain.kernels.blocksparse.reference import dense_to_values
from sparsetrain.kernels.blocksparse.registry import _meta_for


def new_probe(out_features: int, in_features: int, device: torch.device) -> Tensor:
    """A float32 ``[O, I]`` leaf that requires grad and holds one element (zero strides): its value is 0 and it
    is never read; its gradient is the layer's dense weight gradient."""
    one = torch.zeros(1, dtype=torch.float32, device=device)
    return one.as_strided((out_features, in_features), (0, 0)).detach().requires_grad_(True)


def as_operand(values: Tensor, a: Tensor) -> Tensor:
    """The active blocks in the activations' 16-bit dtype (fp32 master values under autocast): one small cast
    per op, where every kernel would otherwise read (or cast) the fp32 blocks once per token tile."""
    return values.to(a.dtype) if values.dtype != a.dtype and a.dtype in (torch.float16, torch.bfloat16) else values


def grads_with_dense(x2d: Tensor, values: Tensor, dy: Tensor, meta: BlockSparseMeta, need_x: bool, need_v: bool,
                     need_b: bool, values_dtype: torch.dtype
                     ) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor]:
    """``(dx, dvalues, dbias float32, dense dW float32)`` of a step that captures the dense gradient (the probe's
    backward and the hook path of :mod:`.op`); ``values`` as the forward multiplied them. One dense matmul in the
    activations' dtype, then float32; the block gradient is gathered from it."""
    dense = torch.mm(dy.t(), x2d).float()
    dx = _dds(dy, values, meta, None, forward=False) if need_x else None
    dv = dense_to_values(dense, meta).to(values_dtype) if need_v else None
    db = dy.sum(0, dtype=torch.float32) if need_b else None
    return dx, dv, db, dense


class ProbedFn(torch.autograd.Function):
    """``y = x2d · W_effᵀ + bias`` on the kernels; the backward gives ``probe`` the dense ``dW``."""

    @staticmethod
    def forward(ctx, x2d: Tensor, values: Tensor, bias: Tensor | None, probe: Tensor, meta: BlockSparseMeta) -> Tensor:
        ctx.dtypes = (values.dtype, None if bias is None else bias.dtype)
        values = as_operand(values, x2d)
        ctx.save_for_backward(x2d, values)
        ctx.meta = meta
        return _dds(x2d, values, meta, bias, forward=True)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2d, values = ctx.saved_tensors
        need_x, need_v, need_b = ctx.needs_input_grad[:3]
        dx, dv, db, dense = grads_with_dense(x2d, values, dy.contiguous(), ctx.meta, need_x, need_v, need_b,
                                             ctx.dtypes[0])
        return dx, dv, (db.to(ctx.dtypes[1]) if need_b else None), dense, None


# ---- torch.compile: the same as custom ops (the metadata travels as its six index tensors, as in op.py) ------
@torch.library.custom_op("sparsetrain::block_sparse_linear_probed", mutates_args=())
def _probed_op(x: Tensor, values: Tensor, bias: Tensor | None, probe: Tensor, row_ptr: Tensor, col_idx: Tensor,
               row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
               in_features: int, block: int) -> Tensor:
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    y = _dds(x.reshape(-1, in_features), as_operand(values, x), meta, bias, forward=True)
    return y.view(*x.shape[:-1], out_features)


@_probed_op.register_fake
def _(x, values, bias, probe, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features,
      block):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("sparsetrain::block_sparse_linear_probed_backward", mutates_args=())
def _probed_backward_op(dy: Tensor, x: Tensor, values: Tensor, row_ptr: Tensor, col_idx: Tensor, row_idx: Tensor,
                        col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int, in_features: int,
                        block: int, need_x: bool, need_v: bool,
                        need_b: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dvalues, dbias float32, dense dW float32); a gradient not asked for comes back empty."""
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    lead = dy.shape[:-1]
    dy2, x2 = dy.reshape(-1, out_features).contiguous(), x.reshape(-1, in_features)
    dx, dv, db, dense = grads_with_dense(x2, as_operand(values, dy2), dy2, meta, need_x, need_v, need_b, values.dtype)
    return (dx.view(*lead, in_features) if need_x else dy.new_empty(0), dv if need_v else values.new_empty(0),
            db if need_b else dy.new_empty(0, dtype=torch.float32), dense)


@_probed_backward_op.register_fake
def _(dy, x, values, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block,
      need_x, need_v, need_b):
    dx = dy.new_empty(*dy.shape[:-1], in_features) if need_x else dy.new_empty(0)
    dv = values.new_empty(values.shape) if need_v else values.new_empty(0)
    db = dy.new_empty(out_features, dtype=torch.float32) if need_b else dy.new_empty(0, dtype=torch.float32)
    return dx, dv, db, dy.new_empty(out_features, in_features, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    x, values, bias, _probe, *tensors = inputs[:10]
    ctx.save_for_backward(x, values, *tensors)
    ctx.ints = inputs[10:]
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, dy):
    x, values, *tensors = ctx.saved_tensors
    need_x, need_v, need_b = ctx.needs_input_grad[:3]
    dx, dv, db, dense = torch.ops.sparsetrain.block_sparse_linear_probed_backward(
        dy, x, values, *tensors, *ctx.ints, need_x, need_v, need_b)
    return (dx if need_x else None, dv if need_v else None, db.to(ctx.bias_dtype) if need_b else None, dense,
            *([None] * 9))


_probed_op.register_autograd(_backward, setup_context=_setup_context)
