"""Ring algorithms: ReduceScatter, AllGather, and AllReduce as their composition.

docs/algorithms.md, "How the ring works", tells the same story in the same words.
Put the n ranks on a ring: rank p sends only to rank p+1 and receives only
from rank p-1 (mod n). Cut the array into n blocks (``split``: the first
``N % n`` blocks have ``N // n + 1`` elements, the others ``N // n``; some are
empty when N < n). (Across several nodes mpicoll orders the ring so that it
crosses each node boundary once; p is then a position on the ring rather than
a rank number: ``shape.ring`` lists the ranks in ring order, see
transport.topology, and ``shape.ring_pos`` is p.)

ReduceScatter takes n-1 steps. In step k (k = 1 ... n-1), rank p sends its
partial sum of block (p-k) mod n to rank p+1, and receives the partial sum
of block (p-k-1) mod n from rank p-1, adding its own contribution to it. Each
block travels once around the ring collecting one contribution per hop.
After step n-1 rank p holds block p summed over all ranks.

AllGather also takes n-1 steps: in step k rank p sends block (p-k+1) mod n
(its own in step 1, then the one it has just received) to rank p+1. After n-1
steps every block has gone around the ring and every rank has all of them.

AllReduce is ReduceScatter then AllGather: 2(n-1) steps.

Each builder below is that table, one :class:`~mpicoll.algorithms.schedule.Ring`
call per step, named after what the step does with its block
(``send``, ``recv_reduce_send``, ``recv_reduce``, ``copy_send``,
``recv_copy_send``, ``recv``).  The calls cut blocks into segments, forward
each segment as soon as it is reduced (the steps overlap), post receives
``window`` segments ahead and bound the work memory (the Ring class says
how).  Message labels count steps from 0: step k of the table is label
step k-1, and the AllReduce's AllGather steps follow its ReduceScatter's.

Tuning
    The segment size and the window come with the call's shape: the options
    ``MPICOLL_SEGMENT_BYTES`` (1 MiB) and ``MPICOLL_WINDOW`` (2) of the
    communicator (core.config, read once, when its context is created).  The
    AllGather reduces nothing, so its segments are ``AG_SEGMENT_FACTOR`` times
    longer: fewer messages, and every link is busy at every step anyway.

Only commutative ops may use the ring: the chain for block b starts at
position b+1, so it combines contributions in rotated order.  Non-commutative
ops are routed to the order-preserving recursive doubling algorithm by
engine.select.
"""

from __future__ import annotations

from .schedule import DST, SRC, Block, Builder, Region, Ring, Schedule, split

# The ring AllGather (nothing to reduce) moves pieces of this many segments.
AG_SEGMENT_FACTOR = 16


def _blocks_of(shape, home, mine):
    """Block of each ring position: the block of the rank there, ``home(r)``/``mine(r)`` its regions."""
    return [Block(r, shape.counts[r], mine(r), home(r)) for r in shape.ring]


def reduce_scatter_schedule(shape) -> Schedule:
    """Ring ReduceScatter: ``DST`` (``counts[rank]`` elements) gets this rank's block, reduced.

    ``SRC`` holds the blocks laid out by ``counts``/``displs``; in place ``DST``
    is the start of ``SRC``'s buffer and only ``DST`` is written.
    """
    n, rank, p = shape.size, shape.rank, shape.ring_pos
    counts, displs = shape.counts, shape.displs
    own, size = displs[rank], counts[rank]
    b = Builder()
    if n == 1:
        if not shape.in_place or own != 0:
            b.copy(Region(DST, 0, size), Region(SRC, own, own + size))
        return b.build(0)
    if max(counts) == 0:
        return b.build(0)
    # In place DST is SRC's first elements: the result may go there only when that is
    # this rank's own block (it starts at 0), else it would overwrite input still to send.
    out = DST if not shape.in_place or own == 0 else b.buffer("ring reduce_scatter: in-place result", size)
    ring = Ring(b, shape, _blocks_of(shape, lambda r: Region(out, 0, size) if r == rank else None,
                                     lambda r: Region(SRC, displs[r], displs[r] + counts[r])),
                "reduce-scatter", shape.message_segment)
    ring.send(p - 1)                   # step 1: send my part of block p-1
    for k in range(2, n):              # step k: block p-k arrived in step k-1; add mine, send it
        ring.recv_reduce_send(p - k)
    ring.recv_reduce(p)                # block p arrives in step n-1; with mine it is complete
    nsteps = ring.run()
    if out != DST:
        b.copy(Region(DST, 0, size), Region(out, 0, size))
    return b.build(nsteps)


def allgather_schedule(shape) -> Schedule:
    """Ring AllGather(v): block r of ``DST`` (``counts[r]`` at ``displs[r]``) from rank r.

    ``SRC`` is this rank's block, unless in place (already in ``DST``).
    Nothing is reduced on the way, so small segments only add messages: the
    AllGather's segments are ``AG_SEGMENT_FACTOR`` times longer, unless every
    message is staged through a host copy (``shape.staged``), where the staged
    segment (``shape.message_segment``) is what lets the copies overlap the
    transfers.
    """
    n, rank, p = shape.size, shape.rank, shape.ring_pos
    lo, size = shape.displs[rank], shape.counts[rank]
    b = Builder()
    if n == 1:
        if not shape.in_place and size:
            b.copy(Region(DST, lo, lo + size), Region(SRC, 0, size))
        return b.build(0)

    def home(r):
        return Region(DST, shape.displs[r], shape.displs[r] + shape.counts[r])

    mine = home(rank) if shape.in_place else Region(SRC, 0, size)
    ring = Ring(b, shape, _blocks_of(shape, home, lambda r: mine if r == rank else None),
                "allgather", shape.message_segment if shape.staged else AG_SEGMENT_FACTOR * shape.segment)
    ring.copy_send(p)                  # step 1: send my block (and put it in its place)
    for k in range(2, n):              # step k: block p-k+1 arrived in step k-1; keep it, send it
        ring.recv_copy_send(p - k + 1)
    ring.recv(p + 1)                   # block p+1 arrives in step n-1
    return b.build(ring.run())


def allreduce_schedule(shape) -> Schedule:
    """Ring AllReduce: the ReduceScatter steps, then the AllGather steps, on ``split(N, n)`` blocks.

    Partials live in ``DST`` (blocks by ring position, labelled by position),
    so no send slots are needed.  The step that completes block p also sends
    it: the AllGather's step 0 overlaps the last reductions.
    """
    n, N, p = shape.size, shape.total, shape.ring_pos
    b = Builder()
    if n == 1 or N == 0:
        if not shape.in_place and N:
            b.copy(Region(DST, 0, N), Region(SRC, 0, N))
        return b.build(0)
    counts, displs = split(N, n)
    blocks = [Block(q, c, Region(SRC, d, d + c), Region(DST, d, d + c))
              for q, (c, d) in enumerate(zip(counts, displs))]
    ring = Ring(b, shape, blocks, "reduce-scatter", shape.message_segment)
    ring.send(p - 1)                   # ReduceScatter step 1: send my part of block p-1
    for k in range(2, n):              # step k: block p-k arrived in step k-1; add mine, send it
        ring.recv_reduce_send(p - k)
    ring.phase = "allgather"           # block p, complete with mine, is AllGather step 1's
    ring.recv_reduce_send(p)
    for k in range(2, n):              # AllGather step k: keep block p-k+1, send it
        ring.recv_copy_send(p - k + 1)
    ring.recv(p + 1)                   # block p+1 arrives in AllGather step n-1
    return b.build(ring.run())


# (collective, algorithm) -> schedule builder, as the other algorithm modules list theirs
SCHEDULES = {
    ("allreduce", "ring"): allreduce_schedule,
    ("reduce_scatter", "ring"): reduce_scatter_schedule,
    ("allgather", "ring"): allgather_schedule,
}


# What the algorithm reference (docs/algorithms.md, generated from the registry in
# engine.select) says of each schedule: what it does, its steps, the bytes each rank
# sends (N: the array; AllGather: the gathered array) and its work memory.
ABOUT = {
    ("allreduce", "ring"): {
        "summary": (
            "ReduceScatter then AllGather around a ring (position p sends only to p+1), blocks "
            "cut into segments forwarded as soon as they are reduced. It sends the least any "
            "AllReduce can, at every rank count: the choice for large arrays."
        ),
        "steps": "2(n-1)", "sends": "2(n-1)/n·N",
        "memory": "`window` segments (partials live in the output)",
    },
    ("reduce_scatter", "ring"): {
        "summary": (
            "n-1 steps around the ring, each block collecting one contribution per hop; partials "
            "are passed on from a few send slots, so work memory does not grow with the array."
        ),
        "steps": "n-1", "sends": "(n-1)/n·N",
        "memory": "at most 2·`window` segments",
    },
    ("allgather", "ring"): {
        "summary": (
            "Every block travels once around the ring; its segments are 16 times the segment "
            "option (nothing is reduced on the way, so fewer messages)."
        ),
        "steps": "n-1", "sends": "(n-1)/n·N",
        "memory": "none",
    },
}
