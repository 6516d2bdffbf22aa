"""The executor: resumable operations, several in flight, persistent restarts, work memory.

Operations come from ``mpicoll.engine.run.start`` on a validated Call (the
interface the public non-blocking and persistent API is built on).  Data is
rank-asymmetric and exactly summable; every result is compared bitwise with
MPI's built-in on the same input.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll
from mpicoll.algorithms.ring import split
from mpicoll.api.args import msg_of_array
from mpicoll.backends.host import NUMPY
from mpicoll.core.types import Call
from mpicoll.engine import context as _context
from mpicoll.engine import run as _run

WORLD = MPI.COMM_WORLD


class _coll:
    """The engine's run path on Calls made here (what api.args makes from arguments)."""

    @staticmethod
    def start_allreduce(comm, smsg, rmsg, op, algorithm="auto", persistent=False):
        return _run.start(Call("allreduce", comm, smsg, rmsg, None, None, op, algorithm),
                          persistent=persistent)

    @staticmethod
    def start_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto",
                             persistent=False):
        return _run.start(Call("reduce_scatter", comm, smsg, rmsg, tuple(counts),
                               tuple(displs), op, algorithm), persistent=persistent)

    @staticmethod
    def start_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto", persistent=False):
        return _run.start(Call("allgather", comm, smsg, rmsg, tuple(counts), tuple(displs),
                               None, algorithm), persistent=persistent)

    @staticmethod
    def run_allreduce(comm, smsg, rmsg, op, algorithm="auto"):
        return _run.run(Call("allreduce", comm, smsg, rmsg, None, None, op, algorithm))

    start_persistent = staticmethod(_run.start_persistent)
    free_persistent = staticmethod(_run.free_persistent)


def _msg(a):
    return msg_of_array(a, NUMPY)


def _tuned(window=2, segment_bytes=24):
    """A Dup of COMM_WORLD with small ring segments: many messages, many waits."""
    comm = WORLD.Dup()
    ctx = _context.context(comm)
    ctx.window, ctx.segment_bytes = window, segment_bytes
    return comm


def _want_allreduce(x):
    out = np.empty_like(x)
    WORLD.Allreduce(x, out, op=MPI.SUM)
    return out


def _want_reduce_scatter(x, counts):
    out = np.empty(counts[WORLD.Get_rank()])
    WORLD.Reduce_scatter(x, out, recvcounts=list(counts), op=MPI.SUM)
    return out


def _want_allgather(x, counts):
    out = np.empty(sum(counts))
    WORLD.Allgatherv(x, [out, list(counts)])
    return out


def _displs(counts):
    return [sum(counts[:r]) for r in range(len(counts))]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_place", [False, True])
def test_test_until_done_equals_wait(in_place):
    """Polling test() to completion gives what wait() gives, and test() never blocks."""
    comm = _tuned()
    try:
        x = rank_data(101, comm.Get_rank())
        want = _want_allreduce(x)
        results = []
        for mode in ("test", "wait"):
            y = x.copy()
            out = y if in_place else np.empty_like(x)
            op = _coll.start_allreduce(comm, None if in_place else _msg(y), _msg(out), MPI.SUM,
                                       "ring")
            assert op.algorithm == "ring"
            polls = 0
            if mode == "test":
                deadline = time.monotonic() + 30
                while not op.test():
                    polls += 1
                    assert time.monotonic() < deadline, "test() never completed"
            else:
                op.wait()
            assert op.done and op.test()
            results.append(out.copy())
        ok = util.same_bytes(results[0], want) and util.same_bytes(results[1], want)
        util.assert_all(comm, ok, f"test: {results[0][:4]}, wait: {results[1][:4]}, "
                                   f"want {want[:4]}")
    finally:
        comm.Free()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_three_collectives_in_flight_waited_in_reverse_order(algorithm):
    """AllReduce, ReduceScatter, AllGather started together and waited last-first."""
    comm = _tuned()
    try:
        n = comm.Get_size()
        x = rank_data(7 * n + 2, comm.Get_rank())
        counts = split(len(x), n)[0]
        g = rank_data(counts[comm.Get_rank()], comm.Get_rank(), salt=5)
        want = (_want_allreduce(x), _want_reduce_scatter(x, counts), _want_allgather(g, counts))
        ar = np.empty_like(x)
        rs = np.empty(counts[comm.Get_rank()])
        ag = np.empty(sum(counts))
        ops = [
            _coll.start_allreduce(comm, _msg(x), _msg(ar), MPI.SUM, algorithm),
            _coll.start_reduce_scatter(comm, _msg(x), _msg(rs), counts, _displs(counts), MPI.SUM,
                                       algorithm),
            _coll.start_allgather(comm, _msg(g), _msg(ag), counts, _displs(counts), algorithm),
        ]
        for op in reversed(ops):
            op.wait()
        ok = all(util.same_bytes(a, b) for a, b in zip((ar, rs, ag), want))
        util.assert_all(comm, ok and all(op.done for op in ops),
                         f"got {ar[:3]}, {rs[:3]}, {ag[:3]}")
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_operations_get_distinct_tags_and_disjoint_work_memory():
    """Two in-place ring AllReduces in flight hold disjoint work regions until they complete."""
    comm = _tuned(window=3, segment_bytes=16)
    try:
        ctx = _context.context(comm)
        x1, x2 = rank_data(60, comm.Get_rank()), rank_data(60, comm.Get_rank(), salt=3)
        want1, want2 = _want_allreduce(x1), _want_allreduce(x2)
        y1, y2 = x1.copy(), x2.copy()
        op1 = _coll.start_allreduce(comm, None, _msg(y1), MPI.SUM, "ring")
        op2 = _coll.start_allreduce(comm, None, _msg(y2), MPI.SUM, "ring")
        # (an operation whose peers were ahead may complete while it starts)
        live = ctx.work.live()
        expect = (not op1.done) + (not op2.done)
        # each in-place ring AllReduce holds its receive slots while in flight
        spans = sorted((a, b) for _, _, a, b in ctx.work.spans() if b > a)
        disjoint = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        tags = (op1.run.tag, op2.run.tag)
        op2.wait()
        op1.wait()
        ok = (len(live) == expect and disjoint and tags[0] != tags[1] and 0 not in tags
              and ctx.work.live() == [] and util.same_bytes(y1, want1)
              and util.same_bytes(y2, want2))
        util.assert_all(comm, ok, f"live {live}, spans {spans}, tags {tags}")
    finally:
        comm.Free()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_persistent_restarted_with_new_data(collective):
    """A persistent operation started again on new contents is right every time; free() is idempotent."""
    comm = _tuned()
    try:
        n, rank = comm.Get_size(), comm.Get_rank()
        ctx = _context.context(comm)
        N = 5 * n + 1
        counts = split(N, n)[0]
        x = np.empty(N if collective != "allgather" else counts[rank])
        if collective == "allreduce":
            out = np.empty(N)
            op = _coll.start_allreduce(comm, _msg(x), _msg(out), MPI.SUM, "ring", persistent=True)
        elif collective == "reduce_scatter":
            out = np.empty(counts[rank])
            op = _coll.start_reduce_scatter(comm, _msg(x), _msg(out), counts, _displs(counts),
                                            MPI.SUM, "ring", persistent=True)
        else:
            out = np.empty(N)
            op = _coll.start_allgather(comm, _msg(x), _msg(out), counts, _displs(counts), "ring",
                                       persistent=True)
        bad = []
        for step in range(4):
            x[...] = rank_data(len(x), comm.Get_rank(), salt=100 * step)
            if collective == "allreduce":
                want = _want_allreduce(x)
            elif collective == "reduce_scatter":
                want = _want_reduce_scatter(x, counts)
            else:
                want = _want_allgather(x, counts)
            _coll.start_persistent(op)
            op.wait()
            if not (op.done and util.same_bytes(out, want)):
                bad.append(f"start {step}: {out[:3]} want {want[:3]}")
        _coll.free_persistent(op)
        _coll.free_persistent(op)  # idempotent
        if ctx.work.live():
            bad.append(f"work memory held after free: {ctx.work.live()}")
        util.assert_all(comm, not bad, "; ".join(bad))
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_non_blocking_calls_are_counted_like_blocking_ones():
    """mpicoll.traffic() sees an operation completed by test() as it sees a blocking call."""
    comm = _tuned()
    try:
        x = rank_data(40, comm.Get_rank())
        out = np.empty_like(x)
        with mpicoll.traffic() as blocking:
            _coll.run_allreduce(comm, _msg(x), _msg(out), MPI.SUM, "ring")
        with mpicoll.traffic() as polled:
            op = _coll.start_allreduce(comm, _msg(x), _msg(out), MPI.SUM, "ring")
            while not op.test():
                pass
        a, b = blocking.calls[0], polled.calls[0]
        ok = (a.messages_sent, a.bytes_sent, a.messages_received, a.send_steps) == \
             (b.messages_sent, b.bytes_sent, b.messages_received, b.send_steps) \
            and (a.messages_sent or comm.size == 1)
        util.assert_all(comm, ok and util.same_bytes(out, _want_allreduce(x)), f"{a} vs {b}")
    finally:
        comm.Free()


def test_leases_released_out_of_order_never_alias():
    """Work memory of operations whose lifetimes do not nest: disjoint while live, then reused."""
    from mpicoll.engine.context import WorkMemory
    mem = WorkMemory()
    f8 = np.dtype(np.float64)
    a, b = mem.lease(NUMPY), mem.lease(NUMPY)
    ra = a.take(f8, 10, "first operation")
    rb = b.take(f8, 10, "second operation")
    assert not np.shares_memory(ra, rb)
    a.release()  # the first completes first
    c = mem.lease(NUMPY)
    rc = c.take(f8, 4, "third operation")
    assert not np.shares_memory(rc, rb)
    b.release()
    c.release()
    c.release()  # idempotent
    assert mem.live() == []
    before = mem.allocations
    d = mem.lease(NUMPY)
    d.take(f8, 20, "reuses the grown arena")
    d.release()
    assert mem.allocations == before


@pytest.mark.timeout(60)
def test_device_operations_started_together():
    """Two small non-blocking AllReduces of (fake) device arrays started together: both right.

    Device transport serves one call at a time per context (one pinned copy
    per context for small calls, WholeStage; the compute stream orders calls),
    so device operations run to the end when they start; two in flight at
    once shared that copy and hung.
    """
    from support import fakegpu

    from mpicoll.api.args import msg_of_array as as_msg
    comm = WORLD.Dup()
    try:
        be = fakegpu.fake_backend()
        rt = be.rt
        with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
            h1, h2 = rank_data(16, comm.Get_rank()), rank_data(16, comm.Get_rank(), salt=9)
            x1, x2 = fakegpu.produce(rt, h1), fakegpu.produce(rt, h2)
            y1, y2 = rt.xp.empty(16, np.float64), rt.xp.empty(16, np.float64)
            op1 = _coll.start_allreduce(comm, as_msg(x1, be), as_msg(y1, be), MPI.SUM, "auto")
            op2 = _coll.start_allreduce(comm, as_msg(x2, be), as_msg(y2, be), MPI.SUM, "auto")
            op2.wait()
            op1.wait()
            got1, got2 = y1.get(), y2.get()
        ok = util.same_bytes(got1, _want_allreduce(h1)) and util.same_bytes(got2,
                                                                             _want_allreduce(h2))
        util.assert_all(comm, ok, f"got {got1[:3]}, {got2[:3]}")
    finally:
        comm.Free()
