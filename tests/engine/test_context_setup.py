"""Creating mpicoll's per-communicator state: options checked first, nothing leaked.

The first collective on a communicator builds its context (a private
duplicate, the ring order).  A bad option must be refused before any MPI call
on the communicator, so refused calls create nothing: thousands of them leave
the communicator (and MPI's supply of communicator ids) intact.  Runs under an
MPI launcher at any rank count.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll
from mpicoll.engine import context as _context

# context creation: 1 rank and 2 (a peer that misses or is late)
pytestmark = [pytest.mark.timeout(300), pytest.mark.ranks(1, 2)]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


class CountingComm(MPI.Intracomm):
    """The same communicator, counting the calls that would create a new one.

    (mpi4py builds the communicators these calls return as the same class,
    without ``__init__``: those do not count.)
    """

    def __init__(self, comm):  # mpi4py's __new__ takes the handle from ``comm``
        self.created = []

    def _note(self, what):
        if "created" in self.__dict__:
            self.created.append(what)

    def Dup(self, *args, **kwargs):
        self._note("Dup")
        return super().Dup(*args, **kwargs)

    def Idup(self, *args, **kwargs):
        self._note("Idup")
        return super().Idup(*args, **kwargs)

    def Split_type(self, *args, **kwargs):
        self._note("Split_type")
        return super().Split_type(*args, **kwargs)


BAD_OPTIONS = [
    ("MPICOLL_SEGMENT_BYTES", "lots"),
    ("MPICOLL_SEGMENT_BYTES", "0"),
    ("MPICOLL_WINDOW", "0"),
    ("MPICOLL_WINDOW", "65"),
    ("MPICOLL_NODE_PIECE_BYTES", "0"),
    ("MPICOLL_FAKE_NODES", "ring:2"),
    ("MPICOLL_TIMEOUT", "soon"),
    ("MPICOLL_CHECK", "maybe"),
]


@pytest.mark.parametrize("var, value", BAD_OPTIONS)
def test_bad_option_refused_before_any_mpi_call(var, value, monkeypatch):
    """The refusal names the variable; no communicator is created, no context is cached."""
    base = WORLD.Dup()
    comm = CountingComm(base)
    monkeypatch.setenv(var, value)
    problem = ""
    calls = [lambda: mpicoll.allreduce(rank_data(6, RANK), comm=comm),
             lambda: mpicoll.Comm(comm).Allreduce(rank_data(6, RANK), np.empty(6))]
    if var != "MPICOLL_TIMEOUT":  # (an argument wins over the variable)
        calls.append(lambda: mpicoll.allreduce(rank_data(6, RANK), comm=comm, timeout=30.0))
    for call in calls:
        try:
            call()
            problem += f"{var}={value!r} accepted; "
        except ValueError as exc:
            if var not in str(exc):
                problem += f"message does not name {var}: {exc}; "
    if comm.created:
        problem += f"MPI calls before the refusal: {comm.created}; "
    if _context._KEYVAL is not None and base.Get_attr(_context._KEYVAL) is not None:
        problem += "a context was cached on the communicator; "
    monkeypatch.delenv(var)
    # the communicator works once the option is fixed
    y = mpicoll.allreduce(rank_data(7, RANK), comm=comm)
    ref = np.empty(7)
    WORLD.Allreduce(rank_data(7, RANK), ref)
    if not np.array_equal(y, ref):
        problem += "wrong result after the refusals; "
    util.assert_all(WORLD, not problem, problem)
    base.Free()


def test_thousands_of_refused_calls_leak_nothing(monkeypatch):
    """3000 refusals (MPICH runs out of communicator ids after ~2000 leaked dups)."""
    comm = WORLD.Dup()
    problem = ""
    for var, value in (("MPICOLL_WINDOW", "0"), ("MPICOLL_SEGMENT_BYTES", "-1")):
        monkeypatch.setenv(var, value)
        refused = 0
        for _ in range(1500):
            try:
                mpicoll.allreduce(rank_data(4, RANK), comm=comm, algorithm="ring")
            except ValueError:
                refused += 1
        if refused != 1500:
            problem += f"{var}={value}: {refused} of 1500 refused; "
        monkeypatch.delenv(var)
    # the communicator, and new ones, still work
    ref = np.empty(5)
    WORLD.Allreduce(rank_data(5, RANK), ref)
    ok = np.array_equal(mpicoll.allreduce(rank_data(5, RANK), comm=comm), ref)
    fresh = WORLD.Dup()
    ok = ok and np.array_equal(mpicoll.allreduce(rank_data(5, RANK), comm=fresh), ref)
    fresh.Free()
    if not ok:
        problem += "wrong result after the refusals; "
    util.assert_all(WORLD, not problem, problem)
    comm.Free()


# -- a rank missing from the first call: the set-up itself times out --------------------------
SKIPPER = 1
T = 0.5          # timeout (seconds)
MARGIN = 4.0     # allowed lateness on an oversubscribed, shared machine


def _first_call(comm, timeout=T):
    """(CollectiveTimeout or None, seconds) of this rank's first allreduce on ``comm``."""
    t0 = time.perf_counter()
    try:
        mpicoll.allreduce(rank_data(1000, RANK), comm=comm, algorithm="ring", timeout=timeout)
    except mpicoll.CollectiveTimeout as exc:
        return exc, time.perf_counter() - t0
    return None, time.perf_counter() - t0


def _check_setup_timeout(exc, elapsed, comm) -> str:
    """What is wrong with a set-up timeout and the communicator it leaves ('' if nothing)."""
    if exc is None:
        return "no CollectiveTimeout; "
    problem = ""
    msg = str(exc)
    for part in (f"allreduce #1 (ring, 1000 x float64) on rank {comm.Get_rank()}: no progress for ",
                 f"(timeout {T:g} s) while setting up mpicoll on this communicator, ",
                 "mpicoll.abort()"):
        if part not in msg:
            problem += f"{part!r} missing from {msg!r}; "
    if (exc.phase, exc.seq, exc.collective, exc.algorithm, exc.timeout) != (
            "setup", 1, "allreduce", "ring", T):
        problem += f"attributes {exc.phase} {exc.seq} {exc.collective} {exc.algorithm}; "
    if not T <= elapsed <= T + MARGIN:
        problem += f"raised after {elapsed:.2f} s, expected {T} s; "
    # refused afterwards, at once and without any MPI call
    t0 = time.perf_counter()
    try:
        mpicoll.allreduce(rank_data(3, RANK), comm=comm, timeout=T)
        problem += "a later call was accepted; "
    except mpicoll.MpicollError as e:
        if "communicator unusable: allreduce #1 timed out on rank" not in str(e):
            problem += f"unexpected refusal: {e}; "
    if time.perf_counter() - t0 > T / 2:
        problem += "the refusal waited; "
    return problem


def _settle(comm_pairs):
    """Let the missing ranks join the pending Idups, then check the abandoned duplicates are freed.

    ``comm_pairs``: [(communicator, whether this rank's set-up on it is pending)].
    """
    reqs = []
    for comm, pending in comm_pairs:
        if not pending:
            dup, req = comm.Idup()  # what the missing rank's set-up would have started
            reqs.append((dup, req))
    MPI.Request.Waitall([r for _, r in reqs])
    for dup, _ in reqs:
        dup.Free()
    deadline = time.perf_counter() + 30
    while _context._ABANDONED and time.perf_counter() < deadline:
        _context._reap()
        time.sleep(0.01)
    return "" if not _context._ABANDONED else f"{len(_context._ABANDONED)} duplicates not freed; "


@pytest.mark.skipif(SIZE < 2, reason="needs a second rank to miss the call")
@pytest.mark.parametrize("given", ["argument", "environment", "configure"])
def test_rank_missing_from_first_call(given, monkeypatch):
    """The others raise CollectiveTimeout (phase 'setup') within the timeout; nothing leaks.
    The timeout is the call's ``timeout=``, or the option (MPICOLL_TIMEOUT, configure()):
    the set-up waited for ever under the option, read only by the context it set up."""
    comm = WORLD.Dup()
    problem = ""
    if given == "environment":
        monkeypatch.setenv("MPICOLL_TIMEOUT", str(T))
    if RANK != SKIPPER:
        if given == "configure":
            with mpicoll.options(timeout=T):
                problem += _check_setup_timeout(*_first_call(comm, None), comm)
        else:
            problem += _check_setup_timeout(*_first_call(comm, T if given == "argument"
                                                         else None), comm)
    WORLD.Barrier()
    problem += _settle([(comm, RANK != SKIPPER)])
    util.assert_all(WORLD, not problem, problem)
    comm.Free()
    # everything else still works
    ref = np.empty(9)
    WORLD.Allreduce(rank_data(9, RANK), ref)
    assert np.array_equal(mpicoll.allreduce(rank_data(9, RANK), timeout=30.0), ref)


@pytest.mark.skipif(SIZE < 2, reason="needs a second rank to call elsewhere")
def test_rank_calls_first_on_another_communicator():
    """One rank's first call is on another fresh communicator: every rank raises."""
    a, b = WORLD.Dup(), WORLD.Dup()
    mine = b if RANK == SKIPPER else a
    problem = _check_setup_timeout(*_first_call(mine), mine)
    WORLD.Barrier()
    problem += _settle([(a, RANK != SKIPPER), (b, RANK == SKIPPER)])
    util.assert_all(WORLD, not problem, problem)
    a.Free()
    b.Free()


@pytest.mark.skipif(SIZE < 2, reason="needs a second rank to be late")
def test_late_rank_within_the_timeout_is_fine():
    """A first call that waits less than the timeout for a late rank succeeds everywhere."""
    comm = WORLD.Dup()
    if RANK == SKIPPER:
        time.sleep(0.3)
    exc, _ = _first_call(comm, timeout=5.0)
    ref = np.empty(1000)
    WORLD.Allreduce(rank_data(1000, RANK), ref)
    y = mpicoll.allreduce(rank_data(1000, RANK), comm=comm, timeout=5.0)
    util.assert_all(WORLD, exc is None and np.array_equal(y, ref), f"{exc}")
    comm.Free()


@pytest.mark.skipif(SIZE < 2, reason="needs a rank whose options differ from rank 0's")
def test_the_agreements_warning_never_raises_mid_collective(monkeypatch):
    """Rank 1 runs with another MPICOLL_SEGMENT_BYTES under warnings-as-errors (``-W
    error``).  The set-up's agreement warned on that rank inside the collective: it raised
    after the exchange, its peers timed out and the communicator was left unusable.  The
    warning is given once the call completed: every rank has the result, and the
    communicator goes on working."""
    import warnings

    if RANK == 1:
        monkeypatch.setenv("MPICOLL_SEGMENT_BYTES", "4K")
    x = rank_data(8192, RANK, np.float64)
    want = np.empty_like(x)
    WORLD.Allreduce(x, want)
    comm = WORLD.Dup()
    raised = None
    try:
        y = np.empty_like(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                mpicoll.allreduce(x, out=y, comm=comm, timeout=20)
            except RuntimeWarning as w:
                raised = str(w)
        z = mpicoll.allreduce(x, comm=comm, timeout=20)
        ok = bool(np.array_equal(y, want) and np.array_equal(z, want))
    finally:
        comm.Free()
    results = WORLD.allgather((ok, raised))
    assert all(r[0] for r in results), results
    assert results[0][1] is None and "rank 0's" in (results[1][1] or ""), results
