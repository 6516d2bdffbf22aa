"""Direct ReduceScatter: every rank sends each block to its owner, who folds them in rank order.

Rank p sends block q of its input straight to rank q (for every q != p) and
receives block p from every other rank; it then combines the n contributions
to its block in rank order, from the left::

    acc = x0[p];  acc = acc op x1[p];  acc = acc op x2[p];  ...  DST = acc

so the result is ``((x0 op x1) op x2) op ...`` for every element, whatever
the message size, segment size or window: there is one way to group the
operands, the one a sequential loop over the ranks uses.  That makes it the
schedule of two things (api.numerics):

* deterministic mode: a floating SUM that is bitwise the same for every
  configuration, equal to the rank-order fold;
* non-commutative ops: the left operand is always the lower rank's.

AllReduce ("direct"): the same ReduceScatter of the array's blocks (the
``numpy.array_split`` rule), then each rank sends its folded block straight
to every other rank; one schedule, so a non-blocking call is one operation.

Cost: each rank sends and receives (n-1)/n of the array, as the ring does,
to n-1 peers at once (one step) rather than in n-1 steps to one neighbour.
Every block is cut into the same number of pieces (of at most the context's
segment; schedule.PieceBuilder says why pieces) and round j moves piece j of
every block, ``window`` rounds in flight; piece j is folded as soon as its
round arrived, out of place straight into ``DST``.  The pieces change how the
messages are cut, never how the operands are grouped, so the result does not
depend on the segment or window.  Sends go to p+1, p+2, ... so that no rank
is everyone's first destination.
"""

from __future__ import annotations

from .ring import split
from .schedule import DST, SRC, Label, PieceBuilder, Region, offsets


def reduce_scatter_schedule(shape):
    """Direct ReduceScatter in rank order: ``DST`` gets this rank's block (``counts[rank]``).

    In place ``DST`` is the start of ``SRC``, which the sends read: the fold
    goes to a work buffer copied into ``DST`` once every send completed.
    """
    b = PieceBuilder(shape.segment, shape.window)
    mine = shape.counts[shape.rank]
    acc = None
    if shape.in_place and mine:
        acc = Region(b.buffer("rank-order fold", mine), 0, mine)
    _fold(b, shape, shape.counts, shape.displs, Region(DST, 0, mine) if acc is None else acc)
    if acc is not None:
        b.copy(Region(DST, 0, mine), acc)
    return b.build(1 if shape.size > 1 else 0)


def allreduce_schedule(shape):
    """Direct AllReduce: the rank-order ReduceScatter, then every block sent to every rank.

    Blocks of ``DST`` (in place: also ``SRC``) other than this rank's are
    received only after every send of the first phase completed.
    """
    n, p = shape.size, shape.rank
    counts, displs = split(shape.total, n)
    counts, displs = tuple(counts), tuple(displs)
    b = PieceBuilder(shape.segment, shape.window)
    mine, own = counts[p], displs[p]
    home = Region(DST, own, own + mine)
    _fold(b, shape, counts, displs, home)
    nseg = _nseg(b, counts)
    recvs = [(q, counts[q], _part(Region(DST, displs[q], displs[q] + counts[q])),
              Label(2, "allgather", q, 0, counts[q])) for q in _from(n, p)]
    sends = [(q, mine, _part(home), Label(2, "allgather", p, 0, mine)) for q in _to(n, p)]
    _rounds(b, recvs, sends, nseg)
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


def _rounds(b, recvs, sends, nseg, after=None):
    """Post piece j of every receive and send in round j, ``window`` rounds in flight.

    ``recvs``/``sends``: ``(peer, count, place, label)``, where ``place(j, a, c)`` is the
    region of elements ``a:c`` (piece j) of the message.  Round j is waited for, then
    ``after(j)`` runs, then round j + window is posted.  Every rank's round j matches
    its peers' round j, so rounds complete in order (no deadlock, even when a send
    completes only once received).  Empty pieces are not sent: both ends know the size.
    """
    cuts = [[_cut(count, nseg) for _, count, _, _ in side] for side in (recvs, sends)]
    posted: dict = {}

    def post(j):
        hs = []
        for side, cut, issue in ((recvs, cuts[0], b.recv), (sends, cuts[1], b.send)):
            for (peer, _, place, lab), pieces in zip(side, cut):
                a, c = pieces[j]
                if c > a:
                    hs.append(issue(peer, place(j, a, c), lab._replace(segment=j, count=c - a)))
        posted[j] = hs

    for j in range(min(b.window, nseg)):
        post(j)
    for j in range(nseg):
        b.wait(*posted.pop(j))
        if after is not None:
            after(j)
        if j + b.window < nseg:
            post(j + b.window)


def _part(region):
    return lambda j, a, c: region.part(a, c)


def _fold(b, shape, counts, displs, target):
    """Send every block to its owner, receive this rank's from every other rank and fold them
    into ``target`` (this rank's count) in rank order, piece by piece as they arrive; ends
    with every send completed (they read ``SRC``, which may be ``DST``).

    The fold of a piece is ``out = x0 op x1; out = out op x2; ...`` with ``out`` the
    target itself when this rank is 0 (in place, x0 is already there), else the slot
    x0 arrived in, the last step writing the target: so out of place the result is
    written straight into ``DST``, and in place the target (this rank's input) is read
    before it is written.
    """
    n, p = shape.size, shape.rank
    mine, own = counts[p], displs[p]
    nseg = _nseg(b, counts)
    cut = _cut(mine, nseg)
    width = max((c - a for a, c in cut), default=0)
    window = min(b.window, nseg)
    peers = _from(n, p)
    index = {q: i for i, q in enumerate(peers)}
    inbox = b.buffer("received pieces", window * (n - 1) * width) if mine and n > 1 else None

    def slot(j, q, c):  # piece j from q (c elements): window rounds of n-1 slots, reused
        at = ((j % window) * (n - 1) + index[q]) * width
        return Region(inbox, at, at + c)

    recvs = [(q, mine, lambda j, a, c, q=q: slot(j, q, c - a), Label(1, "reduce-scatter", p, 0, mine))
             for q in peers]
    sends = [(q, counts[q], _part(Region(SRC, displs[q], displs[q] + counts[q])),
              Label(1, "reduce-scatter", q, 0, counts[q])) for q in _to(n, p)]

    def fold(j):
        a, c = cut[j]
        if c == a:
            return
        out = target.part(a, c)
        xs = [Region(SRC, own + a, own + c) if r == p else slot(j, r, c - a) for r in range(n)]
        if n == 1:
            b.copy(out, xs[0])
            return
        acc, mid = xs[0], out if p == 0 else xs[0]
        for r in range(1, n):
            to = out if r == n - 1 else mid
            b.reduce(acc, xs[r], to)  # the lower ranks on the left
            acc = to

    _rounds(b, recvs, sends, nseg, fold)


SCHEDULES = {
    ("reduce_scatter", "direct"): reduce_scatter_schedule,
    ("allreduce", "direct"): allreduce_schedule,
}
