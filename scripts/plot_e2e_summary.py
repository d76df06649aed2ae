"""One picture of several `sparsetrain bench e2e --json` results: each model's sparse variants against the dense run
of the same invocation, throughput and peak memory side by side, with each run's GPU clock while busy.

    python scripts/plot_e2e_summary.py --out docs/benchmarks/e2e_h200_2026-11-30 \
        "BERT-base=bert.json" "BERT-large=bert_large.json" "ViT-B/16=vit.json" "ViT-L/16=vit_large.json"

Writes OUT.png and OUT.csv (model, variant, mode, rate, x dense, peak GB, x dense memory, clock MHz, power W).
"""
from __future__ import annotations

import argparse
import csv
import json

COLUMNS = ("model", "variant", "mode", "rate", "x_dense", "peak_gb", "x_dense_mem", "clock_mhz", "power_w")


def rows_of(label: str, path: str) -> list[dict]:
    """The table rows of one bench e2e JSON, labelled with the model."""
    with open(path) as f:
        table = json.load(f)["table"]
    return [{"model": label, **{k: r.get(k) for k in COLUMNS[1:]}} for r in table]


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sparse = [r for r in rows if r["variant"] != "dense"]
    labels = [f"{r['model']}\n{r['variant']}" for r in sparse]
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.1 * len(sparse) * 2), 4.2))
    for ax, key, title, fmt in ((axes[0], "x_dense", "throughput / dense's (same invocation)", "{:.2f}"),
                                (axes[1], "x_dense_mem", "peak memory / dense's", "{:.3f}")):
        vals = [r[key] or 0.0 for r in sparse]
        bars = ax.bar(range(len(sparse)), vals, color=["tab:orange" if r["variant"] == "semi24" else "tab:blue"
                                                        for r in sparse])
        ax.bar_label(bars, labels=[fmt.format(v) for v in vals], fontsize=8)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(sparse)), labels, fontsize=7)
        ax.set_title(title, fontsize=10)
    dense_clocks = {r["model"]: r["clock_mhz"] for r in rows if r["variant"] == "dense" and r["clock_mhz"]}
    note = "dense's SM clock under the power cap: " + ", ".join(f"{m} {c:,.0f} MHz" for m, c in dense_clocks.items())
    fig.suptitle("90% sparse encoder linears, compiled, recipe defaults; " + note, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path without extension: OUT.png and OUT.csv are written")
    ap.add_argument("runs", nargs="+", help="LABEL=bench_e2e.json")
    args = ap.parse_args(argv)
    rows = []
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep:
            ap.error(f"a run is LABEL=PATH, got {item!r}")
        rows += rows_of(label, path)
    with open(args.out + ".csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args.out + ".png")
    print(f"wrote {args.out}.png and {args.out}.csv ({len(rows)} runs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
