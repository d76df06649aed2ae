"""sparsetrain.training.tracking: wandb through Accelerate's trackers (offline files, disabled, misuse)."""
import os

import pytest

from sparsetrain.training.tracking import end_tracking, init_tracking, log_tracking


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
