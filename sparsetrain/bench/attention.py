"""SDPA's attention kernels side by side at the shapes of the recipes' models: which one a model should put first.

    sparsetrain bench attention                                  # ViT-B/16, ViT-L/16, BERT-base; no dropout
    sparsetrain bench attention --shapes vit_b --dropout 0.1 --json attn.json

For each shape, q/k/v are views of a [B, S, H·d] projection (as transformers' attention makes them), bf16; each
backend that can run it is timed forward and forward+backward (triton's ``do_bench`` medians), in ms for
``--layers`` layers, and its output compared with the first backend's. ``model.attn_implementation`` puts one of
them first in a BERT or ViT built here (``sdpa_cudnn``, ``sdpa_flash``, ``sdpa_efficient``; the ViT recipes:
cuDNN): docs/choosing.md, docs/benchmarks/e2e.md.
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from sparsetrain.bench._timing import bench

#: name -> (batch, heads, sequence, head dim) as the recipes run them
SHAPES = {"vit_b": (256, 12, 197, 64), "vit_l": (128, 16, 197, 64), "bert_b": (256, 12, 128, 64),
          "bert_b512": (64, 12, 512, 64), "bert_l": (256, 16, 128, 64)}
BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")


def _cuda_ms(fn: Callable[[], object], grads: list[torch.Tensor]) -> float:
    return bench(fn, grad_to_none=grads, rep=50)


def time_backends(shape: tuple[int, int, int, int], backends=BACKENDS, dropout: float = 0.0, layers: int = 12,
                  device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                  timer: Callable[[Callable[[], object], list], float] = _cuda_ms) -> list[dict]:
    """One row per backend: ``fwd_ms`` and ``fwd_bwd_ms`` for ``layers`` layers, ``max_err`` against the first
    backend that ran (without dropout), or ``error`` where the backend cannot run the shape."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = shape
    gen = torch.Generator(device=device).manual_seed(0)
    qkv = [torch.randn(b, s, h * d, device=device, dtype=dtype, generator=gen).view(b, s, h, d).transpose(1, 2)
           .requires_grad_() for _ in range(3)]
    dy = torch.randn(b, h, s, d, device=device, dtype=dtype, generator=gen)
    rows, ref = [], None
    for name in backends:
        kernel = [getattr(SDPBackend, name)]

        def fwd(kernel=kernel):
            with sdpa_kernel(kernel):
                return F.scaled_dot_product_attention(*qkv, dropout_p=dropout)

        def fwd_bwd():
            fwd().backward(dy)
        try:
            y = fwd().detach().float()
            row = {"shape": shape, "backend": name, "fwd_ms": timer(fwd, qkv) * layers,
                   "fwd_bwd_ms": timer(fwd_bwd, qkv) * layers}
        except RuntimeError as e:   # "No available kernel" for this shape, dtype or dropout
            rows.append({"shape": shape, "backend": name, "error": str(e).splitlines()[0][:100]})
            continue
        if dropout == 0.0:
            row["max_err"] = 0.0 if ref is None else (y - ref).abs().max().item()
            ref = y if ref is None else ref
        rows.append(row)
    return rows


def table(rows: list[dict], layers: int) -> str:
    lines = [f"{'shape (B, H, S, d)':22s} {'backend':20s} {'fwd ms':>8s} {'fwd+bwd ms':>11s} {'max err':>9s}"
             f"   (ms for {layers} layers)"]
    for r in rows:
        shape = str(tuple(r["shape"]))
        if "error" in r:
            lines.append(f"{shape:22s} {r['backend']:20s} cannot run: {r['error']}")
        else:
            err = f"{r['max_err']:.4f}" if "max_err" in r else "-"
            lines.append(f"{shape:22s} {r['backend']:20s} {r['fwd_ms']:8.2f} {r['fwd_bwd_ms']:11.2f} {err:>9s}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="sparsetrain bench attention", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="vit_b,vit_l,bert_b", help=f"comma separated, of {sorted(SHAPES)}")
    ap.add_argument("--layers", type=int, default=12, help="times are for this many layers")
    ap.add_argument("--dropout", type=float, default=0.0, help="attention dropout (training mode)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    names = args.shapes.split(",")
    unknown = sorted(set(names) - set(SHAPES))
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; known: {sorted(SHAPES)}")
    if not 0.0 <= args.dropout < 1.0 or args.layers < 1:
        ap.error("--dropout must be in [0, 1) and --layers >= 1")
    if not torch.cuda.is_available():
        print("sparsetrain bench attention needs a CUDA GPU", flush=True)
        return 2
    rows = [r for n in names for r in time_backends(SHAPES[n], dropout=args.dropout, layers=args.layers)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(table(rows, args.layers))
    return 0
