"""The block-sparse linear layer: ``y = x · W_effᵀ + b`` where only the active ``b x b`` blocks of ``W [O, I]``
exist in memory (``values`` plus a :class:`~.meta.BlockSparseMeta`), as an autograd function and as
``torch.library`` custom ops for ``torch.compile``.

On CUDA (or under ``TRITON_INTERPRET=1``) with square blocks of 16, 32, 64 or 128 the three products run on
the tuned kernels of :mod:`.plans` (Triton gather and TMA kernels, CUDA kernels, the dense fallback: whichever
is fastest per shape); otherwise the plain-torch reference (:mod:`.reference`) computes the same function
through a dense scatter, so the same layer trains on a CPU and with small blocks (1, 4, 8), only without the
speed-up.

An eager training step is host-bound, so the kernel path is checked once per call signature and topology: the
first call checks the arguments and picks the path, and keeps a :class:`FastCall` with the launch plans on the
metadata; a later call of the signature is a lookup, the casts and the launches.

The three-piece form (a fused query/key/value projection) is :mod:`.parts`; the custom ops find the metadata in
:mod:`.registry`.

>>> import torch
>>> mask = torch.rand(6, 4) < 0.5
>>> meta = BlockSparseMeta.from_mask(mask, 16)                       # W is 96 x 64
>>> values = torch.randn(meta.n_blocks, 16, 16)
>>> block_sparse_linear(torch.randn(37, 64), values, meta).shape
torch.Size([37, 96])
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from sparsetrain.kernels._runtime.eager import eager_only
from sparsetrain.kernels._runtime.options import IN_FORCE
from sparsetrain.kernels.blocksparse import tuner
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.plans import dds as _dds
from sparsetrain.kernels.blocksparse.plans import dds_planned, run_dw, sampled_grad_planned
from sparsetrain.kernels.blocksparse.plans import sampled_grad as _sampled_grad
from sparsetrain.kernels.blocksparse.probe import ProbedFn, grads_with_dense
from sparsetrain.kernels.blocksparse.probe import as_operand as _as_operand
from sparsetrain.kernels.blocksparse.reference import _blocks, values_to_dense
from sparsetrain.kernels.blocksparse.registry import _meta_for, op_meta_args
from sparsetrain.kernels.blocksparse.testing import HOOKS
from sparsetrain.kernels.blocksparse.tuner import GENERATION, interpreting

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_CALLS = 256  # kept call signatures per metadata (e.g. a new token count every batch)


class BlockSparseLinearFn(torch.autograd.Function):
    """``y = x2d · W_effᵀ + bias`` on the tuned kernels. ``dense_grad_hook`` (or None): when given, the
    backward computes the full dense ``dW = dYᵀ·X`` with one dense matmul, passes it (float32, ``[O, I]``)
    to the hook, and takes the block gradient from it instead of running the sampled kernel."""

    @staticmethod
    def forward(ctx, x2d: Tensor, values: Tensor, bias: Tensor | None, meta: BlockSparseMeta,
                dense_grad_hook: Callable[[Tensor], None] | None) -> Tensor:
        ctx.values_dtype = values.dtype
        values = _as_operand(values, x2d)   # one cast per step, shared by the forward and the input gradient
        ctx.save_for_backward(x2d, values)
        ctx.meta, ctx.hook = meta, dense_grad_hook
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return _dds(x2d, values, meta, bias, forward=True)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2d, values = ctx.saved_tensors
        return (*_backward(x2d, values, dy, ctx.meta, ctx.hook, *ctx.needs_input_grad[:3], ctx.values_dtype,
                           ctx.bias_dtype), None, None)


def _backward(x2d: Tensor, values: Tensor, dy: Tensor, meta: BlockSparseMeta,
              hook: Callable[[Tensor], None] | None, need_x: bool, need_v: bool, need_b: bool,
              values_dtype: torch.dtype, bias_dtype: torch.dtype | None) -> tuple:
    """``(dx, dvalues, dbias)`` of :class:`BlockSparseLinearFn` (``values``: as the forward multiplied them)."""
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    if hook is not None:   # one dense matmul, only on capture steps
        dx, dv, db32, dense = grads_with_dense(x2d, values, dy, meta, need_x, need_v, need_b, values_dtype)
        hook(dense)
        return dx, dv, (db32.to(bias_dtype) if need_b else None)
    dx = _dds(dy, values, meta, None, forward=False) if need_x else None
    dv = db = None
    if need_v:
        dv, db32 = _sampled_grad(x2d, dy, meta, with_bias=need_b, out_dtype=values_dtype)
        if dv.dtype != values_dtype:  # only when the token reduction was split (float32 partial sums)
            dv = dv.to(values_dtype)
        if need_b:
            db = db32 if db32.dtype == bias_dtype else db32.to(bias_dtype)
    if need_b and db is None:
        db = dy.sum(0, dtype=torch.float32).to(bias_dtype)
    return dx, dv, db


# ---- the eager fast path: one validated call signature, its plans kept -----------------------------------
class FastCall:
    """One call signature of :func:`block_sparse_linear` on one topology, checked once, and its launch plans.

    The first call of a signature checks the arguments, picks the path and, where that is the kernels, keeps
    this on the metadata (``meta._groups["calls"]``), keyed by the shape, strides, dtype and device of ``x`` (as
    autocast makes it), of ``values`` and of ``bias``. A later call of that signature is one dictionary lookup
    and one comparison of :func:`.tuner.state` (the options, the backend registry, the test hooks) with the
    state kept here; then the plans kept here run, with no key to build. ``TRITON_INTERPRET`` is read when a
    signature is first seen (Triton itself reads it once, when the kernels are defined). Holds no tensors."""

    __slots__ = ("meta", "state", "flat", "rows", "contig", "out_shape", "dtype", "device", "T", "I", "O",
                 "values_dtype", "bias_dtype", "dy_strides", "fwd", "dx", "dw")

    def __init__(self, meta: BlockSparseMeta, x: Tensor, contig: bool, values: Tensor, bias: Tensor | None):
        self.meta, self.state, self.contig = meta, tuner.state(), contig
        lead = tuple(x.shape[:-1])
        self.flat, self.rows = x.dim() == 2, x.numel() // meta.in_features
        self.out_shape = (*lead, meta.out_features)
        self.dtype, self.device = x.dtype, x.device
        self.T, self.I, self.O = self.rows, meta.in_features, meta.out_features
        self.values_dtype, self.bias_dtype = values.dtype, (bias.dtype if bias is not None else None)
        self.dy_strides = (self.O, 1)
        self.fwd = self.dx = None
        self.dw = [None, None]  # without, with the fused bias gradient


class _PlannedFn(torch.autograd.Function):
    """:class:`BlockSparseLinearFn` for a :class:`FastCall`: the plans kept on it run without a lookup."""

    @staticmethod
    def forward(ctx, x2d: Tensor, values: Tensor, bias: Tensor | None, call: FastCall) -> Tensor:
        # the kernels' values: x's dtype (fp32 master values under 16-bit activations: one cast per step, shared
        # with the input gradient), contiguous; the Parameter itself where it is both already
        values = values.to(call.dtype, memory_format=torch.contiguous_format)
        ctx.save_for_backward(x2d, values)
        ctx.call = call
        plan = call.fwd
        if plan is None:
            out, call.fwd = dds_planned(x2d, values, call.meta, bias, True)
            return out
        out = torch.empty(call.T, call.O, dtype=call.dtype, device=call.device)
        if HOOKS.poison:
            out.fill_(float("nan"))
        plan(x2d, values, x2d if bias is None else bias, out)
        return out

    @staticmethod
    def backward(ctx, dy: Tensor):
        x2d, values = ctx.saved_tensors
        call, h = ctx.call, HOOKS
        need_x, need_v, need_b = ctx.needs_input_grad[:3]
        if (dy.dtype is not call.dtype or dy.stride() != call.dy_strides
                or (IN_FORCE[0], GENERATION[0], h.tune, h.forced, h.timer, h.poison) != call.state):
            return (*_backward(x2d, values, dy, call.meta, None, need_x, need_v, need_b, call.values_dtype,
                               call.bias_dtype), None)
        dx = dv = db = None
        if need_x:
            plan = call.dx
            if plan is None:
                dx, call.dx = dds_planned(dy, values, call.meta, None, False)
            else:
                dx = torch.empty(call.T, call.I, dtype=call.dtype, device=call.device)
                if h.poison:
                    dx.fill_(float("nan"))
                plan(dy, values, dy, dx)
        if need_v:
            plan = call.dw[need_b]
            if plan is None:
                dv, db, call.dw[need_b] = sampled_grad_planned(x2d, dy, call.meta, need_b, call.values_dtype)
            else:
                dv, db = run_dw(plan, x2d, dy, call.meta, need_b, call.values_dtype)
            if dv.dtype is not call.values_dtype:  # a split token reduction: float32 partial sums
                dv = dv.to(call.values_dtype)
            if need_b and db.dtype is not call.bias_dtype:
                db = db.to(call.bias_dtype)
        if need_b and db is None:
            db = dy.sum(0, dtype=torch.float32).to(call.bias_dtype)
        return dx, dv, db, None


# ``Function.apply`` less its Python wrapper (which binds no defaults here, checks functorch, which the fast path
# does itself, and unwraps dead functorch wrappers, which it does for x): ~20 Python calls fewer per forward.
_PLANNED_APPLY = super(torch.autograd.Function, _PlannedFn).apply
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
# torch.compiler.is_compiling() is True under dynamo and in a non-strict export; these say the same in one call
_dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
_compiler = torch.compiler


# ---- torch.compile: the kernels as torch.library custom ops ---------------------------------------------
# Under torch.compile the kernel path goes through these opaque ops (dynamo cannot trace the Triton launches and
# their plan caches). The metadata travels as its six index tensors (:mod:`.registry`).
@torch.library.custom_op("sparsetrain::block_sparse_linear", mutates_args=())
def _bs_linear_op(x: Tensor, values: Tensor, bias: Tensor | None, row_ptr: Tensor, col_idx: Tensor,
                  row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
                  in_features: int, block: int) -> Tensor:
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    values = _as_operand(values, x)
    return _dds(x.reshape(-1, in_features), values, meta, bias, forward=True).view(*x.shape[:-1], out_features)


@_bs_linear_op.register_fake
def _(x, values, bias, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("sparsetrain::block_sparse_linear_backward", mutates_args=())
def _bs_linear_backward_op(dy: Tensor, x: Tensor, values: Tensor, row_ptr: Tensor, col_idx: Tensor,
                           row_idx: Tensor, col_ptr: Tensor, t_row_idx: Tensor, t_slot: Tensor, out_features: int,
                           in_features: int, block: int, need_x: bool, need_v: bool,
                           need_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dvalues, dbias float32); a gradient not asked for comes back as an empty tensor. ``dy`` and ``x`` have
    the forward's leading dimensions (dx too)."""
    meta = _meta_for((row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot), out_features, in_features, block)
    lead = dy.shape[:-1]
    dy, x = dy.reshape(-1, out_features), x.reshape(-1, in_features)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dx = (_dds(dy, _as_operand(values, dy), meta, None, forward=False).view(*lead, in_features) if need_x
          else dy.new_empty(0))
    dv, db = values.new_empty(0), dy.new_empty(0, dtype=torch.float32)
    if need_v:
        dv, db = op_weight_grads(x, dy, values, meta, need_b)
    if need_b and db.numel() == 0:
        db = dy.sum(0, dtype=torch.float32)
    return dx, dv, db


def op_weight_grads(x2d: Tensor, dy2d: Tensor, values: Tensor, meta: BlockSparseMeta,
                    need_b: bool) -> tuple[Tensor, Tensor]:
    """``(dvalues in values' dtype, dbias float32 or empty)`` for a custom op: a split reduction returns dv and db
    as views of one buffer, and an op's outputs may not alias, so db is then a copy."""
    dv, db32 = _sampled_grad(x2d, dy2d, meta, with_bias=need_b, out_dtype=values.dtype)
    dv = dv.to(values.dtype)
    if not need_b:
        return dv, dy2d.new_empty(0, dtype=torch.float32)
    return dv, _not_aliasing(db32, dv)


def _not_aliasing(db: Tensor, dv: Tensor) -> Tensor:
    """``db``, copied where it shares ``dv``'s storage (a split reduction returns both as views of one buffer;
    a custom op's outputs may not alias)."""
    return db.clone() if db.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr() else db


@_bs_linear_backward_op.register_fake
def _(dy, x, values, row_ptr, col_idx, row_idx, col_ptr, t_row_idx, t_slot, out_features, in_features, block,
      need_x, need_v, need_b):
    dx = dy.new_empty(*dy.shape[:-1], in_features) if need_x else dy.new_empty(0)
    dv = values.new_empty(values.shape) if need_v else values.new_empty(0)
    db = dy.new_empty(out_features, dtype=torch.float32) if need_b else dy.new_empty(0, dtype=torch.float32)
    return dx, dv, db


def _bs_setup_context(ctx, inputs, output):
    x, values, bias, *tensors = inputs[:9]
    ctx.save_for_backward(x, values, *tensors)
    ctx.ints = inputs[9:]
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _bs_backward(ctx, dy):
    x, values, *tensors = ctx.saved_tensors
    need_x, need_v, need_b = ctx.needs_input_grad[:3]
    dx, dv, db = torch.ops.sparsetrain.block_sparse_linear_backward(
        dy, x, values, *tensors, *ctx.ints, need_x, need_v, need_b)
    return (dx if need_x else None, dv if need_v else None, db.to(ctx.bias_dtype) if need_b else None,
            None, None, None, None, None, None, None, None, None)


_bs_linear_op.register_autograd(_bs_backward, setup_context=_bs_setup_context)


@eager_only
def _eager_with_hook(x2d: Tensor, values: Tensor, bias: Tensor | None, meta: BlockSparseMeta,
                     hook: Callable[[Tensor], None]) -> Tensor:
    """The autograd-function path outside the compiled graph (a graph break on dense-gradient capture steps)."""
    return BlockSparseLinearFn.apply(x2d, values, bias, meta, hook)


def _values_to_dense_traced(values: Tensor, meta: BlockSparseMeta) -> Tensor:
    """:func:`.reference.values_to_dense` for a compiled graph: the block index cast in the graph, not read from the
    metadata's cache (dynamo guards on what a dict holds: a filled cache would recompile the graph)."""
    w = values.new_zeros(meta.out_features, meta.in_features)
    _blocks(w, meta)[meta.row_idx.long(), meta.col_idx.long()] = values
    return w


class _DenseGradHook(torch.autograd.Function):
    """Identity on the dense weight whose backward hands the incoming gradient to a hook (reference path)."""

    @staticmethod
    def forward(ctx, w: Tensor, hook: Callable[[Tensor], None]) -> Tensor:
        ctx.hook = hook
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.hook(grad.detach().float())
        return grad, None


try:  # torch >= 2.4: autocast state per device type, read in one call each
    torch.get_autocast_dtype("cpu")
    _autocast_on, _autocast_to = torch.is_autocast_enabled, torch.get_autocast_dtype
except (AttributeError, TypeError):  # older torch: the general path below
    _autocast_on = _autocast_to = None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except TypeError:  # torch < 2.4
        enabled = torch.is_autocast_enabled() if device_type == "cuda" else torch.is_autocast_cpu_enabled()
    if not enabled:
        return None
    try:
        return torch.get_autocast_dtype(device_type)
    except AttributeError:  # torch < 2.4
        return torch.get_autocast_gpu_dtype() if device_type == "cuda" else torch.get_autocast_cpu_dtype()


def uses_kernels(x: Tensor, meta: BlockSparseMeta) -> bool:
    """True when :func:`block_sparse_linear` runs the kernels (not the plain-torch reference) for this input."""
    return (meta.kernel_supported and (x.is_cuda or interpreting()) and x.dtype in _KERNEL_DTYPES
            and meta.out_features * meta.in_features < 2**31)  # block offsets are int32 in the kernels


def _check(x: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None) -> None:
    if not isinstance(meta, BlockSparseMeta):
        raise TypeError(f"meta must be a BlockSparseMeta, got {type(meta).__name__}")
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    if x.dim() < 1 or x.shape[-1] != meta.in_features:
        raise ValueError(f"x has shape {tuple(x.shape)}; its last dimension must be in_features={meta.in_features}")
    # compiled: the count as an index tensor's size (dynamic under gradual pruning; an int attribute stays static)
    want = (meta.col_idx.shape[0] if _dynamo_compiling() else meta.n_blocks, meta.block_rows, meta.block_cols)
    if not isinstance(values, Tensor) or tuple(values.shape) != want:
        raise ValueError(f"values has shape {tuple(getattr(values, 'shape', ()))}, expected {want}")
    if bias is not None and tuple(bias.shape) != (meta.out_features,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({meta.out_features},)")
    for name, t in (("values", values), ("bias", bias), ("meta", meta.row_ptr)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")


def block_sparse_linear(x: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None = None, *,
                        dense_grad_hook: Callable[[Tensor], None] | None = None,
                        dense_grad_probe: Tensor | None = None) -> Tensor:
    """``x · W_effᵀ + bias`` with ``W_eff`` given by compressed ``values`` and ``meta``; ``x [..., I]``.

    ``values`` and ``bias`` have ``x``'s dtype, or float32 with a 16-bit ``x`` (mixed precision: the
    active blocks are cast to ``x``'s dtype once per step, shared by the forward and the input gradient, and
    the gradients come back in float32). Under autocast only ``x`` is cast. ``dense_grad_hook(g)``, when given,
    receives the dense ``dL/dW_eff`` (float32 ``[O, I]``) during backward (RigL's grow step); ``dense_grad_probe``
    (:func:`.probe.new_probe`) as its gradient instead, with no Python in the backward (compiled, replayed).

    A call signature seen before on this topology takes the fast path (:class:`FastCall`).

    >>> meta = BlockSparseMeta.from_mask(torch.ones(2, 2, dtype=torch.bool), 16)
    >>> block_sparse_linear(torch.randn(5, 32), torch.randn(4, 16, 16), meta).shape
    torch.Size([5, 32])
    """
    if (dense_grad_hook is None and dense_grad_probe is None and _autocast_on is not None
            and not _dynamo_compiling() and not _compiler._is_compiling_flag and not _functorch_active()):
        try:
            dev = x.device
            x1 = x
            if _autocast_on(dev.type):
                cast = _autocast_to(dev.type)
                if x.dtype is not cast and x.dtype.is_floating_point:
                    x1 = x.to(cast)  # a new tensor (dead functorch wrappers unwrap themselves in an op)
            if x1 is x:
                x1 = _unwrap_if_dead(x)
            call = meta._groups["calls"][(
                x1.shape, x1.stride(), x1.dtype, dev, values.shape, values.dtype, values.device,
                None if bias is None else bias.shape, None if bias is None else bias.dtype,
                None if bias is None else bias.device)]
        except (AttributeError, KeyError, TypeError):  # not seen (or not a tensor, not a meta: checked below)
            call = None
        if call is not None:
            h = HOOKS
            if (IN_FORCE[0], GENERATION[0], h.tune, h.forced, h.timer, h.poison) == call.state:
                if not call.flat:
                    x1 = x1.reshape(call.rows, call.I)
                if call.contig:
                    x1 = x1.contiguous()
                y = _PLANNED_APPLY(x1, values, bias, call)
                return y if call.flat else y.view(call.out_shape)
    return _block_sparse_linear(x, values, meta, bias, dense_grad_hook, dense_grad_probe)


def _block_sparse_linear(x: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None,
                         dense_grad_hook: Callable[[Tensor], None] | None, probe: Tensor | None = None) -> Tensor:
    """:func:`block_sparse_linear` with every check; keeps a :class:`FastCall` where the fast path can take it."""
    _check(x, values, meta, bias)
    cast = _autocast_dtype(x.device.type)
    if cast is not None:
        x = x.to(cast)
    ok = (x.dtype, torch.float32)
    if values.dtype not in ok or (bias is not None and bias.dtype not in ok):
        raise TypeError(f"dtypes differ: x {x.dtype}, values {values.dtype}, "
                        f"bias {None if bias is None else bias.dtype} (values/bias must be x's dtype or float32)")
    lead = x.shape[:-1]
    x2d = x.reshape(-1, meta.in_features)
    if uses_kernels(x2d, meta):
        contig = x2d.stride(-1) != 1
        if contig:
            x2d = x2d.contiguous()
        if probe is not None:   # RigL's grow step: the dense gradient as the probe's gradient (probe.py)
            y = (torch.ops.sparsetrain.block_sparse_linear_probed(
                     x.contiguous(), values.contiguous(), bias, probe, *op_meta_args(meta))
                 if torch.compiler.is_compiling() else ProbedFn.apply(x2d, values, bias, probe, meta))
        elif torch.compiler.is_compiling() and dense_grad_hook is None:  # opaque op for dynamo / inductor
            # x with its leading dimensions, so that the backward's dY is the gradient as its producer wrote it
            # (e.g. LayerNorm backward -> dropout backward over [B, S, O]): inductor then fuses that pointwise
            # work into the producer's kernel; a [T, O] view of it made the op's input a copy of its own
            y = torch.ops.sparsetrain.block_sparse_linear(
                x if x.is_contiguous() else x.contiguous(), values.contiguous(), bias, *op_meta_args(meta))
        elif torch.compiler.is_compiling():  # RigL capture steps: the hook is Python, run this layer eagerly
            y = _eager_with_hook(x2d, values.contiguous(), bias, meta, dense_grad_hook)
        elif dense_grad_hook is None and x2d.shape[0] > 0 and not _functorch_active():
            y = _PLANNED_APPLY(x2d, values, bias, _keep_call(x, contig, values, meta, bias))
        else:
            y = BlockSparseLinearFn.apply(x2d, values.contiguous(), bias, meta, dense_grad_hook)
    else:
        w = (_values_to_dense_traced(values, meta) if _dynamo_compiling()
             else values_to_dense(values, meta)).to(x.dtype)
        bias = bias.to(x.dtype) if bias is not None else None
        if dense_grad_hook is not None and torch.is_grad_enabled() and w.requires_grad:
            w = _DenseGradHook.apply(w, dense_grad_hook)
        w = w if probe is None else w + probe.to(w.dtype)
        y = F.linear(x2d, w, bias)
    return y.reshape(*lead, meta.out_features)


def _keep_call(x: Tensor, contig: bool, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None) -> FastCall:
    """A :class:`FastCall` for this checked signature, kept on the metadata under the fast path's key."""
    calls = meta._groups.get("calls")
    if calls is None or len(calls) >= _MAX_CALLS:
        calls = meta._groups["calls"] = {}
    key = (x.shape, x.stride(), x.dtype, x.device, values.shape, values.dtype, values.device,
           None if bias is None else bias.shape, None if bias is None else bias.dtype,
           None if bias is None else bias.device)
    call = calls[key] = FastCall(meta, x, contig, values, bias)
    return call
