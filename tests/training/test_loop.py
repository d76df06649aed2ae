"""The training loop driven by plain arguments (no config): it applies the run's kernel options for the run and
restores them, calls the sparsity hook once per optimizer step and writes its rows and summary."""
from types import SimpleNamespace

import pytest
import torch

from sparsetrain.data.mlm import MLMCollator, PackedSequences
from sparsetrain.kernels import KernelOptions, kernel_options
from sparsetrain.models.builders import build_model
from sparsetrain.nn import DEFAULT_EXCLUDE
from sparsetrain.sparsity.layout import Block
from sparsetrain.sparsity.schedulers import Static
from sparsetrain.training.loop import train
from sparsetrain.training.metrics import read_metrics, train_seconds
from sparsetrain.training.setup import RunSpec, TrainArgs, optimizer_factory


def _tiny_mlm_data(vocab: int = 64, seq_len: int = 16):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (48, seq_len), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3
    collator = MLMCollator(mask_token_id=4, vocab_size=vocab, special_ids=[0, 1, 2, 3, 4])
    return SimpleNamespace(train=PackedSequences(ids[:40]), eval=PackedSequences(ids[40:]), collator=collator,
                           vocab_size=vocab, seq_len=seq_len)


def _spec(scheduler, args: TrainArgs, build_data=_tiny_mlm_data) -> RunSpec:
    """A one-layer tiny BERT, half its linears masked in 16x16 blocks, trained by ``args``."""
    return RunSpec(
        build_model=lambda: build_model("bert", "tiny", vocab_size=64, seq_len=16, num_hidden_layers=1),
        build_data=build_data,
        build_optimizer=optimizer_factory(torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.01}),
        scheduler=scheduler,
        sparsify_kwargs=dict(targets=["*"], exclude=list(DEFAULT_EXCLUDE), density=0.5, distribution="uniform",
                             density_overrides=None, block=Block(16, 16), format="masked", init="random", seed=0),
        train_args=args, method="static", block_label="16",
    )


def test_train_from_plain_arguments_runs_under_its_kernel_options(tmp_path):
    scheduler = Static()
    seen = []
    step = scheduler.step

    def step_and_record(n):
        seen.append((n, kernel_options()))
        return step(n)

    scheduler.step = step_and_record
    args = TrainArgs(max_steps=3, batch_size=4, eval_every=3, eval_batches=1, log_every=1, device="cpu",
                     progress=False, plot=False, recipe="plain", kernels=KernelOptions(dense_fallback=False))
    spec = _spec(scheduler, args)
    before = kernel_options()
    summary = train(spec, tmp_path / "run")
    assert [n for n, _ in seen] == [1, 2, 3]
    assert all(opts == KernelOptions(dense_fallback=False) for _, opts in seen)   # in force during the run
    assert kernel_options() == before                                             # and restored after it
    assert summary["steps"] == 3 and summary["block"] == "16" and summary["density"] == 0.5
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1, 2, 3]
    assert (tmp_path / "run" / "checkpoints" / "step_00000003").is_dir()


def test_a_data_error_found_while_reading_leaves_an_existing_run_dir_untouched(tmp_path):
    """Data problems only reading can find (too little text, a malformed file) come before config.yaml is
    written: an existing run's config survives a bad restart (issue 19 item 8)."""
    import pytest

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("earlier: run\n")

    def unreadable_data():
        raise ValueError("data.files: holds 3 tokens, fewer than one sequence of seq_len=16")

    spec = _spec(Static(), TrainArgs(max_steps=2, batch_size=4, device="cpu", progress=False, plot=False),
                 build_data=unreadable_data)
    with pytest.raises(ValueError, match="data.files"):
        train(spec, run)
    assert (run / "config.yaml").read_text() == "earlier: run\n"
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]


def test_summary_train_s_leaves_out_the_startup_window(tmp_path):
    """The first window (kernel tuning, compilation, the first capture) is marked `startup` and charged in
    `train_s` (the training-step seconds the Pareto study plots) at the next window's rate; evaluation is in neither."""
    args = TrainArgs(max_steps=6, batch_size=4, eval_every=2, eval_batches=1, log_every=2, device="cpu",
                     progress=False, plot=False, recipe="plain")
    summary = train(_spec(Static(), args), tmp_path / "run")
    rows = read_metrics(tmp_path / "run")
    train_rows = [r for r in rows if "loss" in r]
    assert [r.get("startup", False) for r in train_rows] == [True, False, False]
    steady = train_rows[-1]["elapsed_s"] - train_rows[0]["elapsed_s"]
    second = train_rows[1]["elapsed_s"] - train_rows[0]["elapsed_s"]   # the first window is charged at its rate
    assert summary["train_s"] == train_seconds(rows, 6) == pytest.approx(second + steady)
    assert 0 < summary["train_s"] and summary["device"] == "cpu"


def test_the_run_is_torn_down_after_its_step_and_prepared_objects_are_gone(tmp_path, monkeypatch):
    """A finished run ends its Accelerator (the process group with several processes) only once its training step
    (with the CUDA graph and the prepared, e.g. DDP-wrapped, model it calls) is freed and accelerate holds none of
    the prepared objects: a DDP reducer that outlived its gloo group was seen to hang in its destructor. (The
    scheduler, which the caller's spec holds, keeps the unwrapped model; that holds no process group.)"""
    import weakref

    from accelerate import Accelerator

    from sparsetrain.training import step as step_module

    seen, steps = {}, []
    real_end, real_step = Accelerator.end_training, step_module.TrainStep

    def end_training(self):
        seen["step_alive"] = any(ref() is not None for ref in steps)
        seen["prepared"] = len(self._models) + len(self._optimizers)
        return real_end(self)

    def make_step(*a, **k):
        step = real_step(*a, **k)
        steps.append(weakref.ref(step))
        return step

    monkeypatch.setattr(Accelerator, "end_training", end_training)
    monkeypatch.setattr(step_module, "TrainStep", make_step)
    args = TrainArgs(max_steps=2, batch_size=4, eval_every=0, log_every=1, device="cpu", progress=False,
                     plot=False, recipe="plain", checkpoint_every=0)
    train(_spec(Static(), args), tmp_path / "run")
    assert steps and seen == {"step_alive": False, "prepared": 0}


def test_runs_in_one_process_may_use_different_precisions(tmp_path):
    """accelerate's state is process-wide: a Hydra sweep's jobs (or tests) run one after another in one process,
    and a later job's mixed precision must not be refused because an earlier job set another."""
    from accelerate.state import AcceleratorState

    done = []
    for precision in ("no", "bf16", "no"):
        args = TrainArgs(max_steps=1, batch_size=4, eval_every=0, log_every=1, device="cpu", progress=False,
                         plot=False, recipe="plain", checkpoint_every=0, mixed_precision=precision)
        done.append(train(_spec(Static(), args), tmp_path / f"run_{len(done)}_{precision}")["steps"])
        assert not AcceleratorState._shared_state   # the run took its state with it
    assert done == [1, 1, 1]


def test_a_batch_larger_than_the_held_out_set_is_refused_before_the_run_dir_is_written(tmp_path):
    """The held-out set (8 examples) is checked against trainer.batch_size up front, and only where it is read."""
    args = dict(max_steps=2, batch_size=16, eval_batches=1, log_every=1, device="cpu", progress=False, plot=False,
                recipe="plain")
    with pytest.raises(ValueError, match=r"trainer.batch_size: 16 x 1 process\(es\) is larger than the held-out "
                                         r"set \(trainer.eval_every\) \(8 examples\)"):
        train(_spec(Static(), TrainArgs(eval_every=1, **args)), tmp_path / "refused")
    assert not (tmp_path / "refused" / "config.yaml").exists()
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()
    summary = train(_spec(Static(), TrainArgs(eval_every=0, **args)), tmp_path / "no_eval")
    assert summary["steps"] == 2


def test_the_scheduler_prepares_its_updates_once_inside_the_startup_window(tmp_path):
    """`prepare_updates` (the graphed update's capture ahead of the first update) runs once, after the first step
    of the process that a graph step would replay (warm-up + 1), and that step's window is start-up: its cost is
    start-up work, left out of `train_s` like the training step's own capture."""
    calls = []

    class Preparing(Static):
        def prepare_updates(self, grow=None):
            calls.append(self.step_count)
            return True

    args = TrainArgs(max_steps=5, batch_size=4, eval_every=0, log_every=1, device="cpu", progress=False,
                     plot=False, recipe="plain")
    train(_spec(Preparing(), args), tmp_path / "run")
    assert calls == [2]
    startup = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r and r.get("startup")]
    assert startup == [1, 2]
