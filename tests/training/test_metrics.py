"""sparsetrain.training.metrics: metrics.jsonl, resume truncation, progress bar, summary."""
import json
import math
import os

import pytest

from sparsetrain.training.metrics import (
    MetricsLogger,
    Progress,
    format_flops,
    format_summary,
    read_metrics,
    read_summary,
    train_seconds,
    window_rate,
    write_summary,
)


def test_log_roundtrip_and_nonfinite(tmp_path, write_run):
    rows = write_run(tmp_path)
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
def test_truncate_after_keeps_exact_rows(tmp_path, keep_step, write_run):
    rows = write_run(tmp_path, seed=keep_step)
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




def test_window_rate_is_the_median_of_logged_rates(tmp_path):
    with MetricsLogger(tmp_path) as log:
        for step, rate in ((1, 10.0), (2, 1000.0), (3, 30.0), (4, 20.0)):
            log.log({"step": step, "tokens_per_s": rate})
    assert window_rate(tmp_path, "tokens_per_s") == 30.0
    assert window_rate(tmp_path, "samples_per_s") is None


def test_train_seconds_charges_startup_windows_at_the_next_steps_rate_and_keeps_update_windows():
    """Cumulative seconds: a start-up window (the first, or one marked `startup`: a resumed process's first) is
    charged its steps at the next timed window's step time; a window with a slow mask update keeps its own
    seconds; eval, event and mask rows are not windows."""
    rows = [
        {"step": 10, "loss": 4.0, "elapsed_s": 30.0, "startup": True},   # tuning + first capture
        {"step": 20, "loss": 3.9, "elapsed_s": 31.0},
        {"step": 20, "eval_loss": 3.8, "train_flops": 1.0, "elapsed_s": 31.0},
        {"step": 25, "event": "mask_update", "pruned": 3, "regrown": 3},
        {"step": 30, "loss": 3.7, "elapsed_s": 33.0},                     # 1 s more: the update's cost
        {"step": 40, "loss": 3.6, "elapsed_s": 50.0, "startup": True},    # resumed at step 35: a new process
        {"step": 50, "loss": 3.5, "elapsed_s": 51.0},
    ]
    # 1 (charged) + 1 + 2 + 1 (charged) + 1
    assert train_seconds(rows) == pytest.approx(6.0)
    assert train_seconds(rows, steps=60) == pytest.approx(7.0)        # past the end: the last window's rate
    assert train_seconds(rows, steps=25) == pytest.approx(3.0)        # half of the third window
    first_only = [{k: v for k, v in r.items() if k != "startup"} for r in rows[:2]]
    assert train_seconds(first_only) == pytest.approx(1.0 / 10 * 20)   # old runs: the first window is start-up
    assert train_seconds(rows[:1]) is None and train_seconds([]) is None


def test_train_seconds_follow_a_run_whose_step_time_changes():
    """A sparse phase at 0.05 s per step, then a dense one at 0.1 s (the switch window marked start-up, as the
    loop marks the recompile): each evaluation is charged what the steps before it took, not the run's mean."""
    rows = [{"step": 10, "loss": 5.0, "elapsed_s": 20.0, "startup": True}]
    rows += [{"step": s, "loss": 4.0, "elapsed_s": 20.0 + 0.05 * (s - 10)} for s in (20, 30, 40, 50)]
    rows += [{"step": 60, "loss": 3.9, "elapsed_s": 40.0, "startup": True}]      # switch at 50: recompiling
    rows += [{"step": s, "loss": 3.5, "elapsed_s": 40.0 + 0.1 * (s - 60)} for s in (70, 80)]
    assert train_seconds(rows, 50) == pytest.approx(50 * 0.05)
    assert train_seconds(rows) == pytest.approx(50 * 0.05 + 30 * 0.1)
    assert train_seconds(rows, 70) < train_seconds(rows, 80)


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after it)."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_respect_the_umask(tmp_path, umask, mask):
    """summary.json and a rewritten metrics.jsonl get 0666 minus the umask (0644 under 022), like a plain
    open(); the temp file of the atomic write (mkstemp: 0600) must not leak its mode into them."""
    umask(mask)
    write_summary(tmp_path, status="finished", method="static")
    with MetricsLogger(tmp_path) as log:
        log.log({"step": 1, "loss": 1.0})
        log.log({"step": 2, "loss": 0.5})
    MetricsLogger.truncate_after(tmp_path, 1)
    for name in ("summary.json", "metrics.jsonl"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "summary.json"]  # no temp file left behind


def test_the_summary_measures_one_mask_update_from_the_runs_own_windows():
    from sparsetrain.training.metrics import update_cost_fields

    rows, elapsed = [], 0.0
    for end in range(10, 110, 10):        # windows of 10 steps at 0.1 s a step; the update at 50 adds 0.6 s
        elapsed += 1.0 + (0.6 if end == 50 else 0.0) + (5.0 if end == 10 else 0.0)   # window 1: start-up
        rows.append({"step": end, "loss": 1.0, "tokens_per_s": 1.0, "elapsed_s": elapsed})
        if end == 50:
            rows.append({"step": 50, "event": "mask_update", "pruned": 4, "regrown": 4})
    fields = update_cost_fields(rows, "tokens_per_s")
    assert fields["update_s"] == pytest.approx(0.6) and fields["update_steps"] == pytest.approx(6.0)
    static = [r for r in rows if r.get("event") is None]
    assert update_cost_fields(static, "tokens_per_s") == {"update_s": None, "update_steps": None}
