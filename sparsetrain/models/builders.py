"""BERT and ViT models from transformers configs, by named size; pretrained models for users.

Every size uses an intermediate (MLP) width of 4x hidden and 64-dimensional heads, as the original
BERT and ViT papers do. Models are randomly initialised unless ``arch="hf"``.
"""

from __future__ import annotations

from typing import Any

# (layers, hidden, heads) per architecture and size.
MODEL_SIZES: dict[str, dict[str, tuple[int, int, int]]] = {
    "bert": {
        "tiny": (2, 128, 2),
        "mini": (4, 256, 4),
        "small": (4, 512, 8),
        "medium": (8, 512, 8),
        "base": (12, 768, 12),
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
    config._attn_implementation = attn_implementation
    return config


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
    **overrides: Any,
):
    """Build a randomly initialised BERT (masked LM) or ViT (image classifier), or load a pretrained one.

    ``arch="bert"`` and ``"vit"`` take a ``size`` from :data:`MODEL_SIZES`; ``overrides`` are config
    fields (e.g. ``num_hidden_layers=1``). ``arch="hf"`` loads ``name_or_path`` with
    ``AutoModelForMaskedLM`` (``task="mlm"``) or ``AutoModelForImageClassification``
    (``task="image-classification"``, head resized to ``num_labels``).

    >>> model = build_model("bert", "tiny", vocab_size=1000, seq_len=64)
    >>> model.config.num_hidden_layers, model.config.hidden_size
    (2, 128)
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, got {arch!r}")
    if arch == "hf":
        if not name_or_path:
            raise ValueError("arch='hf' needs name_or_path (a model name or a local folder with weights)")
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        from transformers import AutoModelForImageClassification, AutoModelForMaskedLM

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
        from transformers import BertForMaskedLM

        return BertForMaskedLM(config)
    from transformers import ViTForImageClassification

    return ViTForImageClassification(config)
