"""Timeouts instead of hangs (run under an MPI launcher at any rank count).

A rank that skips a collective makes the others raise CollectiveTimeout
within the timeout (plus a margin for a loaded machine), naming the call, the
step and the peer waited on; the communicator is then refused.  A healthy
collective under a timeout gives exactly the results it gives without one.
Whole-job behaviour (the job ends, the message reaches stderr) is in
tests/launch/test_launch_timeout.py.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll
from mpicoll.engine import context as _context
from mpicoll.engine import select as _select
from mpicoll.transport import channel as _channel
from mpicoll.transport import timeout as _timeout

# timeouts: 1 rank, 2 (a power of two), 3 (not); the long healthy transfer below at 4
pytestmark = [pytest.mark.timeout(90), pytest.mark.ranks(1, 2, 3)]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SKIPPER = 1
T = 0.25         # timeout used here (seconds): short, a missing rank is never coming
MARGIN = 4.0     # allowed lateness on an oversubscribed, shared machine


def ref_allreduce(x, op=MPI.SUM):
    out = np.empty_like(x)
    WORLD.Allreduce(x, out, op)
    return out


# -- the polling loop on its own ----------------------------------------------------------
class FakeReq:
    """Completes ``after`` seconds after creation."""

    def __init__(self, after, kind="recv"):
        self.at = time.perf_counter() + after
        self.kind = kind

    def Test(self):
        return time.perf_counter() >= self.at


class Pending:
    def __init__(self, req):
        self.req, self.kind, self.done = req, req.kind, None


def _expired(left, idle):
    return mpicoll.CollectiveTimeout(f"{len(left)} left after {idle:.3f} s")


def test_progress_restarts_the_deadline():
    """Four completions 0.1 s apart never time out at 0.25 s, though they take 0.4 s."""
    reqs = [Pending(FakeReq(0.1 * (i + 1))) for i in range(4)]
    t0 = time.perf_counter()
    _timeout.wait(reqs, 0.25, _expired, _timeout.tester(reqs))
    assert time.perf_counter() - t0 >= 0.39
    assert all(r.done is not None for r in reqs)
    assert [r.done for r in reqs] == sorted(r.done for r in reqs)


def test_stall_raises_after_timeout_without_progress():
    reqs = [Pending(FakeReq(0.1)), Pending(FakeReq(60.0))]
    t0 = time.perf_counter()
    with pytest.raises(mpicoll.CollectiveTimeout, match=r"^1 left after ") as info:
        _timeout.wait(reqs, 0.2, _expired, _timeout.tester(reqs))
    elapsed = time.perf_counter() - t0
    assert 0.2 <= float(str(info.value).split()[3]) < 1.2  # idle: the timeout (+ a late poll)
    assert 0.29 <= elapsed < 0.3 + 0.2 + 1.0  # 0.1 s of progress + 0.2 s idle (+ slack)
    assert reqs[0].done is not None and reqs[1].done is None


def test_deadline_passed_while_this_process_was_paused():
    """A completion that happened while this rank itself was paused past the deadline counts.

    The clock jumps past the timeout between a poll that saw nothing and the
    next one; the request completed meanwhile, so the wait must return.
    """
    now = [0.0]
    polls = []

    def clock():
        return now[0]

    def test(left):
        polls.append(now[0])
        if len(polls) == 1:
            now[0] = 10.0  # paused for 10 s right after this poll saw nothing
            return [], False
        return list(range(len(left))), True

    reqs = [Pending(FakeReq(60.0))]
    _timeout.wait(reqs, 0.5, _expired, test, clock=clock)
    assert reqs[0].done == 10.0 and len(polls) == 2


def test_requests_that_cannot_be_polled():
    class Opaque:
        kind = "send"
        req = object()
        done = None

    assert _timeout.tester([Opaque()]) is None
    assert _timeout.tester([Opaque()], channel_test=lambda req: True) is not None


# -- a rank that skips a collective ----------------------------------------------------------
def _skip_one(comm, run):
    """Rank SKIPPER skips ``run(comm)``; returns (exception or None, seconds) on the others."""
    exc, elapsed = None, 0.0
    if RANK != SKIPPER:
        t0 = time.perf_counter()
        try:
            run(comm)
        except mpicoll.CollectiveTimeout as e:
            exc = e
        elapsed = time.perf_counter() - t0
    return exc, elapsed


def _fresh_comm():
    comm = WORLD.Dup()
    mpicoll.allreduce(rank_data(4, RANK), comm=comm)  # call #1: context created, all healthy
    return comm


def _discard(comm):
    """Receive and drop the messages the timed-out call left unmatched, then free ``comm``.

    Needed to run more tests in this job: MPICH reuses a freed communicator's
    context id, so a stale message would be matched on a later communicator.
    (A real job ends after a timeout: mpicoll.abort.)
    """
    WORLD.Barrier()
    private = _context.context(comm).comm
    status = MPI.Status()
    quiet_until = time.perf_counter() + 0.3
    while time.perf_counter() < quiet_until:
        if private.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            buf = bytearray(status.Get_count(MPI.BYTE))
            private.Recv([buf, MPI.BYTE], status.Get_source(), status.Get_tag())
            quiet_until = time.perf_counter() + 0.3
    WORLD.Barrier()
    comm.Free()


@pytest.mark.skipif(SIZE < 2, reason="needs a second rank to skip the call")
@pytest.mark.parametrize("collective, algorithm", [
    (c, a) for c, table in _select.ALGORITHMS.items() for a in table])
def test_skipped_call_times_out_on_the_others(collective, algorithm):
    comm = _fresh_comm()
    fn = getattr(mpicoll, collective)
    x = rank_data(8 * SIZE, RANK)  # small: eager sends, nothing left pending at the skipper

    exc, elapsed = _skip_one(comm, lambda c: fn(x, comm=c, algorithm=algorithm, timeout=T))
    problem = ""
    if RANK != SKIPPER:
        if exc is None:
            problem = "no CollectiveTimeout"
        else:
            msg = str(exc)
            for part in (f"{collective} #2 ({algorithm}, ", f"on rank {RANK}: no progress for ",
                         f"(timeout {T:g} s)", f"rank {exc.peer}", "mpicoll.abort()"):
                if part not in msg:
                    problem += f"{part!r} missing from {msg!r}; "
            if not T <= elapsed <= T + MARGIN:
                problem += f"raised after {elapsed:.2f} s, expected {T} s"
            if exc.seq != 2 or exc.collective != collective or exc.algorithm != algorithm:
                problem += f"attributes {exc.seq} {exc.collective} {exc.algorithm}; "
            if exc.phase not in ("send", "recv") or exc.rank != RANK or exc.timeout != T:
                problem += f"attributes {exc.phase} {exc.rank} {exc.timeout}; "
            if algorithm == "ring" and (exc.step is None or "step " not in msg):
                problem += "no step named; "
            if exc.step is None and algorithm != "ring" and "round" not in msg and "step" not in msg:
                problem += "neither step nor round named; "
    peers = WORLD.allgather(None if exc is None else exc.peer)
    util.assert_all(WORLD, not problem, problem)
    # somebody waits on the skipper itself
    assert SKIPPER in peers

    # the communicator is refused afterwards where it timed out, before any message
    refused = ""
    if RANK != SKIPPER:
        try:
            mpicoll.allreduce(rank_data(4, RANK), comm=comm)
            refused = "a call on the timed-out communicator was accepted"
        except mpicoll.MpicollError as e:
            if "communicator unusable" not in str(e) or f"#2 timed out on rank {RANK}" not in str(e):
                refused = f"unexpected message: {e}"
    util.assert_all(WORLD, not refused, refused)
    _discard(comm)
    # and everything else still works
    y = mpicoll.allreduce(rank_data(10, RANK))
    assert np.array_equal(y, ref_allreduce(rank_data(10, RANK)))


@pytest.mark.skipif(SIZE < 2, reason="needs a second rank to skip the call")
def test_skipped_call_times_out_in_the_check():
    comm = _fresh_comm()
    with mpicoll.options(check=True, timeout=T):
        exc, elapsed = _skip_one(comm, lambda c: mpicoll.allreduce(rank_data(3, RANK), comm=c))
    problem = ""
    if RANK != SKIPPER:
        if exc is None:
            problem = "no CollectiveTimeout"
        elif exc.phase != "check" or "agreeing on the call fingerprint (MPICOLL_CHECK)" not in str(exc):
            problem = f"not the check phase: {exc}"
        elif not T <= elapsed <= T + MARGIN:
            problem = f"raised after {elapsed:.2f} s"
    util.assert_all(WORLD, not problem, problem)
    _discard(comm)


# -- healthy collectives under a timeout ------------------------------------------------------
@pytest.mark.parametrize("how", ["argument", "configure", "environment"])
def test_healthy_calls_are_unchanged(how, monkeypatch):
    """Polling moves the same data: many segments, every collective, both APIs."""
    if how == "environment":  # read when the communicator is set up
        monkeypatch.setenv("MPICOLL_TIMEOUT", "30")
    comm = WORLD.Dup()
    _context.context(comm).segment_bytes = 256  # many segments per block
    kw = {"timeout": 30.0} if how == "argument" else {}
    previous = mpicoll.configure(timeout=30.0) if how == "configure" else None
    try:
        for n in (0, 1, SIZE + 1, 3001):
            x = rank_data(n, RANK)
            for algo in ("ring", "recursive_doubling"):
                y = mpicoll.allreduce(x, comm=comm, algorithm=algo, **kw)
                assert np.array_equal(y, ref_allreduce(x)), (n, algo)
        counts = [(r * 37) % 101 for r in range(SIZE)]
        g = mpicoll.allgather(rank_data(counts[RANK], RANK), comm=comm, counts=counts, **kw)
        assert np.array_equal(g, np.concatenate(WORLD.allgather(rank_data(counts[RANK], RANK))))
        x = rank_data(sum(counts), RANK)
        r = mpicoll.reduce_scatter(x, comm=comm, counts=counts, **kw)
        lo = sum(counts[:RANK])
        assert np.array_equal(r, ref_allreduce(x)[lo: lo + counts[RANK]])
        c = mpicoll.Comm(comm)
        out = np.empty(500)
        c.Allreduce(rank_data(500, RANK), out)
        assert np.array_equal(out, ref_allreduce(rank_data(500, RANK)))
    finally:
        if previous is not None:
            mpicoll.configure(**previous)
        comm.Free()


@pytest.mark.parametrize("value, exc", [(0, ValueError), (-1.0, ValueError), ("5", TypeError),
                                        (True, TypeError)])
def test_timeout_argument_is_checked(value, exc):
    x = rank_data(4, RANK)
    before = x.copy()
    with pytest.raises(exc, match="^timeout: expected"):
        mpicoll.allreduce(x, timeout=value)
    with pytest.raises(exc, match="^timeout: expected"):
        mpicoll.configure(timeout=value)
    assert np.array_equal(x, before)


def test_bad_environment_value(monkeypatch):
    monkeypatch.setenv("MPICOLL_TIMEOUT", "soon")  # read when a communicator is set up
    comm = WORLD.Dup()
    try:
        with pytest.raises(ValueError,
                           match="MPICOLL_TIMEOUT: expected a number of seconds, got 'soon'"):
            mpicoll.allreduce(rank_data(4, RANK), comm=comm)
    finally:
        comm.Free()


def test_abort_checks_its_arguments_first():
    """Wrong arguments raise instead of aborting the job."""
    with pytest.raises(TypeError, match="^comm: expected an mpi4py.MPI.Comm, got str"):
        mpicoll.abort("world")
    with pytest.raises(TypeError, match="^errorcode: expected an int, got float"):
        mpicoll.abort(errorcode=1.5)


# -- a healthy transfer much longer than the timeout ----------------------------------------
# The timeout bounds silence, not the call: messages are cut into pieces (_channel.Pieces),
# each completion restarts the deadline.  Before, a non-ring algorithm sent a whole array
# as one message and timed out while data was moving.  Power-of-two rank counts only: at
# other counts the fold step of some algorithms waits, by design, while a peer reduces a
# whole array locally, which is silence (docs/reliability.md).
LONG_N = 16_000_000  # float64 per rank: 128 MB


@functools.lru_cache(maxsize=1)
def long_data():
    """rank_data(LONG_N, RANK) and its MPI AllReduce, made once for every case below (inputs only read)."""
    x = rank_data(LONG_N, RANK)
    return x, ref_allreduce(x)


@pytest.fixture(scope="module", autouse=True)
def _drop_long_data():
    yield
    long_data.cache_clear()  # (256 MB per rank)


@pytest.mark.timeout(300)
# a power of two: 4, where every algorithm takes several steps over the same pieces as at 2
# (at 2 the calls end too fast here to show anything: ~0.1 s under the 0.5 s minimum timeout)
@pytest.mark.ranks(4)
@pytest.mark.skipif(SIZE < 2 or SIZE & (SIZE - 1), reason="needs a power-of-two rank count > 1")
@pytest.mark.parametrize("collective, algorithm", [
    (c, a) for c, table in _select.ALGORITHMS.items() for a in table])
def test_healthy_transfer_longer_than_timeout(collective, algorithm):
    """Every algorithm moves 128 MB per rank under a timeout of ~1/4 of the call's time.

    The call is timed here first (under a long timeout: polled as in the test),
    so the timeout scales with this machine's speed and load (a whole-array
    message, as the algorithms other than the ring send, takes longer).  At
    least 0.5 s: on an oversubscribed machine a load spike between the two
    calls must not pass for a defect.  A call shorter than 1.5 timeouts shows
    nothing and is skipped (MPICH moves 128 MB within 0.5 s here).
    """
    comm = WORLD.Dup()
    x, full = long_data()
    if collective == "allgather":
        x = x[: LONG_N // SIZE]
    fn = getattr(mpicoll, collective)
    fn(x, comm=comm, algorithm=algorithm, timeout=120.0)  # warm-up (set-up, page faults)
    WORLD.Barrier()
    t0 = time.perf_counter()
    fn(x, comm=comm, algorithm=algorithm, timeout=120.0)
    timeout = min(max(WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX) / 4, 0.5), 5.0)
    exc, got = None, None
    WORLD.Barrier()  # (a rank arriving late is silence, not what this tests)
    t0 = time.perf_counter()
    try:
        got = fn(x, comm=comm, algorithm=algorithm, timeout=timeout)
    except mpicoll.MpicollError as e:
        exc = e
    elapsed = WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    if collective == "allreduce":
        ref = full
    elif collective == "reduce_scatter":
        ref = np.array_split(full, SIZE)[RANK]
    else:
        ref = np.concatenate(WORLD.allgather(x))
    ok = exc is None and np.array_equal(got, ref)
    if WORLD.allreduce(not ok):
        _discard(comm)  # (drop what the failed call left in flight)
    else:
        comm.Free()
    util.assert_all(WORLD, ok, f"{algorithm} {collective} under timeout={timeout:.2f} s "
                                f"(call took {elapsed:.2f} s): {exc or 'wrong result'}")
    if elapsed < 1.5 * timeout:  # (the same on every rank)
        pytest.skip(f"the call took {elapsed:.2f} s, under 1.5 times the timeout {timeout:.2f} s: "
                    f"too fast here to show anything")


@pytest.mark.skipif(SIZE < 2, reason="needs a peer")
def test_large_message_shows_progress_per_piece(monkeypatch):
    """Under a timeout a 64 MiB message reports progress every few pieces, not once at its end.

    The mechanism behind the test above, independent of this machine's speed:
    the polling wait must see a completion at least every WINDOW pieces.
    """
    events = []
    original = _timeout.tester

    def spy(*args, **kwargs):
        run = original(*args, **kwargs)
        if run is None:
            return None

        def counted(left):
            got = run(left)
            if got[1] if isinstance(got, tuple) else bool(got):
                events.append(time.perf_counter())
            return got
        return counted

    monkeypatch.setattr(_timeout, "tester", spy)
    comm = WORLD.Dup()
    n = 8 << 20  # float64: 64 MiB
    x = rank_data(n, RANK)
    y = mpicoll.allreduce(x, comm=comm, algorithm="recursive_doubling", timeout=60.0)
    # (the fewest pieces any of its messages is cut into: to a rank of this node, if any)
    local = _context.context(comm).local
    others_local = any(v for r, v in enumerate(local) if r != RANK)
    pieces = n * 8 // (_channel.LOCAL_PIECE_BYTES if others_local else _channel.PIECE_BYTES)
    ok = np.array_equal(y, ref_allreduce(x)) and len(events) >= pieces // _timeout.WINDOW
    util.assert_all(WORLD, ok, f"{len(events)} progress events for {pieces} pieces per message")
    comm.Free()


@pytest.mark.timeout(60)
@pytest.mark.skipif(SIZE < 2, reason="needs a second rank to skip the call")
def test_plan_does_not_run_after_a_timeout():
    """The same buffers as a plain call remembered (engine.cache): after a call on the
    communicator timed out, they are refused like any other call, not started again from the cache."""
    comm = _fresh_comm()
    mc = mpicoll.Comm(comm)
    x = rank_data(5, RANK)
    y = np.empty_like(x)
    mc.Allreduce(x, y)  # plain: remembered as Comm.Allreduce
    mc.Allreduce(x, y)  # run from it
    with mpicoll.options(timeout=T):
        exc, _ = _skip_one(comm, lambda c: mc.Allreduce(x, y))
    refused = ""
    if RANK != SKIPPER:
        if exc is None:
            refused = "no CollectiveTimeout; "
        try:
            mc.Allreduce(x, y)
            refused += "a call with the remembered buffers was accepted"
        except mpicoll.MpicollError as e:
            if "communicator unusable" not in str(e):
                refused += f"unexpected message: {e}"
    util.assert_all(WORLD, not refused, refused)
    _discard(comm)


def _a_timed_plan_times_out(collective, algorithm, monkeypatch, call):
    """Calls #2 and #3 of ``call(comm, x, out)`` are remembered with their timeout and started again; rank
    SKIPPER skips #4, and the others raise the CollectiveTimeout the general path raises
    (call, step, peer, abort advice) in time, without validating the call; the
    communicator is refused afterwards."""
    from mpicoll.api import args as _args
    comm = _fresh_comm()
    x = rank_data(4 * SIZE, RANK)
    out = np.empty(x.size * SIZE if collective == "allgather"
                   else 4 if collective == "reduce_scatter" else x.size)
    want = getattr(mpicoll, collective)(x, comm=WORLD, algorithm=algorithm)
    call(comm, x, out)  # call #2: remembered
    call(comm, x, out)  # #3: runs from it
    np.testing.assert_array_equal(out, want)
    checks = util.spy(monkeypatch, _args, [collective])
    exc, elapsed = _skip_one(comm, lambda c: call(c, x, out))
    problem = ""
    if RANK != SKIPPER:
        if checks:
            problem = "the repeat was validated (not started again from the cache); "
        if exc is None:
            problem += "no CollectiveTimeout"
        else:
            msg = str(exc)
            for part in (f"{collective} #4 ({algorithm}, ", f"on rank {RANK}: no progress for ",
                         f"(timeout {T:g} s)", f"rank {exc.peer}", "step ", "mpicoll.abort()"):
                if part not in msg:
                    problem += f"{part!r} missing from {msg!r}; "
            if not T <= elapsed <= T + MARGIN:
                problem += f"raised after {elapsed:.2f} s, expected {T} s"
            if (exc.seq, exc.collective, exc.algorithm, exc.rank) != (4, collective, algorithm,
                                                                      RANK):
                problem += f"attributes {exc.seq} {exc.collective} {exc.algorithm} {exc.rank}"
    util.assert_all(WORLD, not problem, problem)
    refused = ""
    if RANK != SKIPPER:
        try:
            call(comm, x, out)
            refused = "a call with the remembered arrays was accepted"
        except mpicoll.MpicollError as e:
            if "communicator unusable" not in str(e):
                refused = f"unexpected message: {e}"
    util.assert_all(WORLD, not refused, refused)
    _discard(comm)


@pytest.mark.timeout(60)
@pytest.mark.skipif(SIZE < 2, reason="needs a second rank to skip the call")
@pytest.mark.parametrize("collective, algorithm", [
    ("allreduce", "recursive_doubling"), ("allreduce", "ring"), ("reduce_scatter", "ring"),
    ("allgather", "ring")])
def test_a_timed_plan_times_out_as_the_first_call_does(collective, algorithm, monkeypatch):
    """A call repeated under a timeout starts its remembered operation again, with its deadline (engine.cache): when a rank
    skips it, the others raise the CollectiveTimeout the general path raises, in time,
    and the communicator is refused afterwards."""
    fn = getattr(mpicoll, collective)
    _a_timed_plan_times_out(collective, algorithm, monkeypatch, lambda c, x, out: fn(
        x, comm=c, out=out, algorithm=algorithm, timeout=T))


@pytest.mark.timeout(60)
@pytest.mark.skipif(SIZE < 2, reason="needs a second rank to skip the call")
@pytest.mark.parametrize("collective, algorithm, how", [
    ("allreduce", "recursive_doubling", "wait"), ("reduce_scatter", "ring", "wait"),
    ("allreduce", "ring", "test"), ("allgather", "ring", "test")])
def test_a_timed_non_blocking_plan_times_out_as_the_first_call_does(collective, algorithm, how,
                                                                     monkeypatch):
    """A non-blocking call repeated under a timeout restarts its remembered operation, with its deadline (engine.cache):
    when a rank skips it, the others raise the general path's CollectiveTimeout in time,
    from ``wait()`` (its polling wait) and from ``test()`` polled (its idle check), and the
    communicator is refused afterwards."""
    ifn = getattr(mpicoll, "i" + collective)

    def call(c, x, out):
        h = ifn(x, comm=c, out=out, algorithm=algorithm, timeout=T)
        if how == "wait":
            h.wait()
        else:
            end = time.perf_counter() + T + MARGIN + 5
            while not h.test() and time.perf_counter() < end:
                pass

    _a_timed_plan_times_out(collective, algorithm, monkeypatch, call)
