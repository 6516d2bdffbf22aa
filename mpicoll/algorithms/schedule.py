"""A schedule: one rank's part of one algorithm, as a list of operations.

An algorithm is a function ``build(shape) -> Schedule``.  It describes, for
the rank and call signature in ``shape`` (a :class:`Shape`), which ranges of
which buffers go to whom and what happens to what arrives -- and nothing
else: no MPI calls, no arrays, no waiting.  The executor
(mpicoll/engine/executor.py) runs any schedule on real arrays; the step
labels seen by timeouts and traces, the traffic formulas, the ring diagram
and the rendezvous simulator in the tests read the same schedules.

Buffers are named, never numbered:

``SRC``
    the call's input (for AllGather: this rank's block);
``DST``
    the call's output; in place (``shape.in_place``) the executor binds
    ``SRC`` and ``DST`` to the same memory as the collective defines it
    (AllReduce: the same array; ReduceScatter: ``DST`` is the start of
    ``SRC``; AllGather: ``SRC`` is this rank's block of ``DST``);
work buffers
    declared with :meth:`Builder.buffer` by *purpose*; each gets its own
    region of the context's work arena (see mpicoll/engine/context.py), so two
    buffers of a schedule never alias.  A buffer holds elements of the call's
    type unless declared of another (``Schedule.types``): a schedule that
    folds in a wider type (``shape.accumulate``) keeps its accumulator so.

Operations, in issue order (``Schedule.ops``):

``Send(peer, region, label, chunk)`` / ``Recv(peer, region, label, chunk)``
    post a non-blocking send / receive of ``region``; messages between two
    ranks match in issue order (one tag, MPI's non-overtaking rule), so a
    schedule must issue its sends to a peer in the order the peer issues its
    receives from it.  ``chunk`` (0 but in a pipeline, algorithms.pipeline):
    messages of different chunks never match each other (each chunk's are on
    a tag of their own), so only the order within a chunk matters.
``Wait(handles)``
    block until the listed earlier ``Send``/``Recv`` ops (their indices in
    ``ops``) completed.  A region a posted ``Recv`` writes or a posted
    ``Send`` reads must not be touched before a ``Wait`` covering it.
``Reduce(a, b, out)``
    ``out = a op b`` elementwise (``a`` is the left operand: the order
    matters for non-commutative ops); ``out`` may be ``a`` or ``b``.  The
    operands may be of two types (an accumulator and what arrived): the
    op is computed in the type of ``out``.
``Copy(dst, src)``
    ``dst = src``, converted to the type of ``dst`` (widening to an
    accumulator, or the one rounding back to the call's type).
``Fold(xs, outs)``
    every region of ``outs`` = ``((xs[0] op xs[1]) op xs[2]) op ...``
    elementwise, all of one length: one pass that reads every operand of an
    element before it writes that element anywhere, so an output may be an
    operand (not partly).  The node algorithms on the call's own buffers
    fold every rank's input in one pass (algorithms.shared).

Every op a schedule issues has completed or been waited for when it ends:
the builder adds a final ``Wait`` for anything left outstanding.
"""

from __future__ import annotations

from typing import NamedTuple

SRC = "src"
DST = "dst"


class Label(NamedTuple):
    """Where a message sits in its algorithm (timeouts, traces, diagrams)."""

    step: int
    phase: str         # "reduce-scatter", "allgather", "fold", "exchange", "unfold", ...
    block: int | None  # rank whose block (ReduceScatter, AllGather), chunk (AllReduce)
    segment: int
    count: int         # elements in the message


class Region(NamedTuple):
    """Elements ``start:stop`` of the buffer named ``buf``."""

    buf: str
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    def part(self, start: int, stop: int) -> Region:
        """Elements ``start:stop`` of this region (offsets from its start)."""
        return Region(self.buf, self.start + start, self.start + stop)


class Send(NamedTuple):
    peer: int
    region: Region
    label: Label | None = None
    chunk: int = 0  # messages of chunk k match only chunk k's (a tag of their own: pipelines)


class Recv(NamedTuple):
    peer: int
    region: Region
    label: Label | None = None
    chunk: int = 0


class Wait(NamedTuple):
    handles: tuple  # indices in Schedule.ops of Send/Recv ops


class Reduce(NamedTuple):
    a: Region
    b: Region
    out: Region


class Copy(NamedTuple):
    dst: Region
    src: Region


class Fold(NamedTuple):
    xs: tuple    # Regions, left to right
    outs: tuple  # Regions, each written with the result


# A staged message (Shape.staged: device arrays through pinned host memory) costs a copy
# each way, its events and an MPI message whatever its length, so it is this many segments
# long: 4 MiB at the default 1 MiB segment (docs/gpu.md, "Host staging"; the GPU device
# check measures the staged path beside the direct one).
STAGED_SEGMENT_FACTOR = 4

# The segment of device arrays handed straight to a CUDA-aware MPI (the direct path), unless
# MPICOLL_SEGMENT_BYTES is set: each of its messages costs a stream synchronisation and MPI's
# per-message work, and each segment a kernel, while nothing on the host is there to overlap,
# so blocks up to this size travel whole (64 MiB at 4 ranks: 6 messages a rank, not 96 in
# 1 MiB segments).  The GPU device check times it beside the 1 MiB segment (docs/gpu.md,
# "Direct path (CUDA-aware MPI)").
DIRECT_SEGMENT_BYTES = 16 << 20


class Shape(NamedTuple):
    """What a schedule depends on: the communicator, the call's counts, the tuning.

    ``counts``/``displs`` are per rank (ReduceScatter and AllGather blocks;
    AllReduce: ``(total,)`` and ``(0,)``).  ``ring`` lists ranks in ring
    order and ``ring_pos`` is this rank's position in it.  ``nodes`` is the
    node label of every rank (transport.topology; ``()``: not known, taken as
    one node): only the hierarchical algorithms read it.  ``accumulate``: see
    :data:`Schedule.types`; only a schedule whose messages carry the call's
    type and whose reductions happen at one place can honour it (direct).
    ``staged``: every message goes through a pinned host copy (device arrays
    on the staging path, transport.staging), which stages a message whole: so
    every message is :attr:`message_segment` long at most
    (:data:`STAGED_SEGMENT_FACTOR` segments), to any peer (the ring
    AllGather's and the pieces inside a node included), and each copy
    overlaps the transfers of the others and takes a pinned buffer of that
    size.
    """

    size: int
    rank: int
    ring: tuple
    ring_pos: int
    total: int
    counts: tuple
    displs: tuple
    segment: int        # elements per pipelined segment
    window: int         # receives posted ahead
    in_place: bool
    commutative: bool = True
    nodes: tuple = ()
    # the type partial results are folded in where it is wider than the call's (a NumPy
    # dtype; None: the call's own), for the schedules that fold at the owner (direct)
    accumulate: object = None
    staged: bool = False  # every message through a host copy: none longer than message_segment
    # elements of one slot of node memory (algorithms.shared: each rank's buffer holds two);
    # 0: not set by the engine (a builder then takes a slot of its own choosing)
    shared: int = 0
    # the ranks of a node read and write each other's SRC and DST where they lie (device
    # arrays registered for CUDA IPC, transport.shared), not through slots of node memory
    mapped: bool = False

    @property
    def message_segment(self) -> int:
        """Elements per segment of the ring's and the pieces' messages: the segment, or
        :data:`STAGED_SEGMENT_FACTOR` segments where every message is staged."""
        return self.segment * STAGED_SEGMENT_FACTOR if self.staged else self.segment


class Schedule(NamedTuple):
    ops: tuple
    work: dict       # purpose -> elements (of the call's dtype unless in ``types``)
    nsteps: int
    types: dict = {}  # purpose -> dtype of the work buffers not of the call's dtype
    # name -> (rank, elements): node memory of a rank of this rank's node, or where that
    # rank's SRC or DST lies (Builder.peer_buffer)
    shared: dict = {}
    # A pipeline's chunks (algorithms.pipeline): ((first op, end), ...), each chunk's ops
    # contiguous and independent of the others'; the executor advances the first ``depth``
    # unfinished ones together (chunk c opens once chunk c - depth has ended); the ops
    # after the last chunk run once every chunk has ended.  ``()``: the ops run in order.
    parts: tuple = ()
    depth: int = 0

    def sends(self) -> list:
        return [op for op in self.ops if type(op) is Send]

    def recvs(self) -> list:
        return [op for op in self.ops if type(op) is Recv]


class Builder:
    """Collects a schedule's operations in issue order."""

    __slots__ = ("ops", "work", "types", "shared", "_open")

    def __init__(self):
        self.ops: list = []
        self.work: dict = {}
        self.types: dict = {}
        self.shared: dict = {}
        self._open: set = set()  # Send/Recv handles not waited for yet

    def buffer(self, purpose: str, n: int, dtype=None) -> str:
        """A work buffer of ``n`` elements for ``purpose`` (unique per schedule); its name.

        ``dtype``: the buffer's element type where it is not the call's (None).
        """
        if purpose in self.work or purpose in (SRC, DST) or \
                any(purpose.startswith(prefix) for prefix, _ in _ROLES.values()):
            raise ValueError(f"work buffer {purpose!r} declared twice")
        self.work[purpose] = n
        if dtype is not None:
            self.types[purpose] = dtype
        return purpose

    def node_buffer(self, rank: int, n: int) -> str:
        """The node memory of ``rank`` (of this rank's node, this rank included), ``n``
        elements of the call's type; its name (see the module docstring)."""
        name = node_buffer_name(rank)
        self.shared[name] = (rank, max(n, self.shared.get(name, (rank, 0))[1]))
        return name

    def peer_buffer(self, rank: int, role: str, n: int) -> str:
        """Where ``rank`` (of this rank's node, this rank included) has its call's ``role``
        (:data:`INPUT`: ``SRC``; :data:`OUTPUT`: ``DST``), ``n`` elements, for the ranks of
        its node to read and write (a schedule on ``Shape.mapped``); its name.  The binding
        may give this rank's own the memory of its ``SRC`` (``DST``): a ``Copy`` between
        the two is then nothing."""
        name = node_buffer_name(rank, role)
        self.shared[name] = (rank, max(n, self.shared.get(name, (rank, 0))[1]))
        return name

    def send(self, peer: int, region: Region, label: Label | None = None) -> int:
        self.ops.append(Send(peer, region, label))
        self._open.add(len(self.ops) - 1)
        return len(self.ops) - 1

    def recv(self, peer: int, region: Region, label: Label | None = None) -> int:
        self.ops.append(Recv(peer, region, label))
        self._open.add(len(self.ops) - 1)
        return len(self.ops) - 1

    def wait(self, *handles: int) -> None:
        hs = tuple(h for h in handles if h is not None)
        if hs:
            self.ops.append(Wait(hs))
            self._open.difference_update(hs)

    def reduce(self, a: Region, b: Region, out: Region) -> None:
        self.ops.append(Reduce(a, b, out))

    def copy(self, dst: Region, src: Region) -> None:
        if dst != src:
            self.ops.append(Copy(dst, src))

    def fold(self, xs, outs) -> None:
        self.ops.append(Fold(tuple(xs), tuple(outs)))

    def build(self, nsteps: int) -> Schedule:
        if self._open:
            self.ops.append(Wait(tuple(sorted(self._open))))
            self._open.clear()
        return Schedule(tuple(self.ops), dict(self.work), nsteps, dict(self.types),
                        dict(self.shared))


EMPTY = Schedule((), {}, 0)


_NODE_PREFIX = "node memory of rank "
INPUT, OUTPUT = "input", "output"  # Builder.peer_buffer's roles
_ROLES = {"": (_NODE_PREFIX, None), INPUT: ("input of rank ", SRC),
          OUTPUT: ("output of rank ", DST)}


def node_buffer_name(rank: int, role: str = "") -> str:
    """The name a schedule gives the node memory of ``rank`` (never a work purpose's), or
    (``role``) where that rank's ``SRC`` or ``DST`` lies (:meth:`Builder.peer_buffer`)."""
    return f"{_ROLES[role][0]}{rank}"


def node_role(name: str) -> str | None:
    """Of a name of ``Schedule.shared``: None for node memory, else which of its rank's
    buffers it is (``SRC`` or ``DST``)."""
    for prefix, buf in _ROLES.values():
        if buf is not None and name.startswith(prefix):
            return buf
    return None


def own_block(b: Builder, shape: Shape) -> Region:
    """This rank's block of ``DST`` in an AllGather, with ``SRC`` copied into it first
    unless the call is in place (then ``SRC`` is that block already)."""
    rank = shape.rank
    own = Region(DST, shape.displs[rank], shape.displs[rank] + shape.counts[rank])
    if not shape.in_place and own.count:
        b.copy(own, Region(SRC, 0, own.count))
    return own


# --- counts and layouts ---------------------------------------------------------------

def offsets(counts) -> list:
    """Where each block starts when blocks of ``counts`` lie end to end from 0, then the total:
    ``[0, c0, c0 + c1, ..., sum(counts)]``."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def split(total: int, n: int):
    """(counts, displs) of ``total`` elements cut into ``n`` blocks (``numpy.array_split``'s
    rule: the first ``total % n`` blocks hold one element more)."""
    q, r = divmod(total, n)
    counts = [q + 1] * r + [q] * (n - r)
    return counts, offsets(counts)[:-1]


def packed(counts, displs) -> bool:
    """True when the blocks lie end to end in rank order from offset 0 (no gaps, no reordering)."""
    return list(displs) == offsets(counts)[:-1]


# --- messages between two ranks -------------------------------------------------------

# A piece to a rank of the same node is this many segments (16 MiB at the default 1 MiB
# segment, the channel's LOCAL_PIECE_BYTES; the ring AllGather's AG_SEGMENT_FACTOR).
LOCAL_PIECE_FACTOR = 16


class PieceBuilder(Builder):
    """A :class:`Builder` whose exchange helpers below cut every message into pieces.

    A whole step sent as one message runs slower than the same bytes in
    pieces: two 64 MiB flows on one TCP link reached 50-67% of it, 1 MiB
    pieces 97-98% (measured on the emulated cluster: docs/cluster.md,
    "Measuring on it").  Inside a node every piece is a rendezvous of its own in MPI's
    shared-memory transport, and nothing overlaps the pieces (the
    reductions wait for the whole message): a 2-rank recursive doubling
    AllGather in 1 MiB pieces took 1.17-1.33x the built-in from 8 MiB, the
    ring's 16 MiB pieces 1.0x.  So a peer of this rank's node gets
    ``local_piece`` (:meth:`of`: :data:`LOCAL_PIECE_FACTOR` segments);
    both ends of a message know the same two nodes, so they cut it alike.
    ``piece``: elements per piece to another node (the context's segment, as
    the ring's); ``local``: per rank, whether it is on this rank's node
    (``()``: not known, every peer gets ``piece``, as the channel does);
    ``window``: pieces in flight each way (as the ring's receives), so that
    pieces complete one after the other and each completion is progress.
    """

    __slots__ = ("piece", "window", "local", "local_piece")

    def __init__(self, piece: int, window: int = 2, local: tuple = (), local_piece: int = 0):
        super().__init__()
        self.piece = max(1, int(piece))
        self.window = max(1, int(window))
        self.local = tuple(local)
        self.local_piece = max(self.piece, int(local_piece))

    @classmethod
    def of(cls, shape) -> PieceBuilder:
        """The builder of ``shape``: its segment and window, its node labels (a staged
        shape's pieces are its message segment to every peer: :class:`Shape`)."""
        nodes = shape.nodes
        local = tuple(x == nodes[shape.rank] for x in nodes) if nodes else ()
        piece = shape.message_segment
        return cls(piece, shape.window, local,
                   piece if shape.staged else LOCAL_PIECE_FACTOR * shape.segment)

    def piece_for(self, peer: int) -> int:
        """Elements per piece of a message to or from ``peer``."""
        local = self.local
        return self.local_piece if peer < len(local) and local[peer] else self.piece


def pieces(b: Builder, region: Region, peer: int = -1) -> list:
    """``region`` cut into the builder's pieces to ``peer`` (one piece for a plain Builder);
    [] when empty."""
    if not region.count:
        return []
    piece = b.piece_for(peer) if isinstance(b, PieceBuilder) else None
    if piece is None or region.count <= piece:
        return [region]
    return [Region(region.buf, a, min(a + piece, region.stop))
            for a in range(region.start, region.stop, piece)]


def transfer(b: Builder, recvs: list, sends: list, during: tuple | None = None) -> None:
    """Post ``(peer, region, label)`` receives and sends piece by piece, ``window`` in flight.

    Piece i of each list is waited for before piece i + window is posted;
    the other end does the same, so with a plain Builder (one piece each)
    this is: post the receive, post the send, wait for both.  ``during``: a
    copy ``(dst, src)`` made while the first pieces are on the wire.
    """
    window = getattr(b, "window", 1)
    rs, ss = [[(peer, r, lab._replace(segment=j, count=r.count)) for peer, region, lab in side
               for j, r in enumerate(pieces(b, region, peer))] for side in (recvs, sends)]
    posted: dict = {}

    def post(i):
        r = b.recv(*rs[i]) if i < len(rs) else None
        s = b.send(*ss[i]) if i < len(ss) else None
        posted[i] = (r, s)

    steps = max(len(rs), len(ss))
    for i in range(min(window, steps)):
        post(i)
    if during is not None:
        b.copy(*during)
    if steps <= window:
        b.wait(*(h for i in range(steps) for h in posted[i]))
        return
    for i in range(steps):
        b.wait(*posted.pop(i))
        if i + window < steps:
            post(i + window)


def exchange(b: Builder, peer: int, send: Region, recv: Region, label: Label,
             during: tuple | None = None, to: int | None = None) -> None:
    """Receive ``recv`` from ``peer`` and send ``send`` to ``to`` (default: ``peer``), then wait
    for both, in the builder's pieces; an empty half is not sent (both ends know its size).
    ``during``: a copy ``(dst, src)`` made while the messages are on the wire."""
    transfer(b, [(peer, recv, label)], [(peer if to is None else to, send, label)], during)


def send_to(b: Builder, peer: int, region: Region, label: Label) -> None:
    """Send ``region`` to ``peer`` and wait (nothing when it is empty)."""
    transfer(b, [], [(peer, region, label)])


def recv_from(b: Builder, peer: int, region: Region, label: Label) -> None:
    """Receive ``region`` from ``peer`` and wait (nothing when it is empty)."""
    transfer(b, [(peer, region, label)], [])


# --- steps around a ring --------------------------------------------------------------

class Block(NamedTuple):
    """A block of a ring collective as one rank sees it (``count`` elements).

    ``label`` names it in message labels; ``mine`` is this rank's contribution
    (what it sends first, or reduces into what arrives); ``home`` is where the
    output keeps it (None: nowhere, this rank only passes its partials on).
    """

    label: int
    count: int
    mine: Region | None
    home: Region | None


class RingStep(NamedTuple):
    """What one step of a ring does with one block (:class:`Ring` writes its operations).

    ``recv``: it receives the block's partial (or the block) from the left; ``reduce``:
    it adds this rank's contribution to what arrives; ``send``: it passes the result (or,
    without a receive, this rank's contribution) to the right; ``keep``: it also copies
    this rank's contribution to the block's home.  ``phase`` labels its messages.
    """

    recv: bool
    reduce: bool
    send: bool
    keep: bool
    block: Block
    phase: str


class Unit(NamedTuple):
    """One segment a ring step receives: step ``step``, segment ``seg`` of its block,
    elements ``start:stop`` of the block."""

    step: int
    seg: int
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


class Ring:
    """One rank's steps on a ring: it sends only to the next position, receives only from the one before.

    A ring algorithm calls one method per step, in step order; step ``t``
    sends (if it sends) in step ``t`` and receives what the rank before it
    sent in step ``t - 1``.  Then :meth:`run` writes the operations:

    * blocks are cut into segments of ``segment`` elements, and each segment
      is passed on as soon as it is reduced, so the steps overlap;
    * receives are posted ``window`` segments ahead (at least 2 when nothing is
      reduced: those land in the output and cost no memory), into the
      block's home in the output when nothing there is still needed (out of
      place), else into ``window`` receive slots;
    * partials with no home (ReduceScatter: every block but this rank's own)
      are passed on from a few send slots, reused once their sends completed.
      Then every block is cut into the same number of segments (an empty one
      still travels) and the segments are taken in groups, the first step's
      segments of a group sent first, so that this bounded memory cannot
      deadlock (docs/design.md, "Bounded work memory for the ring ReduceScatter, and
      why it cannot deadlock");
    * where the steps switch from reducing to copying, sends still reading
      blocks the copies may receive into are waited for (all but the last
      step's, which carry this rank's own, complete block).

    Message labels carry the step, :attr:`phase` as it was when the sending
    step was called, the block's label and the segment.
    """

    def __init__(self, b: Builder, shape: Shape, blocks: list, phase: str, segment: int):
        n, p = shape.size, shape.ring_pos
        self.b, self.blocks, self.phase, self.segment = b, blocks, phase, max(1, segment)
        self.left, self.right = shape.ring[(p - 1) % n], shape.ring[(p + 1) % n]
        self.window, self.in_place = max(1, shape.window), shape.in_place
        self.steps: list = []  # RingStep per step

    def _step(self, block: int, recv=False, reduce=False, send=False, keep=False) -> None:
        self.steps.append(RingStep(recv, reduce, send, keep,
                                   self.blocks[block % len(self.blocks)], self.phase))

    def send(self, block: int) -> None:
        """Send my contribution to ``block``."""
        self._step(block, send=True)

    def copy_send(self, block: int) -> None:
        """Send my ``block`` and put it in its home (the copy overlaps the first receives)."""
        self._step(block, send=True, keep=True)

    def recv_reduce_send(self, block: int) -> None:
        """Receive the partial of ``block``, add mine, pass it on."""
        self._step(block, recv=True, reduce=True, send=True)

    def recv_reduce(self, block: int) -> None:
        """Receive the partial of ``block`` and add mine: it is complete, in its home."""
        self._step(block, recv=True, reduce=True)

    def recv_copy_send(self, block: int) -> None:
        """Receive ``block`` into its home and pass it on."""
        self._step(block, recv=True, send=True)

    def recv(self, block: int) -> None:
        """Receive ``block`` into its home."""
        self._step(block, recv=True)

    def run(self) -> int:
        """Write the steps' operations into the builder; the number of steps messages take."""
        passes: list = []  # runs of steps that all reduce or all copy what they receive
        for t, step in enumerate(self.steps):
            prev = self.steps[t - 1] if t else None
            if prev is None or (prev.recv and prev.reduce != step.reduce):
                passes.append([])
            passes[-1].append(t)
        sending: dict = {}  # handle of a send not waited for yet -> its step
        for k, ts in enumerate(passes):
            if k:
                done = [h for h in sorted(sending) if sending[h] != ts[0] - 1]
                self.b.wait(*done)
                for h in done:
                    del sending[h]
            _Pass(self, ts, sending).write()
        self.b.wait(*sorted(sending))
        return len(self.steps) - 1


class _Pass:
    """One run of ring steps that all reduce (or all copy) what they receive, written as
    operations (:meth:`write`): the segments they receive (:class:`Unit`, in the order
    they are taken), where each lands, the slots of partials passed on."""

    def __init__(self, ring: Ring, ts: list, sending: dict):
        self.ring, self.b, self.sending = ring, ring.b, sending
        steps = ring.steps
        self.steps = steps
        # the step that only sends (the pass's first), if it has one
        self.first = ts[0] if not steps[ts[0]].recv else None
        recvs = [t for t in ts if steps[t].recv]
        reduces = bool(recvs) and steps[recvs[0]].reduce
        window = ring.window if reduces else max(ring.window, 2)
        # blocks without a home: send slots, equal cuts, groups (see Ring's docstring)
        self.even = any(bl.home is None for bl in ring.blocks)
        if self.even:
            nseg = -(-max(bl.count for bl in ring.blocks) // ring.segment)
            group = min(2 * window - 1, nseg)
            self.nout = max(1, group - window + 1)
            self.groups = [range(g, min(g + group, nseg)) for g in range(0, nseg, group)]
            self.nseg = nseg
        else:
            self.nout = 1
            self.groups = [None]
        self.units, self.starts = [], []
        for g in self.groups:
            self.starts.append(len(self.units))
            for t in recvs:
                pieces = self.cut(steps[t].block)
                self.units.extend(Unit(t, j, *pieces[j])
                                  for j in (range(len(pieces)) if g is None else g))
        self.window = min(window, len(self.units))
        into = [u.count for u in self.units if not self.direct(u.step)]
        self.slot = max(into) if into else 0  # elements of one receive slot
        self.rslots = self.b.buffer("ring: receive slots", self.window * self.slot) \
            if into else None
        passed = [u.count for u in self.units
                  if steps[u.step].send and steps[u.step].block.home is None]
        self.width = max(passed, default=0)  # elements of one send slot
        self.sslots = self.b.buffer("ring: partials to pass on", self.nout * self.width) \
            if passed else None
        self.slot_send = [None] * (self.nout if passed else 0)

    def cut(self, bl) -> list:
        """(start, stop) of each segment of block ``bl``: every block in ``nseg`` equal
        cuts where some block has no home, else segments of the ring's size."""
        if self.even:
            at = offsets(split(bl.count, self.nseg)[0])
            return list(zip(at, at[1:]))
        seg = self.ring.segment
        return [(a, min(a + seg, bl.count)) for a in range(0, bl.count, seg)]

    def direct(self, t: int) -> bool:
        """Whether step ``t`` receives straight into its block's home."""
        step = self.steps[t]
        return not step.reduce or (not self.ring.in_place and step.block.home is not None)

    def target(self, i: int) -> Region:
        """Where unit ``i`` lands: its block's home, or a receive slot."""
        u = self.units[i]
        if self.direct(u.step):
            return self.steps[u.step].block.home.part(u.start, u.stop)
        at = (i % self.window) * self.slot
        return Region(self.rslots, at, at + u.count)

    def post(self, i: int) -> int:
        """Post the receive of unit ``i``; its handle."""
        u = self.units[i]
        before, step = self.steps[u.step - 1], self.steps[u.step]
        return self.b.recv(self.ring.left, self.target(i),
                           Label(u.step - 1, before.phase, step.block.label, u.seg, u.count))

    def send_first(self, g: int) -> None:
        """Send group ``g``'s segments of the first step (the one that only sends)."""
        if self.first is None:
            return
        step = self.steps[self.first]
        bl, group = step.block, self.groups[g]
        pieces = self.cut(bl)
        for j in (range(len(pieces)) if group is None else group):
            a, c = pieces[j]
            label = Label(self.first, step.phase, bl.label, j, c - a)
            self.sending[self.b.send(self.ring.right, bl.mine.part(a, c), label)] = self.first

    def write(self) -> None:
        b, units, window = self.b, self.units, self.window
        self.send_first(0)
        posted = [self.post(i) for i in range(window)]
        if self.first is not None:
            step = self.steps[self.first]
            if step.keep and step.block.count:
                b.copy(step.block.home, step.block.mine)
        o = 0  # partials passed on so far (their send slots in turn)
        for i, u in enumerate(units):
            if i and i in self.starts:
                self.send_first(self.starts.index(i))
            b.wait(posted[i % window])
            step = self.steps[u.step]
            bl = step.block
            dest = bl.home.part(u.start, u.stop) if bl.home is not None else None
            slot = None
            if step.reduce:
                if dest is None:  # a partial passed on, not kept: through a send slot
                    slot, o = o % self.nout, o + 1
                    if self.slot_send[slot] is not None:
                        b.wait(self.slot_send[slot])
                        self.sending.pop(self.slot_send[slot])
                    dest = Region(self.sslots, slot * self.width, slot * self.width + u.count)
                b.reduce(self.target(i), bl.mine.part(u.start, u.stop), dest)
            if i + window < len(units):
                posted[i % window] = self.post(i + window)
            if step.send:
                h = b.send(self.ring.right, dest, Label(u.step, step.phase, bl.label, u.seg,
                                                        u.count))
                self.sending[h] = u.step
                if slot is not None:
                    self.slot_send[slot] = h
