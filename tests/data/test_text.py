"""build_mlm_data: packed MLM train/eval sets from Shakespeare or local files, with their cache."""
import os
import time

import numpy as np
import pytest
import torch

from sparsetrain.data.text import DEFAULT_VAL_PLAYS, build_mlm_data


@pytest.fixture(scope="session")
def mlm_cache(real_corpus_dir, tmp_path_factory):
    """A fresh tokenizer/packing cache that reuses the machine's corpus (a symlink, no copy)."""
    root = tmp_path_factory.mktemp("mlm_cache")
    os.symlink(real_corpus_dir, root / "corpora")
    return root


@pytest.fixture(scope="session")
def mlm(mlm_cache):
    return build_mlm_data(vocab_size=2048, seq_len=64, cache_dir=str(mlm_cache))


def test_packed_shapes_and_framing(mlm):
    tok = mlm.tokenizer
    ids = mlm.train.input_ids
    assert ids.ndim == 2 and ids.shape[1] == 64 and len(mlm.train) > 10_000 and len(mlm.eval) > 1_000
    assert (ids[:, 0] == tok.cls_token_id).all() and (ids[:, -1] == tok.sep_token_id).all()
    assert not (ids == tok.pad_token_id).any()
    assert mlm.vocab_size == len(tok) == 2048 and int(ids.max()) < mlm.vocab_size
    item = mlm.train[7]
    assert item["index"] == 7 and item["input_ids"].dtype == torch.long and item["input_ids"].shape == (64,)
    assert ids.dtype == torch.int16  # stored narrow (a 2048-token vocabulary fits), read as int64
    assert tok.mask_token_id is not None and tok.decode(ids[0, 1:20]).strip()


def test_held_out_plays_do_not_appear_in_train(mlm):
    assert mlm.eval_documents == list(DEFAULT_VAL_PLAYS)
    assert not set(DEFAULT_VAL_PLAYS) & set(mlm.train_documents) and len(mlm.train_documents) == 34
    train_windows = mlm.train.input_ids[:, 1:-1].unfold(1, 24, 1).reshape(-1, 24)

    def found(window):
        return bool((train_windows == window).all(dim=1).any())

    # Positive control: a window taken from train is found, so the search can fail.
    assert found(mlm.train.input_ids[123, 10:34])
    for row in (5, len(mlm.eval) // 2, len(mlm.eval) - 5):  # one window from each held-out play
        assert not found(mlm.eval.input_ids[row, 10:34])


def test_second_build_reads_the_cache_fast(mlm, mlm_cache):
    start = time.perf_counter()
    again = build_mlm_data(vocab_size=2048, seq_len=64, cache_dir=str(mlm_cache))
    assert time.perf_counter() - start < 2.0
    assert torch.equal(again.train.input_ids, mlm.train.input_ids)
    assert again.tokenizer.get_vocab() == mlm.tokenizer.get_vocab()
    shorter = build_mlm_data(vocab_size=2048, seq_len=32, cache_dir=str(mlm_cache))  # reuses tokenizer.json
    assert (
        shorter.tokenizer.get_vocab() == mlm.tokenizer.get_vocab() and shorter.train.input_ids.shape[1] == 32
    )


def test_max_train_sequences_takes_a_seeded_subset(mlm, mlm_cache):
    small = build_mlm_data(vocab_size=2048, seq_len=64, cache_dir=str(mlm_cache), max_train_sequences=100)
    other = build_mlm_data(
        vocab_size=2048, seq_len=64, cache_dir=str(mlm_cache), max_train_sequences=100, seed=1
    )
    assert len(small.train) == 100 and len(small.eval) == len(mlm.eval)
    rows = {tuple(r) for r in mlm.train.input_ids.tolist()}
    assert all(tuple(r) in rows for r in small.train.input_ids.tolist())
    assert not torch.equal(small.train.input_ids, other.train.input_ids)


def test_bad_arguments_raise_before_work(tmp_path):
    with pytest.raises(ValueError, match="source"):
        build_mlm_data(source="web", cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="mlm_probability"):
        build_mlm_data(mlm_probability=1.5, cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="files"):
        build_mlm_data(source="files", cache_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        build_mlm_data(source="files", files=[str(tmp_path / "nope.txt")], cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="hub_name"):
        build_mlm_data(source="hub", cache_dir=str(tmp_path))


def test_files_source_holds_out_the_last_documents(tmp_path):
    words = ["thou", "art", "more", "lovely", "and", "temperate", "rough", "winds", "do", "shake"]
    rng = np.random.default_rng(0)
    paths = []
    for f in range(2):
        paragraphs = [" ".join(rng.choice(words, 40)) for _ in range(10)]
        paths.append(tmp_path / f"part{f}.txt")
        paths[-1].write_text("\n\n".join(paragraphs))
    data = build_mlm_data(
        source="files",
        files=[str(p) for p in paths],
        vocab_size=200,
        seq_len=16,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
    )
    assert data.train_documents == [f"doc{i}" for i in range(18)]  # a paragraph is a document
    assert data.eval_documents == ["doc18", "doc19"]
    assert data.train.input_ids.shape[1] == 16 and len(data.eval) > 0
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(f'{{"body": "{" ".join(rng.choice(words, 30))}"}}' for _ in range(5)))
    with pytest.raises(ValueError, match="text_column='text'"):
        build_mlm_data(source="files", files=[str(jsonl)], seq_len=16, cache_dir=str(tmp_path / "cache"))
    data = build_mlm_data(
        source="files",
        files=[str(jsonl)],
        text_column="body",
        vocab_size=200,
        seq_len=16,
        val_fraction=0.2,
        cache_dir=str(tmp_path / "cache"),
    )
    assert data.eval_documents == ["doc4"]


def test_config_wires_max_predictions_and_asks_the_model_whether_to_emit_positions():
    """data.max_predictions is validated naming its key; masked_positions are emitted only for a model whose
    builder says it takes them (arch=bert), never for a pretrained model of another class or for images."""
    from sparsetrain.config import ConfigError, compose, data_builder, predictions_per_seq, validate

    bert = compose(["recipe=quickstart"])  # seq_len 64: P = ceil(0.15 * 64)
    assert data_builder(bert).keywords == {"emit_positions": True} and predictions_per_seq(bert) == 10
    assert predictions_per_seq(compose(["recipe=quickstart", "data.max_predictions=12"])) == 12
    hf = compose(["recipe=quickstart", "model=hf", "model.name_or_path=bert-base-uncased"])
    assert data_builder(hf).keywords == {"emit_positions": False} and predictions_per_seq(hf) is None
    vit = compose(["recipe=quickstart", "model=vit_tiny", "data=digits"])
    assert data_builder(vit).keywords.keys() == {"pixel_dtype"} and predictions_per_seq(vit) is None
    for bad in ("0", "65", "true", "2.5"):
        with pytest.raises(ConfigError) as e:
            validate(compose(["recipe=quickstart", f"data.max_predictions={bad}"]))
        assert e.value.key == "data.max_predictions", str(e.value)


def test_batches_carry_masked_positions_for_the_model(mlm):
    assert mlm.predictions_per_seq == 10  # seq_len 64
    batch = mlm.collator([mlm.train[i] for i in range(8)])
    assert sorted(batch) == ["input_ids", "labels", "masked_positions"]  # packed: no attention_mask
    assert batch["masked_positions"].shape == (8, 10) and (batch["labels"][:, 0] == -100).all()
