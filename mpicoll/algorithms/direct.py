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
but in n-1 messages to n-1 peers posted at once (one step), rather than n-1
steps to one neighbour.  Sends go to p+1, p+2, ... so that no rank is
everyone's first destination.
"""

from __future__ import annotations

from .ring import split
from .schedule import DST, SRC, Builder, Label, Region


def reduce_scatter_schedule(shape):
    """Direct ReduceScatter in rank order: ``DST`` gets this rank's block (``counts[rank]``).

    In place ``DST`` is the start of ``SRC``; it is written at the end, once
    every send (which reads ``SRC``) completed.
    """
    b = Builder()
    mine = shape.counts[shape.rank]
    _fold(b, shape, shape.counts, shape.displs)
    if mine:
        b.copy(Region(DST, 0, mine), Region("rank-order fold", 0, mine))
    return b.build(1 if shape.size > 1 else 0)


def allreduce_schedule(shape):
    """Direct AllReduce: the rank-order ReduceScatter, then every block sent to every rank.

    ``DST`` (in place: also ``SRC``) is written only after every send of the
    first phase completed.
    """
    n, p = shape.size, shape.rank
    counts, displs = split(shape.total, n)
    counts, displs = tuple(counts), tuple(displs)
    b = Builder()
    mine, own = counts[p], displs[p]
    _fold(b, shape, counts, displs)
    if mine:
        b.copy(Region(DST, own, own + mine), Region("rank-order fold", 0, mine))
    handles = []
    for k in range(1, n):  # the gather: block q arrives from q, this rank's goes to all
        q = (p - k) % n
        if counts[q]:
            handles.append(b.recv(q, Region(DST, displs[q], displs[q] + counts[q]),
                                  Label(2, "allgather", q, 0, counts[q])))
    for k in range(1, n):
        q = (p + k) % n
        if mine:
            handles.append(b.send(q, Region(DST, own, own + mine), Label(2, "allgather", p, 0, mine)))
    b.wait(*handles)
    return b.build(2 if n > 1 else 0)


def _fold(b, shape, counts, displs):
    """The exchange and the rank-order fold of this rank's block into "rank-order fold";
    ends with every send waited for (they read ``SRC``, which may be ``DST``)."""
    n, p = shape.size, shape.rank
    mine, own = counts[p], displs[p]
    acc = b.buffer("rank-order fold", mine) if mine else None
    inbox = b.buffer("received blocks", (n - 1) * mine) if mine and n > 1 else None
    slots, recvs = {}, {}
    for k in range(1, n):  # receives first: every message has its buffer when it comes
        q = (p - k) % n
        if mine:
            slots[q] = Region(inbox, (k - 1) * mine, k * mine)
            recvs[q] = b.recv(q, slots[q], Label(1, "reduce-scatter", p, 0, mine))
    sends = []
    for k in range(1, n):
        q = (p + k) % n
        if counts[q]:
            sends.append(b.send(q, Region(SRC, displs[q], displs[q] + counts[q]),
                                Label(1, "reduce-scatter", q, 0, counts[q])))
    if mine:
        mine_src = Region(SRC, own, own + mine)
        whole = Region(acc, 0, mine)
        for r in range(n):
            if r == p:
                operand = mine_src
            else:
                b.wait(recvs[r])
                operand = slots[r]
            if r == 0:
                b.copy(whole, operand)
            else:
                b.reduce(whole, operand, whole)  # acc = acc op x_r: the lower ranks on the left
    b.wait(*sends)  # in place, DST is (the start of) SRC, which the sends read


SCHEDULES = {
    ("reduce_scatter", "direct"): reduce_scatter_schedule,
    ("allreduce", "direct"): allreduce_schedule,
}
