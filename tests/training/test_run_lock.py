"""One run per run directory: a second run in a live run's directory is refused in one line and changes nothing;
a run that crashed (kill -9) never blocks the next one, which says it takes over."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparsetrain.training.resume import RunDirError
from sparsetrain.training.run_lock import LOCK_FILE, RunDirLock

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_SILENT": "true"}


def test_a_second_holder_is_refused_naming_the_key_and_the_holder(tmp_path):
    with RunDirLock(tmp_path / "run"):
        holder = json.loads((tmp_path / "run" / LOCK_FILE).read_text())
        assert holder["pid"] == os.getpid()
        with pytest.raises(RunDirError, match=r"hydra\.run\.dir: .* is in use by another run \(pid \d+ on "):
            with RunDirLock(tmp_path / "run"):
                pass
    assert not (tmp_path / "run" / LOCK_FILE).exists()        # released and removed on a normal end
    with RunDirLock(tmp_path / "run"):                        # free again
        pass


def test_the_lock_is_released_when_the_run_fails(tmp_path):
    with pytest.raises(ValueError):
        with RunDirLock(tmp_path / "run"):
            raise ValueError("boom")
    with RunDirLock(tmp_path / "run"):
        pass


def test_a_refused_run_leaves_no_directory_it_created(tmp_path):
    with RunDirLock(tmp_path / "new"):
        pass
    assert not (tmp_path / "new").exists()


def test_other_processes_of_a_run_hold_nothing(tmp_path):
    with RunDirLock(tmp_path / "run"), RunDirLock(tmp_path / "run", enabled=False):
        pass


def test_a_killed_holder_does_not_block_and_is_named(tmp_path, capsys):
    run = tmp_path / "run"
    code = ("import sys, time; from sparsetrain.training.run_lock import RunDirLock\n"
            f"with RunDirLock({str(run)!r}):\n    print('held', flush=True); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=f"pid {child.pid}"):
            with RunDirLock(run):
                pass
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    assert (run / LOCK_FILE).exists()                          # left behind by the killed run
    with RunDirLock(run):
        assert f"pid {child.pid}" in capsys.readouterr().out    # "did not end cleanly ... takes it over"


@pytest.mark.slow
def test_a_second_cli_run_in_a_live_run_dir_is_refused_and_the_first_is_intact(tmp_path):
    run = tmp_path / "run"
    args = ["recipe=quickstart", "logger=quiet", "trainer.eval_every=0", "trainer.max_steps=400",
            "trainer.checkpoint_every=200", "trainer.log_every=1", "trainer.batch_size=8", "data.seq_len=32",
            "data.vocab_size=1024", f"hydra.run.dir={run}"]
    first = subprocess.Popen([sys.executable, "-m", "sparsetrain.cli", "train", *args], cwd=ROOT, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("loss") >= 5):
            assert first.poll() is None and time.time() < deadline, "the first run ended before the second started"
            time.sleep(0.2)
        second = subprocess.run([sys.executable, "-m", "sparsetrain.cli", "train", *args, "seed=1"], cwd=ROOT,
                                env=ENV, capture_output=True, text=True, timeout=300)
        out, err = first.communicate(timeout=600)
    finally:
        first.kill()
    assert second.returncode == 2
    lines = [ln for ln in second.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "hydra.run.dir" in lines[0] and f"pid {first.pid}" in lines[0], second.stderr
    assert first.returncode == 0, err[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 401))     # one run's rows, in order
    assert "seed: 0" in (run / "config.yaml").read_text()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000200", "step_00000400"]
    assert not (run / LOCK_FILE).exists()
