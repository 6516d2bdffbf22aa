"""Sphinx directives that write mpicoll's reference tables from the code's own tables.

Each table has one source of truth in the package, and the pages are generated
from it at every build, so they cannot drift:

``mpicoll-options``
    every ``MPICOLL_*`` option, from ``mpicoll.core.config.OPTIONS``;
``mpicoll-algorithms``
    every algorithm of every collective, from the registry
    (``mpicoll.engine.select.ALGORITHMS``), with the row each algorithm module
    keeps in its ``ABOUT`` table (what it does, steps, bytes, work memory);
    a registered algorithm without a row stops the build;
``mpicoll-auto``
    what ``algorithm="auto"`` picks, from ``mpicoll.engine.select.THRESHOLDS``.

And one transform: a pointer into the documentation in running text --
``docs/numerics.md`` or ``docs/numerics.md, "Overflow, NaN and Inf"`` in a
docstring, an option's help, a page -- becomes a link to that page and section
(``pointers.py`` reads pointers, for this and for the test that keeps them
resolving); one that resolves to nothing stops the build.

The tables are written as Markdown and parsed in place (the pages are MyST).
mpicoll is imported with the modules of ``autodoc_mock_imports`` mocked, as
autodoc imports it (docs/conf.py says why that is honest).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pointers
from docutils import nodes
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

_LOG = logging.getLogger(__name__)

_NAMES = {"allreduce": "AllReduce", "reduce_scatter": "ReduceScatter", "allgather": "AllGather"}


def _import(app, name):
    """Module ``name`` of mpicoll, imported with autodoc's mocks in place."""
    from sphinx.ext.autodoc.mock import mock
    with mock(app.config.autodoc_mock_imports):
        return importlib.import_module(name)


def _size(nbytes: int) -> str:
    """``262144`` -> ``256 KiB`` (whole units only)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(headers, rows) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


class _Generated(SphinxDirective):
    """A directive whose content is Markdown made by :meth:`markdown`."""

    has_content = False

    def run(self):
        node = nodes.container(classes=["mpicoll-generated"])
        self.state.nested_parse(self._lines(), self.content_offset, node)
        return node.children

    def _lines(self):
        from docutils.statemachine import StringList
        return StringList(self.markdown(), source=self.get_source_info()[0])

    def markdown(self) -> list[str]:
        raise NotImplementedError


def _default(opt, config) -> str:
    """An option's default as a user would write it in the environment."""
    value = opt.default
    if value is None:
        return "unset"
    if opt.parse is config.parse_flag:
        return "1 (on)" if value else "0 (off)"
    if opt.parse is config.parse_bytes:
        for suffix, shift in (("G", 30), ("M", 20), ("K", 10)):
            if value % (1 << shift) == 0:
                return f"{value >> shift}{suffix}"
        return str(value)
    if isinstance(value, str):
        home = os.path.expanduser("~")
        if value == home or value.startswith(home + os.sep):
            value = "~" + value[len(home):]  # the reader's home, not the build machine's
    return str(value)


class OptionsTable(_Generated):
    """The ``MPICOLL_*`` options, one row per entry of ``core.config.OPTIONS``."""

    def markdown(self):
        config = _import(self.env.app, "mpicoll.core.config")
        rows = [(f"`{opt.env}`", f"`{opt.name}`", f"`{_default(opt, config)}`",
                 "yes" if opt.api else "no", opt.doc) for opt in config.OPTIONS]
        return _table(("variable", "option", "default", "`configure()`", "meaning"), rows)


class AlgorithmsTable(_Generated):
    """Every registered algorithm with its module's ``ABOUT`` row; a missing row is an error."""

    option_spec = {"summaries": lambda arg: True}

    def markdown(self):
        select = _import(self.env.app, "mpicoll.engine.select")
        rows, notes = [], []
        for collective, table in select.ALGORITHMS.items():
            for name, build in table.items():
                about = getattr(importlib.import_module(build.__module__), "ABOUT", {})
                row = about.get((collective, name))
                if row is None:
                    raise self.error(f"{build.__module__} has no ABOUT row for "
                                     f"({collective!r}, {name!r}): every registered algorithm "
                                     f"needs one (docs/algorithms.md is generated from them)")
                if collective == "allgather":
                    ops = "–"
                elif name in select.ORDER_PRESERVING:
                    ops = "any (keeps rank order)"
                else:
                    ops = "commutative"
                rows.append((_NAMES[collective], f"`{name}`", row["steps"], row["sends"],
                             row["memory"], ops))
                notes.append(f"- **`{name}`** ({_NAMES[collective]}, "
                             f"`{build.__module__}`): {row['summary']}")
        lines = _table(("collective", "algorithm", "steps", "bytes sent per rank",
                        "work memory", "ops"), rows)
        if "summaries" in self.options:
            lines += [""] + notes
        return lines


class AutoTable(_Generated):
    """What ``algorithm="auto"`` picks by size and rank count (``select.THRESHOLDS``)."""

    def markdown(self):
        select = _import(self.env.app, "mpicoll.engine.select")
        rows = []
        for collective, table in select.THRESHOLDS.items():
            for limit, pof2, other in table:
                size = "larger" if limit is None else _size(limit)
                rows.append((_NAMES[collective], size, f"`{pof2}`", f"`{other}`"))
        return _table(("collective", "size ≤", "power-of-two ranks", "other rank counts"), rows)


# text inside these is code or already a link: left as written
_NOT_PROSE = (nodes.literal, nodes.literal_block, nodes.reference, nodes.raw, nodes.comment,
              nodes.target)


def link_pointers(app, doctree, docname):
    """Every ``docs/X.md`` (with its quoted section) in running text becomes a link."""
    docs = Path(app.srcdir)
    for text in list(doctree.findall(nodes.Text)):
        if any(isinstance(a, _NOT_PROSE) for a in _ancestors(text)):
            continue
        source = str(text)
        found = list(pointers.PATH.finditer(source))
        if not found:
            continue
        parts, pos = [], 0
        for m in found:
            page = docs / f"{m.group('page')}.md"
            section = m.group("section")
            anchor = pointers.anchor_of(page, pointers.clean(section)) if section else None
            if not page.is_file() or (section and anchor is None):
                _LOG.warning(f"a pointer to nothing: {m.group(0)!r} (no such page or section)",
                             location=text.parent)
                continue
            uri = app.builder.get_relative_uri(docname, m.group("page"))
            parts += [nodes.Text(source[pos:m.start()]),
                      nodes.reference("", m.group(0), internal=True,
                                      refuri=uri + (f"#{anchor}" if anchor else ""))]
            pos = m.end()
        if parts:
            text.parent.replace(text, [*parts, nodes.Text(source[pos:])])


def _ancestors(node):
    node = node.parent
    while node is not None:
        yield node
        node = node.parent


def setup(app):
    app.connect("doctree-resolved", link_pointers)
    app.add_directive("mpicoll-options", OptionsTable)
    app.add_directive("mpicoll-algorithms", AlgorithmsTable)
    app.add_directive("mpicoll-auto", AutoTable)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
