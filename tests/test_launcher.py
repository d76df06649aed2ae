"""hydra/launcher=gpus: a sweep's runs spread over a machine's GPUs, one run per GPU at a time, each in a process of
its own that sees only its GPU; after a failure no new run starts and the sweep ends in one line per failed run."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hydra_plugins.sparsetrain_gpus.gpus import Job, run_pool, visible_devices

ROOT = Path(__file__).resolve().parents[1]


def _job(tmp_path, number, code):
    """A job that records its device and its start and end times, then runs ``code``."""
    record = tmp_path / f"job{number}.json"
    script = ("import json, os, time, sys; t0 = time.time(); " + code + "; "
              f"json.dump({{'device': os.environ.get('CUDA_VISIBLE_DEVICES'), 't0': t0, 't1': time.time()}}, "
              f"open({str(record)!r}, 'w'))")
    return Job(number, [sys.executable, "-c", script], tmp_path / str(number), tmp_path / "logs" / f"{number}.log")


def test_one_run_per_device_at_a_time_each_seeing_only_its_own(tmp_path):
    jobs = [_job(tmp_path, i, "time.sleep(0.6)") for i in range(4)]
    done = run_pool(jobs, ["0", "1"], say=lambda line: None, poll_s=0.05)
    assert [j.returncode for j in done] == [0, 0, 0, 0]
    records = [json.loads((tmp_path / f"job{i}.json").read_text()) for i in range(4)]
    assert sorted(r["device"] for r in records) == ["0", "0", "1", "1"]
    for t in [r["t0"] + 0.3 for r in records]:                     # at any moment at most two run
        assert sum(r["t0"] <= t <= r["t1"] for r in records) <= 2
    assert sum(r["t0"] <= records[0]["t0"] + 0.3 <= r["t1"] for r in records) == 2   # and two do run together
    assert all(j.log.is_file() for j in jobs)


def test_after_a_failure_no_new_run_starts_and_running_ones_finish(tmp_path):
    jobs = [_job(tmp_path, 0, "sys.exit(3)"), _job(tmp_path, 1, "time.sleep(0.8)"),
            _job(tmp_path, 2, "pass"), _job(tmp_path, 3, "pass")]
    lines = []
    done = run_pool(jobs, ["0", "1"], say=lines.append, poll_s=0.05)
    assert {j.number: j.returncode for j in done} == {0: 3, 1: 0}
    assert not (tmp_path / "job2.json").exists() and "[job 0] FAILED (exit 3)" in lines


def test_without_a_gpu_the_runs_go_one_after_another():
    assert visible_devices([]) == [None] and visible_devices([2, 3]) == ["2", "3"]


@pytest.mark.slow
def test_a_sweep_through_the_cli_runs_each_job_in_its_own_dir(tmp_path):
    sweep = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "-m", "sparsetrain.cli", "train", "-m", "recipe=quickstart", "logger=quiet",
                        "trainer.max_steps=4", "trainer.eval_every=0", "trainer.log_every=2", "trainer.batch_size=8",
                        "data.seq_len=32", "data.vocab_size=1024", "seed=0,1", "hydra/launcher=gpus",
                        "hydra.launcher.gpus=[0,1]", f"hydra.sweep.dir={sweep}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 runs on 2 GPU(s)" in r.stdout and "[job 1] started on GPU 1" in r.stdout
    for n in (0, 1):
        assert json.loads((sweep / str(n) / "summary.json").read_text())["steps"] == 4
        assert f"run directory: {sweep / str(n)}" in (sweep / "logs" / f"{n}.log").read_text()
    seeds = {(sweep / str(n) / "config.yaml").read_text().count("seed: 1") > 0 for n in (0, 1)}
    assert seeds == {True, False}
