"""Step, block and segment of every message an algorithm sends and receives.

Observers (timeouts, traffic accounting, traces) see only the channel calls of
an algorithm, in order.  The algorithms issue their messages in the order of
their documented schedules, so the k-th send (receive) of a call is the k-th
entry of the lists built here:

ring AllGather (steps 0..n-2)
    at step s position p sends block p-s and receives block p-1-s, each as
    segments of ``ctx.segment_bytes``; an empty block sends nothing
ring AllReduce (steps 0..2n-3)
    ReduceScatter steps 0..n-2 (send chunk p-1-s, receive chunk p-2-s), then
    the AllGather above as steps n-1..2n-3, on ``split(N, n)`` chunks
ring ReduceScatter (steps 0..n-2)
    at step s position p sends the partial of block p-1-s and receives block
    p-2-s; every block is cut into the same ``nseg`` pieces (empty pieces are
    sent too), processed in groups of ``2*window - 1`` pieces, step by step
    within a group
recursive doubling AllReduce / ReduceScatter (n = pof2 + rem)
    step 0 folds the first 2*rem ranks in pairs (only when rem > 0), then one
    exchange step per bit of pof2, then a last step unfolds

Every label carries the message's element count; the observer drops the
labels of a call whose messages do not match them (an algorithm changed
without this table), and algorithms not listed get no labels.
"""

from __future__ import annotations

from typing import NamedTuple

from . import ring as _ring


class Label(NamedTuple):
    step: int
    phase: str         # "reduce-scatter", "allgather", "fold", "exchange", "unfold"
    block: int | None  # rank whose block (ReduceScatter, AllGather), chunk (AllReduce)
    segment: int
    count: int         # elements in the message


class Schedule(NamedTuple):
    sends: list
    recvs: list
    nsteps: int


EMPTY = Schedule([], [], 0)


def _segment_labels(step, phase, block, count, seg):
    return [Label(step, phase, block, k, min(seg, count - a))
            for k, a in enumerate(range(0, count, seg))]


def _ring_pass(ctx, sends, recvs, counts, block_at, first_step, phase, send_off, recv_off, seg):
    """One segmented ring pass: step s sends block(p-send_off-s), receives block(p-recv_off-s)."""
    n, p = ctx.size, ctx.ring_pos
    for s in range(n - 1):
        b = block_at((p - send_off - s) % n)
        sends.extend(_segment_labels(first_step + s, phase, b, counts[b], seg))
        b = block_at((p - recv_off - s) % n)
        recvs.extend(_segment_labels(first_step + s, phase, b, counts[b], seg))


def ring_allreduce(ctx, total, counts, displs, itemsize):
    n = ctx.size
    if n == 1 or total == 0:
        return EMPTY
    chunks, _ = _ring.split(total, n)
    seg = _ring._segment_elems(ctx, itemsize)
    sends, recvs = [], []
    _ring_pass(ctx, sends, recvs, chunks, lambda q: q, 0, "reduce-scatter", 1, 2, seg)
    _ring_pass(ctx, sends, recvs, chunks, lambda q: q, n - 1, "allgather", 0, 1, seg)
    return Schedule(sends, recvs, 2 * (n - 1))


def ring_allgather(ctx, total, counts, displs, itemsize):
    n = ctx.size
    if n == 1:
        return EMPTY
    seg = _ring.AG_SEGMENT_FACTOR * _ring._segment_elems(ctx, itemsize)  # as _ring.allgather
    sends, recvs = [], []
    _ring_pass(ctx, sends, recvs, counts, lambda q: ctx.ring[q], 0, "allgather", 0, 1, seg)
    return Schedule(sends, recvs, n - 1)


def ring_reduce_scatter(ctx, total, counts, displs, itemsize):
    n = ctx.size
    biggest = max(counts)
    if n == 1 or biggest == 0:
        return EMPTY
    p, order = ctx.ring_pos, ctx.ring
    nseg = -(-biggest // _ring._segment_elems(ctx, itemsize))
    window = min(max(1, getattr(ctx, "window", _ring.DEFAULT_WINDOW)), 64)
    group = 2 * window - 1
    pieces = {r: _ring.split(counts[r], nseg)[0] for r in set(order)}
    first = order[(p - 1) % n]
    sends, recvs = [], []
    phase = "reduce-scatter"
    for g in range(0, nseg, group):
        ks = range(g, min(g + group, nseg))
        sends.extend(Label(0, phase, first, k, pieces[first][k]) for k in ks)
        for s in range(n - 1):
            b = order[(p - 2 - s) % n]
            recvs.extend(Label(s, phase, b, k, pieces[b][k]) for k in ks)
            if s < n - 2:
                sends.extend(Label(s + 1, phase, b, k, pieces[b][k]) for k in ks)
    return Schedule(sends, recvs, n - 1)


def rd_allreduce(ctx, total, counts, displs, itemsize):
    n, rank = ctx.size, ctx.rank
    if n == 1 or total == 0:
        return EMPTY
    pof2 = 1 << (n.bit_length() - 1)
    rem = n - pof2
    rounds = pof2.bit_length() - 1
    base = 1 if rem else 0
    sends, recvs = [], []
    folded = rank < 2 * rem
    if folded:
        (sends if rank % 2 == 0 else recvs).append(Label(0, "fold", None, 0, total))
    if not (folded and rank % 2 == 0):
        for k in range(rounds):
            sends.append(Label(base + k, "exchange", None, 0, total))
            recvs.append(Label(base + k, "exchange", None, 0, total))
    if folded:
        (recvs if rank % 2 == 0 else sends).append(Label(base + rounds, "unfold", None, 0, total))
    return Schedule(sends, recvs, rounds + 2 * base)


def rd_reduce_scatter(ctx, total, counts, displs, itemsize):
    whole = max((d + c for c, d in zip(counts, displs)), default=0)
    return rd_allreduce(ctx, whole, counts, displs, itemsize)


# (collective, algorithm) -> schedule builder(ctx, total, counts, displs, itemsize)
SCHEDULES = {
    ("allreduce", "ring"): ring_allreduce,
    ("allreduce", "recursive_doubling"): rd_allreduce,
    ("reduce_scatter", "ring"): ring_reduce_scatter,
    ("reduce_scatter", "recursive_doubling"): rd_reduce_scatter,
    ("allgather", "ring"): ring_allgather,
}


def schedule(collective, algorithm, ctx, total, counts, displs, itemsize) -> Schedule | None:
    """The messages of one call in issue order, or None for an algorithm not listed."""
    build = SCHEDULES.get((collective, algorithm))
    if build is None:
        return None
    return build(ctx, total, counts, displs, itemsize)
