"""Hierarchical algorithms: inside each node, across nodes one ring per lane, inside again.

Node layout
    ``shape.nodes`` gives the node label of every rank (``()``: one node).
    Nodes are taken in the order the ring (``shape.ring``) meets them; the
    ranks of a node are its *local* ranks, in rank order.

Lanes
    With ``L`` the fewest ranks any node has, the array (AllGather: the
    gathered array, blocks in rank order) is cut into ``L`` lanes by the
    block-split rule.  Local rank ``i < L`` of every node owns lane ``i``;
    the owners of lane ``i`` on the ``k`` nodes form one ring across nodes,
    so with ``L`` ranks per node ``L`` rings share each node's link, every
    rank's share used (NCCL's "one ring per local rank").  Ranks beyond
    ``L`` on a node (uneven layouts) own no lane and only take part in the
    steps inside the node.

Steps (the same three for every collective)
    0. inside the node: every local rank sends its part of lane ``i`` to
       the lane's owner, which reduces (AllGather: collects) them;
    1 .. ring steps: the lane's ring across nodes, built by the ring
       algorithm (algorithms.ring) on ``k`` ranks and embedded here (peers
       mapped to the lane owners, its buffers to the lane's memory), so it
       is pipelined and cut into segments like every ring;
    last. inside the node: each lane owner sends its finished lane (the
       parts each rank needs) to the other local ranks.

    Bytes on a node's link: AllReduce ``2(k-1)/k * N`` each way (the ring on
    n ranks placed ``k`` nodes of ``n/k``: ``2(n-1)/n * N``, 1.5·N at 2x2
    against 1.0·N here); ReduceScatter and AllGather the other nodes' part
    of the array, once, as the node-ordered ring.  Every message is at most
    one segment (AllGather's ring: its pieces), never a whole step.

Memory and order
    AllReduce reduces lane ``i`` straight into ``DST`` (``window`` receive
    slots per local peer); ReduceScatter and AllGather keep lane ``i`` in a
    work buffer ordered by node and rank (``total/L`` elements), so that each
    node's part of the lane is contiguous for the ring across nodes.  The
    reductions inside a node and the ring's rotation reorder operands: only
    commutative ops (engine.select routes the others to an order-preserving
    algorithm).  Every rank ends with the bits the lane owner computed, so
    results are bitwise equal across ranks.
"""

from __future__ import annotations

import bisect

from . import ring as _ring
from .schedule import DST, SRC, Builder, Label, Recv, Reduce, Region, Schedule, Send, Shape, Wait

INTRA_IN = "gather lanes (node)"
INTRA_OUT = "share lanes (node)"


class _Layout:
    """The node layout of one call: nodes in ring order, local ranks, lanes."""

    def __init__(self, s: Shape):
        labels = tuple(s.nodes) if len(getattr(s, "nodes", ())) == s.size else (0,) * s.size
        order: list = []
        for r in s.ring:
            if labels[r] not in order:
                order.append(labels[r])
        self.members = [sorted(r for r in range(s.size) if labels[r] == lab) for lab in order]
        self.node = order.index(labels[s.rank])       # this rank's node position
        self.local = self.members[self.node]          # its node's ranks, in rank order
        self.index = self.local.index(s.rank)         # its local rank
        self.k = len(order)
        self.lanes = min(len(m) for m in self.members)
        # lane i: elements spans[i] = (start, count) of the array (ring.split's cut); and,
        # once asked for, its parts (_lane_parts) and each rank's of them (_parts_of): a
        # schedule asks for them per peer and per segment, which at hundreds of ranks made
        # building it quadratic
        counts, displs = _ring.split(s.total, self.lanes)
        self.spans = list(zip(displs, counts))
        self.parts: dict = {}
        self.by_rank: dict = {}
        # (logical start, count) of every rank's block: blocks end to end in rank order, so
        # the ranks a lane meets are found by bisection (_lane_parts)
        self.blocks = _logical_blocks(s)
        self.ends = [lo + n for lo, n in self.blocks]

    def owner(self, lane: int, node: int | None = None) -> int:
        return self.members[self.node if node is None else node][lane]

    def ring_shape(self, s: Shape, total, counts, displs, in_place) -> Shape:
        """The Shape of this lane's ring across the ``k`` nodes (positions = node order)."""
        return Shape(self.k, self.node, tuple(range(self.k)), self.node, total, tuple(counts),
                     tuple(displs), s.segment, s.window, in_place, s.commutative,
                     staged=s.staged)


def _cut(lo: int, n: int, seg: int):
    """(start, stop) pieces of at most ``seg`` elements covering ``lo .. lo+n``."""
    return [(a, min(a + seg, lo + n)) for a in range(lo, lo + n, seg)]


def _embed(b: Builder, sub: Schedule, peers, bufs: dict, prefix: str, step0: int) -> None:
    """Append a schedule built for the lane's ring to ``b``.

    ``peers[p]``: the rank at position p; ``bufs``: the sub-schedule's SRC/DST
    -> (buffer, offset) here; its work buffers get ``prefix`` in their name;
    its steps start at ``step0``.
    """
    names = dict(bufs)
    for purpose, n in sub.work.items():
        names[purpose] = (b.buffer(f"{prefix}: {purpose}", n, sub.types.get(purpose)), 0)

    def reg(r: Region) -> Region:
        buf, off = names[r.buf]
        return Region(buf, off + r.start, off + r.stop)

    def lab(label):
        if label is None:
            return None
        return Label(step0 + label.step, f"{label.phase} (across nodes)", label.block,
                     label.segment, label.count)

    index: dict = {}
    for i, op in enumerate(sub.ops):
        kind = type(op)
        if kind is Send:
            index[i] = b.send(peers[op.peer], reg(op.region), lab(op.label))
        elif kind is Recv:
            index[i] = b.recv(peers[op.peer], reg(op.region), lab(op.label))
        elif kind is Wait:
            b.wait(*(index[h] for h in op.handles))
        elif kind is Reduce:
            b.reduce(reg(op.a), reg(op.b), reg(op.out))
        else:
            b.copy(reg(op.dst), reg(op.src))


def _lane_parts(lay: _Layout, i: int):
    """Lane ``i``'s parts ordered by node, then rank: [(rank, logical lo, hi, lane offset)];
    a part is block r's share of the lane (``lay.blocks[r] = (logical start, count)``).
    Found once per layout (the caller must not change the list).

    Blocks lie end to end in rank order, so the ranks whose block meets the lane are
    one range, ``first .. last - 1``: each node's members in it are found by bisection
    (every rank of every node, for every lane, made a schedule quadratic in the ranks).
    """
    got = lay.parts.get(i)
    if got is not None:
        return got
    a, c = lay.spans[i]
    blocks = lay.blocks
    first = bisect.bisect_right(lay.ends, a)  # (the first block ending after a)
    last = bisect.bisect_left(blocks, (a + c,))  # (the first block starting at a + c or later)
    out, at = [], 0
    for node in lay.members:
        for r in node[bisect.bisect_left(node, first):bisect.bisect_left(node, last)]:
            lo, n = blocks[r]
            x, y = max(a, lo), min(a + c, lo + n)
            if y > x:
                out.append((r, x, y, at))
                at += y - x
    lay.parts[i] = out
    return out


def _gather_lanes(b, s, lay, src_of, into, reduce_slots):
    """Step 0: every local rank's part of each lane to the lane's owner.

    ``src_of(lane)``: this rank's [(src region, lane offset)] of that lane;
    ``into(lane, offset, n)``: where the owner accumulates;
    ``reduce_slots``: reduce (AllReduce, ReduceScatter) or place (AllGather).
    Returns the send handles.
    """
    seg, sends = s.message_segment, []
    peers = [q for q in lay.local if q != s.rank]
    for q in peers:  # (peers receive from this rank in this order too)
        i = lay.local.index(q)
        if i < lay.lanes:
            for region, _ in src_of(i):
                for x, y in _cut(region.start, region.count, seg):
                    sends.append(b.send(q, Region(region.buf, x, y), Label(0, INTRA_IN, i, 0, y - x)))
    if lay.index >= lay.lanes:
        return sends
    lane = lay.index
    mine = src_of(lane)
    if not reduce_slots:
        # collect: each peer's parts land straight in the lane buffer (the
        # ring across nodes sends from it: wait for them here)
        recvs = [b.recv(q, into(lane, x, y - x), Label(0, INTRA_IN, lane, 0, y - x))
                 for q in peers for region, off in _parts_of(lay, q, lane)
                 for x, y in _cut(off, region.count, seg)]
        for region, off in mine:
            b.copy(into(lane, off, region.count), region)
        b.wait(*recvs)
        return sends
    # reduce: per segment, one receive slot per peer, ``window`` segments ahead
    units = []
    for region, off in mine:
        units.extend((region.start + x - off, x, y) for x, y in _cut(off, region.count, seg))
    if not peers:
        for region, off in mine:
            b.copy(into(lane, off, region.count), region)
        return sends
    window = max(1, min(s.window, len(units)))
    width = max((y - x for _, x, y in units), default=0)
    if not units:
        return sends
    slots = b.buffer("hierarchical: receive slots", window * len(peers) * width)
    src_buf = mine[0][0].buf

    def slot(u, j, n):
        at = ((u % window) * len(peers) + j) * width
        return Region(slots, at, at + n)

    def post(u):
        _, x, y = units[u]
        return [b.recv(q, slot(u, j, y - x), Label(0, INTRA_IN, lane, u, y - x))
                for j, q in enumerate(peers)]

    pending = [post(u) for u in range(window)]
    for u, (sx, x, y) in enumerate(units):
        b.wait(*pending[u % window])
        acc = into(lane, x, y - x)
        first = Region(src_buf, sx, sx + y - x)
        for j in range(len(peers)):
            b.reduce(first if j == 0 else acc, slot(u, j, y - x), acc)
        if u + window < len(units):
            pending[u % window] = post(u + window)
    return sends


def _parts_of(lay, q, lane):
    """[(region in q's terms, lane offset)] of rank q's block in ``lane`` (AllGather); the
    lane's parts are grouped by rank once per layout (the caller must not change the list)."""
    by = lay.by_rank.get(lane)
    if by is None:
        blocks = lay.blocks
        by = lay.by_rank[lane] = {}
        for r, x, y, off in _lane_parts(lay, lane):
            lo = blocks[r][0]
            by.setdefault(r, []).append((Region(SRC, x - lo, y - lo), off))
    return by.get(q, [])


def _logical_blocks(s):
    """(logical start, count) of every rank's block: blocks in rank order."""
    out, at = [], 0
    for c in s.counts:
        out.append((at, c))
        at += c
    return out


def _lane(s, lay, i):
    """(start, count) of lane ``i`` of ``s``'s array (``lay`` is ``s``'s layout)."""
    return lay.spans[i]


def _trivial(s: Shape, collective: str):
    """One rank: the output from the input (as the ring does)."""
    return {"allreduce": _ring.allreduce_schedule, "reduce_scatter": _ring.reduce_scatter_schedule,
            "allgather": _ring.allgather_schedule}[collective](s)


def allreduce_schedule(s: Shape) -> Schedule:
    """Hierarchical AllReduce: lanes reduced in the node, one ring AllReduce per lane across nodes,
    lanes shared in the node.  Lane ``i`` lives in ``DST`` throughout."""
    if s.size == 1 or s.total == 0:
        return _trivial(s, "allreduce")
    lay = _Layout(s)
    b = Builder()
    nring = 2 * (lay.k - 1)

    def src_of(i):
        a, c = _lane(s, lay, i)
        return [(Region(SRC, a, a + c), 0)] if c else []

    def into(i, off, n):
        a = _lane(s, lay, i)[0]
        return Region(DST, a + off, a + off + n)

    sends = _gather_lanes(b, s, lay, src_of, into, True)
    if lay.index < lay.lanes:
        a, c = _lane(s, lay, lay.index)
        if lay.k > 1 and c:
            sub = _ring.allreduce_schedule(lay.ring_shape(s, c, (c,), (0,), True))
            peers = [lay.owner(lay.index, j) for j in range(lay.k)]
            _embed(b, sub, peers, {SRC: (DST, a), DST: (DST, a)}, "across nodes", 1)
    # the last step writes lanes of DST that step 0 may still be sending (in place)
    b.wait(*sends)
    def lane_of(i, q):
        return [Region(DST, *_span(s, lay, i))]

    _share(b, s, lay, nring + 1, lane_of, lane_of)
    return b.build(nring + 2)


def _span(s, lay, i):
    a, c = _lane(s, lay, i)
    return a, a + c


def _share(b, s, lay, step, have, want):
    """Last step: owner of lane i sends rank q the regions ``want(i, q)`` (in the same order
    as ``have(i)`` lists its own copies of them); every rank receives the lanes it does not own."""
    seg = s.message_segment
    mine = lay.index if lay.index < lay.lanes else None
    recvs = []
    for i in range(lay.lanes):
        owner = lay.owner(i)
        if owner == s.rank:
            continue
        for region in want(i, s.rank):
            for x, y in _cut(region.start, region.count, seg):
                recvs.append(b.recv(owner, Region(region.buf, x, y), Label(step, INTRA_OUT, i, 0, y - x)))
    if mine is not None:
        for q in lay.local:
            if q == s.rank:
                continue
            for region in have(mine, q):
                for x, y in _cut(region.start, region.count, seg):
                    b.send(q, Region(region.buf, x, y), Label(step, INTRA_OUT, mine, 0, y - x))
    b.wait(*recvs)


def reduce_scatter_schedule(s: Shape) -> Schedule:
    """Hierarchical ReduceScatter: lanes reduced in the node (ordered by node), one ring
    ReduceScatter per lane across nodes (each node its part), parts to their ranks."""
    if s.size == 1 or max(s.counts, default=0) == 0:
        return _trivial(s, "reduce_scatter")
    lay = _Layout(s)
    b = Builder()
    # lanes cut the blocks in rank order (logical positions); SRC holds block r at displs[r]
    blocks = lay.blocks
    nring = lay.k - 1
    parts = [_lane_parts(lay, i) for i in range(lay.lanes)]
    size = _lane(s, lay, lay.index)[1] if lay.index < lay.lanes else 0
    lane_buf = b.buffer("hierarchical: lane (by node)", size) if size else None

    def src_of(i):
        return [(Region(SRC, s.displs[r] + x - blocks[r][0], s.displs[r] + y - blocks[r][0]),
                 off) for r, x, y, off in parts[i]]

    def into(i, off, n):
        return Region(lane_buf, off, off + n)

    sends = _gather_lanes(b, s, lay, src_of, into, True)
    out_buf, out_at = None, {}
    if lay.index < lay.lanes and parts[lay.index]:
        lane = lay.index
        # the lane's parts, grouped by node: the ring's blocks
        counts = [0] * lay.k
        for r, x, y, _ in parts[lane]:
            counts[_node_of(lay, r)] += y - x
        displs = [sum(counts[:j]) for j in range(lay.k)]
        mine = counts[lay.node]
        out_buf = b.buffer("hierarchical: node's part of the lane", mine) if mine else None
        at = 0
        for r, x, y, _ in parts[lane]:
            if _node_of(lay, r) == lay.node:
                out_at[r] = out_at.get(r, []) + [(at, y - x)]
                at += y - x
        if lay.k > 1:
            sub = _ring.reduce_scatter_schedule(
                lay.ring_shape(s, sum(counts), counts, displs, False))
            _embed(b, sub, [lay.owner(lane, j) for j in range(lay.k)],
                   {SRC: (lane_buf, 0), DST: (out_buf or lane_buf, 0)}, "across nodes", 1)
        elif mine:
            b.copy(Region(out_buf, 0, mine), Region(lane_buf, displs[lay.node], displs[lay.node] + mine))
    # DST may be the start of SRC (in place), which step 0 may still be sending
    b.wait(*sends)

    def have(i, q):
        return [Region(out_buf, a, a + n) for a, n in out_at.get(q, [])]

    def want(i, q):
        lo = blocks[q][0]
        return [Region(DST, x - lo, y - lo) for r, x, y, _ in parts[i] if r == q]

    _share(b, s, lay, nring + 1, have, want)
    if lay.index < lay.lanes:  # this rank's own part of its lane
        for (a, n), region in zip(out_at.get(s.rank, []), want(lay.index, s.rank)):
            b.copy(region, Region(out_buf, a, a + n))
    return b.build(nring + 2)


def _node_of(lay, r):
    return next(j for j, m in enumerate(lay.members) if r in m)


def allgather_schedule(s: Shape) -> Schedule:
    """Hierarchical AllGather(v): blocks to the lane owners in the node, one ring AllGather per
    lane across nodes (each node its part), lanes to every local rank."""
    if s.size == 1 or s.total == 0:
        return _trivial(s, "allgather")
    lay = _Layout(s)
    b = Builder()
    blocks = lay.blocks
    nring = lay.k - 1
    parts = [_lane_parts(lay, i) for i in range(lay.lanes)]
    size = _lane(s, lay, lay.index)[1] if lay.index < lay.lanes else 0
    lane_buf = b.buffer("hierarchical: lane (by node)", size) if size else None
    lo, cnt = s.displs[s.rank], s.counts[s.rank]
    if not s.in_place and cnt:
        b.copy(Region(DST, lo, lo + cnt), Region(SRC, 0, cnt))

    def src_of(i):
        # in place this rank's block is read where it lies in DST (as the ring does)
        parts = _parts_of(lay, s.rank, i)
        if s.in_place:
            parts = [(Region(DST, lo + r.start, lo + r.stop), off) for r, off in parts]
        return parts

    def into(i, off, n):
        return Region(lane_buf, off, off + n)

    sends = _gather_lanes(b, s, lay, src_of, into, False)
    if lay.index < lay.lanes and size:
        lane = lay.index
        counts = [0] * lay.k
        for r, x, y, _ in parts[lane]:
            counts[_node_of(lay, r)] += y - x
        displs = [sum(counts[:j]) for j in range(lay.k)]
        if lay.k > 1:
            sub = _ring.allgather_schedule(lay.ring_shape(s, size, counts, displs, True))
            _embed(b, sub, [lay.owner(lane, j) for j in range(lay.k)],
                   {SRC: (lane_buf, displs[lay.node]), DST: (lane_buf, 0)}, "across nodes", 1)
    b.wait(*sends)

    def dst_parts(i, q):
        """Lane i's parts rank q lacks, as DST regions, and where the owner holds them."""
        out = []
        for r, x, y, off in parts[i]:
            if r != q:
                d = s.displs[r] + x - blocks[r][0]
                out.append((Region(DST, d, d + y - x), Region(lane_buf, off, off + y - x)))
        return out

    _share(b, s, lay, nring + 1, lambda i, q: [h for _, h in dst_parts(i, q)],
           lambda i, q: [d for d, _ in dst_parts(i, q)])
    if lay.index < lay.lanes:  # the owner's own copy of the other ranks' parts of its lane
        for d, h in dst_parts(lay.index, s.rank):
            b.copy(d, h)
    return b.build(nring + 2)


# What algorithms.shared composes with (these steps across nodes, node memory inside them).
Layout, embed, lane_parts, parts_of, node_of = _Layout, _embed, _lane_parts, _parts_of, _node_of

SCHEDULES = {
    ("allreduce", "hierarchical"): allreduce_schedule,
    ("reduce_scatter", "hierarchical"): reduce_scatter_schedule,
    ("allgather", "hierarchical"): allgather_schedule,
}


# What the algorithm reference (docs/algorithms.md, generated from the registry in
# engine.select) says of each schedule: what it does, its steps, the bytes each rank
# sends (N: the array; AllGather: the gathered array) and its work memory.
ABOUT = {
    ("allreduce", "hierarchical"): {
        "summary": (
            "Two levels: inside each node the lanes are reduced to their owners, one ring per "
            "lane crosses the nodes, then each owner shares its finished lane inside the node. "
            "Each node link carries 2(k-1)/k·N where the ring on n ranks puts 2(n-1)/n·N on it."
        ),
        "steps": "2(k-1) + 2", "sends": "node link: 2(k-1)/k·N each way",
        "memory": "`window`·(ranks on the node - 1) segments",
    },
    ("reduce_scatter", "hierarchical"): {
        "summary": (
            "Lanes reduced to their owners inside the node (ordered by node), one ring per lane "
            "across nodes, then each rank's block from its lane owner."
        ),
        "steps": "k-1 + 2", "sends": "node link: the other nodes' part, once",
        "memory": "N/L (+ the node's part of a lane)",
    },
    ("allgather", "hierarchical"): {
        "summary": (
            "Blocks to the lane owners inside the node, one ring per lane across nodes, then the "
            "finished lanes shared inside the node."
        ),
        "steps": "k-1 + 2", "sends": "node link: the other nodes' part, once",
        "memory": "N/L",
    },
}
