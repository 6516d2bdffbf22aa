"""The recursive doubling labels as they were before the schedules (to be deleted).

Every algorithm now runs as a schedule whose Send/Recv ops carry their labels
(algorithms.schedule), and observe.calls reads them there; nothing in the
library reads this module.  tests/test_schedules.py still compares the
recursive doubling schedules' labels with these; delete both together.

recursive doubling AllReduce / ReduceScatter (n = pof2 + rem)
    step 0 folds the first 2*rem ranks in pairs (only when rem > 0), then one
    exchange step per bit of pof2, then a last step unfolds

Every label carries the message's element count; the observer drops the
labels of a call whose messages do not match them (an algorithm changed
without this table), and algorithms not listed get no labels.
"""

from __future__ import annotations

from typing import NamedTuple


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
    ("allreduce", "recursive_doubling"): rd_allreduce,
    ("reduce_scatter", "recursive_doubling"): rd_reduce_scatter,
}


def schedule(collective, algorithm, ctx, total, counts, displs, itemsize) -> Schedule | None:
    """The messages of one call in issue order, or None for an algorithm not listed."""
    build = SCHEDULES.get((collective, algorithm))
    if build is None:
        return None
    return build(ctx, total, counts, displs, itemsize)
