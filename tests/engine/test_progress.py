"""The progress engine: operations in flight complete in any order, threads, lifecycle.

Every wait advances every operation in flight (MPI's progress rule), so no
order in which ranks complete their operations can hang, with blocking calls
among them, the fingerprint check on, a communicator set up meanwhile, the
progress thread on or off.  No lock is held across an MPI wait, so two threads
on two communicators proceed independently.  A failed operation keeps failing;
timeouts fire while the caller only polls ``test()``; a communicator freed with
operations in flight lets them complete.

Below the public API, the executor's operations (``mpicoll.engine.run.start`` on
a validated Call, the interface the non-blocking and persistent API is built on):
resumable, several in flight with their own tags and work memory, persistent
ones restarted on new data, counted like blocking calls.

Data is rank-asymmetric and exactly summable; results are compared bitwise with
the exact sum or MPI's built-in on the same input.  Each test that could hang
runs under a timeout (pytest-timeout), and the communicators it uses are its
own (``WORLD.Dup()``).
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
from mpi4py import MPI
from support import fakegpu, util
from support.data import rank_data, rank_sum

import mpicoll
from mpicoll.algorithms.ring import split
from mpicoll.api import args as _args
from mpicoll.api.args import msg_of_array
from mpicoll.backends.host import NUMPY
from mpicoll.core.types import Call
from mpicoll.engine import context as _context
from mpicoll.engine import run as _run
from mpicoll.observe import calls as _calls

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
# The orders of completion: 1 rank has nothing to overlap; 2: two ranks in opposite
# orders; 3: odd ranks, a third order and uneven blocks.  More ranks add no order the
# rank-dependent permutations miss.  (The executor's tests below run at every count.)
ORDERS = pytest.mark.ranks(2, 3)


# --- operations in flight through the public API, in every order -------------------

@pytest.fixture(params=[False, True], ids=["no-thread", "progress-thread"])
def progress(request):
    with mpicoll.options(progress=request.param):
        yield request.param


@ORDERS
@pytest.mark.timeout(60)
@pytest.mark.parametrize("timeout", [None, 30.0], ids=["untimed", "timed"])
def test_blocking_call_among_operations_completed_in_other_orders(progress, timeout):
    """Rank 0: A started, A waited, blocking B; rank 1: A started, blocking B, A waited.

    MPI's own Iallreduce/Allreduce complete this; a blocking call that advanced
    nothing else (a fused Sendrecv, a lock held across the wait) hung.  Repeated,
    so the blocking call is a start of its remembered operation too (with its deadline under a timeout).
    """
    comm = WORLD.Dup()
    try:
        a, b = rank_data(1000, RANK, salt=1), rank_data(10, RANK, salt=2)
        out_b = np.empty_like(b)
        for _ in range(4):
            h = mpicoll.iallreduce(a, comm=comm, algorithm="ring")
            if RANK % 2 == 0:
                got_a = h.wait()
                mpicoll.allreduce(b, comm=comm, out=out_b, timeout=timeout)
            else:
                mpicoll.allreduce(b, comm=comm, out=out_b, timeout=timeout)
                got_a = h.wait()
            np.testing.assert_array_equal(got_a, rank_sum(1000, SIZE, salt=1))
            np.testing.assert_array_equal(out_b, rank_sum(10, SIZE, salt=2))
    finally:
        comm.Free()


@ORDERS
@pytest.mark.timeout(60)
def test_first_call_on_a_new_communicator_among_operations_in_flight(progress):
    """The blocking call is the first on its communicator: its set-up advances the others."""
    comm = WORLD.Dup()
    try:
        a, b = rank_data(500, RANK, salt=3), rank_data(7, RANK, salt=4)
        h = mpicoll.iallreduce(a, comm=comm, algorithm="ring")
        fresh = WORLD.Dup()
        try:
            if RANK % 2 == 0:
                got_a = h.wait()
                got_b = mpicoll.allreduce(b, comm=fresh)
            else:
                got_b = mpicoll.allreduce(b, comm=fresh)
                got_a = h.wait()
        finally:
            fresh.Free()
        np.testing.assert_array_equal(got_a, rank_sum(500, SIZE, salt=3))
        np.testing.assert_array_equal(got_b, rank_sum(7, SIZE, salt=4))
    finally:
        comm.Free()


@ORDERS
@pytest.mark.timeout(120)
@pytest.mark.parametrize("check, timeout", [(False, None), (True, 30.0), (False, 30.0)],
                         ids=["plain", "check", "timed"])
def test_operations_waited_in_every_order(progress, check, timeout, monkeypatch):
    """Three operations (three algorithms, two forms) and a blocking call, each rank
    completing them in its own order (a permutation chosen by rank), with the fingerprint
    check on or off and a timeout that must not fire.  The same arrays every time, their
    contents changed in place: from the second time the calls with ``out`` restart their
    kept operations (checked ones running the check, timed ones under their deadline)."""
    comm = WORLD.Dup()
    mc = mpicoll.Comm(comm)
    orders = list(itertools.permutations(range(4)))
    xs = [np.empty(n) for n in (3, 300, 5000)]
    ys = [np.empty_like(x) for x in xs]
    blocking_in, blocking_out = np.empty(4), np.empty(4)
    checks = util.spy(monkeypatch, _args, ["allreduce", "Allreduce"])
    try:
        with mpicoll.options(check=check, timeout=timeout):
            for rep in range(4):
                before = len(checks)
                for k, x in enumerate(xs):
                    x[:] = rank_data(len(x), RANK, salt=rep * 10 + k)
                    ys[k][:] = -1
                blocking_in[:] = rank_data(4, RANK, salt=rep * 10 + 5)
                work = [mpicoll.iallreduce(xs[0], comm=comm, algorithm="recursive_doubling"),
                        mc.Iallreduce(xs[1], ys[1]),
                        mpicoll.iallreduce(xs[2], comm=comm, algorithm="ring", out=ys[2])]
                for k in orders[(RANK + rep) % len(orders)]:
                    if k == 3:
                        mc.Allreduce(blocking_in, blocking_out)
                    elif k == 0:
                        ys[0] = work[0].wait()
                    elif k == 1:
                        work[1].Wait()
                    else:
                        work[2].wait()
                for k, x in enumerate(xs):
                    np.testing.assert_array_equal(ys[k], rank_sum(len(x), SIZE, salt=rep * 10 + k))
                np.testing.assert_array_equal(blocking_out, rank_sum(4, SIZE, salt=rep * 10 + 5))
                # validated: the call without out, and every call the first time
                assert len(checks) - before == (4 if rep == 0 else 1), checks[before:]
    finally:
        comm.Free()


@ORDERS
@pytest.mark.timeout(60)
def test_check_on_with_operations_started_in_other_orders():
    """MPICOLL_CHECK with A and B in flight: rank 0 starts A, waits A, starts B, waits B;
    rank 1 starts A, starts B, waits A, waits B (it hung; with a timeout too it raised a
    false CollectiveTimeout)."""
    comm = WORLD.Dup()
    try:
        for timeout in (None, 20.0):
            with mpicoll.options(check=True, timeout=timeout):
                a, b = rank_data(200, RANK, salt=6), rank_data(9, RANK, salt=7)
                ha = mpicoll.iallreduce(a, comm=comm, algorithm="ring")
                if RANK % 2 == 0:
                    got_a = ha.wait()
                    got_b = mpicoll.iallreduce(b, comm=comm).wait()
                else:
                    hb = mpicoll.iallreduce(b, comm=comm)
                    got_a = ha.wait()
                    got_b = hb.wait()
            np.testing.assert_array_equal(got_a, rank_sum(200, SIZE, salt=6))
            np.testing.assert_array_equal(got_b, rank_sum(9, SIZE, salt=7))
    finally:
        comm.Free()


@ORDERS
@pytest.mark.timeout(60)
def test_two_threads_on_two_communicators():
    """Each rank runs two threads, one per communicator; even ranks start on c1 first,
    odd ranks on c2 first (with a lock held across MPI waits this deadlocked)."""
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("needs MPI_THREAD_MULTIPLE")
    c1, c2 = WORLD.Dup(), WORLD.Dup()
    errors, results = [], {}
    first_started = threading.Event()

    def worker(comm, key, salt, wait_first):
        try:
            if wait_first:
                first_started.wait(5.0)
                time.sleep(0.2)  # the other thread is inside its first call by now
            else:
                first_started.set()
            got = []
            x = rank_data(2000, RANK, salt=salt)
            out = np.empty_like(x)
            for _ in range(5):
                got.append(mpicoll.allreduce(x, comm=comm, algorithm="ring"))
                got.append(mpicoll.iallreduce(x, comm=comm).wait())
                # (from the second time a restart of its remembered operation, engine.cache)
                got.append(mpicoll.iallreduce(x, comm=comm, out=out, timeout=30.0).wait().copy())
            results[key] = got
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    even = RANK % 2 == 0
    t1 = threading.Thread(target=worker, args=(c1, "c1", 1, not even))
    t2 = threading.Thread(target=worker, args=(c2, "c2", 2, even))
    t1.start()
    t2.start()
    t1.join(40.0)
    t2.join(40.0)
    alive = t1.is_alive() or t2.is_alive()
    assert not alive, "threads on two communicators did not finish"
    assert not errors, errors
    for key, salt in (("c1", 1), ("c2", 2)):
        for got in results[key]:
            np.testing.assert_array_equal(got, rank_sum(2000, SIZE, salt=salt))
    c1.Free()
    c2.Free()


@ORDERS
@pytest.mark.timeout(60)
def test_communicator_freed_with_operations_in_flight(progress):
    """MPI_Comm_free marks for deallocation; pending operations complete normally
    (mpicoll freed its duplicate at once: MPI_ERR_COMM on Open MPI, a hang on MPICH)."""
    n = 300_000  # the ring posts most of its segments after the free
    for order in range(2):
        comm = WORLD.Dup()
        mc = mpicoll.Comm(comm, algorithm="ring")
        x, y = rank_data(n, RANK, salt=8), np.empty(n)
        h = mpicoll.iallreduce(rank_data(10, RANK, salt=9), comm=comm)
        req = mc.Iallreduce(x, y)
        comm.Free()
        if (RANK + order) % 2:
            got = h.wait()
            req.Wait()
        else:
            req.Wait()
            got = h.wait()
        np.testing.assert_array_equal(got, rank_sum(10, SIZE, salt=9))
        np.testing.assert_array_equal(y, rank_sum(n, SIZE, salt=8))


@pytest.mark.timeout(60)
@pytest.mark.ranks(2, 3)  # a rank that never joins needs a peer
def test_timeout_fires_while_the_caller_polls_test(progress):
    """A rank that never joins: polling ``test()`` raises CollectiveTimeout within the
    timeout (it stayed False after 4x the timeout), and keeps raising it after that, as
    does ``wait()`` (the handle reported success)."""
    if SIZE < 2:
        pytest.skip("needs a peer")
    comm = WORLD.Dup()
    mpicoll.allreduce(np.ones(1), comm=comm)  # the context set up on every rank
    outcome = None
    if RANK == 0:
        h = mpicoll.iallreduce(rank_data(5, RANK, salt=10), comm=comm, timeout=0.25)
        t0 = time.perf_counter()
        try:
            while time.perf_counter() - t0 < 4.0:
                if h.test():
                    outcome = "completed"
                    break
                time.sleep(0.001)
            else:
                outcome = "no timeout"
        except mpicoll.CollectiveTimeout:
            outcome = "timeout"
            again = []
            for attempt in (h.test, h.wait):
                try:
                    attempt()
                    again.append("returned")
                except mpicoll.CollectiveTimeout:
                    again.append("raised")
            assert again == ["raised", "raised"], again
        assert time.perf_counter() - t0 < 2.0
    WORLD.Barrier()
    assert outcome in (None, "timeout"), outcome


@pytest.mark.timeout(60)
@pytest.mark.ranks(2, 3)
def test_request_keeps_raising_after_a_timeout():
    """``Comm.Iallreduce``'s request, timed out under ``Wait``: ``Test`` and ``Wait`` raise
    again (a second Wait returned with nothing)."""
    if SIZE < 2:
        pytest.skip("needs a peer")
    comm = WORLD.Dup()
    mc = mpicoll.Comm(comm)
    mc.Allreduce(np.ones(1), np.empty(1))
    raised = []
    if RANK == 0:
        with mpicoll.options(timeout=0.25):
            req = mc.Iallreduce(rank_data(5, RANK, salt=11), np.empty(5))
        for attempt in (req.Wait, req.Test, req.Wait):
            try:
                attempt()
                raised.append(False)
            except mpicoll.CollectiveTimeout:
                raised.append(True)
    WORLD.Barrier()
    assert raised in ([], [True, True, True]), raised


@ORDERS
@pytest.mark.timeout(60)
def test_persistent_start_on_an_unusable_communicator_sends_nothing():
    """After a timeout marks a communicator unusable, ``Start()`` raises MpicollError before
    sending, as Allreduce and Iallreduce do (it used to send anyway)."""
    comm = WORLD.Dup()
    mc = mpicoll.Comm(comm)
    x, y = rank_data(6, RANK, salt=12), np.empty(6)
    req = mc.Allreduce_init(x, y)
    req.Start()
    req.Wait()
    np.testing.assert_array_equal(y, rank_sum(6, SIZE, salt=12))
    ctx = _context.context(comm)
    setattr(ctx, _calls._BROKEN, "allreduce #9 timed out on rank 0 (a test)")
    with mpicoll.traffic() as t:
        for call in (req.Start, lambda: mc.Allreduce(x, y), lambda: mc.Iallreduce(x, y)):
            with pytest.raises(mpicoll.MpicollError, match="unusable"):
                call()
    assert not t.calls
    req.Free()
    delattr(ctx, _calls._BROKEN)
    comm.Free()


@ORDERS
@pytest.mark.timeout(60)
def test_a_comm_made_with_an_algorithm_forces_it_for_the_array_functions():
    """``allreduce(x, comm=mpicoll.Comm(W, algorithm="ring"))`` runs the ring (it ran
    recursive doubling), as the README says such a Comm does for every call."""
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm, algorithm="ring")
        x = rank_data(8, RANK, salt=13)
        with mpicoll.traffic() as t:
            got = mpicoll.allreduce(x, comm=mc)
            mpicoll.allgather(x, comm=mc)
            mpicoll.iallreduce(x, comm=mc).wait()
        np.testing.assert_array_equal(got, rank_sum(8, SIZE, salt=13))
        assert [c.algorithm for c in t.calls] == ["ring"] * 3
        with mpicoll.traffic() as t:  # bruck exists for AllGather only: the others stay auto
            mpicoll.allreduce(x, comm=mpicoll.Comm(comm, algorithm="bruck"))
        assert t.calls[0].algorithm != "bruck"
    finally:
        comm.Free()


# --- the executor's operations ----------------------------------------------------

class _coll:
    """The engine's run path on Calls made here (what api.args makes from arguments)."""

    @staticmethod
    def _start(call, persistent):
        return _run.persistent(call) if persistent else _run.start(call)

    @staticmethod
    def start_allreduce(comm, smsg, rmsg, op, algorithm="auto", persistent=False):
        return _coll._start(Call("allreduce", comm, smsg, rmsg, None, None, op, algorithm),
                            persistent)

    @staticmethod
    def start_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto",
                             persistent=False):
        return _coll._start(Call("reduce_scatter", comm, smsg, rmsg, tuple(counts),
                                 tuple(displs), op, algorithm), persistent)

    @staticmethod
    def start_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto", persistent=False):
        return _coll._start(Call("allgather", comm, smsg, rmsg, tuple(counts), tuple(displs),
                                 None, algorithm), persistent)

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
        tags = (op1.ch.tag, op2.ch.tag)  # (each one's: the tag of its call number)
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
    mem = _context.WorkMemory()
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
    comm = WORLD.Dup()
    try:
        be = fakegpu.fake_backend()
        rt = be.rt
        with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
            h1, h2 = rank_data(16, comm.Get_rank()), rank_data(16, comm.Get_rank(), salt=9)
            x1, x2 = fakegpu.produce(rt, h1), fakegpu.produce(rt, h2)
            y1, y2 = rt.xp.empty(16, np.float64), rt.xp.empty(16, np.float64)
            op1 = _coll.start_allreduce(comm, msg_of_array(x1, be), msg_of_array(y1, be), MPI.SUM, "auto")
            op2 = _coll.start_allreduce(comm, msg_of_array(x2, be), msg_of_array(y2, be), MPI.SUM, "auto")
            op2.wait()
            op1.wait()
            got1, got2 = y1.get(), y2.get()
        ok = util.same_bytes(got1, _want_allreduce(h1)) and util.same_bytes(got2,
                                                                             _want_allreduce(h2))
        util.assert_all(comm, ok, f"got {got1[:3]}, {got2[:3]}")
    finally:
        comm.Free()
