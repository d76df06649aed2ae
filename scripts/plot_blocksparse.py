"""Plots the linear section of bench_blocksparse.json (scripts/bench_blocksparse.py): forward+backward speed vs
dense cuBLAS against density, one panel per layer shape, one line per block size (dotted: the same from GPU
busy time; dashed: both sides replayed from a CUDA graph; each where the run recorded it); the peer's forward at
10% density as a marker. Several JSON files may be given: a later file's rows replace an earlier file's (e.g. a
re-run of the 16x16 rows only).

    python scripts/plot_blocksparse.py $OUT/bench_blocksparse.json [more.json] --png docs/blocksparse_linear.png
"""
from __future__ import annotations

import argparse
import json

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def load_rows(paths: list[str]) -> tuple[dict, dict]:
    """``{shape: {"dense": ..., "b16_d0.1": ...}}`` merged over the files, and the first file's env section."""
    rows, env = {}, {}
    for path in paths:
        with open(path) as f:
            res = json.load(f)["results"]
        env = env or res.get("env", {})
        for shape, row in res.get("linear", {}).items():
            if shape == "tuned" or not isinstance(row, dict):
                continue
            merged = rows.setdefault(shape, {})
            for key, val in row.items():
                if isinstance(val, dict) and "error" not in val:
                    merged[key] = val
    return rows, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--png", required=True)
    ap.add_argument("--where", default="", help="device and date for the title when the JSON has no env section")
    args = ap.parse_args()
    rows, env = load_rows(args.json)
    shapes = [s for s in rows if any(k.startswith("b") for k in rows[s])]
    if not shapes:
        raise SystemExit("no linear rows in " + ", ".join(args.json))
    cols = min(2, len(shapes))
    nrows = -(-len(shapes) // cols)
    fig = Figure(figsize=(5.0 * cols, 3.6 * nrows))
    FigureCanvasAgg(fig)
    for i, shape in enumerate(shapes):
        ax = fig.add_subplot(nrows, cols, i + 1)
        row = rows[shape]
        blocks = sorted({int(k[1:].split("_")[0]) for k in row if k.startswith("b")})
        for b in blocks:
            pts = sorted((float(k.split("_d")[1]), v["speedup"]["fwd_bwd"]) for k, v in row.items()
                         if k.startswith(f"b{b}_d"))
            line = ax.plot([100 * d for d, _ in pts], [s for _, s in pts], marker="o", label=f"ours {b}x{b}")[0]
            gpu = sorted((float(k.split("_d")[1]), v["speedup"]["fwd_bwd_gpu"]) for k, v in row.items()
                         if k.startswith(f"b{b}_d") and "fwd_bwd_gpu" in v["speedup"])
            if gpu:  # GPU busy time (no host gaps): shows where the eager call is host-bound
                ax.plot([100 * d for d, _ in gpu], [s for _, s in gpu], ls=":", color=line.get_color(),
                        label=f"ours {b}x{b}, GPU time")
            graph = sorted((float(k.split("_d")[1]), v["speedup"]["fwd_bwd_graph"]) for k, v in row.items()
                           if k.startswith(f"b{b}_d") and v["speedup"].get("fwd_bwd_graph"))
            if graph:  # both sides replayed from a CUDA graph (no host work per call)
                ax.plot([100 * d for d, _ in graph], [s for _, s in graph], ls="--", marker=".",
                        color=line.get_color(), label=f"ours {b}x{b}, CUDA graph")
            peer = row.get(f"b{b}_d0.1", {}).get("speedup", {}).get("peer_fwd")
            if peer:
                ax.plot([10], [peer], marker="x", ls="none", color=line.get_color(),
                        label=f"bsr_dense_mm {b}x{b} (fwd only)")
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        i_f, o_f = shape.split("x")
        ax.set_title(f"{i_f} → {o_f}, fwd+bwd", fontsize=10)
        ax.set_xlabel("density (%)")
        ax.set_ylabel("speed vs dense cuBLAS (x)")
        ax.set_xticks([10, 25, 50])
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=6, loc="upper right")
    where = ", ".join(x for x in (env.get("gpu", ""), str(env.get("date", ""))[:10]) if x) or args.where
    fig.suptitle(f"{where}: block-sparse linear, 16384 tokens, bf16" if where else
                 "block-sparse linear, 16384 tokens, bf16",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
