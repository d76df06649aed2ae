"""The plot of ``sparsetrain bench blocksparse --plot out.png``: forward+backward speed vs dense cuBLAS against
density, one panel per layer shape, one line per block size (dotted: from GPU busy time; dashed: both sides
replayed from a CUDA graph; each where the run recorded it); the peer's forward at 10% density as a marker.
Several result files may be merged (``--replot a.json b.json``): a later file's rows replace an earlier's."""
from __future__ import annotations

import json


def load_rows(paths: list[str]) -> tuple[dict, dict]:
    """``{shape: {"dense": ..., "b16_d0.1": ...}}`` merged over the files, and the first file's env section."""
    rows: dict = {}
    env: dict = {}
    for path in paths:
        with open(path) as f:
            res = json.load(f)["results"]
        env = env or res.get("env", {})
        merge_linear(rows, res.get("linear", {}))
    return rows, env


def merge_linear(rows: dict, linear: dict) -> dict:
    """Adds the rows of one run's linear section to ``rows`` (rows without an error replace earlier ones)."""
    for shape, row in linear.items():
        if shape == "tuned" or not isinstance(row, dict):
            continue
        merged = rows.setdefault(shape, {})
        for key, val in row.items():
            if isinstance(val, dict) and "error" not in val:
                merged[key] = val
    return rows


def _series(row: dict, b: int, field: str) -> list[tuple[float, float]]:
    return sorted((float(k.split("_d")[1]), v["speedup"][field]) for k, v in row.items()
                  if k.startswith(f"b{b}_d") and v["speedup"].get(field))


def plot_linear(rows: dict, env: dict, png: str, tokens: int | None = None) -> None:
    """Write the plot of the merged linear ``rows`` to ``png``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    shapes = [s for s in rows if any(k.startswith("b") for k in rows[s])]
    if not shapes:
        raise ValueError("no linear rows to plot")
    cols = min(2, len(shapes))
    nrows = -(-len(shapes) // cols)
    fig = Figure(figsize=(5.0 * cols, 3.6 * nrows))
    FigureCanvasAgg(fig)
    for i, shape in enumerate(shapes):
        ax = fig.add_subplot(nrows, cols, i + 1)
        row = rows[shape]
        for b in sorted({int(k[1:].split("_")[0]) for k in row if k.startswith("b")}):
            pts = _series(row, b, "fwd_bwd")
            line = ax.plot([100 * d for d, _ in pts], [s for _, s in pts], marker="o", label=f"ours {b}x{b}")[0]
            color = line.get_color()
            gpu = _series(row, b, "fwd_bwd_gpu")
            if gpu:  # GPU busy time (no host gaps): shows where the eager call is host-bound
                ax.plot([100 * d for d, _ in gpu], [s for _, s in gpu], ls=":", color=color,
                        label=f"ours {b}x{b}, GPU time")
            graph = _series(row, b, "fwd_bwd_graph")
            if graph:  # both sides replayed from a CUDA graph (no host work per call)
                ax.plot([100 * d for d, _ in graph], [s for _, s in graph], ls="--", marker=".", color=color,
                        label=f"ours {b}x{b}, CUDA graph")
            peer = row.get(f"b{b}_d0.1", {}).get("speedup", {}).get("peer_fwd")
            if peer:
                ax.plot([10], [peer], marker="x", ls="none", color=color, label=f"bsr_dense_mm {b}x{b} (fwd only)")
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        i_f, o_f = shape.split("x")
        ax.set_title(f"{i_f} → {o_f}, fwd+bwd", fontsize=10)
        ax.set_xlabel("density (%)")
        ax.set_ylabel("speed vs dense cuBLAS (x)")
        ax.set_xticks([10, 25, 50])
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=6, loc="upper right")
    where = ", ".join(x for x in (env.get("gpu", ""), str(env.get("date", ""))[:10]) if x)
    what = f"block-sparse linear, {tokens} tokens, bf16" if tokens else "block-sparse linear, bf16"
    fig.suptitle(f"{where}: {what}" if where else what, fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
