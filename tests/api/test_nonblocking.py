"""Non-blocking and persistent collectives: mpicoll.Comm.I*/*_init, mpicoll.i*, the progress thread.

Expected values are MPI's built-in collective on the same rank-asymmetric
input (``MPI.Intracomm.Allreduce(comm, ...)`` calls mpi4py's own method even
on an mpicoll.Comm).  Runs at any rank count.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll
from mpicoll.api import args as _args
from mpicoll.api import requests as _requests
from mpicoll.core import config
from mpicoll.engine import select as _select

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COMM = mpicoll.Comm(WORLD)
SENTINEL = -7
MPI_COMM = MPI.Intracomm  # mpi4py's own methods: the built-in reference


def uneven(n_per=3):
    """Counts that differ by rank and include 0: rank r gets (r + n_per) % 4."""
    counts = [(r + n_per) % 4 for r in range(SIZE)]
    displs = [sum(counts[:r]) for r in range(SIZE)]
    return counts, displs


def builtin_allreduce(x, op=MPI.SUM, comm=WORLD):
    out = np.empty_like(x)
    MPI_COMM.Allreduce(comm, x, out, op)
    return out


def builtin_allgatherv(x, counts, comm=WORLD):
    out = np.empty(sum(counts), x.dtype)
    MPI_COMM.Allgatherv(comm, x, [out, counts])
    return out


def builtin_reduce_scatter(x, counts, op=MPI.SUM, comm=WORLD):
    out = np.empty(counts[comm.Get_rank()], x.dtype)
    MPI_COMM.Reduce_scatter(comm, x, out, counts, op)
    return out


def problems(pairs):
    """'' if every (name, got, expected) pair is bitwise equal, else what differs."""
    bad = [f"{name}: got {got!r}, expected {exp!r}" for name, got, exp in pairs
           if not util.same_bytes(got, exp)]
    return "; ".join(bad)


# ---------------------------------------------------------------------------
# Several in flight on one communicator
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["world", "split_reversed", "split_parity"])
def test_three_collectives_in_flight_waited_in_reverse_order(kind):
    comms = util.make_comms()
    try:
        raw = comms[kind]
        comm = mpicoll.Comm(raw)
        rank, size = comm.Get_rank(), comm.Get_size()
        counts = [(r + 1) % 3 + (r == 0) for r in range(size)]  # uneven, >= 1 on rank 0
        a = rank_data(7, rank, np.float64, salt=1)
        b = rank_data(counts[rank], rank, np.int32, salt=2)
        c = rank_data(sum(counts), rank, np.float32, salt=3)
        a0, b0, c0 = a.copy(), b.copy(), c.copy()
        ra = np.full(7, SENTINEL, np.float64)
        rb = np.full(sum(counts), SENTINEL, np.int32)
        rc = np.full(counts[rank], SENTINEL, np.float32)
        reqs = [comm.Iallreduce(a, ra, op=MPI.SUM),
                comm.Iallgatherv(b, [rb, counts]),
                comm.Ireduce_scatter(c, rc, counts, op=MPI.MAX)]
        for req in reversed(reqs):
            req.Wait()
        bad = problems([
            ("allreduce", ra, builtin_allreduce(a, MPI.SUM, raw)),
            ("allgatherv", rb, builtin_allgatherv(b, counts, raw)),
            ("reduce_scatter", rc, builtin_reduce_scatter(c, counts, MPI.MAX, raw)),
            ("sendbufs untouched", np.concatenate([a, b, c]), np.concatenate([a0, b0, c0])),
        ])
        util.assert_all(WORLD, not bad, bad)
    finally:
        util.free_comms(comms)


def test_array_api_three_in_flight_waited_in_reverse_order():
    x = rank_data(6, RANK, np.float64, salt=4).reshape(2, 3).T  # Fortran-ordered on every rank
    g = rank_data(RANK % 3, RANK, np.int64, salt=5)                # uneven rows, some 0
    counts = [r % 3 for r in range(SIZE)]
    s = rank_data(2 * SIZE + 1, RANK, np.float64, salt=6)
    h1 = mpicoll.iallreduce(x, op=MPI.MIN)
    h2 = mpicoll.iallgather(g, counts=counts)
    h3 = mpicoll.ireduce_scatter(s)
    r3, r2, r1 = h3.wait(), h2.wait(), h1.wait()
    rs_counts = [len(b) for b in np.array_split(np.arange(len(s)), SIZE)]
    bad = problems([
        ("iallreduce", np.ascontiguousarray(r1),
         builtin_allreduce(np.ascontiguousarray(x), MPI.MIN)),
        ("iallgather", r2, builtin_allgatherv(g, counts)),
        ("ireduce_scatter", r3, builtin_reduce_scatter(s, rs_counts)),
    ])
    ok_types = r1.shape == x.shape and r2.dtype == g.dtype and h1.wait() is r1
    util.assert_all(WORLD, not bad and ok_types, bad or "shapes/dtypes/repeat wait")


def test_blocking_call_while_nonblocking_in_flight():
    """MPI allows a blocking collective between start and wait of a non-blocking one."""
    a = rank_data(1000, RANK, np.float64, salt=7)
    ra = np.empty_like(a)
    req = COMM.Iallreduce(a, ra)
    b = rank_data(5, RANK, np.int32, salt=8)
    rb = np.empty_like(b)
    COMM.Allreduce(b, rb, op=MPI.MAX)
    req.Wait()
    bad = problems([("nonblocking", ra, builtin_allreduce(a)),
                    ("blocking", rb, builtin_allreduce(b, MPI.MAX))])
    util.assert_all(WORLD, not bad, bad)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_ranks_wait_in_different_orders(algorithm):
    """MPI lets every rank complete operations in its own order: a rank blocked in the
    wait of one operation must still advance the others, whose later steps its peers
    wait for (the executor's progress rule).  Multi-step schedules (several segments
    per block with a small segment) hung here when a wait advanced only its own
    operation."""
    comm = mpicoll.Comm(WORLD, algorithm=algorithm)
    n = 64 * SIZE + 5
    xs = [rank_data(n, RANK, np.float64, salt=60 + k) for k in range(3)]
    outs = [np.full(n, SENTINEL, np.float64) for _ in xs]
    with mpicoll.options(timeout=60):
        reqs = [comm.Iallreduce(x, y) for x, y in zip(xs, outs)]
        order = list(range(3)) if RANK % 2 == 0 else list(reversed(range(3)))
        for k in order:
            reqs[k].Wait()
        # a blocking call on a rank while its peer still waits for a non-blocking one
        y = np.full(n, SENTINEL, np.float64)
        late = comm.Iallreduce(xs[0], y)
        if RANK % 2 == 0:
            comm.Allreduce(xs[1], outs[1])
            late.Wait()
        else:
            late.Wait()
            comm.Allreduce(xs[1], outs[1])
    bad = problems([(f"op {k}", outs[k], builtin_allreduce(xs[k])) for k in range(3)]
                   + [("late", y, builtin_allreduce(xs[0]))])
    util.assert_all(WORLD, not bad, bad)


# ---------------------------------------------------------------------------
# Test(), Waitall, statuses
# ---------------------------------------------------------------------------


def test_test_polling_to_completion():
    a = rank_data(50_000, RANK, np.float64, salt=9)
    ra = np.full_like(a, SENTINEL)
    status = MPI.Status()
    req = COMM.Iallreduce(a, ra)
    polls, deadline = 0, time.monotonic() + 60
    while not req.Test(status):
        polls += 1
        assert time.monotonic() < deadline, "Test() never returned True"
    again = req.Test() and req.Wait() and req.done
    bad = problems([("allreduce", ra, builtin_allreduce(a))])
    status_ok = status.Get_source() == MPI.ANY_SOURCE and status.Get_error() == MPI.SUCCESS
    util.assert_all(WORLD, not bad and again and status_ok,
                     bad or f"again={again} status_ok={status_ok}")


def test_a_bad_item_is_refused_before_any_wait(monkeypatch):
    """waitall/testall and Request.Waitall/Testall with a good request first and a bad item
    after it: TypeError naming the bad item, and nothing waited for or advanced before it
    (the good request completes afterwards, right)."""
    x = rank_data(33, RANK, np.float64, salt=4)
    y = np.full_like(x, SENTINEL)
    req, h = COMM.Iallreduce(x, y), mpicoll.iallreduce(x)
    touched = []
    for cls, name in ((_requests.Request, "Wait"), (_requests.Request, "Test"),
                      (_requests.Handle, "wait"), (_requests.Handle, "test")):
        monkeypatch.setattr(cls, name, lambda self, *a, name=name: touched.append(name))
    refused = []
    for fn, good in ((mpicoll.waitall, h), (mpicoll.testall, h), (mpicoll.waitall, req),
                     (mpicoll.Request.Waitall, req), (mpicoll.Request.Testall, req)):
        try:
            fn([good, None])
        except TypeError as exc:
            refused.append(str(exc).startswith(("handles[1]: ", "requests[1]: ")))
    monkeypatch.undo()
    result = h.wait()
    req.Wait()
    bad = problems([("Iallreduce", y, builtin_allreduce(x)), ("iallreduce", result,
                                                               builtin_allreduce(x))])
    ok = not bad and not touched and refused == [True] * 5
    util.assert_all(WORLD, ok, bad or f"touched={touched} refused={refused}")


def test_waitall_and_testall():
    data = [rank_data(n, RANK, np.float64, salt=10 + n) for n in (0, 1, SIZE - 1, 33)]
    outs = [np.full_like(d, SENTINEL) for d in data]
    reqs = [COMM.Iallreduce(d, o) for d, o in zip(data, outs)]
    statuses = [MPI.Status() for _ in reqs]
    assert mpicoll.Request.Waitall(reqs, statuses) is True
    done = mpicoll.Request.Testall(reqs)
    handles = [mpicoll.iallreduce(d) for d in data]
    results = mpicoll.waitall(handles)
    more = [mpicoll.iallgather(d) for d in data]
    while not mpicoll.testall(more):
        pass
    bad = problems([(f"Waitall[{i}]", o, builtin_allreduce(d)) for i, (d, o) in
                    enumerate(zip(data, outs))]
                   + [(f"waitall[{i}]", r, builtin_allreduce(d)) for i, (d, r) in
                      enumerate(zip(data, results))]
                   + [(f"testall[{i}]", h.wait(), builtin_allgatherv(d, [len(d)] * SIZE))
                      for i, (d, h) in enumerate(zip(data, more))])
    util.assert_all(WORLD, not bad and done, bad or "Testall after Waitall is False")


# ---------------------------------------------------------------------------
# Counts 0, 1, < ranks, uneven; in place; dtypes and ops
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, max(SIZE - 1, 0), 2 * SIZE + 3])
@pytest.mark.parametrize("dtype,op", [(np.float64, MPI.SUM), (np.int32, MPI.PROD),
                                      (np.int64, MPI.BXOR), (np.float32, MPI.MAX)])
def test_counts_and_types(n, dtype, op):
    x = rank_data(n, RANK, dtype, salt=11) % 5 + 1 if op is MPI.PROD else rank_data(n, RANK, dtype, salt=11)
    x = x.astype(dtype)
    r1 = np.full(n, SENTINEL, dtype)
    r2 = np.full(n * SIZE, SENTINEL, dtype)
    r3 = np.full(n, SENTINEL, dtype)
    big = rank_data(n * SIZE, RANK, dtype, salt=12)
    reqs = [COMM.Iallreduce(x, r1, op), COMM.Iallgather(x, r2),
            COMM.Ireduce_scatter_block(big, r3, op)]
    mpicoll.Request.Waitall(reqs)
    bad = problems([("Iallreduce", r1, builtin_allreduce(x, op)),
                    ("Iallgather", r2, builtin_allgatherv(x, [n] * SIZE)),
                    ("Ireduce_scatter_block", r3, builtin_reduce_scatter(big, [n] * SIZE, op))])
    util.assert_all(WORLD, not bad, bad)


def test_in_place_forms():
    n = 5
    counts, displs = uneven()
    ar = rank_data(n, RANK, np.float64, salt=13)
    ag = np.full(SIZE * n, SENTINEL, np.float64)
    ag[RANK * n:(RANK + 1) * n] = rank_data(n, RANK, np.float64, salt=14)
    agv = np.full(sum(counts), SENTINEL, np.float64)
    agv[displs[RANK]:displs[RANK] + counts[RANK]] = rank_data(counts[RANK], RANK, np.float64, salt=15)
    rsb = rank_data(SIZE * n, RANK, np.float64, salt=16)
    rs = rank_data(sum(counts), RANK, np.float64, salt=17)
    exp = [builtin_allreduce(ar), builtin_allgatherv(rank_data(n, RANK, np.float64, salt=14), [n] * SIZE),
           builtin_allgatherv(rank_data(counts[RANK], RANK, np.float64, salt=15), counts),
           builtin_reduce_scatter(rsb, [n] * SIZE), builtin_reduce_scatter(rs, counts)]
    reqs = [COMM.Iallreduce(MPI.IN_PLACE, ar), COMM.Iallgather(MPI.IN_PLACE, ag),
            COMM.Iallgatherv(MPI.IN_PLACE, [agv, counts]),
            COMM.Ireduce_scatter_block(MPI.IN_PLACE, rsb),
            COMM.Ireduce_scatter(MPI.IN_PLACE, rs, counts)]
    for r in reversed(reqs):
        r.Wait()
    x = rank_data(SIZE * 2 + 1, RANK, np.float64, salt=18)
    x_exp = builtin_allreduce(x)
    hx = mpicoll.iallreduce(x, out=x)
    y = rank_data(SIZE * 2, RANK, np.float64, salt=19)
    y_exp = builtin_reduce_scatter(y, [2] * SIZE)
    hy = mpicoll.ireduce_scatter(y, out=y)
    bad = problems([("Iallreduce", ar, exp[0]), ("Iallgather", ag, exp[1]),
                    ("Iallgatherv", agv, exp[2]), ("Ireduce_scatter_block", rsb[:n], exp[3]),
                    ("Ireduce_scatter", rs[:counts[RANK]], exp[4]),
                    ("iallreduce out=x", hx.wait(), x_exp),
                    ("ireduce_scatter out=x", hy.wait(), y_exp)])
    same = hx.wait() is x
    util.assert_all(WORLD, not bad and same, bad or "out=x: result is not x")


def test_reduce_scatter_without_recvcounts():
    counts, _ = uneven(1)
    x = rank_data(sum(counts), RANK, np.float64, salt=20)
    out = np.full(counts[RANK], SENTINEL, np.float64)
    COMM.Ireduce_scatter(x, out).Wait()
    bad = problems([("Ireduce_scatter", out, builtin_reduce_scatter(x, counts))])
    util.assert_all(WORLD, not bad, bad)


# ---------------------------------------------------------------------------
# Persistent requests
# ---------------------------------------------------------------------------


def test_persistent_allreduce_restarted_with_new_data():
    x = np.empty(11, np.float64)
    y = np.full(11, SENTINEL, np.float64)
    req = COMM.Allreduce_init(x, y, op=MPI.SUM)
    bad = []
    inactive_done = req.done and req.Test()  # an inactive persistent request is complete
    for it in range(4):
        x[:] = rank_data(11, RANK, np.float64, salt=30 + it)
        req.Start()
        req.Wait()
        if not util.same_bytes(y, builtin_allreduce(x)):
            bad.append(f"start #{it + 1}: {y!r}")
    req.Free()
    req.Free()  # harmless twice
    try:
        req.Start()
        bad.append("Start after Free did not raise")
    except ValueError as exc:
        if "freed" not in str(exc):
            bad.append(f"Start after Free: {exc}")
    util.assert_all(WORLD, not bad and inactive_done, "; ".join(bad) or "inactive not done")


def test_persistent_allgather_and_reduce_scatter_block():
    n = 3
    sx = np.empty(n, np.int32)
    gy = np.full(n * SIZE, SENTINEL, np.int32)
    bx = np.empty(n * SIZE, np.float64)
    by = np.full(n, SENTINEL, np.float64)
    reqs = [COMM.Allgather_init(sx, gy), COMM.Reduce_scatter_block_init(bx, by, op=MPI.MAX)]
    bad = []
    for it in range(3):
        sx[:] = rank_data(n, RANK, np.int32, salt=40 + it)
        bx[:] = rank_data(n * SIZE, RANK, np.float64, salt=50 + it) * (-1) ** (RANK + it)
        for r in reqs:
            r.Start()
        polls = 0
        while not mpicoll.Request.Testall(reqs):
            polls += 1
        bad.append(problems([
            (f"Allgather #{it}", gy, builtin_allgatherv(sx, [n] * SIZE)),
            (f"Reduce_scatter_block #{it}", by, builtin_reduce_scatter(bx, [n] * SIZE, MPI.MAX)),
        ]))
    for r in reqs:
        r.Free()
    bad = "; ".join(b for b in bad if b)
    util.assert_all(WORLD, not bad, bad)


@pytest.mark.timeout(60)
def test_persistent_starts_run_on_persistent_requests(monkeypatch):
    """A persistent collective runs its program (engine.executor: its messages bound once to
    persistent point-to-point requests, at its second start): no start binds again, results stay
    right with new data, a start under a traffic counter runs observed (and is counted),
    and Free frees the program's requests."""
    from mpicoll.engine import executor as _executor
    from mpicoll.engine import run as _run
    observed = util.spy(monkeypatch, _run.Bound, ["observe"])
    binds = util.spy(monkeypatch, _executor, ["bind"])
    x = np.empty(7)
    y = np.full(7, SENTINEL, np.float64)
    req = COMM.Allreduce_init(x, y)
    op = req._op
    made = len(binds)  # (bound when made)
    bad = []
    for it in range(4):
        x[:] = rank_data(7, RANK, np.float64, salt=70 + it)
        req.Start()
        req.Wait()
        bad.append(problems([(f"start #{it + 1}", y, builtin_allreduce(x))]))
    # (one rank: a program of copies, no requests to hold)
    compiled = op.program is not None and (SIZE == 1 or op in _executor._HOLDING)
    with mpicoll.traffic() as t:
        x[:] = rank_data(7, RANK, np.float64, salt=80)
        req.Start()
        req.Wait()
    bad.append(problems([("counted start", y, builtin_allreduce(x))]))
    counted = len(t.calls) == 1 and (SIZE == 1 or t.calls[0].messages_sent > 0)
    requests = list(_executor._HOLDING.get(op, ()))
    req.Free()
    freed = op.program is None and op not in _executor._HOLDING and \
        all(r == MPI.REQUEST_NULL for r in requests)
    bad = "; ".join(b for b in bad if b)
    util.assert_all(WORLD, not bad and compiled and counted and freed and len(observed) == 1
                     and made == 1 and len(binds) == 1,
                     f"{bad} compiled={compiled} counted={counted} freed={freed} "
                     f"observed={len(observed)} (expected 1: the counted start) "
                     f"binds={made}, {len(binds)} (expected 1, 1: bound when made, never again)")


@pytest.mark.timeout(60)
def test_persistent_programs_and_nonblocking_waited_in_rank_dependent_orders():
    """Persistent collectives on their programs, in flight with a non-blocking one; each rank
    waits in its own order, so a blocked program wait must advance the others."""
    n = 5 * SIZE + 2
    x = np.empty(n)
    y = np.full(n, SENTINEL, np.float64)
    g = np.full(n * SIZE, SENTINEL, np.float64)
    p1, p2 = COMM.Allreduce_init(x, y, op=MPI.MAX), COMM.Allgather_init(x, g)
    bad = []
    for it in range(4):
        x[:] = rank_data(n, RANK, np.float64, salt=90 + it)
        z = np.full(n, SENTINEL, np.float64)
        p1.Start()
        h = COMM.Iallreduce(x, z)
        p2.Start()
        reqs = [p1, h, p2]
        for r in (reqs if (RANK + it) % 2 == 0 else reqs[::-1]):
            r.Wait()
        bad.append(problems([(f"allreduce #{it}", y, builtin_allreduce(x, MPI.MAX)),
                             (f"iallreduce #{it}", z, builtin_allreduce(x)),
                             (f"allgather #{it}", g, builtin_allgatherv(x, [n] * SIZE))]))
    compiled = p1._op.program is not None and p2._op.program is not None
    p1.Free()
    p2.Free()
    bad = "; ".join(b for b in bad if b)
    util.assert_all(WORLD, not bad and compiled, bad or "no program compiled")


def test_a_persistent_request_keeps_its_communicator_until_freed():
    """``comm.Free()`` with a persistent request not freed: the request still starts and is
    right (MPI's reference semantics: a request keeps its communicator; MPICH's own
    requests work after the Free), its ``Free()`` succeeds and frees its requests, and
    mpicoll's duplicate of the communicator goes only then.  (``Start()`` raised MPI's
    MPI_ERR_COMM, and ``Free()`` raised too: its error report asked the freed duplicate
    for its group.)"""
    from mpicoll.engine import context as _context
    from mpicoll.engine import executor as _executor
    comm = mpicoll.Comm(WORLD.Dup())
    x, y = rank_data(3, RANK, np.float64), np.empty(3)
    req = comm.Allreduce_init(x, y)
    for _ in range(2):
        req.Start()
        req.Wait()
    ctx = _context.context(comm)
    op = req._op
    requests = list(_executor._HOLDING.get(op, ()))
    comm.Free()
    kept = ctx.comm != MPI.COMM_NULL
    x += 1
    req.Start()
    req.Wait()
    right = util.same_bytes(y, builtin_allreduce(x))
    req.Free()
    req.Free()  # (twice: harmless)
    freed = ctx.comm == MPI.COMM_NULL and all(r == MPI.REQUEST_NULL for r in requests) \
        and op not in _executor._HOLDING
    util.assert_all(WORLD, kept and right and freed,
                     f"kept={kept} right={right} freed={freed}")


# ---------------------------------------------------------------------------
# Repeated non-blocking calls restart their kept operation (engine.cache.restart)
# ---------------------------------------------------------------------------


def _count_validations(monkeypatch):
    """The list every validation of a Comm method or array function appends to."""
    return util.spy(monkeypatch, _args, ["Allreduce", "Allgather", "Reduce_scatter_block",
                                          "allreduce", "allgather", "reduce_scatter"])


@pytest.mark.timeout(60)
def test_repeated_nonblocking_calls_restart_their_operations(monkeypatch):
    """Gradient buckets: the same three buffers started and waited every step.  From the
    second step on, no call is validated again, and every result is right."""
    validated = _count_validations(monkeypatch)
    n = 4 * SIZE + 1
    x, y = np.empty(n), np.full(n, SENTINEL, np.float64)
    g = np.full(n * SIZE, SENTINEL, np.float64)
    b, rs = np.empty(n * SIZE), np.full(n, SENTINEL, np.float64)
    z = np.full(n, SENTINEL, np.float64)
    bad = []
    for step in range(5):
        x[:] = rank_data(n, RANK, np.float64, salt=100 + step)
        b[:] = rank_data(n * SIZE, RANK, np.float64, salt=110 + step)
        reqs = [COMM.Iallreduce(x, y), COMM.Iallgather(x, g),
                COMM.Ireduce_scatter_block(b, rs, MPI.MAX)]
        h = mpicoll.iallreduce(x, MPI.MIN, out=z)
        got = h.wait()
        mpicoll.Request.Waitall(reqs[::-1] if (RANK + step) % 2 else reqs)
        bad.append(problems([
            (f"Iallreduce #{step}", y, builtin_allreduce(x)),
            (f"Iallgather #{step}", g, builtin_allgatherv(x, [n] * SIZE)),
            (f"Ireduce_scatter_block #{step}", rs, builtin_reduce_scatter(b, [n] * SIZE, MPI.MAX)),
            (f"iallreduce #{step}", z, builtin_allreduce(x, MPI.MIN))]))
        if got is not z:
            bad.append(f"iallreduce #{step} returned another array")
        if step == 0:
            first = len(validated)
    bad = "; ".join(b for b in bad if b)
    util.assert_all(WORLD, not bad and len(validated) == first == 4,
                     f"{bad} validations: {len(validated)} (first step {first}; expected 4, 4)")


@pytest.mark.timeout(60)
def test_restart_is_a_per_rank_decision():
    """Even ranks call with the same buffers every time (their operations restart), odd
    ranks with new ones (the general path), with a second operation in flight: the tags
    must still agree (a mismatch hangs or crosses the results)."""
    n = 6
    keep_x, keep_y = np.empty(n), np.empty(n)
    bad = []
    for step in range(4):
        x, y = (keep_x, keep_y) if RANK % 2 == 0 else (np.empty(n), np.empty(n))
        x[:] = rank_data(n, RANK, np.float64, salt=120 + step)
        other = rank_data(n, RANK, np.float64, salt=130 + step)
        w = np.full(n * SIZE, SENTINEL, np.float64)
        r1 = COMM.Iallreduce(x, y)
        r2 = COMM.Iallgather(other, w)
        for r in ((r2, r1) if RANK % 2 else (r1, r2)):
            r.Wait()
        bad.append(problems([(f"allreduce #{step}", y, builtin_allreduce(x)),
                             (f"allgather #{step}", w, builtin_allgatherv(other, [n] * SIZE))]))
    bad = "; ".join(b for b in bad if b)
    util.assert_all(WORLD, not bad, bad)


@pytest.mark.timeout(60)
def test_no_restart_before_the_last_request_was_seen_complete(monkeypatch):
    """A repeat while the last request was not waited (erroneous in MPI, but the operation
    may be complete) starts a new operation: the old request stays its own."""
    validated = _count_validations(monkeypatch)
    x, y = rank_data(5, RANK, np.float64, salt=140), np.empty(5)
    COMM.Iallreduce(x, y).Wait()
    r1 = COMM.Iallreduce(x, y)  # restarted
    r1_op = r1._op
    while not r1_op.done:  # complete, but r1 has not seen it
        r1_op.test()
    before = len(validated)
    r2 = COMM.Iallreduce(x, y)
    fresh = len(validated) == before + 1 and r2._op is not r1_op
    r2.Wait()
    r1.Wait()
    ok = fresh and util.same_bytes(y, builtin_allreduce(x))
    util.assert_all(WORLD, ok, f"fresh={fresh} y={y}")


@pytest.mark.timeout(60)
def test_kept_operations_are_bounded_and_observed_calls_are_counted():
    from mpicoll.engine import cache as _cache
    from mpicoll.engine import context as _context
    comm = mpicoll.Comm(WORLD.Dup())
    try:
        xs = [rank_data(3, RANK, np.float64, salt=150 + k) for k in range(_cache.NON_BLOCKING + 3)]
        ys = [np.empty(3) for _ in xs]
        for x, y in zip(xs, ys):
            comm.Iallreduce(x, y).Wait()
        ctx = _context.context(comm)
        kept = len(ctx.cache.non_blocking)
        with mpicoll.traffic() as t:  # observed: the general path, counted
            comm.Iallreduce(xs[-1], ys[-1]).Wait()
        counted = len(t.calls) == 1
        ok = kept == _cache.NON_BLOCKING and counted and \
            all(util.same_bytes(y, builtin_allreduce(x)) for x, y in zip(xs, ys))
    finally:
        comm.Free()
    emptied = not ctx.cache.non_blocking
    util.assert_all(WORLD, ok and emptied, f"kept={kept} counted={counted} emptied={emptied}")


@pytest.mark.timeout(60)
def test_nonblocking_tags_never_take_a_persistent_operations_tag():
    """A persistent operation keeps its tag for its whole life; non-blocking tags cycle
    with the call counter.  They used to share one range, so once the counter had gone
    round (2**29 calls with MPICH), a non-blocking operation could get a live persistent
    operation's tag, and with both in flight their messages could match each other.
    Here the range is cut to 8 tags to go round quickly."""
    from mpicoll.engine import context as _context
    from mpicoll.engine import executor as _executor
    comm = mpicoll.Comm(WORLD.Dup())
    try:
        n = 3 * SIZE + 1
        comm.Allreduce(np.zeros(1), np.zeros(1))  # sets the context up
        _context.context(comm).tag_ub = _executor.FIRST_TAG + 7
        x, y = np.empty(n), np.full(n, SENTINEL, np.float64)
        p = comm.Allreduce_init(x, y, op=MPI.MAX)
        ptag = p._op.tag
        tags, bad = set(), []
        for it in range(3):
            x[:] = rank_data(n, RANK, np.float64, salt=160 + it)
            p.Start()  # in flight during the non-blocking calls below
            for k in range(12):
                a = rank_data(n, RANK, np.float64, salt=170 + k)
                b = np.full(n, SENTINEL, np.float64)
                r = comm.Iallreduce(a, b)
                tags.add(r._op.ch.tag)  # (the tag of this start's call number)
                r.Wait()
                bad.append(problems([(f"Iallreduce {it}.{k}", b, builtin_allreduce(a))]))
            p.Wait()
            bad.append(problems([(f"persistent #{it}", y, builtin_allreduce(x, MPI.MAX))]))
        p.Free()
    finally:
        comm.Free()
    bad = "; ".join(b for b in bad if b)
    util.assert_all(WORLD, not bad and ptag not in tags,
                     f"{bad} persistent tag {ptag}, non-blocking tags {sorted(tags)}")


def test_persistent_free_without_start():
    x, y = rank_data(4, RANK, np.float64), np.full(4, SENTINEL, np.float64)
    reqs = [COMM.Allreduce_init(x, y), COMM.Allgather_init(x, np.empty(4 * SIZE)),
            COMM.Reduce_scatter_block_init(np.empty(4 * SIZE), y)]
    for r in reqs:
        r.Free()
    # the communicator still works afterwards, and y was never written
    z = np.empty(4)
    COMM.Allreduce(x, z)
    ok = bool(np.all(y == SENTINEL)) and util.same_bytes(z, builtin_allreduce(x))
    util.assert_all(WORLD, ok, f"y={y} z={z}")


@pytest.mark.parametrize("dtype", [np.float64, np.float16])  # float16: through engine.select
def test_start_misuse_raises_one_type(dtype):
    """Start on an active, a freed or a non-blocking request: ValueError each time, the same
    for a request engine.select routes (float16 SUM), naming Start, what it expected and got."""
    x, y = rank_data(4, RANK, np.float64).astype(dtype), np.empty(4, dtype)
    problems = []

    def misuse(what, request, got):
        try:
            request.Start()
            problems.append(f"Start on {what} did not raise")
        except ValueError as exc:
            if not re.match(rf"Start: expected .*, got {got}", str(exc)):
                problems.append(f"Start on {what}: {exc}")
        except Exception as exc:  # another type: what this test is for
            problems.append(f"Start on {what}: {type(exc).__name__}: {exc}")

    p = COMM.Allreduce_init(x, y)
    p.Start()
    misuse("an active request", p, "an active one")
    p.Wait()
    p.Free()
    misuse("a freed request", p, "a freed one")
    r = COMM.Iallreduce(x, y)
    misuse("a non-blocking request", r, "a non-blocking one")
    r.Wait()
    util.assert_all(WORLD, not problems, "; ".join(problems))


# ---------------------------------------------------------------------------
# Bad input: the blocking calls' errors, before anything starts, buffers untouched
# ---------------------------------------------------------------------------


@pytest.fixture
def refuse_start(monkeypatch):
    """Make starting any operation fail loudly (a call that should be refused must not start)."""
    def refuse(*args, **kwargs):
        raise util.MessageSent("an operation was started although the call should be refused")
    from mpicoll.engine import run as _run

    monkeypatch.setattr(_run, "start", refuse)


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # compared below
        return type(exc), str(exc)
    return None, ""


def _bad_cases():
    f8 = lambda n: np.zeros(n, np.float64)  # noqa: E731
    ro = np.zeros(4)
    ro.flags.writeable = False
    over = np.zeros(8)
    return {
        # name: (blocking call, non-blocking call, persistent call or None)
        "allreduce count": ("Allreduce", "Iallreduce", "Allreduce_init", (f8(3), f8(4))),
        "allreduce type": ("Allreduce", "Iallreduce", "Allreduce_init",
                           (np.zeros(4, np.int32), f8(4))),
        "allreduce readonly": ("Allreduce", "Iallreduce", "Allreduce_init", (f8(4), ro)),
        "allreduce op": ("Allreduce", "Iallreduce", "Allreduce_init", (f8(4), f8(4), "sum")),
        "allreduce op/type": ("Allreduce", "Iallreduce", "Allreduce_init",
                              (f8(4), f8(4), MPI.BAND)),
        "allreduce overlap": ("Allreduce", "Iallreduce", "Allreduce_init",
                              (over[:5], over[3:])),
        "allgather count": ("Allgather", "Iallgather", "Allgather_init", (f8(2), f8(2 * SIZE + 1))),
        "allgatherv counts": ("Allgatherv", "Iallgatherv", None,
                              (f8(1), [f8(SIZE + 1), [1] * (SIZE + 1)])),
        "rsb count": ("Reduce_scatter_block", "Ireduce_scatter_block",
                      "Reduce_scatter_block_init", (f8(2 * SIZE + 1), f8(2))),
        "rs counts": ("Reduce_scatter", "Ireduce_scatter", None, (f8(SIZE), f8(1), [2] * SIZE)),
        "rs in place without counts": ("Reduce_scatter", "Ireduce_scatter", None,
                                       (MPI.IN_PLACE, f8(SIZE))),
    }


@pytest.mark.parametrize("name", list(_bad_cases()))
def test_bad_arguments_raise_as_the_blocking_call(name, refuse_start):
    blocking, nonblocking, persistent, args = _bad_cases()[name]
    expected = _error_of(lambda: getattr(COMM, blocking)(*args))
    util.assert_all(WORLD, expected[0] is not None, f"{blocking} accepted {name}")
    buffers = [a for a in args if isinstance(a, np.ndarray)]
    for method in (nonblocking, persistent):
        if method is None:
            continue
        util.raises_everywhere(COMM, expected[0], "^" + re.escape(expected[1]) + "$",
                                lambda m=method: getattr(COMM, m)(*args), *buffers)


@pytest.mark.parametrize("fn,kwargs", [
    ("allreduce", {"out": np.zeros(3)}),
    ("allreduce", {"op": MPI.BAND}),
    ("allreduce", {"algorithm": "bogus"}),
    ("allreduce", {"timeout": -1}),
    ("allgather", {"counts": [1] * (SIZE + 1)}),
    ("reduce_scatter", {"counts": [5] * SIZE}),
    ("reduce_scatter", {"out": np.zeros((1, 1))}),
])
def test_array_bad_arguments_raise_as_the_blocking_call(fn, kwargs, refuse_start):
    x = rank_data(4, RANK, np.float64)
    expected = _error_of(lambda: getattr(mpicoll, fn)(x, **kwargs))
    util.assert_all(WORLD, expected[0] is not None, f"{fn} accepted {kwargs}")
    buffers = [x] + [v for v in kwargs.values() if isinstance(v, np.ndarray)]
    util.raises_everywhere(COMM, expected[0], "^" + re.escape(expected[1]) + "$",
                            lambda: getattr(mpicoll, "i" + fn)(x, **kwargs), *buffers)


# ---------------------------------------------------------------------------
# The progress thread
# ---------------------------------------------------------------------------


@pytest.fixture
def progress():
    _requests.stop_progress()
    with mpicoll.options(progress=True):
        yield
    _requests.stop_progress()


def test_progress_thread_completes_without_test_calls(progress):
    """With the thread on, an operation completes while the caller never calls Test/Wait."""
    a = rank_data(200_000, RANK, np.float64, salt=60)
    ra = np.empty_like(a)
    req = COMM.Iallreduce(a, ra)
    h = mpicoll.iallgather(rank_data(3, RANK, np.float64, salt=61))
    deadline = time.monotonic() + 60
    while not (req.done and h.done) and time.monotonic() < deadline:
        time.sleep(0.001)
    completed = req.done and h.done
    req.Wait()
    bad = problems([("Iallreduce", ra, builtin_allreduce(a)),
                    ("iallgather", h.wait(), builtin_allgatherv(rank_data(3, RANK, np.float64, salt=61), [3] * SIZE))])
    util.assert_all(WORLD, completed and not bad, bad or "not completed by the progress thread")


def test_progress_thread_many_operations_and_persistent(progress):
    data = [rank_data(n, RANK, np.float64, salt=70 + n) for n in (0, 1, 5, 1000, 30_000)]
    handles = [mpicoll.iallreduce(d, op=MPI.MAX) for d in data]
    x, y = np.empty(64), np.empty(64)
    p = COMM.Allreduce_init(x, y)
    bad = []
    for it in range(3):
        x[:] = rank_data(64, RANK, np.float64, salt=80 + it)
        p.Start()
        while not p.Test():  # the caller and the thread both advance it
            pass
        bad.append(problems([(f"persistent #{it}", y, builtin_allreduce(x))]))
    p.Free()
    results = [h.wait() for h in reversed(handles)][::-1]
    bad.append(problems([(f"iallreduce[{i}]", r, builtin_allreduce(d, MPI.MAX))
                         for i, (d, r) in enumerate(zip(data, results))]))
    bad = "; ".join(b for b in bad if b)
    util.assert_all(WORLD, not bad, bad)


def test_progress_thread_stops_and_restarts(progress):
    h = mpicoll.iallreduce(rank_data(10, RANK, np.float64, salt=90))
    h.wait()
    thread = _requests._thread
    _requests.stop_progress()
    stopped = thread is not None and not thread.thread.is_alive()
    r = mpicoll.iallreduce(rank_data(10, RANK, np.float64, salt=91)).wait()  # starts a new thread
    bad = problems([("after restart", r, builtin_allreduce(rank_data(10, RANK, np.float64, salt=91)))])
    util.assert_all(WORLD, stopped and not bad, bad or "thread still alive after stop")


def test_progress_needs_thread_multiple(monkeypatch, refuse_start):
    _requests.stop_progress()
    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    x = rank_data(4, RANK, np.float64)
    y = np.full(4, SENTINEL, np.float64)
    with mpicoll.options(progress=True):
        util.raises_everywhere(COMM, mpicoll.MpicollError, "MPI_THREAD_MULTIPLE.*"
                                "MPI_THREAD_SERIALIZED", lambda: COMM.Iallreduce(x, y), x, y)
        util.raises_everywhere(COMM, mpicoll.MpicollError, "MPI_THREAD_MULTIPLE",
                                lambda: mpicoll.iallreduce(x), x)


def test_progress_environment_variable(monkeypatch):
    """A bad MPICOLL_PROGRESS raises when it is read (a communicator set up), before mpicoll
    has sent anything or set the communicator up."""
    from mpicoll.engine import context as _context
    monkeypatch.setenv("MPICOLL_PROGRESS", "maybe")
    x = rank_data(4, RANK, np.float64)
    before = x.copy()
    comm = WORLD.Dup()
    try:
        with pytest.raises(ValueError, match="MPICOLL_PROGRESS: expected 1/0"):
            mpicoll.iallreduce(x, comm=comm)
        assert _context.existing(comm) is None and np.array_equal(x, before)
    finally:
        comm.Free()
    monkeypatch.undo()
    config.read_environment()


# ---------------------------------------------------------------------------
# mpicoll's algorithms, seen by mpicoll.traffic()
# ---------------------------------------------------------------------------

def test_nonblocking_runs_mpicolls_algorithms():
    """The inherited Iallreduce etc. ran MPI's built-ins: these must be mpicoll's."""
    a = rank_data(1000, RANK, np.float64, salt=95)
    ra = np.empty_like(a)
    with mpicoll.traffic() as t:
        req = COMM.Iallreduce(a, ra)
        req.Wait()
        h = mpicoll.iallgather(a)
        h.wait()
    by = t.by_collective()
    ok = (req.algorithm in _select.ALGORITHMS["allreduce"]
          and h.algorithm in _select.ALGORITHMS["allgather"]
          and by.get("allreduce") is not None and by["allreduce"].calls == 1
          and by.get("allgather") is not None and by["allgather"].calls == 1
          and (SIZE == 1 or by["allreduce"].messages_sent > 0))
    util.assert_all(WORLD, ok, f"algorithms {req.algorithm}, {h.algorithm}; traffic {by}")


# ---------------------------------------------------------------------------
# Device arrays (fake GPU: mpicoll's device code on a fake CUDA runtime, see fakegpu)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("cuda_aware", [False, True])
def test_device_arrays(cuda_aware):
    from support import fakegpu
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    n = 2 * SIZE + 1
    a, g, s = rank_data(n, RANK, np.float64, salt=100), rank_data(RANK % 3, RANK, np.float64, salt=101), rank_data(n, RANK, np.float64, salt=102)
    counts = [r % 3 for r in range(SIZE)]
    rs_counts = [len(b) for b in np.array_split(np.arange(n), SIZE)]
    with fakegpu.registered(be), mpicoll.options(cuda_aware=cuda_aware):
        x = fakegpu.produce(rt, a)          # written by a kernel still queued at the start
        h1 = mpicoll.iallreduce(x)
        h2 = mpicoll.iallgather(fakegpu.produce(rt, g), counts=counts)
        h3 = mpicoll.ireduce_scatter(fakegpu.produce(rt, s), op=MPI.MAX)
        r3, r2, r1 = h3.wait().get(), h2.wait().get(), h1.wait().get()
        y = rt.xp.empty(n, np.float64)
        req = mpicoll.Comm(WORLD).Iallreduce(fakegpu.produce(rt, a), y, op=MPI.MIN)
        req.Wait()
        rmin = y.get()
    bad = problems([("iallreduce", r1, builtin_allreduce(a)),
                    ("iallgather", r2, builtin_allgatherv(g, counts)),
                    ("ireduce_scatter", r3, builtin_reduce_scatter(s, rs_counts, MPI.MAX)),
                    ("Iallreduce", rmin, builtin_allreduce(a, MPI.MIN))])
    util.assert_all(WORLD, not bad, bad)
