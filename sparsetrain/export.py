"""``sparsetrain export RUN_DIR --format hf|sparse --out DIR``: a trained run as a deployable model.

``hf``: a transformers checkpoint with zeros (``from_pretrained`` loads it). ``sparse``: a compressed
inference checkpoint (bitmap + packed values, see :mod:`sparsetrain.inference`). Both folders also hold what
turns raw inputs into model inputs, rebuilt from the run's ``config.yaml`` by the data package itself: the
run's tokenizer (text: the WordPiece trained on the run's text, from the data cache) or an image processor
(images: the resize and normalisation the training data used). So an ``hf`` export works as is::

    fill = pipeline("fill-mask", model="runs/quickstart/DATE/export-hf")

and a ``sparse`` export loads through :func:`sparsetrain.inference.load_sparse` with a model of its class::

    config = AutoConfig.from_pretrained(out)
    model = load_sparse(lambda: AutoModelForMaskedLM.from_config(config), out).eval()
    fill = pipeline("fill-mask", model=model, tokenizer=AutoTokenizer.from_pretrained(out))
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _run_config(run_dir: str | Path):
    from omegaconf import OmegaConf

    cfg_path = Path(run_dir) / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a sparsetrain run directory (no config.yaml)")
    return OmegaConf.load(cfg_path)


def load_trained_model(run_dir: str | Path, checkpoint: str | Path | None = None) -> nn.Module:
    """Rebuild the run's model from its ``config.yaml`` and load the newest (or given) checkpoint, with every
    sparse weight multiplied by its mask, as a plain transformers model of ``nn.Linear`` layers (a BERT trained
    with the masked-positions head comes back as the ``BertForMaskedLM`` it is to everyone else, and a model
    trained with ``model.fused_qkv`` with its separate query, key and value projections)."""
    from omegaconf import OmegaConf

    from sparsetrain.config import model_builder
    from sparsetrain.models.fused_qkv import unfuse_qkv
    from sparsetrain.models.mlm import to_masked_lm
    from sparsetrain.sparsity.layout import Block, to_element_mask
    from sparsetrain.training.checkpoint import list_checkpoints

    run_dir = Path(run_dir)
    cfg = _run_config(run_dir)
    ckpt = Path(checkpoint) if checkpoint else (list_checkpoints(run_dir / "checkpoints") or [None])[-1]
    if ckpt is None or not (ckpt / "pytorch_model.bin").is_file():
        raise FileNotFoundError(f"no finished checkpoint under {run_dir / 'checkpoints'}")
    model = model_builder(cfg)()
    state = torch.load(ckpt / "pytorch_model.bin", map_location="cpu", weights_only=True)
    blk = cfg.sparsity.block
    block = Block.parse(OmegaConf.to_container(blk) if OmegaConf.is_config(blk) else blk)
    clean = {}
    for key, value in state.items():
        if key.endswith(".mask"):
            continue
        mkey = key[: -len("weight")] + "mask" if key.endswith(".weight") else None
        if mkey and mkey in state:
            value = value * to_element_mask(state[mkey].bool(), block).to(value.dtype)
        clean[key] = value
    missing, unexpected = model.load_state_dict(clean, strict=False)
    missing = [k for k in missing if not k.endswith("decoder.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {ckpt} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return to_masked_lm(unfuse_qkv(model)).eval()


def load_preprocessor(run_dir: str | Path, model: nn.Module | None = None) -> Any | None:
    """The run's tokenizer (``sparsetrain.data.build_mlm_data``) or image processor (``build_image_data``),
    rebuilt from its ``config.yaml``; None for data it cannot describe (synthetic images, a user's builder).

    The tokenizer is the data builder's own: a WordPiece run reads it from the data cache, where the packed
    training ids are stored together with the tokenizer that produced them. Given the trained ``model``, a
    tokenizer with more tokens than the model's vocabulary (the cache was rebuilt from other text) is refused.

    Example:
        >>> load_preprocessor("runs/quickstart/2026-11-25_10-00-00").tokenize("To be, or not")
        ['to', 'be', ',', 'or', 'not']
    """
    from sparsetrain.config import data_builder

    cfg = _run_config(run_dir)
    target = str(cfg.data._target_)
    if "build_mlm_data" in target:  # the test config.model_builder uses for "this is MLM text"
        saved = Path(run_dir) / "tokenizer"  # written by the run itself (runs since 2026-11-25)
        if saved.is_dir():
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(saved))
        else:
            tokenizer = data_builder(cfg)().tokenizer
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is not None and len(tokenizer) > vocab:
            raise RuntimeError(f"data.tokenizer: the tokenizer rebuilt from the run's data has {len(tokenizer)} "
                               f"tokens, the trained model {vocab}: the data cache no longer holds the run's "
                               "tokenizer")
        return tokenizer
    if "build_image_data" in target:
        return _image_processor(cfg, model)
    return None


def _image_processor(cfg, model: nn.Module | None):
    """A ViT image processor doing what ``sparsetrain.data.build_image_data`` does to an image: bilinear resize
    to ``data.image_size``, pixels scaled to [0, 1], then normalised (digits: the training split's mean/std
    that the data builder fits; image folders and hub sets: mean 0.5, std 0.5)."""
    import transformers
    from transformers.image_utils import PILImageResampling

    from sparsetrain.config import data_builder

    data = cfg.data
    source = str(data.get("source", "digits"))
    if source == "synthetic":  # noise images: there is no transform to reproduce
        return None
    channels = int(getattr(getattr(model, "config", None), "num_channels", data.get("num_channels", 3)))
    mean, std = 0.5, 0.5
    if source == "digits":  # 8x8 digits in [0, 1] (x/16) like an 8-bit image's pixels x/255
        train = data_builder(cfg)().train
        mean, std = float(train.mean), float(train.std)
    size = int(data.image_size)
    # transformers >= 5 names the PIL-backed processor apart (the default one needs torchvision); both save
    # the same preprocessor_config.json, which AutoImageProcessor reads either way.
    cls = getattr(transformers, "ViTImageProcessorPil", None) or transformers.ViTImageProcessor
    return cls(do_resize=True, size={"height": size, "width": size}, resample=PILImageResampling.BILINEAR,
               do_rescale=True, rescale_factor=1 / 255, do_normalize=True, image_mean=[mean] * channels,
               image_std=[std] * channels)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="sparsetrain export", description=__doc__.splitlines()[0])
    p.add_argument("run_dir")
    p.add_argument("--format", choices=("hf", "sparse"), default="hf")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/export-FORMAT)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint dir (default: the newest)")
    p.add_argument("--min-sparsity", type=float, default=0.5,
                   help="sparse format: layers with fewer zeros stay dense")
    p.add_argument("--layer-format", choices=("auto", "bitmap", "csl", "pair"), default="auto",
                   help="sparse format: compressed layout of each layer (auto: fewest bytes; pair: fastest decode)")
    a = p.parse_args(argv)
    try:  # everything that can fail is read before anything is written
        model = load_trained_model(a.run_dir, a.checkpoint)
        preprocessor = load_preprocessor(a.run_dir, model)
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out or Path(a.run_dir) / f"export-{a.format}")
    from sparsetrain import inference

    if a.format == "hf":
        inference.export_hf(model, out)
    else:
        inference.save_sparse(model, out, min_sparsity=a.min_sparsity, fmt=a.layer_format)
    extra = ""
    if preprocessor is not None:
        preprocessor.save_pretrained(out)
        extra = " with its " + ("tokenizer" if hasattr(preprocessor, "convert_tokens_to_ids") else "image processor")
    print(f"wrote {a.format} export{extra} to {out}")
    return 0
