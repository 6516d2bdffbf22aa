"""Helpers shared by mpicoll's test files (``from support import util``).

Rules every MPI test follows (the suite runs under ``mpirun -n 1..5``):

* Every rank runs the same tests in the same order: skip conditions depend on
  the rank count, never on the rank.
* A test calls every collective on every rank, even when an earlier check
  failed on one rank: collect local results, then decide together with
  :func:`assert_all` / :func:`assert_case`, so all ranks pass or fail together
  and the next test does not hang on a rank that left early.
* Expected values are functions of rank and size, or the exact reference of
  the same input judged by :mod:`mpicoll.tools.results` (one tolerance rule).

Tests that start ``mpirun`` themselves live in ``tests/launch/``;
conftest.py leaves them out under an MPI launcher, and ``tests/run_tests.sh``
runs them once with plain pytest.  :func:`launcher` and :func:`mpirun_cmd`
build their command lines.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]  # the repository

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
SIZE = WORLD.Get_size()

# Environment variables an MPI launcher sets in the processes it starts.
LAUNCHER_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MPI_LOCALNRANKS")


def under_launcher() -> bool:
    """Whether this process was started by mpirun/mpiexec/srun (even with one rank)."""
    return any(v in os.environ for v in LAUNCHER_VARS)


# ---------------------------------------------------------------------------
# Communicators
# ---------------------------------------------------------------------------

COMM_KINDS = ("world", "dup", "split_parity", "split_reversed")


def make_comms(world=WORLD) -> dict:
    """The communicators every collective is tested on (collective over ``world``).

    world            ``world`` itself
    dup              ``world.Dup()``
    split_parity     ``world.Split(rank % 2)``: two halves, ranks in order
    split_reversed   ``world.Split(0, key=size - rank)``: every rank, order reversed
    """
    rank, size = world.Get_rank(), world.Get_size()
    return {
        "world": world,
        "dup": world.Dup(),
        "split_parity": world.Split(rank % 2, rank),
        "split_reversed": world.Split(0, size - rank),
    }


def free_comms(comms: dict) -> None:
    """Free what :func:`make_comms` created (collective)."""
    for kind, comm in comms.items():
        if kind != "world" and comm != MPI.COMM_NULL:
            comm.Free()


# ---------------------------------------------------------------------------
# Collective assertions
# ---------------------------------------------------------------------------


def assert_all(comm, ok, message: str = "") -> None:
    """Fail on every rank if ``ok`` is false on any rank (collective over ``comm``).

    The failure lists each failing rank's message.
    """
    results = comm.allgather((bool(ok), str(message)))
    bad = [f"rank {r}: {m}" for r, (good, m) in enumerate(results) if not good]
    if bad:
        pytest.fail("\n".join(bad), pytrace=False)


def assert_case(result) -> None:
    """Fail if a :func:`mpicoll.tools.verify.run_case` result is not ok (it is the same on every rank)."""
    if not result.ok:
        pytest.fail(result.report(), pytrace=False)


def check_cases(comm, run) -> None:
    """Run ``run()`` -> iterable of (label, CaseResult); fail once with every failing label."""
    bad = [f"{label}: {res.report()}" for label, res in run if not res.ok]
    if bad:
        shown = bad[:10] + ([f"... and {len(bad) - 10} more"] if len(bad) > 10 else [])
        pytest.fail(f"{len(bad)} case(s) failed:\n" + "\n".join(shown), pytrace=False)


def share(cases) -> list:
    """This MPI rank's share of ``cases`` (every size-th one): a file of simulated cases then
    takes the same time at any rank count."""
    return [c for i, c in enumerate(cases) if i % SIZE == RANK]


def same_bytes(a, b) -> bool:
    """Whether two host arrays hold bitwise the same values (padding ignored)."""
    from mpicoll.tools.results import same_values
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.hasobject or b.dtype.hasobject:  # Python objects: no bytes to compare
        return a.shape == b.shape and a.tolist() == b.tolist()
    return same_values(a, b)


def spy(monkeypatch, owner, names, calls=None) -> list:
    """Wrap the functions ``names`` of ``owner`` (a module or class) so that each call
    appends its name to ``calls`` (a new list by default), which is returned."""
    calls = [] if calls is None else calls
    for name in names:
        real = getattr(owner, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapper)
    return calls


# ---------------------------------------------------------------------------
# "Raises before any message"
# ---------------------------------------------------------------------------


class MessageSent(AssertionError):
    """Raised when mpicoll sends or receives inside :func:`no_messages`."""


@contextlib.contextmanager
def no_messages(comm):
    """Fail if mpicoll starts a collective or moves a message on ``comm`` inside the block.

    mpicoll's point-to-point channel (``isend``/``irecv``, which
    every algorithm moves its data through) is patched to raise
    :class:`MessageSent` at the first send or receive (before MPI is called, so a wrongly accepted
    call raises on every rank instead of hanging), and the communicator's
    collective counter (``ctx.seq``) must not move.  Creates mpicoll's context
    for ``comm`` first, which is collective.
    """
    from mpicoll.engine import context as _context
    from mpicoll.transport import channel as _channel

    ctx = _context.context(comm)
    seq = ctx.seq
    saved = {name: getattr(_channel.Channel, name) for name in ("isend", "irecv")}

    def refuse(self, *args, **kwargs):
        raise MessageSent("mpicoll moved a message although the call should have been refused")

    raised = None
    try:
        for name in saved:
            setattr(_channel.Channel, name, refuse)
        yield
    except BaseException as exc:
        raised = exc
        raise
    finally:
        for name, fn in saved.items():
            setattr(_channel.Channel, name, fn)
        if ctx.seq != seq:  # replaces the exception in flight, if any
            raise MessageSent(
                f"a collective started on the communicator (call counter {seq} -> {ctx.seq})"
            ) from raised


def raises_everywhere(comm, exc_type, match: str, fn, *buffers) -> None:
    """``fn()`` must raise ``exc_type`` matching ``match`` on every rank, send nothing, touch nothing.

    Args:
        comm: the communicator the call would use (checked for messages).
        exc_type: expected exception class (exactly this class or a subclass).
        match: regular expression searched in the message (``re.search``).
        fn: the call.
        buffers: NumPy arrays (or bytearrays) that must be unchanged afterwards.
    """
    before = [np.array(np.asarray(b), copy=True) for b in buffers]
    problem = ""
    try:
        with no_messages(comm):
            fn()
        problem = f"no exception (expected {exc_type.__name__} matching {match!r})"
    except MessageSent as exc:
        problem = str(exc)
    except Exception as exc:  # checked against exc_type below
        if not isinstance(exc, exc_type):
            problem = f"raised {type(exc).__name__}: {exc} (expected {exc_type.__name__})"
        elif not re.search(match, str(exc)):
            problem = f"message {str(exc)!r} does not match {match!r}"
    for i, (b, old) in enumerate(zip(buffers, before)):
        if not same_bytes(np.asarray(b), old):
            problem += f"; buffer {i} was modified"
    assert_all(comm, not problem, problem)


# ---------------------------------------------------------------------------
# Launching MPI jobs from a test (tests/launch/)
# ---------------------------------------------------------------------------


def mpi_flavour(launcher_path: str | None = None) -> str | None:
    """"openmpi" or "mpich": from the launcher's --version, else from the MPI library in use."""
    text = ""
    if launcher_path:
        try:
            text = subprocess.run([launcher_path, "--version"], capture_output=True, text=True,
                                  timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            text = ""
    else:
        text = MPI.Get_library_version()
    if re.search(r"Open MPI|OpenRTE|PRRTE", text):
        return "openmpi"
    if re.search(r"HYDRA|MPICH|Intel\(R\) MPI", text):
        return "mpich"
    return None


def launcher() -> tuple[str, str]:
    """(path, flavour) of mpirun/mpiexec next to this Python (the venv's MPI), else on PATH.

    Skips the calling test when there is none.
    """
    here = Path(sys.executable).parent
    candidates = [str(here / name) for name in ("mpirun", "mpiexec")]
    candidates += [shutil.which(name) for name in ("mpirun", "mpiexec")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            flavour = mpi_flavour(path)
            if flavour:
                return path, flavour
    pytest.skip("no Open MPI or MPICH mpirun/mpiexec next to the Python or on PATH")


def mpirun_cmd(nranks: int, args, launch=None) -> tuple[list[str], dict]:
    """(argv, env) to run ``python *args`` on ``nranks`` ranks (oversubscribing, root allowed)."""
    path, flavour = launch or launcher()
    cmd = [path, "-n", str(nranks)]
    env = dict(os.environ)
    if flavour == "openmpi":
        cmd.append("--oversubscribe")
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return cmd + [sys.executable, *map(str, args)], env


def run_job(cmd, env, limit: float) -> subprocess.CompletedProcess:
    """Run a launcher command in a session of its own; on ``limit`` seconds kill the job and fail.

    Killing the process group ends every rank the launcher started, so a
    hung job cannot outlive the test.
    """
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} did not finish in {limit} s\n"
                    f"--- stdout\n{out}\n--- stderr\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def benchmark(name: str):
    """The measurement script ``benchmarks/<name>.py`` as a module (the scripts live
    beside the package, not in it: a user runs ``python benchmarks/<name>.py``).
    Loaded once per process, so a test's ``monkeypatch`` of it holds for its ``main``."""
    key = f"benchmarks.{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def as_function(collective: str, build):
    """The schedule builder ``build`` as a function of the classic algorithm signature.

    ``allreduce``: ``fn(ctx, ch, be, red, src, dst)``, in place when ``src is dst``;
    ``reduce_scatter``: ``fn(ctx, ch, be, red, src, dst, counts, displs)``, in place when
    ``src`` and ``dst`` share memory; ``allgather``: ``fn(ctx, ch, be, src, dst, counts,
    displs)``, in place when ``src`` is None.  Each call builds the schedule of its shape
    and runs it to the end with ``executor.run_on`` (tests drive algorithms on simulated
    channels this way).
    """
    from mpicoll.engine.executor import run_on, shape_of

    if collective == "allreduce":
        def fn(ctx, ch, be, red, src, dst):
            shape = shape_of(ctx, len(dst), (len(dst),), (0,), dst.dtype.itemsize, src is dst)
            run_on(build(shape), ctx, ch, be, red, src, dst)
    elif collective == "reduce_scatter":
        def fn(ctx, ch, be, red, src, dst, counts, displs):
            shape = shape_of(ctx, sum(counts), tuple(counts), tuple(displs), src.dtype.itemsize,
                             bool(np.shares_memory(src, dst)))
            run_on(build(shape), ctx, ch, be, red, src, dst)
    else:
        def fn(ctx, ch, be, src, dst, counts, displs):
            shape = shape_of(ctx, sum(counts), tuple(counts), tuple(displs), dst.dtype.itemsize,
                             src is None)
            run_on(build(shape), ctx, ch, be, None, src, dst)
    return fn


def algorithm_functions(collective: str) -> dict:
    """{name: :func:`as_function` of its builder} for every algorithm of ``collective`` that
    runs on messages alone (the shared algorithms read node memory, which only the engine's
    calls map: tests/engine/test_shared.py runs them through the API)."""
    from mpicoll.engine import intranode, select
    return {name: as_function(collective, build)
            for name, build in select.BUILDERS[collective].items()
            if name not in intranode.ALGORITHMS}


class env_options:
    """``monkeypatch``'s setenv/delenv for ``MPICOLL_*`` variables, read again at once.

    mpicoll reads its options when a communicator's context is created; a test
    that changes a process-wide option (cuda_aware, progress, trace) in the
    environment reads it again here, as a new communicator would.
    """

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def setenv(self, name, value):
        from mpicoll.core import config
        self.monkeypatch.setenv(name, value)
        try:
            config.read_environment()
        except ValueError:  # a bad value: the option raises when it is used
            pass

    def delenv(self, name, raising=False):
        from mpicoll.core import config
        self.monkeypatch.delenv(name, raising=raising)
        config.read_environment()
