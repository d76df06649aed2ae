"""Hardening of the loop, in process on a tiny BERT: a NaN stops the run before anything bad is saved or a mask
update runs; nothing loaded on resume can execute code; a partial run restarts; resume refuses another model or
mask config, skips a damaged checkpoint and removes leftovers of an interrupted write."""
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from sparsetrain.models.builders import build_model
from sparsetrain.nn import DEFAULT_EXCLUDE
from sparsetrain.sparsity.layout import Block
from sparsetrain.sparsity.schedulers import PruneRegrow
from sparsetrain.training import checkpoint as ckpt
from sparsetrain.training.checkpoint import CheckpointError
from sparsetrain.training.guard import NonFiniteLoss, RunStopped
from sparsetrain.training.loop import RunDirError, train
from sparsetrain.training.metrics import read_metrics
from sparsetrain.training.resume import plan_start, shape_changes
from sparsetrain.training.setup import RunSpec, TrainArgs, optimizer_factory
from tests.training.test_loop import _tiny_mlm_data

CONFIG = {"model": {"arch": "bert", "size": "tiny"}, "sparsity": {"density": 0.5, "block": 16}, "seed": 0,
          "optim": {"optimizer": {"lr": 1e-3}}}


def _spec(poison_after: int | None = None, records: list | None = None, config: dict | None = None, **args):
    """A tiny prune-and-regrow run (mask updates at steps 3, 6, 9 of 12). ``poison_after=N`` writes a NaN into
    one weight right after optimizer step N (so the loss of step N+1 is NaN)."""
    scheduler = PruneRegrow(policy="set", drop_fraction=0.3, interval=3)
    step = scheduler.step

    def step_and_poison(n):
        record = step(n)
        if records is not None and record is not None:
            records.append(n)
        if n == poison_after:
            with torch.no_grad():
                next(scheduler.model.parameters()).view(-1)[0] = float("nan")
        return record

    scheduler.step = step_and_poison
    kw = dict(max_steps=12, batch_size=4, eval_every=0, eval_batches=1, log_every=100, checkpoint_every=4,
              device="cpu", progress=False, plot=False, recipe="plain", overrides=("recipe=plain", "seed=0"))
    kw.update(args)
    return RunSpec(
        build_model=lambda: build_model("bert", "tiny", vocab_size=64, seq_len=16, num_hidden_layers=1),
        build_data=_tiny_mlm_data,
        build_optimizer=optimizer_factory(torch.optim.AdamW, {"lr": 1e-3}),
        scheduler=scheduler,
        sparsify_kwargs=dict(targets=["*"], exclude=list(DEFAULT_EXCLUDE), density=0.5, distribution="uniform",
                             density_overrides=None, block=Block(16, 16), format="masked", init="random", seed=0),
        train_args=TrainArgs(**kw), method="prune_regrow/set", config=dict(config or CONFIG), block_label="16")


def _reseal(checkpoint: Path, name: str) -> None:
    """Record a file's new size and checksum in meta.json, as if the checkpoint had been written with it."""
    meta = json.loads((checkpoint / ckpt.META_FILE).read_text())
    meta["files"][name] = (checkpoint / name).stat().st_size
    meta["sha256"][name] = hashlib.sha256((checkpoint / name).read_bytes()).hexdigest()
    (checkpoint / ckpt.META_FILE).write_text(json.dumps(meta))


def _steps(run_dir: Path) -> list[str]:
    return [p.name for p in ckpt.list_checkpoints(run_dir / "checkpoints")]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 12-step run (checkpoints at steps 8 and 12)."""
    d = tmp_path_factory.mktemp("done") / "run"
    train(_spec(), d)
    return d


def test_nan_stops_before_the_mask_update_and_keeps_the_good_checkpoint(tmp_path):
    d, records = tmp_path / "nan", []
    with pytest.raises(NonFiniteLoss) as err:     # the loss of step 6 is NaN; step 6 updates masks
        train(_spec(poison_after=5, records=records), d)
    msg = str(err.value)
    assert "\n" not in msg and "at step 6" in msg and err.value.exit_code == 1
    assert "step_00000004" in msg and f"hydra.run.dir={d} trainer.resume=auto" in msg
    assert msg.split("continue with ")[1].startswith("sparsetrain train recipe=plain seed=0 ")
    assert records == [3]                          # no mask update ran on the NaN weights
    assert _steps(d) == ["step_00000004"]          # nothing non-finite was written or rotated in
    weights = torch.load(d / "checkpoints/step_00000004" / ckpt.MODEL_FILE, weights_only=True)
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert not (d / "summary.json").exists()


def _gate_on_the_device(monkeypatch) -> list[int]:
    """Make PruneRegrow accept the loop's gate on every update (as the captured graphed update does; on the CPU its
    layer-by-layer update reads the gate instead); returns the steps at which the guard's flag is read."""
    from sparsetrain.training.guard import Guard

    def gate_update(self, step, ok):
        self._gate = ok
        return ok is not None

    polled, poll = [], Guard.poll
    monkeypatch.setattr(PruneRegrow, "gate_update", gate_update)
    monkeypatch.setattr(Guard, "poll", lambda self: (polled.append(int(self._count)), poll(self))[1])
    return polled


def test_a_gated_update_step_does_not_sync_and_its_row_waits_for_the_next_read(tmp_path, monkeypatch):
    """Where the mask update reads the guard's flag on the device, its step is no sync point: the flag is read only
    at the checkpoint steps (4, 8) and the last (12); each update's row reaches metrics.jsonl at the next read, in
    step order, and the run ends with the weights of a run that read the flag before every update."""
    train(_spec(), tmp_path / "plain")
    polled = _gate_on_the_device(monkeypatch)
    train(_spec(), tmp_path / "gated")
    assert polled == [4, 8, 12]
    rows = [r for r in read_metrics(tmp_path / "gated") if r.get("event") == "mask_update"]
    assert [r["step"] for r in rows] == [3, 6, 9] and all(r["pruned"] > 0 for r in rows)
    assert rows == [r for r in read_metrics(tmp_path / "plain") if r.get("event") == "mask_update"]
    final = [torch.load(tmp_path / d / "checkpoints/step_00000012" / ckpt.MODEL_FILE, weights_only=True)
             for d in ("plain", "gated")]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_a_gated_update_after_a_nan_moves_nothing_and_leaves_no_row(tmp_path, monkeypatch):
    """The loss of step 6 is NaN and step 6 updates masks with the gate: the update moves nothing, no row is
    written for it, and the run stops at the next read (step 8) naming step 6, the step-4 checkpoint kept."""
    _gate_on_the_device(monkeypatch)
    d, records = tmp_path / "nan", []
    with pytest.raises(NonFiniteLoss, match="at step 6"):
        train(_spec(poison_after=5, records=records), d)
    assert records == [3]
    assert [r["step"] for r in read_metrics(d) if r.get("event") == "mask_update"] == [3]
    assert _steps(d) == ["step_00000004"]


def test_nan_weights_are_never_checkpointed(tmp_path):
    d = tmp_path / "nanw"   # poisoned inside step 4, whose loss was still finite: the save of step 4 refuses
    with pytest.raises(NonFiniteLoss, match="non-finite weights at step 4"):
        train(_spec(poison_after=4), d)
    assert _steps(d) == [] and not list((d / "checkpoints").glob("*"))


class _Payload:
    """Unpickling this creates the directory ``path``: proof that a load ran code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.makedirs, (self.path,))


@pytest.mark.parametrize("victim", [ckpt.STATE_FILE, ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE, "rng_state_0.pt"])
def test_a_checkpoint_file_that_would_run_code_is_refused(finished_run, tmp_path, victim):
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad" / "checkpoints" / "step_00000012"
    shutil.copytree(finished_run / "checkpoints" / "step_00000012", bad)
    torch.save({"x": _Payload(marker)}, bad / victim)
    _reseal(bad, victim)                                        # sizes and checksums agree: only the content is hostile
    with pytest.raises(CheckpointError, match="cannot be loaded safely") as err:
        train(_spec(resume=str(bad), max_steps=14), tmp_path / "new")
    assert "\n" not in str(err.value) and victim in str(err.value)
    assert not marker.exists()


def test_resume_refuses_model_or_mask_changes_before_touching_the_run(finished_run, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    (d / "summary.json").unlink()
    before = (d / "config.yaml").read_text()
    changed = {**CONFIG, "sparsity": {"density": 0.2, "block": 16}, "seed": 3}
    with pytest.raises(CheckpointError) as err:
        train(_spec(resume="auto", max_steps=16, config=changed), d)
    msg = str(err.value)
    assert "\n" not in msg and "sparsity.density (0.5 -> 0.2)" in msg and "seed (0 -> 3)" in msg
    assert (d / "config.yaml").read_text() == before
    assert shape_changes(CONFIG, {**CONFIG, "optim": {"optimizer": {"lr": 1.0}}}) == []   # lr may change


def test_a_run_saved_before_a_key_existed_resumes_with_the_behaviour_it_had():
    """model.fused_qkv came later: a stored config without it compares as false (what those runs did)."""
    old = {"model": {"arch": "bert", "size": "tiny"}, "seed": 0}
    assert shape_changes(old, {"model": {"arch": "bert", "size": "tiny", "fused_qkv": False}, "seed": 0}) == []
    assert shape_changes(old, {"model": {"arch": "bert", "size": "tiny", "fused_qkv": True}, "seed": 0}) == [
        "model.fused_qkv"]


def test_resume_skips_a_damaged_checkpoint_removes_partial_ones_and_warns_on_world_size(finished_run, tmp_path,
                                                                                        capsys):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    (d / "summary.json").unlink()
    root = d / "checkpoints"
    newest = root / "step_00000012" / ckpt.STATE_FILE
    newest.write_bytes(newest.read_bytes()[:200])             # truncated
    state = torch.load(root / "step_00000008" / ckpt.STATE_FILE, weights_only=True)
    state["args"]["batch_size"] = 2                           # as if 2 processes x 2: the same global batch
    torch.save({**state, "processes": 2}, root / "step_00000008" / ckpt.STATE_FILE)
    _reseal(root / "step_00000008", ckpt.STATE_FILE)
    (root / "step_00000099").mkdir()                            # a rotation or write killed half-way
    (root / "step_00000099" / ckpt.MODEL_FILE).write_bytes(b"partial")
    (root / ".tmp_step_00000100").mkdir()
    summary = train(_spec(resume="auto", max_steps=12), d)
    out = capsys.readouterr().out
    assert "skipping damaged checkpoint" in out and "step_00000012" in out
    assert "resumed from" in out and "at step 8" in out
    assert ("resuming a checkpoint of 2 process(es) x trainer.batch_size=2 x trainer.grad_accum=1 with 1 "
            "process(es) x trainer.batch_size=4 x trainer.grad_accum=1: the same global batch (4)") in out
    assert "removed the partial checkpoint" in out and "step_00000099" in out
    assert summary["steps"] == 12 and _steps(d) == ["step_00000008", "step_00000012"]
    assert (root / ".damaged_step_00000012").is_dir()
    assert sorted(p.name for p in root.iterdir()) == [".damaged_step_00000012", "step_00000008", "step_00000012"]
    assert f"run directory: {d}" in out


def test_a_run_killed_before_its_first_checkpoint_restarts(tmp_path, capsys):
    d = tmp_path / "partial"
    d.mkdir()
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')
    (d / "config.yaml").write_text("seed: 0\n")
    plan = plan_start("auto", d)
    assert plan.path is None and plan.replace_metrics
    summary = train(_spec(max_steps=4, log_every=1), d)          # the same command again, no trainer.resume
    assert "partial run with no checkpoint: starting again from step 0" in capsys.readouterr().out
    assert summary["steps"] == 4
    assert [r["loss"] != 9.0 for r in read_metrics(d) if r.get("step") == 1] == [True]
    assert [r["step"] for r in read_metrics(d) if "loss" in r] == [1, 2, 3, 4]
    with pytest.raises(RunDirError, match="trainer.resume=auto"):   # a finished run is never clobbered
        train(_spec(max_steps=4), d)
    train(_spec(max_steps=4, resume="auto"), tmp_path / "fresh")     # auto with no checkpoint: from step 0


def test_checkpoint_files_and_directories_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = os.fsync

    def record(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    train(_spec(max_steps=4, checkpoint_every=0), tmp_path / "run")
    root = tmp_path / "run" / "checkpoints"
    names = {Path(p).name for p in synced}
    assert {ckpt.STATE_FILE, ckpt.MODEL_FILE, ckpt.OPTIMIZER_FILE, "rng_state_0.pt", ckpt.META_FILE} <= names
    assert str(root) in synced and str(root / ".tmp_step_00000004") in synced


def test_resuming_a_finished_run_keeps_its_final_eval_loss(tmp_path):
    d = tmp_path / "run"
    first = train(_spec(eval_every=6), d)
    assert first["final_eval_loss"] is not None
    again = train(_spec(eval_every=6, resume="auto"), d)        # resumed at its last checkpoint (step 12): no steps
    assert again["steps"] == 12 and again["final_eval_loss"] == first["final_eval_loss"]
    assert json.loads((d / "summary.json").read_text())["final_eval_loss"] == first["final_eval_loss"]


@pytest.mark.parametrize("victim", [ckpt.MODEL_FILE, "rng_state_0.pt"])
def test_corruption_of_the_same_size_is_caught_and_resume_takes_the_checkpoint_before(finished_run, tmp_path,
                                                                                      capsys, victim):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    (d / "summary.json").unlink()
    f = d / "checkpoints" / "step_00000012" / victim
    f.write_bytes(os.urandom(f.stat().st_size))                 # same size: only the checksum can tell
    with pytest.raises(CheckpointError, match="does not match the SHA-256") as err:   # named: refused in one line
        train(_spec(resume=str(f.parent), max_steps=14), tmp_path / "other")
    assert "\n" not in str(err.value) and victim in str(err.value) and not (tmp_path / "other").exists()
    summary = train(_spec(resume="auto", max_steps=12), d)       # auto: skipped for the one before
    out = capsys.readouterr().out
    assert "skipping damaged checkpoint" in out and "does not match the SHA-256" in out and "at step 8" in out
    assert summary["steps"] == 12 and (d / "checkpoints" / ".damaged_step_00000012").is_dir()


def test_a_full_disk_stops_in_one_line_with_the_resume_command_and_keeps_the_good_checkpoints(tmp_path,
                                                                                             monkeypatch):
    real_save, d = torch.save, tmp_path / "run"

    def save(obj, path, *a, **k):   # what torch raises when the disk fills while it writes a zip
        if "step_00000008" in str(path) and Path(path).name == ckpt.MODEL_FILE:
            Path(path).write_bytes(b"half")
            raise RuntimeError("basic_ios::clear: iostream error")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", save)
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 2**20, 2**20))
    with pytest.raises(RunStopped) as err:
        train(_spec(), d)
    msg = str(err.value)
    assert "\n" not in msg and err.value.exit_code == 1
    assert "no space left on the device" in msg and "step_00000008" in msg and "1 MiB free" in msg
    assert "the last good checkpoint is" in msg and "step_00000004" in msg and "trainer.resume=auto" in msg
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_00000004"]   # nothing half-written
    monkeypatch.undo()                                           # room made: the printed command continues
    assert train(_spec(resume="auto"), d)["steps"] == 12


def test_a_checkpoint_of_a_step_already_there_is_replaced_not_skipped(finished_run, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    (d / "summary.json").unlink()
    old = torch.load(d / "checkpoints/step_00000012" / ckpt.MODEL_FILE, weights_only=True)
    changed = {**CONFIG, "optim": {"optimizer": {"lr": 5e-3}}}   # continue from step 8 on another path
    spec = _spec(resume=str(d / "checkpoints/step_00000008"), config=changed)
    spec.build_optimizer = optimizer_factory(torch.optim.AdamW, {"lr": 5e-3})
    train(spec, d)
    new = torch.load(d / "checkpoints/step_00000012" / ckpt.MODEL_FILE, weights_only=True)
    assert any(not torch.equal(old[k], new[k]) for k in old)     # the new run's step 12, not the old one's
    ckpt.check_intact(d / "checkpoints/step_00000012")
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_00000008", "step_00000012"]


def test_resume_applies_a_changed_learning_rate_and_says_so(finished_run, tmp_path, capsys):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    (d / "summary.json").unlink()
    changed = {**CONFIG, "optim": {"optimizer": {"lr": 2e-3}}}
    spec = _spec(resume=str(d / "checkpoints/step_00000008"), config=changed, log_every=1, lr_schedule="constant")
    spec.build_optimizer = optimizer_factory(torch.optim.AdamW, {"lr": 2e-3})
    train(spec, d)
    assert "this run's optim.optimizer.lr (0.001 -> 0.002) replace the checkpoint's" in capsys.readouterr().out
    assert {r["lr"] for r in read_metrics(d) if "loss" in r and r["step"] > 8} == {2e-3}
    opt = torch.load(d / "checkpoints/step_00000012" / ckpt.OPTIMIZER_FILE, weights_only=True)
    assert {g["initial_lr"] for g in opt["param_groups"]} == {2e-3}


def test_resume_refuses_another_optimizer_naming_the_key_before_touching_the_run(finished_run, tmp_path):
    d = tmp_path / "run"
    shutil.copytree(finished_run, d)
    (d / "summary.json").unlink()
    before = (d / "config.yaml").read_text()
    changed = {**CONFIG, "optim": {"optimizer": {"_target_": "torch.optim.SGD", "lr": 1e-3, "momentum": 0.9}}}
    old = {**CONFIG, "optim": {"optimizer": {"_target_": "torch.optim.AdamW", "lr": 1e-3}}}
    state = torch.load(d / "checkpoints/step_00000012" / ckpt.STATE_FILE, weights_only=True)
    torch.save({**state, "config": old}, d / "checkpoints/step_00000012" / ckpt.STATE_FILE)
    _reseal(d / "checkpoints/step_00000012", ckpt.STATE_FILE)
    spec = _spec(resume="auto", max_steps=16, config=changed)
    spec.build_optimizer = optimizer_factory(torch.optim.SGD, {"lr": 1e-3, "momentum": 0.9})
    with pytest.raises(CheckpointError) as err:
        train(spec, d)
    msg = str(err.value)
    assert "\n" not in msg and "optim.optimizer._target_ ('torch.optim.AdamW' -> 'torch.optim.SGD')" in msg
    assert "trainer.init_from=" in msg and (d / "config.yaml").read_text() == before
