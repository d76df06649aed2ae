"""The Pareto study recipes (docs/pareto.md): the grid they sweep, and the whole study as its commands run it, on
a tiny BERT and a text file written here (CPU, no network): dense reference, sparse points, `pareto --dense-steps`,
the matched dense runs, the plot with its CSV and markdown table."""
import contextlib
import csv
import io
import itertools

import pytest
import torch
from omegaconf import OmegaConf

from sparsetrain.cli import _sweep, main
from sparsetrain.config import compose, validate

ANIMALS = [("cat", "mat", "dog"), ("dog", "rug", "cat"), ("bird", "tree", "sky"), ("cow", "grass", "sun")]
TEXT = "\n\n".join(f"the {a} sat on the {b} and looked at the {c} ." for a, b, c in ANIMALS * 40)


def test_the_grid_is_4_methods_x_3_densities_x_3_blocks_each_in_a_format_that_fits():
    """The CLI checks command-line sweeps before Hydra runs them, not a recipe's own sweep: this test does."""
    params = compose(["recipe=pareto_bert_small"], return_hydra_config=True).hydra.sweeper.params
    jobs = _sweep([f"{k}={v}" for k, v in params.items()])
    assert len(jobs) == 36 and len({tuple(j) for j in jobs}) == 36
    grid = list(itertools.product(("static", "prune_regrow", "rigl", "gradual"), (1, 16, 64)))
    cfgs = {(m, b): compose(["recipe=pareto_bert_small", f"sparsity={m}", "sparsity.density=0.1",
                             f"sparsity.block={b}"]) for m, b in grid}
    # unstructured and gradual (it shrinks the active count) run masked; the others use the block kernels
    assert {k: cfg.sparsity.format for k, cfg in cfgs.items()} == {
        (m, b): "masked" if b == 1 or m == "gradual" else "block" for m, b in grid}
    for key in (("static", 64), ("prune_regrow", 16), ("rigl", 1), ("gradual", 64)):  # each method, block, format
        validate(cfgs[key])
    assert {compose(["recipe=pareto_bert_small", f"sparsity={m}"]).sparsity.distribution
            for m in ("static", "prune_regrow", "rigl", "gradual")} == {"uniform"}


def test_dense_baselines_differ_from_the_sparse_runs_in_sparsity_only():
    sparse = OmegaConf.to_container(compose(["recipe=pareto_bert_small"]), resolve=True)
    dense = OmegaConf.to_container(compose(["recipe=pareto_bert_small_dense"]), resolve=True)
    assert {k for k in sparse if sparse[k] != dense[k]} == {"sparsity", "recipe_info"}
    assert dense["sparsity"]["scheduler"]["_target_"].endswith("Dense") and dense["data"]["source"] == "english_large"
    assert compose(["recipe=pareto_bert_small_dense"], return_hydra_config=True).hydra.sweeper.params is None


@pytest.fixture
def one_thread():
    """One intra-op thread, as the CLI tests' subprocesses run (OMP_NUM_THREADS=1): on a busy 2-core machine more
    threads make each tiny step wait for the others."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_study_runs_end_to_end_on_a_tiny_model(tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(TEXT)
    study = tmp_path / "study"
    tiny = ["model=bert_tiny", "data=text_files", f"data.files=[{tmp_path / 'corpus.txt'}]",
            f"data.cache_dir={tmp_path / 'cache'}", "data.vocab_size=128", "data.seq_len=16", "data.val_fraction=0.1",
            "trainer.device=cpu", "trainer.mixed_precision=no", "trainer.batch_size=4", "trainer.log_every=1",
            "trainer.eval_every=4", "trainer.eval_batches=1", "trainer.num_workers=0", "optim.warmup_steps=1",
            "sparsity.scheduler.num_updates=1"]
    # the study's commands (docs/pareto.md), each cut to a few steps and 2 of the 36 sparse points
    assert main(["train", "recipe=pareto_bert_small_dense", f"hydra.run.dir={study}/dense/reference",
                 "trainer.max_steps=4", *tiny]) == 0
    assert main(["train", "-m", "recipe=pareto_bert_small", "sparsity=rigl,gradual", "sparsity.density=0.5",
                 "sparsity.block=1", f"hydra.sweep.dir={study}/sparse", "trainer.max_steps=4", *tiny]) == 0
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["pareto", str(study), "--dense-steps"]) == 0
    steps = out.getvalue().strip()
    assert steps and all(n.isdigit() for n in steps.split(","))
    assert main(["train", "-m", "recipe=pareto_bert_small_dense", f"trainer.max_steps={steps}",
                 f"hydra.sweep.dir={study}/dense/matched", *tiny]) == 0
    assert main(["pareto", str(study), "--out", str(study / "pareto.png")]) == 0

    assert (study / "pareto.png").stat().st_size > 10_000
    with open(study / "pareto.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    runs = {(r["method"], r["density"], r["block"], r["steps"]) for r in rows}
    assert runs == {("prune_regrow/gradient", "0.5", "1", "4"), ("gradual_magnitude", "0.5", "1", "4"),
                    ("dense", "1.0", "-", "4"), *(("dense", "1.0", "-", n) for n in steps.split(","))}
    assert all(float(r["gpu_s"]) > 0 and float(r["final_eval_loss"]) > 0 and r["device"] == "cpu"
               for r in rows if r["steps"] != "2")   # 2 steps: both windows are start-up, no GPU-seconds
    md = (study / "pareto.md").read_text()
    assert md.count("\n| ") == len(rows) + 1 and "prune_regrow/gradient" in md
