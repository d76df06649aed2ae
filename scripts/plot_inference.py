"""Plots bench_inference.json (`sparsetrain bench inference`): speed vs dense cuBLAS against sparsity, one panel
per weight shape, one line per compressed format, at one token count.

    python scripts/plot_inference.py $OUT/bench_inference.json --tokens 16 --png docs/benchmarks/inference_formats_n16.png
"""
from __future__ import annotations

import argparse
import json

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

FORMATS = [("speedup", "bitmap"), ("csl_speedup", "tiled CSL"), ("pair_speedup", "pair bitmap")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--png", required=True)
    args = ap.parse_args()
    with open(args.json) as f:
        info = json.load(f)
    rows = [r for r in info["rows"] if r["N"] == args.tokens]
    if not rows:
        raise SystemExit(f"{args.json}: no rows with N={args.tokens}")
    shapes = list(dict.fromkeys((r["M"], r["K"]) for r in rows))
    cols = min(3, len(shapes))
    nrows = -(-len(shapes) // cols)
    fig = Figure(figsize=(4.2 * cols, 3.4 * nrows))
    FigureCanvasAgg(fig)
    for i, (m, k) in enumerate(shapes):
        ax = fig.add_subplot(nrows, cols, i + 1)
        pts = sorted((r for r in rows if (r["M"], r["K"]) == (m, k)), key=lambda r: r["sparsity"])
        xs = [100 * r["sparsity"] for r in pts]
        for key, label in FORMATS:
            ys = [r.get(key) for r in pts]
            if any(y is not None for y in ys):
                ax.plot(xs, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_title(f"W {m} x {k}, N = {args.tokens}", fontsize=10)
        ax.set_xlabel("sparsity (%)")
        ax.set_ylabel("speed vs dense cuBLAS (x)")
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=8)
    fig.suptitle(f"{info.get('device', '')}, {info.get('date', '')[:10]}: skinny SpMM, compressed formats", fontsize=11)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
