"""Communicators: mpicoll's traffic stays off the user's messages; its per-communicator state.

mpicoll runs every collective on a private duplicate of the user's
communicator (created at the first collective, cached as an MPI attribute,
freed with the user's communicator), so a user's receive posted with
ANY_SOURCE/ANY_TAG on the same communicator never sees mpicoll's messages.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from support import util

import mpicoll
from mpicoll.engine import context as _context
from mpicoll.tools.verify import algorithms_for

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


def run_every_collective(comm):
    """One call of each collective (several algorithms), checked against closed forms."""
    r, n = comm.Get_rank(), comm.Get_size()
    bad = []
    x = np.arange(2 * n + 1, dtype=np.float64) + r
    want = n * np.arange(2 * n + 1) + n * (n - 1) / 2
    for algo in algorithms_for("allreduce", auto=True):
        y = mpicoll.allreduce(x, comm=comm, algorithm=algo)
        if not np.array_equal(y, want):
            bad.append(f"allreduce {algo}: {y}")
    c = mpicoll.Comm(comm)
    counts = [1 + q % 2 for q in range(n)]
    y = np.empty(counts[r])
    c.Reduce_scatter(np.arange(sum(counts), dtype=np.float64) + r, y)  # counts exchanged
    lo = sum(counts[:r])
    if not np.array_equal(y, n * np.arange(lo, lo + counts[r]) + n * (n - 1) / 2):
        bad.append(f"Reduce_scatter: {y}")
    g = mpicoll.allgather(np.array([r, -r], np.int32), comm=comm)
    if not np.array_equal(g, np.array([v for q in range(n) for v in (q, -q)], np.int32)):
        bad.append(f"allgather: {g}")
    return bad


@pytest.mark.parametrize("kind", util.COMM_KINDS)
def test_user_messages_are_not_consumed(comms, kind):
    """An Irecv(ANY_SOURCE, ANY_TAG) posted before mpicoll's collectives gets only the user's message."""
    comm = comms[kind]
    r, n = comm.Get_rank(), comm.Get_size()
    inbox = np.full(3, -1, np.int64)
    req = comm.Irecv(inbox, MPI.ANY_SOURCE, MPI.ANY_TAG)
    early = req.Test()  # nothing has been sent to us yet
    bad = run_every_collective(comm)
    if early:
        bad.append("the user's receive completed before anything was sent to it")
    status = MPI.Status()
    comm.Send(np.array([r, 1000 + r, 42], np.int64), (r + 1) % n, tag=42)
    req.Wait(status)
    left = (r - 1) % n
    if status.Get_source() != left or status.Get_tag() != 42 or \
            not np.array_equal(inbox, [left, 1000 + left, 42]):
        bad.append(f"received {inbox} from {status.Get_source()} tag {status.Get_tag()}")
    comm.Barrier()
    if comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG):
        bad.append("a message is left over on the user's communicator")
    util.assert_all(comm, not bad, "; ".join(bad))


def test_user_collective_in_flight():
    """A user's nonblocking barrier pending on the same communicator is not disturbed."""
    comm = WORLD.Dup()
    try:
        req = comm.Ibarrier()
        bad = run_every_collective(comm)
        req.Wait()
        util.assert_all(comm, not bad, "; ".join(bad))
    finally:
        comm.Free()


def test_private_duplicate_freed_with_the_communicator():
    """comm.Free() frees mpicoll's private duplicate (the attribute's delete callback)."""
    comm = WORLD.Dup()
    mpicoll.allreduce(np.ones(3), comm=comm)
    ctx = _context.context(comm)
    private = ctx.comm
    ok = private != MPI.COMM_NULL and MPI.Comm.Compare(private, comm) == MPI.CONGRUENT \
        and private != comm
    comm.Free()
    ok = ok and ctx.comm == MPI.COMM_NULL and private == MPI.COMM_NULL
    util.assert_all(WORLD, ok, f"private {private} after Free: {ctx.comm}")


def test_many_dup_use_free_cycles():
    """Dup, use, Free 60 times: no error, no handle left behind on this side."""
    bad = []
    for i in range(60):
        comm = WORLD.Dup()
        y = mpicoll.allreduce(np.array([i, RANK], np.int64), comm=comm)
        if y[0] != i * SIZE or y[1] != SIZE * (SIZE - 1) // 2:
            bad.append(f"cycle {i}: {y}")
        ctx = _context.context(comm)
        comm.Free()
        if ctx.comm != MPI.COMM_NULL:
            bad.append(f"cycle {i}: private duplicate not freed")
    util.assert_all(WORLD, not bad, "; ".join(bad[:5]))


def test_wrappers_share_one_context():
    """Two mpicoll.Comm wrappers of one communicator (and the communicator itself) share a context."""
    comm = WORLD.Dup()
    try:
        a, b = mpicoll.Comm(comm), mpicoll.Comm(comm, algorithm="ring")
        y = np.empty(2)
        a.Allreduce(np.ones(2), y)
        ctx = _context.context(comm)
        seq = ctx.seq
        b.Allreduce(np.ones(2), y)
        mpicoll.allreduce(np.ones(2), comm=comm)
        ok = _context.context(a) is ctx and _context.context(b) is ctx and ctx.seq == seq + 2
        ok = ok and np.array_equal(y, [SIZE, SIZE])
        util.assert_all(WORLD, ok, f"contexts {_context.context(a)} {_context.context(b)} {ctx}")
    finally:
        comm.Free()


def test_sub_communicators_are_independent(comms):
    """The two parity halves run different numbers of collectives; then the world runs one."""
    half = comms["split_parity"]
    calls = 3 if RANK % 2 == 0 else 5
    bad = []
    for k in range(calls):
        y = mpicoll.allreduce(np.array([k + 1.0]), comm=half)
        if y[0] != (k + 1) * half.Get_size():
            bad.append(f"half call {k}: {y}")
    y = mpicoll.allreduce(np.array([1.0]), comm=WORLD)
    if y[0] != SIZE:
        bad.append(f"world: {y}")
    util.assert_all(WORLD, not bad, "; ".join(bad))


def test_reversed_split_rank_order(comms):
    """On Split(key=size-rank) rank 0 is the last world rank: gathers follow the new order."""
    comm = comms["split_reversed"]
    g = mpicoll.allgather(np.array([RANK], np.int32), comm=comm)
    util.assert_all(WORLD, np.array_equal(g, np.arange(SIZE)[::-1]), f"{g}")


def _derived_comms(parent):
    """Every intra-communicator an mpicoll.Comm can make, by method (collective)."""
    made = {
        "Dup": parent.Dup(),
        "Dup(info)": parent.Dup(MPI.INFO_NULL),
        "Dup_with_info": parent.Dup_with_info(MPI.INFO_NULL),
        "Clone": parent.Clone(),
        "Split": parent.Split(0, SIZE - RANK),
        "Split_type": parent.Split_type(MPI.COMM_TYPE_SHARED, RANK),
        "Create": parent.Create(parent.Get_group()),
        "Create_group": parent.Create_group(parent.Get_group()),
    }
    for name, method in (("Idup", parent.Idup), ("Idup_with_info", parent.Idup_with_info)):
        comm, req = method() if name == "Idup" else method(MPI.INFO_NULL)
        req.Wait()
        made[name] = comm
    return made


def test_derived_communicators_keep_the_forced_algorithm():
    """Dup/Clone/Idup/Split/Create/... of Comm(algorithm="ring") are mpicoll.Comm running ring."""
    parent = mpicoll.Comm(WORLD.Dup(), algorithm="ring")
    made = _derived_comms(parent)
    bad = []
    for name, comm in made.items():
        if not isinstance(comm, mpicoll.Comm):
            bad.append(f"{name}: {type(comm).__name__}")
            continue
        n, r = comm.Get_size(), comm.Get_rank()
        y = np.empty(3)
        with mpicoll.trace() as tr:
            comm.Allreduce(np.arange(3.0) + r, y)
        algos = {e["algorithm"] for e in tr.events if e["phase"] == "collective"}
        if algos != {"ring"}:
            bad.append(f"{name}: ran {sorted(algos)}")
        if not np.array_equal(y, n * np.arange(3.0) + n * (n - 1) / 2):
            bad.append(f"{name}: {y}")
    for comm in made.values():
        comm.Free()
    parent.Free()
    util.assert_all(WORLD, not bad, "; ".join(bad))


def test_derived_null_communicator_is_comm_null():
    """Split with MPI.UNDEFINED gives MPI.COMM_NULL, as mpi4py does."""
    parent = mpicoll.Comm(WORLD, algorithm="ring")
    sub = parent.Split(MPI.UNDEFINED if RANK == 0 else 1, RANK)
    ok = (sub == MPI.COMM_NULL) if RANK == 0 else isinstance(sub, mpicoll.Comm)
    if sub != MPI.COMM_NULL:
        sub.Free()
    util.assert_all(WORLD, ok, f"{type(sub).__name__}")
