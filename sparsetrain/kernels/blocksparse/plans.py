"""The three products of the layer as cached launch plans: :func:`dds` (forward ``X·Wᵀ`` and input gradient
``dY·W``) and :func:`sampled_grad` (``dW = dYᵀ·X`` at the active blocks, with the bias gradient fused).

Everything a launch needs besides the data pointers depends only on the topology, the token count, the
strides, the dtypes and what steers the tuner. The first call per such key asks the tuner for a config among
the registered backends' candidates, builds that backend's plan and keeps it on the metadata
(``meta._groups["plans"]``, dropped with it when the topology changes); a steady-state call is then one dict
lookup, one output allocation and the launch.

The built-in backends are registered here, in the order the tuner lists their candidates: the first
candidate is the choice wherever nothing is timed.
"""
from __future__ import annotations

import torch
from torch import Tensor

from sparsetrain.kernels.blocksparse import _cuda, dense, gather, tma, tuner
from sparsetrain.kernels.blocksparse.epilogue import NAMES, EpiloguePlan
from sparsetrain.kernels.blocksparse.meta import BlockSparseMeta
from sparsetrain.kernels.blocksparse.testing import HOOKS
from sparsetrain.kernels.blocksparse.tuner import Product

for _backend in (_cuda.BACKEND, tma.BACKEND, gather.BACKEND, dense.BACKEND):
    tuner.register_backend(_backend)

_MAX_PLANS = 256  # per metadata, e.g. a new token count every batch: bound the cache, rebuilding is cheap


def _plans(meta: BlockSparseMeta) -> dict:
    plans = meta._groups.get("plans")
    if plans is None:
        plans = meta._groups["plans"] = {}
    return plans


def _keep_plan(meta: BlockSparseMeta, key: tuple, plan) -> None:
    plans = _plans(meta)
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan


def _may_cache(device: torch.device) -> bool:
    # while capturing a CUDA graph the tuner takes the first candidate untimed: not a choice to keep
    return device.type != "cuda" or not torch.cuda.is_current_stream_capturing()


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _chosen_plan(meta: BlockSparseMeta, kept: set, built: dict, cfg, p: Product):
    """The plan of the chosen ``cfg``. Where timing built other candidates' plans, the lists and tables they left
    on the metadata (every key added since ``kept``) go and the chosen plan is built again: a mask update
    refills everything kept on the metadata (BlockSparseMeta.rewrite_), so what no plan reads would cost host
    time at every update."""
    chosen = tuner.config_key(cfg)
    if not any(k != chosen for k in built):
        return built.get(chosen) or tuner.make_plan(cfg, p)
    for k in set(meta._groups) - kept - {"plans", "calls"}:
        del meta._groups[k]
    return tuner.make_plan(cfg, p)


def dds(a: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None, forward: bool) -> Tensor:
    """``a [T, K] · B`` with ``B = Wᵀ`` (forward, ``a = X``) or ``B = W`` (input gradient, ``a = dY``)."""
    return dds_planned(a, values, meta, bias, forward)[0]


def dds_planned(a: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None, forward: bool):
    """:func:`dds` and the plan that computed it, if it was kept (None: not kept, e.g. no tokens or during a
    CUDA-graph capture): ``(out, plan)``."""
    T = a.shape[0]
    has_bias = bias is not None
    pkey = ("plan_dds", forward, T, a.stride(0), a.stride(1), a.dtype, values.dtype,
            bias.dtype if has_bias else None, a.device, *tuner.steering())
    plan = _plans(meta).get(pkey)
    if plan is not None:  # the steady state of training: one allocation and one direct launch
        out = torch.empty(T, plan.out_width, dtype=a.dtype, device=a.device)
        if HOOKS.poison:
            out.fill_(float("nan"))
        plan(a, values, bias if has_bias else a, out)
        return out, plan

    B = meta.block
    n_out = meta.grid[0] if forward else meta.grid[1]
    out = torch.empty(T, n_out * B, dtype=a.dtype, device=a.device)
    if HOOKS.poison:
        out.fill_(float("nan"))
    if T == 0:
        return out, None
    cfg, plan = _tune_dds(a, values, meta, bias, forward, out)
    plan(a, values, bias if has_bias else a, out)
    if not _may_cache(a.device):
        return out, None
    _keep_plan(meta, pkey, plan)
    return out, plan


def _tune_dds(a: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None, forward: bool,
              out: Tensor, epi: int = 0, aux: Tensor | None = None, out2: Tensor | None = None):
    """The tuner's config for this product (timed on ``out`` as scratch where it is timed) and its plan, built
    with the epilogue ``epi`` (``aux``, ``out2``: its operands, scratch for timing). The config is the plain
    product's. Where that config's kernel has the epilogue, it is timed once per shape against the plain kernel
    followed by the epilogue's own pass, and the faster is kept: the epilogue's arithmetic runs inside a kernel
    whose issue slots are the bottleneck, where a pass of its own overlaps it with memory traffic."""
    T, B, has_bias = a.shape[0], meta.block, bias is not None
    p = Product("fwd" if forward else "dx", meta, a, values, has_bias)
    built: dict = {}  # one plan per candidate while tuning, by (config type, config): timing excludes building

    def launch(cfg) -> Tensor:
        k = tuner.config_key(cfg)
        if k not in built:
            built[k] = tuner.make_plan(cfg, p)
        if HOOKS.poison:   # one output buffer for every candidate: the tuner's check poisons it first
            out.fill_(float("nan"))
        built[k](a, values, bias if has_bias else a, out)
        return out

    key = (B, _pow2(T), meta.in_features if forward else meta.out_features, out.shape[1],
           tuner.density_bucket(meta), a.dtype, values.dtype, has_bias)
    kept = set(meta._groups)
    cfg = tuner.pick(p.kind, key, a.device, tuner.candidates(p), launch, meta.estimate_plans)
    if epi:  # the chosen plan is built again, with the epilogue
        built.pop(tuner.config_key(cfg), None)
        p = Product(p.kind, meta, a, values, has_bias, epi)
    plan = _chosen_plan(meta, kept, built, cfg, p)
    if epi and not getattr(plan, "native_epilogue", False):
        plan = EpiloguePlan(plan, epi)
    elif epi and _times_forms(a.device):  # else the kernel's own epilogue, untimed
        forms = {"fused": plan, "pass": EpiloguePlan(tuner.make_plan(cfg, Product(p.kind, meta, a, values,
                                                                                       has_bias)), epi)}

        def run_form(form: str) -> tuple[Tensor, Tensor]:
            forms[form](a, values, bias if has_bias else a, out, aux, out2)
            return out, out2

        plan = forms[_pick_form(f"{p.kind}+{NAMES[epi]}", (*key, tuner.config_key(cfg)), run_form)]
    return cfg, plan


_FORMS: dict[tuple, str] = {}  # (kind, shape key, config, options) -> "fused" or "pass", timed in this process


def _times_forms(device: torch.device) -> bool:
    """Whether the two forms of an epilogue are timed here (where the tuner times: not under the interpreter or
    off a GPU without a test's timer, not untuned, not while a CUDA graph is captured)."""
    return ((HOOKS.timer is not None or (not tuner.interpreting() and device.type == "cuda")) and HOOKS.tune
            and _may_cache(device))


def _pick_form(kind: str, key: tuple, run_form) -> str:
    """``"fused"`` (the kernel's own epilogue) or ``"pass"`` (the plain kernel, then the epilogue's pass), timed
    once per shape and config in this process (:func:`_times_forms`)."""
    timer = HOOKS.timer
    full = (kind, *key, *tuner.option_key())
    if full not in _FORMS:
        timed = tuner.time_candidates(kind, key, ["fused", "pass"], run_form, timer or tuner._do_bench,
                                      check=timer is None)
        _FORMS[full] = min(timed, key=lambda t: t[1])[0] if timed else "fused"
    return _FORMS[full]


def dds_epilogue(a: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None, forward: bool, epi: int,
                 aux: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`dds` with the epilogue ``epi`` (:mod:`.epilogue`; ``aux`` [T, width] contiguous for
    :data:`~.epilogue.DGELU`): ``(out, out2)``."""
    T = a.shape[0]
    has_bias = bias is not None
    pkey = ("plan_dds_epi", epi, forward, T, a.stride(0), a.stride(1), a.dtype, values.dtype,
            bias.dtype if has_bias else None, a.device, *tuner.steering())
    plan = _plans(meta).get(pkey)
    width = (meta.grid[0] if forward else meta.grid[1]) * meta.block
    out = torch.empty(T, width, dtype=a.dtype, device=a.device)
    out2 = torch.empty_like(out)
    if HOOKS.poison:
        out.fill_(float("nan"))
        out2.fill_(float("nan"))
    if T == 0:
        return out, out2
    if aux is None:  # an epilogue that reads none: a placeholder the kernels do not touch
        aux = out
    if plan is None:
        _, plan = _tune_dds(a, values, meta, bias, forward, out, epi, aux, out2)
        if _may_cache(a.device):
            _keep_plan(meta, pkey, plan)
        if HOOKS.poison:
            out.fill_(float("nan"))
    plan(a, values, bias if has_bias else a, out, aux, out2)
    return out, out2


def sampled_grad(x: Tensor, dy: Tensor, meta: BlockSparseMeta, with_bias: bool,
                 out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor | None]:
    """``dvalues = blocks of dYᵀ·X at the active positions`` and, fused, ``dbias = Σ_t dY`` (float32).
    ``dvalues`` comes back in ``out_dtype``, or in float32 where the plan adds partial sums (``atomic``)."""
    dv, db, _ = sampled_grad_planned(x, dy, meta, with_bias, out_dtype)
    return dv, db


def sampled_grad_planned(x: Tensor, dy: Tensor, meta: BlockSparseMeta, with_bias: bool,
                         out_dtype: torch.dtype = torch.float32):
    """:func:`sampled_grad` and the plan that computed it if it was kept (else None): ``(dv, db, plan)``."""
    T = x.shape[0]
    dev = x.device
    pkey = ("plan_dw", T, x.stride(0), x.stride(1), dy.stride(0), x.dtype, dy.dtype, out_dtype, with_bias, dev,
            *tuner.steering())
    plan = _plans(meta).get(pkey)
    if plan is None:
        p = Product("dw", meta, x, dy, with_bias)
        built: dict = {}

        def launch(cfg) -> tuple[Tensor, Tensor | None]:
            k = tuner.config_key(cfg)
            if k not in built:
                built[k] = tuner.make_plan(cfg, p)
            return run_dw(built[k], x, dy, meta, with_bias, out_dtype)

        key = (meta.block, _pow2(T), meta.in_features, meta.out_features, tuner.density_bucket(meta), x.dtype,
               out_dtype, with_bias)
        kept = set(meta._groups)
        cfg = tuner.pick("dw", key, dev, tuner.candidates(p), launch, meta.estimate_plans)
        plan = _chosen_plan(meta, kept, built, cfg, p)
        if T > 0 and _may_cache(dev):
            _keep_plan(meta, pkey, plan)
        else:
            dv, db = run_dw(plan, x, dy, meta, with_bias, out_dtype)
            return dv, db, None
    dv, db = run_dw(plan, x, dy, meta, with_bias, out_dtype)
    return dv, db, plan


def run_dw(plan, x: Tensor, dy: Tensor, meta: BlockSparseMeta, with_bias: bool,
           out_dtype: torch.dtype, more_dy: tuple | list = ()) -> tuple[Tensor, Tensor | None]:
    """Allocate the outputs of one weight-gradient launch and run it (``more_dy``: dY's other pieces, for a plan
    built with parts). An atomic plan adds float32 partial sums into zeroed memory; dvalues and dbias then share
    ONE zero-filled buffer (one fill instead of two)."""
    B, n, O, dev = meta.block_rows, meta.n_blocks, meta.out_features, x.device
    db = None
    if plan.atomic:
        buf = torch.zeros(n * B * B + (O if with_bias else 0), dtype=torch.float32, device=dev)
        dv = buf[: n * B * B].view(n, B, B)
        if with_bias:
            db = buf[n * B * B:]
    else:
        dv = torch.empty(n, B, B, dtype=out_dtype, device=dev)
        if HOOKS.poison:
            dv.fill_(float("nan"))
        if with_bias:
            db = torch.zeros(O, dtype=torch.float32, device=dev)
    if x.shape[0] == 0:
        return dv.zero_(), db
    plan(x, dy, dv, db if db is not None else dv, *more_dy)
    return dv, db


# ---- a layer whose output is three tensors: a fused query/key/value projection --------------------------------
PARTS = 3


def parts_native(meta: BlockSparseMeta) -> bool:
    """Whether this layer's products can run with its output as :data:`PARTS` tensors without a copy: an output
    of whole blocks per piece (every backend but TMA takes the pieces; the tuner times those that do). Elsewhere
    the layer's output stays one tensor (the caller splits it, and its backward concatenates the pieces'
    gradients)."""
    return meta.grid[0] % PARTS == 0


def _tuned_parts(pkey: tuple, p: Product, key: tuple, run, keep: bool = True):
    """The plan of a three-piece product: the tuner's pick among the candidates of the backends that take
    pieces (``run(plan)`` one launch, timed), built like the other products' plans and kept under ``pkey``
    (where ``keep`` and plans may be cached)."""
    built: dict = {}

    def launch(cfg):
        k = tuner.config_key(cfg)
        if k not in built:
            built[k] = tuner.make_plan(cfg, p)
        return run(built[k])

    kept = set(p.meta._groups)
    cfg = tuner.pick(p.kind, key, p.a.device, tuner.candidates(p), launch, p.meta.estimate_plans)
    plan = _chosen_plan(p.meta, kept, built, cfg, p)
    if keep and _may_cache(p.a.device):
        _keep_plan(p.meta, pkey, plan)
    return plan


def dds_parts_forward(x: Tensor, values: Tensor, meta: BlockSparseMeta, bias: Tensor | None) -> list[Tensor]:
    """``x [T, I] · Wᵀ + bias`` as :data:`PARTS` tensors ``[T, O / PARTS]`` (each its own allocation), written by
    the kernels directly (:func:`parts_native` layers)."""
    T, width, has_bias = x.shape[0], meta.out_features // PARTS, bias is not None
    outs = [torch.empty(T, width, dtype=x.dtype, device=x.device) for _ in range(PARTS)]
    if T == 0:
        return outs
    pkey = ("plan_dds_parts", True, T, x.stride(0), x.stride(1), x.dtype, values.dtype,
            bias.dtype if has_bias else None, x.device, *tuner.steering())
    plan = _plans(meta).get(pkey)

    def run(pl):
        if HOOKS.poison:
            for o in outs:
                o.fill_(float("nan"))
        pl(x, values, bias if has_bias else x, outs[0], outs[0], outs[0], x, x, outs[1], outs[2])
        return tuple(outs)

    if plan is None:
        key = (meta.block, _pow2(T), meta.in_features, meta.out_features, tuner.density_bucket(meta), x.dtype,
               values.dtype, has_bias, PARTS)
        plan = _tuned_parts(pkey, Product("fwd", meta, x, values, has_bias, parts=PARTS), key, run)
    run(plan)
    return outs


def dds_parts_dx(dys: list[Tensor], values: Tensor, meta: BlockSparseMeta) -> Tensor:
    """``dY · W`` with dY given as :data:`PARTS` tensors ``[T, O / PARTS]`` of one row stride (the gradients of
    :func:`dds_parts_forward`'s outputs), read in place by the kernels: ``dx [T, I]``."""
    d0 = dys[0]
    T = d0.shape[0]
    dx = torch.empty(T, meta.in_features, dtype=d0.dtype, device=d0.device)
    if T == 0:
        return dx
    pkey = ("plan_dds_parts", False, T, d0.stride(0), d0.stride(1), d0.dtype, values.dtype, None, d0.device,
            *tuner.steering())
    plan = _plans(meta).get(pkey)

    def run(pl):
        if HOOKS.poison:
            dx.fill_(float("nan"))
        pl(d0, values, d0, dx, dx, dx, dys[1], dys[2], dx, dx)
        return dx

    if plan is None:
        key = (meta.block, _pow2(T), meta.out_features, meta.in_features, tuner.density_bucket(meta), d0.dtype,
               values.dtype, False, PARTS)
        plan = _tuned_parts(pkey, Product("dx", meta, d0, values, False, parts=PARTS), key, run)
    return run(plan)


def sampled_grad_parts(x: Tensor, dys: list[Tensor], meta: BlockSparseMeta, with_bias: bool,
                       out_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor | None]:
    """:func:`sampled_grad` with dY given as :data:`PARTS` tensors of one row stride, read in place."""
    d0 = dys[0]
    T = x.shape[0]
    pkey = ("plan_dw_parts", T, x.stride(0), x.stride(1), d0.stride(0), x.dtype, d0.dtype, out_dtype, with_bias,
            x.device, *tuner.steering())
    plan = _plans(meta).get(pkey)
    result: list = []

    def run(pl):
        result[:] = run_dw(pl, x, d0, meta, with_bias, out_dtype, dys[1:])
        return tuple(result)

    if plan is None:
        key = (meta.block, _pow2(T), meta.in_features, meta.out_features, tuner.density_bucket(meta), x.dtype,
               out_dtype, with_bias, PARTS)
        plan = _tuned_parts(pkey, Product("dw", meta, x, d0, with_bias, parts=PARTS), key, run, keep=T > 0)
    run(plan)
    return result[0], result[1]
