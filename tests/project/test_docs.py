"""The documentation: no dated narrative, docstrings that list the registry, what the build reads.

* The pages (README.md, CHANGELOG.md, every text file under docs/) keep current
  facts, not a work diary: no dates, clock times, commit hashes, load
  averages, "again", "session", tracker numbers.  :func:`diary` finds such
  text; its own tests plant lines it must catch and legitimate text it must
  pass, so a rule that stops firing, or fires on a version number, fails.
* Every public docstring that lists the names ``algorithm=`` takes lists
  exactly the registry's (``engine.select.ALGORITHMS``).
* Every registered algorithm has the ``ABOUT`` row the algorithm reference is
  generated from (docs/_ext/mpicoll_docs.py stops the Sphinx build without
  one; this finds it without Sphinx).
* The README stays short and keeps the two set-up commands where .ci/run
  reads them.
* docs/gpu.md states the one-shot limits ``engine.select`` has, and the direct path's
  segment ``algorithms.schedule`` has.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys

import pytest

pytestmark = pytest.mark.local  # reads files and docstrings: no MPI peer

ROOT = pathlib.Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".md", ".py", ".rst", ".txt"}


def pages() -> list[pathlib.Path]:
    """README.md, CHANGELOG.md and every text file under docs/ (not a build's output)."""
    found = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for path in sorted((ROOT / "docs").rglob("*")):
        rel = path.relative_to(ROOT / "docs").parts
        if path.is_file() and path.suffix in TEXT_SUFFIXES and "_build" not in rel:
            found.append(path)
    return [p for p in found if p.exists()]


# Dated narrative anywhere, code blocks included: a date, a clock time, a commit hash.
EVERYWHERE = {
    "an ISO date": re.compile(r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])(?:-(?:0[1-9]|[12]\d|3[01]))?\b"),
    "a clock time": re.compile(r"\b\d{1,2}:\d\d(?::\d\d)?(?:\s*-\s*\d{1,2}:\d\d)?\s*(?:UTC|GMT)\b"),
    # 7-40 hex digits with a digit and a letter, standing alone (not in a path,
    # a URL, a name or after 0x)
    "a commit hash": re.compile(r"(?<![\w./#:-])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])"
                                r"[0-9a-f]{7,40}(?![\w/-])"),
}
# Work-diary words, outside code blocks and code spans (a quoted error message
# may say "again").
IN_PROSE = {
    '"again"': re.compile(r"\bagain\b", re.I),
    '"session"': re.compile(r"(?<!MPI )(?<!MPI_)\bsessions?\b", re.I),
    "a load average": re.compile(r"\bload averages?\b|\bload \d+(?:\.\d+)?"
                                 r"(?!\.?\d|\s*(?:[KMGT]i?B|bytes?|elements?|ranks?|%))", re.I),
    '"today"/"yesterday"': re.compile(r"\b(?:today|yesterday|tonight)\b", re.I),
    "a tracker item": re.compile(r"\bissues? \d+\b|\bthe issue's\b", re.I),
}

_FENCE = re.compile(r"^(\s*)(```+|~~~+)")


def prose(text: str) -> list[str]:
    """The lines of ``text`` with fenced and indented code blocks blanked and code spans removed."""
    out, fence, prev_blank = [], None, True
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is not None:
            out.append("")
            if m and m.group(2)[0] == fence[0] and len(m.group(2)) >= len(fence):
                fence = None
            continue
        if m:
            fence = m.group(2)
            out.append("")
            continue
        indented = line.startswith("    ") and prev_blank and not line.lstrip().startswith(("-", "*"))
        if indented:  # an indented code block (a command under a blank line)
            out.append("")
            continue
        prev_blank = not line.strip()
        out.append(re.sub(r"`[^`]*`", "", line))
    return out


def diary(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, the text found) for every piece of dated narrative in ``text``."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, rule in EVERYWHERE.items():
            found += [(n, what, m.group(0)) for m in rule.finditer(line)]
    for n, line in enumerate(prose(text), 1):
        for what, rule in IN_PROSE.items():
            found += [(n, what, m.group(0)) for m in rule.finditer(line)]
    return sorted(found)


@pytest.mark.parametrize("path", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_dated_narrative(path):
    found = diary(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}: dated narrative (history belongs in git and " \
        f"CHANGELOG.md): " + "; ".join(f"line {n}: {what} {text!r}" for n, what, text in found)


PLANTED = [
    ("### The bands with a tuning file (2 ranks, 2026-12-03)", "an ISO date"),
    ("measured 2026-12, before the fix", "an ISO date"),
    ("14:19-14:22 UTC, the machine otherwise idle", "a clock time"),
    ("at 17:39 UTC on the first run", "a clock time"),
    ("main at 1a6d4a0, Open MPI 5.0.11", "a commit hash"),
    ("(46814b8), fixed", "a commit hash"),
    ("The bands, measured again", '"again"'),
    ("Pipelines across nodes (fourth session)", '"session"'),
    ("other sessions' jobs were idle", '"session"'),
    ("shared VM, load average 8-10", "a load average"),
    ("(Open MPI, load 10, two runs)", "a load average"),
    ("at load 2.8-3.0 the same code took 51 s", "a load average"),
    ("how many cases there are today", '"today"/"yesterday"'),
    ("as issue 21 measured", "a tracker item"),
    ("The issue's 'done when' numbers", "a tracker item"),
]

LEGITIMATE = [
    "Open MPI 5.0.11 and MPICH 5.0.2, mpi4py 4.1.2, NumPy 2.4.6, torch 2.14.1",
    "float16, bfloat16, float8_e4m3fn and float8_e5m2 on 1048576 elements",
    "MPI Sessions and MPI_Session_init are not used",
    "the loader reads `/tmp/abc1234/lib` and http://example.invalid/deadbee1",
    "the pointer 0x7f3a2b1c4d5e, a cliff at 256-272 B, 1.10 -> 1.56 us",
    "load 64 MiB of input; a load 4 bytes wide",
    "```\nThis communicator cannot be used again; end the job\n```",
    "    mpirun -n 2 python -m mpicoll.tools.overlap   # run it again to compare",
    "a `retry again` code span, Sep 16, 2026 in a version string",
    "the issues of a schedule, 2(n-1)/n of the array, 2 log2 n steps",
]


@pytest.mark.parametrize("line, what", PLANTED)
def test_diary_finds_a_planted_line(line, what):
    text = f"# A page\n\nSome current fact.\n{line}\nMore current text.\n"
    assert [w for _, w, _ in diary(text)] == [what], diary(text)
    assert diary(text)[0][0] == 4


@pytest.mark.parametrize("text", LEGITIMATE)
def test_diary_passes_legitimate_text(text):
    assert diary(text) == []


# -- docstrings list what the registry has -----------------------------------------

_QUOTED = re.compile(r'"([a-z_]+)"')


def algorithm_names(doc: str) -> set[str] | None:
    """The quoted names in the ``algorithm:`` entry of a Google-style docstring, or None."""
    lines = inspect.cleandoc(doc or "").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"(\s*)algorithm:\s*(.*)", line)
        if m:
            indent, entry = len(m.group(1)), [m.group(2)]
            for nxt in lines[i + 1:]:
                if not nxt.strip() or len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                entry.append(nxt.strip())
            return set(_QUOTED.findall(" ".join(entry)))
    return None


def _squash(name: str) -> str:
    return name.lower().replace("_", "")


def _public():
    """(name, object, collectives it takes algorithms of) of every public callable with a docstring."""
    import mpicoll
    from mpicoll.engine import select
    out = []
    for name in mpicoll.__all__:
        obj = getattr(mpicoll, name)
        if not callable(obj):
            continue
        targets = [c for c in select.ALGORITHMS if _squash(c) in _squash(name)]
        out.append((f"mpicoll.{name}", obj, targets or list(select.ALGORITHMS)))
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if callable(member) and not attr.startswith("_"):
                    coll = [c for c in select.ALGORITHMS if _squash(c) in _squash(attr)]
                    out.append((f"mpicoll.{name}.{attr}", member, coll or list(select.ALGORITHMS)))
    return out


def test_docstrings_list_the_registry():
    from mpicoll.engine import select
    listed = {}
    for name, obj, collectives in _public():
        names = algorithm_names(obj.__doc__)
        if not names:  # no entry, or one that names no algorithm (Request.algorithm)
            continue
        expected = {"auto"}.union(*(select.ALGORITHMS[c] for c in collectives))
        assert names == expected, (f"{name}'s docstring lists algorithms {sorted(names)}; "
                                   f"the registry has {sorted(expected)}")
        listed[name] = names
    # the entries that must exist (a docstring that dropped its list would pass above)
    for name in ("mpicoll.allreduce", "mpicoll.reduce_scatter", "mpicoll.allgather",
                 "mpicoll.Comm"):
        assert name in listed, f"{name}'s docstring has no algorithm: entry listing the names"


def test_algorithm_names_reads_a_wrapped_entry():
    doc = '''Summary.

    Args:
        algorithm: ``"auto"`` or one of ``"ring"``,
            ``"bruck"``.
        timeout: ``"ring"`` here is another argument's.
    '''
    assert algorithm_names(doc) == {"auto", "ring", "bruck"}
    assert algorithm_names("No arguments.") is None


def test_every_algorithm_has_a_reference_row():
    from mpicoll.engine import select
    for collective, table in select.ALGORITHMS.items():
        for name, build in table.items():
            about = getattr(importlib.import_module(build.__module__), "ABOUT", {})
            row = about.get((collective, name))
            assert row is not None, f"{build.__module__}.ABOUT has no row for {collective} {name}"
            assert set(row) == {"summary", "steps", "sends", "memory"}, (collective, name, row)
            assert all(isinstance(v, str) and v.strip() for v in row.values()), (collective, name)


# -- the README ---------------------------------------------------------------------

def test_readme_is_short_and_keeps_the_setup_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, "README.md: at most 200 lines (the rest is in docs/)"
    # .ci/run runs the first two ```bash blocks under "## Set up and run" literally
    section = re.search(r"^## Set up and run.*?(?=^## |\Z)", text, re.M | re.S)
    assert section, 'README.md: no "## Set up and run" section'
    blocks = re.findall(r"^```bash\n(.*?)^```", section.group(0), re.M | re.S)
    assert len(blocks) >= 2, "README.md: the set-up section needs two ```bash blocks"
    assert "examples/allreduce.py" in blocks[0] and "tests/run_tests.sh" in blocks[1]


# -- pointers into the documentation resolve -------------------------------------------

sys.path.insert(0, str(ROOT / "docs" / "_ext"))
import pointers  # noqa: E402  (docs/_ext/pointers.py: the one reader of pointers)

POINTER_SUFFIXES = {".py", ".c", ".sh", ".md", ".txt", ".sbatch", ".toml", ".cfg", ".rst"}
# Where pointers are looked for: every text file of these parts of the repository (the
# lead's engine apart, so that a broken pointer there names its own case).
POINTER_SCOPES = {
    "mpicoll/engine": ["mpicoll/engine/**/*"],
    "mpicoll": ["mpicoll/**/*"],
    "benchmarks": ["benchmarks/**/*"],
    "tests": ["tests/**/*"],
    "docs": ["docs/**/*"],
    "jobscripts, examples, the top level": ["jobscripts/**/*", "examples/**/*", "README.md",
                                            "CHANGELOG.md", "setup.cfg", "pyproject.toml",
                                            ".ci/**/*"],
}


def _scope_files(scope: str) -> list[pathlib.Path]:
    found = set()
    for pattern in POINTER_SCOPES[scope]:
        found |= {p for p in ROOT.glob(pattern) if p.is_file()}
    if scope == "mpicoll":
        found = {p for p in found if (ROOT / "mpicoll" / "engine") not in p.parents}
    return sorted(p for p in found if (p.suffix in POINTER_SUFFIXES or p.name == "run")
                  and not {"_build", "__pycache__"} & set(p.parts))


@pytest.mark.parametrize("scope", list(POINTER_SCOPES))
def test_every_pointer_into_the_docs_resolves(scope):
    """Every ``docs/X.md`` (with its quoted section) and every Markdown link ``X.md#anchor``
    names a page and a heading that exist (docs/_ext/pointers.py reads them)."""
    files = _scope_files(scope)
    assert files, scope
    broken = []
    for path in files:
        for p in pointers.find(path.read_text(encoding="utf-8", errors="replace"), path,
                               ROOT / "docs"):
            why = pointers.problem(p)
            if why:
                broken.append(f"{path.relative_to(ROOT)}:{p.line}: {why} ({p.text!r})")
    assert not broken, "pointers into the docs that resolve to nothing:\n" + "\n".join(broken)


def test_the_pointer_reader_finds_what_is_written(tmp_path):
    """Planted pointers, good and broken, in the forms the code writes them."""
    D = "docs"  # (not written out here: this file is read for pointers too)
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "guide.md").write_text("# Guide\n\n## Timeouts (`MPICOLL_TIMEOUT`)\n\n```\n"
                                   "# not a heading\n```\n### Shared memory inside a node\n")
    text = (f'x = 1  # why: {D}/guide.md, "Timeouts (MPICOLL_TIMEOUT)"\n'
            f'# a comment ({D}/guide.md, "Shared\n# memory inside a node") goes on\n'
            f'"""{D}/guide.md ("Not a heading") and {D}/guide.md\'s "not a heading"."""\n'
            f"see {D}/gone.md and {D}/guide.md\n")
    found = pointers.find(text, tmp_path / "x.py", docs)
    assert [(p.line, p.page.name, p.section) for p in found] == [
        (1, "guide.md", "timeouts (mpicoll_timeout)"), (2, "guide.md", "shared memory inside a node"),
        (4, "guide.md", "not a heading"), (4, "guide.md", "not a heading"),
        (5, "gone.md", None), (5, "guide.md", None)]
    assert [pointers.problem(p) for p in found] == [
        None, None, "guide.md has no section 'not a heading'",
        "guide.md has no section 'not a heading'", "no page gone.md", None]
    page = tmp_path / "page.md"
    page.write_text(f"[a]({D}/guide.md#timeouts-mpicoll_timeout) [b]({D}/guide.md#timeouts-mpicoll-timeout) "
                    f"[c]({D}/guide.md#nowhere) [d]({D}/none.md) [e](https://x.invalid/a.md)\n")
    links = pointers.find(page.read_text(), page, docs)
    assert [pointers.problem(p) for p in links] == [
        None, None, "guide.md has no heading with the anchor #nowhere", "no page none.md"]


# -- the guides are for users ----------------------------------------------------------

# What a maintainer's page says and a user's does not: a measurement owed or provisional,
# the development machine, the CI and the device check's procedures (they are on the
# Developing page, docs/developing.md).
MAINTAINERS = re.compile(
    r"\bprovisional\b|\bowed\b|\bquiet machine\b|\b\d+-core (?:VM|machine)\b"
    r"|\bthe development machine\b|\.ci/run|run_device_check|run_slurm_ci|\bchrt\b", re.I)


def user_pages() -> list[pathlib.Path]:
    """The pages of docs/index.md's toctrees but Background and Developing: the guides and
    the reference, in reading order."""
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    found = []
    for caption, body in re.findall(r"```\{toctree\}\n:caption: (.*?)\n(.*?)```", index, re.S):
        if caption not in ("Background", "Developing"):
            found += [ROOT / "docs" / f"{line.strip()}.md" for line in body.splitlines()
                      if line.strip() and not line.startswith(":")]
    return found


def test_the_user_pages_are_the_guides_and_the_reference():
    names = [p.stem for p in user_pages()]
    assert {"install", "tutorial", "gpu", "torch", "api", "options"} <= set(names), names
    assert "developing" not in names and all(p.exists() for p in user_pages())


@pytest.mark.parametrize("path", user_pages(), ids=lambda p: p.name)
def test_a_user_page_holds_no_maintainers_material(path):
    found = [(n, m.group(0)) for n, line in enumerate(prose(path.read_text(encoding="utf-8")), 1)
             for m in MAINTAINERS.finditer(line)]
    assert not found, f"{path.name}: maintainers' material (it goes to docs/developing.md, an " \
        f"open question to CHANGELOG.md): " + "; ".join(f"line {n}: {t!r}" for n, t in found)


def test_gpu_page_states_the_oneshot_limits():
    """docs/gpu.md's one-shot limits under ``intranode=shared`` are engine.select's."""
    from mpicoll.engine import select

    text = " ".join((ROOT / "docs" / "gpu.md").read_text().split())
    host = select.SHARED_FORCED["allreduce"][0][0] >> 10
    assert f"one shot up to {host} KiB, then two shot" in text
    assert f"one shot up to {select.DEVICE_ONESHOT_BYTES >> 10} KiB" in text


def test_gpu_page_states_the_direct_segment():
    """docs/gpu.md's segment of the direct path is algorithms.schedule's."""
    from mpicoll.algorithms import schedule

    text = " ".join((ROOT / "docs" / "gpu.md").read_text().split())
    mib = schedule.DIRECT_SEGMENT_BYTES >> 20
    assert f"The direct path has a segment of its own: {mib} MiB" in text
    assert f"blocks up to {mib} MiB travel whole" in text
