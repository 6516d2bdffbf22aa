"""Recursive halving ReduceScatter and Rabenseifner AllReduce (commutative ops).

Recursive halving (ReduceScatter)
    The pof2 active ranks (see the fold in :mod:`mpicoll.algorithms.recursive`) split
    the array into pof2 "new blocks" (new block i = the blocks of the real
    ranks new rank i stands for).  At the step with distance ``mask``
    (pof2/2, pof2/4, ..., 1) a rank keeps the half of its current run of new
    blocks on its own side, sends the other half to new rank ``i ^ mask`` and
    reduces the half it receives into the half it keeps.  After log2(pof2)
    steps new rank i holds new block i reduced over all ranks; odd ranks of
    the fold then hand the even neighbour its block.  Each rank sends
    (pof2-1)/pof2 of the array in log2(pof2) messages: the ring's volume with
    the latency of recursive doubling.  Uneven and empty blocks are fine: all
    ranks compute the same element ranges from ``counts``.

Rabenseifner (AllReduce)
    Recursive halving over ``split(N, pof2)`` followed by recursive doubling
    AllGather of the reduced blocks (the halving steps in reverse).  Every
    element is reduced on exactly one rank and then copied, so all ranks get
    bitwise-identical results.

Halving combines the data of ranks ``i`` and ``i ^ mask`` before those of
their neighbours, i.e. not in rank order: only commutative ops may use it.

Schedules
    :func:`reduce_scatter_schedule` and :func:`allreduce_schedule` are the
    algorithms as step schedules (:data:`SCHEDULES`, see
    :mod:`mpicoll.algorithms.schedule`): step 0 the fold (when n is not a
    power of two), then the halving steps (Rabenseifner: then the doubling
    steps), then the unfold.
"""

from __future__ import annotations

from .recursive import fold_in, fold_steps, new_rank, real_rank
from .schedule import DST, SRC, Builder, Label, Region, exchange, offsets, packed, recv_from, send_to, split

# --- schedules (see mpicoll.algorithms.schedule) ------------------------------------
#
# Empty messages are not sent (both ends know their sizes).  Steps: 0 is the
# fold (only when n is not a power of two), then the halving steps,
# (Rabenseifner: then the doubling steps), then the unfold.


def _halve_steps(b, rank, newrank, pof2, rem, cur, acc, tmp, edge, first_step, last=None):
    """Emit recursive halving among the active ranks; the result's buffer.

    ``cur`` names the buffer holding this rank's data (never written),
    ``acc`` the one reduced ranges are written to, ``tmp`` the incoming halves.
    ``last``: a buffer the last step reduces into, at offset 0, instead of
    ``acc`` (the ReduceScatter's output: no copy after); then returns None.
    """
    lo, hi = 0, pof2
    mask, step = pof2 >> 1, first_step
    while mask:
        newpeer = newrank ^ mask
        mid = lo + mask
        if newrank < newpeer:
            keep_lo, keep_hi, give_lo, give_hi = lo, mid, mid, hi
        else:
            keep_lo, keep_hi, give_lo, give_hi = mid, hi, lo, mid
        ka, kb = edge[keep_lo], edge[keep_hi]
        peer = real_rank(newpeer, rem)
        incoming = Region(tmp, 0, kb - ka)
        exchange(b, peer, Region(cur, edge[give_lo], edge[give_hi]), incoming,
                 Label(step, "reduce-scatter", None, 0, 0))
        if kb > ka:
            mine, out = Region(cur, ka, kb), Region(acc, ka, kb)
            if last is not None and mask == 1:
                out = Region(last, 0, kb - ka)
            if peer < rank:
                b.reduce(incoming, mine, out)
            else:
                b.reduce(mine, incoming, out)
        cur = acc
        lo, hi = keep_lo, keep_hi
        mask >>= 1
        step += 1
    return None if last is not None else cur


def reduce_scatter_schedule(shape):
    """Recursive halving ReduceScatter: ``DST`` gets this rank's block (``counts[rank]``).

    In place ``DST`` is the start of ``SRC`` and is written only at the end.
    """
    n, rank = shape.size, shape.rank
    counts, displs = shape.counts, shape.displs
    own, mine = displs[rank], counts[rank]
    b = Builder()
    if n == 1:
        if mine and not (shape.in_place and own == 0):
            if shape.in_place:  # own block moves down over itself: through a work buffer
                t = b.buffer("packed input", mine)
                b.copy(Region(t, 0, mine), Region(SRC, own, own + mine))
                b.copy(Region(DST, 0, mine), Region(t, 0, mine))
            else:
                b.copy(Region(DST, 0, mine), Region(SRC, own, own + mine))
        return b.build(0)
    total = sum(counts)
    if total == 0:
        return b.build(0)
    src = SRC
    start = offsets(counts)
    if not packed(counts, displs):
        src = b.buffer("packed input", total)
        for r in range(n):
            if counts[r]:
                b.copy(Region(src, start[r], start[r + 1]), Region(SRC, displs[r], displs[r] + counts[r]))
    pof2, rem, rounds, base = fold_steps(n)
    edge = [start[2 * i] if i < rem else start[i + rem] for i in range(pof2)] + [total]
    fold_lab = Label(0, "fold", None, 0, 0)
    unfold = fold_lab._replace(step=base + rounds, phase="unfold")
    if rank < 2 * rem and rank % 2 == 0:
        send_to(b, rank + 1, Region(src, 0, total), fold_lab)
        recv_from(b, rank + 1, Region(DST, 0, mine), unfold._replace(block=rank))
        return b.build(rounds + 2 * base)
    # A rank outside the fold ends holding its own block: out of place, the last
    # step reduces it straight into DST.  (In place DST is the start of SRC, which
    # at two ranks is still read by that step, so the result goes through acc.)
    direct = rank >= 2 * rem and not shape.in_place
    acc = b.buffer("reduced halves", total) if not (direct and pof2 == 2) else None
    # largest incoming piece: the whole input for the fold, else the first kept half
    half = edge[pof2 // 2]
    tmp = b.buffer("incoming half", total if rem else max(half, total - half))
    cur = src
    if rank < 2 * rem:
        fold_in(b, rank, Region(tmp, 0, total), Region(src, 0, total), Region(acc, 0, total),
                fold_lab)
        cur = acc
    cur = _halve_steps(b, rank, new_rank(rank, rem), pof2, rem, cur, acc, tmp, edge, base,
                       DST if direct else None)
    if direct:
        return b.build(rounds + 2 * base)
    if rank < 2 * rem:
        send_to(b, rank - 1, Region(cur, start[rank - 1], start[rank]), unfold._replace(block=rank - 1))
    if mine:
        b.copy(Region(DST, 0, mine), Region(cur, start[rank], start[rank] + mine))
    return b.build(rounds + 2 * base)


def allreduce_schedule(shape):
    """Rabenseifner AllReduce: recursive halving ReduceScatter + recursive doubling AllGather."""
    n, rank, N = shape.size, shape.rank, shape.total
    b = Builder()
    if n == 1 or N == 0:
        if N and not shape.in_place:
            b.copy(Region(DST, 0, N), Region(SRC, 0, N))
        return b.build(0)
    pof2, rem, rounds, base = fold_steps(n)
    counts, displs = split(N, pof2)
    edge = displs + [N]
    fold_lab = Label(0, "fold", None, 0, 0)
    unfold = fold_lab._replace(step=base + 2 * rounds, phase="unfold")
    if rank < 2 * rem and rank % 2 == 0:
        send_to(b, rank + 1, Region(SRC, 0, N), fold_lab)
        recv_from(b, rank + 1, Region(DST, 0, N), unfold)
        return b.build(2 * rounds + 2 * base)
    # largest incoming piece: the whole array for the fold, else the first kept half
    half = edge[pof2 // 2]
    tmp = b.buffer("incoming half", N if rem else max(half, N - half))
    cur = SRC
    if rank < 2 * rem:
        fold_in(b, rank, Region(tmp, 0, N), Region(SRC, 0, N), Region(DST, 0, N), fold_lab)
        cur = DST
    newrank = new_rank(rank, rem)
    _halve_steps(b, rank, newrank, pof2, rem, cur, DST, tmp, edge, base)
    for k in range(rounds):
        mask = 1 << k
        newpeer = newrank ^ mask
        mine = newrank & ~(mask - 1)
        theirs = newpeer & ~(mask - 1)
        exchange(b, real_rank(newpeer, rem), Region(DST, edge[mine], edge[mine + mask]),
                 Region(DST, edge[theirs], edge[theirs + mask]),
                 Label(base + rounds + k, "allgather", None, 0, 0))
    if rank < 2 * rem:
        send_to(b, rank - 1, Region(DST, 0, N), unfold)
    return b.build(2 * rounds + 2 * base)


SCHEDULES = {
    ("reduce_scatter", "recursive_halving"): reduce_scatter_schedule,
    ("allreduce", "rabenseifner"): allreduce_schedule,
}
