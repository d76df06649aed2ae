"""Sparse inference: swap pruned ``nn.Linear`` layers for compressed ones; save and load compressed models.

Example (a magnitude-pruned Llama built from its config; nothing is downloaded)::

    model, swaps = to_inference(model, mode="compressed")  # Linear -> SparseInferenceLinear where sparse
    save_sparse(model, "out/sparse")                        # bitmaps + values + the dense rest + config.json
    model2 = load_sparse(lambda: LlamaForCausalLM(config), "out/sparse")
    export_hf(plain_model_with_zeros, "out/hf")             # save_pretrained, zeros included

Compressed layers go through :func:`sparsetrain.kernels.spmm_infer.spmm_infer`: up to 64 tokens per call run
the compressed kernel; more tokens (prefill) expand the weight to a transient dense matrix and call cuBLAS.
``mode="auto"`` (the default of :func:`to_inference`) compresses only above the measured break-even sparsity
(``BREAK_EVEN_SPARSITY``); on the H200 no sparsity beat cuBLAS on every shape (CUDA kernel: 0.78-1.05x at
N = 16), so "auto" keeps weights dense and ``mode="compressed"`` is the memory-saving choice
(docs/inference.md).
"""
from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .kernels._launch import max_tile_len
from .kernels.spmm_csl import CompressedWeight, CslWeight
from .kernels.spmm_infer import BREAK_EVEN_SPARSITY, FORMATS, SparseInferenceWeight, compress, spmm_infer
from .kernels.spmm_pair import PairWeight

FORMAT_VERSION = 1
MODES = ("auto", "compressed", "dense")
_INDEX = "sparse_index.json"
_TENSORS = "sparse_model.safetensors"
_CLASSES = {"bitmap": SparseInferenceWeight, "csl": CslWeight, "pair": PairWeight}
_STORED = {"bitmap": ("bitmap", "values", "row_offsets", "tile_offsets"),
           "csl": ("values", "locs", "sub_offsets", "tile_offsets"),
           "pair": ("bitmap", "values", "row_offsets", "tile_offsets")}


def weight_sparsity(weight: Tensor) -> float:
    """Fraction of exact zeros. Example: ``weight_sparsity(torch.tensor([[0., 1.]]))`` is 0.5."""
    return float((weight == 0).sum()) / max(weight.numel(), 1)


class SparseInferenceLinear(nn.Module):
    """``nn.Linear`` for inference with its weight stored compressed (or dense below break-even).

    The compressed tensors are buffers (they move with ``.to()`` / ``.half()`` and live in the state dict).
    Example: ``layer = SparseInferenceLinear.from_linear(pruned_linear); y = layer(x)``.
    """

    def __init__(self, in_features: int, out_features: int, bias: Tensor | None = None,
                 compressed: CompressedWeight | None = None, dense_weight: Tensor | None = None):
        super().__init__()
        if (compressed is None) == (dense_weight is None):
            raise ValueError("give exactly one of compressed and dense_weight")
        self.in_features, self.out_features = in_features, out_features
        self.block_m = compressed.block_m if compressed is not None else 0
        self.fmt = compressed.fmt if compressed is not None else "dense"
        if compressed is not None:
            if compressed.shape != (out_features, in_features):
                raise ValueError(f"compressed weight has shape {compressed.shape}, "
                                 f"expected {(out_features, in_features)}")
            for name, t in compressed.tensors().items():
                self.register_buffer(name, t)
            self.dense_weight = None
            # The kernels size shared memory by the longest tile: computed once here (one sync), not per call.
            self._max_tile_len = max_tile_len(compressed)
        else:
            self.register_buffer("dense_weight", dense_weight)
        self.register_buffer("bias", bias)

    @property
    def is_compressed(self) -> bool:
        return self.dense_weight is None

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        if self.is_compressed:  # new tile offsets may have a different longest tile
            self.__dict__.pop("_cw", None)
            self._max_tile_len = None
            self._max_tile_len = max_tile_len(self.compressed_weight())

    def compressed_weight(self) -> CompressedWeight:
        """The compressed weight as a kernel argument; a view of this module's buffers, rebuilt only when
        they are replaced (``.to()``, ``.half()``, ``load_state_dict``)."""
        bufs = tuple(getattr(self, name) for name in _STORED[self.fmt])
        cached = self.__dict__.get("_cw")
        if cached is not None and all(a is b for a, b in zip(cached[0], bufs)):
            return cached[1]
        shape = (self.out_features, self.in_features)
        w = _CLASSES[self.fmt].from_tensors(dict(zip(_STORED[self.fmt], bufs)), shape)
        if self._max_tile_len is not None:
            w._max_tile_len = self._max_tile_len
        self.__dict__["_cw"] = (bufs, w)
        return w

    @classmethod
    def from_linear(cls, linear: nn.Linear, min_sparsity: float = 0.5, block_m: int = 128,
                    mode: str = "auto", fmt: str = "auto") -> SparseInferenceLinear:
        """Wraps ``linear``; its weight is compressed when its sparsity >= ``min_sparsity`` and

        - ``mode="auto"``: also >= ``BREAK_EVEN_SPARSITY`` (measured: below it cuBLAS on the dense weight is
          faster, so the dense weight is kept);
        - ``mode="compressed"``: always (2.5-6x smaller weights; for N <= 16 tokens on an H200 0.8-1.1x of cuBLAS
          with the bitmap/CSL formats, 1.2-1.6x with ``fmt="pair"`` at 90% sparsity: docs/inference.md);
        - ``mode="dense"``: never.

        ``fmt``: the compressed format, "bitmap", "csl", "pair" (more bytes, faster decode) or "auto" (the one of
        bitmap and CSL with fewer bytes; see ``compress``).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be an nn.Linear, got {type(linear).__name__}")
        if not 0.0 <= min_sparsity <= 1.0:
            raise ValueError(f"min_sparsity must be in [0, 1], got {min_sparsity}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if fmt not in FORMATS:
            raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach().clone()
        auto = max(min_sparsity, BREAK_EVEN_SPARSITY)
        threshold = {"auto": auto, "compressed": min_sparsity, "dense": 2.0}[mode]
        if weight_sparsity(weight) >= threshold:
            return cls(linear.in_features, linear.out_features, bias,
                       compressed=compress(weight, block_m=block_m, fmt=fmt))
        return cls(linear.in_features, linear.out_features, bias, dense_weight=weight.clone())

    def forward(self, x: Tensor) -> Tensor:
        if self.is_compressed:
            return spmm_infer(x, self.compressed_weight(), self.bias)
        return F.linear(x, self.dense_weight, self.bias)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with the dense weight (zeros included)."""
        weight = self.compressed_weight().to_dense() if self.is_compressed else self.dense_weight
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        if not self.is_compressed:
            return f"in_features={self.in_features}, out_features={self.out_features}, dense"
        w = self.compressed_weight()
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"sparsity={w.sparsity:.3f}, format={self.fmt}, bytes={w.nbytes()}")


@dataclass(frozen=True)
class LayerSwap:
    """One ``nn.Linear`` that :func:`to_inference` replaced."""

    name: str
    shape: tuple[int, int]
    sparsity: float
    compressed: bool   # False: kept dense inside SparseInferenceLinear (below break-even)
    dense_bytes: int
    stored_bytes: int


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def _selected(name: str, targets: Sequence[str] | None) -> bool:
    return targets is None or any(fnmatch.fnmatchcase(name, pattern) for pattern in targets)


def to_inference(model: nn.Module, min_sparsity: float = 0.5, targets: Sequence[str] | None = None,
                 block_m: int = 128, mode: str = "auto", fmt: str = "auto") -> tuple[nn.Module, list[LayerSwap]]:
    """Swaps (in place) every ``nn.Linear`` with weight sparsity >= ``min_sparsity`` (and whose qualified name
    matches one of the ``targets`` globs, if given) for a :class:`SparseInferenceLinear`; ``mode`` as in
    :meth:`SparseInferenceLinear.from_linear` ("auto" keeps dense weights below the measured break-even),
    ``fmt`` the compressed format ("auto": per layer, the one with fewer bytes).

    Returns the model and one :class:`LayerSwap` per swapped layer.
    Example: ``model, swaps = to_inference(model, targets=["*.mlp.*"], mode="compressed")``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(targets, str):
        raise TypeError("targets must be a sequence of glob strings, not one string")
    swaps = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or not _selected(name, targets):
            continue
        sparsity = weight_sparsity(module.weight)
        if sparsity < min_sparsity:
            continue
        layer = SparseInferenceLinear.from_linear(module, min_sparsity, block_m, mode, fmt)
        _set_module(model, name, layer)
        stored = (layer.compressed_weight().nbytes() if layer.is_compressed
                  else layer.dense_weight.numel() * layer.dense_weight.element_size())
        swaps.append(LayerSwap(name, tuple(module.weight.shape), sparsity, layer.is_compressed,
                               module.weight.numel() * module.weight.element_size(), stored))
    return model, swaps


def to_dense_linears(model: nn.Module) -> nn.Module:
    """Inverse of :func:`to_inference` (in place): every SparseInferenceLinear back to ``nn.Linear``."""
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseInferenceLinear):
            _set_module(model, name, module.to_linear())
    return model


def export_hf(model: nn.Module, out_dir: str) -> None:
    """``model.save_pretrained(out_dir)`` with the zeros written densely (loads anywhere with
    ``from_pretrained``). SparseInferenceLinear layers, if any, are first turned back into ``nn.Linear``."""
    if not hasattr(model, "save_pretrained"):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    to_dense_linears(model)
    model.save_pretrained(out_dir)


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
    save_file(tensors, os.path.join(out_dir, _TENSORS))
    # The compressed layers need inputs of their values' dtype: load_sparse casts the model to it.
    dtypes = [tensors[f"{name}.values"].dtype for name in layers]
    index = {"format_version": FORMAT_VERSION, "layers": layers, "aliases": aliases,
             "dtype": str(dtypes[0]).removeprefix("torch.") if dtypes else None,
             "swaps": [asdict(s) for s in swaps]}
    with open(os.path.join(out_dir, _INDEX), "w") as f:
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
    dtype. Example: ``load_sparse(lambda: LlamaForCausalLM(cfg), path)``.
    """
    from safetensors.torch import load_file

    model = model_or_factory if isinstance(model_or_factory, nn.Module) else model_or_factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_or_factory must be (or build) an nn.Module, got {type(model).__name__}")
    with open(os.path.join(out_dir, _INDEX)) as f:
        index = json.load(f)
    if index.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{out_dir} has format_version {index.get('format_version')}, "
                         f"this code reads {FORMAT_VERSION}")
    if index.get("dtype"):
        model = model.to(getattr(torch, index["dtype"]))  # compressed layers take inputs of their own dtype
    tensors = load_file(os.path.join(out_dir, _TENSORS), device=str(device) if device is not None else "cpu")
    for alias, key in index["aliases"].items():
        tensors[alias] = tensors[key]
    for name, info in index["layers"].items():
        m, k = info["shape"]
        fmt = info.get("fmt", "bitmap")  # checkpoints written before the CSL format are all bitmap
        if fmt not in _STORED:
            raise ValueError(f"{out_dir}: layer {name} has unknown format {fmt!r}")
        stored = {part: tensors[f"{name}.{part}"] for part in _STORED[fmt]}
        weight = _CLASSES[fmt].from_tensors(stored, (m, k))
        _set_module(model, name, SparseInferenceLinear(k, m, tensors.get(f"{name}.bias"), compressed=weight))
    model.load_state_dict(tensors, strict=True)
    return model.to(device) if device is not None else model
