"""Checks run by :func:`sparsetrain.config.validate` before any model, data or file is touched: values left
``???``, ``_target_`` paths (checked before anything is imported), the machine (device, precision), the weight
format against the scheduler, and the sparsity layout against the model's layers (built on the meta device:
names and shapes, no memory, no weights read). Each raises :class:`ConfigError` naming the key.

>>> check_machine("cpu", "bf16", cuda_available=False)  # fine
>>> check_machine("cuda", "no", cuda_available=False)  # doctest: +IGNORE_EXCEPTION_DETAIL
Traceback (most recent call last):
ConfigError: trainer.device: ...
"""
from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["BUILDERS", "COMPILE_MODES", "ConfigError", "check_compile", "pixel_dtype", "check_format_fits_scheduler",
           "check_layout", "check_machine", "check_no_missing", "check_target_path", "resolve_target",
           "user_modules"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


class ConfigError(ValueError):
    """An invalid configuration value; the message starts with the offending key (``sparsetrain.config``
    re-exports it)."""

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"{key}: {message}")


def check_no_missing(cfg: DictConfig) -> None:
    """Every ``???`` value (``model=hf`` without ``model.name_or_path``, ``data=text_files`` without
    ``data.files``) is named before anything else happens."""
    missing = sorted(k for k in OmegaConf.missing_keys(cfg) if not str(k).startswith("hydra."))
    if missing:
        raise ConfigError(missing[0], f"needs a value: add {missing[0]}=... to the command line")


def check_compile(trainer: DictConfig) -> None:
    """``trainer.compile`` (a bool), ``trainer.compile_mode`` (null or one of :data:`COMPILE_MODES`) and
    ``trainer.activation_memory_budget`` (a number in (0, 1])."""
    check_bool(trainer, "compile")
    mode = trainer.get("compile_mode")
    if mode is not None and mode not in COMPILE_MODES:
        raise ConfigError("trainer.compile_mode", f"must be one of {list(COMPILE_MODES)}, got {mode!r}")
    budget = trainer.get("activation_memory_budget", 1.0)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1:
        raise ConfigError("trainer.activation_memory_budget", f"must be a number in (0, 1], got {budget!r}")


def check_bool(trainer: DictConfig, key: str, default: bool = False) -> None:
    """``trainer.<key>`` is true or false."""
    if not isinstance(trainer.get(key, default), bool):
        raise ConfigError(f"trainer.{key}", f"must be true or false, got {trainer.get(key)!r}")


def check_machine(device: str, mixed_precision: str, cuda_available: bool | None = None) -> None:
    """``trainer.device=cuda`` needs a GPU (never a silent CPU run); fp16 autocast needs one too (bf16 runs on
    the CPU)."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    if device == "cuda" and not cuda_available:
        raise ConfigError("trainer.device", "is 'cuda' but no CUDA GPU is visible; use trainer.device=cpu "
                                            "(or auto) to train on the CPU")
    on_cpu = device == "cpu" or not cuda_available
    if mixed_precision == "fp16" and on_cpu:
        raise ConfigError("trainer.mixed_precision", "fp16 needs a CUDA GPU and this run is on the CPU; use "
                                                     "trainer.mixed_precision=bf16 or no")


_COMPUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "no": "float32"}


def pixel_dtype(asked: str, mixed_precision: str, casts_pixels: bool) -> str:
    """``data.pixel_dtype`` as the run uses it: ``auto`` is the run's compute dtype where the model's first product
    reads the pixels (``casts_pixels``: the same step from pixels in that dtype), else float32. A 16-bit dtype other
    than the compute dtype, or any with a model that may do other work first, would change what it computes.

    >>> pixel_dtype("auto", "bf16", True), pixel_dtype("auto", "bf16", False), pixel_dtype("auto", "no", True)
    ('bfloat16', 'float32', 'float32')
    """
    compute = _COMPUTE_DTYPES.get(mixed_precision, "float32")
    if asked == "auto":
        return compute if casts_pixels else "float32"
    if asked != "float32" and (asked != compute or not casts_pixels):
        why = (f"trainer.mixed_precision={mixed_precision!r} computes in {compute}" if asked != compute
               else "the model may use its pixels before a product (only a ViT built by sparsetrain does not)")
        raise ConfigError("data.pixel_dtype", f"{asked} pixels would change the step: {why}; use auto or float32")
    return asked


def check_target_path(target: str, key: str) -> None:
    """What can be checked of a ``_target_`` without importing anything: a dotted path ``module.Name`` whose
    module is not part of the standard library (no stdlib class is a sparsetrain policy, scheduler, format
    or optimizer, and importing some stdlib modules has effects, e.g. ``this``)."""
    module_name, _, attr = target.rpartition(".")
    if not module_name or not attr or not all(p.isidentifier() for p in target.split(".")):
        raise ConfigError(key, f"{target!r} must be a dotted path 'module.Name'")
    top = module_name.split(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        raise ConfigError(key, f"{target!r} comes from the standard library module {top!r}; name a class from "
                               "sparsetrain, torch or your own module")


#: What a function slot (a ``_target_`` called to build something, not a class checked against a base) accepts
#: from sparsetrain itself: its builders, by name. Any other callable there must come from a module the config
#: lists in ``allowed_targets``, the user's own code: a helper of the package that happens to be callable (one that
#: starts a process, say) is no model builder.
BUILDERS = {
    "model": ("sparsetrain.models.build_model", "sparsetrain.models.builders.build_model"),
    "data": ("sparsetrain.data.build_mlm_data", "sparsetrain.data.text.build_mlm_data",
             "sparsetrain.data.build_image_data", "sparsetrain.data.vision.build_image_data"),
}
_SLOT_NAMES = {"model": "model builder", "data": "data builder"}
#: Modules that are not the user's own: ``allowed_targets`` may not list them (their callables would all become
#: builders).
_NOT_USER_MODULES = ("sparsetrain", "torch", "transformers", "accelerate", "hydra", "omegaconf", "datasets")


def user_modules(allowed_targets: Any) -> tuple[str, ...]:
    """``allowed_targets``: prefixes of the user's own modules, whose callables the function slots accept. The
    package's and its dependencies' modules are refused (naming the key): listing them would make any of their
    callables a builder."""
    if allowed_targets is not None and not isinstance(allowed_targets, (list, tuple)):
        raise ConfigError("allowed_targets", f"must be a list of module prefixes, got {allowed_targets!r}")
    prefixes = tuple(str(p) for p in (allowed_targets or ()))
    for prefix in prefixes:
        top = prefix.split(".")[0]
        if not top or top in _NOT_USER_MODULES or top in sys.stdlib_module_names:
            raise ConfigError("allowed_targets", f"{prefix!r} is not a module of your own; list the prefixes of "
                                                 f"your modules (e.g. 'my_models.'); sparsetrain's builders "
                                                 f"({', '.join(b for v in BUILDERS.values() for b in v[::2])}) "
                                                 f"are accepted without it")
    return prefixes


def _locate(target: str, key: str) -> Any:
    """Import ``target``'s module and return the attribute; only after :func:`check_target_path`
    (syntax, no standard-library module) has passed, so a refused target never runs module code."""
    check_target_path(target, key)
    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(key, f"cannot import module {module_name!r} for _target_ {target!r}: {e}") from e
    if not hasattr(module, attr):
        raise ConfigError(key, f"module {module_name!r} has no {attr!r} (_target_ {target!r})")
    return getattr(module, attr)


def resolve_target(node: Any, key: str, base: type | None = None, allowed: tuple[str, ...] = ()):
    """Check a ``_target_``, then import it. A class slot (``base``: policies, schedulers, optimizers) takes a
    subclass of ``base`` from any module, so users' policies work from YAML: the module is imported (as
    ``python -m`` would run the user's own code) only once the path is a dotted name outside the standard
    library, then the class is checked. A function slot (``model``, ``data``) takes one of sparsetrain's
    :data:`BUILDERS` for that slot, or a callable from a module under ``allowed`` (:func:`user_modules`); that
    is checked on the string, before anything is imported."""
    if not isinstance(node, (dict, DictConfig)) or "_target_" not in node:
        raise ConfigError(key, "needs a _target_")
    target = str(node["_target_"])
    if base is None and target not in BUILDERS.get(key, ()) and not target.startswith(tuple(allowed)):
        what = _SLOT_NAMES.get(key, "builder")
        raise ConfigError(key + "._target_", f"{target!r} is not a {what} (one of "
                                             f"{list(BUILDERS.get(key, ())[::2])}, or a callable of a module of "
                                             f"your own listed in allowed_targets)")
    obj = _locate(target, key + "._target_")
    if base is not None and not (inspect.isclass(obj) and issubclass(obj, base)):
        raise ConfigError(key + "._target_", f"{target!r} is not a {base.__module__}.{base.__name__} subclass")
    if base is None and not callable(obj):
        raise ConfigError(key + "._target_", f"{target!r} is not callable")
    return obj


def _caps(fmt: type) -> Any:
    try:
        return fmt().caps  # capabilities may depend on the instance (2:4 derives its mask by default)
    except TypeError:  # a user format whose constructor needs arguments: checked when it is built
        return None


def check_format_fits_scheduler(fmt: type, format_spec: str, scheduler, sharded: bool = False) -> None:
    """The format's capabilities against what the scheduler's updates do, so that the first mask update cannot
    fail mid-run: N:M formats (``FormatCaps.needs_nm``, e.g. ``2:4``) need N:M masks (``produces_nm``) or masks
    that never change (``static_topology``); a format that keeps the active count and cannot shrink it, or trains a
    dense master weight, cannot follow a scheduler that shrinks the count (``shrinks_count``, gradual pruning)."""
    caps = _caps(fmt)
    if caps is None or not scheduler.sparse:
        return
    name = getattr(scheduler, "name", type(scheduler).__name__)
    if caps.needs_nm and not (scheduler.produces_nm or scheduler.static_topology):
        raise ConfigError("sparsity.format", f"{format_spec!r} keeps 2:4 masks, but the {name} scheduler writes "
                                             "unstructured masks at its updates; use sparsity=sparse_then_dense "
                                             "or sparsity=static with it, or sparsity.format=masked")
    if scheduler.shrinks_count and ((caps.keeps_count and not caps.can_shrink) or caps.straight_through
                                    or caps.needs_nm):
        raise ConfigError("sparsity.format", f"the {name} scheduler shrinks the active count at its updates, "
                                             f"which {format_spec!r} cannot hold; use sparsity.format=masked")
    if scheduler.shrinks_count and caps.keeps_count and sharded:
        raise ConfigError("sparsity.format", f"the {name} scheduler shrinks the active count at its updates, which "
                                             f"{format_spec!r} does by rebuilding its values, and FSDP shards them; "
                                             "use sparsity.format=masked with FSDP")


def check_layout(model, format_cls: type, sparsify_kwargs: dict) -> None:
    """The sparsity layout against the model's layers: every ``targets`` glob matches a linear, the block
    divides every selected weight, ``density_overrides`` globs match and leave a valid density, and an N:M
    format gets element blocks and dimensions it can tile. ``model`` may live on the meta device."""
    from sparsetrain.nn.sparsify import select_linears
    from sparsetrain.sparsity.distributions import layer_densities
    from sparsetrain.sparsity.layout import Block

    kw = sparsify_kwargs
    try:
        chosen = select_linears(model, kw["targets"], kw["exclude"])
    except (TypeError, ValueError) as e:
        raise ConfigError("sparsity.targets", str(e)) from e
    block: Block = kw["block"]
    caps = _caps(format_cls)
    for name, lin in chosen.items():
        out_f, in_f = (int(n) for n in lin.weight.shape)
        if out_f % block.rows or in_f % block.cols:
            raise ConfigError("sparsity.block", f"{block} does not divide layer {name} ({out_f}, {in_f})")
        if caps is not None and caps.needs_nm:
            if block != Block(1, 1):
                raise ConfigError("sparsity.block", f"must be 1 with sparsity.format={kw['format']} (element "
                                                    f"masks), got {block}")
            if out_f % 4 or in_f % 4:
                raise ConfigError("sparsity.format", f"{kw['format']!r} needs both dimensions divisible by 4; "
                                                     f"layer {name} is ({out_f}, {in_f})")
    shapes = {n: tuple(m.weight.shape) for n, m in chosen.items()}
    try:
        layer_densities(shapes, kw["density"], kw["distribution"], kw["density_overrides"])
    except ValueError as e:
        key = "sparsity.density_overrides" if "density_overrides" in str(e) else "sparsity.density"
        raise ConfigError(key, str(e)) from e
