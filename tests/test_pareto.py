"""Tests for sparsetrain.pareto on synthetic run directories (single runs, a Hydra multirun, unfinished): the
table, the plot (frontiers, labels that never overlap), the CSV and markdown tables, the dense step counts."""
import csv
import itertools
import math
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest

from sparsetrain._plot_labels import place_labels
from sparsetrain.pareto import (
    CSV_COLUMNS,
    RunResult,
    collect_runs,
    dense_steps,
    format_table,
    frontier,
    main,
    pareto_figure,
    plot_pareto,
    point_label,
    read_run,
    read_table,
    write_tables,
)
from sparsetrain.training.metrics import MetricsLogger, read_metrics, train_seconds, write_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _make_run(run_dir, method, density, rng, steps=100, finished=True, evals=True, wall=True, config=None):
    """Write metrics.jsonl (+ summary.json when finished); return the expected values."""
    flops_per_step = 1e13 * (0.3 + 0.7 * density) * rng.uniform(0.9, 1.1)
    loss_floor = 2.0 + 1.5 * (1 - density) + rng.uniform(0, 0.1)
    eval_rows = []
    with MetricsLogger(run_dir) as log:
        for step in range(10, steps + 1, 10):
            loss = loss_floor + 3 * math.exp(-step / 30)
            row = {"step": step, "loss": loss, "lr": 1e-3, "train_flops": flops_per_step * step,
                   "tokens_per_s": 4e4, "density": density}
            log.log(row | ({"elapsed_s": 0.5 * step} if wall else {}))
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
                  total_train_flops=expected["flops"], wall_s=expected["wall"], tokens_per_s=4e4,
                  train_s=0.45 * steps if wall else None)
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
    assert header == ["method", "density", "block", "seed", "steps", "FLOPs", "GPU", "s", "wall", "s", "eval", "loss",
                      "status", "path"]
    rows = {}
    for line in lines[1:]:
        if line.startswith("* "):
            continue
        method, density, block, seed, steps, flops, gpu, wall, loss, status, path = line.split()
        rows[path] = {"method": method, "density": float(density), "block": block, "seed": seed, "steps": steps,
                      "flops": flops, "gpu": gpu, "wall": wall, "loss": loss, "status": status}
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
            assert float(row["gpu"]) == pytest.approx(45.0)   # the summary's train_s
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
    # One finished run without any time (summary or rows): the time panel is dropped (a narrower figure).
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


# --------------------------------------------------------------------------------------------------
# Frontiers, labels, tables, dense step counts
# --------------------------------------------------------------------------------------------------
def _result(method, density, block, loss, flops, gpu_s, steps=800, seed=0, path=None):
    return RunResult(Path(path or f"{method}/{density}/{block}/{seed}/{steps}"), method, density, block, loss, flops,
                     None if gpu_s is None else gpu_s * 1.1, "finished", steps=steps, gpu_s=gpu_s, seed=seed,
                     device="NVIDIA H100 80GB HBM3", date="2026-11-26")


def _crowded_study(seeds=(0, 1)):
    """4 methods x 3 densities x 3 blocks x seeds at the same few FLOP totals and near-equal losses, and dense
    runs: the layout of the real study, as crowded as it gets."""
    rng = random.Random(3)
    runs = []
    for method, density, block, seed in itertools.product(
            ["static", "prune_regrow/random", "prune_regrow/gradient", "gradual_magnitude"], (0.5, 0.25, 0.1),
            ("1", "16", "64"), seeds):
        runs.append(_result(method, density, block, 4.5 - 0.5 * density + rng.uniform(0, 0.03),
                            3e15 * (0.2 + 0.8 * density), 16 + rng.uniform(-0.5, 0.5), seed=seed))
    for steps, seed in itertools.product((800, 600, 400, 250), seeds):
        runs.append(_result("dense", 1.0, "-", 4.0 + 100 / steps, 3e12 * steps, 0.02 * steps, steps, seed))
    return runs


def test_frontier_is_the_lower_left_envelope():
    pts = [_result("static", 0.1, "16", loss, flops, None, path=str(i))
           for i, (flops, loss) in enumerate([(1, 5.0), (2, 4.0), (2, 4.5), (3, 4.2), (4, 3.0), (0.5, 6.0)])]
    best = frontier(pts, lambda r: r.total_train_flops)
    assert [(r.total_train_flops, r.final_eval_loss) for r in best] == [(0.5, 6.0), (1, 5.0), (2, 4.0), (4, 3.0)]


def test_place_labels_never_overlap_and_are_deterministic():
    rng = random.Random(0)
    anchors = [(100 + rng.uniform(0, 40), 100 + rng.uniform(0, 40)) for _ in range(80)]   # 80 labels in 40x40 px
    sizes = [(rng.uniform(20, 70), 9.0) for _ in anchors]
    markers = [(x - 4, y - 4, x + 4, y + 4) for x, y in anchors]
    bounds = (0, 0, 500, 400)
    boxes = place_labels(anchors, sizes, markers, bounds=bounds, gap=2.0)
    assert boxes == place_labels(anchors, sizes, markers, bounds=bounds, gap=2.0)
    for (x0, y0, x1, y1), (w, h) in zip(boxes, sizes):
        assert (x1 - x0, y1 - y0) == pytest.approx((w, h))
        assert bounds[0] <= x0 and x1 <= bounds[2] and bounds[1] <= y0 and y1 <= bounds[3]
    apart = lambda a, b: a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]  # noqa: E731
    assert all(apart(a, b) for a, b in itertools.combinations(boxes, 2))
    assert all(apart(a, m) for a in boxes for m in markers)
    # nowhere inside the bounds is free: the labels go outside them, still without overlaps
    tight = place_labels(anchors[:20], sizes[:20], bounds=(100, 100, 140, 140), rings=3)
    assert all(apart(a, b) for a, b in itertools.combinations(tight, 2))


def test_figure_labels_never_overlap_and_tell_runs_apart():
    from matplotlib.text import Text

    runs = _crowded_study()
    fig = pareto_figure(runs)
    fig.canvas.draw()                       # as savefig does: the annotations take their final positions
    renderer = fig.canvas.get_renderer()
    for ax in fig.axes:
        texts = [t for t in ax.texts if t.get_text()]
        assert sorted(t.get_text() for t in texts) == sorted(point_label(r, with_seed=True) for r in runs)
        assert len({(t.get_color(), t.get_text()) for t in texts}) == len(runs)  # colour (method) + text: one run
        boxes = [Text.get_window_extent(t, renderer) for t in texts]   # the text alone, not its leader line
        for a, b in itertools.combinations(boxes, 2):
            assert not a.overlaps(b), (a, b)
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert {"800 steps s0", "0.1 16x16 s1", "0.25 1x1 s0"} <= labels
    assert [ax.get_xlabel().split(" (")[0] for ax in fig.axes] == ["total training FLOPs", "training GPU-seconds"]


def test_tables_beside_the_png(tmp_path):
    runs = _crowded_study(seeds=(0,))
    csv_path, md_path = write_tables(runs, tmp_path / "study" / "pareto.png")
    assert (csv_path.name, md_path.name) == ("pareto.csv", "pareto.md")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == CSV_COLUMNS and len(rows) == len(runs)
    dense = sorted(int(r["steps"]) for r in rows if r["method"] == "dense")
    assert dense == [250, 400, 600, 800] and all(r["frontier"] == "FLOPs time" for r in rows if r["method"] == "dense")
    by_key = {(r["method"], r["density"], r["block"]): r for r in rows}
    assert float(by_key["static", "0.1", "16"]["final_eval_loss"]) == pytest.approx(
        next(r.final_eval_loss for r in runs if (r.method, r.density, r.block) == ("static", 0.1, "16")))
    assert sum(bool(r["frontier"]) for r in rows if r["method"] == "static") >= 3   # one per FLOP level at least
    md = md_path.read_text().splitlines()
    assert "NVIDIA H100 80GB HBM3, 2026-11-26" in md[0] and "Warning" not in md_path.read_text()
    assert sum(line.startswith("| ") for line in md) == len(runs) + 1
    assert "| dense | 1 | - | 0 | 800 |" in md_path.read_text()


def test_dense_steps_match_flops_and_gpu_seconds():
    dense = _result("dense", 1.0, "-", 4.0, 3e12 * 800, 16.0)           # 3e12 FLOPs and 20 ms per step
    sparse = [_result(m, d, b, 4.5, 3e12 * 800 * ratio, seconds, seed=s)
              for m in ("static", "prune_regrow/random") for s in (0, 1)
              for d, ratio, b, seconds in ((0.5, 0.6, "16", 16.5), (0.5, 0.6, "64", 15.0), (0.1, 0.27, "16", 12.0),
                                           (0.1, 0.27, "64", 8.0), (0.1, 0.27, "1", 50.0))]
    chosen = dense_steps([dense, *sparse])
    assert chosen == [(216, "FLOPs of density 0.1 (6.5e+14)"), (400, "GPU-seconds of 0.1 64x64 (8.0 s)"),
                      (480, "FLOPs of density 0.5 (1.4e+15)"), (600, "GPU-seconds of 0.1 16x16 (12.0 s)"),
                      (750, "GPU-seconds of 0.5 64x64 (15.0 s)"),
                      (1600, "GPU-seconds of 0.1 1x1 (50.0 s)")]   # 2500 capped at 2 x 800; 825 is within 5% of 800
    done = [_result("dense", 1.0, "-", 4.0, 3e12 * n, 0.02 * n, steps=n) for n, _ in chosen[:3]]
    assert [n for n, _ in dense_steps([dense, *done, *sparse])] == [600, 750, 1600]   # what is left to run
    with pytest.raises(ValueError, match="0 dense"):
        dense_steps(sparse)


def test_main_dense_steps_prints_only_the_list(tmp_path, capsys):
    root = tmp_path / "study"
    rng = random.Random(2)
    _make_run(root / "dense/reference", "dense", 1.0, rng)
    for i, d in enumerate((0.5, 0.1)):
        _make_run(root / f"sparse/{i}", "static", d, rng)
    assert main([str(root), "--dense-steps"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and all(n.isdigit() for n in out.strip().split(","))
    assert "FLOPs of density 0.1" in err and not (tmp_path / "pareto.png").exists()
    assert main([str(root / "sparse"), "--dense-steps"]) == 1
    assert "dense" in capsys.readouterr().err


def test_gpu_seconds_from_summary_or_rows_times_processes(tmp_path):
    rng = random.Random(4)
    _make_run(tmp_path / "new", "static", 0.1, rng)
    _make_run(tmp_path / "old", "static", 0.1, rng)
    write_summary(tmp_path / "old", status="finished", method="static", density=0.1, steps=100, final_eval_loss=3.0,
                  total_train_flops=1e15, wall_s=55.0, processes=2)   # written before summaries had train_s
    new, old = read_run(tmp_path / "new"), read_run(tmp_path / "old")
    assert new.gpu_s == pytest.approx(45.0)
    assert old.gpu_s == pytest.approx(2 * train_seconds(read_metrics(tmp_path / "old"), 100)) and old.gpu_s > 0


def test_tables_warn_when_step_modes_differ(tmp_path):
    runs = [replace(r, step_mode="eager" if i < 2 else "cuda_graph") for i, r in enumerate(_crowded_study((0,)))]
    _, md_path = write_tables(runs, tmp_path / "pareto.png")
    assert "different step modes (38 cuda_graph, 2 eager" in md_path.read_text()


# --------------------------------------------------------------------------------------------------
# A study in parts: the CSV of an earlier call as input
# --------------------------------------------------------------------------------------------------
def test_a_table_pareto_wrote_reads_back_as_the_same_runs(tmp_path):
    runs = _crowded_study(seeds=(0,))
    csv_path, _ = write_tables(runs, tmp_path / "day1" / "pareto.png")
    back = read_table(csv_path)
    assert sorted(back, key=lambda r: str(r.path)) == sorted(runs, key=lambda r: str(r.path))


def test_runs_and_an_earlier_table_plot_together_and_a_run_dir_wins_over_its_row(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rng = random.Random(5)
    for name, density in (("a", 0.1), ("b", 0.5)):
        _make_run(tmp_path / "runs" / name, "static", density, rng)
    earlier = collect_runs(["runs"])
    changed = RunResult(Path("runs/a"), "static", 0.1, "16x16", 9.9, 1e15, 5.0, "finished", steps=100)
    other = _result("prune_regrow/random", 0.25, "16", 2.5, 3e15, 12.0, path="elsewhere/0")
    csv_path, _ = write_tables([*earlier, changed, other], tmp_path / "day1" / "pareto.png")
    runs = collect_runs(["runs", str(csv_path)])
    by_path = {str(r.path) if not r.path.is_absolute() else os.path.relpath(r.path): r for r in runs}
    assert sorted(by_path) == ["elsewhere/0", "runs/a", "runs/b"]           # each run once
    assert by_path["runs/a"].final_eval_loss != 9.9                          # read from its directory
    assert by_path["elsewhere/0"].final_eval_loss == 2.5 and by_path["elsewhere/0"].gpu_s == 12.0
    assert main(["runs", str(csv_path), "--out", str(tmp_path / "all" / "pareto.png")]) == 0
    assert "elsewhere/0" in (tmp_path / "all" / "pareto.csv").read_text()


def test_a_malformed_table_is_refused_naming_the_file_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("method,density\nstatic,0.1\n")
    with pytest.raises(ValueError, match="bad.csv: not a table `sparsetrain pareto` wrote: no column"):
        read_table(bad)
    runs = [_result("static", 0.1, "16", 3.0, 1e15, 10.0)]
    good, _ = write_tables(runs, tmp_path / "t" / "pareto.png")
    text = good.read_text().splitlines()
    text[1] = text[1].replace("1000000000000000.0", "__import__('os')")
    good.write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match=r"pareto.csv, line 2: column 'train_flops' holds"):
        read_table(good)
    assert main([str(good), "--out", str(tmp_path / "x.png")]) == 2
    assert "train_flops" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_runs_from_two_devices_are_flagged(tmp_path):
    runs = [_result("static", 0.1, "16", 3.0, 1e15, 10.0),
            RunResult(Path("h200/run"), "dense", 1.0, None, 2.9, 3e15, 9.0, "finished", steps=800, gpu_s=8.0,
                      seed=0, device="NVIDIA H200", date="2026-11-26")]
    _, md = write_tables(runs, tmp_path / "pareto.png")
    assert "Warning:** the runs trained on different devices (1 on NVIDIA H100 80GB HBM3, 1 on NVIDIA H200)" \
        in md.read_text()

