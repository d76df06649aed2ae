"""Packing and the MLM masking collator (no corpus needed)."""
import time

import pytest
import torch

from sparsetrain.data.mlm import MLMCollator, _mix, pack_documents


def test_pack_documents_separates_documents_with_sep():
    packed = pack_documents([[10, 11, 12, 13], [20, 21]], seq_len=5, cls_id=2, sep_id=3)
    assert packed.tolist() == [[2, 10, 11, 12, 3], [2, 13, 3, 20, 3]]  # the tail [21, SEP] is dropped
    with pytest.raises(ValueError, match="seq_len"):
        pack_documents([[1]], seq_len=2, cls_id=2, sep_id=3)


SPECIALS = [0, 1, 2, 3, 4]  # [PAD] [UNK] [CLS] [SEP] [MASK]


def _examples(n, length=64, vocab=500, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(5, vocab, (length,), generator=g)
        ids[0], ids[-1], ids[length // 2] = 2, 3, 3
        out.append({"input_ids": ids, "index": i})
    return out


def test_mask_is_a_function_of_seed_and_index_only():
    examples = _examples(8)
    collator = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, seed=5)
    batch = collator(examples)
    # Same (seed, index) in another batch, another order, another collator object: same mask.
    alone = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, seed=5)([examples[3]])
    reordered = collator([examples[6], examples[3]])
    for key in ("input_ids", "labels", "masked_positions"):
        assert torch.equal(alone[key][0], batch[key][3])
        assert torch.equal(reordered[key][1], batch[key][3])
        assert torch.equal(collator(examples)[key], batch[key])
    # Same tokens under another index, or another seed: a different mask.
    moved = collator([{"input_ids": examples[3]["input_ids"], "index": 4}])
    assert not torch.equal(moved["labels"][0], batch["labels"][3])
    other_seed = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, seed=6)(examples)
    assert not torch.equal(other_seed["labels"], batch["labels"])
    collator.set_epoch(1)
    assert not torch.equal(collator(examples)["labels"], batch["labels"])


def test_hash_is_splitmix64_in_wrapping_int64():
    """The int64 torch ops give splitmix64's uint64 results (multiplication wraps, shifts are logical)."""
    def reference(x):
        m = 2**64 - 1
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    values = torch.randint(-2**63, 2**63 - 1, (1000,), generator=torch.Generator().manual_seed(0))
    values[:4] = torch.tensor([0, -1, 2**63 - 1, -2**63])
    got = _mix(values)
    assert [v % 2**64 for v in got.tolist()] == [reference(v % 2**64) for v in values.tolist()]


def test_exactly_k_positions_per_sequence_with_the_80_10_10_rule():
    examples = _examples(400, length=128)
    original = torch.stack([ex["input_ids"] for ex in examples])
    collator = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, mlm_probability=0.15)
    batch = collator(examples)
    assert sorted(batch) == ["input_ids", "labels", "masked_positions"]  # no padding: no attention_mask
    positions = batch["masked_positions"]
    assert positions.shape == (400, 20) and positions.dtype == torch.long  # P = ceil(0.15 * 128)
    selected = batch["labels"] != -100
    special = torch.isin(original, torch.tensor(SPECIALS))
    k = round(0.15 * 125)  # 128 positions, 3 special
    assert (selected.sum(1) == k).all()
    assert torch.equal(positions[:, :k], selected.nonzero()[:, 1].view(400, k))  # sorted, real ones first
    assert (positions[:, k:] == 0).all() and (batch["labels"][:, 0] == -100).all()
    assert not (selected & special).any()
    assert torch.equal(batch["input_ids"][special], original[special])
    assert torch.equal(batch["labels"][selected], original[selected])
    assert torch.equal(batch["input_ids"][~selected], original[~selected])
    became_mask = (batch["input_ids"] == 4)[selected].float().mean().item()
    kept = (batch["input_ids"] == original)[selected].float().mean().item()
    replaced = batch["input_ids"][selected & (batch["input_ids"] != 4) & (batch["input_ids"] != original)]
    assert abs(became_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.015
    assert not torch.isin(replaced, torch.tensor(SPECIALS)).any()
    # uniform over the maskable positions: each is chosen k / 125 of the time (3-sigma band)
    rate = selected[:, ~special[0]].float().mean(0)
    assert (rate - k / 125).abs().max() < 3 * (k / 125 * (1 - k / 125) / 400) ** 0.5 + 0.01


def test_max_predictions_caps_k_and_fixes_the_shape():
    examples = _examples(16, length=64)
    collator = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, mlm_probability=0.5,
                           max_predictions=8)
    batch = collator(examples)
    assert batch["masked_positions"].shape == (16, 8)
    assert ((batch["labels"] != -100).sum(1) == 8).all()  # round(0.5 * 61) = 30, capped at P = 8
    short = [{"input_ids": torch.tensor([2, 9, 3, 3]), "index": 0}]  # one maskable position
    one = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS)(short)
    assert one["masked_positions"].tolist() == [[1]] and one["labels"].tolist() == [[-100, 9, -100, -100]]
    none = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS)(
        [{"input_ids": torch.tensor([2, 3, 3, 3]), "index": 0}])
    assert none["masked_positions"].tolist() == [[0]] and (none["labels"] == -100).all()
    quiet = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, mlm_probability=0.5,
                        max_predictions=8, emit_positions=False)(examples)  # for a model with the full head
    assert sorted(quiet) == ["input_ids", "labels"] and torch.equal(quiet["labels"], batch["labels"])
    with pytest.raises(ValueError, match="^max_predictions must be <= seq_len=64, got 65"):
        MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, max_predictions=65)(examples)
    with pytest.raises(ValueError, match="^max_predictions must be"):
        MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, max_predictions=0)


def test_padding_keeps_the_attention_mask_and_is_never_masked():
    examples = _examples(32, length=32)
    for ex in examples:
        ex["input_ids"][20:] = 0  # [PAD]
    batch = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, pad_token_id=0)(examples)
    original = torch.stack([ex["input_ids"] for ex in examples])
    assert torch.equal(batch["attention_mask"], (original != 0).long())
    assert (batch["labels"][:, 20:] == -100).all() and torch.equal(batch["input_ids"][:, 20:], original[:, 20:])
    assert ((batch["labels"] != -100).sum(1) == round(0.15 * 17)).all()  # 20 positions, 3 special


def test_collate_is_fast():
    """256 x 128 tokens in well under 5 ms on one core (the host does it every step)."""
    examples = _examples(256, length=128, vocab=30522)
    collator = MLMCollator(mask_token_id=4, vocab_size=30522, special_ids=SPECIALS)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        collator(examples)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            collator(examples)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    assert min(times) < 5e-3, f"{min(times) * 1e3:.2f} ms"


def test_collator_rejects_bad_input():
    with pytest.raises(ValueError, match="mlm_probability"):
        MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, mlm_probability=0.0)
    with pytest.raises(ValueError, match="index"):
        MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS)(
            [{"input_ids": torch.arange(5, 9)}]
        )
