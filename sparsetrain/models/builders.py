"""BERT and ViT models from transformers configs, by named size; pretrained models for users.

Every size uses an intermediate (MLP) width of 4x hidden and 64-dimensional heads, as the original
BERT and ViT papers do. Models are randomly initialised unless ``arch="hf"``. ``arch="bert"`` builds a
:class:`~sparsetrain.models.mlm.BertForMaskedPositionsLM` (its MLM head runs on the masked positions only);
a pretrained model keeps its class and its full head (:func:`takes_masked_positions` tells which).
"""

from __future__ import annotations

import functools
import json
import pickle
from pathlib import Path
from typing import Any

# (layers, hidden, heads) per architecture and size.
MODEL_SIZES: dict[str, dict[str, tuple[int, int, int]]] = {
    "bert": {
        "tiny": (2, 128, 2),
        "mini": (4, 256, 4),
        "small": (4, 512, 8),
        "medium": (8, 512, 8),
        "base": (12, 768, 12),
        "large": (24, 1024, 16),
    },
    "vit": {
        "tiny": (12, 192, 3),
        "small": (12, 384, 6),
        "base": (12, 768, 12),
        "large": (24, 1024, 16),
    },
}
ARCHS = ("bert", "vit", "hf")
TASKS = ("mlm", "image-classification")


def _size(arch: str, size: str) -> tuple[int, int, int]:
    if size not in MODEL_SIZES[arch]:
        raise ValueError(f"unknown size {size!r} for arch={arch!r}; sizes: {list(MODEL_SIZES[arch])}")
    return MODEL_SIZES[arch][size]


def _check_overrides(config_cls, overrides: dict[str, Any]) -> None:
    # transformers configs accept any keyword silently; a misspelt override would be lost without this.
    defaults = config_cls()
    unknown = sorted(k for k in overrides if not hasattr(defaults, k))
    if unknown:
        raise ValueError(f"overrides {unknown} are not fields of {config_cls.__name__}")


def build_config(
    arch: str,
    size: str = "tiny",
    vocab_size: int | None = None,
    seq_len: int = 128,
    image_size: int = 224,
    patch_size: int = 16,
    num_channels: int = 3,
    num_labels: int = 10,
    attn_implementation: str = "eager",
    **overrides: Any,
):
    """Return the transformers config that :func:`build_model` would instantiate (cheap: no weights).

    >>> build_config("vit", "large").num_hidden_layers
    24
    """
    if arch == "bert":
        from transformers import BertConfig

        if vocab_size is None or vocab_size < 1:
            raise ValueError(f"arch='bert' needs vocab_size >= 1 (use MLMData.vocab_size), got {vocab_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        layers, hidden, heads = _size(arch, size)
        _check_overrides(BertConfig, overrides)
        fields = {
            "vocab_size": vocab_size,
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "intermediate_size": 4 * hidden,
            # Positions beyond seq_len are never used; keeping the table at seq_len saves parameters.
            "max_position_embeddings": seq_len,
        }
        fields.update(overrides)
        if fields["max_position_embeddings"] < seq_len:
            raise ValueError(
                f"max_position_embeddings={fields['max_position_embeddings']} < seq_len={seq_len}"
            )
        config = BertConfig(**fields)
    elif arch == "vit":
        from transformers import ViTConfig

        layers, hidden, heads = _size(arch, size)
        if patch_size < 1 or image_size % patch_size != 0:
            raise ValueError(
                f"image_size={image_size} must be a positive multiple of patch_size={patch_size}"
            )
        _check_overrides(ViTConfig, overrides)
        fields = {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "intermediate_size": 4 * hidden,
            "image_size": image_size,
            "patch_size": patch_size,
            "num_channels": num_channels,
            "num_labels": num_labels,
        }
        fields.update(overrides)
        config = ViTConfig(**fields)
    else:
        raise ValueError(f"arch must be one of {ARCHS[:2]} for a config built from a size, got {arch!r}")
    if config.hidden_size % config.num_attention_heads != 0:
        raise ValueError(
            f"hidden_size={config.hidden_size} is not divisible by "
            f"num_attention_heads={config.num_attention_heads}"
        )
    if attn_implementation in SDPA_FIRST or arch == "vit" and attn_implementation == "sdpa":
        attn_implementation = _unpadded_sdpa(SDPA_FIRST.get(attn_implementation))
    config._attn_implementation = attn_implementation
    return config


#: The attention implementation of the ViTs built here when "sdpa" is asked for: transformers' SDPA attention,
#: with no attention mask unless a padding mask is given (images are never padded). Under plain "sdpa",
#: transformers builds an all-True [B, 1, S, S] mask while torch.compile traces or a CUDA graph is captured (it
#: cannot look at the values then), and SDPA leaves its fused kernels for an unfused path with fp32 products
#: (ViT-B/16 compiled on an H200: ~33 ms of a 110 ms forward and backward). BERT avoids the same through
#: :class:`~sparsetrain.models.mlm.BertForMaskedPositionsLM`. The name is not saved with the config.
UNPADDED_SDPA = "sparsetrain_sdpa_unpadded"
#: ``attn_implementation`` values of a BERT or ViT built here that put one of SDPA's kernels first (on CUDA; PyTorch
#: falls back to the next where it cannot run), e.g. cuDNN's fused attention; "sdpa" lets PyTorch choose.
SDPA_FIRST = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}


def _preferring(backend: str, forward):
    """``forward`` (transformers' SDPA attention) with SDPA's ``backend`` first on CUDA tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rest = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)
    order = [getattr(SDPBackend, backend)] + [b for b in rest if b.name != backend]

    def attend(module, query, *args, **kwargs):
        if not query.is_cuda:
            return forward(module, query, *args, **kwargs)
        with sdpa_kernel(order, set_priority=True):
            return forward(module, query, *args, **kwargs)
    return attend


@functools.cache   # registered once per process and backend
def _unpadded_sdpa(backend: str | None = None) -> str:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def mask(*args, attention_mask=None, **kwargs):
        return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)

    # (transformers treats any name with "flash" in it as its own flash-attention kernels)
    name = UNPADDED_SDPA if backend is None else f"{UNPADDED_SDPA}_{backend.lower().replace('flash', 'fa')}"
    AttentionInterface.register(name, sdpa_attention_forward if backend is None
                                else _preferring(backend, sdpa_attention_forward))
    AttentionMaskInterface.register(name, mask)
    return name


def build_model(
    arch: str,
    size: str = "tiny",
    vocab_size: int | None = None,
    seq_len: int = 128,
    image_size: int = 224,
    patch_size: int = 16,
    num_channels: int = 3,
    num_labels: int = 10,
    name_or_path: str | None = None,
    attn_implementation: str = "eager",
    task: str = "mlm",
    fused_qkv: bool = False,
    fp32_residual: bool = True,
    patch_matmul: bool = False,
    **overrides: Any,
):
    """Build a randomly initialised BERT (masked LM) or ViT (image classifier), or load a pretrained one.

    ``arch="bert"`` builds a :class:`~sparsetrain.models.mlm.BertForMaskedPositionsLM` (a BertForMaskedLM
    that also takes ``masked_positions``). ``arch="bert"`` and ``"vit"`` take a ``size`` from :data:`MODEL_SIZES`; ``overrides`` are config
    fields (e.g. ``num_hidden_layers=1``). ``arch="hf"`` loads ``name_or_path`` with
    ``AutoModelForMaskedLM`` (``task="mlm"``) or ``AutoModelForImageClassification``
    (``task="image-classification"``, head resized to ``num_labels``). ``fused_qkv=True`` gives each attention
    one query/key/value projection (:mod:`sparsetrain.models.fused_qkv`: the same function, fewer and larger
    products; the sparsity layer sees one layer there). ``fp32_residual=False`` makes the LayerNorms return the
    autocast dtype, so the residual stream is 16-bit under mixed precision (:mod:`sparsetrain.models.norms`).
    ``patch_matmul=True`` computes a ViT's patch embedding as one matrix product instead of a convolution (the
    same Parameters and function, :mod:`sparsetrain.models.patches`).

    >>> model = build_model("bert", "tiny", vocab_size=1000, seq_len=64)
    >>> model.config.num_hidden_layers, model.config.hidden_size
    (2, 128)
    """
    check_model_args(arch, size, name_or_path=name_or_path, task=task, fused_qkv=fused_qkv,
                     fp32_residual=fp32_residual, patch_matmul=patch_matmul)
    if arch == "hf":
        model = _load_pretrained(name_or_path, task, num_labels, attn_implementation, overrides)
        return _fused(model, fused_qkv, fp32_residual, patch_matmul)

    config = build_config(
        arch,
        size,
        vocab_size=vocab_size,
        seq_len=seq_len,
        image_size=image_size,
        patch_size=patch_size,
        num_channels=num_channels,
        num_labels=num_labels,
        attn_implementation=attn_implementation,
        **overrides,
    )
    if arch == "bert":
        from sparsetrain.models.mlm import BertForMaskedPositionsLM

        model = BertForMaskedPositionsLM(config)
    else:
        from transformers import ViTForImageClassification

        model = ViTForImageClassification(config)
    return _fused(model, fused_qkv, fp32_residual, patch_matmul)


def _fused(model, fused_qkv: bool, fp32_residual: bool = True, patch_matmul: bool = False):
    """The model's fusions: the query/key/value projection where asked; the feed-forward blocks always
    (:mod:`sparsetrain.models.ffn`: GELU recomputed in the backward where both linears are block-sparse and
    ``trainer.kernels.gelu_recompute`` is on; transformers' modules otherwise); 16-bit LayerNorm outputs under
    autocast unless ``fp32_residual``; a ViT's patch embedding as one product where ``patch_matmul``."""
    from sparsetrain.models.ffn import use_gelu_mlp
    from sparsetrain.models.fused_qkv import fuse_qkv
    from sparsetrain.models.norms import use_16bit_residual
    from sparsetrain.models.patches import use_patch_matmul

    model = use_gelu_mlp(fuse_qkv(model) if fused_qkv else model)
    model = use_patch_matmul(model) if patch_matmul else model
    return model if fp32_residual else use_16bit_residual(model)


# ---- checks before anything is loaded, and the pretrained-model boundary -------------------------------------
#: Weight files ``from_pretrained`` reads from a local folder (one of them must be there).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


#: ``model_type`` values of pretrained models whose attention ``fused_qkv`` can fuse (sparsetrain.models.fused_qkv).
FUSABLE_MODEL_TYPES = ("bert", "vit")


def check_model_args(arch: str = "bert", size: str = "tiny", name_or_path: str | None = None, task: str = "mlm",
                     fused_qkv: bool = False, fp32_residual: bool = True, patch_matmul: bool = False,
                     attn_implementation: str = "sdpa", **_unused: Any) -> None:
    """Cheap checks of :func:`build_model`'s arguments (no weights read, no network): raises ValueError whose
    message starts with the argument's name. A local ``name_or_path`` must be a folder with a JSON
    ``config.json`` and an intact weight file (the safetensors header is read); a hub name is checked when
    it is loaded."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    for name, value in (("fused_qkv", fused_qkv), ("fp32_residual", fp32_residual), ("patch_matmul", patch_matmul)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
    if patch_matmul and arch == "bert":
        raise ValueError("patch_matmul: a ViT's patch embedding setting; arch 'bert' has none (leave it false)")
    if str(attn_implementation).startswith("sdpa_") and (arch == "hf" or attn_implementation not in SDPA_FIRST):
        raise ValueError(f"attn_implementation: {attn_implementation!r} is not one of eager, sdpa, "
                         f"{', '.join(SDPA_FIRST)}" + (" (a model built here: arch bert or vit)" if arch == "hf" else ""))
    if arch != "hf":
        _size(arch, size)
        return
    if not name_or_path or str(name_or_path) == "???":
        raise ValueError("name_or_path is required for arch='hf' (a model name or a local folder with weights)")
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    path = Path(str(name_or_path)).expanduser()
    if not path.exists():
        if str(name_or_path).startswith(("/", "./", "../", "~")) or str(name_or_path).count("/") > 1:
            raise ValueError(f"name_or_path {str(name_or_path)!r} is neither a local folder nor a hub model name")
        return  # a hub name: checked when loaded
    if not path.is_dir():
        raise ValueError(f"name_or_path {str(path)!r} must be a folder holding config.json and the weights")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"name_or_path {str(path)!r}: config.json is missing or not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise ValueError(f"name_or_path {str(path)!r}: config.json does not hold a JSON object")
    if fused_qkv and config.get("model_type") not in FUSABLE_MODEL_TYPES:
        raise ValueError(f"fused_qkv: {str(path)!r} holds a {config.get('model_type')!r} model; only "
                         f"{list(FUSABLE_MODEL_TYPES)} attention can be fused")
    weights = [path / w for w in WEIGHT_FILES if (path / w).is_file()]
    if not weights:
        raise ValueError(f"name_or_path {str(path)!r} holds no weight file (one of {list(WEIGHT_FILES)})")
    if weights[0].name == "model.safetensors":
        problem = _safetensors_problem(weights[0])
        if problem:
            raise ValueError(f"name_or_path {str(path)!r}: model.safetensors is damaged ({problem})")
    elif weights[0].stat().st_size == 0:
        raise ValueError(f"name_or_path {str(path)!r}: {weights[0].name} is empty")


def _safetensors_problem(file: Path) -> str | None:
    """What is wrong with a safetensors file's framing (header length, JSON header, data size), or None.
    Reads only the header."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"header length {n} exceeds the file size {size}"
        try:
            header = json.loads(f.read(n))
        except ValueError:
            return "the header is not JSON"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    ends = [v["data_offsets"][1] for k, v in header.items()
            if k != "__metadata__" and isinstance(v, dict) and len(v.get("data_offsets", ())) == 2]
    if 8 + n + max(ends, default=0) > size:
        return f"truncated: the tensors need {8 + n + max(ends)} bytes, the file has {size}"
    return None


def _load_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, ValueError, pickle.UnpicklingError, EOFError)
    try:
        from safetensors import SafetensorError

        errors += (SafetensorError,)
    except ImportError:  # pragma: no cover - safetensors ships with transformers
        pass
    return errors


def _load_pretrained(name_or_path: str, task: str, num_labels: int, attn_implementation: str,
                     overrides: dict[str, Any]):
    """``from_pretrained`` with its failures (missing or damaged files, unknown hub names) as one ValueError
    naming ``name_or_path``."""
    from transformers import AutoModelForImageClassification, AutoModelForMaskedLM

    try:
        if task == "mlm":
            return AutoModelForMaskedLM.from_pretrained(
                name_or_path, attn_implementation=attn_implementation, **overrides
            )
        return AutoModelForImageClassification.from_pretrained(
            name_or_path,
            num_labels=num_labels,
            ignore_mismatched_sizes=True,
            attn_implementation=attn_implementation,
            **overrides,
        )
    except _load_errors() as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"name_or_path {name_or_path!r} cannot be loaded: {first}") from e


def build_skeleton(arch: str, size: str = "tiny", **kwargs: Any):
    """The model :func:`build_model` would build, on the meta device (layer names and shapes, no memory, no
    weights read), to check a sparsity layout before anything is loaded; None for a pretrained model that
    is not a local folder (its structure is known only once loaded)."""
    import torch

    check_model_args(arch, size, **kwargs)
    if arch != "hf":
        with torch.device("meta"):
            return build_model(arch, size, **kwargs)
    path = Path(str(kwargs["name_or_path"])).expanduser()
    if not path.is_dir():
        return None
    from transformers import AutoConfig, AutoModelForImageClassification, AutoModelForMaskedLM

    task = kwargs.get("task", "mlm")
    try:
        config = AutoConfig.from_pretrained(str(path))
    except _load_errors() as e:
        raise ValueError(f"name_or_path {str(path)!r}: config.json cannot be read: {e}") from e
    auto = AutoModelForMaskedLM if task == "mlm" else AutoModelForImageClassification
    with torch.device("meta"):
        model = auto.from_config(config)
    return _fused(model, bool(kwargs.get("fused_qkv")))


def takes_masked_positions(arch: str = "bert", **_unused: Any) -> bool:
    """Whether :func:`build_model` builds a model whose forward takes ``masked_positions`` (its MLM head runs
    there only): ``arch="bert"``. A pretrained model (``arch="hf"``, any class) keeps its full head, so its
    batches must not carry the key.

    >>> takes_masked_positions("bert"), takes_masked_positions("hf", name_or_path="bert-base-uncased")
    (True, False)
    """
    return arch == "bert"


def casts_pixels(arch: str = "bert", **_unused: Any) -> bool:
    """Whether the first thing :func:`build_model`'s model does with its pixels is a product that autocast runs in
    the compute dtype (a ViT built here: its patch embedding), so pixels handed over in that dtype give the same
    step (``data.pixel_dtype=auto``). A pretrained model (``arch="hf"``) may do other work first: no.

    >>> casts_pixels("vit"), casts_pixels("hf", name_or_path="google/vit-base-patch16-224")
    (True, False)
    """
    return arch == "vit"


build_model.check_args = check_model_args  # what sparsetrain.config calls before anything is built
build_model.skeleton = build_skeleton
build_model.takes_masked_positions = takes_masked_positions  # whether the data should emit masked_positions
build_model.casts_pixels = casts_pixels  # whether image batches may come in the compute dtype


__all__ = ["ARCHS", "MODEL_SIZES", "TASKS", "build_config", "build_model", "build_skeleton", "check_model_args",
           "takes_masked_positions", "casts_pixels"]
