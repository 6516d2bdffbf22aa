"""Work memory: buffers owned by purpose never alias, and are reused.

The ring ReduceScatter once numbered its work buffers by hand (receive slots
0..window-1, send slots 110+k, the in-place staging buffer 120), so with a
window of 11 or more send slot 110+10 *was* the staging buffer.  The tests
below run the ring at every window the docs allow (1-64) with segments small
enough that every slot is in use, in and out of place, and compare bitwise
with MPI's built-in on rank-asymmetric, exactly summable data.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll
from mpicoll.algorithms.ring import split
from mpicoll.backends.host import NUMPY
from mpicoll.engine import context as _context
from mpicoll.engine.context import WorkMemory

# work memory by purpose: up to 4 ranks (several slots in flight on the ring)
pytestmark = pytest.mark.ranks(1, 2, 3, 4)

WORLD = MPI.COMM_WORLD


def _builtin_reduce_scatter(comm, x, counts):
    out = np.empty(counts[comm.Get_rank()], x.dtype)
    comm.Reduce_scatter(x, out, recvcounts=list(counts), op=MPI.SUM)
    return out


def _tuned_dup(window, segment_bytes):
    comm = WORLD.Dup()
    ctx = _context.context(comm)
    ctx.window, ctx.segment_bytes = window, segment_bytes
    return comm


# --- a window of 11 or more: send slot 110+10 was the staging buffer ----------------

@pytest.mark.timeout(60)
def test_in_place_ring_reduce_scatter_window_11():
    """3 ranks, window 11, 8-byte segments, 40 float64 per rank, reduce_scatter(y, out=y)."""
    comm = _tuned_dup(11, 8)
    try:
        total = 40 * comm.Get_size()
        y = rank_data(total, comm.Get_rank())
        want = _builtin_reduce_scatter(WORLD, y.copy(), split(total, comm.Get_size())[0])
        got = mpicoll.reduce_scatter(y, comm=comm, out=y, algorithm="ring")
        ok = util.same_bytes(got, want) and util.same_bytes(y[40:], rank_data(total, comm.Get_rank())[40:])
        util.assert_all(comm, ok, f"got {got.tolist()}, want {want.tolist()}")
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_comm_reduce_scatter_block_in_place_large_window():
    """Comm.Reduce_scatter_block(IN_PLACE) with window 16: small blocks, 8-byte segments."""
    comm = _tuned_dup(16, 8)
    try:
        n, per = comm.Get_size(), 64
        buf = rank_data(n * per, comm.Get_rank())
        want = np.empty(per)
        WORLD.Reduce_scatter_block(buf, want, op=MPI.SUM)
        mpicoll.Comm(comm, algorithm="ring").Reduce_scatter_block(MPI.IN_PLACE, buf, op=MPI.SUM)
        wrong = int(np.count_nonzero(buf[:per] != want))
        util.assert_all(comm, wrong == 0, f"{wrong} of {per} elements wrong")
    finally:
        comm.Free()


# --- every window the docs allow ----------------------------------------------------

@pytest.mark.timeout(120)
# not 4: the ring's slots and pieces per block are the same at any count (blocks of
# 2*window + 1 pieces, uneven at 3 as at 4); 3 is where the aliasing showed
@pytest.mark.ranks(1, 2, 3)
def test_ring_every_window():
    """Ring ReduceScatter and AllReduce, in and out of place, windows 1-64, bitwise."""
    comm = WORLD.Dup()
    try:
        ctx = _context.context(comm)
        n = comm.Get_size()
        bad = []
        for window in range(1, 65):
            # 8-byte segments (one element) and blocks of 2*window + 1 pieces: every
            # receive and send slot of the window is in use; uneven blocks, so that
            # in place every rank but 0 stages its result in work memory too
            ctx.window, ctx.segment_bytes = window, 8
            rows = (2 * window + 1) * n + (n - 1)
            counts = split(rows, n)[0]
            x = rank_data(rows, comm.Get_rank())
            want_rs = _builtin_reduce_scatter(WORLD, x, counts)
            want_ar = np.empty_like(x)
            WORLD.Allreduce(x, want_ar, op=MPI.SUM)
            what = f"window={window}"
            y = x.copy()
            got = mpicoll.reduce_scatter(y, comm=comm, algorithm="ring")
            if not (util.same_bytes(got, want_rs) and util.same_bytes(y, x)):
                bad.append(f"reduce_scatter out of place {what}")
            got = mpicoll.reduce_scatter(y, comm=comm, out=y, algorithm="ring")
            if not util.same_bytes(got, want_rs):
                bad.append(f"reduce_scatter in place {what}")
            y = x.copy()
            got = mpicoll.allreduce(y, comm=comm, algorithm="ring")
            if not (util.same_bytes(got, want_ar) and util.same_bytes(y, x)):
                bad.append(f"allreduce out of place {what}")
            got = mpicoll.allreduce(y, comm=comm, out=y, algorithm="ring")
            if not util.same_bytes(got, want_ar):
                bad.append(f"allreduce in place {what}")
        util.assert_all(comm, not bad, "; ".join(bad[:8]) + (f" ... {len(bad)} in all" if bad else ""))
    finally:
        comm.Free()


# --- reuse: a repeated call allocates nothing ---------------------------------------

CASES = [
    ("allreduce", "ring", True), ("allreduce", "recursive_doubling", False),
    ("allreduce", "rabenseifner", False), ("reduce_scatter", "ring", True),
    ("reduce_scatter", "ring", False), ("reduce_scatter", "recursive_doubling", False),
    ("reduce_scatter", "recursive_halving", False), ("allgather", "bruck", False),
    ("allgather", "recursive_doubling", False),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collective,algorithm,in_place", CASES)
def test_repeated_call_allocates_nothing(collective, algorithm, in_place):
    """After one call of a signature, the next ones reuse the arena and stay correct."""
    comm = _tuned_dup(3, 16)
    try:
        fn = getattr(mpicoll, collective)
        n = comm.Get_size()
        x = rank_data(10 * n + 3, comm.Get_rank())
        if collective == "allgather":
            want = np.empty(n * len(x))
            WORLD.Allgather(x, want)
        elif collective == "allreduce":
            want = np.empty_like(x)
            WORLD.Allreduce(x, want, op=MPI.SUM)
        else:
            want = _builtin_reduce_scatter(WORLD, x, split(len(x), n)[0])
        ctx = _context.context(comm)
        results, allocs = [], []
        for _ in range(3):
            y = x.copy()
            kw = {"out": y} if in_place else {}
            results.append(fn(y, comm=comm, algorithm=algorithm, **kw).copy())
            # (the operation an out= call keeps holds its work memory while its arrays live)
            del y, kw
            allocs.append(ctx.work.allocations)
        ok = all(util.same_bytes(r, want) for r in results) and allocs[1] == allocs[2] == allocs[0]
        util.assert_all(comm, ok, f"allocations after each call {allocs}")
    finally:
        comm.Free()


# --- the arena itself (local, no messages) ------------------------------------------

def _overlap(a, b) -> bool:
    return bool(np.shares_memory(a, b))


def test_takes_in_one_scope_are_disjoint():
    mem = WorkMemory()
    with mem.scope(NUMPY):
        bufs = [mem.take(np.dtype(np.float64), k, f"buffer {k}") for k in (3, 0, 5, 7, 1, 64)]
        bufs += [mem.take(np.dtype(np.int8), 9, "bytes")]
        assert [len(b) for b in bufs] == [3, 0, 5, 7, 1, 64, 9]
        for i, a in enumerate(bufs):
            for b in bufs[i + 1:]:
                assert not _overlap(a, b)
        assert [p for p, _, _ in mem.live()][:2] == ["buffer 3", "buffer 0"]
    assert mem.live() == []


def test_nested_scope_is_above_the_outer_regions_and_gives_back_its_own():
    mem = WorkMemory()
    f8 = np.dtype(np.float64)
    with mem.scope(NUMPY):
        outer = mem.take(f8, 10, "outer")
        with mem.scope(NUMPY):
            inner = [mem.take(f8, 10, "inner a"), mem.take(f8, 4, "inner b")]
            assert not any(_overlap(outer, b) for b in inner)
        again = mem.take(f8, 14, "outer, after the inner call")
        assert not _overlap(outer, again)
        assert len(mem.live()) == 2
    # the arena now holds what the largest call took, and reuses it
    assert mem.nbytes == 24 * 8
    before = mem.allocations
    with mem.scope(NUMPY):
        mem.take(f8, 10, "outer")
        with mem.scope(NUMPY):
            mem.take(f8, 14, "inner")
    assert mem.allocations == before


def test_take_outside_a_scope_raises():
    mem = WorkMemory()
    with pytest.raises(RuntimeError, match="outside a work-memory scope"):
        mem.take(np.dtype(np.float64), 4, "stray")


def test_scope_gets_distinct_buffers_for_any_count():
    """A run asking for many buffers of one purpose gets distinct ones (no slot ids)."""
    work = WorkMemory()

    def algorithm(count):
        with work.scope(NUMPY):
            bufs = [work.take(np.dtype(np.float64), 2, "receive slot") for _ in range(count)]
            for i, b in enumerate(bufs):
                b[:] = i
            return [float(b[0]) for b in bufs]

    for count in (1, 11, 64, 130):
        assert algorithm(count) == [float(i) for i in range(count)]
    assert work.nbytes == 130 * 2 * 8
