"""Shared by the training tests: a synthetic run's metrics rows."""
import math
import random

import pytest

from sparsetrain.training.metrics import MetricsLogger


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



@pytest.fixture
def write_run():
    """``write_run(run_dir, steps=120, seed=0) -> rows``: log a synthetic run into ``run_dir``."""
    return _write_run
