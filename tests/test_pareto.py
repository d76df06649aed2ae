"""Tests for sparsetrain.pareto on synthetic run directories (single runs, a Hydra multirun, unfinished)."""
import math
import random

import pytest

from sparsetrain.pareto import collect_runs, format_table, main, plot_pareto, read_run
from sparsetrain.training.metrics import MetricsLogger, read_metrics, write_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _make_run(run_dir, method, density, rng, steps=100, finished=True, evals=True, wall=True, config=None):
    """Write metrics.jsonl (+ summary.json when finished); return the expected values."""
    flops_per_step = 1e13 * (0.3 + 0.7 * density) * rng.uniform(0.9, 1.1)
    loss_floor = 2.0 + 1.5 * (1 - density) + rng.uniform(0, 0.1)
    eval_rows = []
    with MetricsLogger(run_dir) as log:
        for step in range(10, steps + 1, 10):
            loss = loss_floor + 3 * math.exp(-step / 30)
            log.log({"step": step, "loss": loss, "lr": 1e-3, "train_flops": flops_per_step * step,
                     "tokens_per_s": 4e4, "density": density, "elapsed_s": 0.5 * step})
            if evals and step % 50 == 0:
                row = {"step": step, "eval_loss": loss + 0.1, "train_flops": flops_per_step * step,
                       "elapsed_s": 0.5 * step}
                log.log(row)
                eval_rows.append(row)
            if step % 30 == 0:
                log.log({"step": step, "event": "mask_update", "pruned": 10, "regrown": 10,
                         "drop_fraction": 0.2})
    if config is not None:
        (run_dir / ".hydra").mkdir()
        (run_dir / ".hydra" / "config.yaml").write_text(config)
    if not finished:
        last = eval_rows[-1] if eval_rows else None
        return {"method": method, "density": density, "status": "unfinished",
                "loss": last and last["eval_loss"], "flops": last and last["train_flops"],
                "wall": last and last["elapsed_s"]}
    expected = {"method": method, "density": density, "status": "finished", "block": "16x16", "steps": steps,
                "loss": loss_floor + rng.uniform(0, 0.05), "flops": flops_per_step * steps,
                "wall": 0.55 * steps if wall else None}
    write_summary(run_dir, status="finished", method=method, recipe="bert_tiny", density=density,
                  block="16x16", steps=steps, final_eval_loss=expected["loss"],
                  total_train_flops=expected["flops"], wall_s=expected["wall"], tokens_per_s=4e4)
    return expected


@pytest.fixture
def runs_tree(tmp_path):
    """dense (1 run), static (2 single runs), prune_regrow/random (Hydra multirun 0/ 1/), 2 unfinished."""
    rng = random.Random(1234)
    expected = {}
    expected["runs/dense"] = _make_run(tmp_path / "runs/dense", "dense", 1.0, rng)
    for d in (0.5, 0.1):
        expected[f"runs/static_{d}"] = _make_run(tmp_path / f"runs/static_{d}", "static", d, rng)
    multirun = tmp_path / "multirun/2026-11-21/10-00-00"
    for i, d in enumerate((0.5, 0.1)):
        key = f"multirun/2026-11-21/10-00-00/{i}"
        expected[key] = _make_run(multirun / str(i), "prune_regrow/random", d, rng)
    (multirun / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    (multirun / ".hydra").mkdir()  # a multirun's own .hydra must not be taken for a run
    expected["runs/crashed"] = _make_run(
        tmp_path / "runs/crashed", "rigl", 0.1, rng, finished=False,
        config="sparsity:\n  policy:\n    _target_: sparsetrain.sparsity.schedulers.RigL\n  block: 16x16\n")
    expected["runs/early"] = _make_run(tmp_path / "runs/early", "unknown", 0.25, rng, steps=40,
                                       finished=False, evals=False)
    return tmp_path, expected


def _parse_table(text):
    lines = text.splitlines()
    header = lines[0].split()
    assert header == ["method", "density", "block", "steps", "FLOPs", "wall", "s", "eval", "loss", "status",
                      "path"]
    rows = {}
    for line in lines[1:]:
        if line.startswith("* "):
            continue
        method, density, block, steps, flops, wall, loss, status, path = line.split()
        rows[path] = {"method": method, "density": float(density), "block": block, "steps": steps,
                      "flops": flops, "wall": wall, "loss": loss, "status": status}
    return rows


def test_collect_and_table(runs_tree, monkeypatch):
    root, expected = runs_tree
    monkeypatch.chdir(root)
    runs = collect_runs(["runs", "multirun/2026-11-21"])  # run dirs found one and two levels down
    assert len(runs) == len(expected)
    table = _parse_table(format_table(runs))
    assert set(table) == set(expected)
    for path, exp in expected.items():
        row = table[path]
        assert row["density"] == pytest.approx(exp["density"], abs=5e-4)
        assert row["status"] == ("finished" if exp["status"] == "finished" else "*unfinished")
        if exp["loss"] is None:
            assert row["loss"] == "-"
        else:
            assert float(row["loss"]) == pytest.approx(exp["loss"], abs=5e-5)
            assert float(row["flops"]) == pytest.approx(exp["flops"], rel=5e-3)
            assert float(row["wall"]) == pytest.approx(exp["wall"], abs=0.05)
        if exp["status"] == "finished":
            assert row["method"] == exp["method"] and row["block"] == "16x16" and row["steps"] == "100"
    # Unfinished runs: labels from .hydra/config.yaml, steps from metrics.
    assert table["runs/crashed"]["method"] == "RigL" and table["runs/crashed"]["block"] == "16x16"
    assert table["runs/early"]["method"] == "unknown" and table["runs/early"]["steps"] == "40"
    assert "not finished" in format_table(runs).splitlines()[-1]


def test_read_run_prefers_last_eval_row_without_summary_loss(tmp_path):
    rng = random.Random(0)
    _make_run(tmp_path / "r", "static", 0.2, rng)
    write_summary(tmp_path / "r", status="finished", method="static", density=0.2, final_eval_loss=None,
                  total_train_flops=1e15, wall_s=None)
    run = read_run(tmp_path / "r")
    last_eval = [r for r in read_metrics(tmp_path / "r") if "eval_loss" in r][-1]
    assert last_eval["step"] == 100 and run.final_eval_loss == last_eval["eval_loss"]
    assert run.wall_s is None and run.total_train_flops == 1e15 and run.plottable


def _check_png(path, min_bytes=10_000):
    import matplotlib.image as mpimg

    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > min_bytes
    img = mpimg.imread(path)
    assert img.std() > 0.05, "image is (nearly) blank"
    return img


def test_plot_two_panels_and_one_panel(runs_tree, tmp_path):
    root, _ = runs_tree
    runs = collect_runs([root / "runs", root / "multirun"])
    both = _check_png(plot_pareto(runs, tmp_path / "out/both.png"))
    # One finished run without wall time: the wall-clock panel is dropped (a narrower figure).
    rng = random.Random(5)
    _make_run(root / "untimed", "static", 0.3, rng, wall=False)
    runs = collect_runs([root / "runs", root / "untimed"])
    one = _check_png(plot_pareto(runs, tmp_path / "one.png"))
    assert both.shape[1] > 1.5 * one.shape[1]
    with pytest.raises(ValueError, match="none has a finite"):
        plot_pareto([r for r in runs if not r.plottable], tmp_path / "none.png")


def test_bad_paths(tmp_path):
    (tmp_path / "empty/a/b/c").mkdir(parents=True)
    with pytest.raises(ValueError, match="empty"):
        collect_runs([str(tmp_path / "empty")])
    with pytest.raises(ValueError, match="missing"):
        collect_runs([str(tmp_path / "missing")])
    with pytest.raises(TypeError, match="list"):
        collect_runs(str(tmp_path))


def test_main(runs_tree, monkeypatch, capsys):
    root, expected = runs_tree
    monkeypatch.chdir(root)
    assert main(["runs", "multirun"]) == 0
    out = capsys.readouterr().out
    assert (root / "pareto.png").stat().st_size > 10_000
    assert "wrote pareto.png" in out and len(_parse_table(out.split("\nwrote")[0])) == len(expected)
    assert main(["runs/early", "--out", "x.png"]) == 1 and not (root / "x.png").exists()
    assert main(["nowhere"]) == 2
    assert "nowhere" in capsys.readouterr().err


_SCHED = "sparsity:\n  density: 0.1\n  scheduler:\n    _target_: sparsetrain.sparsity.{sched}\n{policy}"


def _config(sched="PruneRegrow", policy_target=None):
    policy = f"    policy:\n      _target_: {policy_target}\n" if policy_target else ""
    return _SCHED.format(sched=sched, policy=policy)


def test_labels_old_and_new_summaries_and_unfinished_runs(tmp_path):
    """Finished runs keep their summary's label, except the parent label that summaries written before
    class labels gave a user's RigL/SET subclass; unfinished runs are labelled from the run's config.yaml the
    way the scheduler would describe itself."""
    rng = random.Random(7)
    runs = {  # name: (summary method or None when unfinished, config.yaml, expected label)
        "new_user": ("prune_regrow/GradEMA", _config(policy_target="my_policies.GradEMA"), "prune_regrow/GradEMA"),
        "old_user": ("prune_regrow/gradient", _config(policy_target="my_policies.GradEMA"), "prune_regrow/GradEMA"),
        "old_rigl": ("prune_regrow/gradient", _config(policy_target="sparsetrain.sparsity.RigL"),
                     "prune_regrow/gradient"),
        "old_set_no_config": ("prune_regrow/random", None, "prune_regrow/random"),
        "static": ("static", _config("Static"), "static"),
        "open_set": (None, _config(policy_target="sparsetrain.sparsity.SET"), "prune_regrow/random"),
        "open_rigl": (None, _config(policy_target="sparsetrain.sparsity.RigL"), "prune_regrow/gradient"),
        "open_user": (None, _config(policy_target="my_policies.GradEMA"), "prune_regrow/GradEMA"),
        "open_default_policy": (None, _config(), "prune_regrow/random"),
        "open_gradual": (None, _config("GradualMagnitude"), "gradual_magnitude"),
    }
    for name, (method, config, _) in runs.items():
        _make_run(tmp_path / name, method or "unused", 0.1, rng, finished=method is not None)
        if config is not None:
            (tmp_path / name / "config.yaml").write_text(config)
    import sys

    sys.modules.pop("my_policies", None)  # another test of this process may have imported a module of that name
    labels = {r.path.name: r.method for r in collect_runs([tmp_path])}
    assert labels == {name: label for name, (_, _, label) in runs.items()}
    assert "my_policies" not in sys.modules  # a label never imports the user's module
