"""Derived MPI datatypes in ``mpicoll.Comm``'s buffer specs: decoded once, run as one predefined type.

A committed derived datatype ``T`` (``Create_contiguous``, ``Create_vector``,
``Create_hvector``, ``Create_indexed``, ``Create_indexed_block``,
``Create_hindexed(_block)``, ``Create_subarray``, ``Create_darray``,
``Create_struct``, ``Create_resized``, ``Dup``) is decoded with
``Get_envelope``/``Get_contents`` (mpi4py's ``decode``) into its *base*, the
one predefined datatype all its elements are, and ``n``, the base elements in
one element of ``T``.

A spec ``[buf, count, displ, T]`` is then a message of ``count * n`` base
elements, and the algorithms run on it as on any other:

* *contiguous* types (``count`` elements of ``T`` are ``count * n`` base elements
  end to end in type-map order, no byte between: ``Create_contiguous``, a vector
  whose stride is its block, a struct of one type without gaps, ``Dup``) are a
  view of the buffer: no copy;
* every other layout is *packed*: before the algorithm the elements are copied,
  in type-map order, into a work array, and after it the result is written
  back to the type map's positions.  MPI itself does both copies (a
  message to this rank on a private duplicate of ``MPI.COMM_SELF``, ``T`` on one
  side and the base type on the other), so the type map is MPI's, whatever the
  constructor, and the bytes outside it (a vector's gaps, a subarray's border,
  a pair type's padding) stay untouched, as MPI's own collectives leave them.

MPI packs a non-contiguous datatype on every message it sends of it; a
collective that forwards a block several times (a ring AllGather, size - 1
times) would pack it that often, so packing once per call costs no more than
handing ``T`` to ``Isend``/``Irecv``, and it keeps the engine to one kind of
message: runs of one predefined type, which every algorithm cuts, forwards,
copies into work memory and binds once (persistent requests) the same way.
Ranks may describe their blocks with different datatypes of one type
signature, as MPI allows: every one becomes the same run of base elements.

A predefined op (``MPI.SUM``, ...) reduces the base elements one by one.  (MPI
defines its predefined ops on predefined datatypes only, MPI-4.1 6.9.2: Open
MPI and MPICH raise ``MPI_ERR_OP`` for them on any derived datatype, even
mpi4py's ``dtlib.from_numpy_dtype`` duplicates, which mpicoll has always
reduced.)  A user-defined op (``MPI.Op.Create``) is handed ``T`` itself, as MPI
hands it: on a contiguous ``T`` the message's elements are the elements of ``T``
(blocks of its extent, reduced with ``Op.Reduce_local`` on ``T``); on any other
layout the op would read ``T``'s layout in mpicoll's work memory, so the call
goes to MPI.

What mpicoll does not run goes to MPI's own collective (api.delegate, shown as
"delegated" by ``mpicoll.trace``/``mpicoll.traffic``): :class:`Delegate` says
why.  The reasons follow from the type signature (mixed or non-numeric element
types: every rank's datatypes of one call share it), from the datatype and op
of a reduction (the same on every rank, as MPI requires) or from a device
buffer.  :data:`ROUTES` lists them for ``python -m mpicoll.info``.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import weakref
from typing import NamedTuple

import numpy as np
from mpi4py import MPI

from ..core import types as _types
from ..core.types import Msg
from ..engine.run import free_persistent, start_persistent


class Delegate(Exception):
    """A call mpicoll hands to MPI's own collective (api.delegate); ``str()`` says why.

    Raised while the call is validated, before any message: never seen by a user."""


# What runs where, as ``python -m mpicoll.info`` prints it (datatype, who runs it).
ROUTES = (
    ("predefined numeric, MPI.BYTE and pair (MINLOC/MAXLOC) types", "mpicoll"),
    ("derived of one such type, contiguous", "mpicoll, on the buffer itself"),
    ("derived of one such type, any other layout", "mpicoll, packed once per call"),
    ("derived, contiguous, with a user-defined op", "mpicoll, the op handed the datatype"),
    ("derived, any other layout, with a user-defined op", "delegated"),
    ("derived of mixed or non-numeric types", "delegated"),
    ("derived with an extent of 0 or less, or on a device buffer", "delegated"),
)


def is_derived(datatype) -> bool:
    """Whether an MPI.Datatype is a derived one (not predefined, not DATATYPE_NULL)."""
    return not datatype.is_predefined


class Decoded(NamedTuple):
    """What mpicoll knows of a derived datatype (:func:`decode`)."""

    why: str | None          # why MPI runs calls of it (then the rest is not read)
    base: MPI.Datatype | None  # the predefined type of every element
    dtype: np.dtype | None   # its NumPy dtype and category (core.types)
    category: str | None
    n: int                   # base elements per element of the datatype
    extent: int              # the datatype's extent (bytes)
    true_lb: int             # where its data starts and how far it reaches (bytes)
    true_extent: int
    contiguous: bool         # count elements are count * n base elements end to end
    name: str                # for messages: "derived datatype (2 x MPI.DOUBLE)"


# id(datatype) -> (weak reference to it, its handle, Decoded).  A hit must be the same
# object with the same handle: a freed datatype's handle becomes DATATYPE_NULL, and a
# handle MPI hands out again belongs to a new object.
_DECODED: dict = {}


def decode(datatype) -> Decoded:
    """The :class:`Decoded` of a derived datatype, cached per datatype object."""
    key = id(datatype)
    hit = _DECODED.get(key)
    if hit is not None and hit[0]() is datatype and hit[1] == datatype.handle:
        return hit[2]
    info = _decode(datatype)

    def forget(ref, key=key):
        if _DECODED.get(key, (None,))[0] is ref:
            del _DECODED[key]

    _DECODED[key] = (weakref.ref(datatype, forget), datatype.handle, info)
    return info


def _delegated(why: str) -> Decoded:
    return Decoded(why, None, None, None, 0, 0, 0, 0, False, "derived datatype")


def _decode(datatype) -> Decoded:
    leaves: dict = {}
    try:
        run = _walk(datatype, leaves)
    except Exception as exc:  # (a constructor this MPI or mpi4py cannot decode)
        return _delegated(f"it cannot be decoded ({type(exc).__name__}: {exc})")
    lb, extent = datatype.Get_extent()
    true_lb, true_extent = datatype.Get_true_extent()
    if extent <= 0:
        return _delegated(f"its extent is {extent}")
    kinds = set()
    base = None
    for leaf in leaves.values():
        try:
            dtype, category = _types.dtype_of_datatype(leaf)
        except TypeError:
            return _delegated(f"its elements are {_types.datatype_name(leaf)}, which mpicoll "
                              f"does not reduce or move")
        if dtype.itemsize != leaf.Get_extent()[1]:
            return _delegated(f"its elements are {_types.datatype_name(leaf)}, whose extent "
                              f"is not its NumPy size")
        kinds.add((dtype, category))
        if base is None:
            base = leaf
    if len(kinds) != 1:
        return _delegated("its elements are of mixed types" if kinds else "it has no elements")
    (dtype, category), = kinds
    size, bsize = datatype.Get_size(), base.Get_size()
    n = size // bsize
    # (no byte of the extent outside the type map: a pair type's padding would be one)
    contiguous = run == (0, extent) and size == extent
    name = f"derived datatype ({n} x {_types.datatype_name(base)})"
    return Decoded(None, base, dtype, category, n, extent, true_lb, true_extent, contiguous,
                   name)


# --- the type map as one run ---------------------------------------------------------
# A run (start, nbytes): the type map is base elements end to end from byte ``start``
# in type-map order (each element at its base type's extent); None: it is not.
_EMPTY = (0, 0)


def _tile(run, count, step):
    """The run of ``count`` copies of ``run``, copy i shifted by ``i * step`` bytes."""
    if run is None:
        return None
    if count == 0 or run[1] == 0:
        return _EMPTY
    if count == 1 or run[1] == step:
        return run[0], count * run[1]
    return None


def _shift(run, by):
    return None if run is None else (run if run[1] == 0 else (run[0] + by, run[1]))


def _concat(runs):
    """The run of ``runs`` one after the other in type-map order (empty ones skipped)."""
    out = _EMPTY
    for run in runs:
        if run is None:
            return None
        if run[1] == 0:
            continue
        if out[1] == 0:
            out = run
        elif out[0] + out[1] == run[0]:
            out = (out[0], out[1] + run[1])
        else:
            return None
    return out


def _subarray(run, ext, sizes, subsizes, starts, order):
    """The run of a subarray of elements ``run`` (extent ``ext``)."""
    dims = list(range(len(sizes)))
    if order == MPI.ORDER_C:
        dims.reverse()  # (the fastest dimension first)
    stride = ext
    for d in dims:
        run = _shift(_tile(run, subsizes[d], stride), starts[d] * stride)
        stride *= sizes[d]
    return run


def _walk(datatype, leaves):
    """The run of ``datatype`` (see above); its predefined element types go into ``leaves``
    (handle -> datatype).  Datatypes that decoding hands out are freed here."""
    if datatype.is_predefined:
        leaves.setdefault(datatype.handle, datatype)
        return 0, datatype.Get_extent()[1]
    old, combiner, p = datatype.decode()
    olds = p["datatypes"] if combiner == "STRUCT" else [old]
    try:
        runs = [_walk(t, leaves) for t in olds]
        exts = [t.Get_extent()[1] for t in olds]
    finally:
        for t in olds:
            if not t.is_predefined:
                t.Free()
    run, ext = runs[0], exts[0]
    if combiner in ("DUP", "RESIZED"):
        return run
    if combiner == "CONTIGUOUS":
        return _tile(run, p["count"], ext)
    if combiner in ("VECTOR", "HVECTOR"):
        step = p["stride"] * (ext if combiner == "VECTOR" else 1)
        return _tile(_tile(run, p["blocklength"], ext), p["count"], step)
    if combiner in ("INDEXED", "HINDEXED", "INDEXED_BLOCK", "HINDEXED_BLOCK"):
        unit = 1 if combiner.startswith("H") else ext
        displs = p["displacements"]
        lengths = p["blocklengths"] if "blocklengths" in p else [p["blocklength"]] * len(displs)
        return _concat(_shift(_tile(run, b, ext), d * unit) for b, d in zip(lengths, displs))
    if combiner == "STRUCT":
        return _concat(_shift(_tile(r, b, e), d) for r, e, b, d in
                       zip(runs, exts, p["blocklengths"], p["displacements"]))
    if combiner == "SUBARRAY":
        return _subarray(run, ext, p["sizes"], p["subsizes"], p["starts"], p["order"])
    return None  # (DARRAY and any other: packed, whatever their layout)


# --- messages of a derived datatype ----------------------------------------------------

class Layout:
    """Where a derived-datatype message's elements are in the user's buffer.

    ``segments``: (byte offset, count) of each run of elements of ``datatype``
    (one for a simple spec, one per rank for Allgatherv's), end to end in the
    message.  ``n``: the message's elements per element of ``datatype``.
    ``packed``: the work array the message runs on, or None where it runs on the
    buffer itself (a contiguous datatype).
    """

    __slots__ = ("raw", "segments", "datatype", "extent", "base", "n", "packed")

    def __init__(self, raw, segments, datatype, extent, base, n, packed):
        self.raw, self.segments, self.datatype, self.extent = raw, segments, datatype, extent
        self.base, self.n, self.packed = base, n, packed

    @property
    def count(self) -> int:
        """Elements of the datatype in the message."""
        return sum(c for _, c in self.segments)

    def _pieces(self, lo, hi):
        """(buffer byte offset, count, first element in the message) of the parts of the
        segments that hold the message's elements ``lo`` to ``hi`` (of the datatype)."""
        first = 0
        for offset, count in self.segments:
            a, b = max(lo, first), min(hi, first + count)
            if a < b:
                yield offset + (a - first) * self.extent, b - a, a
            first += count

    def pack(self, lo=0, hi=None) -> None:
        """Copy elements ``lo`` to ``hi`` (all by default) from the buffer into the work array."""
        n, T, base = self.n, self.datatype, self.base
        for offset, count, k in self._pieces(lo, self.count if hi is None else hi):
            _copy([self.raw, count, offset // self.extent, T],
                  [self.packed[k * n:(k + count) * n], count * n, base])

    def unpack(self, lo=0, hi=None) -> None:
        """Write elements ``lo`` to ``hi`` (all by default) of the work array to the buffer."""
        n, T, base = self.n, self.datatype, self.base
        for offset, count, k in self._pieces(lo, self.count if hi is None else hi):
            _copy([self.packed[k * n:(k + count) * n], count * n, base],
                  [self.raw, count, offset // self.extent, T])


_SELF: list = []  # [the private duplicate of MPI.COMM_SELF] once made
_SELF_MADE = threading.Lock()  # (one thread makes it: a Dup is a collective call)
_TAGS = itertools.count()
_TAG_RANGE = 32767  # (the least MPI_TAG_UB MPI allows: every tag below it is valid)


def _copy(src, dst) -> None:
    """Copy message ``src`` into message ``dst`` (specs of one type signature) through MPI: a
    message to this rank on a private communicator, each copy with a tag of its own, so
    copies on several threads never match each other's.  It completes by itself (both
    ends are here), so it cannot wait on a peer."""
    if not _SELF:
        with _SELF_MADE:
            if not _SELF:
                _SELF.append(MPI.COMM_SELF.Dup())
                atexit.register(_free_self)  # (after mpi4py's exit hook: runs before it)
    tag = next(_TAGS) % _TAG_RANGE
    _SELF[0].Sendrecv(src, 0, tag, dst, 0, tag)


def _free_self() -> None:
    if _SELF and not MPI.Is_finalized():
        _SELF.pop().Free()


def check_runs(info: Decoded, backend) -> None:
    """:class:`Delegate` unless mpicoll runs messages of this datatype on this backend's
    buffers (whatever the op: :func:`message` decides the rest)."""
    if info.why is not None:
        raise Delegate(f"a {info.name}: {info.why}")
    if backend.name != "numpy":
        raise Delegate(f"a {info.name} on a {backend.name} (device) buffer")


def check_bounds(info: Decoded, nbytes, offset, count, argname) -> None:
    """ValueError unless ``count`` elements of the datatype from byte ``offset`` lie inside a
    buffer of ``nbytes`` (MPI would read or write past its end)."""
    if count == 0:
        return
    lo = offset + info.true_lb
    hi = lo + (count - 1) * info.extent + info.true_extent
    if lo < 0 or hi > nbytes:
        raise ValueError(
            f"{argname}: count {count} of the {info.name} at byte {offset} needs bytes "
            f"{lo} to {hi}, the buffer holds {nbytes}")


def message(info: Decoded, datatype, raw, backend, segments, vector, op) -> Msg:
    """The :class:`Msg` of a spec with derived ``datatype`` (``info``: its :func:`decode`) over
    buffer bytes ``raw`` (checked by the caller: :func:`check_bounds`), ``segments`` as
    :class:`Layout`'s, on a host buffer (:func:`check_runs`); ``vector``: Allgatherv's
    receive spec, ``op``: the call's op (None: no reduction).  Raises :class:`Delegate`
    where MPI runs the call."""
    extent, base = info.extent, info.base
    if op is not None and _types.op_name(op) is None:
        # a user op is handed the datatype itself, on elements of it: a message of them
        # where they are contiguous
        if not info.contiguous:
            raise Delegate(f"a user-defined op on a {info.name} that is not contiguous")
        dtype, n, mpitype, optype = np.dtype((np.void, extent)), 1, datatype, datatype
    else:
        dtype, n, optype = info.dtype, info.n, base
        mpitype = base if info.category == "pair" else (_types.wire_type(dtype) or base)
    counts = displs = None
    if info.contiguous:
        packed = None
        if vector:
            arr = raw[: len(raw) // dtype.itemsize * dtype.itemsize].view(dtype)
            counts = tuple(c * n for _, c in segments)
            displs = tuple(offset // extent * n for offset, _ in segments)
        else:
            offset, count = segments[0]
            arr = raw[offset: offset + count * extent].view(dtype)
    else:
        arr = packed = np.empty(sum(c for _, c in segments) * n, dtype)
        if vector:
            counts = tuple(c * n for _, c in segments)
            displs = (0,) + tuple(itertools.accumulate(counts[:-1]))
    layout = Layout(raw, tuple(segments), datatype, extent, base, n, packed)
    return Msg(arr, dtype, info.category, mpitype, info.name, backend, counts, displs, optype,
               layout)


# --- the copies around a call ----------------------------------------------------------

class Packing:
    """The copies of one call's packed messages: :meth:`pack` before its operation starts,
    :meth:`complete` once it ended (each start of a persistent call packs again).

    ``ins``/``outs``: (layout, first, end) element ranges copied in and out."""

    __slots__ = ("ins", "outs", "pending")

    def __init__(self, ins, outs):
        self.ins, self.outs = ins, outs
        self.pending = False

    def pack(self) -> None:
        for layout, lo, hi in self.ins:
            layout.pack(lo, hi)
        self.pending = True

    def complete(self, operation=None) -> None:
        """Write the results back, once per start, and only if the operation succeeded."""
        if self.pending and (operation is None or operation.error is None):
            self.pending = False
            for layout, lo, hi in self.outs:
                layout.unpack(lo, hi)

    # -- as api.requests.Request drives a non-blocking or persistent call --------------
    def start(self, operation) -> None:
        self.pack()
        start_persistent(operation)

    def free(self, operation) -> None:
        free_persistent(operation)  # (an active one completes first)
        self.complete(operation)


def packing(call) -> Packing | None:
    """The :class:`Packing` of a validated call whose messages are packed, else None.

    The input is copied in: the send message, or in place the receive message's
    input (all of it, an AllGather's own block).  The output is copied out: the
    receive message, but in place an AllGather's blocks of the other ranks and a
    ReduceScatter's first block (its result)."""
    send, recv = call.send, call.recv
    slay = None if send is None or send.layout is None or send.layout.packed is None \
        else send.layout
    rlay = None if recv.layout is None or recv.layout.packed is None else recv.layout
    if slay is None and rlay is None:
        return None
    ins = [] if slay is None else [(slay, 0, slay.count)]
    outs = []
    if rlay is not None:
        total, n = rlay.count, rlay.n
        rank = call.comm.Get_rank()
        if send is not None:
            outs.append((rlay, 0, total))
        elif call.collective == "allgather":  # (packed blocks are end to end: call.displs)
            lo = call.displs[rank] // n if n else 0
            hi = lo + (call.counts[rank] // n if n else 0)
            ins.append((rlay, lo, hi))
            outs += [(rlay, 0, lo), (rlay, hi, total)]
        else:
            ins.append((rlay, 0, total))
            result = total if call.collective == "allreduce" else \
                (call.counts[rank] // n if n else 0)
            outs.append((rlay, 0, result))
    return Packing(tuple(ins), tuple(outs))
