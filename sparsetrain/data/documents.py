"""Where MLM text comes from: ``(name, text)`` documents for the train and held-out splits.

Sources: the embedded Shakespeare corpus (whole plays held out), local text/json/jsonl/parquet files and named
hub datasets (the last documents held out, or the hub's ``validation`` split). The larger English corpus brings
its own split: :func:`sparsetrain.data.english_large.english_large_documents`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from sparsetrain.data.corpus import shakespeare_plays

FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def shakespeare_documents(val_plays: Sequence[str], corpus_dir: Path):
    """(train, held-out) documents of the Shakespeare corpus: the plays ``val_plays`` are held out whole."""
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


def file_identity(files: Sequence[str]) -> list:
    """What keys the cache for local files: path, size and modification time of each (all must exist and
    share one supported extension)."""
    check_text_files(files)
    paths = [Path(f).expanduser() for f in files]
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


#: A plain-text file this small is read whole up front to refuse one holding only whitespace.
_SMALL_TEXT_BYTES = 1 << 16


def check_text_files(files: Sequence[str]) -> None:
    """Cheap checks before any text is read: every file exists, is readable, is not empty (a small ``.txt``
    holding only whitespace counts as empty) and all share one supported extension. Raises FileNotFoundError
    or ValueError whose message starts with ``files``."""
    paths = [Path(str(f)).expanduser() for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"files not found: {missing}")
    suffixes = {p.suffix.lower() for p in paths}
    if len(suffixes) != 1 or next(iter(suffixes)) not in FILE_BUILDERS:
        raise ValueError(f"files must all share one of the extensions {sorted(FILE_BUILDERS)}; got {sorted(suffixes)}")
    for p in paths:
        if not os.access(p, os.R_OK):
            raise ValueError(f"files: {str(p)!r} is not readable")
        size = p.stat().st_size
        blank = size == 0 or (p.suffix.lower() == ".txt" and size <= _SMALL_TEXT_BYTES
                              and not p.read_bytes().strip())
        if blank:
            raise ValueError(f"files: {str(p)!r} is empty")


def _column(dataset, text_column: str, what: str) -> list[str]:
    if text_column not in dataset.column_names:
        raise ValueError(f"text_column={text_column!r} is not in {what}; columns: {dataset.column_names}")
    return [t for t in dataset[text_column] if t and t.strip()]


def file_documents(files: Sequence[str], text_column: str, val_fraction: float, cache_root: Path):
    """(train, held-out) documents of local files: a ``.txt`` paragraph or a json/parquet row is one document;
    the last ``val_fraction`` are held out."""
    import datasets

    paths = [str(Path(f).expanduser().resolve()) for f in files]
    builder = FILE_BUILDERS[Path(paths[0]).suffix.lower()]
    # Plain text: one document per paragraph (blank-line separated), so a single file still splits.
    extra = {"sample_by": "paragraph"} if builder == "text" else {}
    try:
        loaded = datasets.load_dataset(
            builder, data_files=paths, split="train", cache_dir=str(cache_root / "datasets"), **extra
        )
    except datasets.exceptions.DatasetGenerationError as e:  # e.g. malformed json, an unreadable parquet
        cause = e.__cause__ or e
        raise ValueError(f"files: cannot read {paths}: {str(cause).strip().splitlines()[0][:300]}") from e
    texts = _column(loaded, "text" if builder == "text" else text_column, f"files {paths}")
    docs = [(f"doc{i}", t) for i, t in enumerate(texts)]
    return _split_last(docs, val_fraction, f"files {paths}")


def hub_documents(hub_name: str, hub_config: str | None, text_column: str, val_fraction: float):
    """(train, held-out) documents of a hub dataset: its ``validation`` split, else its last ``val_fraction``."""
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
