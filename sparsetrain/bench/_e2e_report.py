"""The report of ``sparsetrain bench e2e``: what a run's windows give (the update cost, the steady rate), the
table's ratios (:func:`build_table`), its text (:func:`format_table`, the notes under it) and the bar chart
(:func:`plot`). Only the standard library is imported at module level."""
from __future__ import annotations


def steady_rate(run: dict, interval: float | None) -> dict | None:
    """What a full-length run gets, from a short one (``read_run``'s output): the rate of its update-free
    windows (:func:`~sparsetrain.training.metrics.clean_windows`) and, for a run with mask updates, that rate with one update's cost
    (:func:`update_cost`) spread over ``interval`` steps (the recipe's own). None without a clean window."""
    from sparsetrain.training.metrics import clean_windows, update_cost  # cheap: the bench imports no torch

    idx = clean_windows(run["windows"], run["updates"])
    seconds = sum(run["windows"][i][2] for i in idx)
    if not idx or seconds <= 0:
        return None
    clean = sum(run["window_items"][i] for i in idx) / seconds
    out = {"clean_rate": clean, "rate_at_interval": clean, "interval": interval}
    cost = update_cost(run["windows"], run["updates"]) if run["updates"] else None
    if cost and interval:
        out["update_s"] = cost["update_s"]
        out["rate_at_interval"] = clean / (1 + cost["update_s"] / (interval * cost["clean_step_s"]))
    return out


def build_table(runs: list[dict], baseline: str = "dense", gemm_tflops: float | None = None) -> list[dict]:
    """Rows of the table: each run with its ratios to the baseline of its round (same mode; the baseline's fastest
    mode), its memory ratio (of the steady-state peaks, ``peak_gb``), its model FLOP rate (``sparsetrain.flops``'
    count of what the step runs, per second) and that rate's share of ``gemm_tflops`` (a bf16 GEMM measured on the
    same GPU), and, for dynamic variants, the update cost amortised over the recipe's interval; then the rounds of
    one variant and mode combined (:func:`combine_rounds`)."""
    base = {(r.get("round", 1), r["mode"]): r for r in runs if r["variant"] == baseline and r.get("rate")}
    bests = {}
    for (rnd, _), b in base.items():
        bests[rnd] = max(bests.get(rnd, 0.0), b["rate"])
    rows = []
    for r in runs:
        row = dict(r)
        b, best = base.get((r.get("round", 1), r["mode"])), bests.get(r.get("round", 1))
        if r.get("rate"):
            row["x_dense"] = r["rate"] / b["rate"] if b else None
            row["x_dense_best"] = r["rate"] / best if best else None
        if r.get("peak_gb") and b and b.get("peak_gb"):
            row["x_dense_mem"] = r["peak_gb"] / b["peak_gb"]
        if r.get("rate") and r.get("flops_per_step") and r.get("items_per_step"):
            row["model_tflops"] = r["rate"] * r["flops_per_step"] / r["items_per_step"] / 1e12
            if gemm_tflops:
                row["of_gemm"] = row["model_tflops"] / gemm_tflops
        if r.get("dynamic") and r.get("windows") is not None:
            from sparsetrain.training.metrics import update_cost

            cost = update_cost(r["windows"], r.get("updates", []))
            row["update"] = cost
            if cost and r.get("recipe_interval"):
                cost["amortised_pct"] = 100 * cost["update_s"] / (r["recipe_interval"] * cost["clean_step_s"])
                steady = steady_rate(r, r["recipe_interval"]) if r.get("window_items") else None
                if steady and best:  # what a full-length run of the recipe gets, against dense's fastest mode
                    row["x_dense_at_interval"] = steady["rate_at_interval"] / best
        rows.append(row)
    return combine_rounds(rows)


#: Row fields averaged over rounds (each ratio taken against its own round's baseline first), and those maximised.
MEAN_KEYS = ("rate", "x_dense", "x_dense_best", "x_dense_mem", "model_tflops", "of_gemm", "x_dense_at_interval")
MAX_KEYS = ("peak_gb", "startup_peak_gb")


def combine_rounds(rows: list[dict]) -> list[dict]:
    """One row per variant and mode: with ``--repeat``, the rounds' rows combined (the last round's row, its rates
    and ratios the mean over the rounds that ran, its peaks the largest, ``x_dense_range`` the least and greatest
    ratio, ``rounds`` how many ran); a variant and mode with no good round keeps its error."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["variant"], r["mode"]), []).append(r)
    out = []
    for group in groups.values():
        good = [r for r in group if not r.get("error")]
        if len(group) == 1 or not good:
            out.append(group[-1])
            continue
        row = dict(good[-1], rounds=len(good), rounds_failed=len(group) - len(good))
        for key in MEAN_KEYS:
            vals = [r[key] for r in good if r.get(key) is not None]
            if vals:
                row[key] = sum(vals) / len(vals)
        for key in MAX_KEYS:
            vals = [r[key] for r in good if r.get(key) is not None]
            if vals:
                row[key] = max(vals)
        ratios = [r["x_dense"] for r in good if r.get("x_dense") is not None]
        if ratios:
            row["x_dense_range"] = (min(ratios), max(ratios))
        out.append(row)
    return out


def _num(v, fmt: str, none: str = "-") -> str:
    return none if v is None else format(v, fmt)


def _on_cublas(choices: dict | None) -> str:
    """``"fallback/tuned"``: of the block-sparse products the run's tuner chose for (a kind at one shape), how many
    run as cuBLAS on the dense weight; "-" for a run with none."""
    total = sum((choices or {}).values())
    return f"{choices.get('dense', 0)}/{total}" if total else "-"


def format_table(rows: list[dict]) -> str:
    unit = next((r["rate_key"].split("_")[0] for r in rows if r.get("rate_key")), "tokens")
    head = ["variant", "mode", f"{unit}/s", "x dense", "x dense best", "TFLOP/s", "% GEMM", "peak GB", "x mem",
            "startup GB", "capt/eager", "on cuBLAS", "update ms", "amortised", "x dense run"]
    rounds = any(r.get("rounds") for r in rows)
    if rounds:
        head.insert(4, "x dense range")
    lines = []
    for r in rows:
        if r.get("error"):
            lines.append([r["variant"], r["mode"], f"error: {r['error']}"])
            continue
        up = r.get("update") or {}
        amort = (f"{up['amortised_pct']:.2f}% /{r['recipe_interval']:.0f}" if up.get("amortised_pct") is not None
                 else ("n/a" if r.get("dynamic") else "-"))
        lines.append([r["variant"], r["mode"], _num(r.get("rate"), ",.0f"), _num(r.get("x_dense"), ".3f"),
                      _num(r.get("x_dense_best"), ".3f"), _num(r.get("model_tflops"), ".0f"),
                      _num(r.get("of_gemm") and 100 * r["of_gemm"], ".0f"), _num(r.get("peak_gb"), ".2f"),
                      _num(r.get("x_dense_mem"), ".3f"), _num(r.get("startup_peak_gb"), ".2f"),
                      f"{r.get('graph_captures', 0)}/{r.get('eager_steps', 0)}", _on_cublas(r.get("kernel_choices")),
                      _num(up.get("update_s") and 1e3 * up["update_s"], ".1f"), amort,
                      _num(r.get("x_dense_at_interval"), ".3f")])
        if rounds:
            lo_hi = r.get("x_dense_range")
            lines[-1].insert(4, f"{lo_hi[0]:.3f}-{lo_hi[1]:.3f} ({r['rounds']})" if lo_hi else "-")
    widths = [max([len(head[i]), *(len(ln[i]) for ln in lines if len(ln) == len(head))]) for i in range(len(head))]
    fmt = [head, ["-" * w for w in widths], *lines]
    out = ["  ".join(c.ljust(w) if i < 2 or len(ln) < len(head) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(ln, widths, strict=False))) for ln in fmt]
    return "\n".join(s.rstrip() for s in out)


def uneven_windows(runs: list[dict], tolerance: float = 0.03) -> list[str]:
    """A line for each run whose measured windows (after the first, none holding a mask update) differ in step time
    by more than ``tolerance``: something ran in one of them that the others did not (a phase switch, a recompile,
    another process on the host), and the run's rate, their mean, includes it."""
    from sparsetrain.training.metrics import clean_windows

    out = []
    for run in runs:
        windows = run.get("windows") or []
        idx = clean_windows(windows, run.get("updates") or [])
        ms = {windows[i][0]: 1e3 * windows[i][2] / windows[i][1] for i in idx if windows[i][1] and windows[i][2] > 0}
        if len(ms) >= 2 and max(ms.values()) > (1 + tolerance) * min(ms.values()):
            steps = ", ".join(f"to step {end}: {v:.1f}" for end, v in ms.items())
            rnd = f" round {run['round']}" if run.get("round", 1) > 1 else ""
            out.append(f"uneven windows: {run['variant']} {run['mode']}{rnd}: ms a step {steps} (its rate is their "
                       f"mean; something ran in the slower ones: see its metrics)")
    return out


FLOPS_NOTE = ("TFLOP/s: model FLOPs per second as `sparsetrain flops` counts the step (what runs: a sparse layer's "
              "active blocks; no elementwise work); % GEMM: of the bf16 GEMM rate measured first on this GPU ({})")
NOTE = ("update ms: one mask update's cost = (mean step time of windows with an update - that of windows without) "
        "x steps per window (window 1 left out); amortised: that cost over the recipe's own interval "
        "(max_steps / num_updates, shown after /) as a % of the update-free step time; x dense run: the update-free "
        "rate with that cost spread over the interval, against dense's fastest mode (what a full-length run gets; "
        "the benchmark itself updates far more often)")


def plot(rows: list[dict], path: str, title: str) -> None:
    """Bars of throughput / the baseline's fastest mode, one group per variant, one bar per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r["variant"] for r in rows))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(variants), 4))
    width = 0.8 / max(1, len(modes))
    hatched, top = False, 1.0
    for j, mode in enumerate(modes):
        cells = [next((r for r in rows if r["variant"] == v and r["mode"] == mode), {}) for v in variants]
        # a dynamic variant: what a full-length run gets (updates at the recipe's interval), not the benchmark's
        # own run, which updates far more often
        at_interval = [c.get("x_dense_at_interval") is not None for c in cells]
        vals = [(c.get("x_dense_at_interval") if a else c.get("x_dense_best")) or 0.0
                for c, a in zip(cells, at_interval, strict=True)]
        xs = [i + (j - (len(modes) - 1) / 2) * width for i in range(len(variants))]
        bars = ax.bar(xs, vals, width, label=mode)
        for bar, a in zip(bars, at_interval, strict=True):
            if a:
                bar.set_hatch("//")
                hatched = True
        ax.bar_label(bars, labels=[f"{v:.2f}" if v else "x" for v in vals], fontsize=8)
        top = max(top, *vals)
    handles, _ = ax.get_legend_handles_labels()
    if hatched:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//",
                             label="mask updates at the recipe's interval"))
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(variants)), variants)
    ax.set_ylabel("throughput / dense (its fastest mode)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, 1.3 * top)  # room for the legend above the bars
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
