"""The one place Hydra is touched: find configs and recipes, compose, validate, instantiate.

Below this module nothing sees a DictConfig: :func:`build_run` turns a composed config into a
:class:`~sparsetrain.training.setup.RunSpec` of plain objects (model, data and optimizer builders, scheduler,
sparsify arguments, :class:`~sparsetrain.training.setup.TrainArgs`).
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from sparsetrain import preflight
from sparsetrain.launch_checks import check_dense_phase
from sparsetrain.preflight import ConfigError
from sparsetrain.training.setup import RunSpec, TrainArgs, optimizer_factory, sparsify_model

__all__ = ["ConfigError", "RunSpec", "build_run", "compose", "config_dir", "list_recipes", "recipes_dir",
           "sparsify_model", "validate"]

PACKAGE_ROOT = Path(__file__).resolve().parent
log = logging.getLogger(__name__)


# ---- where configs live --------------------------------------------------------------------------
def _resource_dir(package: str, fallback: str) -> Path:
    """Installed wheels ship configs/ and recipes/ as package data (sparsetrain.configs / .recipes);
    a source checkout uses the top-level folders."""
    try:
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                if Path(loc).is_dir():
                    return Path(loc)
    except (ImportError, ValueError):
        pass
    return PACKAGE_ROOT.parent / fallback


def config_dir() -> Path:
    return _resource_dir("sparsetrain.configs", "configs")


def recipes_dir() -> Path:
    return _resource_dir("sparsetrain.recipes", "recipes")


def list_recipes() -> dict[str, str]:
    """Recipe name -> one-line description (``recipe_info.description`` in the file)."""
    out = {}
    for path in sorted(recipes_dir().glob("*.yaml")):
        node = OmegaConf.load(path)
        info = node.get("recipe_info", {}) or {}
        out[path.stem] = str(info.get("description", ""))
    return out


def register_recipes() -> None:
    """Make recipes/*.yaml the Hydra config group ``recipe`` (package ``_global_``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for path in sorted(recipes_dir().glob("*.yaml")):
        node = OmegaConf.load(path)
        cs.store(group="recipe", name=path.stem, node=node, package="_global_")


def compose(overrides: list[str] | None = None, config_name: str = "train",
            return_hydra_config: bool = False) -> DictConfig:
    """Compose the training config without running a job (used by `sparsetrain flops`, the CLI's checks
    before Hydra runs, and tests)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_recipes()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []),
                             return_hydra_config=return_hydra_config)


# ---- instantiation with an allow-list (checked before anything is imported: sparsetrain.preflight) -------
resolve_target = preflight.resolve_target


def _user_modules(cfg: DictConfig) -> tuple[str, ...]:
    """``allowed_targets``: the user's module prefixes, whose callables the ``model`` and ``data`` slots accept."""
    return preflight.user_modules(_plain(cfg.get("allowed_targets")))


def _plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def _arg_key(key: str, message: str, kwargs: dict) -> str:
    """``data`` + "seq_len must be >= 3" -> ``data.seq_len``: builders start their messages with the
    argument's name."""
    first = message.replace(":", " ").replace("=", " ").split(" ", 1)[0]
    return f"{key}.{first}" if first in kwargs else key


def _call(node: Any, key: str, fn: Callable, **runtime: Any) -> Any:
    kwargs = {k: v for k, v in _plain(node).items() if k != "_target_"}
    kwargs.update(runtime)
    try:
        return fn(**kwargs)
    except (ValueError, TypeError, FileNotFoundError) as e:
        message = str(e)
        sub = _arg_key(key, message, kwargs)
        field = sub.rsplit(".", 1)[1]
        if sub != key and message.startswith((field + ": ", field + " ")):
            message = message[len(field):].lstrip(": ")
        raise ConfigError(sub, message) from e


def _check_args(fn: Callable, kwargs: Any, key: str) -> None:
    """A builder may carry ``check_args(**kwargs)``: cheap checks (no data, weights or network) run here."""
    check = getattr(fn, "check_args", None)
    if check is not None:
        _call(kwargs, key, check)


# ---- validation -----------------------------------------------------------------------------------
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
MIXED_PRECISION = ("no", "fp16", "bf16")
LR_SCHEDULES = ("constant", "linear", "cosine")


def _int(cfg: DictConfig, key: str, lo: int = 0, allow_none: bool = False) -> int | None:
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(key, f"must be an integer >= {lo}, got {value!r}")
    return value


def _choice(cfg: DictConfig, key: str, choices) -> str:
    value = OmegaConf.select(cfg, key)
    if value not in choices:
        raise ConfigError(key, f"must be one of {list(choices)}, got {value!r}")
    return value


def validate(cfg: DictConfig) -> None:
    """Check every value before any model, data or file is touched; raise ConfigError naming the key."""
    from sparsetrain.sparsity.distributions import DISTRIBUTIONS
    from sparsetrain.sparsity.layout import check_density
    from sparsetrain.sparsity.policies import Policy
    from sparsetrain.sparsity.schedulers import SparsityScheduler

    allowed = _user_modules(cfg)
    preflight.check_no_missing(cfg)
    # trainer
    for key, lo in (("max_steps", 1), ("batch_size", 1), ("grad_accum", 1), ("eval_every", 0), ("eval_batches", 1),
                    ("log_every", 1), ("checkpoint_every", 0), ("keep_checkpoints", 1), ("num_workers", 0)):
        _int(cfg, f"trainer.{key}", lo)
    preflight.check_bool(cfg.trainer, "copy_ahead")
    _choice(cfg, "trainer.mixed_precision", MIXED_PRECISION)
    preflight.check_compile(cfg.trainer)
    _choice(cfg, "trainer.device", ("auto", "cpu", "cuda"))
    preflight.check_machine(cfg.trainer.device, cfg.trainer.mixed_precision)
    _check_cuda_graph(cfg)
    clip = cfg.trainer.clip_grad_norm
    if clip is not None and (not isinstance(clip, (int, float)) or clip <= 0):
        raise ConfigError("trainer.clip_grad_norm", f"must be a positive number or null, got {clip!r}")
    kernel_options(cfg)
    resume = cfg.trainer.resume
    if resume not in (None, "auto") and not Path(str(resume)).is_dir():
        raise ConfigError("trainer.resume", f"must be 'auto', null or an existing checkpoint dir, got {resume!r}")
    init_from = cfg.trainer.get("init_from")   # its checkpoint is read (and checked) when the run starts
    if init_from is not None and (not isinstance(init_from, str) or not init_from.strip()):
        raise ConfigError("trainer.init_from", f"must be null or a checkpoint (or run) dir, got {init_from!r}")
    # optimizer
    resolve_target(cfg.optim.optimizer, "optim.optimizer", base=_optimizer_base())
    lr = cfg.optim.optimizer.get("lr")
    if not isinstance(lr, (int, float)) or lr <= 0:
        raise ConfigError("optim.optimizer.lr", f"must be a positive number, got {lr!r}")
    _choice(cfg, "optim.lr_schedule", LR_SCHEDULES)
    _int(cfg, "optim.warmup_steps", 0)
    ratio = cfg.optim.min_lr_ratio
    if not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {ratio!r}")
    # model and data
    model_fn = resolve_target(cfg.model, "model", allowed=allowed)
    data_fn = resolve_target(cfg.data, "data", allowed=allowed)
    arch = cfg.model.get("arch")
    data_kind = getattr(data_fn, "__name__", "")
    if arch == "bert" and data_kind == "build_image_data" or arch == "vit" and data_kind == "build_mlm_data":
        raise ConfigError("data", f"model.arch={arch!r} cannot train on data built by {data_kind}")
    _check_args(data_fn, cfg.data, "data")  # user data must exist before anything is built or written
    _data_runtime(cfg, data_fn)  # data.pixel_dtype against the run's precision
    _check_args(model_fn, _model_kwargs(cfg), "model")
    # sparsity
    sp = cfg.sparsity
    try:
        check_density(sp.density, "sparsity.density")
    except (TypeError, ValueError) as e:
        raise ConfigError("sparsity.density", f"must be a number in (0, 1], got {sp.density!r}") from e
    parse_block(cfg)
    _choice(cfg, "sparsity.distribution", tuple(DISTRIBUTIONS))
    _choice(cfg, "sparsity.init", ("random", "magnitude"))
    for k, v in (_plain(sp.density_overrides) or {}).items():
        try:
            check_density(v)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"sparsity.density_overrides.{k}", f"must be in (0, 1], got {v!r}") from e
    for key in ("targets", "exclude"):
        value = _plain(sp.get(key))
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ConfigError(f"sparsity.{key}", f"must be a list of name globs, got {value!r}")
    resolve_target(sp.scheduler, "sparsity.scheduler", base=SparsityScheduler)
    if "policy" in sp.scheduler:
        resolve_target(sp.scheduler.policy, "sparsity.scheduler.policy", base=Policy)
    scheduler = build_scheduler(cfg, quiet=True)  # constructing it validates its values (pure, cheap)
    if cfg.logger.wandb.enabled:
        _choice(cfg, "logger.wandb.mode", ("offline", "online", "disabled"))
    if cfg.trainer.get("compile") and cfg.trainer.get("compile_mode") in CUDA_GRAPH_MODES and not getattr(
            scheduler, "static_topology", False):
        raise ConfigError("trainer.compile_mode", f"{cfg.trainer.compile_mode!r} captures CUDA graphs, which keep "
                          f"tensor addresses, but the {getattr(scheduler, 'name', type(scheduler).__name__)} "
                          "scheduler rewrites the sparse layers' index tensors at mask updates; use "
                          "compile_mode=default or max-autotune-no-cudagraphs (or a static scheduler)")
    # the layout against the model's layers (meta device: names and shapes only)
    fmt = _check_format(cfg)
    preflight.check_format_fits_scheduler(fmt, str(sp.format), scheduler,
                                          sharded=os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true")
    skeleton = getattr(model_fn, "skeleton", None)
    if scheduler.sparse and skeleton is not None:
        model = _call(_model_kwargs(cfg), "model", skeleton)
        if model is not None:
            preflight.check_layout(model, fmt, _sparsify_kwargs(cfg))


def parse_block(cfg: DictConfig):
    """``sparsity.block`` as a :class:`~sparsetrain.sparsity.layout.Block` (``16``, ``[16, 32]``, ``"16x32"``)."""
    from sparsetrain.sparsity.layout import Block

    try:
        return Block.parse(_plain(cfg.sparsity.block))
    except ValueError as e:
        raise ConfigError("sparsity.block", str(e)) from e


def _check_format(cfg: DictConfig) -> type:
    """``sparsity.format``: a registered format name or the dotted path of a WeightFormat subclass (checked as
    a ``_target_`` is before its module is imported)."""
    from sparsetrain.nn.formats import FORMATS, resolve_format

    spec = cfg.sparsity.format
    if isinstance(spec, str) and spec not in FORMATS and "." in spec:
        preflight.check_target_path(spec, "sparsity.format")
    try:
        return resolve_format(spec)
    except ValueError as e:
        raise ConfigError("sparsity.format", str(e)) from e


def kernel_options(cfg: DictConfig):
    """``trainer.kernels`` as a :class:`~sparsetrain.kernels.KernelOptions`; KernelOptions checks the values
    itself and its ``"field: message"`` error becomes one naming ``trainer.kernels.<field>``."""
    from dataclasses import fields

    from sparsetrain.kernels import KernelOptions

    node = _plain(OmegaConf.select(cfg, "trainer.kernels"))
    if node is None:
        return KernelOptions()
    if not isinstance(node, dict):
        raise ConfigError("trainer.kernels", f"must be a mapping of kernel options, got {node!r}")
    known = {f.name for f in fields(KernelOptions)}
    unknown = sorted(set(node) - known)
    if unknown:
        raise ConfigError(f"trainer.kernels.{unknown[0]}", f"is not a kernel option; known: {sorted(known)}")
    try:
        return KernelOptions(**node)
    except ValueError as e:
        field, sep, message = str(e).partition(": ")
        if sep and field in known:
            raise ConfigError(f"trainer.kernels.{field}", message) from e
        raise ConfigError("trainer.kernels", str(e)) from e


def _optimizer_base() -> type:
    import torch

    return torch.optim.Optimizer


# ---- building the run ----------------------------------------------------------------------------
def build_scheduler(cfg: DictConfig, quiet: bool = False):
    """The scheduler ``sparsity.scheduler`` names. Keys it does not take (a recipe's keys for another
    scheduler) are dropped with one log line (none when ``quiet``)."""
    from sparsetrain.sparsity.schedulers import SparsityScheduler

    node = _plain(cfg.sparsity.scheduler)
    cls = resolve_target(node, "sparsity.scheduler", base=SparsityScheduler)
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    if isinstance(kwargs.get("policy"), dict):
        from sparsetrain.sparsity.policies import Policy

        pnode = kwargs["policy"]
        pcls = resolve_target(pnode, "sparsity.scheduler.policy", base=Policy)
        kwargs["policy"] = _call(pnode, "sparsity.scheduler.policy", pcls)
    accepted = inspect.signature(cls).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        # Keys a recipe set for another scheduler (e.g. `recipe=quickstart sparsity=static`): Hydra already
        # rejected misspelt command-line keys, so these can only come from composition.
        ignored = sorted(k for k in kwargs if k not in accepted)
        if ignored:
            if not quiet:
                log.info("sparsity.scheduler: %s does not use %s; ignoring them", cls.__name__, ignored)
            kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return _call(kwargs, "sparsity.scheduler", cls)


def _model_kwargs(cfg: DictConfig) -> dict:
    kwargs = {k: v for k, v in _plain(cfg.model).items() if k != "_target_"}
    if "build_mlm_data" in str(cfg.data._target_):
        kwargs.setdefault("vocab_size", cfg.data.vocab_size)
    return kwargs


def model_builder(cfg: DictConfig) -> Callable:
    allowed = _user_modules(cfg)
    fn = resolve_target(cfg.model, "model", allowed=allowed)
    return partial(_call, _model_kwargs(cfg), "model", fn)


def _model_says(cfg: DictConfig, attr: str) -> bool:
    tells = getattr(resolve_target(cfg.model, "model", allowed=_user_modules(cfg)), attr, None)
    return bool(tells is not None and _call(_model_kwargs(cfg), "model", tells))


def _data_runtime(cfg: DictConfig, data_fn: Callable) -> dict:
    """What a data builder takes from the rest of the run: ``emit_positions`` (``masked_positions`` in its batches
    only for a model whose builder says its forward takes them: ``build_model.takes_masked_positions``, arch=bert)
    and ``pixel_dtype`` (``auto`` resolved by :func:`preflight.pixel_dtype`, ``build_model.casts_pixels``)."""
    params, out = inspect.signature(data_fn).parameters, {}
    if "emit_positions" in params:
        out["emit_positions"] = _model_says(cfg, "takes_masked_positions")
    if "pixel_dtype" in params:
        out["pixel_dtype"] = preflight.pixel_dtype(str(cfg.data.get("pixel_dtype", "auto")),
                                                   str(cfg.trainer.mixed_precision), _model_says(cfg, "casts_pixels"))
    return out


def data_builder(cfg: DictConfig) -> Callable:
    allowed = _user_modules(cfg)
    fn = resolve_target(cfg.data, "data", allowed=allowed)
    return partial(_call, cfg.data, "data", fn, **_data_runtime(cfg, fn))


def predictions_per_seq(cfg: DictConfig) -> int | None:
    """P, the masked positions per sequence the MLM head runs on (``sparsetrain.flops``), from the config alone;
    None where the head runs on every token (no ``masked_positions`` in the batches)."""
    allowed = _user_modules(cfg)
    fn = resolve_target(cfg.data, "data", allowed=allowed)
    tells = getattr(fn, "predictions_per_seq", None)
    return None if tells is None else _call(cfg.data, "data", tells, **_data_runtime(cfg, fn))


def optimizer_builder(cfg: DictConfig) -> Callable:
    """``make(model) -> optimizer`` with no weight decay on biases and norms (torchtune style: runtime
    objects are passed at the call site, never through YAML)."""
    node = _plain(cfg.optim.optimizer)
    cls = resolve_target(node, "optim.optimizer", base=_optimizer_base())
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    return optimizer_factory(cls, kwargs, tuple(_plain(cfg.optim.no_decay) or ()))


def _sparsify_kwargs(cfg: DictConfig) -> dict:
    sp = cfg.sparsity
    return dict(
        targets=list(sp.targets), exclude=list(sp.exclude), density=float(sp.density),
        distribution=str(sp.distribution), density_overrides=_plain(sp.density_overrides) or None,
        block=parse_block(cfg), format=str(sp.format), init=str(sp.init), seed=int(cfg.seed),
    )


def _check_cuda_graph(cfg: DictConfig) -> None:
    """``trainer.cuda_graph``: true, false or auto; true only where a whole-step graph can work (the loop's
    ``sparsetrain.training.step.graph_mode`` decides auto the same way) and with a capturable optimizer. Several
    processes (``accelerate launch`` sets ``WORLD_SIZE``) can, unless FSDP shards the model."""
    import os

    import torch

    from sparsetrain.training.step import graph_mode

    t = cfg.trainer
    setting = t.get("cuda_graph", False)
    if setting not in (True, False, "auto"):
        raise ConfigError("trainer.cuda_graph", f"must be true, false or auto, got {setting!r}")
    if not setting:
        return
    on_cuda = t.device != "cpu" and torch.cuda.is_available()
    processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    cls = resolve_target(cfg.optim.optimizer, "optim.optimizer", base=_optimizer_base())
    try:
        graph_mode(setting, on_cuda, processes, str(t.mixed_precision),
                   t.get("compile_mode") if t.get("compile") else None,
                   optimizer_capturable="capturable" in inspect.signature(cls).parameters,
                   sharded=os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true")
    except ValueError as e:
        raise ConfigError("trainer.cuda_graph", str(e).split(": ", 1)[1]) from None


def build_run(cfg: DictConfig) -> RunSpec:
    """Validate ``cfg`` and turn it into a :class:`RunSpec` (nothing is loaded or written yet)."""
    validate(cfg)
    sp = cfg.sparsity
    scheduler = build_scheduler(cfg)
    check_dense_phase(cfg, scheduler)
    sparsify_kwargs = _sparsify_kwargs(cfg)
    t, o = cfg.trainer, cfg.optim
    args = TrainArgs(
        max_steps=t.max_steps, batch_size=t.batch_size, grad_accum=t.grad_accum,
        mixed_precision=t.mixed_precision, clip_grad_norm=t.clip_grad_norm, eval_every=t.eval_every,
        eval_batches=t.eval_batches, log_every=t.log_every, checkpoint_every=t.checkpoint_every,
        keep_checkpoints=t.keep_checkpoints, resume=t.resume, init_from=t.get("init_from"), device=t.device,
        num_workers=t.num_workers, copy_ahead=bool(t.get("copy_ahead", False)),
        compile=bool(t.get("compile", False)), compile_mode=t.get("compile_mode"),
        activation_memory_budget=float(t.get("activation_memory_budget", 1.0)), cuda_graph=t.get("cuda_graph", False),
        lr_schedule=o.lr_schedule, warmup_steps=o.warmup_steps, min_lr_ratio=float(o.min_lr_ratio),
        seed=int(cfg.seed), progress=bool(cfg.logger.progress), plot=bool(cfg.logger.plot),
        wandb=bool(cfg.logger.wandb.enabled), wandb_mode=str(cfg.logger.wandb.mode),
        wandb_project=str(cfg.logger.wandb.project), wandb_name=cfg.logger.wandb.name,
        recipe=str(cfg.recipe_info.name), kernels=kernel_options(cfg),
    )
    method = getattr(scheduler, "describe", lambda: str(sp.name))()
    return RunSpec(model_builder(cfg), data_builder(cfg), optimizer_builder(cfg), scheduler, sparsify_kwargs,
                   args, method, OmegaConf.to_container(cfg, resolve=True), block_label=str(_plain(sp.block)))


def run_dir_from_hydra() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


