"""Algorithm-level tests: every registered algorithm, on a strict simulated network and on MPI.

Simulated network (no MPI messages): ``n`` threads run an algorithm through
a fake channel with *rendezvous* semantics.  A send completes only when the
matching receive is posted and one of the two sides waits; data is copied at
that moment, from whatever the send buffer then holds.  So a schedule that
only works because MPI buffers small messages deadlocks here (detected at
once: every thread blocked, nothing matchable), and an algorithm that reuses
a buffer before its send completed, or reads a receive buffer before its
receive completed, produces wrong results.  Work arrays are filled with
garbage whenever they are handed out.  The cases are spread over the MPI
ranks running this file (each rank runs its share), so the file takes the
same time at any -n.

MPI: every algorithm on COMM_WORLD with tiny segments, against MPI's
built-in collectives.
"""

from __future__ import annotations

import random
import threading
from collections import deque

import _util
import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.algorithms.ring import split
from mpicoll.backends.host import NUMPY
from mpicoll.engine import context as _context
from mpicoll.engine import select as _select
from mpicoll.engine.workmem import WorkMemory
from mpicoll.tools import results as _results
from mpicoll.transport.channel import Channel

WORLD = MPI.COMM_WORLD


class Deadlock(RuntimeError):
    pass


class _Req:
    __slots__ = ("buf", "done", "key")

    def __init__(self, buf, key):
        self.buf = buf
        self.done = False
        self.key = key  # (source rank, destination rank)


class _World:
    """Shared state of the simulated network: per-link FIFO queues of unmatched requests."""

    def __init__(self, n):
        self.cv = threading.Condition()
        self.sends = {}
        self.recvs = {}
        self.alive = n
        self.waiting = {}  # thread rank -> requests it is blocked on
        self.dead = False

    def link(self, key):
        """(unmatched sends, unmatched receives) of the link key = (source, destination)."""
        if key not in self.sends:
            self.sends[key] = deque()
            self.recvs[key] = deque()
        return self.sends[key], self.recvs[key]

    def queues(self, req):
        """(queue holding req, the partner queue) of its link."""
        sends, recvs = self.link(req.key)
        return (sends, recvs) if req in sends else (recvs, sends)

    def matchable(self, req):
        mine, other = self.queues(req)
        return len(other) > mine.index(req)

    def match_upto(self, req):
        """Match the link's FIFO heads up to and including ``req`` if its partner is posted."""
        if not self.matchable(req):
            return False
        sends, recvs = self.sends[req.key], self.recvs[req.key]
        for _ in range(max(sends.index(req) if req in sends else recvs.index(req), 0) + 1):
            s = sends.popleft()
            r = recvs.popleft()
            if len(s.buf) != len(r.buf):
                raise AssertionError(f"message of {len(s.buf)} elements received into {len(r.buf)}")
            r.buf[...] = s.buf
            s.done = r.done = True
        return True

    def stuck(self):
        """True if every live thread waits and none of their requests can complete."""
        if len(self.waiting) < self.alive:
            return False
        for reqs in self.waiting.values():
            pending = [r for r in reqs if not r.done]
            if not pending or any(self.matchable(r) for r in pending):
                return False
        return True


class FakeChannel:
    """The Channel interface over :class:`_World` (rendezvous; progress only in waits)."""

    def __init__(self, world, rank):
        self.world = world
        self.rank = rank

    def isend(self, arr, dest):
        req = _Req(arr, (self.rank, dest))
        with self.world.cv:
            self.world.link(req.key)[0].append(req)
            self.world.cv.notify_all()
        return req

    def irecv(self, arr, source):
        req = _Req(arr, (source, self.rank))
        with self.world.cv:
            self.world.link(req.key)[1].append(req)
            self.world.cv.notify_all()
        return req

    def wait(self, req):
        self.waitall([req])

    def waitall(self, reqs):
        w = self.world
        with w.cv:
            while True:
                progressed = False
                for req in reqs:
                    if not req.done and w.match_upto(req):
                        progressed = True
                if progressed:
                    w.cv.notify_all()
                if all(r.done for r in reqs):
                    return
                if w.dead:
                    raise Deadlock("another thread found a deadlock")
                w.waiting[self.rank] = reqs
                if w.stuck():
                    w.dead = True
                    w.cv.notify_all()
                    raise Deadlock(f"all {w.alive} live ranks blocked, nothing matchable")
                w.cv.wait(timeout=5)
                w.waiting.pop(self.rank, None)

    def sendrecv(self, sendarr, dest, recvarr, source):
        reqs = []
        if recvarr is not None and len(recvarr):
            reqs.append(self.irecv(recvarr, source))
        if sendarr is not None and len(sendarr):
            reqs.append(self.isend(sendarr, dest))
        self.waitall(reqs)


class FakeCtx:
    """The parts of :class:`mpicoll.engine.context.Context` that algorithms use."""

    def __init__(self, rank, size, ring, segment_bytes, window, rng):
        self.rank, self.size = rank, size
        self.ring = ring
        self.ring_pos = ring.index(rank)
        self.segment_bytes = segment_bytes
        self.window = window
        self.seq = 0
        self.work = _GarbageWork()
        self.rng = rng


class _GarbageWork(WorkMemory):
    """The context's arena, filling every work array with garbage when it is handed out."""

    __slots__ = ()

    def take(self, dtype, n, purpose):
        view = super().take(dtype, n, purpose)
        view[...] = 1e300 if dtype.kind == "f" else -12345
        return view


def _run(n, body, timeout=60):
    """Run body(rank, channel) on n threads over one fake world; return per-rank results."""
    world = _World(n)
    results = [None] * n
    errors = []
    chans = [FakeChannel(world, r) for r in range(n)]

    def main(r):
        try:
            results[r] = body(r, chans[r])
        except BaseException as exc:  # reported below
            errors.append((r, exc))
            with world.cv:
                world.dead = True
                world.cv.notify_all()
        finally:
            with world.cv:
                world.alive -= 1
                world.waiting.pop(r, None)
                world.cv.notify_all()

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "simulated collective did not finish"
    if errors:
        errors.sort(key=lambda e: isinstance(e[1], Deadlock) and "another" in str(e[1]))
        raise errors[0][1]
    return results, world


# --- reductions -------------------------------------------------------------

SUM = NUMPY.reducer(MPI.SUM, MPI.DOUBLE, "floating")


class Affine:
    """Composition of affine maps x -> re*x + im, packed in complex numbers.

    Associative but not commutative: (a o b) = a.re*b.re + i(a.re*b.im + a.im).
    With small integers every result is exact, so operand order shows.
    """

    commutative = False

    def __call__(self, a, b, out):
        re = a.real * b.real
        im = a.real * b.imag + a.imag
        out.real = re
        out.imag = im


AFFINE = Affine()


def _data(rank, N, dtype):
    i = np.arange(N)
    if dtype == np.complex128:
        return ((rank + i) % 3 - 1 + ((rank * 5 + i) % 7 - 3) * 1j).astype(dtype)
    return ((rank * 131 + i * 7) % 17 - 8).astype(dtype)


def _reduce_all(inputs, red_name):
    acc = inputs[0].copy()
    for x in inputs[1:]:
        if red_name == "affine":
            acc = acc.real * x.real + 1j * (acc.real * x.imag + acc.imag)
        else:
            acc = acc + x
    return acc


def _rings(n, rng):
    out = [list(range(n)), list(range(n))[::-1]]
    perm = list(range(n))
    rng.shuffle(perm)
    out.append(perm)
    return out


def _counts_patterns(n, rng):
    pats = [[3] * n, split(2 * n + 1, n)[0], [0] * n, [0] * (n - 1) + [5],
            [rng.randrange(0, 6) for _ in range(n)], [rng.randrange(0, 40) for _ in range(n)]]
    return pats


def _share(cases):
    """This MPI rank's share of the cases."""
    return [c for i, c in enumerate(cases) if i % WORLD.size == WORLD.rank]


def _tunings():
    # segment bytes (float64: 1, 3 elements, 1 MiB) x window
    return [(8, 1), (8, 2), (24, 3), (1 << 20, 2)]


# --- AllReduce --------------------------------------------------------------

def _allreduce_cases():
    rng = random.Random(1)
    cases = []
    for name in _select.ALGORITHMS["allreduce"]:
        for n in range(1, 8):
            for N in sorted({0, 1, max(n - 1, 0), n, 2 * n + 1, 37}):
                for ring in _rings(n, rng)[: 2 if name == "ring" else 1]:
                    for seg, win in _tunings():
                        cases.append((name, n, N, ring, seg, win, rng.random() < 0.5, "sum"))
                if name in _select.ORDER_PRESERVING:
                    cases.append((name, n, N, list(range(n)), 8, 2, False, "affine"))
                    cases.append((name, n, N, list(range(n)), 8, 2, True, "affine"))
    return cases


def _allreduce_case(name, n, N, ring, seg, win, in_place, red_name):
    fn = _util.algorithm_functions("allreduce")[name]
    dtype = np.complex128 if red_name == "affine" else np.float64
    red = AFFINE if red_name == "affine" else SUM
    inputs = [_data(r, N, dtype) for r in range(n)]
    expect = _reduce_all(inputs, red_name)

    def body(r, ch):
        ctx = FakeCtx(r, n, ring, seg, win, None)
        src = inputs[r].copy()
        dst = src if in_place else np.full(N, 7, dtype)
        fn(ctx, ch, NUMPY, red, src, dst)
        return dst, src

    res, _ = _run(n, body)
    what = f"{name} n={n} N={N} ring={ring} seg={seg} window={win} in_place={in_place} op={red_name}"
    for r in range(n):
        np.testing.assert_array_equal(res[r][0], expect, err_msg=f"{what} rank {r}")
        if not in_place:
            np.testing.assert_array_equal(res[r][1], inputs[r], err_msg=f"{what}: input changed")
        assert res[r][0].tobytes() == res[0][0].tobytes(), f"{what}: ranks differ bitwise"


@pytest.mark.local
@pytest.mark.timeout(300)
def test_allreduce_simulated():
    for case in _share(_allreduce_cases()):
        _allreduce_case(*case)


# --- ReduceScatter ----------------------------------------------------------

def _reduce_scatter_cases():
    rng = random.Random(2)
    cases = []
    for name in _select.ALGORITHMS["reduce_scatter"]:
        for n in range(1, 8):
            for counts in _counts_patterns(n, rng):
                for ring in _rings(n, rng)[: 3 if name == "ring" else 1]:
                    for seg, win in _tunings():
                        cases.append((name, n, counts, ring, seg, win, rng.random() < 0.5, "sum"))
                if name in _select.ORDER_PRESERVING:
                    cases.append((name, n, counts, list(range(n)), 8, 2, rng.random() < 0.5, "affine"))
    return cases


def _reduce_scatter_case(name, n, counts, ring, seg, win, in_place, red_name):
    fn = _util.algorithm_functions("reduce_scatter")[name]
    dtype = np.complex128 if red_name == "affine" else np.float64
    red = AFFINE if red_name == "affine" else SUM
    total = sum(counts)
    displs = [sum(counts[:r]) for r in range(n)]
    inputs = [_data(r, total, dtype) for r in range(n)]
    expect = _reduce_all(inputs, red_name)

    def body(r, ch):
        ctx = FakeCtx(r, n, ring, seg, win, None)
        src = inputs[r].copy()
        dst = src[: counts[r]] if in_place else np.full(counts[r], 7, dtype)
        fn(ctx, ch, NUMPY, red, src, dst, counts, displs)
        return dst.copy(), src

    res, _ = _run(n, body)
    what = f"{name} n={n} counts={counts} ring={ring} seg={seg} window={win} in_place={in_place}"
    for r in range(n):
        mine = expect[displs[r]: displs[r] + counts[r]]
        np.testing.assert_array_equal(res[r][0], mine, err_msg=f"{what} rank {r}")
        if in_place:
            np.testing.assert_array_equal(res[r][1][counts[r]:], inputs[r][counts[r]:],
                                          err_msg=f"{what}: input beyond the result changed")
        else:
            np.testing.assert_array_equal(res[r][1], inputs[r], err_msg=f"{what}: input changed")


@pytest.mark.local
@pytest.mark.timeout(300)
def test_reduce_scatter_simulated():
    for case in _share(_reduce_scatter_cases()):
        _reduce_scatter_case(*case)


# --- AllGather --------------------------------------------------------------

def _allgather_cases():
    rng = random.Random(3)
    cases = []
    for name in _select.ALGORITHMS["allgather"]:
        for n in range(1, 8):
            for counts in _counts_patterns(n, rng):
                for layout in ("packed", "scattered"):
                    for ring in _rings(n, rng)[: 3 if name == "ring" else 1]:
                        for seg, win in _tunings()[:3]:
                            cases.append((name, n, counts, layout, ring, seg, win, rng.random() < 0.5))
    return cases


def _layout(counts, how, rng):
    if how == "packed":
        return [sum(counts[:r]) for r in range(len(counts))], sum(counts)
    order = list(range(len(counts)))
    rng.shuffle(order)
    displs = [0] * len(counts)
    at = 2
    for r in order:
        displs[r] = at
        at += counts[r] + 1  # gaps between blocks
    return displs, at + 3


def _allgather_case(name, n, counts, how, ring, seg, win, in_place, rng):
    fn = _util.algorithm_functions("allgather")[name]
    displs, length = _layout(counts, how, rng)
    blocks = [_data(r, counts[r], np.float64) + 100 * r for r in range(n)]
    expect = np.full(length, -1.0)
    for r in range(n):
        expect[displs[r]: displs[r] + counts[r]] = blocks[r]

    def body(r, ch):
        ctx = FakeCtx(r, n, ring, seg, win, None)
        dst = np.full(length, -1.0)
        if in_place:
            dst[displs[r]: displs[r] + counts[r]] = blocks[r]
            fn(ctx, ch, NUMPY, None, dst, counts, displs)
        else:
            src = blocks[r].copy()
            fn(ctx, ch, NUMPY, src, dst, counts, displs)
            np.testing.assert_array_equal(src, blocks[r])
        return dst

    res, _ = _run(n, body)
    what = f"{name} n={n} counts={counts} {how} ring={ring} seg={seg} window={win} in_place={in_place}"
    for r in range(n):
        np.testing.assert_array_equal(res[r], expect, err_msg=f"{what} rank {r}")


@pytest.mark.local
@pytest.mark.timeout(300)
def test_allgather_simulated():
    rng = random.Random(4)
    for case in _share(_allgather_cases()):
        _allgather_case(*case, rng)


# --- bounded memory and the harness itself ------------------------------------

@pytest.mark.local
def test_ring_reduce_scatter_memory_is_bounded():
    """Out of place, the ring ReduceScatter holds 2*window segments of work memory."""
    if WORLD.rank != 0:
        pytest.skip("single-process check, run on rank 0")
    n, per, seg_elems, win = 4, 1000, 16, 2
    counts = [per] * n
    displs = [per * r for r in range(n)]
    fn = _util.algorithm_functions("reduce_scatter")["ring"]
    inputs = [_data(r, per * n, np.float64) for r in range(n)]
    ctxs = [FakeCtx(r, n, list(range(n)), seg_elems * 8, win, None) for r in range(n)]

    def body(r, ch):
        dst = np.empty(per)
        fn(ctxs[r], ch, NUMPY, SUM, inputs[r], dst, counts, displs)
        return dst

    res, _ = _run(n, body)
    np.testing.assert_array_equal(res[1], _reduce_all(inputs, "sum")[per: 2 * per])
    for ctx in ctxs:
        assert ctx.work.nbytes == 2 * win * seg_elems * 8


@pytest.mark.local
def test_harness_detects_deadlock_and_early_reuse():
    """The fake network must catch a head-to-head blocking exchange and a reused send buffer."""
    if WORLD.rank != 0:
        pytest.skip("single-process check, run on rank 0")

    def head_to_head(r, ch):
        buf = np.zeros(4)
        ch.wait(ch.isend(buf, 1 - r))  # both ranks send first and wait: no receive posted
        ch.wait(ch.irecv(buf, 1 - r))

    with pytest.raises(Deadlock):
        _run(2, head_to_head)

    def early_reuse(r, ch):
        buf = np.full(4, 1.0)
        if r == 0:
            req = ch.isend(buf, 1)
            buf[...] = 2.0  # bug: the send has not completed
            ch.wait(req)
            return None
        ch.wait(ch.irecv(buf, 0))
        return buf

    res, _ = _run(2, early_reuse)
    assert res[1][0] == 2.0  # the data seen is what the buffer held when the send matched


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
    for name, fn in _util.algorithm_functions(collective).items():
        for N in (0, 1, n + 1, 50, 1001):
            for dtype in (np.int64, np.float32):
                counts = split(N, n)[0]
                displs = [sum(counts[:r]) for r in range(n)]
                x = _data(rank, N if collective != "allgather" else counts[rank], dtype) * (rank + 1)
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
