"""Resuming on another number of processes (gloo, CPU): a checkpoint of two processes loads in one with the
very same masks and optimizer state and goes on like the two-process run (same global batch, from the same
sample), and the other way round; another global batch, or micro-batches that cannot start at the
checkpoint's sample, are refused in one line before anything is written."""
import os

import pytest
import torch

from sparsetrain.models.builders import build_model
from sparsetrain.nn import DEFAULT_EXCLUDE
from sparsetrain.sparsity.layout import Block
from sparsetrain.sparsity.schedulers import PruneRegrow
from sparsetrain.training import checkpoint as ckpt
from sparsetrain.training.batches import Batches, same_sample_position
from sparsetrain.training.checkpoint import CheckpointError
from sparsetrain.training.loop import train
from sparsetrain.training.metrics import read_metrics
from sparsetrain.training.resume import data_position
from sparsetrain.training.setup import RunSpec, TrainArgs, optimizer_factory
from tests.training.test_loop import _tiny_mlm_data
from tests.training.test_ranks import _spawn

CONFIG = {"model": {"arch": "bert", "size": "tiny"}, "sparsity": {"density": 0.5, "block": 8}, "seed": 0}


def _spec(**kw) -> RunSpec:
    """A tiny BERT without dropout (so one process and two can agree), its linears half active in 8x8 blocks of
    the block format (compressed values and Adam moments; on the CPU its plain-torch path, as 16x16 blocks would
    run the Triton interpreter), SET updates at steps 3 and 6 of 8."""
    args = dict(max_steps=8, batch_size=4, eval_every=0, log_every=1, checkpoint_every=4, keep_checkpoints=4,
                device="cpu", progress=False, plot=False, recipe="plain")
    args.update(kw)
    return RunSpec(
        build_model=lambda: build_model("bert", "tiny", vocab_size=64, seq_len=16, num_hidden_layers=1,
                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
        build_data=_tiny_mlm_data,
        build_optimizer=optimizer_factory(torch.optim.AdamW, {"lr": 1e-3}),
        scheduler=PruneRegrow(policy="set", drop_fraction=0.3, interval=3),
        sparsify_kwargs=dict(targets=["*"], exclude=list(DEFAULT_EXCLUDE), density=0.5, distribution="uniform",
                             density_overrides=None, block=Block(8, 8), format="block", init="random", seed=0),
        train_args=TrainArgs(**args), method="prune_regrow/set", config=dict(CONFIG), block_label="8")


def _worker(rank: int, port: int, run_dir: str, kw: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    train(_spec(**kw), run_dir)


def _rows(run_dir, key: str) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if key in r}


def _load(run_dir, step: int, name: str) -> dict:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}" / name, weights_only=True)


def _assert_same_run(a, b) -> None:
    """``b`` (whole, or resumed at step 4) trains like ``a``: the same losses up to summation order, the same
    mask updates, the same final masks, close final weights."""
    la, lb = _rows(a, "loss"), _rows(b, "loss")
    assert list(la) == list(range(1, 9)) and list(lb) in (list(range(1, 9)), list(range(5, 9)))
    assert [lb[s]["loss"] for s in lb] == pytest.approx([la[s]["loss"] for s in lb], rel=1e-5, abs=1e-6)
    ua, ub = _rows(a, "event"), _rows(b, "event")
    assert list(ua) == [3, 6] and all(u["pruned"] > 0 for u in ua.values())
    assert {s: ub[s]["pruned"] for s in ub} == {s: ua[s]["pruned"] for s in ua if s >= min(lb)}
    ma, mb = _load(a, 8, ckpt.MODEL_FILE), _load(b, 8, ckpt.MODEL_FILE)
    assert [k for k in ma if k.endswith(".mask")] and all(ma[k].equal(mb[k]) for k in ma if k.endswith(".mask"))
    assert all(torch.allclose(ma[k].float(), mb[k].float(), atol=1e-5) for k in ma)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Eight steps on two processes x 4 samples, and on one process x 8 samples (the same global batch)."""
    root = tmp_path_factory.mktemp("world")
    _spawn(_worker, str(root / "two"), {})
    train(_spec(batch_size=8), root / "one")
    return root / "two", root / "one"


def test_two_processes_train_like_one_with_the_same_global_batch(runs):
    _assert_same_run(*runs)


def test_a_two_process_checkpoint_loads_in_one_process_with_the_same_masks_and_optimizer_state(runs, tmp_path):
    two, _ = runs
    # resumed at its last step, the run saves what it loaded: exactly the two-process checkpoint
    train(_spec(max_steps=4, grad_accum=2, resume=str(two / "checkpoints/step_00000004")), tmp_path / "loaded")
    model, saved = _load(tmp_path / "loaded", 4, ckpt.MODEL_FILE), _load(two, 4, ckpt.MODEL_FILE)
    assert model.keys() == saved.keys() and all(model[k].equal(saved[k]) for k in model)
    opt, saved_opt = _load(tmp_path / "loaded", 4, ckpt.OPTIMIZER_FILE), _load(two, 4, ckpt.OPTIMIZER_FILE)
    assert opt["state"].keys() == saved_opt["state"].keys()
    values = [s for s in opt["state"].values() if s["exp_avg"].dim() == 3]   # the block format's [n, 8, 8]
    assert values and all(s["exp_avg_sq"].dim() == 3 for s in values)
    assert all(opt["state"][i][k].equal(saved_opt["state"][i][k]) for i in opt["state"] for k in opt["state"][i])


def test_a_two_process_checkpoint_continues_in_one_process_like_the_two_process_run(runs, tmp_path, capsys):
    two, _ = runs
    resumed = tmp_path / "resumed"
    train(_spec(grad_accum=2, resume=str(two / "checkpoints/step_00000004")), resumed)  # 1 x 4 x 2 = 2 x 4 x 1
    assert "the same global batch (8), continuing at the same sample" in capsys.readouterr().out
    _assert_same_run(two, resumed)


def test_a_one_process_checkpoint_continues_on_two_processes_like_the_one_process_run(runs, tmp_path):
    _, one = runs
    resumed = tmp_path / "resumed"
    _spawn(_worker, str(resumed), {"resume": str(one / "checkpoints/step_00000004")})
    _assert_same_run(one, resumed)


def test_another_global_batch_is_refused_before_anything_is_written(runs, tmp_path):
    two, _ = runs
    with pytest.raises(CheckpointError) as err:
        train(_spec(resume=str(two / "checkpoints/step_00000004")), tmp_path / "refused")
    assert str(err.value).endswith(
        "was trained with a global batch of 8 (2 process(es) x trainer.batch_size=4 x trainer.grad_accum=1), this "
        "run has 4 (1 process(es) x trainer.batch_size=4 x trainer.grad_accum=1): the learning-rate and mask "
        "schedules count steps of one global batch; keep it with trainer.grad_accum=2")
    assert not (tmp_path / "refused").exists()


def test_the_same_sample_position_reads_the_same_samples():
    """Batches of 8 samples on two processes and of 4 on one: from the converted position the one-process run
    reads, two micro-batches per step, what the two processes read, across epoch ends (42 samples: the 8-sample
    split drops 2 per epoch, the 4-sample split none)."""
    data = list(range(42))
    two = [Batches(data, list, 4, 2, rank, seed=0) for rank in (0, 1)]
    one = Batches(data, list, 4, 1, 0, seed=0)
    for micro in range(12):
        pos = same_sample_position(micro, 42, old_group=8, new_group=4)
        assert one.get(pos) + one.get(pos + 1) == two[0].get(micro) + two[1].get(micro)
    assert same_sample_position(4, 42, old_group=8, new_group=4) == 8
    assert same_sample_position(5, 42, old_group=8, new_group=4) == 10        # epoch 1 starts at 10 batches of 4
    assert same_sample_position(5, 42, old_group=4, new_group=8) is None       # sample 20: no batch of 8 there
    assert same_sample_position(10, 42, old_group=4, new_group=8) == 5         # sample 40 of epoch 0: epoch 1


def test_micro_batches_that_cannot_start_at_the_checkpoint_sample_are_refused():
    state = {"micro_batches": 5, "processes": 1, "args": {"batch_size": 4, "grad_accum": 2}}
    with pytest.raises(CheckpointError, match=r"stopped at sample 20 of epoch 0, where no micro-batch of this run "
                                              r"starts \(8 samples: 2 process\(es\) x trainer.batch_size=4\); "
                                              r"resume with processes x trainer.batch_size = 4"):
        data_position("ckpt", state, processes=2, batch_size=4, grad_accum=1, samples=42)
    position, note = data_position("ckpt", {**state, "micro_batches": 4}, 2, 4, 1, samples=42)   # sample 16
    assert position == 2 and note.startswith("resuming a checkpoint of 1 process(es) x trainer.batch_size=4 x "
                                              "trainer.grad_accum=2 with 2 process(es) x trainer.batch_size=4 x "
                                              "trainer.grad_accum=1: the same global batch (8)")
    assert data_position("ckpt", {**state, "processes": 1}, 1, 4, 2, samples=42) == (5, None)  # nothing changed


def test_random_state_of_a_gpu_process_resumes_on_a_machine_with_fewer_gpus(monkeypatch):
    """Each process keeps its own GPU's random state: a checkpoint of a two-GPU machine (rank 1 on cuda:1) or an
    older one holding every GPU's state resumes on one GPU (torch.cuda.set_rng_state_all would index cuda:1)."""
    states = {0: torch.tensor([0], dtype=torch.uint8), 1: torch.tensor([1], dtype=torch.uint8)}
    device, restored = [1], {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: device[0])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda i: states[i])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.__setitem__(i, s))
    saved = ckpt.rng_state()
    assert saved["cuda"].equal(states[1])                       # rank 1 saves cuda:1's state only
    device[0] = 0                                               # resumed as the one process of a one-GPU machine
    ckpt.set_rng_state(saved)
    assert list(restored) == [0] and restored[0].equal(states[1])
    restored.clear()
    ckpt.set_rng_state({**saved, "cuda": [states[0], states[1]]})   # an older checkpoint: one state per GPU
    assert list(restored) == [0] and restored[0].equal(states[0])
    device[0], restored = 2, {}
    ckpt.set_rng_state({**saved, "cuda": [states[0], states[1]]})   # no state for this GPU: left as seeded
    assert restored == {}
