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

Across nodes both pair ranks by ring position and halve on bit-reversed new
ranks (:func:`_ids`): the first, largest exchange is inside a node whatever
the launcher's placement; ReduceScatter packs the blocks in that order.

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

from .recursive import bit_reversed, fold_in, fold_steps, new_rank, real_rank
from .schedule import (
    DST,
    SRC,
    Label,
    PieceBuilder,
    Region,
    exchange,
    offsets,
    packed,
    recv_from,
    send_to,
    split,
)

# --- schedules (see mpicoll.algorithms.schedule) ------------------------------------
#
# Empty messages are not sent (both ends know their sizes).  Steps: 0 is the
# fold (only when n is not a power of two), then the halving steps,
# (Rabenseifner: then the doubling steps), then the unfold.



def _incoming(b, me, rem, rank_of, half, total, src, into, label):
    """(the buffer incoming halves land in, the buffer the halving starts from).

    The buffer holds the largest incoming piece: the whole array for the fold
    (an odd id below 2*rem receives its even neighbour's, and folds it into
    ``into``), else the first kept half."""
    tmp = b.buffer("incoming half", total if rem else max(half, total - half))
    if me < 2 * rem:
        return tmp, fold_in(b, rank_of(me - 1), Region(tmp, 0, total), Region(src, 0, total),
                            Region(into, 0, total), label).buf
    return tmp, src

def _halve_steps(b, rank, newrank, pof2, rem, cur, acc, tmp, edge, first_step, last=None,
                 peer_of=None):
    """Emit recursive halving among the active ranks; the result's buffer.

    ``cur`` names the buffer holding this rank's data (never written),
    ``acc`` the one reduced ranges are written to, ``tmp`` the incoming halves.
    ``last``: a buffer the last step reduces into, at offset 0, instead of
    ``acc`` (the ReduceScatter's output: no copy after); then returns None.
    ``peer_of``: the rank acting as a new rank (default: the fold's
    :func:`real_rank`).
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
        peer = real_rank(newpeer, rem) if peer_of is None else peer_of(newpeer)
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
    b = PieceBuilder.of(shape)
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
    pof2, rem, rounds, base = fold_steps(n)
    me, rank_of, order = _ids(shape, rem, rounds)
    # Packed order: new block h holds the blocks of the ids new rank order(h)
    # stands for, so after the halving (run on order(new rank), as
    # Rabenseifner's) each id holds its own block.  On one node: rank order.
    lay, edge = [], []
    for h in range(pof2):
        q = order(h)
        edge.append(len(lay))
        lay += [2 * q, 2 * q + 1] if q < rem else [q + rem]
    lay = [rank_of(i) for i in lay]  # ranks in packed order
    at = offsets([counts[r] for r in lay])
    edge = [at[j] for j in edge] + [total]
    where = {r: at[j] for j, r in enumerate(lay)}  # rank -> start of its block
    src = SRC
    if not (packed(counts, displs) and lay == list(range(n))):
        src = b.buffer("packed input", total)
        for j, r in enumerate(lay):
            if counts[r]:
                b.copy(Region(src, at[j], at[j + 1]), Region(SRC, displs[r], displs[r] + counts[r]))
    fold_lab = Label(0, "fold", None, 0, 0)
    unfold = fold_lab._replace(step=base + rounds, phase="unfold")
    if me < 2 * rem and me % 2 == 0:
        send_to(b, rank_of(me + 1), Region(src, 0, total), fold_lab)
        recv_from(b, rank_of(me + 1), Region(DST, 0, mine), unfold._replace(block=rank))
        return b.build(rounds + 2 * base)
    # A rank outside the fold ends holding its own block: out of place, the last
    # step reduces it straight into DST.  (In place DST is the start of SRC, which
    # at two ranks is still read by that step, so the result goes through acc.)
    direct = me >= 2 * rem and not shape.in_place
    acc = b.buffer("reduced halves", total) if not (direct and pof2 == 2) else None
    tmp, cur = _incoming(b, me, rem, rank_of, edge[pof2 // 2], total, src, acc, fold_lab)

    def peer_of(q):
        return rank_of(real_rank(order(q), rem))

    cur = _halve_steps(b, rank, order(new_rank(me, rem)), pof2, rem, cur, acc, tmp, edge, base,
                       DST if direct else None, peer_of)
    if direct:
        return b.build(rounds + 2 * base)
    if me < 2 * rem:
        even = rank_of(me - 1)
        send_to(b, even, Region(cur, where[even], where[even] + counts[even]),
                unfold._replace(block=even))
    if mine:
        b.copy(Region(DST, 0, mine), Region(cur, where[rank], where[rank] + mine))
    return b.build(rounds + 2 * base)


def _ids(shape, rem, rounds):
    """(this rank's id, rank of an id, new rank of an id's new rank) for Rabenseifner.

    On one node (``shape.nodes`` with one label, or unknown) ids are ranks and
    the schedule is the textbook one.  Across nodes ids are ring positions
    (nodes are contiguous on the ring, see transport.topology), so the fold
    pairs ring neighbours, and the halving runs on bit-reversed new ranks:
    its first and largest exchange (half the array) is between ring
    neighbours, inside a node, and only the small later ones cross nodes,
    whatever the launcher's placement.
    """
    if len(set(shape.nodes)) < 2:
        return shape.rank, (lambda i: i), (lambda q: q)
    return shape.ring_pos, shape.ring.__getitem__, (lambda q: bit_reversed(q, rounds))


def allreduce_schedule(shape):
    """Rabenseifner AllReduce: recursive halving ReduceScatter + recursive doubling AllGather.

    Across nodes ranks pair by ring position, largest exchange inside a node (see :func:`_ids`).
    """
    n, rank, N = shape.size, shape.rank, shape.total
    b = PieceBuilder.of(shape)
    if n == 1 or N == 0:
        if N and not shape.in_place:
            b.copy(Region(DST, 0, N), Region(SRC, 0, N))
        return b.build(0)
    pof2, rem, rounds, base = fold_steps(n)
    me, rank_of, order = _ids(shape, rem, rounds)
    counts, displs = split(N, pof2)
    edge = displs + [N]
    fold_lab = Label(0, "fold", None, 0, 0)
    unfold = fold_lab._replace(step=base + 2 * rounds, phase="unfold")
    if me < 2 * rem and me % 2 == 0:
        send_to(b, rank_of(me + 1), Region(SRC, 0, N), fold_lab)
        recv_from(b, rank_of(me + 1), Region(DST, 0, N), unfold)
        return b.build(2 * rounds + 2 * base)
    tmp, cur = _incoming(b, me, rem, rank_of, edge[pof2 // 2], N, SRC, DST, fold_lab)
    newrank = order(new_rank(me, rem))

    def peer_of(q):
        return rank_of(real_rank(order(q), rem))

    _halve_steps(b, rank, newrank, pof2, rem, cur, DST, tmp, edge, base, peer_of=peer_of)
    for k in range(rounds):
        mask = 1 << k
        newpeer = newrank ^ mask
        mine = newrank & ~(mask - 1)
        theirs = newpeer & ~(mask - 1)
        exchange(b, peer_of(newpeer), Region(DST, edge[mine], edge[mine + mask]),
                 Region(DST, edge[theirs], edge[theirs + mask]),
                 Label(base + rounds + k, "allgather", None, 0, 0))
    if me < 2 * rem:
        send_to(b, rank_of(me - 1), Region(DST, 0, N), unfold)
    return b.build(2 * rounds + 2 * base)


SCHEDULES = {
    ("reduce_scatter", "recursive_halving"): reduce_scatter_schedule,
    ("allreduce", "rabenseifner"): allreduce_schedule,
}


# What the algorithm reference (docs/algorithms.md, generated from the registry in
# engine.select) says of each schedule: what it does, its steps, the bytes each rank
# sends (N: the array; AllGather: the gathered array) and its work memory.
ABOUT = {
    ("reduce_scatter", "recursive_halving"): {
        "summary": (
            "At distance n/2, n/4, ..., 1 a rank keeps half of its range, sends the other half to "
            "its partner and reduces what it receives: the ring's bytes in log2 n steps."
        ),
        "steps": "log2 n (+2)", "sends": "(n-1)/n·N (+N)",
        "memory": "1.5N (2N with the fold)",
    },
    ("allreduce", "rabenseifner"): {
        "summary": (
            "Recursive halving ReduceScatter, then recursive doubling AllGather of the reduced "
            "blocks: about the ring's bytes in 2 log2 n steps, for medium sizes on many ranks."
        ),
        "steps": "2 log2 n (+2)", "sends": "2(n-1)/n·N (+N)",
        "memory": "N/2 (N with the fold)",
    },
}
