"""Plots the BERT-base training step of one or more bench_blocksparse.json files (``--sections bert``, best with
``--bert-graph --bert-profile``): ms per step of each model, eager (every run: the mean as the bar, each run as a
dot) and replayed from one CUDA graph, beside the GPU kernel time of the eager step where a run profiled it.
Eager steps are host-bound on slow hosts, so the runs' spread is shown rather than hidden.

    python scripts/plot_bert_step.py run1/bench_blocksparse.json run2/... --png docs/bert_step_r8.png
"""
from __future__ import annotations

import argparse
import json

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

SERIES = (("eager", "eager step"), ("graph", "one CUDA graph"), ("kernels", "kernels of the eager step"))


def load_runs(paths: list[str]) -> tuple[dict[str, dict[str, list[float]]], dict]:
    """``{model: {"eager": [ms, ...], "graph": [...], "kernels": [...]}}`` over the files (one value per file that
    measured it), and the first env section found."""
    out: dict[str, dict[str, list[float]]] = {}
    env: dict = {}
    for path in paths:
        with open(path) as f:
            res = json.load(f)["results"]
        env = env or res.get("env", {})
        bert = res.get("bert", {})
        for model, row in bert.items():
            if not isinstance(row, dict) or "step_ms" not in row:
                continue
            series = out.setdefault(model, {key: [] for key, _ in SERIES})
            series["eager"].append(row["step_ms"])
            if model in bert.get("graph_ms", {}):
                series["graph"].append(bert["graph_ms"][model])
            if model in bert.get("profile", {}):
                series["kernels"].append(sum(bert["profile"][model].values()))
    return out, env


def ratios(runs: dict[str, dict[str, list[float]]], series: str) -> dict[str, float]:
    """Tokens/s of each sparse model vs dense for one series: mean dense ms over mean model ms."""
    dense = runs.get("dense", {}).get(series, [])
    if not dense:
        return {}
    base = sum(dense) / len(dense)
    return {m: base / (sum(v[series]) / len(v[series])) for m, v in runs.items() if m != "dense" and v[series]}


def model_label(model: str) -> str:
    """``block16_d0.1`` -> ``16x16 blocks, 10%``; other names unchanged."""
    if not model.startswith("block") or "_d" not in model:
        return model
    b, d = model[len("block"):].split("_d")
    return f"{b}x{b} blocks, {float(d):.0%}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--png", required=True)
    ap.add_argument("--where", default="", help="device and date for the title when the JSON has no env section")
    args = ap.parse_args()
    runs, env = load_runs(args.json)
    if "dense" not in runs:
        raise SystemExit("no BERT dense step in " + ", ".join(args.json))
    models = ["dense"] + sorted(m for m in runs if m != "dense")
    fig = Figure(figsize=(7.5, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.26
    for j, (key, label) in enumerate(SERIES):
        xs, means = [], []
        for i, m in enumerate(models):
            vals = runs[m][key]
            if not vals:
                continue
            x = i + (j - 1) * width
            xs.append(x)
            means.append(sum(vals) / len(vals))
            if len(vals) > 1:
                ax.plot([x] * len(vals), vals, "k.", ms=4)
        if xs:
            bars = ax.bar(xs, means, width, label=label)
            rel = ratios(runs, key)
            for x, m, h in zip(xs, [m for m in models if runs[m][key]], means):
                if m in rel:
                    ax.text(x, h, f"{rel[m]:.2f}x", ha="center", va="bottom", fontsize=7,
                            color=bars.patches[0].get_facecolor())
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels([model_label(m) for m in models])
    ax.set_ylabel("ms per training step (lower is faster)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    where = ", ".join(x for x in (env.get("gpu", ""), str(env.get("date", ""))[:10]) if x) or args.where
    title = ("BERT-base MLM step, 64 x 128 tokens, 72 encoder linears sparse\n"
             "labels: tokens/s vs dense (ratio of the means)")
    ax.set_title(f"{where}\n{title}" if where else title, fontsize=9)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
