"""Direct ReduceScatter: every rank sends each block to its owner, who folds them in rank order.

Rank p sends block q of its input straight to rank q (for every q != p) and
receives block p from every other rank; it then combines the n contributions
to its block in rank order, from the left::

    acc = x0[p];  acc = acc op x1[p];  acc = acc op x2[p];  ...  DST = acc

so the result is ``((x0 op x1) op x2) op ...`` for every element, whatever
the message size, segment size or window: there is one way to group the
operands, the one a sequential loop over the ranks uses.  That makes it the
schedule of two things (engine.select's dtype policy):

* deterministic mode: a floating SUM that is bitwise the same for every
  configuration, equal to the rank-order fold;
* non-commutative ops: the left operand is always the lower rank's.

AllReduce ("direct"): the same ReduceScatter of the array's blocks (the
``numpy.array_split`` rule), then each rank sends its folded block straight
to every other rank; one schedule, so a non-blocking call is one operation.

Accumulating in a wider type (``shape.accumulate``: float32 for a 16/8-bit SUM/PROD,
engine.select): the blocks travel in the call's type and the owner folds them in that
type, rounding once, so the ring's bytes move rather than float32's twice as many.

Cost: each rank sends and receives (n-1)/n of the array, as the ring does,
to n-1 peers at once (one step) rather than in n-1 steps to one neighbour.
Every block is cut into the same number of pieces (of at most the context's
segment; schedule.PieceBuilder says why pieces); every send is posted at
once, receives ``window`` rounds ahead (round j: piece j from every rank),
and piece j is folded as soon as its round arrived, out of place straight
into ``DST`` (AllReduce: then sent on to every rank at once).  The pieces change how the
messages are cut, never how the operands are grouped, so the result does not
depend on the segment or window.  Sends go to p+1, p+2, ... so that no rank
is everyone's first destination.
"""

from __future__ import annotations

from .ring import split
from .schedule import DST, SRC, Label, PieceBuilder, Region, offsets, packed


def reduce_scatter_schedule(shape):
    """Direct ReduceScatter in rank order: ``DST`` gets this rank's block (``counts[rank]``).

    In place ``DST`` is the start of ``SRC``, which the sends read: the fold
    goes to a work buffer copied into ``DST`` once every send completed --
    unless this rank's own block is that start (rank 0's; no send reads it).
    """
    b = PieceBuilder.of(shape)
    mine = shape.counts[shape.rank]
    acc = None
    if shape.in_place and mine and not _own_block_first(shape):
        acc = Region(b.buffer("rank-order fold", mine), 0, mine)
    _fold(b, shape, shape.counts, shape.displs, Region(DST, 0, mine) if acc is None else acc)
    if acc is not None:
        b.copy(Region(DST, 0, mine), acc)
    return b.build(1 if shape.size > 1 else 0)


def allreduce_schedule(shape):
    """Direct AllReduce: the rank-order ReduceScatter, then every block sent to every rank.

    Each folded piece of this rank's block goes to every rank as soon as it is
    folded; the other blocks are received into ``DST`` once every receive of
    the first phase was posted (one tag: a peer's messages match in order) and,
    in place, every send of the first phase completed (they read ``SRC``).
    """
    n, p = shape.size, shape.rank
    counts, displs = split(shape.total, n)
    counts, displs = tuple(counts), tuple(displs)
    b = PieceBuilder.of(shape)
    mine, own = counts[p], displs[p]
    home = Region(DST, own, own + mine)
    nseg = _nseg(b, counts)

    def gather(j, a, c):  # piece j of this rank's block is final: to every rank
        for q in _to(n, p):
            b.send(q, home.part(a, c), Label(2, "allgather", p, j, c - a))

    _fold(b, shape, counts, displs, home, gather)
    for q in _from(n, p):
        block = Region(DST, displs[q], displs[q] + counts[q])
        for j, (a, c) in enumerate(_cut(counts[q], nseg)):
            if c > a:
                b.recv(q, block.part(a, c), Label(2, "allgather", q, j, c - a))
    return b.build(2 if n > 1 else 0)


def _from(n, p):
    return [(p - k) % n for k in range(1, n)]


def _to(n, p):  # p+1 first: no rank is everyone's first destination
    return [(p + k) % n for k in range(1, n)]


def _nseg(b, counts) -> int:
    """Pieces per block: the same for every block and rank (both ends of a message cut it alike)."""
    return max(1, -(-max(counts, default=0) // b.piece))


def _cut(count: int, nseg: int) -> list:
    at = offsets(split(count, nseg)[0])
    return list(zip(at, at[1:]))


def _fold(b, shape, counts, displs, target, folded=None):
    """Send every block to its owner, receive this rank's from every other rank and fold them
    into ``target`` (this rank's count) in rank order, piece by piece as they arrive; ends
    with every send completed (they read ``SRC``, which may be ``DST``).  ``folded(j, a, c)``
    runs once piece j (elements ``a:c`` of the block) is final in ``target``.

    Every send is posted first: they read ``SRC`` only, so they need no memory, and a rank
    waits only for receives, whose sends are all posted, so nothing waits in a cycle.
    Receives are posted ``window`` rounds ahead, round j holding piece j from every rank.
    The fold of a piece is ``acc = x0 op x1; acc = acc op x2; ...``.  Unless the target is
    this rank's input (in place: AllReduce, or a ReduceScatter's block at offset 0), the
    first operand this rank does not hold (x0, or x1 on rank 0) is received straight into
    the target and the fold accumulates there, so no work memory holds it (at 2 ranks
    none at all, as the ring's).  Otherwise the accumulator is the target itself when this
    rank is 0, else the slot x0 arrived in, the last step writing the target: in place the
    input is read before it is written.

    ``shape.accumulate`` (a wider type): messages still carry the call's type (so the bytes
    are the call's), and piece j is folded as ``acc = widen(x0); acc = acc op x1; ...`` in
    an accumulator of that type, then rounded once into the target: the same rank-order
    fold, in the wider type.
    """
    n, p = shape.size, shape.rank
    mine, own = counts[p], displs[p]
    nseg = _nseg(b, counts)
    cut = _cut(mine, nseg)
    width = max((c - a for a, c in cut), default=0)
    window = min(b.window, nseg)
    peers = _from(n, p)
    # the first operand from a peer straight into the target, unless it holds this rank's input
    first = 1 if p == 0 else 0
    into_target = n > 1 and not _aliases_input(shape, target)
    slotted = [q for q in peers if not (into_target and q == first)]
    index = {q: i for i, q in enumerate(slotted)}
    inbox = b.buffer("received pieces", window * len(slotted) * width) if mine and slotted else None
    # folding in a wider type: the pieces travel and arrive in the call's type, and each is
    # folded in one accumulator piece of the wider type (the fold of a piece ends before the
    # next one's begins)
    wide = shape.accumulate if n > 1 and mine else None
    accbuf = b.buffer("accumulator", width, wide) if wide is not None else None

    def where(j, q, a, c):  # piece j from q: the target, or window rounds of slots, reused
        if into_target and q == first:
            return target.part(a, c)
        at = ((j % window) * len(slotted) + index[q]) * width
        return Region(inbox, at, at + c - a)

    sends = []
    for q in _to(n, p):
        block = Region(SRC, displs[q], displs[q] + counts[q])
        for j, (a, c) in enumerate(_cut(counts[q], nseg)):
            if c > a:
                sends.append(b.send(q, block.part(a, c), Label(1, "reduce-scatter", q, j, c - a)))
    posted = {}

    def post(j):
        a, c = cut[j]
        posted[j] = [b.recv(q, where(j, q, a, c), Label(1, "reduce-scatter", p, j, c - a))
                     for q in peers] if c > a else []

    for j in range(min(window, nseg)):
        post(j)
    for j in range(nseg):
        a, c = cut[j]
        b.wait(*posted.pop(j))
        if c > a:
            out = target.part(a, c)
            xs = [Region(SRC, own + a, own + c) if r == p else where(j, r, a, c) for r in range(n)]
            if n == 1:
                b.copy(out, xs[0])
            elif wide is not None:  # widen x0, fold the others into it, round once
                acc = Region(accbuf, 0, c - a)
                b.copy(acc, xs[0])
                for r in range(1, n):
                    b.reduce(acc, xs[r], acc)  # the lower ranks on the left
                b.copy(out, acc)
            else:
                acc = xs[0]
                mid = out if p == 0 or into_target else xs[0]
                for r in range(1, n):
                    to = out if r == n - 1 else mid
                    b.reduce(acc, xs[r], to)  # the lower ranks on the left
                    acc = to
        if j + window < nseg:
            post(j + window)
        if c > a and folded is not None:
            folded(j, a, c)
    b.wait(*sends)  # in place, DST is (the start of) SRC, which the sends read


def _own_block_first(shape) -> bool:
    """Whether a ReduceScatter's own block is the first of a packed input (then in place it
    is ``DST``, and no send reads it)."""
    return shape.displs[shape.rank] == 0 and packed(shape.counts, shape.displs)


def _aliases_input(shape, target) -> bool:
    """Whether ``target`` is memory of this rank's input: in place, ``DST`` of an AllReduce
    (it is ``SRC``) or of a ReduceScatter whose own block comes first."""
    return shape.in_place and target.buf == DST and (
        shape.counts == (shape.total,) or _own_block_first(shape))


SCHEDULES = {
    ("reduce_scatter", "direct"): reduce_scatter_schedule,
    ("allreduce", "direct"): allreduce_schedule,
}


# What the algorithm reference (docs/algorithms.md, generated from the registry in
# engine.select) says of each schedule: what it does, its steps, the bytes each rank
# sends (N: the array; AllGather: the gathered array) and its work memory.
ABOUT = {
    ("reduce_scatter", "direct"): {
        "summary": (
            "Every rank sends each block straight to its owner, which folds the n contributions "
            "in rank order from the left: one grouping of the operands whatever the size or "
            "settings, so deterministic mode and non-commutative ops run on it, and 16/8-bit "
            "floats are folded in float32 here."
        ),
        "steps": "1", "sends": "(n-1)/n·N",
        "memory": "`window`·(n-2) pieces",
    },
    ("allreduce", "direct"): {
        "summary": (
            "The direct ReduceScatter, then each rank sends its folded block straight to every "
            "rank: the rank-order result in two steps."
        ),
        "steps": "2", "sends": "2(n-1)/n·N",
        "memory": "`window`·(n-2) pieces",
    },
}
