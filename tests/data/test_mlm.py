"""Packing and the MLM masking collator (no corpus needed)."""
import pytest
import torch

from sparsetrain.data.mlm import MLMCollator, pack_documents


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
    assert torch.equal(alone["input_ids"][0], batch["input_ids"][3])
    assert torch.equal(reordered["labels"][1], batch["labels"][3])
    assert torch.equal(collator(examples)["input_ids"], batch["input_ids"])
    # Same tokens under another index, or another seed: a different mask.
    moved = collator([{"input_ids": examples[3]["input_ids"], "index": 4}])
    assert not torch.equal(moved["labels"][0], batch["labels"][3])
    other_seed = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, seed=6)(examples)
    assert not torch.equal(other_seed["labels"], batch["labels"])
    collator.set_epoch(1)
    assert not torch.equal(collator(examples)["labels"], batch["labels"])


def test_masking_rates_specials_and_labels():
    examples = _examples(400, length=128)
    original = torch.stack([ex["input_ids"] for ex in examples])
    collator = MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, mlm_probability=0.15)
    batch = collator(examples)
    selected = batch["labels"] != -100
    special = torch.isin(original, torch.tensor(SPECIALS))
    assert not (selected & special).any()
    assert torch.equal(batch["input_ids"][special], original[special])
    assert abs(selected[~special].float().mean().item() - 0.15) < 0.01
    assert torch.equal(batch["labels"][selected], original[selected])
    assert torch.equal(batch["input_ids"][~selected], original[~selected])
    became_mask = (batch["input_ids"] == 4)[selected].float().mean().item()
    kept = (batch["input_ids"] == original)[selected].float().mean().item()
    replaced = batch["input_ids"][selected & (batch["input_ids"] != 4) & (batch["input_ids"] != original)]
    assert abs(became_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.015
    assert not torch.isin(replaced, torch.tensor(SPECIALS)).any()
    assert torch.equal(batch["attention_mask"], torch.ones_like(original))


def test_collator_rejects_bad_input():
    with pytest.raises(ValueError, match="mlm_probability"):
        MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS, mlm_probability=0.0)
    with pytest.raises(ValueError, match="index"):
        MLMCollator(mask_token_id=4, vocab_size=500, special_ids=SPECIALS)(
            [{"input_ids": torch.arange(5, 9)}]
        )
