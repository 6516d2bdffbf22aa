"""One runner: a single loop advances steps, and no collective starts a process.

A collective is an operation bound once (engine.executor.Operation) whose
steps one loop advances, ``Operation._run``.  The package's source is read
(``ast``) for every loop, comprehension or table that dispatches on the
executor's step kinds (``SEND``, ``RECV``, ``WAIT``...): besides that loop
only ``executor.on_requests`` may, which binds steps to persistent requests
once and posts nothing.  A loop over a schedule's ops (``Send``, ``Recv``...)
reads the schedule and posts nothing either.  The package ships no compiled
code, so no loop hides outside the scan.

No subprocess, fork or compiler runs after ``MPI_Init``: a communicator's
set-up and every form of every collective run here with every way of
starting a process made to raise and recorded.
"""

from __future__ import annotations

import _posixsubprocess
import ast
import contextlib
import os
import pathlib
import pty
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from mpi4py import MPI
from support import fakegpu, util

import mpicoll
from mpicoll.backends import cuda as _cuda
from mpicoll.backends import devices as _devices
from mpicoll.engine import select as _select

ROOT = pathlib.Path(__file__).resolve().parents[2] / "mpicoll"
WORLD = MPI.COMM_WORLD

# the ops of a schedule (algorithms/schedule.py)
SCHEDULE_OPS = frozenset({"Send", "Recv", "Wait", "Reduce", "Copy", "Fold"})
# what moves or completes messages: a call of a method of these names (a channel's or
# MPI's; a schedule builder's ``send``/``recv``/``wait`` only write ops)
POSTS = frozenset({"isend", "irecv", "waitall", "testall", "Isend", "Irecv", "Send", "Recv",
                   "Sendrecv", "Start", "Startall", "Wait", "Waitall", "Waitany", "Waitsome",
                   "Test", "Testall", "Testany", "Testsome"})
# the functions whose loops may dispatch on step kinds: the loop that runs steps, and the
# binding of steps to persistent requests (made once, run by that loop)
RUNNER = "engine/executor.py:Operation._run"
BINDER = "engine/executor.py:on_requests"


# --- the scan -------------------------------------------------------------------------

def step_kinds(root: pathlib.Path = ROOT) -> frozenset:
    """The names of the step kinds: the targets of executor.py's ``SEND, RECV, ... = range(n)``."""
    tree = ast.parse((root / "engine" / "executor.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple) \
                and isinstance(node.value, ast.Call) \
                and getattr(node.value.func, "id", None) == "range":
            names = frozenset(e.id for e in node.targets[0].elts if isinstance(e, ast.Name))
            if {"SEND", "RECV", "WAIT"} <= names:
                return names
    raise AssertionError("engine/executor.py defines no step kinds (SEND, RECV, ... = range(n))")


# the patterns of a match statement (Python 3.10+)
_PATTERNS = tuple(getattr(ast, n) for n in ("MatchValue", "MatchClass") if hasattr(ast, n))
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


def _names(node) -> set:
    """Every name a node mentions, bare or as an attribute (``SEND``, ``_executor.SEND``)."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


def _inside(loop):
    """The nodes of a loop's body (its test, its elements and conditions), not those of the
    functions and classes defined in it."""
    todo = [c for c in ast.iter_child_nodes(loop)]
    while todo:
        node = todo.pop()
        yield node
        todo += [c for c in ast.iter_child_nodes(node) if not isinstance(c, _SCOPES)]


def _dispatch(nodes, names) -> set:
    """Which of ``names`` the nodes compare against, test by ``isinstance`` or match on."""
    found = set()
    for node in nodes:
        if isinstance(node, ast.Compare):
            found |= _names(node) & names
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" \
                and len(node.args) == 2:
            found |= _names(node.args[1]) & names
        elif _PATTERNS and isinstance(node, _PATTERNS):
            found |= _names(node) & names
    return found


def _posts(nodes) -> set:
    """The message calls among the nodes (``ch.isend(...)``, ``req.Wait()``...)."""
    return {n.func.attr for n in nodes if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute) and n.func.attr in POSTS}


class _Scan(ast.NodeVisitor):
    def __init__(self, where, kinds):
        self.where, self.kinds, self.scope = where, kinds, []
        self.by_kind: dict = {}  # function -> what its dispatching loops post
        self.by_op: dict = {}    # function -> what its loops over schedule ops post

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _function(self):
        return f"{self.where}:{'.'.join(self.scope) or '<module>'}"

    def _loop(self, node):
        inside = list(_inside(node))
        posts = _posts(inside)
        if len(_dispatch(inside, self.kinds)) >= 2:
            self.by_kind.setdefault(self._function(), set()).update(posts)
        if len(_dispatch(inside, SCHEDULE_OPS)) >= 2:
            self.by_op.setdefault(self._function(), set()).update(posts)
        self.generic_visit(node)

    visit_For = visit_AsyncFor = visit_While = _loop
    visit_ListComp = visit_SetComp = visit_DictComp = visit_GeneratorExp = _loop

    def visit_Dict(self, node):
        # a table keyed by step kinds dispatches as an if-chain does
        if len(_names(ast.Tuple([k for k in node.keys if k is not None], ast.Load()))
               & self.kinds) >= 2:
            self.by_kind.setdefault(self._function(), set())
        self.generic_visit(node)


def scan(root: pathlib.Path = ROOT, kinds=None) -> tuple[dict, dict]:
    """(function -> message calls of its loops that dispatch on step kinds, function -> those
    of its loops that dispatch on schedule ops) over every module under ``root``."""
    kinds = step_kinds(root) if kinds is None else kinds
    by_kind, by_op = {}, {}
    for path in sorted(root.rglob("*.py")):
        v = _Scan(path.relative_to(root).as_posix(), kinds)
        v.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        by_kind.update(v.by_kind)
        by_op.update(v.by_op)
    return by_kind, by_op


# --- one loop -------------------------------------------------------------------------

@pytest.mark.local
def test_one_loop_advances_steps():
    """Only ``Operation._run`` dispatches on step kinds and posts messages; the binding to
    persistent requests is the one other dispatch, and posts nothing; loops over a
    schedule's ops post nothing."""
    by_kind, by_op = scan()
    assert sorted(by_kind) == sorted([RUNNER, BINDER]), (
        f"loops that dispatch on step kinds: {sorted(by_kind)}; the one loop that advances "
        f"steps is {RUNNER} (docs/design.md, \"The progress rule\")")
    assert by_kind[RUNNER] >= {"isend", "irecv"}, by_kind[RUNNER]
    assert not by_kind[BINDER], f"{BINDER} posts {by_kind[BINDER]}: it binds, runs nothing"
    posting = {f: p for f, p in by_op.items() if p}
    assert not posting, f"loops over schedule ops that move messages: {posting}"


@pytest.mark.local
def test_no_compiled_code_ships():
    """No C, C++, Cython or built extension in the package: every loop is in the scan."""
    found = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                   if p.suffix in {".c", ".cc", ".cpp", ".h", ".pyx", ".pxd", ".so", ".pyd"})
    assert not found, f"compiled code in mpicoll/: {found}"


PLANTED = {
    "engine/executor.py": "SEND, RECV, WAIT, REDUCE, COPY, CALL, AFTER, FOLD = range(8)\n",
    "engine/second.py": """
        from .executor import RECV, SEND, WAIT

        def if_chain(steps, ch):
            for step in steps:
                if step[0] == SEND:
                    ch.isend(step[1], step[2])
                elif step[0] is RECV:
                    ch.irecv(step[1], step[2])

        def through_the_module(op):
            i = 0
            while i < len(op.steps):
                k = op.steps[i][0]
                if k in (_executor.SEND, _executor.WAIT):
                    op.go(i)
                i += 1

        def comprehension(steps):
            return [s[1].Start if s[0] == SEND else s[1].Wait if s[0] == WAIT else s[1]
                    for s in steps]

        def table(mod):
            return {SEND: mod.post, RECV: mod.post, WAIT: mod.wait}

        def one_kind_only(steps):
            return [s for s in steps if s[0] == WAIT]
        """,
    "engine/third.py": """
        def matched(steps, ch):
            for step in steps:
                match step[0]:
                    case _executor.SEND:
                        ch.isend(step[1])
                    case _executor.RECV:
                        ch.irecv(step[1])
        """,
    "algorithms/reader.py": """
        def count(sched):
            for op in sched.ops:
                if type(op) is Send:
                    n += 1
                elif isinstance(op, Recv):
                    n -= 1

        def run_ops(sched, ch):
            for op in sched.ops:
                if type(op) is Send:
                    ch.isend(op.region)
                elif type(op) is Wait:
                    ch.waitall(op.handles)
        """,
}


@pytest.mark.local
def test_the_scan_finds_a_second_loop(tmp_path):
    """Planted: loops that dispatch on step kinds (an if-chain, through the executor module,
    a comprehension, a table keyed by kinds, a match), and a loop that runs a schedule's
    ops; a loop on one kind, and one that reads ops, are none."""
    for name, text in PLANTED.items():
        if name == "engine/third.py" and sys.version_info < (3, 10):
            continue  # (no match statement before Python 3.10)
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(textwrap.dedent(text))
    by_kind, by_op = scan(tmp_path)
    assert by_kind == {"engine/second.py:if_chain": {"isend", "irecv"},
                       "engine/second.py:through_the_module": set(),
                       "engine/second.py:comprehension": set(),
                       "engine/second.py:table": set(),
                       **({"engine/third.py:matched": {"isend", "irecv"}}
                          if sys.version_info >= (3, 10) else {})}
    assert by_op == {"algorithms/reader.py:count": set(),
                     "algorithms/reader.py:run_ops": {"isend", "waitall"}}


# --- no process -----------------------------------------------------------------------

# every way Python starts a process: (module, function)
STARTS = [(os, name) for name in (
    "fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "execv", "execve",
    "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnl",
    "spawnle", "spawnlp", "spawnlpe", "spawnvp", "spawnvpe")] + [
    (subprocess, "Popen"), (subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"),
    (pty, "fork")]
# their audit events: a start through a name bound before the patch is still seen
EVENTS = frozenset({"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn",
                    "os.spawn", "subprocess.Popen"})
_WATCH: list = []  # while refusing: the list starts are recorded in
_HOOKED: list = []


def _audit(event, args):
    if _WATCH and event in EVENTS:
        _refused(event)


def _refused(what):
    _WATCH[-1].append(what)
    # (said at once: a start on one rank only leaves its peers waiting until the timeout)
    print(f"rank {WORLD.Get_rank()}: {what} after MPI_Init", file=sys.stderr, flush=True)
    raise RuntimeError(f"{what}: a process started after MPI_Init")


@contextlib.contextmanager
def refusing_processes():
    """A block in which every way of starting a process raises; yields the list of the
    starts tried."""
    if not _HOOKED:  # (an audit hook stays for the process: it only looks while watching)
        sys.addaudithook(_audit)
        _HOOKED.append(True)
    started: list = []

    def refuse(name):
        def start(*args, **kwargs):
            _refused(name)
        return start

    with pytest.MonkeyPatch.context() as mp:
        for owner, name in STARTS:
            if hasattr(owner, name):
                mp.setattr(owner, name, refuse(f"{owner.__name__}.{name}"))
        _WATCH.append(started)
        try:
            yield started
        finally:
            _WATCH.pop()


def _arrays(collective, n, rank, make=np.array, empty=np.empty, k=4):
    """(input, output) of a call of ``collective`` with ``k`` elements per rank's block."""
    if collective == "allgather":
        return make(np.arange(k, dtype=np.float64) + rank), empty(k * n)
    x = make(np.arange(k * n, dtype=np.float64) * (rank + 1))
    return x, empty(k * n if collective == "allreduce" else k)


FUNCTIONS = {"allreduce": (mpicoll.allreduce, mpicoll.iallreduce),
             "reduce_scatter": (mpicoll.reduce_scatter, mpicoll.ireduce_scatter),
             "allgather": (mpicoll.allgather, mpicoll.iallgather)}


def _every_form(comm, monkeypatch):
    """A new communicator's set-up, then every collective in every form on it."""
    n, rank = comm.Get_size(), comm.Get_rank()
    mc = mpicoll.Comm(comm.Dup())  # (its set-up is the first call's)
    try:
        # the array functions: every algorithm, blocking and non-blocking, each twice
        # (the second a repeat), in place
        for collective, (blocking, nonblocking) in FUNCTIONS.items():
            for algorithm in ("auto",) + tuple(_select.names(collective)):
                x, out = _arrays(collective, n, rank)
                for _ in range(2):
                    blocking(x, out=out, comm=mc, algorithm=algorithm)
                    nonblocking(x, out=out, comm=mc, algorithm=algorithm).wait()
            x, out = _arrays(collective, n, rank)
            whole = out if collective == "allgather" else x  # (in place: the whole buffer)
            blocking(whole, out=whole, comm=mc)
            nonblocking(whole, out=whole, comm=mc).wait()
        # mpicoll.Comm as mpi4py's drop-in: blocking, non-blocking, persistent, in place,
        # specs, vector forms, a derived datatype
        x, y = np.arange(4.0 * n) + rank, np.empty(4 * n)
        block, whole = np.empty(4), np.empty(4 * n)
        for _ in range(2):
            mc.Allreduce(x, y)
            mc.Allreduce([x, MPI.DOUBLE], [y, MPI.DOUBLE])
            mc.Allgather(block, whole)
            mc.Reduce_scatter_block(x, block)
            mc.Iallreduce(x, y).Wait()
            mc.Iallgather(block, whole).Wait()
            mc.Ireduce_scatter_block(x, block).Wait()
        mc.Allreduce(MPI.IN_PLACE, y)
        mc.Allgatherv(block, [whole, [4] * n])
        mc.Reduce_scatter(x, block, [4] * n)
        pair = MPI.DOUBLE.Create_contiguous(2).Commit()
        try:
            mc.Allreduce([x, 2 * n, pair], [y, 2 * n, pair])
        finally:
            pair.Free()
        mixed = MPI.Datatype.Create_struct([1, 1], [0, 8], [MPI.DOUBLE, MPI.INT]).Commit()
        try:  # (MPI's own collective runs it: api.delegate)
            mc.Allgather([np.zeros(16, np.uint8), 1, mixed], [np.zeros(16 * n, np.uint8), 1, mixed])
        finally:
            mixed.Free()
        for request in (mc.Allreduce_init(x, y), mc.Allgather_init(block, whole),
                        mc.Reduce_scatter_block_init(x, block)):
            for _ in range(2):
                request.Start()
                request.Wait()
            request.Free()
        # observed: the fingerprint check, a deadline, a trace, a traffic counter
        with mpicoll.options(check=True, timeout=60.0), mpicoll.traffic(), \
                mpicoll.trace(comm=mc):
            mpicoll.allreduce(x, out=y, comm=mc)
            mpicoll.iallreduce(x, out=y, comm=mc).wait()
            mc.Allreduce(x, y)
        # a sub-communicator: its own set-up
        sub = mc.Split(rank % 2, rank)
        sub.Allreduce(x, y)
        sub.Free()
    finally:
        mc.Free()
    # fake nodes: the hierarchical algorithms and a pipeline (a large call across nodes)
    nodes = comm.Dup()
    try:
        big = np.ones(1 << 18)  # 2 MiB of float64: a pipeline
        monkeypatch.setenv("MPICOLL_FAKE_NODES", "cyclic:2")  # (read by the set-up)
        mpicoll.allreduce(big, out=np.empty_like(big), comm=nodes)
        monkeypatch.delenv("MPICOLL_FAKE_NODES")
        for algorithm in ("hierarchical", "rabenseifner"):
            mpicoll.allreduce(big, out=np.empty_like(big), comm=nodes, algorithm=algorithm)
    finally:
        nodes.Free()
    # device arrays on the fake GPU: staged whole, staged per message, direct
    be = fakegpu.fake_backend()
    rt = be.rt
    for aware, whole in ((False, True), (False, False), (True, False)):
        monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 1 << 30 if whole else 0)
        with fakegpu.registered(be), mpicoll.options(cuda_aware=aware):
            for collective, (blocking, nonblocking) in FUNCTIONS.items():
                x, out = _arrays(collective, n, rank, lambda h: fakegpu.produce(rt, h),
                                 lambda m: rt.xp.empty(m, np.float64))
                blocking(x, out=out, comm=comm)
                nonblocking(x, out=out, comm=comm).wait()


# 1: the set-up without an exchange, no message; 2 and 3: the exchanges, node memory of
# two and three ranks, fake nodes of one and two ranks.
@pytest.mark.ranks(1, 2, 3)
@pytest.mark.timeout(300)
def test_no_process_starts_in_a_collective(monkeypatch):
    """A new communicator's set-up and every collective in every form (blocking,
    non-blocking, persistent, mpicoll.Comm's drop-in, in place; every algorithm; observed;
    across fake nodes; device arrays on a fake GPU) on every rank, with every way of
    starting a process (subprocess, fork, posix_spawn, system, exec, spawn) raising:
    none was tried.  (The one child job, ``python -m mpicoll.info --probe``'s, starts at
    import, before MPI_Init, in that command only: not in this one.)"""
    problems = []
    if _cuda.early_probe() is not None:
        problems.append(f"importing mpicoll ran the probe job: {_cuda.early_probe()}")
    comm = WORLD.Dup()
    try:
        with refusing_processes() as started:
            try:
                _every_form(comm, monkeypatch)
            except Exception as exc:  # (a refused start raises in the call that tried it)
                problems.append(f"{type(exc).__name__}: {exc}")
    finally:
        comm.Free()
    problems += [f"started: {what}" for what in started]
    util.assert_all(WORLD, not problems, "\n".join(problems))


@pytest.mark.local
def test_refusing_processes_refuses_each_way():
    """In the block, each way of starting a process raises and is recorded, also through a
    name bound before the block (seen by its audit event); after it, nothing is."""
    popen, fork = subprocess.Popen, os.fork  # (bound before: the audit hook sees popen)
    with refusing_processes() as started:
        for start in (lambda: subprocess.run(["true"]), lambda: os.system("true"),
                      lambda: os.posix_spawn("/bin/true", ["true"], {}),
                      lambda: os.execv("/bin/true", ["true"]), lambda: popen(["true"]),
                      os.fork):
            with pytest.raises(RuntimeError, match="after MPI_Init"):
                start()
    assert started == ["subprocess.Popen", "os.system", "os.posix_spawn", "os.execv",
                       "subprocess.Popen", "os.fork"]
    assert subprocess.Popen is popen and os.fork is fork
