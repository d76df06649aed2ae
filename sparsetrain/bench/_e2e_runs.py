"""The runs of ``sparsetrain bench e2e``: :class:`Bench` spawns each variant in each mode as a ``sparsetrain train``
process (and the profiled runs of ``--breakdown``), reads its run directory (:func:`read_run`) and keeps the
results, and measures the GPU's bf16 GEMM rate first. Only the standard library is imported at module level."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from sparsetrain.bench._child import run_child
from sparsetrain.bench._e2e_report import _num, build_table
from sparsetrain.bench._e2e_variants import Variant, merged, recipe_facts, run_overrides
from sparsetrain.bench._gpu_clock import ClockSampler, nvml_handle

HYDRA_HINT = "HYDRA_FULL_ERROR"
RESULTS_FILE = "e2e_results.json"


# ---- reading a run --------------------------------------------------------------------------------------
def last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and HYDRA_HINT not in ln]
    return lines[-1].removeprefix("error: ")[:300] if lines else ""


def read_run(run_dir: Path) -> dict:
    """The numbers of one finished run: its summary's throughput and step counts, memory (``peak_gb``: the largest
    per-window ``reserved_gb`` outside the startup window, or, for runs without such rows, the largest
    ``peak_mem_gb``; ``startup_peak_gb``: the startup window's ``reserved_gb``: tuning, compile and capture), window times
    (``[end_step, steps, seconds]``) and the steps of its mask updates."""
    from sparsetrain.training.metrics import read_metrics, read_summary, run_windows

    summary = read_summary(run_dir)
    if summary is None:
        raise FileNotFoundError(f"{run_dir}/summary.json is missing")
    rate_key = "tokens_per_s" if summary.get("tokens_per_s") is not None else "samples_per_s"
    rows = read_metrics(run_dir)
    train = sorted((r for r in rows if rate_key in r and "event" not in r), key=lambda r: r["step"])
    windows = run_windows(rows, rate_key)
    items = [r[rate_key] * seconds for r, (_, _, seconds) in zip(train, windows, strict=True)]
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
        self.clock = None   # NVML's handle of the runs' GPU (set by run() where there is one): their clocks

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

    def train_run(self, variant: Variant, mode: str, facts: dict, index: str, rnd: int = 1) -> dict:
        name = f"{variant.name}-{mode}" + (f"-r{rnd}" if rnd > 1 else "")
        overrides = run_overrides(variant, mode, self.args, facts)
        key = json.dumps(overrides)
        if (reused := self._reused(name, key)) is not None:
            return reused
        run_dir = self.out / name
        shutil.rmtree(run_dir, ignore_errors=True)
        self.say(f"{index} {name}: sparsetrain train {' '.join(overrides)}")
        t = time.time()
        with ClockSampler(self.clock) as clock:
            rc, last = self._spawn(name, [sys.executable, "-m", "sparsetrain.cli", "train", *overrides,
                                          f"hydra.run.dir={run_dir}"])
        result = {**(clock.summary() or {}), "variant": variant.name, "mode": mode, "round": rnd, "overrides": overrides,
                  "seconds": time.time() - t,
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
        self.clock = nvml_handle() if "gpu" in self.results["env"] else None
        # rounds one after another, each running every variant and mode once: a drift of the GPU's clock over the
        # invocation reaches every variant alike, and each ratio is taken within its round
        jobs = [(v, m, rnd) for rnd in range(1, args.repeat + 1) for v in args.variant_list for m in modes]
        facts: dict[str, dict] = {}
        for i, (variant, mode, rnd) in enumerate(jobs, 1):
            if variant.name not in facts:
                try:
                    facts[variant.name] = recipe_facts(variant)
                except Exception as e:  # noqa: BLE001 - a recipe that does not compose is one failed row
                    facts[variant.name] = {"error": (str(e).strip().splitlines() or [type(e).__name__])[0][:300]}
            f = facts[variant.name]
            if "error" in f:
                self.say(f"[{i}/{len(jobs)}] {variant.name}-{mode}: FAILED: "
                         f"{' '.join(['recipe=' + variant.recipe, *variant.overrides])} does not compose: {f['error']}")
                self.results["runs"].append({"variant": variant.name, "mode": mode, "round": rnd,
                                             "error": f["error"]})
                continue
            self.results["runs"].append(self.train_run(variant, mode, f, f"[{i}/{len(jobs)}]", rnd))
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
