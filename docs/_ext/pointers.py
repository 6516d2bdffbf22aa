"""Pointers into the documentation, found in any text: ``docs/X.md`` and its section.

A comment, a docstring, a help text or a page points at the documentation in one
of two ways, and both are read here, once, for the test that keeps every
pointer resolving (``tests/project/test_docs.py``) and for the Sphinx extension
that turns the pointers in docstrings and generated tables into links
(``mpicoll_docs.py``):

* a path, ``docs/numerics.md``, optionally followed by a section title in
  quotes: ``docs/numerics.md, "Overflow, NaN and Inf"``, ``docs/numerics.md
  ("Overflow, NaN and Inf")``, ``docs/numerics.md's "Overflow, NaN and Inf"``
  (in a comment the title may run onto the next line, after its ``#``);
* a Markdown link, ``[text](numerics.md#overflow-nan-and-inf)``, relative to
  the file it is in.

A section is a heading of the page (any level), compared without Markdown
code marks, case or repeated spaces; an anchor is the heading's id as MyST
makes it (``myst_heading_anchors``).  No Sphinx and no mpicoll import: the
tests read files.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

# docs/X.md, then optionally: 's / , / ( / "section" and a quoted title; between the
# words of the title a line break with a comment's leader (#, *, //)
_BREAK = r"(?:\s*\n\s*(?:#+|\*|//)?\s*|\s+)"
PATH = re.compile(
    r"(?<![\w/.-])docs/(?P<page>[a-z_]+)\.md"
    r"(?:(?:'s)?,?" + _BREAK + r"?\(?(?:section" + _BREAK + r")?"
    r"[\"\u201c](?P<section>[^\"\u201d\n]+(?:" + _BREAK + r"[^\"\u201d\n]+)*)[\"\u201d])?")
LINK = re.compile(r"\]\((?P<target>[^()\s]+?\.md)(?:#(?P<anchor>[\w-]+))?\)")
_FENCE = re.compile(r"^\s*(```+|~~~+)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


class Pointer(NamedTuple):
    line: int            # 1-based, where the pointer starts
    page: Path           # the page it names (may not exist)
    section: str | None  # a quoted title, or None
    anchor: str | None   # a link's #anchor, or None
    text: str            # as written


def clean(title: str) -> str:
    return " ".join(re.sub(_BREAK, " ", title).replace("`", "").split()).casefold()


def find(text: str, where: Path, docs: Path) -> list[Pointer]:
    """Every pointer in ``text`` (the contents of the file ``where``) into ``docs``."""
    out = []
    for m in PATH.finditer(text):
        if text[max(m.start() - 2, 0):m.start()] == "](":
            continue  # a Markdown link's target: below
        section = m.group("section")
        out.append(Pointer(text.count("\n", 0, m.start()) + 1, docs / f"{m.group('page')}.md",
                           clean(section) if section else None, None, m.group(0)))
    if where.suffix == ".md":
        for m in LINK.finditer(text):
            target = m.group("target")
            if "://" in target:
                continue
            out.append(Pointer(text.count("\n", 0, m.start()) + 1,
                               (where.parent / target).resolve(), None, m.group("anchor"),
                               m.group(0)))
    return out


def headings(page: Path) -> list[str]:
    """The heading titles of a Markdown page (outside fenced code), as written."""
    found, fence = [], None
    for line in page.read_text(encoding="utf-8").splitlines():
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence):
                fence = None
            continue
        h = _HEADING.match(line) if fence is None else None
        if h:
            found.append(h.group(2))
    return found


def anchors(title: str) -> set[str]:
    """The ids a heading may have: MyST's slug (GitHub's rule) and docutils' id of it."""
    github = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
    docutils = re.sub(r"[^a-z0-9]+", "-", title.replace("`", "").lower()).strip("-")
    return {github, docutils}


def problem(p: Pointer) -> str | None:
    """Why ``p`` does not resolve (None: it does)."""
    if not p.page.is_file():
        return f"no page {p.page.name}"
    if p.section is None and p.anchor is None:
        return None
    titles = headings(p.page)
    if p.section is not None and p.section not in {clean(t) for t in titles}:
        return f"{p.page.name} has no section {p.section!r}"
    if p.anchor is not None and not any(p.anchor in anchors(t) for t in titles):
        return f"{p.page.name} has no heading with the anchor #{p.anchor}"
    return None


def anchor_of(page: Path, section: str) -> str | None:
    """The anchor MyST gives the heading of ``page`` titled ``section`` (cleaned), or None."""
    for title in headings(page):
        if clean(title) == section:
            return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
    return None
