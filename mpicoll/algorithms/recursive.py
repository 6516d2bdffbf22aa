"""Latency-optimal algorithms: recursive doubling AllReduce, ReduceScatter, AllGather.

Recursive doubling takes ceil(log2 n) steps of whole-array exchanges (plus
two for the fold when n is not a power of two): few messages, so it wins for
small arrays; each rank moves log2(n) full arrays, so the ring wins for large
ones.

Fold (n not a power of two, pof2 = largest power of two <= n, rem = n - pof2)
    Among the first 2*rem ranks, each even rank hands its data to the odd
    rank above it and sits out; the pof2 remaining ranks get "new ranks"
    0..pof2-1 (new rank i < rem is real rank 2i+1, else real rank i+rem) and
    run the power-of-two algorithm; at the end each odd rank returns the
    result to its even neighbour.

AllReduce keeps rank order, so it is also the algorithm for non-commutative
ops: new rank i stands for a contiguous run of real ranks, and at every step
the data of the lower group is the left operand.  Both partners of a step
evaluate the same expression ``lower op higher``, so all ranks end with
bitwise-identical results.  The first step reads the input directly and every
step writes into the output or one work array, so a 2-rank call is one
exchange and one reduction, with no copies.

Across nodes (commutative ops, and AllGather) ranks pair by ring position
(:func:`ids`), so the launcher's placement does not change which exchanges
cross nodes; AllGather also runs on bit-reversed new ranks, so its largest
exchange stays inside a node.  On one node the schedules are the textbook ones.

Schedules
    :func:`allreduce_schedule`, :func:`reduce_scatter_schedule` and
    :func:`allgather_schedule` are the algorithms as step schedules (see
    :mod:`mpicoll.algorithms.schedule`; :data:`SCHEDULES` lists them).  Step 0
    is the fold (only when n is not a power of two), then one exchange step per
    bit of pof2, then the unfold;
    each exchange is "post the receive, post the send, wait for both" and an
    empty message is not sent (both ends know its size).
"""

from __future__ import annotations

from .schedule import (
    DST,
    SRC,
    Builder,
    Label,
    PieceBuilder,
    Region,
    exchange,
    offsets,
    own_block,
    packed,
    recv_from,
    send_to,
)


def fold(n: int):
    """(pof2, rem): largest power of two <= n, and n - pof2."""
    pof2 = 1 << (n.bit_length() - 1)
    return pof2, n - pof2


def new_rank(rank: int, rem: int) -> int:
    """This rank's rank among the pof2 active ranks after the fold (-1: sits out)."""
    if rank < 2 * rem:
        return rank // 2 if rank % 2 else -1
    return rank - rem


def real_rank(newrank: int, rem: int) -> int:
    """The real rank acting as ``newrank`` after the fold."""
    return newrank * 2 + 1 if newrank < rem else newrank + rem


# --- schedules (see mpicoll.algorithms.schedule) ------------------------------------
#
# Empty messages are not sent (both ends know their sizes).  Steps: 0 is the
# fold (only when n is not a power of two), then one step per bit of pof2,
# then the unfold.


def fold_in(b: Builder, peer: int, incoming: Region, src: Region, into: Region,
            label: Label) -> Region:
    """The fold on an odd id below 2*rem: receive the even ``peer``'s data into ``incoming``,
    reduce ``incoming op src`` (the lower id's data on the left) into ``into``; returns it."""
    recv_from(b, peer, incoming, label)
    b.reduce(incoming, src, into)
    return into


def fold_steps(n: int):
    """(pof2, rem, rounds, base): base = 1 when step 0 is a fold."""
    pof2, rem = fold(n)
    return pof2, rem, pof2.bit_length() - 1, 1 if rem else 0


def ids(shape, commutative=True):
    """(this rank's id, rank of an id): the numbering recursive doubling and halving run on.

    On one node (``shape.nodes`` with one label, or unknown) ids are ranks and
    the schedules are the textbook ones.  Across nodes ids are ring positions:
    nodes are contiguous on the ring (transport.topology), so ids pair the
    same way under any launcher placement, as ranks do under block
    placement: the fold and the small masks pair ranks of one node.  Not for
    non-commutative ops, whose operands must stay in rank order.
    """
    if not commutative or len(set(shape.nodes)) < 2:
        return shape.rank, _same
    return shape.ring_pos, shape.ring.__getitem__


def _same(i: int) -> int:
    return i


def _allreduce_into(b: Builder, n: int, rank: int, src: Region, dst: Region, in_place: bool,
                    tmp_name: str, rank_of=_same) -> None:
    """Emit recursive doubling AllReduce of ``src`` into ``dst`` (same length N > 0).

    ``rank`` is this rank's id and ``rank_of`` maps an id to the rank to message
    (see :func:`ids`); operands are ordered by id.
    """
    N = dst.count
    pof2, rem, rounds, base = fold_steps(n)
    lab = Label(0, "fold", None, 0, N)
    if rank < 2 * rem and rank % 2 == 0:
        # Sit out: hand the data to rank + 1 (the left operand there), wait for the result.
        send_to(b, rank_of(rank + 1), src, lab)
        recv_from(b, rank_of(rank + 1), dst, lab._replace(step=base + rounds, phase="unfold"))
        return
    tmp = Region(b.buffer(tmp_name, N), 0, N)
    cur = src  # region holding this rank's partial result; src is never written
    if rank < 2 * rem:
        recv_from(b, rank_of(rank - 1), tmp, lab)
        b.reduce(tmp, src, dst)  # (the lower id's data on the left, as fold_in does)
        cur = dst
    newrank = new_rank(rank, rem)
    for k in range(rounds):
        peer = real_rank(newrank ^ (1 << k), rem)
        if cur == src and peer >= 2 * rem and not in_place:
            # both partners exchange their inputs (neither folded in): each reduces
            # ``lower op higher`` of its input and the peer's into dst, a separate output
            # on both, so neither copies its input first
            exchange(b, rank_of(peer), src, tmp, Label(base + k, "exchange", None, 0, N))
            b.reduce(tmp, src, dst) if peer < rank else b.reduce(src, tmp, dst)
            cur = dst
            continue
        if cur == src:
            # first exchange: straight into dst when the peer's data is the right operand
            rbuf = dst if peer > rank and not in_place else tmp
        else:
            rbuf = tmp if cur == dst else dst
        exchange(b, rank_of(peer), cur, rbuf, Label(base + k, "exchange", None, 0, N))
        if peer < rank:
            # peer's (lower ranks) op mine, written over mine (a copy of it if mine is the
            # input): the right operand is the output on both partners, as in the branch
            # below, because NumPy may round differently when the output is a separate
            # array (complex multiply of one element does), and both must produce the same bits
            if cur == src:
                if not in_place:
                    b.copy(dst, src)
                cur = dst
            b.reduce(rbuf, cur, cur)
        else:
            b.reduce(cur, rbuf, rbuf)  # mine op peer's (higher ranks)
            cur = rbuf
    if rank < 2 * rem:
        send_to(b, rank_of(rank - 1), cur, Label(base + rounds, "unfold", None, 0, N))
    if cur != dst:
        b.copy(dst, cur)


def allreduce_schedule(shape):
    """Recursive doubling AllReduce of ``shape.total`` elements: SRC -> DST."""
    n, N = shape.size, shape.total
    b = PieceBuilder.of(shape)
    if n == 1 or N == 0:
        if N and not shape.in_place:
            b.copy(Region(DST, 0, N), Region(SRC, 0, N))
        return b.build(0)
    me, rank_of = ids(shape, shape.commutative)
    _allreduce_into(b, n, me, Region(SRC, 0, N), Region(DST, 0, N), shape.in_place,
                    "incoming partial", rank_of)
    _, _, rounds, base = fold_steps(n)
    return b.build(rounds + 2 * base)


def reduce_scatter_schedule(shape):
    """ReduceScatter as a recursive doubling AllReduce of the whole input into a work buffer.

    In place ``DST`` is the start of ``SRC``: it is written only by the final copy.
    """
    n, rank = shape.size, shape.rank
    total = max((d + c for c, d in zip(shape.counts, shape.displs)), default=0)
    own, mine = shape.displs[rank], shape.counts[rank]
    b = PieceBuilder.of(shape)
    if total == 0:
        return b.build(0)
    if n == 1 and not (shape.in_place and own):
        # nothing to reduce; in place at offset 0 nothing to move either
        if mine and not shape.in_place:
            b.copy(Region(DST, 0, mine), Region(SRC, own, own + mine))
        return b.build(0)
    full = Region(b.buffer("whole result", total), 0, total)
    if n == 1:
        b.copy(full, Region(SRC, 0, total))  # own block moves down over itself in place
    else:
        me, rank_of = ids(shape, shape.commutative)
        _allreduce_into(b, n, me, Region(SRC, 0, total), full, False, "incoming partial", rank_of)
    if mine:
        b.copy(Region(DST, 0, mine), Region(full.buf, own, own + mine))
    _, _, rounds, base = fold_steps(n)
    return b.build(0 if n == 1 else rounds + 2 * base)


def bit_reversed(x: int, bits: int) -> int:
    """``x`` with its low ``bits`` bits in reverse order."""
    return int(f"{x:0{bits}b}"[::-1], 2) if bits else 0


def allgather_schedule(shape):
    """Recursive doubling AllGather(v): swap runs of blocks with new rank ``i ^ mask``.

    Blocks move straight in ``DST`` when they are packed in rank order, else
    through a packed work buffer.  In place ``SRC`` is this rank's block of ``DST``.
    Across nodes ranks pair by ring position (:func:`ids`) and the doubling runs
    on bit-reversed new ranks (as Rabenseifner's AllGather half): its last and
    largest exchange (half the array) is between ring neighbours, inside a node.
    """
    n, rank = shape.size, shape.rank
    counts, displs = shape.counts, shape.displs
    b = PieceBuilder.of(shape)
    me, rank_of = ids(shape)
    pof2, rem, rounds, base = fold_steps(n)
    order = _same if rank_of is _same else (lambda q: bit_reversed(q, rounds))
    # Packed order: new block h holds the blocks of the ids new rank order(h)
    # stands for (on one node: rank order).
    lay, first = [], []
    for h in range(pof2):
        q = order(h)
        first.append(len(lay))
        lay += [2 * q, 2 * q + 1] if q < rem else [q + rem]
    slot = {i: j for j, i in enumerate(lay)}  # id -> its place in packed order
    lay = [rank_of(i) for i in lay]  # ranks in packed order
    in_order = packed(counts, displs) and lay == list(range(n))
    # With n a power of two and the blocks packed, the first exchange sends this rank's
    # block straight from SRC and the copy into DST runs while it is on the wire.
    late = n > 1 and in_order and rem == 0 and not shape.in_place
    if late:
        own = Region(DST, displs[rank], displs[rank] + counts[rank])
    else:
        own = own_block(b, shape)
    if n == 1:
        return b.build(0)
    start = offsets([counts[r] for r in lay])
    total = start[n]

    def block(i):  # id i's block in the packed order
        return Region(work, start[slot[i]], start[slot[i] + 1])

    if in_order:
        work = DST
    else:
        work = b.buffer("packed blocks", total)
        b.copy(block(me), own)
    edge = [start[j] for j in first] + [total]
    lab = Label(0, "fold", None, 0, 0)
    unfold = lab._replace(step=base + rounds, phase="unfold")
    if me < 2 * rem and me % 2 == 0:
        send_to(b, rank_of(me + 1), block(me), lab._replace(block=rank))
        recv_from(b, rank_of(me + 1), Region(work, 0, total), unfold)
    else:
        if me < 2 * rem:
            recv_from(b, rank_of(me - 1), block(me - 1), lab._replace(block=rank_of(me - 1)))
        newrank = order(new_rank(me, rem))
        for k in range(rounds):
            mask = 1 << k
            newpeer = newrank ^ mask
            mine = newrank & ~(mask - 1)
            theirs = newpeer & ~(mask - 1)
            peer = rank_of(real_rank(order(newpeer), rem))
            send = Region(work, edge[mine], edge[mine + mask])
            recv = Region(work, edge[theirs], edge[theirs + mask])
            label = Label(base + k, "exchange", None, 0, 0)
            if late and k == 0:  # send is own: it goes from SRC, copied into own meanwhile
                src = Region(SRC, 0, own.count)
                exchange(b, peer, src, recv, label, during=(own, src))
            else:
                exchange(b, peer, send, recv, label)
        if me < 2 * rem:
            send_to(b, rank_of(me - 1), Region(work, 0, total), unfold)
    if not in_order:
        for j, r in enumerate(lay):
            if counts[r]:
                b.copy(Region(DST, displs[r], displs[r] + counts[r]),
                       Region(work, start[j], start[j + 1]))
    return b.build(rounds + 2 * base)


SCHEDULES = {
    ("allreduce", "recursive_doubling"): allreduce_schedule,
    ("reduce_scatter", "recursive_doubling"): reduce_scatter_schedule,
    ("allgather", "recursive_doubling"): allgather_schedule,
}


# What the algorithm reference (docs/algorithms.md, generated from the registry in
# engine.select) says of each schedule: what it does, its steps, the bytes each rank
# sends (N: the array; AllGather: the gathered array) and its work memory.
ABOUT = {
    ("allreduce", "recursive_doubling"): {
        "summary": (
            "Whole-array exchanges with the rank at distance 1, 2, 4, ...: few steps, so it wins "
            "for small arrays. It keeps rank order (the lower ranks are the left operand), so it "
            "also runs non-commutative ops."
        ),
        "steps": "log2 n (+2)", "sends": "log2 n·N",
        "memory": "N",
    },
    ("reduce_scatter", "recursive_doubling"): {
        "summary": (
            "A recursive doubling AllReduce of the whole input into a work array, then this "
            "rank's block copied out: the order-preserving ReduceScatter."
        ),
        "steps": "log2 n (+2)", "sends": "log2 n·N",
        "memory": "2N",
    },
    ("allgather", "recursive_doubling"): {
        "summary": (
            "Runs of blocks swapped with the rank at distance 1, 2, 4, ..., straight in the "
            "output; across nodes on bit-reversed ranks, so the largest exchange stays inside a "
            "node."
        ),
        "steps": "log2 n (+2)", "sends": "(n-1)/n·N (+N)",
        "memory": "none (packed blocks)",
    },
}
