"""Tuner choices kept on disk, so a new process does not time every shape again.

One JSON file per machine setup: ``<cache>/tuning/<name>-<fingerprint>.json`` under the sparsetrain cache
(``$SPARSETRAIN_CACHE``, default ``~/.cache/sparsetrain``). The fingerprint hashes everything that could make a
kept choice wrong or stale: the GPU's name and compute capability, the torch, triton and CUDA versions, and the
kernel sources (the ``.py``, ``.cu`` and ``.cuh`` files under the folders given). A key is a JSON text of plain
values (:func:`stable_key`). A value is the chosen config and the timings behind it. A config is kept as its
backend's name, its class name and its fields (a ``NamedTuple``), and it comes back only where that class is
registered under that backend and accepts those fields. Otherwise the entry is ignored and timed again.

A store reads the file, adds the entries of this process and replaces the file atomically (temp file +
rename). Concurrent processes therefore never leave a torn file; a store that races another may drop the
other's entries until that process stores again, which at worst costs a re-time. A corrupt or unreadable
file is ignored with one warning and replaced at the next store.

>>> import tempfile; from typing import NamedTuple
>>> class Tile(NamedTuple):
...     rows: int
>>> kept = ChoiceFile(Path(tempfile.mkdtemp()) / "choices.json")
>>> kept.store("k", Tile(64), [(Tile(64), 0.5), (Tile(128), 0.7)], {Tile: "mine"})
>>> ChoiceFile(kept.path).lookup("k", {Tile: "mine"})
(Tile(rows=64), [(Tile(rows=64), 0.5), (Tile(rows=128), 0.7)])
"""
from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import torch

# a leaf module (no sparsetrain imports): the package's one atomic write, below every floor
from sparsetrain._files import atomic_write_text
from sparsetrain.kernels._runtime.cuda_build import cache_dir

FORMAT = 1  # part of the fingerprint: a file of another layout is never read
_PLAIN = (str, int, float, bool, type(None))


def cache_root() -> Path:
    """The sparsetrain cache folder (``$SPARSETRAIN_CACHE``, default ``~/.cache/sparsetrain``)."""
    return cache_dir().parent  # cache_dir() is <root>/kernels, where the CUDA builds go


@lru_cache(maxsize=8)
def source_digest(folders: tuple[Path, ...]) -> str:
    """A hash of the kernel sources under ``folders``: every ``.py``, ``.cu`` and ``.cuh`` file, by relative
    path and content (read once per process)."""
    h = hashlib.sha256()
    for folder in folders:
        for f in sorted(p for ext in ("py", "cu", "cuh") for p in folder.rglob(f"*.{ext}")):
            h.update(f"{folder.name}/{f.relative_to(folder).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def device_facts(device: torch.device) -> dict:
    """What besides the sources decides whether a choice timed on ``device`` still holds."""
    import triton

    major, minor = torch.cuda.get_device_capability(device)
    return {"gpu": torch.cuda.get_device_name(device), "capability": f"{major}.{minor}",
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def fingerprint(device: torch.device, folders: Sequence[Path]) -> str:
    """16 hex digits that change with :func:`device_facts`, the sources under ``folders`` and :data:`FORMAT`."""
    facts = {**device_facts(device), "sources": source_digest(tuple(folders)), "format": FORMAT}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def choice_file(name: str, device: torch.device, folders: Sequence[Path]) -> ChoiceFile:
    """The file of ``name``'s choices on ``device``: ``<cache>/tuning/<name>-<fingerprint>.json``."""
    return ChoiceFile(cache_root() / "tuning" / f"{name}-{fingerprint(device, folders)}.json")


def stable_key(parts: Iterable) -> str | None:
    """``parts`` (plain values, torch dtypes, nested tuples/lists of them) as a JSON text; None if a part is
    something else (such a choice is not kept)."""
    def plain(v):
        if isinstance(v, torch.dtype):
            return str(v)
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, _PLAIN):
            return v
        raise TypeError(type(v).__name__)

    try:
        return json.dumps([plain(v) for v in parts], separators=(",", ":"))
    except TypeError:
        return None


def encode_config(config, types: Mapping[type, str]) -> dict | None:
    """``{"backend", "type", "fields"}`` of a registered ``NamedTuple`` config of plain fields, else None.
    ``types`` maps each registered config class to its backend's name."""
    backend = types.get(type(config))
    fields = getattr(config, "_fields", None)
    if backend is None or fields is None or not all(isinstance(v, _PLAIN) for v in config):
        return None
    return {"backend": backend, "type": type(config).__name__, "fields": dict(zip(fields, config))}


def decode_config(data, types: Mapping[type, str]):
    """The config :func:`encode_config` wrote, or None where its class is not registered under that backend or
    its fields do not match the class's."""
    if not isinstance(data, dict) or not isinstance(data.get("fields"), dict):
        return None
    for cls, backend in types.items():
        if backend == data.get("backend") and cls.__name__ == data.get("type"):
            if set(data["fields"]) != set(getattr(cls, "_fields", ())):
                return None
            try:
                return cls(**data["fields"])
            except (TypeError, ValueError):
                return None
    return None


class ChoiceFile:
    """The kept choices of one file: read on the first :meth:`lookup`, merged into the file by :meth:`store`."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._entries: dict | None = None  # the file's entries, read at the first lookup
        self._mine: dict = {}  # the entries this process stored
        self._warned = False
        self._writable = True

    def lookup(self, key: str, types: Mapping[type, str]) -> tuple[object, list[tuple[object, float]]] | None:
        """``(config, [(config, ms), ...])`` kept under ``key``, or None (none kept, or one that does not
        reconstruct with the registered ``types``)."""
        if self._entries is None:
            self._entries = self._read()
        entry = self._entries.get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("timed"), list):
            return None
        config = decode_config(entry.get("config"), types)
        timed = []
        for item in entry["timed"]:
            if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], (int, float))):
                return None
            cfg = decode_config(item[0], types)
            if cfg is None:
                return None
            timed.append((cfg, float(item[1])))
        return None if config is None else (config, timed)

    def store(self, key: str, config, timed: Sequence[tuple[object, float]], types: Mapping[type, str]) -> None:
        """Keep ``config`` and its timings under ``key``: the file as it is now plus this entry, written
        atomically. Nothing is kept where a config cannot be encoded; a failed write warns once."""
        entry = {"config": encode_config(config, types),
                 "timed": [[encode_config(c, types), float(ms)] for c, ms in timed]}
        if entry["config"] is None or any(c is None for c, _ in entry["timed"]):
            return
        self._mine[key] = entry
        if not self._writable:
            self._entries = {**(self._entries or {}), key: entry}
            return
        # what other processes wrote meanwhile, and all of this process's entries (one a racing writer dropped
        # comes back)
        entries = self._entries = {**self._read(), **self._mine}
        try:
            # compact: json's C encoder (with an indent it encodes in Python, 4x slower; each store writes all)
            atomic_write_text(self.path, json.dumps({"format": FORMAT, "choices": entries}) + "\n")
        except OSError as e:
            self._writable = False
            warnings.warn(f"sparsetrain: could not write the kernel tuning cache {self.path} ({e}); "
                          "choices made from now on are timed again by the next process", stacklevel=3)

    def _read(self) -> dict:
        try:
            raw = self.path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as e:
            return self._ignore(f"could not read it ({e})")
        try:
            data = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError included
            return self._ignore("it is not valid JSON")
        if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("choices"), dict)):
            return self._ignore("it is not a tuning cache of this version")
        return data["choices"]

    def _ignore(self, why: str) -> dict:
        if not self._warned:
            self._warned = True
            warnings.warn(f"sparsetrain: ignoring the kernel tuning cache {self.path}: {why}; "
                          "it will be replaced", stacklevel=4)
        return {}
