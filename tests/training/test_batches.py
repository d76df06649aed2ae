"""Prefetched batches are the batches: whatever the number of threads, batch ``b`` is ``Batches.get(b)``, across
epoch boundaries (the MLM collator draws its masks per epoch), and a run's losses do not change with it."""
import torch

from sparsetrain.data.mlm import MLMCollator, PackedSequences
from sparsetrain.training.batches import Batches, Prefetcher
from sparsetrain.training.loop import train
from sparsetrain.training.metrics import read_metrics
from sparsetrain.training.setup import TrainArgs
from tests.training.test_loop import _spec


def _mlm_batches(seed: int = 0) -> Batches:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 64, (37, 16), generator=g)
    ids[:, 0], ids[:, -1] = 2, 3
    collator = MLMCollator(mask_token_id=4, vocab_size=64, special_ids=[0, 1, 2, 3, 4], seed=seed)
    return Batches(PackedSequences(ids), collator, batch_size=4, world=1, rank=0, seed=seed)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_prefetched_batches_equal_the_plain_ones_across_epochs():
    plain = _mlm_batches()
    want = [plain.get(b) for b in range(3, 30)]          # 9 batches per epoch: three epoch boundaries
    for workers in (0, 1, 3):
        with Prefetcher(_mlm_batches(), start=3, workers=workers) as feed:
            got = [feed.get(b) for b in range(3, 30)]
        assert all(_same(g, w) for g, w in zip(got, want, strict=True)), workers


def test_asking_out_of_order_starts_over_and_pinning_keeps_the_values():
    plain = _mlm_batches(1)
    with Prefetcher(_mlm_batches(1), start=0, workers=2) as feed:
        assert _same(feed.get(0), plain.get(0))
        assert _same(feed.get(7), plain.get(7))          # a jump: the pending batches are dropped
        assert _same(feed.get(8), plain.get(8))
    if torch.cuda.is_available():
        with Prefetcher(_mlm_batches(1), start=2, workers=1, pin=True) as feed:
            batch = feed.get(2)
        assert all(v.is_pinned() for v in batch.values()) and _same(batch, plain.get(2))


def test_a_run_trains_the_same_with_input_threads(tmp_path):
    from sparsetrain.sparsity.schedulers import Static

    losses = {}
    for workers in (0, 2):
        args = TrainArgs(max_steps=6, batch_size=4, eval_every=0, log_every=1, device="cpu", progress=False,
                         plot=False, recipe="threads", num_workers=workers)
        train(_spec(Static(), args), tmp_path / str(workers))
        losses[workers] = [r["loss"] for r in read_metrics(tmp_path / str(workers)) if "loss" in r]
    assert len(losses[0]) == 6 and losses[0] == losses[2]
