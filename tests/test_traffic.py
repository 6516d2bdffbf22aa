"""mpicoll.traffic(): exact message, byte and step counts against the algorithms' formulas.

Run under an MPI launcher at any rank count.  Expected figures are computed
here from the documented algorithms (ring position p = ``ctx.ring_pos``,
chunks ``split(N, n)``, segments of ``ctx.segment_bytes``), not from the
library's own schedule tables:

ring AllReduce      sends every chunk but p (reduce-scatter) and every chunk
                    but p+1 (allgather): 2(n-1) steps, 2(n-1)N elements summed
                    over ranks, 2(n-1)/n of the data per rank when even
ring ReduceScatter  sends every block but its own: (n-1)/n of the data when
                    even; every block travels as the same number of pieces
ring AllGather      sends every block but that of position p+1
recursive doubling  log2(n) whole-array exchanges (+ fold and unfold)
"""

from __future__ import annotations

import math

import _util
import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.algorithms import steps as _steps
from mpicoll.algorithms.ring import AG_SEGMENT_FACTOR, split
from mpicoll.engine import context as _context
from mpicoll.engine import select as _select

pytestmark = pytest.mark.timeout(120)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SEG_BYTES = 64  # small segments: several messages per block at modest sizes


@pytest.fixture(params=["identity", "cyclic"])
def comm(request, monkeypatch):
    """A fresh communicator with small segments; 'cyclic' fakes 2 nodes (ring order != rank)."""
    if request.param == "cyclic":
        monkeypatch.setenv("MPICOLL_FAKE_NODES", "cyclic:2")
    c = WORLD.Dup()
    ctx = _context.context(c)
    ctx.segment_bytes = SEG_BYTES
    yield c
    c.Free()


def data(n, dtype=np.float64):
    return (np.arange(n) % 11 + RANK).astype(dtype)


def nmsg(count, seg):
    return math.ceil(count / seg)


def expect_ring_allreduce(ctx, N, itemsize):
    """(messages_sent, bytes_sent, messages_received, bytes_received, send_steps)."""
    n, p = ctx.size, ctx.ring_pos
    if n == 1 or N == 0:
        return 0, 0, 0, 0, 0
    c, _ = split(N, n)
    seg = max(1, SEG_BYTES // itemsize)
    sent = [q for q in range(n) if q != p] + [q for q in range(n) if q != (p + 1) % n]
    recv = [q for q in range(n) if q != (p - 1) % n] + [q for q in range(n) if q != p]
    return (sum(nmsg(c[q], seg) for q in sent), sum(c[q] for q in sent) * itemsize,
            sum(nmsg(c[q], seg) for q in recv), sum(c[q] for q in recv) * itemsize,
            sum(1 for q in sent if c[q]))


def expect_ring_reduce_scatter(ctx, counts, itemsize):
    n, p, order = ctx.size, ctx.ring_pos, ctx.ring
    if n == 1 or max(counts) == 0:
        return 0, 0, 0, 0, 0
    total = sum(counts)
    nseg = math.ceil(max(counts) / max(1, SEG_BYTES // itemsize))
    return ((n - 1) * nseg, (total - counts[order[p]]) * itemsize,
            (n - 1) * nseg, (total - counts[order[(p - 1) % n]]) * itemsize, n - 1)


def expect_ring_allgather(ctx, counts, itemsize):
    n, p, order = ctx.size, ctx.ring_pos, ctx.ring
    if n == 1:
        return 0, 0, 0, 0, 0
    seg = max(1, SEG_BYTES // itemsize) * AG_SEGMENT_FACTOR  # AllGather pieces: 16 segments
    sent = [order[q] for q in range(n) if q != (p + 1) % n]
    recv = [order[q] for q in range(n) if q != p]
    return (sum(nmsg(counts[r], seg) for r in sent), sum(counts[r] for r in sent) * itemsize,
            sum(nmsg(counts[r], seg) for r in recv), sum(counts[r] for r in recv) * itemsize,
            sum(1 for r in sent if counts[r]))


def measured(t):
    c = t.calls[-1]
    return c.messages_sent, c.bytes_sent, c.messages_received, c.bytes_received, c.send_steps


def sizes():
    n = SIZE
    return sorted({0, 1, max(n - 1, 1), n, 7 * n + 3, 203})


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.float16])
def test_ring_allreduce(comm, dtype):
    ctx = _context.context(comm)
    itemsize = np.dtype(dtype).itemsize  # float16 travels as 16-bit words
    problems = []
    for N in sizes():
        x = data(N, dtype)
        with mpicoll.traffic() as t:
            mpicoll.allreduce(x, comm=comm, algorithm="ring")
        want = expect_ring_allreduce(ctx, N, itemsize)
        if measured(t) != want:
            problems.append(f"N={N}: measured {measured(t)}, formula {want}")
        if N >= SIZE > 1 and t.calls[-1].send_steps != 2 * (SIZE - 1):
            problems.append(f"N={N}: {t.calls[-1].send_steps} send steps, not 2(n-1)")
        total = WORLD.allreduce(t.calls[-1].bytes_sent)
        if total != 2 * (SIZE - 1) * N * itemsize:
            problems.append(f"N={N}: all ranks sent {total} bytes, not 2(n-1)N*itemsize")
    _util.assert_all(WORLD, not problems, "; ".join(problems))


def test_ring_reduce_scatter_even_and_uneven(comm):
    ctx = _context.context(comm)
    problems = []
    layouts = [[5] * SIZE, [(r * 7) % 5 for r in range(SIZE)], [0] * SIZE,
               [41 + r for r in range(SIZE)], [1] + [0] * (SIZE - 1)]
    for counts in layouts:
        x = data(sum(counts))
        with mpicoll.traffic() as t:
            mpicoll.reduce_scatter(x, comm=comm, counts=counts, algorithm="ring")
        want = expect_ring_reduce_scatter(ctx, counts, 8)
        if measured(t) != want:
            problems.append(f"counts={counts}: measured {measured(t)}, formula {want}")
        if len(set(counts)) == 1 and SIZE > 1:
            # (n-1)/n of the data on every rank
            if t.calls[-1].bytes_sent * SIZE != (SIZE - 1) * sum(counts) * 8:
                problems.append(f"counts={counts}: {t.calls[-1].bytes_sent} bytes is not (n-1)/n")
    _util.assert_all(WORLD, not problems, "; ".join(problems))


def test_ring_allgather_even_and_uneven(comm):
    ctx = _context.context(comm)
    problems = []
    for counts in ([6] * SIZE, [(r * 5) % 3 for r in range(SIZE)], [0] * SIZE,
                   [17 * (r + 1) for r in range(SIZE)]):
        x = data(counts[RANK])
        with mpicoll.traffic() as t:
            mpicoll.allgather(x, comm=comm, counts=counts, algorithm="ring")
        want = expect_ring_allgather(ctx, counts, 8)
        if measured(t) != want:
            problems.append(f"counts={counts}: measured {measured(t)}, formula {want}")
        if len(set(counts)) == 1 and SIZE > 1 and counts[0]:
            if t.calls[-1].bytes_received * SIZE != (SIZE - 1) * sum(counts) * 8:
                problems.append(f"counts={counts}: received {t.calls[-1].bytes_received}, not (n-1)/n")
    _util.assert_all(WORLD, not problems, "; ".join(problems))


def test_recursive_doubling_allreduce(comm):
    N = 10
    pof2 = 1 << (SIZE.bit_length() - 1)
    rem, rounds = SIZE - pof2, pof2.bit_length() - 1
    with mpicoll.traffic() as t:
        mpicoll.allreduce(data(N), comm=comm, algorithm="recursive_doubling")
    if RANK < 2 * rem:
        msgs, steps = (1, 1) if RANK % 2 == 0 else (rounds + 1, rounds + 1)
    else:
        msgs, steps = rounds, rounds
    want = (msgs, msgs * N * 8, msgs, msgs * N * 8, steps)
    _util.assert_all(WORLD, measured(t) == want, f"measured {measured(t)}, formula {want}")


def test_totals_per_collective_and_gather(comm):
    x = data(40)
    with mpicoll.traffic() as t:
        mpicoll.allreduce(x, comm=comm, algorithm="ring")
        mpicoll.allreduce(x, comm=comm, algorithm="ring")
        mpicoll.allgather(x[:3], comm=comm, algorithm="ring")
        c = mpicoll.Comm(comm)
        recv = np.empty(2)
        c.Reduce_scatter(data(2 * SIZE), recv)  # exchanges recvcounts first
    by = t.by_collective()
    assert list(by) == ["allreduce", "allgather", "reduce_scatter.recvcounts", "reduce_scatter"]
    assert by["allreduce"].calls == 2
    assert by["allreduce"].bytes_sent == 2 * t.calls[0].bytes_sent
    assert t.bytes_sent == sum(c.bytes_sent for c in t.calls)
    assert t.total("allgather").messages_received == t.calls[2].messages_received
    assert [c.seq for c in t.calls] == list(range(t.calls[0].seq, t.calls[0].seq + 5))
    everyone = t.gather(WORLD)
    if RANK == 0:
        assert len(everyone) == SIZE
        assert sum(g["allreduce"].bytes_sent for g in everyone) == 2 * 2 * (SIZE - 1) * 40 * 8
    else:
        assert everyone is None


def test_check_and_in_place_do_not_change_the_counts(comm):
    """The MPICOLL_CHECK exchange is not payload; in place moves the same data."""
    x = data(100)
    with mpicoll.traffic() as plain:
        mpicoll.allreduce(x, comm=comm, algorithm="ring")
    with mpicoll.options(check=True), mpicoll.traffic() as checked:
        mpicoll.allreduce(x, comm=comm, algorithm="ring")
    y = x.copy()
    with mpicoll.traffic() as inplace:
        mpicoll.allreduce(y, comm=comm, out=y, algorithm="ring")
    assert measured(plain) == measured(checked) == measured(inplace)


def test_nested_counters_and_nothing_outside(comm):
    x = data(30)
    with mpicoll.traffic() as outer:
        mpicoll.allreduce(x, comm=comm)
        with mpicoll.traffic() as inner:
            mpicoll.allreduce(x, comm=comm)
    mpicoll.allreduce(x, comm=comm)
    assert len(outer.calls) == 2 and len(inner.calls) == 1
    assert inner.calls[0] == outer.calls[1]


def test_algorithms_without_schedule_count_rounds(comm):
    """Messages and bytes are always counted; steps of sendrecv-only algorithms are their rounds."""
    unknown = [a for a in _select.ALGORITHMS["allgather"] if ("allgather", a) not in _steps.SCHEDULES]
    if not unknown:
        pytest.skip("every allgather algorithm has a schedule")
    problems = []
    for algo in unknown:
        with mpicoll.traffic() as t:
            g = mpicoll.allgather(data(4), comm=comm, algorithm=algo)
        if not np.array_equal(g, np.concatenate(WORLD.allgather(data(4)))):
            problems.append(f"{algo}: wrong result")
        call = t.calls[0]
        if call.algorithm != algo or call.send_steps is None or call.recv_steps is None:
            problems.append(f"{algo}: {call}")
        # every rank receives the others' blocks at least once
        if SIZE > 1 and call.bytes_received < (SIZE - 1) * 4 * 8:
            problems.append(f"{algo}: received only {call.bytes_received} bytes")
        if algo == "bruck" and call.send_steps != (SIZE - 1).bit_length():
            problems.append(f"bruck: {call.send_steps} send steps, not ceil(log2 n)")
        if WORLD.allreduce(call.bytes_sent) != WORLD.allreduce(call.bytes_received):
            problems.append(f"{algo}: bytes sent and received differ over the ranks")
    _util.assert_all(WORLD, not problems, "; ".join(problems))
