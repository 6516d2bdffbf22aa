"""Algorithm-level tests: every registered algorithm, on a strict simulated network and on MPI.

Simulated (no MPI messages): every builder of ``engine.select.BUILDERS`` (what
a call can select) runs on the schedule simulator (tests/support/schedsim.py)
with rendezvous transport, so a schedule that only works because MPI buffers
small messages deadlocks, and one that touches a buffer while a message is in
flight on it fails.  The cases are spread over the MPI ranks running this file
(each rank runs its share), so the file takes the same time at any -n.

MPI: every algorithm on COMM_WORLD with tiny segments, against MPI's
built-in collectives.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from mpi4py import MPI
from support import schedsim as sim
from support import util
from support.data import rank_data

from mpicoll.algorithms.ring import split
from mpicoll.algorithms.schedule import DST, SRC, Builder, Region
from mpicoll.backends.host import NUMPY
from mpicoll.engine import context as _context
from mpicoll.engine import select as _select
from mpicoll.tools import results as _results
from mpicoll.transport.channel import Channel

WORLD = MPI.COMM_WORLD


TUNINGS = [(1, 1), (1, 2), (3, 3), (1 << 17, 2)]  # (segment elements, window)


def _rings(n, rng):
    """Ring orders: the identity, reversed, and a random one."""
    perm = list(range(n))
    rng.shuffle(perm)
    return [tuple(range(n)), tuple(range(n))[::-1], tuple(perm)]


def _simulate(collective, cases):
    """Run this rank's share of ``cases`` ((algorithm, n, counts, displs, length, in place,
    ring, tuning, op)) on the schedule simulator, rendezvous transport."""
    for name, n, counts, displs, length, in_place, ring, tuning, op in util.share(cases):
        sim.run_case(collective, _select.BUILDERS[collective][name], n, counts, displs, length,
                     in_place, "rendezvous", tuning, op, ring)


# --- AllReduce --------------------------------------------------------------

def _allreduce_cases():
    rng = random.Random(1)
    cases = []
    for name in _select.BUILDERS["allreduce"]:
        for n in range(1, 8):
            for N in sorted({0, 1, max(n - 1, 0), n, 2 * n + 1, 37}):
                for ring in _rings(n, rng)[: 3 if name == "ring" else 1]:
                    for tuning in TUNINGS:
                        cases.append((name, n, (N,), (0,), N, rng.random() < 0.5, ring, tuning, "sum"))
                if name in _select.ORDER_PRESERVING:
                    for in_place in (False, True):
                        cases.append((name, n, (N,), (0,), N, in_place, None, (1, 2), "affine"))
    return cases


@pytest.mark.local
@pytest.mark.timeout(300)
def test_allreduce_simulated():
    """Every selectable AllReduce, 1-7 ranks, ring orders and tunings, SUM and a
    non-commutative op where the order is kept."""
    _simulate("allreduce", _allreduce_cases())


# --- ReduceScatter ----------------------------------------------------------

def _reduce_scatter_cases():
    rng = random.Random(2)
    cases = []
    for name in _select.BUILDERS["reduce_scatter"]:
        for n in range(1, 8):
            for counts in sim.count_patterns(n, rng)[:-1]:  # a thousand: test_schedules.py
                displs = [sum(counts[:r]) for r in range(n)]
                for ring in _rings(n, rng)[: 3 if name == "ring" else 1]:
                    for tuning in TUNINGS:
                        cases.append((name, n, counts, displs, sum(counts), rng.random() < 0.5,
                                      ring, tuning, "sum"))
                if name in _select.ORDER_PRESERVING:
                    cases.append((name, n, counts, displs, sum(counts), rng.random() < 0.5, None,
                                  (1, 2), "affine"))
    return cases


@pytest.mark.local
@pytest.mark.timeout(300)
def test_reduce_scatter_simulated():
    """Every selectable ReduceScatter, 1-7 ranks, the count patterns, ring orders, tunings."""
    _simulate("reduce_scatter", _reduce_scatter_cases())


# --- AllGather --------------------------------------------------------------

def _allgather_cases():
    rng = random.Random(3)
    cases = []
    for name in _select.BUILDERS["allgather"]:
        for n in range(1, 8):
            for counts in sim.count_patterns(n, rng)[:-1]:  # a thousand: test_schedules.py
                packed = ([sum(counts[:r]) for r in range(n)], sum(counts))
                for displs, length in (packed, sim.scattered(counts, rng)):
                    for ring in _rings(n, rng)[: 3 if name == "ring" else 1]:
                        for tuning in TUNINGS[:3]:
                            cases.append((name, n, counts, displs, length, rng.random() < 0.5,
                                          ring, tuning, "sum"))
    return cases


@pytest.mark.local
@pytest.mark.timeout(300)
def test_allgather_simulated():
    """Every selectable AllGather, 1-7 ranks, packed and scattered layouts, ring orders."""
    _simulate("allgather", _allgather_cases())


# --- bounded memory and the simulator itself ----------------------------------

@pytest.mark.local
def test_ring_reduce_scatter_memory_is_bounded():
    """Out of place, the ring ReduceScatter holds 2*window segments of work memory."""
    n, per, seg, win = 4, 1000, 16, 2
    build = _select.BUILDERS["reduce_scatter"]["ring"]
    counts = [per] * n
    res = sim.run_case("reduce_scatter", build, n, counts, [per * r for r in range(n)], per * n,
                       False, "rendezvous", (seg, win))
    assert res.dst(1).size == per
    for r in range(n):
        sh = sim.shape("reduce_scatter", n, r, counts=counts, segment=seg, window=win)
        assert sum(build(sh).work.values()) == 2 * win * seg


@pytest.mark.local
def test_harness_detects_deadlock_and_early_reuse():
    """The simulator must catch a head-to-head blocking exchange and a reused send buffer."""
    whole = Region(DST, 0, 4)

    def head_to_head(r):
        b = Builder()
        b.wait(b.send(1 - r, whole))  # both ranks send first and wait: no receive posted
        b.wait(b.recv(1 - r, whole))
        return b.build(2)

    def early_reuse(r):
        b = Builder()
        if r == 0:
            h = b.send(1, whole)
            b.copy(whole, Region(SRC, 0, 4))  # bug: the send has not completed
            b.wait(h)
        else:
            b.wait(b.recv(0, whole))
        return b.build(1)

    def early_read(r):
        b = Builder()
        if r == 0:
            b.wait(b.send(1, whole))
        else:
            h = b.recv(0, whole)
            b.copy(Region(SRC, 0, 4), whole)  # bug: the receive has not completed
            b.wait(h)
        return b.build(1)

    def run(make, alias=False):
        bufs = [{SRC: np.ones(4), DST: np.zeros(4)} for _ in range(2)]
        if alias:  # in place: SRC is DST's memory, which only addresses show
            for b in bufs:
                b[SRC] = b[DST]
        sim.simulate([make(0), make(1)], bufs, np.add, "rendezvous")

    with pytest.raises(sim.Deadlock):
        run(head_to_head)
    with pytest.raises(sim.ScheduleError, match="before it was waited"):
        run(early_reuse)
    with pytest.raises(sim.ScheduleError, match="touches memory of the Recv"):
        run(early_read)
    with pytest.raises(sim.ScheduleError, match="partially overlap|touches memory"):
        run(early_read, alias=True)


# --- real MPI ---------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_comm():
    """A Dup of COMM_WORLD whose context uses 3-element segments and window 2."""
    comm = WORLD.Dup()
    ctx = _context.context(comm)
    ctx.segment_bytes = 24
    ctx.window = 2
    yield comm
    comm.Free()


def _reference(comm, kind, x, counts=None):
    """The checker's reference (mpicoll.tools.results): exact sums, gathers by MPI's built-in."""
    if kind == "allgather":
        return np.asarray(_results.reference_allgatherv(
            comm, x, counts, [sum(counts[:r]) for r in range(comm.size)],
            np.zeros(sum(counts), x.dtype)))
    ref = _results.reference_allreduce(comm, x, MPI.SUM)
    if kind == "reduce_scatter":
        lo = sum(counts[:comm.rank])
        ref = ref[lo:lo + counts[comm.rank]]
    return ref


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", list(_select.ALGORITHMS))
def test_every_algorithm_matches_mpi(tiny_comm, collective):
    comm = tiny_comm
    n, rank = comm.size, comm.rank
    ctx = _context.context(comm)
    for name, fn in util.algorithm_functions(collective).items():
        for N in (0, 1, n + 1, 50, 1001):
            for dtype in (np.int64, np.float32):
                counts = split(N, n)[0]
                displs = [sum(counts[:r]) for r in range(n)]
                x = rank_data(N if collective != "allgather" else counts[rank], rank, dtype)
                ch = Channel(ctx.comm, MPI._typedict[np.dtype(dtype).char])
                red = NUMPY.reducer(MPI.SUM, ch.mpitype, "integer" if dtype == np.int64 else "floating")
                if collective == "allreduce":
                    out = np.empty_like(x)
                    fn(ctx, ch, NUMPY, red, x, out)
                elif collective == "reduce_scatter":
                    out = np.empty(counts[rank], dtype)
                    fn(ctx, ch, NUMPY, red, x, out, counts, displs)
                else:
                    out = np.empty(N, dtype)
                    fn(ctx, ch, NUMPY, x, out, counts, displs)
                ref = _reference(comm, collective, x, counts)
                res = _results.compare(out, ref, None if collective == "allgather" else "SUM", n)
                assert res.ok, f"{name} N={N} {np.dtype(dtype)}: {res.worst}"


# --- pipelining parameters ----------------------------------------------------

@pytest.mark.local
def test_tuning_from_environment():
    from mpicoll.core.config import parse_bytes, read_environment

    defaults = read_environment({})
    assert (defaults["segment_bytes"], defaults["window"]) == (1 << 20, 2)
    got = read_environment({"MPICOLL_SEGMENT_BYTES": "64K", "MPICOLL_WINDOW": "3"})
    assert (got["segment_bytes"], got["window"]) == (65536, 3)
    got = read_environment({"MPICOLL_SEGMENT_BYTES": " 2MiB ", "MPICOLL_WINDOW": ""})
    assert (got["segment_bytes"], got["window"]) == (2 << 20, 2)
    assert parse_bytes("4096", "x") == 4096 and parse_bytes("1g", "x") == 1 << 30
    for bad in ({"MPICOLL_SEGMENT_BYTES": "0"}, {"MPICOLL_SEGMENT_BYTES": "1.5M"},
                {"MPICOLL_SEGMENT_BYTES": "big"}):
        with pytest.raises(ValueError, match="MPICOLL_SEGMENT_BYTES"):
            read_environment(bad)
    for bad in ("0", "65", "two"):
        with pytest.raises(ValueError, match="MPICOLL_WINDOW"):
            read_environment({"MPICOLL_WINDOW": bad})
    read_environment()


@pytest.mark.timeout(60)
def test_context_reads_tuning_once(monkeypatch):
    monkeypatch.setenv("MPICOLL_SEGMENT_BYTES", "8K")
    monkeypatch.setenv("MPICOLL_WINDOW", "3")
    comm = WORLD.Dup()
    try:
        ctx = _context.context(comm)
        assert (ctx.segment_bytes, ctx.window) == (8192, 3)
        monkeypatch.setenv("MPICOLL_SEGMENT_BYTES", "1M")  # read at creation only
        x = np.arange(10000, dtype=np.float64) + comm.rank
        ref = np.empty_like(x)
        comm.Allreduce(x, ref)
        from mpicoll import allreduce
        np.testing.assert_array_equal(allreduce(x, comm=comm, algorithm="ring"), ref)
        assert _context.context(comm).segment_bytes == 8192
    finally:
        comm.Free()


# --- automatic selection ------------------------------------------------------

@pytest.mark.local
def test_threshold_table_is_well_formed():
    for collective, rows in _select.THRESHOLDS.items():
        limits = [r[0] for r in rows]
        assert limits[-1] is None and all(a < b for a, b in zip(limits[:-2], limits[1:-1]))
        for _, pof2, other in rows:
            assert pof2 in _select.ALGORITHMS[collective] and other in _select.ALGORITHMS[collective]


@pytest.mark.local
def test_auto_follows_the_table():
    for collective, rows in _select.THRESHOLDS.items():
        lo = 0
        for limit, pof2, other in rows:
            for nbytes in {lo, (limit if limit is not None else lo + (1 << 30))}:
                assert _select.choose(collective, "auto", nbytes, 4) == pof2
                assert _select.choose(collective, "auto", nbytes, 6) == other
            lo = (limit or 0) + 1
    # non-commutative ops: always an order-preserving algorithm
    for collective in ("allreduce", "reduce_scatter"):
        for nbytes in (8, 1 << 30):
            name = _select.choose(collective, "auto", nbytes, 5, commutative=False)
            assert name in _select.ORDER_PRESERVING


@pytest.mark.local
def test_environment_override():
    """The ``algorithm`` option (MPICOLL_ALGORITHM) replaces "auto" where it applies."""
    assert _select.choose("allreduce", "auto", 8, 4, forced="ring") == "ring"
    assert _select.choose("allreduce", "auto", 8, 4, commutative=False,
                          forced="ring") == "recursive_doubling"
    assert _select.choose("allreduce", "rabenseifner", 8, 4, forced="ring") == "rabenseifner"
    # AllGather only: the others stay on auto
    assert _select.choose("allgather", "auto", 1 << 30, 4, forced="bruck") == "bruck"
    assert _select.choose("allreduce", "auto", 1 << 30, 4, forced="bruck") == "ring"
