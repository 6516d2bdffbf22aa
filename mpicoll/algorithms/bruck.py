"""Bruck AllGather(v): ceil(log2 n) steps for any number of ranks.

Each rank keeps the blocks in a work array rotated to start at its own
block (position j holds rank ``(rank + j) % n``).  At the step with distance
``d`` (1, 2, 4, ...) it sends its first ``min(d, n - d)`` positions to rank
``rank - d`` and receives as many from rank ``rank + d``, whose first positions
are its own positions ``d`` .. ``d + min(d, n - d)``.  A final rotation puts
the blocks in rank order.  Unlike recursive doubling it needs no fold for
rank counts that are not powers of two, at the price of two local copies.

:func:`allgather_schedule` is the algorithm as a step schedule (see
:mod:`mpicoll.algorithms.schedule`): step k is the exchange at distance 2**k.
"""

from __future__ import annotations

from .schedule import DST, Label, PieceBuilder, Region, exchange, offsets, own_block, packed


def allgather_schedule(shape):
    """Bruck AllGather(v) as a step schedule (see the module docstring).

    Step k (distance ``d = 2**k``) sends positions ``0 .. min(d, n-d)`` of
    the rotated work buffer to rank ``rank - d`` and receives positions
    ``d .. d + min(d, n-d)`` from rank ``rank + d``.  In place ``SRC`` is this
    rank's block of ``DST``.
    """
    n, rank = shape.size, shape.rank
    counts, displs = shape.counts, shape.displs
    b = PieceBuilder.of(shape)
    own = own_block(b, shape)
    # offset of position j in the rotated work buffer
    at = offsets(counts[(rank + j) % n] for j in range(n))
    total = at[n]
    nsteps = (n - 1).bit_length()
    if n == 1 or total == 0:
        return b.build(0 if n == 1 else nsteps)
    work = b.buffer("rotated blocks", total)
    if own.count:
        b.copy(Region(work, 0, at[1]), own)
    d, step = 1, 0
    while d < n:
        c = min(d, n - d)
        # one exchange with two partners: receive from rank + d, send to rank - d
        exchange(b, (rank + d) % n, Region(work, 0, at[c]), Region(work, at[d], at[d + c]),
                 Label(step, "allgather", None, 0, 0), to=(rank - d) % n)
        d <<= 1
        step += 1
    # rotate back: position j holds rank (rank + j) % n
    if packed(counts, displs):
        tail = n - rank  # positions 1 .. tail-1 are ranks rank+1 .. n-1
        if at[tail] > at[1]:
            lo = displs[rank] + counts[rank]
            b.copy(Region(DST, lo, lo + at[tail] - at[1]), Region(work, at[1], at[tail]))
        if total > at[tail]:
            lo = displs[0]
            b.copy(Region(DST, lo, lo + total - at[tail]), Region(work, at[tail], total))
    else:
        for j in range(1, n):
            r = (rank + j) % n
            if counts[r]:
                b.copy(Region(DST, displs[r], displs[r] + counts[r]), Region(work, at[j], at[j + 1]))
    return b.build(nsteps)


SCHEDULES = {("allgather", "bruck"): allgather_schedule}


# What the algorithm reference (docs/algorithms.md, generated from the registry in
# engine.select) says of each schedule: what it does, its steps, the bytes each rank
# sends (N: the array; AllGather: the gathered array) and its work memory.
ABOUT = {
    ("allgather", "bruck"): {
        "summary": (
            "Blocks kept rotated to start at this rank's own; at distance d = 1, 2, 4, ... a rank "
            "sends its first positions to rank - d: ceil(log2 n) steps at any rank count, without "
            "a fold, for two local copies."
        ),
        "steps": "ceil(log2 n)", "sends": "(n-1)/n·N",
        "memory": "N",
    },
}
