"""The real CLI in subprocesses: quickstart learns, kill + resume is exact, two ranks agree, pareto plots."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
KILL_LAUNCHER = Path(__file__).resolve().parent / "kill_at_step.py"
TINY = ["trainer.batch_size=8", "data.seq_len=32", "data.vocab_size=1024", "trainer.eval_batches=2"]


def cli(*args, env=None, check=True, timeout=600, kill_at_step=None):
    """Run ``sparsetrain ARGS`` in a subprocess; ``kill_at_step=N`` SIGKILLs it after step N
    (through tests/kill_at_step.py)."""
    e = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    launcher = ["-m", "sparsetrain.cli"] if kill_at_step is None else [str(KILL_LAUNCHER), str(kill_at_step)]
    r = subprocess.run([sys.executable, *launcher, *args], cwd=ROOT, env=e, capture_output=True,
                       text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"exit {r.returncode}\nSTDOUT:\n{r.stdout[-3000:]}\nSTDERR:\n{r.stderr[-3000:]}")
    return r


def rows(run_dir, key):
    return [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()
            if key in json.loads(line)]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("quick") / "run"
    r = cli("train", "recipe=quickstart", "trainer.max_steps=60", "trainer.eval_every=30", "trainer.log_every=10",
            *TINY, f"hydra.run.dir={d}")
    return d, r


@pytest.mark.slow
def test_quickstart_learns_and_writes_everything(quickstart_run):
    d, r = quickstart_run
    train = rows(d, "loss")
    assert [x["step"] for x in train] == [10, 20, 30, 40, 50, 60]
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, [x["loss"] for x in train]   # it learns
    flops = [x["train_flops"] for x in train]
    assert all(b > a for a, b in zip(flops, flops[1:]))
    assert all(abs(x["density"] - 0.1) < 0.001 and x["tokens_per_s"] > 0 for x in train)
    updates = rows(d, "event")
    assert updates and all(u["pruned"] == u["regrown"] > 0 for u in updates if u["event"] == "mask_update")
    assert len(rows(d, "eval_loss")) == 2
    summary = json.loads((d / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["method"] == "prune_regrow/random"
    assert (d / "curves.png").stat().st_size > 10_000 and (d / "config.yaml").is_file()
    assert (d / "tokenizer" / "tokenizer.json").is_file()  # the run keeps its own tokenizer (export reads it)
    assert list((d / "wandb").glob("offline-run-*/*.wandb")), "wandb offline run files"
    assert "final eval loss" in r.stdout


@pytest.mark.slow
def test_kill_and_resume_equals_uninterrupted(tmp_path):
    common = ["recipe=quickstart", "trainer.max_steps=24", "trainer.checkpoint_every=8", "trainer.log_every=4",
              "trainer.eval_every=12", "logger=quiet", "sparsity.scheduler.num_updates=5", *TINY]
    a, b = tmp_path / "a", tmp_path / "b"
    cli("train", *common, f"hydra.run.dir={a}")
    killed = cli("train", *common, f"hydra.run.dir={b}", kill_at_step=13, check=False)
    assert killed.returncode != 0
    assert sorted(p.name for p in (b / "checkpoints").iterdir() if not p.name.startswith(".")) == ["step_00000008"]
    again = cli("train", *common, f"hydra.run.dir={b}", check=False)           # refuses to clobber
    assert again.returncode == 2 and "trainer.resume=auto" in again.stderr
    cli("train", *common, f"hydra.run.dir={b}", "trainer.resume=auto")
    la, lb = rows(a, "loss"), rows(b, "loss")
    assert [x["step"] for x in lb] == [4, 8, 12, 16, 20, 24]
    assert [x["loss"] for x in la] == [x["loss"] for x in lb]                  # exactly equal on CPU
    assert [x["eval_loss"] for x in rows(a, "eval_loss")] == [x["eval_loss"] for x in rows(b, "eval_loss")]
    ma = torch.load(a / "checkpoints/step_00000024/pytorch_model.bin", map_location="cpu")
    mb = torch.load(b / "checkpoints/step_00000024/pytorch_model.bin", map_location="cpu")
    masks = [k for k in ma if k.endswith(".mask")]
    assert masks and all(ma[k].equal(mb[k]) for k in masks)
    assert all(ma[k].equal(mb[k]) for k in ma)


def _kill_processes_mentioning(text: str) -> None:
    """SIGKILL every process whose command line contains ``text`` (Linux /proc): never leave workers behind,
    and never let their open pipes keep the test waiting."""
    from pathlib import Path

    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            if text in (proc_dir / "cmdline").read_bytes().decode(errors="replace"):
                os.kill(int(proc_dir.name), 9)
        except (OSError, ValueError):
            continue


@pytest.mark.slow
def test_two_process_run_has_identical_masks(tmp_path):
    d = tmp_path / "ddp"
    e = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    import socket

    with socket.socket() as sock:  # a free port: a fixed one would collide with another run on the machine
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), "-m", "sparsetrain.cli", "train",
           "trainer.device=cpu",
           "recipe=quickstart", "trainer.max_steps=12", "trainer.eval_every=6", "logger=quiet",
           "sparsity.scheduler.num_updates=3", "sparsity.scheduler.policy._target_=sparsetrain.sparsity.RigL",
           *TINY, f"hydra.run.dir={d}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        _kill_processes_mentioning(str(d))  # the launcher starts each worker in a session of its own
        _, err = proc.communicate()
        raise AssertionError(f"two-process run did not finish in 300 s:\n{err[-3000:]}") from None
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["processes"] == 2 and summary["ranks_masks_identical"] is True
    assert [u["pruned"] > 0 for u in rows(d, "event")] == [True] * 3


@pytest.mark.slow
def test_pareto_from_two_runs(quickstart_run, tmp_path):
    d1, _ = quickstart_run
    d2 = tmp_path / "dense"
    cli("train", "sparsity=dense", "trainer=cpu_small", "trainer.max_steps=20", "trainer.eval_every=20",
        "logger=quiet", *TINY, f"hydra.run.dir={d2}")
    out = tmp_path / "pareto.png"
    r = cli("pareto", str(d1), str(d2), "--out", str(out))
    assert out.stat().st_size > 10_000
    assert "prune_regrow/random" in r.stdout and "dense" in r.stdout


def test_unknown_recipe_lists_recipes():
    r = cli("train", "recipe=nope", check=False)
    assert r.returncode == 2 and "unknown recipe 'nope'" in r.stderr and "quickstart" in r.stderr


def test_invalid_value_leaves_existing_run_untouched(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = sorted(p.name for p in d.rglob("*"))
    r = cli("train", "recipe=quickstart", "sparsity.density=1.7", f"hydra.run.dir={d}", check=False)
    assert r.returncode == 2 and "sparsity.density" in r.stderr
    assert sorted(p.name for p in d.rglob("*")) == before
    assert (d / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'


def test_bad_override_key_reports_hydra_error():
    r = cli("train", "recipe=quickstart", "trainer.maxsteps=3", check=False)
    assert r.returncode != 0 and "trainer.maxsteps" in r.stderr


def test_recipes_and_flops_commands():
    r = cli("recipes")
    assert "quickstart" in r.stdout and "bert_phase1_dynamic" in r.stdout
    f = cli("flops", "recipe=quickstart")
    assert "sparse / dense" in f.stdout and "bert.encoder.layer.0.intermediate.dense" in f.stdout


@pytest.mark.slow
def test_export_hf_and_sparse_round_trip(quickstart_run, tmp_path):
    from transformers import BertForMaskedLM

    from sparsetrain.export import load_trained_model
    from sparsetrain.inference import load_sparse

    d, _ = quickstart_run
    cli("export", str(d), "--format", "hf", "--out", str(tmp_path / "hf"))
    cli("export", str(d), "--format", "sparse", "--out", str(tmp_path / "sparse"))
    cli("export", str(d), "--format", "sparse", "--layer-format", "pair", "--out", str(tmp_path / "pair"))
    trained = load_trained_model(d)
    x = torch.randint(5, 1000, (2, 32))
    with torch.no_grad():
        ref = trained(input_ids=x).logits
        hf = BertForMaskedLM.from_pretrained(tmp_path / "hf").eval()
        torch.testing.assert_close(hf(input_ids=x).logits, ref)
        w = hf.bert.encoder.layer[0].intermediate.dense.weight
        assert (w == 0).float().mean().item() == pytest.approx(0.9, abs=0.002)     # the trained 90% sparsity
        sparse = load_sparse(lambda: BertForMaskedLM(hf.config), str(tmp_path / "sparse")).eval()
        torch.testing.assert_close(sparse(input_ids=x).logits, ref, rtol=1e-3, atol=1e-3)
        pair = load_sparse(lambda: BertForMaskedLM(hf.config), str(tmp_path / "pair")).eval()
        assert pair.bert.encoder.layer[0].intermediate.dense.fmt == "pair"
        torch.testing.assert_close(pair(input_ids=x).logits, ref, rtol=1e-3, atol=1e-3)
    r = cli("export", str(tmp_path), check=False)
    assert r.returncode == 2 and "not a sparsetrain run directory" in r.stderr


@pytest.mark.slow
def test_grad_accumulation_counts_optimizer_steps_and_sparse_run_refuses_dense_checkpoint(tmp_path):
    acc = tmp_path / "acc"
    cli("train", "recipe=quickstart", "trainer.max_steps=12", "trainer.grad_accum=3", "trainer.log_every=4",
        "trainer.eval_every=0", "logger=quiet", "sparsity.scheduler.num_updates=3", *TINY, f"hydra.run.dir={acc}")
    assert [u["step"] for u in rows(acc, "event")] == [3, 6, 9]         # optimizer steps, not micro-batches
    assert [x["step"] for x in rows(acc, "loss")] == [4, 8, 12]
    s = json.loads((acc / "summary.json").read_text())
    # FLOPs of 12 optimizer steps of 3 micro-batches each
    assert s["total_train_flops"] == pytest.approx(12 * s["flops_per_step_sparse"], rel=0.05)

    dense = tmp_path / "dense"
    cli("train", "trainer=cpu_small", "trainer.max_steps=4", "trainer.checkpoint_every=2", "trainer.eval_every=0",
        "logger=quiet", *TINY, f"hydra.run.dir={dense}")
    ckpt = dense / "checkpoints" / "step_00000004"
    before = {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()}
    r = cli("train", "recipe=quickstart", f"trainer.resume={ckpt}", "logger=quiet", *TINY,
            f"hydra.run.dir={tmp_path / 'sparse'}", check=False)
    assert r.returncode == 2 and "has no sparsity state" in r.stderr
    assert {p.name: p.stat().st_mtime_ns for p in ckpt.iterdir()} == before


def test_missing_data_files_named_before_any_work(tmp_path):
    r = cli("train", "data=text_files", f"data.files=[{tmp_path}/nope.txt]", f"hydra.run.dir={tmp_path}/run",
            check=False)
    assert r.returncode == 2 and "data.files" in r.stderr and "nope.txt" in r.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_trainer_compile_runs_and_matches_eager_closely(tmp_path):
    """trainer.compile=true: the first step eager, then the torch.compile'd forward (mask updates included);
    the losses track an eager run of the same seed (dropout draws differ under inductor, so not bit-equal)."""
    common = ["train", "recipe=quickstart", "trainer.max_steps=6", "trainer.eval_every=0", "trainer.log_every=2",
              "logger=quiet", "sparsity.scheduler.num_updates=3", *TINY]
    cli(*common, "trainer.compile=true", f"hydra.run.dir={tmp_path / 'compiled'}")
    cli(*common, f"hydra.run.dir={tmp_path / 'eager'}")
    compiled, eager = rows(tmp_path / "compiled", "loss"), rows(tmp_path / "eager", "loss")
    assert [r["step"] for r in compiled] == [2, 4, 6]
    assert [u["step"] for u in rows(tmp_path / "compiled", "event")] == [u["step"] for u in rows(tmp_path / "eager", "event")]
    for a, b in zip(compiled, eager):
        assert abs(a["loss"] - b["loss"]) < 0.05
    assert json.loads((tmp_path / "compiled" / "summary.json").read_text())["status"] == "finished"


def test_bench_without_a_known_name_prints_the_benchmarks(capsys):
    from sparsetrain.bench import BENCHES
    from sparsetrain.cli import main

    for argv in (["bench"], ["bench", "nope"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "usage: sparsetrain bench" in err and all(name in err for name in BENCHES)
