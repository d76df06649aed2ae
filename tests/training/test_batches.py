"""Prefetched batches are the batches: whatever the number of threads, batch ``b`` is ``Batches.get(b)``, across
epoch boundaries (the MLM collator draws its masks per epoch), and a run's losses do not change with it."""
import pytest
import torch

from sparsetrain.data.mlm import MLMCollator, PackedSequences
from sparsetrain.training.batches import Batches, DeviceFeed, Prefetcher
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


def test_the_device_feed_hands_out_the_prefetchers_batches_in_and_out_of_order():
    plain = _mlm_batches(2)
    with Prefetcher(_mlm_batches(2), start=0, workers=1) as host:
        feed = DeviceFeed(host, "cpu", ahead=True)     # ahead needs CUDA: off the GPU each batch is copied when asked
        assert feed.stream is None
        assert all(_same(feed.get(b), plain.get(b)) for b in (0, 1, 5, 6))


def test_ready_says_whether_a_thread_has_finished_the_batch():
    import time

    with Prefetcher(_mlm_batches(4), start=0, workers=2) as feed:
        feed.get(0)                                   # batches 1 and 2 go to the threads
        assert not feed.ready(5)                      # not asked for yet
        deadline = time.monotonic() + 30
        while not feed.ready(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert feed.ready(1)
        feed.get(1)
        assert not feed.ready(1)                      # handed out
    with Prefetcher(_mlm_batches(4), start=0, workers=0) as feed:
        feed.get(0)
        assert not feed.ready(1)                      # no threads: prepared when asked for


def test_a_run_with_copy_ahead_set_trains_the_same_off_the_gpu(tmp_path):
    from sparsetrain.sparsity.schedulers import Static

    losses = {}
    for ahead in (False, True):
        args = TrainArgs(max_steps=4, batch_size=4, eval_every=0, log_every=1, device="cpu", progress=False,
                         plot=False, recipe="ahead", num_workers=1, copy_ahead=ahead)
        train(_spec(Static(), args), tmp_path / str(ahead))
        losses[ahead] = [r["loss"] for r in read_metrics(tmp_path / str(ahead)) if "loss" in r]
    assert len(losses[False]) == 4 and losses[False] == losses[True]


def test_copy_ahead_must_be_a_bool():
    from sparsetrain.config import ConfigError, compose, validate

    with pytest.raises(ConfigError, match="trainer.copy_ahead"):
        validate(compose(["recipe=quickstart", "trainer=cpu_small", "trainer.copy_ahead=2"]))


@pytest.mark.gpu
def test_gpu_batches_copied_ahead_on_their_own_stream_equal_the_plain_ones_while_the_device_is_busy():
    # every batch taken while the step's stream is busy with work that reads the previous one: a copy that raced
    # the step, or memory reused before the step was done with it, would show as a different batch or sum
    plain = _mlm_batches(3)
    a = torch.randn(4096, 4096, device="cuda")
    with Prefetcher(_mlm_batches(3), start=0, workers=2, pin=True) as host:
        feed = DeviceFeed(host, "cuda", ahead=True)
        assert feed.stream is not None
        sums = []
        for b in range(12):
            batch = feed.get(b)
            for _ in range(3):
                a = (a @ a).tanh()                       # keeps the step's stream busy
            sums.append(sum(int(v.sum()) for v in batch.values()))
            assert _same({k: v.cpu() for k, v in batch.items()}, plain.get(b)), b
    assert sums == [sum(int(v.sum()) for v in plain.get(b).values()) for b in range(12)]
    assert feed.copied_ahead >= 6          # the threads keep up with this busy stream: most copies started early


@pytest.mark.gpu
def test_gpu_a_graphed_run_with_copy_ahead_trains_the_same(tmp_path):
    from sparsetrain.sparsity.schedulers import Static

    losses = {}
    for ahead in (False, True):
        args = TrainArgs(max_steps=8, batch_size=4, eval_every=0, log_every=1, device="cuda", progress=False,
                         plot=False, recipe="ahead", num_workers=2, cuda_graph=True, copy_ahead=ahead)
        train(_spec(Static(), args), tmp_path / str(ahead))
        losses[ahead] = [r["loss"] for r in read_metrics(tmp_path / str(ahead)) if "loss" in r]
    assert len(losses[False]) == 8 and losses[False] == losses[True]


def test_a_collator_that_can_pin_is_asked_to_and_others_are_not():
    from sparsetrain.data.vision import collate_images

    seen = []

    def plain(items):
        seen.append("plain")
        return {"x": torch.stack(items)}

    def pinning(items, pin=False):
        seen.append(("pinning", pin))
        return {"x": torch.stack(items)}

    pinning.pins = True
    data = [torch.full((2,), float(i)) for i in range(8)]
    for collator in (plain, pinning):
        batches = Batches(data, collator, batch_size=4, world=1, rank=0, seed=0)
        assert torch.equal(batches.get(1, pin=True)["x"], batches.get(1)["x"])
    assert seen == ["plain", "plain", ("pinning", True), ("pinning", False)]
    assert collate_images.pins is True
    items = [{"pixel_values": torch.randn(3, 4, 4), "labels": i, "index": i} for i in range(3)]
    out = collate_images(items)
    assert torch.equal(out["pixel_values"], torch.stack([it["pixel_values"] for it in items]))
    assert out["labels"].tolist() == [0, 1, 2]


@pytest.mark.gpu
def test_gpu_image_batches_are_stacked_straight_into_pinned_memory():
    from sparsetrain.data.vision import build_image_data

    data = build_image_data(source="synthetic", image_size=32, num_classes=10, synthetic_size=64, seed=0)
    plain = Batches(data.train, data.collator, batch_size=8, world=1, rank=0, seed=0)
    with Prefetcher(Batches(data.train, data.collator, batch_size=8, world=1, rank=0, seed=0), start=0, workers=2,
                    pin=True) as feed:
        for b in range(4):
            got = feed.get(b)
            assert all(v.is_pinned() for v in got.values()) and _same(got, plain.get(b))
