"""Time to quality (`sparsetrain pareto --curves`): every evaluation of each run against its GPU-seconds and FLOPs,
and the GPU-seconds each run needs to reach the dense baseline's final loss, on synthetic run directories."""
import csv

import pytest

from sparsetrain.pareto import collect_runs, dense_target, main, reach_rows, read_curves
from sparsetrain.training.metrics import MetricsLogger, write_summary


def _run(run_dir, method, density, step_s, slope, steps=100, processes=1):
    """Train rows every 10 steps at ``step_s`` seconds a step (window 1 marked start-up, 5 s slower), evals every
    20 steps at loss 5 - slope x step, FLOPs 1e12 a step, and a summary."""
    with MetricsLogger(run_dir) as log:
        elapsed = 0.0
        for step in range(10, steps + 1, 10):
            elapsed += 10 * step_s + (5.0 if step == 10 else 0.0)
            log.log({"step": step, "loss": 5.0, "lr": 1e-3, "train_flops": 1e12 * step, "tokens_per_s": 1.0,
                     "density": density, "elapsed_s": elapsed, **({"startup": True} if step == 10 else {})})
            if step % 20 == 0:
                log.log({"step": step, "eval_loss": 5.0 - slope * step, "train_flops": 1e12 * step,
                         "elapsed_s": elapsed})
    write_summary(run_dir, status="finished", method=method, density=density, block="16", steps=steps,
                  final_eval_loss=5.0 - slope * steps, total_train_flops=1e12 * steps, wall_s=elapsed,
                  train_s=steps * step_s, processes=processes)


@pytest.fixture
def study(tmp_path):
    _run(tmp_path / "dense", "dense", 1.0, step_s=0.1, slope=0.02)                  # 3.0 at step 100: 10 s
    _run(tmp_path / "fast", "static", 0.1, step_s=0.05, slope=0.025)                # 3.0 at step 80: 4 s
    _run(tmp_path / "two", "static", 0.1, step_s=0.05, slope=0.025, processes=2)   # the same on 2 GPUs: 8 GPU s
    _run(tmp_path / "slow", "prune_regrow/random", 0.1, step_s=0.05, slope=0.01)   # best 4.0: never
    return tmp_path


def test_each_run_reaches_the_dense_loss_at_its_own_gpu_seconds(study):
    runs = collect_runs([study])
    assert dense_target(runs) == pytest.approx(3.0)
    curves = read_curves(runs)
    fast = next(c for c in curves if c.run.path.name == "fast")
    assert fast.steps == [20, 40, 60, 80, 100]
    assert fast.gpu_s == pytest.approx([1.0, 2.0, 3.0, 4.0, 5.0])        # the start-up window left out
    assert fast.flops == [2e13, 4e13, 6e13, 8e13, 1e14]
    got = sorted((r["step"] or 0, round(r["gpu_s"] or 0, 6), round(r["x_dense"] or 0, 6))
                  for r in reach_rows(curves, 3.0))
    assert got == [(0, 0, 0), (80, 4.0, 2.5), (80, 8.0, 1.25), (100, 10.0, 1.0)]   # "slow" never reaches 3.0
    slow = next(r for r in reach_rows(curves, 3.0) if r["run"].startswith("SET"))
    # its best, 4.0 after 5.0 GPU s; dense's first evaluation at or below 4.0 is step 60's (3.8), 6.0 s
    assert slow["x_dense_best"] == pytest.approx(6.0 / 5.0) and slow["speedup_for_125"] == pytest.approx(1.25 / 1.2)


def test_the_command_prints_the_table_and_writes_the_curves(study, capsys):
    out = study / "plots" / "study.png"
    assert main([str(study), "--out", str(out), "--curves"]) == 0
    text = capsys.readouterr().out
    assert "GPU-seconds to reach eval loss 3.0000 (the dense baseline's final eval loss)" in text
    lines = {line.split()[0] + " " + line.split()[-1] for line in text.splitlines() if "never" in line}
    assert any(line.startswith("SET") for line in lines)                 # the run that never gets there says so
    slow = next(line.split() for line in text.splitlines() if line.startswith("SET"))
    assert slow[-2:] == ["1.20", "1.04x"]                                # ... and what it would need
    assert (study / "plots" / "study_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = list(csv.DictReader(open(study / "plots" / "study_curves.csv")))
    assert len(points) == 4 * 5 and {p["step"] for p in points} == {"20", "40", "60", "80", "100"}
    assert main([str(study), "--out", str(out), "--curves", "--target-loss", "4.5"]) == 0
    assert "eval loss 4.5000 (--target-loss)" in capsys.readouterr().out


def test_without_a_dense_run_the_target_must_be_given(study, capsys):
    assert main([str(study / "fast"), "--out", str(study / "p.png"), "--curves"]) == 1
    assert "give --target-loss" in capsys.readouterr().err


def test_a_sparse_then_dense_run_is_not_a_dense_baseline(study):
    """It ends at density 1 but is charged its sparse phase: not the target's source, not drawn or ranked as dense,
    and its curve follows its two step times (0.05 s, then 0.1 s after the switch at step 50)."""
    run_dir = study / "switch"
    with MetricsLogger(run_dir) as log:
        elapsed = 0.0
        for step in range(10, 101, 10):
            elapsed += 10 * (0.05 if step <= 50 else 0.1) + (5.0 if step in (10, 60) else 0.0)
            log.log({"step": step, "loss": 5.0, "lr": 1e-3, "train_flops": 1e12 * step, "tokens_per_s": 1.0,
                     "density": 0.1 if step <= 50 else 1.0, "elapsed_s": elapsed,
                     **({"startup": True} if step in (10, 60) else {})})
            if step % 50 == 0:
                log.log({"step": step, "eval_loss": 2.0, "train_flops": 1e12 * step, "elapsed_s": elapsed})
    write_summary(run_dir, status="finished", method="static+dense@0.5", density=1.0, block="16", steps=100,
                  final_eval_loss=2.0, total_train_flops=1e14, wall_s=elapsed, train_s=7.5, processes=1)
    runs = collect_runs([study])
    assert [r.dense for r in runs if r.path.name == "switch"] == [False]
    assert dense_target(runs) == pytest.approx(3.0)
    switch = next(c for c in read_curves(runs) if c.run.path.name == "switch")
    assert switch.gpu_s == pytest.approx([2.5, 7.5])
    row = next(r for r in reach_rows(read_curves(runs), 3.0) if r["run"].startswith("static+dense"))
    assert not row["dense"] and row["x_dense"] == pytest.approx(10.0 / 2.5)


def test_runs_of_several_models_are_labelled_by_model(tmp_path, capsys):
    """A narrower dense baseline beside a wider sparse model (the study's item 3): every label names its model
    (read from the run's config.yaml), in the printed tables, the curves' CSV and the runs CSV, which reads back;
    runs of one model keep the short labels."""
    import yaml

    from sparsetrain.pareto import read_table

    for name, method, density, size in (("base", "dense", 1.0, "base"), ("small", "dense", 1.0, "small"),
                                        ("sparse", "static", 0.1, "base")):
        _run(tmp_path / name, method, density, step_s=0.1, slope=0.02)
        (tmp_path / name / "config.yaml").write_text(yaml.safe_dump({"model": {"arch": "bert", "size": size}}))
    out = tmp_path / "plots" / "p.png"
    assert main([str(tmp_path), "--out", str(out), "--curves"]) == 0
    text = capsys.readouterr().out
    for label in ("dense bert-small 100 steps", "dense bert-base 100 steps", "static bert-base 0.1 16x16"):
        assert label in text, label
    assert "dense (bert-small)" in text                                     # the runs table's method column
    with open(out.with_name("p_curves.csv"), newline="") as f:
        assert {row["run"] for row in csv.DictReader(f)} == {
            "dense bert-base 100 steps", "dense bert-small 100 steps", "static bert-base 0.1 16x16"}
    assert sorted(r.model for r in read_table(out.with_suffix(".csv"))) == ["bert-base", "bert-base", "bert-small"]
    (tmp_path / "small" / "config.yaml").write_text(yaml.safe_dump({"model": {"arch": "bert", "size": "base"}}))
    assert main([str(tmp_path), "--out", str(out), "--curves"]) == 0
    assert "bert-" not in capsys.readouterr().out.split("GPU-seconds to reach")[1]
