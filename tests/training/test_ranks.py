"""Masks identical on every rank: the exact signature, the cross-rank comparison in a two-process gloo group,
and two-process training runs (torch.multiprocessing.spawn) that log the check at every mask update and stop
at the first update that splits the ranks."""
import json
import os
import socket
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparsetrain.nn import sparsify
from sparsetrain.sparsity import criteria
from sparsetrain.sparsity.policies import SET
from sparsetrain.sparsity.protocol import sparse_layers
from sparsetrain.sparsity.schedulers import PruneRegrow
from sparsetrain.training.guard import RunStopped
from sparsetrain.training.metrics import read_metrics
from sparsetrain.training.ranks import RanksDiverged, compare_masks, layer_signatures, mask_signature
from sparsetrain.training.setup import TrainArgs
from tests.training.test_loop import _spec


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    sparsify(model, targets=["*"], exclude=[], density=0.5, block=8, seed=0)
    return model


def test_signature_is_exact_and_sees_every_position():
    model = _mlp()
    names, hashes = layer_signatures(model)
    assert names == ["0", "2"] and hashes.dtype == torch.int64 and hashes.shape == (2,)
    sig = mask_signature(model)
    assert sig.dtype == torch.int64 and sig.equal(mask_signature(_mlp()))   # same masks, same signature
    seen = {int(sig)}
    for name, layer in sparse_layers(model).items():   # flipping any single block changes it
        for i in range(layer.mask.numel()):
            layer.mask.view(-1)[i] ^= True
            seen.add(int(mask_signature(model)))
            assert not layer_signatures(model)[1][names.index(name)].equal(hashes[names.index(name)])
            layer.mask.view(-1)[i] ^= True
    assert len(seen) == 1 + sum(layer.mask.numel() for layer in sparse_layers(model).values())
    assert mask_signature(model).equal(sig)


def test_one_process_compares_nothing_and_logs_no_key():
    agreement = compare_masks(_mlp(), processes=1)
    assert agreement.identical is None and agreement.row == {}
    agreement.raise_if_diverged(3)   # nothing to stop


def _free_port() -> int:
    with socket.socket() as sock:  # a fixed port would collide with another run on the machine
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(fn, *args) -> None:
    """Run ``fn(rank, port, *args)`` in two processes; an assertion failing in either fails the test."""
    spawn_pair(fn, _free_port(), *args)


def spawn_pair(fn, *args) -> None:
    """``fn(rank, *args)`` in two processes (torch.multiprocessing.spawn); an exception in either fails the caller."""
    mp.spawn(_then_exit, args=(fn, *args), nprocs=2, join=True)


def _then_exit(rank: int, fn, *args) -> None:
    """Run ``fn(rank, *args)``; once it returned, leave the process at once. Its gloo groups are destroyed by then,
    but interpreter shutdown still destroyed gloo state now and then with a thread left joinable
    ("terminate called without an active exception", SIGABRT: seen in CI and locally under load); an exception
    from ``fn`` still reaches the parent as usual."""
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _compare_worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _mlp()
        agreement = compare_masks(model, processes=2)
        assert agreement.identical is True and agreement.row == {"ranks_masks_identical": True}
        agreement.raise_if_diverged(4)
        if rank == 1:                                  # rank 1 moves one active block of the second layer
            layer = sparse_layers(model)["2"]
            on, off = layer.mask.view(-1).nonzero()[0], (~layer.mask).view(-1).nonzero()[0]
            layer.mask.view(-1)[on], layer.mask.view(-1)[off] = False, True
        agreement = compare_masks(model, processes=2)
        assert agreement.row == {"ranks_masks_identical": False}
        assert agreement.differing_ranks == (1,) and agreement.first_layer == "2"
        with pytest.raises(RanksDiverged, match="after the mask update at step 4: rank 1 differs from rank 0, "
                                                "first in layer 2; the run stopped before the next optimizer"):
            agreement.raise_if_diverged(4)
        with pytest.raises(RanksDiverged, match="at the end of the run"):
            agreement.raise_if_diverged()
    finally:
        dist.barrier()   # both ranks reach teardown together (a gloo peer that exits first can abort the other)
        dist.destroy_process_group()


def test_two_ranks_compare_their_masks():
    _spawn(_compare_worker)


class RankDependentDrop(SET):
    """Test only, and wrong on purpose: rank 1 drops the largest blocks, rank 0 the smallest."""

    def drop_scores(self, weight, grad, mask):
        score = criteria.magnitude(weight)
        return -score if dist.get_rank() == 1 else score


def _train_worker(rank: int, port: int, run_dir: str, policy: str) -> None:
    from sparsetrain.training.loop import train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    scheduler = PruneRegrow(policy=RankDependentDrop() if policy == "rank_dependent" else SET(),
                            drop_fraction=0.3, num_updates=3)
    args = TrainArgs(max_steps=8, batch_size=4, eval_every=0, log_every=4, checkpoint_every=1, keep_checkpoints=8,
                     device="cpu", progress=False, plot=False, recipe="plain")
    try:
        train(_spec(scheduler, args), run_dir)
    except RunStopped as e:
        with open(os.path.join(run_dir, f"error_rank{rank}.txt"), "w") as f:
            f.write(str(e))


def _updates(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("event") == "mask_update"]


def test_two_process_run_logs_identical_masks_at_every_update(tmp_path):
    _spawn(_train_worker, str(tmp_path), "set")
    updates = _updates(tmp_path)
    assert len(updates) == 3 and all(u["pruned"] > 0 for u in updates)
    assert [u["ranks_masks_identical"] for u in updates] == [True] * 3
    assert json.loads((tmp_path / "summary.json").read_text())["ranks_masks_identical"] is True


def test_rank_dependent_policy_stops_the_run_at_the_first_update(tmp_path):
    _spawn(_train_worker, str(tmp_path), "rank_dependent")
    updates = _updates(tmp_path)
    assert len(updates) == 1 and updates[0]["ranks_masks_identical"] is False
    step = updates[0]["step"]
    errors = {(tmp_path / f"error_rank{r}.txt").read_text() for r in (0, 1)}
    assert len(errors) == 1                                          # both ranks stop with the same line
    error = errors.pop()
    assert f"after the mask update at step {step}: rank 1 differs from rank 0, first in layer bert." in error
    assert "\n" not in error
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith("."))
    assert saved == [f"step_{s:08d}" for s in range(1, step)]     # every step before the update, not that one
    assert not (tmp_path / "summary.json").exists()


def test_one_process_run_logs_no_rank_key(tmp_path):
    from sparsetrain.training.loop import train

    args = TrainArgs(max_steps=8, batch_size=4, eval_every=0, log_every=4, device="cpu", progress=False,
                     plot=False, recipe="plain")
    summary = train(_spec(PruneRegrow(policy=SET(), drop_fraction=0.3, num_updates=3), args), tmp_path)
    updates = _updates(tmp_path)
    assert len(updates) == 3 and not any("ranks_masks_identical" in u for u in updates)
    assert summary["ranks_masks_identical"] is None
