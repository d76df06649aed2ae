"""``trainer.init_from``: a new run (BERT phase II) starts from another run's checkpoint with exactly its weights and
masks, at step 0 with a fresh optimizer and LR schedule, on a longer ``seq_len`` with the same position table; a
missing, damaged or mismatched checkpoint, or ``trainer.resume=PATH`` beside it, is refused naming the key before
anything is written into the new run dir."""
import shutil
from pathlib import Path

import pytest
import torch

from sparsetrain.models.builders import build_model
from sparsetrain.nn import DEFAULT_EXCLUDE
from sparsetrain.nn.sparse_linear import SparseLinear
from sparsetrain.sparsity.layout import Block
from sparsetrain.sparsity.schedulers import PruneRegrow
from sparsetrain.training import checkpoint as ckpt
from sparsetrain.training.checkpoint import CheckpointError
from sparsetrain.training.loop import train
from sparsetrain.training.metrics import read_metrics
from sparsetrain.training.resume import find_init, plan_start
from sparsetrain.training.setup import RunSpec, TrainArgs, optimizer_factory
from tests.training.test_loop import _tiny_mlm_data

POSITIONS = 32


def _spec(seq_len: int = 16, seed: int = 0, density: float = 0.5, positions: int = POSITIONS, seen=None,
          **args) -> RunSpec:
    """A one-layer tiny BERT, half its linears in 8x8 blocks of the block format (on the CPU its plain-torch path,
    as 16x16 blocks would run the Triton interpreter), SET every 2 steps. ``seen`` gets the model's state, its
    sparse layers' outputs and the optimizer's state as the optimizer is built (after an init_from load, before
    step 1)."""
    def build_optimizer(model):
        opt = optimizer_factory(torch.optim.AdamW, {"lr": 1e-3})(model)
        if seen is not None:
            x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                outputs = {n: (m.values.shape[0], m(x)) for n, m in model.named_modules()
                           if isinstance(m, SparseLinear) and m.in_features == 128}
            seen.update(state={k: v.detach().clone() for k, v in model.state_dict().items()}, x=x,
                        outputs=outputs, optimizer_state=len(opt.state))
        return opt

    kw = dict(max_steps=4, batch_size=4, eval_every=0, eval_batches=1, log_every=1, checkpoint_every=0,
              device="cpu", progress=False, plot=False, recipe="plain", seed=seed)
    kw.update(args)
    config = {"model": {"arch": "bert", "size": "tiny", "seq_len": seq_len, "max_position_embeddings": positions,
                        "num_hidden_layers": 1},
              "data": {"seq_len": seq_len, "vocab_size": 64},
              "sparsity": {"density": density, "block": 8, "format": "block", "scheduler": {"interval": 2}},
              "seed": seed}
    return RunSpec(
        build_model=lambda: build_model("bert", "tiny", vocab_size=64, seq_len=seq_len, num_hidden_layers=1,
                                        max_position_embeddings=positions),
        build_data=lambda: _tiny_mlm_data(seq_len=seq_len),
        build_optimizer=build_optimizer,
        scheduler=PruneRegrow(policy="set", drop_fraction=0.3, interval=2, seed=seed),
        sparsify_kwargs=dict(targets=["*"], exclude=list(DEFAULT_EXCLUDE), density=density, distribution="uniform",
                             density_overrides=None, block=Block(8, 8), format="block", init="random",
                             seed=seed),
        train_args=TrainArgs(**kw), method="prune_regrow/set", config=config, block_label="8")


@pytest.fixture(scope="module")
def phase1(tmp_path_factory) -> Path:
    """Phase I: seq 16, four steps (mask updates at 2 and 4), its final checkpoint at step 4."""
    d = tmp_path_factory.mktemp("phase1") / "run"
    train(_spec(), d)
    return d


def _untouched(run_dir: Path) -> None:
    assert not (run_dir / "config.yaml").exists() and not (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "checkpoints").exists()


def test_phase2_starts_from_the_checkpoints_weights_and_masks_at_step_0(phase1, tmp_path):
    path = phase1 / "checkpoints" / "step_00000004"
    saved = torch.load(path / ckpt.MODEL_FILE, weights_only=True)
    fresh = {}
    train(_spec(seq_len=16, seed=1, max_steps=1, seen=fresh), tmp_path / "fresh")   # seed 1 draws other masks
    seen, steps = {}, []
    spec = _spec(seq_len=32, seed=1, max_steps=2, seen=seen, init_from=str(path))
    step = spec.scheduler.step
    spec.scheduler.step = lambda n: steps.append(n) or step(n)
    summary = train(spec, tmp_path / "phase2")

    assert set(seen["state"]) == set(saved)
    assert all(torch.equal(seen["state"][k], saved[k]) for k in saved), "not bit-exactly the checkpoint's"
    masks = [k for k in saved if k.endswith(".mask")]
    assert masks and any(not torch.equal(fresh["state"][k], saved[k]) for k in masks)   # loaded, not re-drawn
    assert seen["outputs"]
    for name, (active, out) in seen["outputs"].items():   # block format: values of the loaded active count, and
        assert active == int(saved[f"{name}.mask"].sum())    # metadata rebuilt for the loaded mask
        dense = saved[f"{name}.weight"] * saved[f"{name}.mask"].repeat_interleave(8, 0).repeat_interleave(8, 1)
        torch.testing.assert_close(out, torch.nn.functional.linear(seen["x"], dense, saved[f"{name}.bias"]))
    assert seen["optimizer_state"] == 0                # a fresh optimizer
    assert steps == [1, 2] and summary["steps"] == 2   # from step 0, on its own scheduler
    rows = read_metrics(tmp_path / "phase2")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    end = torch.load(tmp_path / "phase2/checkpoints/step_00000002" / ckpt.STATE_FILE, weights_only=True)
    assert end["lr_scheduler"]["last_epoch"] == 2 and end["sparsity"]["step"] == 2 and end["sparsity"]["seed"] == 1
    assert end["config"]["data"]["seq_len"] == 32
    opt = torch.load(tmp_path / "phase2/checkpoints/step_00000002" / ckpt.OPTIMIZER_FILE, weights_only=True)
    assert {float(s["step"]) for s in opt["state"].values()} == {2.0}   # Adam counted this run's steps only


def test_a_run_dir_means_its_newest_intact_checkpoint_and_the_runs_own_checkpoint_wins(phase1, tmp_path):
    path, state, notes = find_init(phase1)
    assert path == phase1 / "checkpoints" / "step_00000004" and state["step"] == 4 and notes == []
    plan = plan_start(None, tmp_path / "new", init_from=str(phase1))
    assert plan.path is None and plan.init_path == path
    own = plan_start("auto", phase1, init_from=str(tmp_path / "gone"))   # resuming itself: init_from unused
    assert own.path == path and own.init_path is None
    assert any("trainer.init_from is not used" in n for n in own.notes)


def _damaged(phase1: Path, tmp_path: Path) -> Path:
    bad = tmp_path / "bad" / "step_00000004"
    shutil.copytree(phase1 / "checkpoints" / "step_00000004", bad)
    model = bad / ckpt.MODEL_FILE
    model.write_bytes(model.read_bytes()[:100])
    return bad


@pytest.mark.parametrize("case", ["missing", "damaged", "layout", "positions", "with_resume"])
def test_a_bad_init_from_is_refused_naming_the_key_before_anything_is_written(phase1, tmp_path, case):
    path = str(phase1 / "checkpoints" / "step_00000004")
    spec, expect = {
        "missing": (lambda: _spec(init_from=str(tmp_path / "nope")), ["does not exist"]),
        "damaged": (lambda: _spec(init_from=str(_damaged(phase1, tmp_path))), ["pytorch_model.bin is damaged"]),
        "layout": (lambda: _spec(density=0.25, init_from=path), ["sparsity.density (0.5 -> 0.25)"]),
        "positions": (lambda: _spec(seq_len=32, positions=64, init_from=path),
                      ["model.max_position_embeddings (32 -> 64)"]),
        "with_resume": (lambda: _spec(init_from=path, resume=path), ["trainer.resume=", "both set"]),
    }[case]
    run = tmp_path / "new"
    with pytest.raises(CheckpointError) as err:
        train(spec(), run)
    msg = str(err.value)
    assert msg.startswith("trainer.init_from") and "\n" not in msg, msg
    assert all(e in msg for e in expect), msg
    _untouched(run)


def test_the_config_key_is_declared_and_checked():
    from sparsetrain.config import ConfigError, build_run, compose, validate

    for recipe in ("quickstart", "bert_phase2_dynamic"):
        assert compose([f"recipe={recipe}"]).trainer.init_from is None
    assert compose(["recipe=bert_phase1_dynamic"]).model.max_position_embeddings == 512
    assert build_run(compose(["recipe=quickstart", "trainer.init_from=runs/a"])).train_args.init_from == "runs/a"
    with pytest.raises(ConfigError) as e:
        validate(compose(["recipe=quickstart", "trainer.init_from=5"]))
    assert str(e.value).startswith("trainer.init_from")
