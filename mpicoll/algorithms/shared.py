"""Intra-node algorithms on node memory: each rank's buffer mapped into the ranks of its node.

Every rank of a node owns a buffer of node memory (``Builder.node_buffer``;
mpicoll/transport/shared.py maps it: shared host memory, or CUDA IPC for
device arrays) that the other ranks of its node read with ``Copy`` and
``Reduce``.  MPI carries only synchronisation: a *sync* is a 0-byte message
to and from every other rank of the node, then a wait for all of them, so no
rank passes it before every rank of the node reached it.  What a rank wrote
before a sync, the others may read after it.

Slots and chunks
    Each rank's buffer holds two *slots* of ``shape.shared`` elements.  An
    array is cut into *chunks* that fit a slot, and chunk ``c`` (counted over
    the whole schedule) uses slot ``c % 2``.  A rank writes a slot again two
    chunks later, after it passed the sync of the chunk between: every rank
    reached that sync after it finished reading the slot, so each chunk
    needs one sync before its readers start, and none after.  A last sync
    (``node: done``) ends every schedule that used node memory: once a rank
    passes it, no other rank still reads its buffer, so the next call may
    write it.

Reductions (the ``reduce`` phase)
    Block ``j`` of the array is reduced at local rank ``j``: every rank
    copies its contribution to the other ranks' blocks into its slot
    (block ``j`` at ``j * w``, ``w`` elements of each block per chunk), syncs,
    and each owner folds its block from every rank's slot in local-rank order,
    from the left: ``((x0 op x1) op x2) op ...``, reading its own contribution
    where it lies.  One way to group the operands, the same on every rank, so
    the results are bitwise identical across ranks and a non-commutative op
    keeps its order inside a node.

Sharing (the ``share`` phase)
    Each owner copies its finished block into its slot, syncs, and every rank
    copies the blocks it needs from the owners' slots.

Algorithms (one node)
    ``shared_oneshot`` (AllReduce, small arrays): every rank copies its whole
    chunk into its slot, syncs, and folds every rank's chunk into ``DST``: one
    sync per chunk, every rank reading all inputs.  ``shared_twoshot``
    (AllReduce, large arrays): ``reduce`` then ``share`` over the array's
    blocks (``numpy.array_split`` rule): each rank reads ``(m-1)/m`` of the
    array twice and folds ``1/m``, about ``(1 + 1/m)`` syncs per slot of the
    array.  ``shared`` ReduceScatter: ``reduce`` over the output blocks, straight
    into ``DST``.  ``shared`` AllGather: ``share`` of every rank's block.

The call's own buffers (``Shape.mapped``: device arrays, one node)
    Where the ranks of a node map each other's ``SRC`` and ``DST`` (CUDA IPC
    registration, transport.shared), no slots and no chunks: each rank makes
    its input readable where the others read it (a copy into its own buffer
    for that, or nothing where that is its own array), syncs, does its part
    in one pass, and syncs again (``node: done``: no peer reads its input or
    writes its output after that), whatever the size.  AllReduce one shot:
    every rank folds (``Fold``) every rank's whole input into its ``DST``
    (in place: into a work buffer, copied into ``DST`` after the last sync,
    as the peers read ``SRC`` until then).  AllReduce two shot: local rank
    ``j`` folds block ``j`` of every rank's input and writes it into every
    rank's output; each rank then copies its output into ``DST`` (nothing
    where it is ``DST``).  ReduceScatter: each rank folds its block of every
    rank's input into ``DST`` (in place, unless its block is the start of
    ``SRC``, through a work buffer as above).  AllGather: each rank copies
    every peer's block from where it lies in that peer's output.  Every
    operand is read once and every result written once: the fewest bytes a
    kernel can move.  The folds keep the order above, so results are bitwise
    identical across ranks and a non-commutative op keeps its order.

Across nodes
    On a communicator that spans nodes the same phases replace the steps
    inside each node of the hierarchical algorithms (algorithms.hierarchical):
    ``reduce`` of the lanes (AllGather: a ``collect``, the lane's parts copied
    to its owner), the lane's ring across nodes (messages, as there), ``share``
    of the lanes.  ``shared_oneshot`` runs as ``shared_twoshot`` there.  The
    ring reorders operands: across nodes only commutative ops (engine.select).

Only the ranks of one node touch each other's node memory; a rank alone on
its node uses none.
"""

from __future__ import annotations

from . import hierarchical as _hier
from . import ring as _ring
from .schedule import (
    DST,
    INPUT,
    OUTPUT,
    SRC,
    Builder,
    Label,
    Region,
    Schedule,
    Shape,
    own_block,
    packed,
    split,
)

READY = "node: inputs ready"
SHARED = "node: results ready"
DONE = "node: done"

ONESHOT = "shared_oneshot"
TWOSHOT = "shared_twoshot"
NAME = "shared"  # ReduceScatter's and AllGather's


class _Node:
    """This rank's node in one schedule: its ranks, their node memory, the chunk count."""

    def __init__(self, b: Builder, s: Shape):
        labels = tuple(s.nodes) if len(s.nodes) == s.size else (0,) * s.size
        self.b = b
        self.rank = s.rank
        self.local = [r for r in range(s.size) if labels[r] == labels[s.rank]]
        self.index = self.local.index(s.rank)
        self.peers = [q for q in self.local if q != s.rank]
        # elements per slot: the engine's (transport.shared), else one of the shape's own
        # (a model or simulator building the schedule without node memory behind it)
        self.slot = s.shared if s.shared > 0 else max(s.segment, len(self.local))
        if self.slot < len(self.local):
            raise ValueError(f"shape.shared: a slot of {self.slot} elements is smaller than "
                             f"the {len(self.local)} ranks of this node")
        self.chunks = 0  # chunks so far: chunk c uses slot c % 2
        self.step = 0    # the label step of the next sync
        self._names: dict = {}

    def mem(self, q: int, start: int, stop: int) -> Region:
        """Elements ``start:stop`` of rank ``q``'s slot of the current chunk."""
        name = self._names.get(q)
        if name is None:
            name = self._names[q] = self.b.node_buffer(q, 2 * self.slot)
        base = (self.chunks % 2) * self.slot
        return Region(name, base + start, base + stop)

    def sync(self, phase: str) -> None:
        """No rank of the node goes on before every rank reached this point."""
        b, label = self.b, Label(self.step, phase, None, self.chunks, 0)
        none = Region(DST, 0, 0)
        handles = [b.recv(q, none, label) for q in self.peers]
        handles += [b.send(q, none, label) for q in self.peers]
        b.wait(*handles)
        self.step += 1

    def finish(self) -> None:
        """The last sync: no peer reads this rank's node memory after it (see the module
        docstring); only where some chunk used node memory."""
        if self.chunks:
            self.sync(DONE)


def _window(pieces, lo: int, hi: int):
    """``pieces`` [(region, offset)] clipped to offsets ``lo:hi``: [(region part, offset)]."""
    out = []
    for region, off in pieces:
        a, z = max(lo, off), min(hi, off + region.count)
        if z > a:
            out.append((region.part(a - off, z - off), a))
    return out


def _fold(b: Builder, xs: list, out: Region) -> None:
    """``out = ((xs[0] op xs[1]) op xs[2]) op ...``; ``out`` may be xs[0] or xs[1] but no
    later operand."""
    if len(xs) == 1:
        b.copy(out, xs[0])
        return
    b.reduce(xs[0], xs[1], out)
    for x in xs[2:]:
        b.reduce(out, x, out)


def _chunks(n: int, w: int) -> int:
    return -(-n // w) if n > 0 else 0


def reduce_phase(node: _Node, lens: list, contrib, into, alias: bool = False) -> None:
    """Block ``j`` (``lens[j]`` elements) reduced at local rank ``j`` into ``into(off, n)``.

    ``contrib(j)``: this rank's contribution to block ``j``, [(region, offset)]
    covering ``0:lens[j]`` (the same pieces as every rank's, cut at the same
    offsets).  ``alias``: ``into`` is the memory of this rank's own contribution
    (in place), which the fold must read before it writes there.
    """
    b, i, nb = node.b, node.index, len(lens)
    if not node.peers:
        if i < nb:
            for region, off in contrib(i):
                b.copy(into(off, region.count), region)
        return
    w = node.slot // nb
    mine = [contrib(j) for j in range(nb)]
    for c in range(_chunks(max(lens, default=0), w)):
        lo, hi = c * w, (c + 1) * w
        for j in range(nb):
            if j != i:
                for region, off in _window(mine[j], lo, hi):
                    at = j * w + off - lo
                    b.copy(node.mem(node.rank, at, at + region.count), region)
        node.sync(READY)
        if i < nb:
            for region, off in _window(mine[i], lo, hi):
                at, n = i * w + off - lo, region.count
                xs = [region if q == node.rank else node.mem(q, at, at + n) for q in node.local]
                out = into(off, n)
                if alias and i >= 2:
                    # the fold writes before it reads this rank's operand: fold in this
                    # rank's own block of its slot (no copy goes there), then copy out
                    acc = node.mem(node.rank, at, at + n)
                    _fold(b, xs, acc)
                    b.copy(out, acc)
                else:
                    _fold(b, xs, out)
        node.chunks += 1


def share_phase(node: _Node, lens: list, have, want) -> None:
    """Every rank copies from local rank ``j``'s block (``lens[j]`` elements) what it wants.

    ``have``: this rank's block, [(region, offset)] covering ``0:lens[index]``
    (if it owns one); ``want(j)``: [(region, offset)] this rank copies from
    block ``j`` (``j`` not its own).
    """
    b, i, nb = node.b, node.index, len(lens)
    if not node.peers:
        return
    w = node.slot
    wants = [want(j) if j != i else [] for j in range(nb)]
    for c in range(_chunks(max(lens, default=0), w)):
        lo, hi = c * w, (c + 1) * w
        if i < nb:
            for region, off in _window(have, lo, hi):
                b.copy(node.mem(node.rank, off - lo, off - lo + region.count), region)
        node.sync(SHARED)
        for j in range(nb):
            for region, off in _window(wants[j], lo, hi):
                b.copy(region, node.mem(node.local[j], off - lo, off - lo + region.count))
        node.chunks += 1


def collect_phase(node: _Node, lens: list, contrib, parts_of, into) -> None:
    """Local rank ``j`` collects block ``j`` (``lens[j]`` elements) from the parts every rank
    holds: ``contrib(j)``, this rank's parts [(region, offset)]; ``parts_of(q, j)``, rank
    ``q``'s parts [(region, offset)] (only the offsets are read); ``into(off, n)``: where
    the owner puts them."""
    b, i, nb = node.b, node.index, len(lens)
    mine = [contrib(j) for j in range(nb)]
    if i < nb:
        for region, off in mine[i]:
            b.copy(into(off, region.count), region)
    if not node.peers:
        return
    w = node.slot // nb
    theirs = {q: parts_of(q, i) for q in node.peers} if i < nb else {}
    for c in range(_chunks(max(lens, default=0), w)):
        lo, hi = c * w, (c + 1) * w
        for j in range(nb):
            if j != i:
                for region, off in _window(mine[j], lo, hi):
                    at = j * w + off - lo
                    b.copy(node.mem(node.rank, at, at + region.count), region)
        node.sync(READY)
        for q, pieces in theirs.items():
            for region, off in _window(pieces, lo, hi):
                at = i * w + off - lo
                b.copy(into(off, region.count), node.mem(q, at, at + region.count))
        node.chunks += 1


def _spans_nodes(s: Shape) -> bool:
    return len(s.nodes) == s.size and len(set(s.nodes)) > 1


def _trivial(s: Shape, collective: str):
    return {"allreduce": _ring.allreduce_schedule, "reduce_scatter": _ring.reduce_scatter_schedule,
            "allgather": _ring.allgather_schedule}[collective](s)


# --- one node --------------------------------------------------------------------------

def _allreduce_mapped(s: Shape, oneshot: bool) -> Schedule:
    """AllReduce on the ranks' own buffers (the module docstring): one fold, two syncs."""
    b = Builder()
    node = _Node(b, s)
    n, me = s.total, s.rank
    ins = {q: b.peer_buffer(q, INPUT, n) for q in node.local}
    b.copy(Region(ins[me], 0, n), Region(SRC, 0, n))

    def xs(lo, hi):
        return [Region(SRC if q == me else ins[q], lo, hi) for q in node.local]

    node.sync(READY)
    if oneshot:
        into = Region(b.buffer("shared: rank-order fold", n), 0, n) if s.in_place \
            else Region(DST, 0, n)
        b.fold(xs(0, n), [into])
        node.sync(DONE)
        b.copy(Region(DST, 0, n), into)
    else:
        outs = {q: b.peer_buffer(q, OUTPUT, n) for q in node.local}
        counts, displs = split(n, len(node.local))
        lo, hi = displs[node.index], displs[node.index] + counts[node.index]
        if hi > lo:
            b.fold(xs(lo, hi), [Region(outs[q], lo, hi) for q in node.local])
        node.sync(DONE)
        b.copy(Region(DST, 0, n), Region(outs[me], 0, n))
    return b.build(node.step)


def allreduce_oneshot(s: Shape) -> Schedule:
    """One-shot AllReduce: each rank publishes its chunk, then folds every rank's chunk."""
    if _spans_nodes(s):
        return allreduce_twoshot(s)
    if s.size == 1 or s.total == 0:
        return _trivial(s, "allreduce")
    if s.mapped:
        return _allreduce_mapped(s, oneshot=True)
    b = Builder()
    node = _Node(b, s)
    w = node.slot
    for c in range(_chunks(s.total, w)):
        a, n = c * w, min(w, s.total - c * w)
        b.copy(node.mem(s.rank, 0, n), Region(SRC, a, a + n))
        node.sync(READY)
        _fold(b, [node.mem(q, 0, n) for q in node.local], Region(DST, a, a + n))
        node.chunks += 1
    node.finish()
    return b.build(node.step)


def allreduce_twoshot(s: Shape) -> Schedule:
    """Two-shot AllReduce: block ``j`` reduced at local rank ``j``, then shared."""
    if s.size == 1 or s.total == 0:
        return _trivial(s, "allreduce")
    if _spans_nodes(s):
        return _allreduce_nodes(s)
    if s.mapped:
        return _allreduce_mapped(s, oneshot=False)
    b = Builder()
    node = _Node(b, s)
    counts, displs = split(s.total, len(node.local))
    i = node.index

    def block(j):
        return Region(DST, displs[j], displs[j] + counts[j])

    reduce_phase(node, counts, lambda j: [(Region(SRC, displs[j], displs[j] + counts[j]), 0)],
                 lambda off, n: block(i).part(off, off + n), alias=s.in_place)
    share_phase(node, counts, [(block(i), 0)], lambda j: [(block(j), 0)])
    node.finish()
    return b.build(node.step)


def _reduce_scatter_mapped(s: Shape) -> Schedule:
    """ReduceScatter on the ranks' own buffers: one fold of this rank's block of every
    rank's input into ``DST`` (in place through a work buffer, as :func:`reduce_scatter`),
    two syncs."""
    b = Builder()
    node = _Node(b, s)
    me, counts, displs = s.rank, s.counts, s.displs
    extent = max(d + c for c, d in zip(counts, displs))
    ins = {q: b.peer_buffer(q, INPUT, extent) for q in node.local}
    b.copy(Region(ins[me], 0, extent), Region(SRC, 0, extent))
    node.sync(READY)
    lo, mine = displs[me], counts[me]
    own_first = lo == 0 and packed(counts, displs)
    into = Region(b.buffer("shared: rank-order fold", mine), 0, mine) \
        if s.in_place and mine and not own_first else Region(DST, 0, mine)
    if mine:
        b.fold([Region(SRC if q == me else ins[q], lo, lo + mine) for q in node.local],
               [into])
    node.sync(DONE)
    b.copy(Region(DST, 0, mine), into)
    return b.build(node.step)


def reduce_scatter(s: Shape) -> Schedule:
    """ReduceScatter: each rank folds its block from every rank's input, into ``DST``.

    In place ``DST`` is the start of ``SRC``, which later chunks still copy
    from: the fold goes to a work buffer copied into ``DST`` at the end --
    unless this rank's block is that start (then no copy reads it).
    """
    if s.size == 1 or max(s.counts, default=0) == 0:
        return _trivial(s, "reduce_scatter")
    if _spans_nodes(s):
        return _reduce_scatter_nodes(s)
    if s.mapped:
        return _reduce_scatter_mapped(s)
    b = Builder()
    node = _Node(b, s)
    counts, displs, mine = s.counts, s.displs, s.counts[s.rank]
    own_first = displs[s.rank] == 0 and packed(counts, displs)
    acc = None
    if s.in_place and mine and not own_first:
        acc = b.buffer("shared: rank-order fold", mine)
    target = DST if acc is None else acc
    reduce_phase(node, list(counts),
                 lambda j: [(Region(SRC, displs[j], displs[j] + counts[j]), 0)],
                 lambda off, n: Region(target, off, off + n), alias=s.in_place and acc is None)
    if acc is not None:
        b.copy(Region(DST, 0, mine), Region(acc, 0, mine))
    node.finish()
    return b.build(node.step)


def _allgather_mapped(s: Shape) -> Schedule:
    """AllGather(v) on the ranks' own buffers: every rank copies each peer's block from
    where it lies in that peer's output (its own block there first), two syncs.  (In
    place the binding gives ``SRC`` all of ``DST``: only :func:`own_block` reads it.)"""
    b = Builder()
    node = _Node(b, s)
    me, counts, displs = s.rank, s.counts, s.displs
    extent = max(d + c for c, d in zip(counts, displs))
    outs = {q: b.peer_buffer(q, OUTPUT, extent) for q in node.local}
    own = own_block(b, s)
    b.copy(Region(outs[me], own.start, own.stop), own)
    node.sync(READY)
    for q in node.local:
        a, z = displs[q], displs[q] + counts[q]
        if q != me and z > a:
            b.copy(Region(DST, a, z), Region(outs[q], a, z))
    node.sync(DONE)
    return b.build(node.step)


def allgather(s: Shape) -> Schedule:
    """AllGather(v): each rank publishes its block; every rank copies the others'."""
    if s.size == 1 or s.total == 0:
        return _trivial(s, "allgather")
    if _spans_nodes(s):
        return _allgather_nodes(s)
    if s.mapped:
        return _allgather_mapped(s)
    b = Builder()
    node = _Node(b, s)
    own = own_block(b, s)
    share_phase(node, list(s.counts), [(own, 0)],
                lambda j: [(Region(DST, s.displs[j], s.displs[j] + s.counts[j]), 0)])
    node.finish()
    return b.build(node.step)


# --- across nodes: the hierarchical algorithms, node memory inside each node ------------

def _ring_across(b, node, s, lay, sub, bufs) -> None:
    """Embed the lane's ring ``sub`` across nodes (algorithms.hierarchical), after the syncs
    so far; its steps follow theirs."""
    peers = [lay.owner(lay.index, j) for j in range(lay.k)]
    _hier.embed(b, sub, peers, bufs, "across nodes", node.step)
    node.step += sub.nsteps + 1


def _allreduce_nodes(s: Shape) -> Schedule:
    """Lanes reduced in the node, one ring AllReduce per lane across nodes, lanes shared."""
    lay = _hier.Layout(s)
    b = Builder()
    node = _Node(b, s)
    lens = [c for _, c in lay.spans]

    def lane(j):
        a, c = lay.spans[j]
        return Region(DST, a, a + c)

    reduce_phase(node, lens, lambda j: [(Region(SRC, lay.spans[j][0], sum(lay.spans[j])), 0)]
                 if lens[j] else [], lambda off, n: lane(node.index).part(off, off + n),
                 alias=s.in_place)
    if node.index < lay.lanes and lay.k > 1 and lens[node.index]:
        c = lens[node.index]
        sub = _ring.allreduce_schedule(lay.ring_shape(s, c, (c,), (0,), True))
        a = lay.spans[node.index][0]
        _ring_across(b, node, s, lay, sub, {SRC: (DST, a), DST: (DST, a)})
    share_phase(node, lens, [(lane(node.index), 0)] if node.index < lay.lanes else [],
                lambda j: [(lane(j), 0)] if lens[j] else [])
    node.finish()
    return b.build(node.step)


def _node_parts(lay, lane: int) -> list:
    """[(rank, logical lo, hi, offset)] of the parts of ``lane`` on this rank's node, offsets
    counted in that order (the node's part of the lane, as the ring across nodes leaves it)."""
    out, at = [], 0
    for r, x, y, _ in _hier.lane_parts(lay, lane):
        if r in lay.local:
            out.append((r, x, y, at))
            at += y - x
    return out


def _reduce_scatter_nodes(s: Shape) -> Schedule:
    """Lanes reduced in the node (ordered by node), one ring ReduceScatter per lane across
    nodes (each node its part), parts copied to their ranks."""
    lay = _hier.Layout(s)
    b = Builder()
    node = _Node(b, s)
    blocks = lay.blocks
    parts = [_hier.lane_parts(lay, j) for j in range(lay.lanes)]
    lens = [c for _, c in lay.spans]
    owner = node.index < lay.lanes
    lane_buf = b.buffer("shared: lane (by node)", lens[node.index]) \
        if owner and lens[node.index] else None

    def src_of(j):
        return [(Region(SRC, s.displs[r] + x - blocks[r][0], s.displs[r] + y - blocks[r][0]), off)
                for r, x, y, off in parts[j]]

    reduce_phase(node, lens, src_of, lambda off, n: Region(lane_buf, off, off + n))
    here = [_node_parts(lay, j) for j in range(lay.lanes)]
    node_lens = [sum(y - x for _, x, y, _ in h) for h in here]
    out_buf = None
    if owner and parts[node.index]:
        counts = [0] * lay.k
        for r, x, y, _ in parts[node.index]:
            counts[_hier.node_of(lay, r)] += y - x
        displs = [sum(counts[:j]) for j in range(lay.k)]
        mine = counts[lay.node]
        out_buf = b.buffer("shared: node's part of the lane", mine) if mine else None
        sub = _ring.reduce_scatter_schedule(lay.ring_shape(s, sum(counts), counts, displs, False))
        _ring_across(b, node, s, lay, sub, {SRC: (lane_buf, 0), DST: (out_buf or lane_buf, 0)})

    def want(j):
        lo = blocks[s.rank][0]
        return [(Region(DST, x - lo, y - lo), at) for r, x, y, at in here[j] if r == s.rank]

    have = [(Region(out_buf, 0, node_lens[node.index]), 0)] if out_buf is not None else []
    share_phase(node, node_lens, have, want)
    if owner and out_buf is not None:  # this rank's own parts of its lane
        for region, at in want(node.index):
            b.copy(region, Region(out_buf, at, at + region.count))
    node.finish()
    return b.build(node.step)


def _allgather_nodes(s: Shape) -> Schedule:
    """Lanes collected in the node, one ring AllGather per lane across nodes, lanes shared."""
    lay = _hier.Layout(s)
    b = Builder()
    node = _Node(b, s)
    blocks = lay.blocks
    parts = [_hier.lane_parts(lay, j) for j in range(lay.lanes)]
    lens = [c for _, c in lay.spans]
    owner = node.index < lay.lanes
    lane_buf = b.buffer("shared: lane (by node)", lens[node.index]) \
        if owner and lens[node.index] else None
    lo, cnt = s.displs[s.rank], s.counts[s.rank]
    if not s.in_place and cnt:
        b.copy(Region(DST, lo, lo + cnt), Region(SRC, 0, cnt))

    def parts_of(q, j):
        pieces = _hier.parts_of(lay, q, j)
        if q == s.rank and s.in_place:  # this rank's block, where it lies in DST
            return [(Region(DST, lo + r.start, lo + r.stop), off) for r, off in pieces]
        return pieces

    collect_phase(node, lens, lambda j: parts_of(s.rank, j), parts_of,
                  lambda off, n: Region(lane_buf, off, off + n))
    if owner and lane_buf is not None and lay.k > 1:
        counts = [0] * lay.k
        for r, x, y, _ in parts[node.index]:
            counts[_hier.node_of(lay, r)] += y - x
        displs = [sum(counts[:j]) for j in range(lay.k)]
        sub = _ring.allgather_schedule(lay.ring_shape(s, lens[node.index], counts, displs, True))
        _ring_across(b, node, s, lay, sub,
                     {SRC: (lane_buf, displs[lay.node]), DST: (lane_buf, 0)})

    def missing(j):
        """Lane j's parts this rank lacks: [(DST region, lane offset)]."""
        out = []
        for r, x, y, off in parts[j]:
            if r != s.rank:
                d = s.displs[r] + x - blocks[r][0]
                out.append((Region(DST, d, d + y - x), off))
        return out

    have = [(Region(lane_buf, 0, lens[node.index]), 0)] if lane_buf is not None else []
    share_phase(node, lens, have, missing)
    if owner and lane_buf is not None:  # the owner's own copy of the others' parts
        for region, off in missing(node.index):
            b.copy(region, Region(lane_buf, off, off + region.count))
    node.finish()
    return b.build(node.step)


SCHEDULES = {
    ("allreduce", ONESHOT): allreduce_oneshot,
    ("allreduce", TWOSHOT): allreduce_twoshot,
    ("reduce_scatter", NAME): reduce_scatter,
    ("allgather", NAME): allgather,
}

# What each algorithm does (docs/algorithms.md is generated from these rows).
ABOUT = {
    ("allreduce", ONESHOT): {
        "summary": (
            "Inside a node, through node memory (each rank's buffer mapped into the others'): "
            "every rank copies its chunk in, one synchronisation, and folds every rank's "
            "chunk into its result in rank order. MPI carries only 0-byte messages: for "
            "small arrays. Device arrays on one node: every rank's input read where it lies, "
            "one fold kernel, two synchronisations. Across nodes: the hierarchical algorithm "
            "with node memory inside."
        ),
        "steps": "1 sync per chunk", "sends": "0 inside a node",
        "memory": "node memory: 2 slots per rank",
    },
    ("allreduce", TWOSHOT): {
        "summary": (
            "Inside a node, through node memory: each rank reduces its own block from every "
            "rank's buffer, one synchronisation, then copies every reduced block: the least "
            "memory traffic, for large arrays. Device arrays on one node: each rank folds its "
            "block of every rank's input where it lies into every rank's output, one kernel, "
            "two synchronisations. Across nodes: the hierarchical algorithm with node memory "
            "inside."
        ),
        "steps": "2 syncs per chunk", "sends": "0 inside a node",
        "memory": "node memory: 2 slots per rank",
    },
    ("reduce_scatter", NAME): {
        "summary": (
            "Inside a node, through node memory: each rank reduces its own block from every "
            "rank's buffer in rank order. Across nodes: the hierarchical algorithm with node "
            "memory inside."
        ),
        "steps": "1 sync per chunk", "sends": "0 inside a node",
        "memory": "node memory: 2 slots per rank",
    },
    ("allgather", NAME): {
        "summary": (
            "Inside a node, through node memory: each rank publishes its block, one "
            "synchronisation, and copies the others'. Across nodes: the hierarchical "
            "algorithm with node memory inside."
        ),
        "steps": "1 sync per chunk", "sends": "0 inside a node",
        "memory": "node memory: 2 slots per rank",
    },
}
