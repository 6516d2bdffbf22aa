"""Creating mpicoll's per-communicator state: options checked first, nothing leaked.

The first collective on a communicator builds its context (a private
duplicate, the ring order).  A bad option must be refused before any MPI call
on the communicator, so refused calls create nothing: thousands of them leave
the communicator (and MPI's supply of communicator ids) intact.  Runs under an
MPI launcher at any rank count.
"""

from __future__ import annotations

import _util
import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll import _context

pytestmark = pytest.mark.timeout(300)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def data(n):
    return (np.arange(n) % 89 * (RANK + 2) + 3 * RANK).astype(np.float64)


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
    calls = [lambda: mpicoll.allreduce(data(6), comm=comm),
             lambda: mpicoll.Comm(comm).Allreduce(data(6), np.empty(6))]
    if var != "MPICOLL_TIMEOUT":  # (an argument wins over the variable)
        calls.append(lambda: mpicoll.allreduce(data(6), comm=comm, timeout=30.0))
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
    y = mpicoll.allreduce(data(7), comm=comm)
    ref = np.empty(7)
    WORLD.Allreduce(data(7), ref)
    if not np.array_equal(y, ref):
        problem += "wrong result after the refusals; "
    _util.assert_all(WORLD, not problem, problem)
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
                mpicoll.allreduce(data(4), comm=comm, algorithm="ring")
            except ValueError:
                refused += 1
        if refused != 1500:
            problem += f"{var}={value}: {refused} of 1500 refused; "
        monkeypatch.delenv(var)
    # the communicator, and new ones, still work
    ref = np.empty(5)
    WORLD.Allreduce(data(5), ref)
    ok = np.array_equal(mpicoll.allreduce(data(5), comm=comm), ref)
    fresh = WORLD.Dup()
    ok = ok and np.array_equal(mpicoll.allreduce(data(5), comm=fresh), ref)
    fresh.Free()
    if not ok:
        problem += "wrong result after the refusals; "
    _util.assert_all(WORLD, not problem, problem)
    comm.Free()
