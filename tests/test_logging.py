"""Tests for sparsetrain.training.logging: metrics.jsonl, resume, progress, plots, summary, wandb."""
import json
import math
import os
import random

import pytest

from sparsetrain.training.logging import (
    MetricsLogger,
    Progress,
    end_tracking,
    format_flops,
    format_summary,
    init_tracking,
    log_tracking,
    plot_run,
    read_metrics,
    read_summary,
    write_summary,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _train_row(step: int, rng: random.Random, density: float = 0.1) -> dict:
    return {"step": step, "loss": 5.0 * math.exp(-step / 40) + rng.random() * 0.1, "lr": 1e-3,
            "train_flops": 1e12 * step, "tokens_per_s": 5e4 + rng.random() * 1e3, "density": density,
            "elapsed_s": 0.1 * step}


def _write_run(run_dir, steps: int = 120, seed: int = 0) -> list[dict]:
    """Log a synthetic run (train rows, mask updates, evals, an unknown event); return the rows."""
    rng = random.Random(seed)
    rows = []
    for step in range(1, steps + 1):
        train = _train_row(step, rng, density=0.1 + 0.2 * (step < 30))
        rows.append(train)
        if step % 20 == 0:
            rows.append({"step": step, "event": "mask_update", "pruned": 64, "regrown": 64,
                         "drop_fraction": 0.3})
        if step % 25 == 0:
            rows.append({"step": step, "eval_loss": train["loss"] + 0.2, "train_flops": 1e12 * step,
                         "elapsed_s": 0.1 * step})
        if step == 60:
            rows.append({"step": step, "event": "dispatch", "kernel": "bsr", "unknown_key": [1, 2]})
    with MetricsLogger(run_dir) as log:
        for row in rows:
            log.log(row)
    return rows


def test_log_roundtrip_and_nonfinite(tmp_path):
    rows = _write_run(tmp_path)
    back = read_metrics(tmp_path)
    assert back == rows
    with MetricsLogger(tmp_path) as log:  # append mode: a second logger continues the file
        log.log({"step": 121, "loss": float("nan"), "lr": float("inf"), "x": -math.inf})
    text = (tmp_path / "metrics.jsonl").read_text().splitlines()[-1]
    assert '"loss": "NaN"' in text and '"lr": "Infinity"' in text and '"x": "-Infinity"' in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    last = read_metrics(tmp_path)[-1]
    assert math.isnan(last["loss"]) and last["lr"] == math.inf and last["x"] == -math.inf


def test_log_tensor_values_and_bad_rows(tmp_path):
    import numpy as np
    import torch

    log = MetricsLogger(tmp_path)
    loss = torch.rand(()).item() + 1.0
    log.log({"step": 3, "loss": torch.tensor(loss), "n": np.int64(7), "d": np.float32(0.5)})
    row = read_metrics(tmp_path)[0]
    assert row == {"step": 3, "loss": pytest.approx(loss), "n": 7, "d": 0.5}
    with pytest.raises(TypeError, match="step"):
        log.log({"loss": 1.0})
    with pytest.raises(TypeError, match="step"):
        log.log({"step": 1.5, "loss": 1.0})
    with pytest.raises(TypeError, match="'w'"):
        log.log({"step": 4, "w": torch.ones(3)})
    log.close()
    assert len(read_metrics(tmp_path)) == 1  # rejected rows left nothing behind, not even a partial line


def test_non_main_process_writes_nothing(tmp_path):
    log = MetricsLogger(tmp_path / "run", is_main_process=False)
    log.log({"step": 1, "loss": 1.0})
    log.close()
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("keep_step", [0, 37, 75, 120, 500])
def test_truncate_after_keeps_exact_rows(tmp_path, keep_step):
    rows = _write_run(tmp_path, seed=keep_step)
    # A killed run can leave a partial last line and a row without a step.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"note": "no step"}) + "\n")
        f.write('{"step": 121, "loss": 1.2')
    kept = MetricsLogger.truncate_after(tmp_path, keep_step)
    expected = [r for r in rows if r["step"] <= keep_step] + [{"note": "no step"}]
    assert read_metrics(tmp_path) == expected
    assert kept == len(expected)
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]  # temp file replaced, nothing left over
    # Resuming appends after the kept rows.
    with MetricsLogger(tmp_path) as log:
        log.log({"step": keep_step + 1, "loss": 0.5})
    assert read_metrics(tmp_path)[-1] == {"step": keep_step + 1, "loss": 0.5}


def test_truncate_after_missing_file_and_bad_step(tmp_path):
    assert MetricsLogger.truncate_after(tmp_path, 10) == 0
    with pytest.raises(TypeError, match="step"):
        MetricsLogger.truncate_after(tmp_path, "10")


def test_progress_shows_postfix(capsys):
    with pytest.raises(ValueError, match="initial"):
        Progress(total_steps=10, initial=11)
    bar = Progress(total_steps=10, initial=2)
    for step in range(3, 11):
        bar.update(step, loss=1.0 / step, lr=3e-4, tokens_per_s=51234.0)
    assert bar.n == 10
    bar.close()
    err = capsys.readouterr().err
    assert "10/10" in err and "loss=0.1" in err and "lr=3.00e-04" in err and "tokens_per_s=51.2k" in err
    quiet = Progress(total_steps=5, disable=True)
    quiet.update(5, loss=1.0)
    quiet.close()
    assert capsys.readouterr().err == ""


def _check_png(path, min_bytes=10_000):
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > min_bytes
    img = mpimg.imread(path)
    assert img.std() > 0.05, "image is (nearly) blank"
    return img


def test_plot_run_writes_png(tmp_path):
    _write_run(tmp_path)
    with MetricsLogger(tmp_path) as log:
        log.log({"step": 121, "loss": float("nan"), "density": 0.1})
    write_summary(tmp_path, status="finished", method="prune_regrow/random", density=0.1)
    out = plot_run(tmp_path)
    assert out == tmp_path / "curves.png"
    _check_png(out)
    with pytest.raises(ValueError, match="run_dir"):
        plot_run(tmp_path / "empty")


def test_summary_roundtrip_and_format(tmp_path):
    fields = {"status": "finished", "method": "static", "recipe": "bert_tiny", "density": 0.1,
              "block": "16x16", "steps": 1000, "final_eval_loss": 3.41234, "total_train_flops": 1.234e15,
              "wall_s": 754.0, "tokens_per_s": 45600.0}
    path = write_summary(tmp_path, **fields)
    assert path == tmp_path / "summary.json" and read_summary(tmp_path) == fields
    text = format_summary(fields)
    for piece in ("finished:", "method=static", "density=0.100", "block=16x16", "steps 1000", "12m34s",
                  "final eval loss 3.4123", "1.23e15", "45.6k tokens/s"):
        assert piece in text, piece
    write_summary(tmp_path, status="diverged", final_eval_loss=float("nan"), tokens_per_s=None)
    back = read_summary(tmp_path)
    assert back["status"] == "diverged" and math.isnan(back["final_eval_loss"])
    assert "diverged:" in format_summary(back) and "throughput -" in format_summary(back)


@pytest.mark.parametrize("value, text", [(1.234e15, "1.23e15"), (9.999e14, "1.00e15"), (3.0e9, "3.00e9"),
                                         (None, "-"), (0.0, "0")])
def test_format_flops(value, text):
    assert format_flops(value) == text
    if value:
        assert float(text) == pytest.approx(value, rel=5e-3)


@pytest.fixture
def wandb_env(monkeypatch):
    """Isolate wandb env vars and Accelerate's process-wide state from other tests."""
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_SILENT", "WANDB_CONSOLE"):
        monkeypatch.setenv(var, "unset-by-test")  # records the old value so teardown restores it
        monkeypatch.delenv(var)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_wandb_offline_files(tmp_path, wandb_env):
    from accelerate import Accelerator

    run_dir = tmp_path / "run"
    acc = Accelerator(log_with="wandb", project_dir=str(run_dir))
    with pytest.raises(ValueError, match="mode"):
        init_tracking(acc, "sparsetrain-test", str(run_dir), {}, mode="cloud")
    init_tracking(acc, "sparsetrain-test", str(run_dir), {"sparsity": {"density": 0.1}, "seed": 0}, name="t")
    assert os.environ["WANDB_MODE"] == "offline" and os.environ["WANDB_DIR"] == str(run_dir)
    for step in range(1, 4):
        log_tracking(acc, {"step": step, "loss": 1.0 / step, "lr": 1e-3, "peak_mem_gb": None}, step=step)
    log_tracking(acc, {"step": 3, "event": "mask_update", "pruned": 4, "regrown": 4}, step=3)
    end_tracking(acc)
    assert acc.trackers == []
    acc.end_training()  # must not finish the wandb run a second time
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    wandb_files = list(runs[0].glob("*.wandb"))
    assert len(wandb_files) == 1
    # The logged keys reached the run file (records are protobufs; their key strings are stored as is).
    data = wandb_files[0].read_bytes()
    assert b"loss" in data and b"mask_update/pruned" in data


def test_tracking_disabled_and_wrong_accelerator(tmp_path, wandb_env):
    from accelerate import Accelerator

    acc = Accelerator(log_with=None, project_dir=str(tmp_path))
    init_tracking(acc, "p", str(tmp_path), {}, enabled=False)
    log_tracking(acc, {"step": 1, "loss": 1.0}, step=1)  # no trackers: a no-op
    end_tracking(acc)
    assert not (tmp_path / "wandb").exists() and "WANDB_MODE" not in os.environ
    with pytest.raises(ValueError, match="log_with"):
        init_tracking(acc, "p", str(tmp_path), {})
