"""What a run is made of, from plain arguments: :class:`TrainArgs`, :class:`RunSpec`, the model's sparsification,
the optimizer and the learning-rate schedule.

:mod:`sparsetrain.config` turns a composed config into a :class:`RunSpec`; nothing here (or below) sees a
DictConfig. Runtime objects (the model, its parameters) are passed at the call site, never through the config:

>>> spec = RunSpec(build_model=..., build_data=..., build_optimizer=optimizer_factory(torch.optim.AdamW, {"lr": 1e-3}),
...                scheduler=Static(), sparsify_kwargs=dict(density=0.1, block=Block(16, 16)),
...                train_args=TrainArgs(max_steps=100))  # doctest: +SKIP
>>> layers = sparsify_model(spec.build_model(), spec.scheduler, spec.sparsify_kwargs)  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch._functorch.config as functorch_config
from torch import nn

from sparsetrain.kernels import KernelOptions


@dataclass
class TrainArgs:
    """The loop's settings (``trainer.*``, ``optim`` schedule, ``logger.*``), as plain values."""

    max_steps: int = 100
    batch_size: int = 8
    grad_accum: int = 1
    mixed_precision: str = "no"
    clip_grad_norm: float | None = 1.0
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: str | None = None
    #: A checkpoint (or run) dir whose weights and masks a new run starts from, at step 0 (see training/resume.py).
    init_from: str | None = None
    device: str = "auto"
    num_workers: int = 0
    #: Copy the next batch to the GPU on a stream of its own while the step runs (pinned batches: CUDA graph steps).
    copy_ahead: bool = False
    compile: bool = False
    compile_mode: str | None = None
    #: torch.compile: the share of the activations the compiled step keeps for its backward (1.0: as torch's
    #: partitioner decides; lower recomputes cheap ops such as GELU and casts in the backward instead).
    activation_memory_budget: float = 1.0
    #: Replay each training step from one CUDA graph: True, False or "auto" (see training/step.py).
    cuda_graph: bool | str = False
    lr_schedule: str = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    seed: int = 0
    progress: bool = True
    plot: bool = True
    wandb: bool = False
    wandb_mode: str = "offline"
    wandb_project: str = "sparsetrain"
    wandb_name: str | None = None
    recipe: str = "custom"
    #: The command-line overrides the run was started with; the loop prints them in the command that resumes it.
    overrides: tuple[str, ...] = ()
    #: Kernel choices (``trainer.kernels.*``), put in force once when the run starts.
    kernels: KernelOptions = field(default_factory=KernelOptions)


@dataclass
class RunSpec:
    """Everything a run needs, as plain objects and callables (built by :func:`sparsetrain.config.build_run`).

    ``sparsify_kwargs`` are :func:`sparsetrain.nn.sparsify`'s arguments (``block`` a parsed
    :class:`~sparsetrain.sparsity.layout.Block`) with the global ``density`` and its ``distribution``;
    ``block_label`` is the block as the config spelt it, for the summary; ``config`` is the resolved config,
    saved with the run.
    """

    build_model: Callable[..., nn.Module]
    build_data: Callable[[], Any]
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    scheduler: Any
    sparsify_kwargs: dict
    train_args: TrainArgs
    method: str = "custom"
    config: dict = field(default_factory=dict)
    block_label: str = "1"


def compile_settings(args: TrainArgs):
    """A context holding the torch settings a compiled step is built under for a whole run (the model compiles
    at its first compiled step): ``trainer.activation_memory_budget`` where it is below 1 (at 1, torch's own
    setting stands, e.g. one a library user made). Below 1 the partitioner also weighs the custom ops (the
    block-sparse products) by their FLOPs (:mod:`sparsetrain.kernels.blocksparse.flops`) before recomputing one:
    left to its aggressive min-cut they counted as free, and every sparse forward product ran again in the
    backward (a tiny BERT's 10 of 10 at 0.7; BERT-base lost 8.5% of its rate at 0.7 on an H200)."""
    budget = float(args.activation_memory_budget)
    if budget == 1.0:
        return contextlib.nullcontext()
    settings = {"activation_memory_budget": budget}
    if hasattr(functorch_config, "is_non_builtin_to_include"):
        settings["is_non_builtin_to_include"] = True
    return functorch_config.patch(**settings)


def sparsify_model(model: nn.Module, scheduler, sparsify_kwargs: dict, format: str | None = None) -> dict:
    """Sparsify ``model`` as the run's scheduler wants it: per-layer target densities from the distribution
    (handed to ``scheduler.set_targets``), each layer started at ``scheduler.initial_density(target)`` (dense
    for gradual pruning and 2:4). ``format`` overrides the configured weight format (``sparsetrain flops``
    counts with ``"masked"``). Returns ``{name: SparseLinear}`` (empty for a dense run)."""
    from sparsetrain.nn.sparsify import select_linears, sparsify
    from sparsetrain.sparsity.distributions import layer_densities

    if not scheduler.sparse:
        return {}
    kw = dict(sparsify_kwargs)
    chosen = select_linears(model, kw["targets"], kw["exclude"])
    targets = layer_densities({n: tuple(m.weight.shape) for n, m in chosen.items()}, kw.pop("density"),
                              kw.pop("distribution"), kw.pop("density_overrides"))
    scheduler.set_targets(targets)
    if format is not None:
        kw["format"] = format
    return sparsify(model, density={n: scheduler.initial_density(d) for n, d in targets.items()}, **kw)


def build_model_and_data(spec: RunSpec, init_path: Path | None = None, init_key: str = "") -> tuple[nn.Module, Any]:
    """The run's model, sparsified as its scheduler wants and, with ``init_path``, given that checkpoint's weights
    and masks (before any optimizer exists); then its data (read after the model, so that a structure error costs
    no data loading), checked against the model's vocabulary."""
    from sparsetrain.training.checkpoint import load_model_state

    model = spec.build_model()
    sparsify_model(model, spec.scheduler, spec.sparsify_kwargs)
    if init_path is not None:   # block format: the values are resized for the loaded masks
        load_model_state(model, init_path, key=init_key)
    data = spec.build_data()
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if hasattr(data, "vocab_size") and vocab is not None and data.vocab_size > vocab:
        raise ValueError(f"data.vocab_size: the tokenizer has {data.vocab_size} tokens, the model {vocab}")
    return model, data


def build_optimizer(model: nn.Module, optimizer_cls: type[torch.optim.Optimizer], kwargs: dict,
                    no_decay: Sequence[str] = ()) -> torch.optim.Optimizer:
    """``optimizer_cls`` over the model's trainable parameters, without weight decay on biases, norms (any
    parameter of fewer than 2 dims) and parameters whose name contains a ``no_decay`` substring."""
    decay, plain = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (plain if p.ndim < 2 or any(s in name for s in no_decay) else decay).append(p)
    wd = kwargs.get("weight_decay", 0.0)
    groups = [{"params": decay, "weight_decay": wd}, {"params": plain, "weight_decay": 0.0}]
    rest = {k: v for k, v in kwargs.items() if k != "weight_decay"}
    return optimizer_cls([g for g in groups if g["params"]], **rest)


def optimizer_factory(optimizer_cls: type[torch.optim.Optimizer], kwargs: dict,
                      no_decay: Sequence[str] = ()) -> Callable[[nn.Module], torch.optim.Optimizer]:
    """``make(model) -> optimizer`` for :attr:`RunSpec.build_optimizer`."""
    return partial(build_optimizer, optimizer_cls=optimizer_cls, kwargs=dict(kwargs), no_decay=tuple(no_decay))


def lr_lambda(schedule: str, warmup: int, total: int, min_ratio: float) -> Callable[[int], float]:
    """Linear warmup to the peak, then constant / linear / cosine decay to ``min_ratio`` of the peak."""

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return min_ratio + (1 - min_ratio) * (1 - t)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return f


def lr_scheduler(optimizer: torch.optim.Optimizer, args: TrainArgs) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's learning-rate schedule (stepped once per optimizer step)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(args.lr_schedule, args.warmup_steps, args.max_steps, args.min_lr_ratio))


def plan_kernel_dispatch(model: nn.Module, tokens: int, cpu: bool) -> list[dict]:
    """On a GPU, let each sparse format choose its kernels for ``tokens`` rows per step (2:4 times itself
    against dense per layer shape); one record per planned layer for the run log. Nothing on the CPU."""
    if cpu:
        return []
    from sparsetrain.nn import plan_dispatch

    return plan_dispatch(model, tokens)


def apply_optimizer_settings(optimizer: torch.optim.Optimizer, lr_sched: torch.optim.lr_scheduler.LambdaLR,
                             fresh: list[dict], keys: Sequence[str]) -> None:
    """A resumed run's own settings over the checkpoint's, after both were loaded: ``fresh`` holds this run's
    param-group values (taken before the load), ``keys`` the changed config keys (``optim.optimizer.lr``...).
    The learning rate becomes this run's peak times the (this run's) schedule at the checkpoint's step."""
    names = {k.split(".", 2)[2] for k in keys if k.startswith("optim.optimizer.")}
    for group, new in zip(optimizer.param_groups, fresh, strict=True):
        for name in names & set(new):
            group[name] = new[name]
        group["initial_lr"] = new["initial_lr"]
    lr_sched.base_lrs = [new["initial_lr"] for new in fresh]
    for group, base, factor in zip(optimizer.param_groups, lr_sched.base_lrs, lr_sched.lr_lambdas, strict=True):
        group["lr"] = base * factor(lr_sched.last_epoch)
    lr_sched._last_lr = [group["lr"] for group in optimizer.param_groups]
