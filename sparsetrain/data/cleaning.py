"""Turning packaged text into plain prose: HTML pages, reStructuredText sources, dictd dictionaries.

Each function takes what a package ships and returns plain text with paragraphs separated by one blank line.
Code is dropped (``<pre>`` blocks, reST literal blocks and code directives, doctest lines): the corpus is
English prose for a masked-language model, and code would mostly teach it punctuation.

>>> normalize_text("a  \\r\\n\\n\\n\\nb\\n")
'a\\n\\nb'
"""

from __future__ import annotations

import re
import zlib
from html.parser import HTMLParser

_BLANK_RUNS = re.compile(r"\n\s*\n\s*\n+")


def normalize_text(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row, no outer whitespace."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\f", "\n").replace("\u00a0", " ")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return _BLANK_RUNS.sub("\n\n", text).strip()


# ---- HTML ---------------------------------------------------------------------------------------------
_SKIP_TAGS = frozenset({"script", "style", "head", "pre", "nav", "header", "footer", "svg", "noscript"})
_BLOCK_TAGS = frozenset({"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "dt", "dd", "table",
                         "blockquote", "section", "article", "ul", "ol", "dl", "hr", "title", "caption"})
_VOID_TAGS = frozenset({"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "wbr"})


class _TextOfHTML(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.stack: list[tuple[str, bool]] = []  # (tag, skipped) of open elements

    def _skipping(self) -> bool:
        return any(skipped for _, skipped in self.stack)

    def handle_starttag(self, tag, attrs):
        if tag in _BLOCK_TAGS:
            self.parts.append("\n\n")
        if tag in _VOID_TAGS:
            return
        classes = " ".join(v or "" for k, v in attrs if k in ("class", "id")).lower()
        # navigation bars and menus ("navheader", "navfooter", "menu") repeat on every page of a manual
        self.stack.append((tag, tag in _SKIP_TAGS or "nav" in classes.split("-")[0] or "menu" in classes))

    def handle_endtag(self, tag):
        if tag in _BLOCK_TAGS:
            self.parts.append("\n\n")
        for i in range(len(self.stack) - 1, -1, -1):  # close up to the matching tag (HTML is forgiving)
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break

    def handle_data(self, data):
        if not self._skipping():
            self.parts.append(data)


def html_to_text(html: str) -> str:
    """The readable text of an HTML page: scripts, styles, ``<pre>`` code and navigation left out.

    >>> html_to_text("<html><head><title>T</title></head><body><div class='navheader'>Next</div>"
    ...              "<p>One &amp; two.</p><pre>x = 1</pre><p>Three</p></body></html>")
    'One & two.\\n\\nThree'
    """
    parser = _TextOfHTML()
    parser.feed(html)
    parser.close()
    paragraphs = (" ".join(p.split()) for p in "".join(parser.parts).split("\n\n"))
    return "\n\n".join(p for p in paragraphs if p)


# ---- reStructuredText -----------------------------------------------------------------------------------
_CODE_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+(code-block|code|sourcecode|doctest|testcode|testoutput|"
                             r"literalinclude|highlight|productionlist|math|raw|graphviz|csv-table|"
                             r"list-table|table|toctree|autosummary|automodule|autoclass|image|figure|"
                             r"index|include|only|tabularcolumns|rubric|currentmodule|module)::.*$")
_DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
_COMMENT_OR_TARGET = re.compile(r"^(\s*)\.\.(\s|$)")  # a comment, a target or a substitution
# directives whose argument is prose (the others' argument is a signature or a name: dropped, body kept)
_PROSE_ARGUMENT = frozenset({"note", "warning", "versionadded", "versionchanged", "deprecated", "seealso",
                             "attention", "caution", "danger", "error", "hint", "important", "tip",
                             "admonition", "topic", "sidebar", "impl-detail"})
_UNDERLINE = re.compile(r"^\s*([=\-~^\"'`#*+.:_])(?:\1|\s)*\1\1\s*$")  # also simple-table rules "=== ==="
_FIELD = re.compile(r"^\s*:[\w -]+:(\s|$)")
_NOT_PROSE = (">>>", "...", "$ ", "+-", "+=", "|")  # doctest and shell lines, grid-table rules and rows
_ROLE = re.compile(r":[\w:.+-]+:`~?!?([^`<]*?)\s*(?:<[^`>]*>)?`")
_LINK = re.compile(r"`([^`<]*?)\s*<[^`>]*>`__?")
_REF = re.compile(r"`([^`]+)`_{0,2}")
_INLINE = re.compile(r"\*\*([^*]+)\*\*|\*([^*\s][^*]*)\*|``([^`]+)``|\|([^|\s][^|]*)\|_?")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def rst_to_text(rst: str) -> str:
    """The prose of a reStructuredText source: literal blocks (after ``::``), code and table directives,
    comments, targets, field lists and doctest lines dropped; roles, links and inline markup reduced to
    their text; headings kept as lines. Admonitions (``.. note::``) keep their body.

    >>> rst_to_text("Title\\n=====\\n\\nUse :func:`len` like this::\\n\\n    len(x)\\n\\nSee `docs <http://x>`_.")
    'Title\\n\\nUse len like this:\\n\\nSee docs.'
    """
    lines = rst.replace("\r\n", "\n").split("\n")
    out: list[str] = []
    skip_below: int | None = None  # drop lines indented deeper than this (a literal block or directive body)
    for line in lines:
        if skip_below is not None:
            if not line.strip() or _indent(line) > skip_below:
                continue
            skip_below = None
            out.append("")  # the dropped block ended a paragraph
        stripped = line.strip()
        if _CODE_DIRECTIVE.match(line) or (_COMMENT_OR_TARGET.match(line) and not _DIRECTIVE.match(line)):
            skip_below = _indent(line)
            continue
        directive = _DIRECTIVE.match(line)
        if directive:  # keep the body (and an admonition's argument), drop the marker
            if directive.group(2).split(":")[-1] not in _PROSE_ARGUMENT:
                continue
            line = directive.group(1) + directive.group(3)
            stripped = line.strip()
        if _UNDERLINE.match(line) or _FIELD.match(line) or stripped.startswith(_NOT_PROSE):
            continue
        if stripped.endswith("::"):
            skip_below = _indent(line)
            line = line.rstrip()[:-1] if not stripped == "::" else ""
            if stripped.endswith(" ::"):
                line = line.rstrip()[:-1].rstrip()
        line = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if "~" in m.group(0) else m.group(1), line)
        line = _LINK.sub(r"\1", line)
        line = _INLINE.sub(lambda m: next(g for g in m.groups() if g is not None), line)
        line = _REF.sub(r"\1", line)
        out.append(line.strip())
    return normalize_text("\n".join(out))


# ---- dictd dictionaries -----------------------------------------------------------------------------------
_B64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}


def _dictd_number(digits: str) -> int:
    value = 0
    for c in digits:
        value = value * 64 + _B64[c]
    return value


def dictd_entries(index: str, data: bytes) -> list[tuple[str, str]]:
    """``(headword, entry text)`` of a dictd dictionary, in index order: ``index`` is the ``.index`` file
    (``headword<TAB>offset<TAB>length``, numbers in base 64), ``data`` the ``.dict`` or gzip'd ``.dict.dz``.
    The ``00-database-*`` entries (the dictionary's own metadata) are left out.

    >>> body = b"cat\\n  a small feline\\n"
    >>> dictd_entries("cat\\tA\\tW\\n", body)
    [('cat', 'cat\\n  a small feline')]
    """
    if data[:2] == b"\x1f\x8b":
        data = zlib.decompress(data, 16 + zlib.MAX_WBITS)
    entries = []
    for line in index.splitlines():
        fields = line.split("\t")
        if len(fields) < 3 or fields[0].startswith("00-database") or fields[0].startswith("00database"):
            continue
        start, length = _dictd_number(fields[1]), _dictd_number(fields[2])
        entries.append((fields[0], data[start : start + length].decode("utf-8", "replace").rstrip()))
    return entries


def decode_text(raw: bytes) -> str:
    """UTF-8 (a byte-order mark dropped), else Latin-1: old Gutenberg texts are often ISO-8859-1."""
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


__all__ = ["decode_text", "dictd_entries", "html_to_text", "normalize_text", "rst_to_text"]
