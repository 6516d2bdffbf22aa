"""docs/design.md's "How a call runs", checked against the code and against a traced call.

The page names the concepts that carry a call (a type in one module each),
the modules a first ``mpicoll.allreduce(x, out=o)`` passes through in the
order it enters them, what the set-up of a communicator adds on its very
first call, and the modules of the repeat.  Here the three calls run under
a profiler (``sys.setprofile``) that records every function of mpicoll's
that runs; the tables must name every module that runs and no other, the
first call's and the repeat's in the order they are entered, every function
they name must run, and the repeat must run no function the page does not
name.  Each concept's type must be a class of its module, and the objects a
remembered call runs with (its cache entry and what it refers to) must
include one of each row's types.
"""

from __future__ import annotations

import gc
import importlib
import inspect
import os
import pathlib
import re
import sys
import tempfile

import numpy as np
import pytest
from mpi4py import MPI
from support import util

import mpicoll
from mpicoll.core import config as _config
from mpicoll.engine import cache as _cache
from mpicoll.engine import context as _context
from mpicoll.engine import executor as _executor
from mpicoll.engine import select as _select

# 1: no message (the schedule is a copy, no wait); 2: one exchange; 3: the fold of a
# rank count not a power of two.  The modules and functions a call passes through do
# not change beyond these.
pytestmark = pytest.mark.ranks(1, 2, 3)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "design.md"
PACKAGE = pathlib.Path(mpicoll.__file__).resolve().parent
WORLD = MPI.COMM_WORLD

# the tables, by the heading they follow
CONCEPTS = "## How a call runs"
FIRST = "### The first call"
SETUP = "### The set-up of a communicator"
REPEAT = "### The repeated call"

_CODE = re.compile(r"`([^`]+)`")


# --- the page -------------------------------------------------------------------------

def table(heading: str, text: str | None = None) -> list[list[str]]:
    """The rows (cells as text) of the first Markdown table after the heading that starts
    with ``heading``, header and rule left out."""
    lines = (PAGE.read_text(encoding="utf-8") if text is None else text).splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(heading)]
    assert len(starts) == 1, f"design.md: expected one heading {heading!r}, got {len(starts)}"
    i = starts[0] + 1
    while i < len(lines) and not lines[i].startswith("|"):
        assert not lines[i].startswith("#"), f"design.md: no table under {heading!r}"
        i += 1
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
        i += 1
    assert len(rows) > 2, f"design.md: an empty table under {heading!r}"
    return rows[2:]


def steps(heading: str, text: str | None = None) -> list[tuple[str, list[str]]]:
    """(module, [function, ...]) of each row of a table ``| # | module | functions | ... |``."""
    out = []
    for row in table(heading, text):
        module = _CODE.findall(row[1])
        assert len(module) == 1, f"design.md, {heading!r}: one module per row, got {row[1]!r}"
        functions = _CODE.findall(row[2])
        assert functions, f"design.md, {heading!r}: no function named in {row!r}"
        out.append((module[0], functions))
    return out


def concepts(text: str | None = None) -> list[tuple[str, list[str], str]]:
    """(concept, [type, ...], module) of each row of the concepts table."""
    out = []
    for row in table(CONCEPTS, text):
        module = _CODE.findall(row[2])
        assert len(module) == 1, f"design.md, concepts: one module per row, got {row[2]!r}"
        out.append((row[0].strip("*"), _CODE.findall(row[1]), module[0]))
    return out


# --- the trace ------------------------------------------------------------------------

_QUALNAMES: dict = {}


def _qualname(code) -> str:
    """The qualified name of a code object (``co_qualname`` from Python 3.11; before that,
    looked up among the functions and classes of mpicoll's modules)."""
    name = getattr(code, "co_qualname", None)
    if name is not None:
        return name
    if code not in _QUALNAMES:
        for mod in [m for n, m in sys.modules.items() if n.startswith("mpicoll")]:
            _index(vars(mod).values(), mod.__name__, "")
    return _QUALNAMES.get(code, code.co_name)


def _index(objects, module: str, prefix: str) -> None:
    for obj in objects:
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        elif isinstance(obj, property):
            obj = obj.fget
        if inspect.isfunction(obj) and obj.__module__ == module:
            _nested(obj.__code__, obj.__qualname__)
        elif inspect.isclass(obj) and obj.__module__ == module and \
                obj.__qualname__.startswith(prefix):
            _index(vars(obj).values(), module, obj.__qualname__)


def _nested(code, qualname: str) -> None:
    _QUALNAMES[code] = qualname
    for const in code.co_consts:
        if inspect.iscode(const):
            _nested(const, f"{qualname}.<locals>.{const.co_name}")


class Trace:
    """What ran of mpicoll in a call: ``modules`` in the order first entered, ``functions``
    (module -> qualified names), ``types`` (the classes whose methods ran)."""

    def __init__(self):
        self.modules: list = []
        self.functions: dict = {}
        self.types: set = set()

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(PACKAGE) + os.sep):
            return
        module = pathlib.Path(path).relative_to(PACKAGE).as_posix()
        if module not in self.functions:
            self.modules.append(module)
            self.functions[module] = set()
        self.functions[module].add(_qualname(frame.f_code))
        me = frame.f_locals.get("self")
        if me is not None:
            self.types.add(type(me))


def traced(call) -> Trace:
    """``call()`` under the profiler, with the collector off (an argument of an earlier test
    collected now would make its entry's release run here)."""
    trace = Trace()
    before = sys.getprofile()
    gc.disable()
    sys.setprofile(trace)
    try:
        call()
    finally:
        sys.setprofile(before)
        gc.enable()
    return trace


def ran(trace: Trace, module: str, name: str) -> bool:
    """Whether function (or class) ``name`` of ``module`` ran: itself or a method of it."""
    return any(q == name or q.startswith(name + ".") for q in trace.functions.get(module, ()))


def reached(root) -> set:
    """The classes of mpicoll's objects reachable from ``root`` through their attributes and
    the tuples, lists and dicts they hold."""
    seen, found, todo = set(), set(), [root]
    while todo and len(seen) < 100_000:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        cls = type(obj)
        if isinstance(obj, dict):
            todo += list(obj.values())
            continue
        if cls in (list, tuple):
            todo += list(obj)
            continue
        if not cls.__module__.startswith("mpicoll."):
            continue
        found.add(cls)
        if isinstance(obj, tuple):  # (a NamedTuple: Call, Schedule, Shape, ...)
            todo += list(obj)
        for klass in cls.__mro__:
            for slot in getattr(klass, "__slots__", ()):
                if hasattr(obj, slot) and slot != "__weakref__":
                    todo.append(getattr(obj, slot))
        todo += list(getattr(obj, "__dict__", {}).values())
    return found


# --- the calls ------------------------------------------------------------------------

@pytest.fixture
def defaults(monkeypatch):
    """A program's defaults: no ``MPICOLL_*`` option set, no API setting, no tuning file
    (an empty cache folder, the same path on every rank: the path is part of what the
    ranks compare at set-up), read as a new process reads them."""
    for opt in _config.OPTIONS:
        monkeypatch.delenv(opt.env, raising=False)
    made = tempfile.mkdtemp() if WORLD.Get_rank() == 0 else None
    monkeypatch.setenv("XDG_CACHE_HOME", WORLD.bcast(made))
    _select.reset()
    try:
        yield
    finally:
        monkeypatch.undo()
        _select.reset()
        WORLD.Barrier()
        if made is not None:
            os.rmdir(made)


def run_calls():
    """Trace the very first call on a new communicator, a first call on it with other
    arrays and size, and its repeat once the program is bound; (set-up trace, first trace,
    repeat trace, the classes the remembered call's entry reaches, problems found before
    tracing)."""
    problems = []
    set_options = [o.name for o in _config.OPTIONS if o.api and _config.configured(o.name)]
    if set_options or _executor.IN_FLIGHT:
        problems.append(f"not a program's defaults: options set {set_options}, "
                        f"{len(_executor.IN_FLIGHT)} operation(s) in flight")
    gc.collect()
    comm = WORLD.Dup()
    try:
        rank = comm.Get_rank()
        w, wo = np.full(3, rank + 1.0), np.empty(3)
        x, o = np.arange(8.0) * (rank + 1), np.empty(8)
        setup = traced(lambda: mpicoll.allreduce(w, out=wo, comm=comm))
        first = traced(lambda: mpicoll.allreduce(x, out=o, comm=comm))
        mpicoll.allreduce(x, out=o, comm=comm)  # (its first repeat binds the program)
        repeat = traced(lambda: mpicoll.allreduce(x, out=o, comm=comm))
        n = comm.Get_size()
        if not (np.all(wo == n * (n + 1) / 2) and np.array_equal(o, np.arange(8.0) * wo[0])):
            problems.append("wrong results")
        op = _cache.latest(_context.context(comm), "allreduce")
        entries = [e for e in _context.context(comm).cache.blocking.values() if e.op is op]
        types = reached(entries[0]) if entries else set()
        if not entries:
            problems.append("the first call was not remembered")
        return setup, first, repeat, types | first.types, problems
    finally:
        comm.Free()


def _module_problems(where: str, named: list, trace: Trace, ordered: bool) -> list:
    got = trace.modules
    if ordered and named == got:
        return []
    if not ordered and set(named) == set(got):
        return []
    return [f"{where}: the page names {named}, the call ran {got} "
            f"(not named: {[m for m in got if m not in named]}; named, not run: "
            f"{[m for m in named if m not in got]})"]


def _function_problems(where: str, rows: list, trace: Trace, absent=()) -> list:
    missing = [f"{m}: {f}" for m, fs in rows for f in fs
               if not ran(trace, m, f) and f"{m}: {f}" not in absent]
    return [f"{where}: named, did not run: {missing}"] if missing else []


def test_the_tables_name_what_a_call_runs(defaults):
    """The first call's and the repeat's modules, exactly and in order; the set-up's
    modules beside the first call's, exactly; every function named runs; the repeat runs
    no function the page does not name."""
    setup, first, repeat, _, problems = run_calls()
    first_rows, setup_rows, repeat_rows = steps(FIRST), steps(SETUP), steps(REPEAT)
    first_modules = [m for m, _ in first_rows]
    problems += _module_problems("the first call", first_modules, first, ordered=True)
    problems += _function_problems("the first call", first_rows, first)
    # the set-up: what the very first call runs beyond the first call's modules
    extra = [m for m in setup.modules if m not in first_modules]
    named = [m for m, _ in setup_rows if m not in first_modules]
    if set(extra) != set(named):
        problems.append(f"the set-up: the page names {named} beside the first call's modules, "
                        f"the very first call ran {extra}")
    problems += [f"the set-up: {m} did not run" for m, _ in setup_rows if m not in setup.modules]
    problems += _function_problems("the set-up", setup_rows, setup)
    problems += _module_problems("the repeat", [m for m, _ in repeat_rows], repeat, ordered=True)
    # (one rank: no message, so no wait)
    no_peer = ("engine/executor.py: Operation._waited",) if WORLD.Get_size() == 1 else ()
    problems += _function_problems("the repeat", repeat_rows, repeat, no_peer)
    names = {m: fs for m, fs in repeat_rows}
    unnamed = sorted(f"{m}: {q}" for m, qs in repeat.functions.items() for q in qs
                     if not any(q == f or q.startswith(f + ".<locals>.")
                                for f in names.get(m, ())))
    if unnamed:
        problems.append(f"the repeat: ran, not named: {unnamed}")
    util.assert_all(WORLD, not problems, "\n".join(problems))


def test_each_concept_is_a_type_of_its_module_that_a_call_runs_with(defaults):
    """Each concept's types are classes of the module named beside them, and the objects a
    remembered call runs with include one of each row's types."""
    _, _, _, types, problems = run_calls()
    rows = concepts()
    for concept, names, module in rows:
        mod = importlib.import_module("mpicoll." + module.removesuffix(".py").replace("/", "."))
        classes = [getattr(mod, n, None) for n in names]
        bad = [n for n, c in zip(names, classes)
               if not inspect.isclass(c) or c.__module__ != mod.__name__]
        if not names or bad:
            problems.append(f"{concept}: no class {bad or names} in {module}")
        elif not set(classes) & types:
            problems.append(f"{concept}: none of {names} among the call's objects "
                            f"({sorted(t.__qualname__ for t in types)})")
    util.assert_all(WORLD, not problems, "\n".join(problems))


# --- the reader -----------------------------------------------------------------------

PLANTED = """\
## How a call runs

| concept | type | module | what it is |
|---|---|---|---|
| **Call** | `Call` | `core/types.py` | a record |

### The first call: `f(x)`

| # | module | functions | what happens |
|---|---|---|---|
| 1 | `api/arrays.py` | `allreduce`, `_key` | tries the repeat |
| 2 | `engine/nowhere.py` | `Gone.run` | planted |

### The repeated call

no table here
## Next
"""


@pytest.mark.local
def test_the_reader_finds_what_is_written():
    """The table reader takes the rows of the table under a heading, a module and the
    functions of each, and refuses a heading without a table."""
    assert steps(FIRST, PLANTED) == [("api/arrays.py", ["allreduce", "_key"]),
                                     ("engine/nowhere.py", ["Gone.run"])]
    assert concepts(PLANTED) == [("Call", ["Call"], "core/types.py")]
    with pytest.raises(AssertionError, match="no table"):
        table(REPEAT, PLANTED)
    # the qualified names before Python 3.11 (no co_qualname): as 3.11 names them
    _index(vars(_executor).values(), _executor.__name__, "")
    assert _QUALNAMES[_executor.Operation._run.__code__] == "Operation._run"
    assert _QUALNAMES[_executor.Operation.run.__code__] == "Operation.run"
    assert "on_requests.<locals>.flush" in _QUALNAMES.values()
    if sys.version_info >= (3, 11):
        wrong = {q: c.co_qualname for c, q in _QUALNAMES.items() if q != c.co_qualname}
        assert not wrong, wrong
    trace = Trace()
    trace.functions = {"engine/executor.py": {"Operation.run", "wait_for.<locals>.<lambda>"}}
    assert ran(trace, "engine/executor.py", "Operation")
    assert ran(trace, "engine/executor.py", "wait_for")
    assert not ran(trace, "engine/executor.py", "Operation._run")
    assert not ran(trace, "engine/run.py", "run")
