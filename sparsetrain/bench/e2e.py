"""End-to-end training throughput: dense and sparse variants through the real training loop, eager, CUDA graph and
compiled + CUDA graph.

    sparsetrain bench e2e --out $OUT --json $OUT/e2e.json --plot $OUT/e2e.png
    sparsetrain bench e2e --variants dense,static_b16 --modes graph --steps 40 --breakdown none
    sparsetrain bench e2e --model vit --variants dense,static_b16 --modes compiled
    sparsetrain bench e2e --recipe-map "tiny=quickstart:sparsity=static trainer=cpu_small" --variants tiny

Each variant in each mode is one ``python -m sparsetrain.cli train`` process (fresh memory statistics and tuner
caches) with the same overrides: ``trainer.max_steps``, ``batch_size``, no eval, no periodic checkpoints, quiet
logger, and the mode's: ``trainer.cuda_graph=false`` (eager), ``true`` (graph) or ``true`` with
``trainer.compile=true`` (compiled: torch.compile's fused kernels inside the whole-step graph). The table reads each run's summary.json
(median window throughput, graph captures / eager steps) and metrics.jsonl (peak memory, window times, mask
updates). For a dynamic variant the cost of one mask update is derived from the windows: the mean step time of
windows that contain an update minus that of windows that do not, times the steps per window (window 1, the
warm-up, is left out), then amortised over the recipe's own interval (its ``max_steps / num_updates``) as a
share of the update-free step time. ``--breakdown`` adds, per variant and mode, one profiled run (in a process
of its own) that splits three steps into kernel categories and host gaps (:mod:`sparsetrain.bench._e2e_breakdown`).
docs/benchmarks/e2e.md explains the columns.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sparsetrain.bench._child import Stopped, run_child
from sparsetrain.bench._e2e_breakdown import format_breakdown, profile_child

HYDRA_HINT = "HYDRA_FULL_ERROR"
RESULTS_FILE = "e2e_results.json"

#: The overrides of each mode: eager steps; the whole step replayed from a CUDA graph; the same with the model
#: compiled (torch.compile's default mode, its fused elementwise kernels captured in the graph).
MODES = {"eager": ["trainer.cuda_graph=false", "trainer.compile=false"],
         "graph": ["trainer.cuda_graph=true", "trainer.compile=false"],
         "compiled": ["trainer.cuda_graph=true", "trainer.compile=true"]}


@dataclass(frozen=True)
class Variant:
    """One thing to benchmark: a recipe and overrides of its own (``--recipe-map name=recipe[:overrides]``)."""

    name: str
    recipe: str
    overrides: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Variant:
        """``"static_b64=bert_static:sparsity.block=64 trainer=gpu"`` -> Variant (overrides split on spaces)."""
        name, sep, rest = text.partition("=")
        recipe, _, overrides = rest.partition(":")
        if not sep or not name.strip() or not recipe.strip():
            raise ValueError(f"--recipe-map wants name=recipe[:overrides], got {text!r}")
        return cls(name.strip(), recipe.strip(), tuple(overrides.split()))


# ViT: ViT-B/16 at 224 px on synthetic images (vit_base_dense / vit_base_static; the 2:4 variant is the
# sparse-then-dense recipe with ViT-B and the 2:4 phase for the whole run).
DEFAULT_VARIANTS = {
    "bert": (Variant("dense", "bert_dense"), Variant("static_b64", "bert_static", ("sparsity.block=64",)),
             Variant("static_b16", "bert_static"), Variant("dynamic_b16", "bert_phase1_dynamic")),
    "vit": (Variant("dense", "vit_base_dense"), Variant("static_b64", "vit_base_static", ("sparsity.block=64",)),
            Variant("static_b16", "vit_base_static"),
            Variant("semi24", "vit_24_sparse_then_dense", ("model=vit_base", "sparsity.scheduler.sparse_fraction=1.0"))),
}
DEFAULT_BATCH = {"bert": 256, "vit": 256}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sparsetrain bench e2e", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(DEFAULT_VARIANTS), default="bert")
    p.add_argument("--variants", help="comma separated (default: the model's variants and every --recipe-map)")
    p.add_argument("--recipe-map", action="append", default=[], type=Variant.parse, metavar="NAME=RECIPE[:OVR]",
                   help="add or replace a variant: a recipe and space-separated overrides")
    p.add_argument("--baseline", default="dense", help="the variant ratios are taken against")
    p.add_argument("--modes", default="eager,graph,compiled", help="comma separated: eager, graph, compiled")
    p.add_argument("--extra", action="append", default=[], help="more overrides for every run (space separated)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--batch", type=int, help="per-step batch (default: 256)")
    p.add_argument("--seq", type=int, default=128, help="data.seq_len of text models")
    p.add_argument("--log-every", type=int, default=10, help="steps per measured window")
    p.add_argument("--updates", type=int, help="mask updates of dynamic variants in the run (default: chosen "
                                                "so that updates fall inside windows, with update-free windows)")
    p.add_argument("--breakdown", default="dense,static_b16", help="variants profiled per kernel category "
                                                                   "(none: skip)")
    p.add_argument("--profile-at", type=int, default=5, help="the breakdown profiles steps N..N+2")
    p.add_argument("--out", help="run directories (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep run directories (checkpoints are always deleted)")
    p.add_argument("--resume", action="store_true", help="reuse finished runs of the same command in --out")
    p.add_argument("--timeout", type=float, default=None, help="seconds per run")
    p.add_argument("--json", help="write results here")
    p.add_argument("--plot", help="write a PNG bar chart here")
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown {bad}; use some of {','.join(MODES)}")
    if args.steps < 1 or args.log_every < 1:
        p.error("--steps and --log-every must be >= 1")
    table = {v.name: v for v in (*DEFAULT_VARIANTS[args.model], *args.recipe_map)}
    names = args.variants.split(",") if args.variants else list(table)
    if unknown := [n for n in names if n not in table]:
        p.error(f"--variants: unknown {unknown}; known: {sorted(table)} (add one with --recipe-map)")
    args.variant_list = [table[n] for n in names]
    args.breakdown = [] if args.breakdown in ("", "none") else [b for b in args.breakdown.split(",") if b in names]
    args.batch = args.batch or DEFAULT_BATCH[args.model]
    args.extra = [o for chunk in args.extra for o in chunk.split()]
    return args


# ---- what each run is -----------------------------------------------------------------------------------
def recipe_facts(variant: Variant) -> dict:
    """What the recipe, as configured (its own overrides, none of the bench's), says: whether its topology
    changes (a scheduler taking ``num_updates``), its steps and update interval, whether the data has a
    ``seq_len``."""
    import importlib
    import inspect

    from omegaconf import OmegaConf

    from sparsetrain.config import compose

    cfg = compose([f"recipe={variant.recipe}", *variant.overrides])
    sched = OmegaConf.to_container(cfg.sparsity.scheduler, resolve=False)
    module, _, name = str(sched["_target_"]).rpartition(".")
    params = inspect.signature(getattr(importlib.import_module(module), name)).parameters
    steps, interval, n = int(cfg.trainer.max_steps), sched.get("interval"), sched.get("num_updates")
    dynamic = "num_updates" in params
    return {"dynamic": dynamic, "recipe_steps": steps, "recipe_num_updates": n if dynamic else None,
            "recipe_interval": (interval or steps / n) if dynamic and (interval or n) else None,
            "start": float(sched.get("start", 0.0)), "end": float(sched.get("end", 1.0)),
            "has_interval": "interval" in sched,
            "text": OmegaConf.select(cfg, "data.seq_len") is not None}


def update_steps(num_updates: int, steps: int, start: float = 0.0, end: float = 1.0) -> list[int]:
    """The steps at which a ``num_updates`` scheduler updates in a run of ``steps`` (PruneRegrow's spacing)."""
    from sparsetrain.sparsity.schedules import UpdateSchedule

    s, e = int(start * steps), max(1, int(round(end * steps)))
    n = min(num_updates, max(1, e - s - 1))
    sched = UpdateSchedule.from_num_updates(n, s, e) if e - s >= 2 else UpdateSchedule(s, e, 1)
    return [k for k in range(1, steps + 1) if sched.is_update_step(k)]


def auto_updates(steps: int, log_every: int, start: float = 0.0, end: float = 1.0) -> int:
    """The number of updates for which each update and the two steps after it (an eager step, a re-capture)
    fall inside one window, none in window 1, with as many update windows as update-free ones."""
    best, best_score = 1, -1
    for n in range(1, steps // 2):
        ups = update_steps(n, steps, start, end)
        if not ups or any(u <= log_every or u + 2 > steps or (u - 1) % log_every > log_every - 3 for u in ups):
            continue
        with_update = {(u - 1) // log_every for u in ups}
        clean = (steps + log_every - 1) // log_every - 1 - len(with_update)
        if min(len(with_update), clean) > best_score:
            best, best_score = n, min(len(with_update), clean)
    return best


def merged(*groups: list[str] | tuple[str, ...]) -> list[str]:
    """Overrides in order, a later one replacing an earlier one of the same key (``+``/``~`` prefixes aside)."""
    out: dict[str, str] = {}
    for group in groups:
        for o in group:
            out[o.split("=", 1)[0].lstrip("+~")] = o
    return list(out.values())


def run_overrides(variant: Variant, mode: str, args: argparse.Namespace, facts: dict) -> list[str]:
    common = ["trainer=gpu", f"trainer.max_steps={args.steps}", f"trainer.batch_size={args.batch}",
              "trainer.grad_accum=1", "trainer.eval_every=0", f"trainer.log_every={args.log_every}",
              "trainer.checkpoint_every=0", "logger=quiet", "logger.plot=false",
              *MODES[mode]]
    if facts.get("text"):
        common.append(f"data.seq_len={args.seq}")
    dynamic = []
    if facts.get("dynamic"):
        n = args.updates or auto_updates(args.steps, args.log_every, facts["start"], facts["end"])
        dynamic = ["sparsity.scheduler.interval=null"] if facts.get("has_interval") else []
        dynamic.append(f"sparsity.scheduler.num_updates={n}")
    return merged([f"recipe={variant.recipe}"], common, variant.overrides, dynamic, args.extra)


# ---- reading a run --------------------------------------------------------------------------------------
def last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and HYDRA_HINT not in ln]
    return lines[-1].removeprefix("error: ")[:300] if lines else ""


def read_run(run_dir: Path) -> dict:
    """The numbers of one finished run: its summary's throughput and step counts, memory (``peak_gb``: the largest
    per-window ``reserved_gb`` outside the startup window, or, for runs without such rows, the largest
    ``peak_mem_gb``; ``startup_peak_gb``: the startup window's ``reserved_gb``: tuning, compile and capture), window times
    (``[end_step, steps, seconds]``) and the steps of its mask updates."""
    from sparsetrain.training.metrics import read_metrics, read_summary

    summary = read_summary(run_dir)
    if summary is None:
        raise FileNotFoundError(f"{run_dir}/summary.json is missing")
    rate_key = "tokens_per_s" if summary.get("tokens_per_s") is not None else "samples_per_s"
    rows = read_metrics(run_dir)
    train = sorted((r for r in rows if rate_key in r and "event" not in r), key=lambda r: r["step"])
    windows, items, prev_step, prev_s = [], [], 0, 0.0
    for r in train:
        windows.append([r["step"], r["step"] - prev_step, r["elapsed_s"] - prev_s])
        items.append(r[rate_key] * (r["elapsed_s"] - prev_s))
        prev_step, prev_s = r["step"], r["elapsed_s"]
    peaks = [r["peak_mem_gb"] for r in train if "peak_mem_gb" in r]
    steady = [r["reserved_gb"] for r in train if "reserved_gb" in r and not r.get("startup")]
    startup = [r["reserved_gb"] for r in train if "reserved_gb" in r and r.get("startup")]
    return {"rate_key": rate_key, "rate": summary.get(rate_key), "peak_gb": max(steady or peaks, default=None),
            "startup_peak_gb": max(startup or peaks, default=None),
            "windows": windows, "window_items": items,
            "updates": [r["step"] for r in rows if r.get("event") == "mask_update"],
            "flops_per_step": summary.get("flops_per_step_sparse"),   # what runs (dense: the dense count)
            **{k: summary.get(k) for k in ("step_mode", "graph_captures", "graph_replays", "eager_steps",
                                           "capture_s", "wall_s", "kernel_choices")}}


def update_cost(windows: list[list], updates: list[int]) -> dict | None:
    """Seconds one mask update adds, from window times: Σ over windows holding updates of (window seconds −
    its steps × the mean step time of update-free windows) / updates in them. Window 1 (warm-up) is left out,
    and so is a window that holds only the two steps after an update (its eager step, its re-capture)."""
    hit = [(steps, sec, n) for end, steps, sec in windows[1:]
           if (n := sum(end - steps < u <= end for u in updates))]
    clean = [windows[i][1:] for i in _clean(windows, updates)]
    if not hit or not clean:
        return None
    step_s = sum(sec for _, sec in clean) / sum(steps for steps, _ in clean)
    cost = sum(sec - steps * step_s for steps, sec, _ in hit) / sum(n for *_, n in hit)
    return {"update_s": cost, "clean_step_s": step_s, "update_windows": len(hit), "clean_windows": len(clean)}


def _clean(windows: list[list], updates: list[int]) -> list[int]:
    """Indices of the windows after the first (warm-up) that hold no mask update and neither of the two steps
    after one (its eager step, its re-capture)."""
    return [i for i, (end, steps, _) in enumerate(windows) if i > 0
            and not any(end - steps < u + k <= end for u in updates for k in (0, 1, 2))]


def steady_rate(run: dict, interval: float | None) -> dict | None:
    """What a full-length run gets, from a short one (``read_run``'s output): the rate of its update-free
    windows (:func:`_clean`) and, for a run with mask updates, that rate with one update's cost
    (:func:`update_cost`) spread over ``interval`` steps (the recipe's own). None without a clean window."""
    idx = _clean(run["windows"], run["updates"])
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
    """Rows of the table: each run with its ratios to the baseline (same mode; the baseline's fastest mode),
    its memory ratio (of the steady-state peaks, ``peak_gb``), its model FLOP rate (``sparsetrain.flops``' count of
    what the step runs, per second) and that rate's share of ``gemm_tflops`` (a bf16 GEMM measured on the same GPU),
    and, for dynamic variants, the update cost amortised over the recipe's interval."""
    base = {r["mode"]: r for r in runs if r["variant"] == baseline and r.get("rate")}
    best = max((r["rate"] for r in base.values()), default=None)
    rows = []
    for r in runs:
        row = dict(r)
        b = base.get(r["mode"])
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
            cost = update_cost(r["windows"], r.get("updates", []))
            row["update"] = cost
            if cost and r.get("recipe_interval"):
                cost["amortised_pct"] = 100 * cost["update_s"] / (r["recipe_interval"] * cost["clean_step_s"])
                steady = steady_rate(r, r["recipe_interval"]) if r.get("window_items") else None
                if steady and best:  # what a full-length run of the recipe gets, against dense's fastest mode
                    row["x_dense_at_interval"] = steady["rate_at_interval"] / best
        rows.append(row)
    return rows


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
    widths = [max([len(head[i]), *(len(ln[i]) for ln in lines if len(ln) == len(head))]) for i in range(len(head))]
    fmt = [head, ["-" * w for w in widths], *lines]
    out = ["  ".join(c.ljust(w) if i < 2 or len(ln) < len(head) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(ln, widths, strict=False))) for ln in fmt]
    return "\n".join(s.rstrip() for s in out)


FLOPS_NOTE = ("TFLOP/s: model FLOPs per second as `sparsetrain flops` counts the step (what runs: a sparse layer's "
              "active blocks; no elementwise work); % GEMM: of the bf16 GEMM rate measured first on this GPU ({})")
NOTE = ("update ms: one mask update's cost = (mean step time of windows with an update - that of windows without) "
        "x steps per window (window 1 left out); amortised: that cost over the recipe's own interval "
        "(max_steps / num_updates, shown after /) as a % of the update-free step time; x dense run: the update-free "
        "rate with that cost spread over the interval, against dense's fastest mode (what a full-length run gets; "
        "the benchmark itself updates far more often)")


# ---- running --------------------------------------------------------------------------------------------
class Bench:
    """The runs of one invocation. ``<out>/e2e_results.json`` is rewritten after every run; with ``--resume`` a run
    whose overrides match a finished one there is read from it instead of run again (one command may then be
    split over several invocations)."""

    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args, self.t0 = args, time.time()
        self.out = Path(args.out or tempfile.mkdtemp(prefix="sparsetrain-e2e-")).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        saved = self.out / RESULTS_FILE
        self.done: dict[str, dict] = {}   # run name -> {"key": its overrides, "result": ...}, finished runs only
        if args.resume and saved.is_file():
            self.done = json.loads(saved.read_text()).get("done", {})
        self.results = {"argv": ["sparsetrain", "bench", "e2e", *argv], "env": {}, "runs": [], "table": [],
                        "breakdown": {}}

    def say(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:5.0f} s] {msg}", flush=True)

    def save(self) -> None:
        (self.out / RESULTS_FILE).write_text(json.dumps({**self.results, "done": self.done}, indent=1, default=str))

    def _reused(self, name: str, key: str) -> dict | None:
        if self.done.get(name, {}).get("key") == key:
            self.say(f"{name}: reused from {self.out / RESULTS_FILE}")
            return self.done[name]["result"]
        return None

    def _spawn(self, name: str, cmd: list[str]) -> tuple[int, str]:
        """Run ``cmd`` with its output in ``<out>/<name>.log`` (kept when it fails); (exit code, last line)."""
        log = self.out / f"{name}.log"
        with open(log, "w") as f:
            rc = run_child(cmd, f, self.args.timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if rc is None:
            return 124, f"timed out after {self.args.timeout:.0f} s"
        text = log.read_text(errors="replace")
        if rc == 0 and not self.args.keep:
            log.unlink()
        return rc, last_error_line(text) or f"exit {rc}"

    def _cleanup(self, run_dir: Path) -> None:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        if not self.args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)

    def train_run(self, variant: Variant, mode: str, facts: dict, index: str) -> dict:
        name = f"{variant.name}-{mode}"
        overrides = run_overrides(variant, mode, self.args, facts)
        key = json.dumps(overrides)
        if (reused := self._reused(name, key)) is not None:
            return reused
        run_dir = self.out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        self.say(f"{index} {name}: sparsetrain train {' '.join(overrides)}")
        t = time.time()
        rc, last = self._spawn(name, [sys.executable, "-m", "sparsetrain.cli", "train", *overrides,
                                      f"hydra.run.dir={run_dir}"])
        result = {"variant": variant.name, "mode": mode, "overrides": overrides, "seconds": time.time() - t,
                  "items_per_step": self.args.batch * (self.args.seq if facts.get("text") else 1),
                  **{k: facts.get(k) for k in ("dynamic", "recipe_interval", "recipe_steps", "recipe_num_updates")}}
        try:
            if rc != 0:
                raise RuntimeError(last)
            result.update(read_run(run_dir))
            self.say(f"{index} {name}: {result['rate']:,.0f} {result['rate_key'].replace('_per_s', '/s')}, peak "
                     f"{_num(result['peak_gb'], '.2f')} GB (startup {_num(result['startup_peak_gb'], '.2f')} GB), "
                     f"{result['graph_captures']} captures / {result['eager_steps']} eager steps "
                     f"({result['seconds']:.0f} s)")
            self.done[name] = {"key": key, "result": result}
        except Exception as e:  # noqa: BLE001 - a failed run is a row of the table, the bench goes on
            result["error"] = str(e) or type(e).__name__
            self.say(f"{index} {name}: FAILED: {result['error']} (log: {self.out / (name + '.log')})")
        self._cleanup(run_dir)
        return result

    def profile_run(self, variant: Variant, mode: str, facts: dict) -> dict:
        name, first = f"{variant.name}-{mode}-profile", self.args.profile_at
        overrides = merged(run_overrides(variant, mode, self.args, facts), [f"trainer.max_steps={first + 3}"])
        key = json.dumps(overrides)
        if (reused := self._reused(name, key)) is not None:
            return reused
        run_dir = self.out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        job = {"overrides": overrides, "run_dir": str(run_dir), "first": first, "count": 3,
               "result": str(self.out / f"{name}.json")}
        job_path = self.out / f"{name}.job.json"
        job_path.write_text(json.dumps(job))
        self.say(f"breakdown {name}: steps {first}..{first + 2} under torch.profiler")
        rc, last = self._spawn(name, [sys.executable, "-m", "sparsetrain.bench.e2e", "--profile-child",
                                      str(job_path)])
        self._cleanup(run_dir)
        if rc != 0:
            self.say(f"breakdown {name}: FAILED: {last}")
            return {"error": last}
        result = json.loads(Path(job["result"]).read_text())
        self.say(f"breakdown {name}: {result['wall_ms']:.2f} ms per step, {result['kernels_ms']:.2f} ms of kernels")
        self.done[name] = {"key": key, "result": result}
        return result

    def run(self) -> list[dict]:
        args = self.args
        modes = list(args.modes)
        if not _has_cuda() and (gpu_only := [m for m in modes if m != "eager"]):
            modes = [m for m in modes if m == "eager"]
            self.say(f"{' and '.join(gpu_only)} mode needs a CUDA GPU; skipped")
        self.say(f"run directories under {self.out}" + ("" if args.keep else " (removed after reading)"))
        self.results["env"] = _env()
        jobs = [(v, m) for v in args.variant_list for m in modes]
        facts: dict[str, dict] = {}
        for i, (variant, mode) in enumerate(jobs, 1):
            if variant.name not in facts:
                try:
                    facts[variant.name] = recipe_facts(variant)
                except Exception as e:  # noqa: BLE001 - a recipe that does not compose is one failed row
                    facts[variant.name] = {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
            f = facts[variant.name]
            if "error" in f:
                self.say(f"[{i}/{len(jobs)}] {variant.name}-{mode}: FAILED: "
                         f"{' '.join(['recipe=' + variant.recipe, *variant.overrides])} does not compose: {f['error']}")
                self.results["runs"].append({"variant": variant.name, "mode": mode, "error": f["error"]})
                continue
            self.results["runs"].append(self.train_run(variant, mode, f, f"[{i}/{len(jobs)}]"))
            self.save()
        self.results["table"] = build_table(self.results["runs"], args.baseline,
                                            self.results["env"].get("bf16_gemm_tflops"))
        todo = [v for v in args.variant_list if v.name in args.breakdown and "error" not in facts.get(v.name, {})]
        if todo and modes and not _has_cuda():
            self.say("breakdown needs a CUDA GPU (torch.profiler's CUDA activity); skipped")
        elif todo:
            for variant in todo:
                for mode in modes:
                    self.results["breakdown"][f"{variant.name}-{mode}"] = self.profile_run(variant, mode,
                                                                                         facts[variant.name])
                    self.save()
        self.save()
        return self.results["table"]


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


#: The GPU's bf16 matmul rate (TFLOP/s), measured in a process of its own before the runs: the yardstick of the
#: table's "% GEMM" column.
GEMM_PROBE = ("import torch\nfrom triton.testing import do_bench\n"
              "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
              "print(2 * 8192**3 / do_bench(lambda: a @ a, warmup=25, rep=200, return_mode='median') / 1e9)")


def gemm_tflops() -> float | None:
    """The bf16 GEMM rate of this GPU (8192³, median), or None where it cannot be measured."""
    with tempfile.TemporaryFile("w+") as out:
        if run_child([sys.executable, "-c", GEMM_PROBE], out, timeout=180) != 0:
            return None
        out.seek(0)
        for line in reversed(out.read().splitlines()):  # the probe's one printed number (stderr is merged in)
            try:
                return float(line)
            except ValueError:
                continue
        return None


def _env() -> dict:
    import torch

    env = {"torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["bf16_gemm_tflops"] = gemm_tflops()
    return env


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


def main(argv: list[str]) -> int:
    if argv[:1] == ["--profile-child"]:
        return profile_child(argv[1])
    args = parse_args(argv)
    bench = Bench(args, argv)
    try:
        rows = bench.run()
    except Stopped as stop:
        bench.save()
        print(f"\n{stop} (the running run and its processes were ended); finished runs are kept in "
              f"{bench.out / RESULTS_FILE}: the same command with --out {bench.out} --resume goes on from there",
              file=sys.stderr)
        return 128 + stop.signum
    print("\n==== end-to-end training throughput ====")
    print(format_table(rows))
    gemm = bench.results.get("env", {}).get("bf16_gemm_tflops")
    if any(r.get("model_tflops") for r in rows):
        print(FLOPS_NOTE.format(f"{gemm:.0f} TFLOP/s" if gemm else "not measured: no CUDA GPU"))
    if any(r.get("update") for r in rows):
        print(NOTE)
    if bench.results["breakdown"]:
        print("\n==== per-step breakdown (ms per step, 3 profiled steps; head: FLOPs share from sparsetrain.flops, "
              "not timed) ====")
        print(format_breakdown(bench.results["breakdown"]))
    if args.json:
        Path(args.json).write_text(json.dumps(bench.results, indent=1, default=str))
        print(f"wrote {args.json}")
    if args.plot:
        env = bench.results.get("env", {})
        plot(rows, args.plot, f"{args.model}, batch {args.batch}, {args.steps} steps, {env.get('gpu', 'CPU')}")
        print(f"wrote {args.plot}")
    failed = any(r.get("error") for r in rows) or any(b.get("error") for b in bench.results["breakdown"].values())
    if failed:
        print(f"logs of the failed runs: {bench.out}")
    elif not args.keep and not args.out:
        shutil.rmtree(bench.out, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
