"""``sparsetrain export RUN_DIR --format hf|sparse --out DIR``: a trained run as a deployable model.

``hf``: a transformers checkpoint with zeros (``from_pretrained`` loads it). ``sparse``: a compressed
inference checkpoint (bitmap + packed values, see :mod:`sparsetrain.inference`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn


def load_trained_model(run_dir: str | Path, checkpoint: str | Path | None = None) -> nn.Module:
    """Rebuild the run's model from its ``config.yaml`` and load the newest (or given) checkpoint, with every
    sparse weight multiplied by its mask, as a plain transformers model of ``nn.Linear`` layers."""
    from omegaconf import OmegaConf

    from sparsetrain.config import model_builder
    from sparsetrain.sparsity.layout import Block, to_element_mask
    from sparsetrain.training.checkpoint import list_checkpoints

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run_dir} is not a sparsetrain run directory (no config.yaml)")
    cfg = OmegaConf.load(cfg_path)
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
    return model.eval()


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
    try:
        model = load_trained_model(a.run_dir, a.checkpoint)
    except (FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(a.out or Path(a.run_dir) / f"export-{a.format}")
    from sparsetrain import inference

    if a.format == "hf":
        inference.export_hf(model, out)
    else:
        inference.save_sparse(model, out, min_sparsity=a.min_sparsity, fmt=a.layer_format)
    print(f"wrote {a.format} export to {out}")
    return 0
