"""Run the schedules of all ranks of one collective in one process: NumPy, no MPI, no threads.

A :class:`~mpicoll.algorithms.schedule.Schedule` is one rank's part of an
algorithm.  :func:`simulate` runs one schedule per rank over a simulated
network and checks what the executor relies on:

binding
    ``SRC``, ``DST`` and the work buffers are bound the way the executor
    binds them (:func:`bind`): in place, AllReduce's ``SRC`` is ``DST``,
    ReduceScatter's ``DST`` is the start of ``SRC`` (``src[:counts[rank]]``)
    and AllGather's ``SRC`` is this rank's block of ``DST``.  Work buffers
    are filled with garbage, so a schedule that reads one before writing it
    gives wrong results.
matching
    A rank's k-th Send to a peer in a chunk matches the peer's k-th Recv from it
    in that chunk (one tag per chunk, MPI's non-overtaking order); the sizes
    must agree.
transport
    ``"eager"``: a Send completes when posted, its data copied then (MPI
    buffering small messages).  ``"rendezvous"``: a Send completes only when
    its Recv is posted, and the data moves then -- a schedule that relies on
    buffering deadlocks here.  A Recv completes when its Send is matched.
progress
    Ranks advance round-robin, one op at a time; a Wait blocks its rank
    until all its handles completed.  When no rank can move, the deadlock
    is reported with each rank's blocked op.
hazards (each a :class:`ScheduleError` naming the rank and op)
    a region out of its buffer's bounds or of an unknown buffer; an op that
    reads or writes memory a posted, not yet waited Recv writes into; an op
    that writes memory a posted, not yet waited Send reads (MPI allows
    concurrent reads); a Reduce whose output partially overlaps an operand,
    a Copy whose ends partially overlap; Wait on a handle that is not a
    Send/Recv of this schedule; ops left outstanding at the end; messages
    sent and never received, or the other way round.
node memory (``Schedule.shared``, algorithms.shared)
    Each node buffer (the node memory of rank q; where rank q's input or
    output lies, ``Shape.mapped``) is one array, the same in every schedule
    that names it, and only ranks of q's node may name it (``nodes``).
    ``mapped="own"`` binds rank q's input and output to its own ``SRC`` and
    ``DST`` (registered buffers) instead of arrays of their own (a rank's
    buffer for memory that cannot be shared): then q's accesses to its
    ``SRC``/``DST`` are accesses to that node buffer, checked alike.  Accesses
    to it are checked for every interleaving, not only the simulated one:
    each rank keeps a vector clock, a Send carries its sender's clock and the
    Wait that completes the matching Recv joins it, so one access *happens
    before* another exactly when a chain of messages orders them.  Two
    accesses by different ranks to the same element, one of them a write,
    must be so ordered (a rank reads a peer's element only after the write
    it reads was synchronised; it overwrites one only after every reader
    before was done); and every access a peer makes to rank q's node memory
    must happen before q's schedule ends (q's next call may write it).

Memory is compared by address, not by buffer name, so aliases (in place)
are seen for what they are.

:func:`traffic` counts a single schedule's messages, bytes and steps the way
:mod:`mpicoll.observe.traffic` reports a call (``measured()`` in
tests/tools/test_traffic.py).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from mpicoll.algorithms import ring
from mpicoll.algorithms.schedule import (
    DST,
    SRC,
    Copy,
    Fold,
    Recv,
    Reduce,
    Region,
    Schedule,
    Send,
    Shape,
    Wait,
    node_role,
)
from mpicoll.transport import topology
from support.data import rank_data

MODELS = ("eager", "rendezvous")


class ScheduleError(AssertionError):
    """A schedule broke a rule of the format (message says which rank, op and rule)."""


class Deadlock(ScheduleError):
    """No rank can move and some have not finished."""


class Counts(NamedTuple):
    """One rank's traffic, the fields of a call in ``mpicoll.traffic()`` in the same order."""

    messages_sent: int
    bytes_sent: int
    messages_received: int
    bytes_received: int
    send_steps: int | None  # steps with at least one message; None: a message without a label
    recv_steps: int | None


class Result(NamedTuple):
    buffers: list  # per rank: {name: array} as bound (SRC, DST, work buffers)
    counts: list   # per rank: Counts (bytes of DST's dtype)

    def dst(self, rank):
        return self.buffers[rank][DST]

    def src(self, rank):
        return self.buffers[rank][SRC]


# --- shapes and binding ---------------------------------------------------------

def shape(collective, size, rank, counts=None, displs=None, total=None, ring=None,
          segment=1 << 17, window=2, in_place=False, commutative=True, nodes=(),
          accumulate=None, staged=False, mapped=False) -> Shape:
    """The :class:`Shape` of one rank's call (counts/displs default to packed blocks).

    AllReduce: ``total`` elements (counts/displs become ``(total,)``/``(0,)``).
    """
    ring = tuple(range(size)) if ring is None else tuple(ring)
    if collective == "allreduce":
        counts, displs = (total,), (0,)
    else:
        counts = tuple(counts)
        if displs is None:
            displs = tuple(sum(counts[:r]) for r in range(size))
        displs = tuple(displs)
        total = sum(counts)
    return Shape(size, rank, ring, ring.index(rank), total, counts, displs, segment, window,
                 in_place, commutative, tuple(nodes), accumulate, staged, mapped=mapped)


def bind(collective, sh: Shape, src, dst):
    """{SRC: ..., DST: ...} as the executor binds them.

    Out of place ``src``/``dst`` are the user's arrays.  In place pass the one
    array the user passes (``src`` for ReduceScatter, ``dst`` otherwise) and
    None for the other: the other name is bound to its part of it.
    """
    if not sh.in_place:
        return {SRC: src, DST: dst}
    if collective == "allreduce":
        return {SRC: dst, DST: dst}
    if collective == "reduce_scatter":
        return {SRC: src, DST: src[: sh.counts[sh.rank]]}
    if collective == "allgather":
        lo = sh.displs[sh.rank]
        return {SRC: dst[lo: lo + sh.counts[sh.rank]], DST: dst}
    raise ValueError(f"collective: expected allreduce, reduce_scatter or allgather, got {collective!r}")


def garbage(dtype, n):
    """A work buffer as the arena may hand it out: full of values no result contains."""
    dtype = np.dtype(dtype)
    if dtype.kind in "fc":
        return np.full(n, 1e300, dtype)
    if dtype.kind == "b":
        return np.ones(n, dtype)
    return np.full(n, -12345 if dtype.kind == "i" else 12345, dtype)


# --- counting -------------------------------------------------------------------

def traffic(schedule: Schedule, itemsize: int = 1) -> Counts:
    """Messages, bytes (elements * itemsize) and labelled steps of one schedule.

    Steps are the distinct ``label.step`` of the messages in each direction
    (None when a message has no label), as ``mpicoll.traffic()`` counts them;
    ``traffic(s, itemsize)[:5]`` is what tests/tools/test_traffic.py's ``measured()``
    reads from a call.
    """
    sends, recvs = schedule.sends(), schedule.recvs()

    def steps(ops):
        if any(op.label is None for op in ops):
            return None
        return len({op.label.step for op in ops})

    return Counts(len(sends), sum(op.region.count for op in sends) * itemsize,
                  len(recvs), sum(op.region.count for op in recvs) * itemsize,
                  steps(sends), steps(recvs))


# --- the simulator ----------------------------------------------------------------

class _Msg:
    __slots__ = ("rank", "index", "view", "data", "done", "partner", "clock")

    def __init__(self, rank, index, view):
        self.rank, self.index, self.view = rank, index, view
        self.data = None      # eager sends: the data at posting
        self.done = False
        self.partner = None
        self.clock = None     # sends: the sender's vector clock when posted


class _NodeMemory:
    """A node buffer of one rank as the simulator tracks it: per element the last write
    (rank, time) and each rank's last read since (0: none), for the happens-before check."""

    def __init__(self, owner, arr, n):
        self.owner = owner
        self.arr = arr
        self.w_rank = np.full(len(arr), -1, np.int64)
        self.w_time = np.zeros(len(arr), np.int64)
        self.r_time = np.zeros((n, len(arr)), np.int64)

    def access(self, rk, start, stop, write, what):
        """Rank ``rk`` reads (writes) elements start:stop now; ScheduleError if an access by
        another rank to them does not happen before (see the module docstring)."""
        if stop <= start:
            return
        me, clock, now = rk.rank, rk.clock_arr(), rk.clock[rk.rank]
        w_rank, w_time = self.w_rank[start:stop], self.w_time[start:stop]
        other = (w_rank >= 0) & (w_rank != me)
        if other.any():
            late = other & (w_time > clock[np.maximum(w_rank, 0)])
            if late.any():
                at = start + int(np.argmax(late))
                raise ScheduleError(
                    f"{rk.where()}: {'overwrites' if write else 'reads'} element {at} of rank "
                    f"{self.owner}'s node memory before rank {int(self.w_rank[at])}'s write of it "
                    f"was synchronised ({what})")
        if write:
            reads = self.r_time[:, start:stop]
            for p in range(len(reads)):
                if p != me:
                    late = reads[p] > clock[p]
                    if late.any():
                        at = start + int(np.argmax(late))
                        raise ScheduleError(
                            f"{rk.where()}: overwrites element {at} of rank {self.owner}'s node "
                            f"memory before rank {p} was done reading it ({what})")
            self.w_rank[start:stop] = me
            self.w_time[start:stop] = now
            self.r_time[:, start:stop] = 0
        else:
            self.r_time[me, start:stop] = now

    def check_end(self, rk):
        """At the end of the owner's schedule: every peer's access happened before it."""
        clock = rk.clock_arr()
        other = (self.w_rank >= 0) & (self.w_rank != self.owner)
        late = other & (self.w_time > clock[np.maximum(self.w_rank, 0)])
        for p in range(len(self.r_time)):
            if p != self.owner:
                late = late | (self.r_time[p] > clock[p])
        if late.any():
            at = int(np.argmax(late))
            raise ScheduleError(f"rank {self.owner}: its schedule ends while another rank's "
                                f"access to element {at} of its node memory is not synchronised "
                                f"with it (the next call would overwrite it)")


def _span(arr):
    """(first byte address, one past the last) of a contiguous 1-D view."""
    lo = arr.__array_interface__["data"][0]
    return lo, lo + arr.nbytes


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


class _Rank:
    def __init__(self, rank, schedule, buffers, n=1, node=None):
        self.rank = rank
        self.ops = schedule.ops
        self.buffers = buffers
        self.clock = [0] * n   # vector clock (node memory's happens-before check)
        self.node = node or {}  # buffer name -> _NodeMemory
        # each buffer's (first byte address, itemsize): a region's span is computed from
        # it (a view's __array_interface__ costs a dict per call: a fifth of the
        # simulator's time went there)
        self.base = {}
        for name, buf in buffers.items():
            if buf.ndim != 1 or not buf.flags.c_contiguous:
                raise ScheduleError(f"rank {rank}: buffer {name!r} is not a contiguous 1-D array")
            self.base[name] = (_span(buf)[0], buf.itemsize)
        self.pc = 0
        self.msgs = {}     # op index -> _Msg of a posted Send/Recv
        self.pending = {}  # op index -> (kind, lo, hi) of posted, not yet waited Send/Recv

    def clock_arr(self):
        return np.asarray(self.clock, np.int64)

    def join(self, other):
        self.clock = [max(a, b) for a, b in zip(self.clock, other)]

    def touch(self, region, write, what):
        """Record an access to ``region`` if it is node memory (``node``: buffer name ->
        (node buffer, offset of the buffer in it))."""
        got = self.node.get(region.buf)
        if got is not None:
            mem, off = got
            mem.access(self, off + region.start, off + region.stop, write, what)

    def where(self, i=None):
        i = self.pc if i is None else i
        op = self.ops[i] if i < len(self.ops) else "end of schedule"
        return f"rank {self.rank} op {i} {op}"

    def view(self, region):
        """(the view of ``region``, its span: first byte address, one past the last)."""
        if type(region) is not Region:
            raise ScheduleError(f"{self.where()}: {region!r} is not a Region")
        buf = self.buffers.get(region.buf)
        if buf is None:
            raise ScheduleError(f"{self.where()}: unknown buffer {region.buf!r} "
                                f"(have {sorted(self.buffers)})")
        start, stop = region.start, region.stop
        if not 0 <= start <= stop <= len(buf):
            raise ScheduleError(f"{self.where()}: region {start}:{stop} out of bounds "
                                f"of {region.buf!r} ({len(buf)} elements)")
        addr, size = self.base[region.buf]
        return buf[start:stop], (addr + start * size, addr + stop * size)

    def check_access(self, reads=(), writes=(), skip=None):
        """Refuse touching a pending Recv's memory, or writing a pending Send's.

        ``reads``, ``writes``: spans (empty ones touch nothing)."""
        if not self.pending:
            return
        touched = reads + writes  # what a pending Recv's memory must not see
        for h, (kind, lo, hi) in self.pending.items():
            if h == skip or lo == hi:
                continue
            recv = kind == "recv"
            for a, b in (touched if recv else writes):
                if a < hi and lo < b and a < b:  # (_overlap of non-empty spans, inlined)
                    if recv:
                        raise ScheduleError(f"{self.where()}: touches memory of the Recv posted "
                                            f"at op {h}, not waited yet (overlap)")
                    raise ScheduleError(f"{self.where()}: overwrites the region of the Send "
                                        f"posted at op {h} before it was waited")


def simulate(schedules, buffers, op=None, model="rendezvous", nodes=(), mapped=None) -> Result:
    """Run ``schedules[r]`` on ``buffers[r]`` ({SRC, DST} arrays, see :func:`bind`) for all ranks.

    ``op(a, b, out)`` computes ``out = a op b`` elementwise (a NumPy ufunc
    such as ``np.add`` works); work buffers are allocated here, of the dtype
    of ``DST`` unless the schedule declares another (``Schedule.types``), filled
    with :func:`garbage`, and so are node buffers (one array per name, shared by
    every schedule naming it; ``nodes``: the node label of each rank, () for
    one node; ``mapped="own"``: a rank's input and output are its own ``SRC``
    and ``DST``, see the module docstring).  Raises :class:`ScheduleError`
    (:class:`Deadlock`) on any broken rule.
    """
    if model not in MODELS:
        raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
    if mapped not in (None, "own"):
        raise ValueError(f"mapped: expected None or 'own', got {mapped!r}")
    n = len(schedules)
    labels = tuple(nodes) if len(nodes) == n else (0,) * n
    sizes: dict = {}  # name -> (owner rank, elements: the largest any names)
    for r in range(n):
        for name, (q, count) in schedules[r].shared.items():
            if not 0 <= q < n or labels[q] != labels[r]:
                raise ScheduleError(f"rank {r}: names {name!r}, node memory of rank {q}, which "
                                    f"is not on its node (nodes {labels})")
            sizes[name] = (q, max(sizes.get(name, (q, 0))[1], count))
    memory: dict = {}  # name -> (_NodeMemory, offset of the buffer in its array)
    owned: dict = {}   # id of an array of a rank's own -> its _NodeMemory (mapped="own")
    for name, (q, count) in sizes.items():
        own = node_role(name) if mapped == "own" else None
        if own is None:
            memory[name] = (_NodeMemory(q, garbage(buffers[q][DST].dtype, count), n), 0)
            continue
        arr = buffers[q][own]
        base = arr if arr.base is None else arr.base  # (in place: one array, two views)
        mem = owned.get(id(base))
        if mem is None:
            mem = owned[id(base)] = _NodeMemory(q, base.reshape(-1), n)
        off = (_span(arr)[0] - _span(mem.arr)[0]) // arr.itemsize
        if count > len(arr):
            raise ScheduleError(f"rank {q}'s {own} holds {len(arr)} elements, {name!r} {count}")
        memory[name] = (mem, off)
    ranks = []
    for r in range(n):
        bufs = dict(buffers[r])
        dtype = bufs[DST].dtype
        types = schedules[r].types
        for purpose, count in schedules[r].work.items():
            bufs[purpose] = garbage(types.get(purpose, dtype), count)
        node = {}
        for name in schedules[r].shared:
            mem, off = memory[name]
            bufs[name] = mem.arr[off: off + sizes[name][1]]
            node[name] = (mem, off)
        for own in (SRC, DST):  # (a rank's own buffers that are node buffers: mapped="own")
            arr = bufs[own]
            mem = owned.get(id(arr if arr.base is None else arr.base))
            if mem is not None and mem.owner == r:
                node[own] = (mem, (_span(arr)[0] - _span(mem.arr)[0]) // arr.itemsize)
        ranks.append(_Rank(r, schedules[r], bufs, n, node))
    sends = {}  # (source, dest) -> deque of unmatched send _Msg
    recvs = {}  # (source, dest) -> deque of unmatched recv _Msg

    def deliver(s, rv):
        if s.view.size != rv.view.size:
            raise ScheduleError(f"message size mismatch: {ranks[s.rank].where(s.index)} sends "
                                f"{s.view.size} elements, {ranks[rv.rank].where(rv.index)} "
                                f"receives {rv.view.size}")
        rv.view[...] = s.data if s.data is not None else s.view
        s.done = rv.done = True
        rv.partner = s

    def post(rk, i, o):
        is_send = type(o) is Send
        if not 0 <= o.peer < n:
            raise ScheduleError(f"{rk.where()}: peer {o.peer} out of range 0..{n - 1}")
        v, span = rk.view(o.region)
        if is_send:
            rk.check_access(reads=(span,))
        else:
            rk.check_access(writes=(span,))
        m = _Msg(rk.rank, i, v)
        if is_send:
            m.clock = list(rk.clock)
        rk.msgs[i] = m
        rk.pending[i] = ("send" if is_send else "recv", *span)
        # (each chunk is a tag of its own: messages match within their chunk only)
        key = (rk.rank, o.peer, o.chunk) if is_send else (o.peer, rk.rank, o.chunk)
        mine, other = (sends, recvs) if is_send else (recvs, sends)
        if is_send and model == "eager":
            m.data = v.copy()
            m.done = True
        q = other.get(key)
        if q:
            partner = q.popleft()
            deliver(m, partner) if is_send else deliver(partner, m)
        else:
            mine.setdefault(key, deque()).append(m)

    def step(rk):
        """Advance rank ``rk`` by one op; False if it is blocked or finished."""
        if rk.pc >= len(rk.ops):
            return False
        i, o = rk.pc, rk.ops[rk.pc]
        t = type(o)
        rk.clock[rk.rank] += 1
        if t is Send or t is Recv:
            post(rk, i, o)
        elif t is Wait:
            for h in o.handles:
                if h not in rk.msgs:
                    raise ScheduleError(f"{rk.where()}: handle {h} is not a posted Send/Recv")
                if h not in rk.pending:
                    raise ScheduleError(f"{rk.where()}: handle {h} waited twice")
            if not all(rk.msgs[h].done for h in o.handles):
                rk.clock[rk.rank] -= 1  # (blocked: nothing happened)
                return False
            for h in o.handles:
                del rk.pending[h]
                m = rk.msgs[h]
                if m.clock is None and m.partner is not None:  # a receive: the send's clock
                    rk.join(m.partner.clock)
        elif t is Reduce:
            (a, sa), (b, sb), (out, so) = rk.view(o.a), rk.view(o.b), rk.view(o.out)
            if not (a.size == b.size == out.size):
                raise ScheduleError(f"{rk.where()}: operand sizes {a.size}, {b.size}, {out.size} differ")
            for x, sx in ((a, sa), (b, sb)):
                if x.size and _overlap(sx, so) and sx != so:
                    raise ScheduleError(f"{rk.where()}: output partially overlaps an operand")
            rk.check_access(reads=(sa, sb), writes=(so,))
            rk.touch(o.a, False, "Reduce")
            rk.touch(o.b, False, "Reduce")
            rk.touch(o.out, True, "Reduce")
            if a.size:
                op(a, b, out)
        elif t is Copy:
            (d, sd), (s, ss) = rk.view(o.dst), rk.view(o.src)
            if d.size != s.size:
                raise ScheduleError(f"{rk.where()}: copies {s.size} elements into {d.size}")
            if d.size and _overlap(sd, ss) and sd != ss:
                raise ScheduleError(f"{rk.where()}: source and destination partially overlap")
            rk.check_access(reads=(ss,), writes=(sd,))
            rk.touch(o.src, False, "Copy")
            rk.touch(o.dst, True, "Copy")
            d[...] = s
        elif t is Fold:
            xs, outs = [rk.view(x) for x in o.xs], [rk.view(y) for y in o.outs]
            sizes_ = {v.size for v, _ in xs + outs}
            if len(sizes_) > 1 or not xs or not outs:
                raise ScheduleError(f"{rk.where()}: operand and output sizes {sorted(sizes_)}")
            for i, (y, sy) in enumerate(outs):
                for _, sv in xs + outs[:i]:
                    if y.size and _overlap(sy, sv) and sy != sv:
                        raise ScheduleError(f"{rk.where()}: an output partially overlaps "
                                            f"an operand or another output")
            rk.check_access(reads=tuple(sx for _, sx in xs), writes=tuple(sy for _, sy in outs))
            for x in o.xs:
                rk.touch(x, False, "Fold")
            for y in o.outs:
                rk.touch(y, True, "Fold")
            acc = xs[0][0].copy()
            for v, _ in xs[1:]:
                op(acc, v, acc)
            for y, _ in outs:
                y[...] = acc
        else:
            raise ScheduleError(f"{rk.where()}: unknown op type {t.__name__}")
        rk.pc += 1
        return True

    live = list(ranks)
    while live:
        moved = False
        for rk in live:
            moved |= step(rk)
        live = [rk for rk in live if rk.pc < len(rk.ops)]
        if live and not moved:
            lines = []
            for rk in live:
                o = rk.ops[rk.pc]
                waiting = [f"op {h} {rk.ops[h]}" for h in o.handles if not rk.msgs[h].done]
                lines.append(f"  {rk.where()} waits for " + "; ".join(waiting))
            raise Deadlock(f"deadlock ({model}): no rank can move\n" + "\n".join(lines))
    for rk in ranks:
        if rk.pending:
            raise ScheduleError(f"rank {rk.rank}: ops {sorted(rk.pending)} left outstanding at the end")
    for mem in {id(m): m for m, _ in memory.values()}.values():
        mem.check_end(ranks[mem.owner])
    left = [m for q in (*sends.values(), *recvs.values()) for m in q]
    if left:
        raise ScheduleError("unmatched messages: " + "; ".join(ranks[m.rank].where(m.index) for m in left))
    return Result([rk.buffers for rk in ranks],
                  [traffic(Schedule(rk.ops, {}, 0), rk.buffers[DST].itemsize) for rk in ranks])


# --- one checked case -------------------------------------------------------------

def affine(a, b, out):
    """Composition of affine maps x -> re*x + im packed in complex numbers: associative,
    not commutative; exact on small integers, so operand order shows."""
    re = a.real * b.real
    im = a.real * b.imag + a.imag
    out.real = re
    out.imag = im


def _inputs(n, length, op):
    dtype = np.complex128 if op == "affine" else np.float64
    return [rank_data(length, r, dtype) for r in range(n)]


def _reduce_all(inputs, op):
    acc = inputs[0].copy()
    for x in inputs[1:]:
        (affine if op == "affine" else np.add)(acc, x, acc)  # rank order, left to right
    return acc


def count_patterns(n, rng):
    """Block counts that differ: equal, uneven, all empty, one non-empty (last, first),
    random small and larger, a thousand split."""
    from mpicoll.algorithms.ring import split
    return [[3] * n, split(2 * n + 1, n)[0], [0] * n, [0] * (n - 1) + [5], [1] + [0] * (n - 1),
            [rng.randrange(0, 6) for _ in range(n)], [rng.randrange(0, 40) for _ in range(n)],
            split(1000, n)[0]]


def scattered(counts, rng):
    """Displacements with gaps between blocks, in a random order; the buffer length."""
    order = list(range(len(counts)))
    rng.shuffle(order)
    displs, at = [0] * len(counts), 2
    for r in order:
        displs[r] = at
        at += counts[r] + 1
    return displs, at + 3


def run_case(collective, build, n, counts, displs, length, in_place, model, tuning=(1, 2), op="sum",
             ring_order=None, nodes=(), mapped=None):
    """Build every rank's schedule, simulate, check; returns the simulator's Result.

    ``mapped``: the shapes' ``Shape.mapped``, the node buffers of the call's own bound
    to arrays of their own (``"apart"``) or to the ranks' ``SRC``/``DST`` (``"own"``).

    Checks: every rank's result equals a NumPy reference bitwise (``op`` "sum",
    or "affine", which is not commutative); AllReduce under "affine": every rank
    the same bits; inputs unchanged unless in place (in place: what lies beyond
    ReduceScatter's result); every message labelled with its size; the
    simulator's traffic equals :func:`traffic`.  ``tuning``: (segment elements, window).
    """
    seg, win = tuning
    shapes = [shape(collective, n, r, counts=counts, displs=displs,
                    total=length if collective == "allreduce" else None, ring=ring_order,
                    segment=seg, window=win, in_place=in_place, commutative=op != "affine",
                    nodes=nodes, mapped=mapped is not None)
              for r in range(n)]
    schedules = [build(s) for s in shapes]
    what = (f"{collective} {build.__module__}.{build.__name__} n={n} counts={counts} "
            f"displs={displs} in_place={in_place} {model} tuning={tuning} op={op} "
            f"ring={ring_order} nodes={nodes} mapped={mapped}")
    if collective == "allgather":
        blocks = [rank_data(counts[r], r) + 100 * r for r in range(n)]
        expect = np.full(length, -1.0)
        for r in range(n):
            expect[displs[r]: displs[r] + counts[r]] = blocks[r]
        bufs = []
        for r in range(n):
            dst = np.full(length, -1.0)
            if in_place:
                dst[displs[r]: displs[r] + counts[r]] = blocks[r]
                bufs.append(bind(collective, shapes[r], None, dst))
            else:
                bufs.append(bind(collective, shapes[r], blocks[r].copy(), dst))
        inputs = blocks
    else:
        inputs = _inputs(n, length, op)
        full = _reduce_all(inputs, op)
        bufs = []
        for r in range(n):
            x = inputs[r].copy()
            if collective == "allreduce":
                dst = None if in_place else np.full(length, 7, x.dtype)
                bufs.append(bind(collective, shapes[r], None if in_place else x, x if in_place else dst))
            else:
                bufs.append(bind(collective, shapes[r], x,
                                 None if in_place else np.full(counts[r], 7, x.dtype)))
    res = simulate(schedules, bufs, np.add if op == "sum" else affine, model, nodes,
                   "own" if mapped == "own" else None)
    for r in range(n):
        got = res.dst(r)
        if collective == "allreduce":
            want = full
        elif collective == "reduce_scatter":
            want = full[displs[r]: displs[r] + counts[r]]
        else:
            want = expect
        assert got.tobytes() == want.tobytes(), f"{what}: rank {r} got {got}, want {want}"
        if collective == "allreduce" and op == "affine":
            assert got.tobytes() == res.dst(0).tobytes(), f"{what}: ranks differ bitwise"
        src = res.src(r)
        if not in_place:
            assert src.tobytes() == inputs[r].tobytes(), f"{what}: rank {r} input changed"
        elif collective == "reduce_scatter":
            assert src[counts[r]:].tobytes() == inputs[r][counts[r]:].tobytes(), \
                f"{what}: rank {r} input beyond the result changed"
        for o in schedules[r].ops:
            if type(o) in (Send, Recv):
                assert o.label is not None and o.label.count == o.region.count, f"{what}: label {o}"
        assert res.counts[r] == traffic(schedules[r], got.itemsize)
    return res


def node_link_elements(collective, build, nodes, total, segment=64) -> dict:
    """{node: elements its ranks send to other nodes} of one call of ``build`` over ``total``
    elements, every rank on the topology-aware ring of ``nodes`` (node label per rank)."""
    n = len(nodes)
    order = tuple(topology.ring_from_nodes(list(nodes)))
    counts = ring.split(total, n)[0]
    out: dict = {}
    for r in range(n):
        sh = shape(collective, n, r, counts=None if collective == "allreduce" else counts,
                   total=total if collective == "allreduce" else None, ring=order,
                   segment=segment, nodes=nodes)
        for o in build(sh).sends():
            if nodes[o.peer] != nodes[r]:
                out[nodes[r]] = out.get(nodes[r], 0) + o.region.count
    return out
