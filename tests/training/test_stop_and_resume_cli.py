"""The real CLI in subprocesses: SIGTERM checkpoints, says how to continue, and the continued run equals an
uninterrupted one and keeps its wandb run; a NaN stops the run with one line; a hostile checkpoint is refused."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = ROOT / "tests" / "kill_at_step.py"
TINY = ["trainer.batch_size=8", "data.seq_len=32", "data.vocab_size=1024", "trainer.eval_batches=2"]
COMMON = ["recipe=quickstart", "trainer.max_steps=24", "trainer.checkpoint_every=8", "trainer.log_every=4",
          "trainer.eval_every=12", "sparsity.scheduler.num_updates=5", "logger.progress=false", "logger.plot=false",
          *TINY]


def cli(*args, signal_at=None, env=None):
    """``sparsetrain ARGS`` in a subprocess; ``signal_at="13:SIGTERM"`` sends the signal after step 13."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_SILENT": "true",
         **(env or {})}
    launcher = ["-m", "sparsetrain.cli"] if signal_at is None else [str(LAUNCHER), signal_at]
    return subprocess.run([sys.executable, *launcher, *args], cwd=ROOT, env=e, capture_output=True, text=True,
                          timeout=600)


def rows(run_dir, key):
    lines = Path(run_dir, "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if key in json.loads(line)]


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_continued_run_equals_an_uninterrupted_one(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    plain = cli("train", *COMMON, "logger.wandb.enabled=false", f"hydra.run.dir={a}")
    assert plain.returncode == 0, plain.stderr[-2000:]
    lines = plain.stdout.splitlines()
    assert lines.count(f"run directory: {a}") == 2 and lines[-1] == f"run directory: {a}"   # start and end

    stopped = cli("train", *COMMON, f"hydra.run.dir={b}", signal_at="13:SIGTERM")   # wandb offline is on
    assert stopped.returncode == 143, (stopped.returncode, stopped.stderr[-2000:])  # handled: 128 + SIGTERM
    err = [line for line in stopped.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "stopped by SIGTERM after step 13" in err[0]
    assert "continue with sparsetrain train " in err[0] and f"hydra.run.dir={b} trainer.resume=auto" in err[0]
    assert "<the same overrides>" not in err[0] and all(o in err[0] for o in COMMON), err[0]  # the user's own
    assert sorted(p.name for p in (b / "checkpoints").iterdir()) == ["step_00000008", "step_00000013"]
    assert not (b / "summary.json").exists()

    resumed = cli("train", *COMMON, f"hydra.run.dir={b}", "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout and "at step 13" in resumed.stdout
    la, lb = rows(a, "loss"), rows(b, "loss")
    assert [x["step"] for x in lb] == [4, 8, 12, 16, 20, 24]
    assert [x["loss"] for x in la] == [x["loss"] for x in lb]                  # exactly equal on CPU
    assert [x["eval_loss"] for x in rows(a, "eval_loss")] == [x["eval_loss"] for x in rows(b, "eval_loss")]
    ma = torch.load(a / "checkpoints/step_00000024/pytorch_model.bin", weights_only=True)
    mb = torch.load(b / "checkpoints/step_00000024/pytorch_model.bin", weights_only=True)
    assert all(ma[k].equal(mb[k]) for k in ma)
    # the continued run writes to the same wandb run (offline files: one per process, one run id)
    runs = sorted((b / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({re.sub(r".*-", "", r.name) for r in runs}) == 1, runs


@pytest.mark.slow
def test_nan_stops_with_one_line_and_keeps_the_good_checkpoints(tmp_path):
    d = tmp_path / "nan"
    r = cli("train", "recipe=quickstart", "optim.optimizer.lr=1e6", "trainer.max_steps=60",
            "trainer.checkpoint_every=10", "logger=quiet", *TINY, f"hydra.run.dir={d}")
    assert r.returncode == 1, r.stderr[-2000:]
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: non-finite"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (d / "summary.json").exists()
    for path in (d / "checkpoints").glob("step_*"):
        weights = torch.load(path / "pytorch_model.bin", weights_only=True)
        assert all(torch.isfinite(w).all() for w in weights.values()), path


class _Payload:
    """Unpickling this creates the directory ``path``: proof that a load ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


def test_a_checkpoint_that_would_run_code_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "x": _Payload(marker)}, bad / "sparsetrain_state.pt")
    r = cli("train", "recipe=quickstart", f"trainer.resume={bad}", "logger=quiet", *TINY,
            f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and not marker.exists()
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "cannot be loaded safely" in err[0], r.stderr[-2000:]


@pytest.mark.slow
def test_a_checkpoint_write_that_fails_in_torch_ends_in_one_line(tmp_path):
    """A real failed write inside torch.save's C++ writer (files capped at 1 MB: the checkpoint's optimizer file
    is larger) ends the run in one line with exit 1, leaving no half-written checkpoint."""
    import resource
    import signal

    def cap_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1_000_000, 1_000_000))

    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "sparsetrain.cli", "train", "recipe=quickstart", "logger=quiet",
                        "trainer.max_steps=8", "trainer.checkpoint_every=4", "trainer.eval_every=0", *TINY,
                        f"hydra.run.dir={run}"], cwd=ROOT, preexec_fn=cap_files, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 1, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: could not write step_00000004"), r.stderr[-2000:]
    assert "MiB free" in lines[0] and "no checkpoint was written yet" in lines[0]
    assert list((run / "checkpoints").iterdir()) == []
