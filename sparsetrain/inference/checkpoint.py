"""The two checkpoint formats of a sparse model: Hugging Face ``save_pretrained`` with the zeros written densely
(:func:`export_hf`), and the compressed one (:func:`save_sparse` / :func:`load_sparse`): the compressed layers'
stored tensors + every other tensor of the state dict in one safetensors file, an index, and ``config.json``.
"""
from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from dataclasses import asdict

import torch
from torch import nn

from sparsetrain.inference.convert import LayerSwap, set_module, to_dense_linears, to_inference
from sparsetrain.inference.linear import WEIGHT_CLASSES, SparseInferenceLinear

FORMAT_VERSION = 1
INDEX_FILE = "sparse_index.json"
TENSORS_FILE = "sparse_model.safetensors"


def umask_file_mode(folder: str | os.PathLike) -> int:
    """The mode a plain ``open(path, "w")`` gives a new file in ``folder`` (0o644 under umask 022), found by
    creating a probe file rather than by ``os.umask``, which would change the process's umask for a moment."""
    probe = os.path.join(folder, f".mode-probe-{secrets.token_hex(6)}")
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return os.fstat(fd).st_mode & 0o777
    finally:
        os.close(fd)
        os.unlink(probe)


def _respect_umask(out_dir: str | os.PathLike) -> None:
    # safetensors writes through a private temp file (mode 0600) and renames it: give the weights the mode any
    # other file of the export gets, so a model exported under umask 022 is readable by its group and others.
    mode = umask_file_mode(out_dir)
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if name.endswith(".safetensors") and os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, mode)


def export_hf(model: nn.Module, out_dir: str) -> None:
    """``model.save_pretrained(out_dir)`` with the zeros written densely (loads anywhere with
    ``from_pretrained``). SparseInferenceLinear layers, if any, are first turned back into ``nn.Linear``."""
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    to_dense_linears(model)
    model.save_pretrained(out_dir)
    _respect_umask(out_dir)


def save_sparse(model: nn.Module, out_dir: str, min_sparsity: float = 0.5, fmt: str = "auto") -> list[LayerSwap]:
    """Writes a compressed checkpoint: ``sparse_model.safetensors`` (the compressed layers' bitmaps, values
    and offsets + every other tensor of the state dict), ``sparse_index.json`` (which layers are compressed,
    their shapes) and, for transformers models, ``config.json``.

    Plain ``nn.Linear`` layers with sparsity >= ``min_sparsity`` are compressed first (in place, through
    :func:`to_inference` with ``mode="compressed"`` and ``fmt``: a checkpoint is about size, so "auto" keeps each
    layer's smallest format). Returns the swaps made now.
    """
    from safetensors.torch import save_file

    _, swaps = to_inference(model, min_sparsity=min_sparsity, mode="compressed", fmt=fmt)
    os.makedirs(out_dir, exist_ok=True)
    layers = {name: {"shape": [m.out_features, m.in_features], "block_m": m.block_m, "fmt": m.fmt}
              for name, m in model.named_modules()
              if isinstance(m, SparseInferenceLinear) and m.is_compressed}
    tensors, aliases, seen = {}, {}, {}
    for key, t in model.state_dict().items():
        if t is None:
            continue
        ident = (t.data_ptr(), t.dtype, tuple(t.shape), t.storage_offset()) if t.numel() else None
        if ident is not None and ident in seen:  # tied weights: store once
            aliases[key] = seen[ident]
            continue
        if ident is not None:
            seen[ident] = key
        tensors[key] = t.detach().contiguous().cpu()
    save_file(tensors, os.path.join(out_dir, TENSORS_FILE))
    _respect_umask(out_dir)
    # The compressed layers need inputs of their values' dtype: load_sparse casts the model to it.
    dtypes = [tensors[f"{name}.values"].dtype for name in layers]
    index = {"format_version": FORMAT_VERSION, "layers": layers, "aliases": aliases,
             "dtype": str(dtypes[0]).removeprefix("torch.") if dtypes else None,
             "swaps": [asdict(s) for s in swaps]}
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=1)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config.to_json_file(os.path.join(out_dir, "config.json"))
    return swaps


def load_sparse(model_or_factory: nn.Module | Callable[[], nn.Module], out_dir: str,
                device: torch.device | str | None = None) -> nn.Module:
    """Loads a :func:`save_sparse` checkpoint into ``model_or_factory`` (a model of the same architecture, or
    a zero-argument callable that builds one): compressed layers become (compressed) SparseInferenceLinear,
    everything else is loaded with ``load_state_dict(strict=True)``; the model is cast to the checkpoint's
    dtype. Example: ``load_sparse(lambda: LlamaForCausalLM(cfg), path)``; a ``sparsetrain export --format sparse``
    folder holds ``config.json`` and the run's tokenizer or image processor too::

        config = AutoConfig.from_pretrained(path)
        model = load_sparse(lambda: AutoModelForMaskedLM.from_config(config), path).eval()
        fill = pipeline("fill-mask", model=model, tokenizer=AutoTokenizer.from_pretrained(path))
    """
    from safetensors.torch import load_file

    model = model_or_factory if isinstance(model_or_factory, nn.Module) else model_or_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_or_factory must be (or build) an nn.Module, got {type(model).__name__}")
    with open(os.path.join(out_dir, INDEX_FILE)) as f:
        index = json.load(f)
    if index.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{out_dir} has format_version {index.get('format_version')}, "
                         f"this code reads {FORMAT_VERSION}")
    if index.get("dtype"):
        model = model.to(getattr(torch, index["dtype"]))  # compressed layers take inputs of their own dtype
    tensors = load_file(os.path.join(out_dir, TENSORS_FILE), device=str(device) if device is not None else "cpu")
    for alias, key in index["aliases"].items():
        tensors[alias] = tensors[key]
    for name, info in index["layers"].items():
        m, k = info["shape"]
        fmt = info.get("fmt", "bitmap")  # checkpoints written before the CSL format are all bitmap
        if fmt not in WEIGHT_CLASSES:
            raise ValueError(f"{out_dir}: layer {name} has unknown format {fmt!r}")
        stored = {part: tensors[f"{name}.{part}"] for part in WEIGHT_CLASSES[fmt].TENSORS}
        weight = WEIGHT_CLASSES[fmt].from_tensors(stored, (m, k))
        set_module(model, name, SparseInferenceLinear(k, m, tensors.get(f"{name}.bias"), compressed=weight))
    model.load_state_dict(tensors, strict=True)
    return model.to(device) if device is not None else model
