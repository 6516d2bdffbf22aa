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
    region of the context's work arena (see mpicoll/engine/workmem.py), so two
    buffers of a schedule never alias.

Operations, in issue order (``Schedule.ops``):

``Send(peer, region, label)`` / ``Recv(peer, region, label)``
    post a non-blocking send / receive of ``region``; messages between two
    ranks match in issue order (one tag, MPI's non-overtaking rule), so a
    schedule must issue its sends to a peer in the order the peer issues its
    receives from it.
``Wait(handles)``
    block until the listed earlier ``Send``/``Recv`` ops (their indices in
    ``ops``) completed.  A region a posted ``Recv`` writes or a posted
    ``Send`` reads must not be touched before a ``Wait`` covering it.
``Reduce(a, b, out)``
    ``out = a op b`` elementwise (``a`` is the left operand: the order
    matters for non-commutative ops); ``out`` may be ``a`` or ``b``.
``Copy(dst, src)``
    ``dst = src``.

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


class Send(NamedTuple):
    peer: int
    region: Region
    label: Label | None = None


class Recv(NamedTuple):
    peer: int
    region: Region
    label: Label | None = None


class Wait(NamedTuple):
    handles: tuple  # indices in Schedule.ops of Send/Recv ops


class Reduce(NamedTuple):
    a: Region
    b: Region
    out: Region


class Copy(NamedTuple):
    dst: Region
    src: Region


class Shape(NamedTuple):
    """What a schedule depends on: the communicator, the call's counts, the tuning.

    ``counts``/``displs`` are per rank (ReduceScatter and AllGather blocks;
    AllReduce: ``(total,)`` and ``(0,)``).  ``ring`` lists ranks in ring
    order and ``ring_pos`` is this rank's position in it.  ``nodes`` is the
    node label of every rank (transport.topology; ``()``: not known, taken as
    one node): only the hierarchical algorithms read it.
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


class Schedule(NamedTuple):
    ops: tuple
    work: dict       # purpose -> elements (of the call's dtype)
    nsteps: int

    def sends(self) -> list:
        return [op for op in self.ops if type(op) is Send]

    def recvs(self) -> list:
        return [op for op in self.ops if type(op) is Recv]


class Builder:
    """Collects a schedule's operations in issue order."""

    __slots__ = ("ops", "work", "_open")

    def __init__(self):
        self.ops: list = []
        self.work: dict = {}
        self._open: set = set()  # Send/Recv handles not waited for yet

    def buffer(self, purpose: str, n: int) -> str:
        """A work buffer of ``n`` elements for ``purpose`` (unique per schedule); its name."""
        if purpose in self.work or purpose in (SRC, DST):
            raise ValueError(f"work buffer {purpose!r} declared twice")
        self.work[purpose] = n
        return purpose

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

    def build(self, nsteps: int) -> Schedule:
        if self._open:
            self.ops.append(Wait(tuple(sorted(self._open))))
            self._open.clear()
        return Schedule(tuple(self.ops), dict(self.work), nsteps)


EMPTY = Schedule((), {}, 0)


def own_block(b: Builder, shape: Shape) -> Region:
    """This rank's block of ``DST`` in an AllGather, with ``SRC`` copied into it first
    unless the call is in place (then ``SRC`` is that block already)."""
    rank = shape.rank
    own = Region(DST, shape.displs[rank], shape.displs[rank] + shape.counts[rank])
    if not shape.in_place and own.count:
        b.copy(own, Region(SRC, 0, own.count))
    return own
