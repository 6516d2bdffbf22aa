"""Validation: every argument of the array functions and of ``mpicoll.Comm``'s methods.

One function per entry point turns its arguments into one
:class:`~mpicoll.core.types.Call` (or raises), the record the engine runs
(engine.run), so the blocking call, its non-blocking form and its persistent
form cannot check differently:

* the array functions: :func:`allreduce`, :func:`allgather`,
  :func:`reduce_scatter` return ``(call, result, after)``: ``result`` is what
  the function returns, ``after`` the copy back into a non-C-ordered ``out``
  once the data moved (or None);
* ``mpicoll.Comm``'s methods: :func:`Allreduce`, :func:`Allgather`,
  :func:`Allgatherv`, :func:`Reduce_scatter_block`, :func:`Reduce_scatter`
  (named after the method) return the call.

What both APIs check the same way is one function here: the op against the
data type (:func:`check_op_applies`), memory shared by input and output
(:func:`check_apart`, on :func:`overlaps`), the numerics flags, the forced
algorithm of an ``mpicoll.Comm``.  Every error is raised before any message is
sent and names the argument, what was expected and what was got: TypeError
for a wrong type, ValueError for a wrong value.

Only a call that is not a repeat comes here: a repeat (engine.cache) is
proven valid by the signature of what these functions read.

The buffer arguments (the second half of this module) are normalised once:
an mpi4py message spec or an array becomes a :class:`~mpicoll.core.types.Msg`.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..algorithms.ring import split
from ..algorithms.schedule import offsets
from ..backends import dlpack as _dlpack
from ..backends import host as _backend
from ..backends import registry as _registry
from ..backends.host import NUMPY
from ..core import config as _config
from ..core import types as _types
from ..core.comms import check_comm
from ..core.types import Call, Msg
from ..engine import run as _run
from ..engine import select as _select
from . import derived as _derived

# -- checks both APIs share ---------------------------------------------------------


def check_flags(deterministic, accumulate) -> None:
    """TypeError unless both numerics flags are None or a bool."""
    for name, value in (("deterministic", deterministic), ("accumulate", accumulate)):
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"{name}: expected True, False or None, got {type(value).__name__}")


def check_comm_options(algorithm, deterministic, accumulate) -> None:
    """``mpicoll.Comm(comm, algorithm, deterministic, accumulate)``'s own arguments: the
    algorithm of at least one collective (it is forced where it exists)."""
    if not any(algorithm == "auto" or algorithm in table for table in _select.ALGORITHMS.values()):
        _select.check_algorithm("allreduce", algorithm)
    check_flags(deterministic, accumulate)


def forced(comm, collective, algorithm):
    """``"auto"`` on an ``mpicoll.Comm`` made with ``algorithm=``: that algorithm, where it
    exists for the collective; otherwise ``algorithm``."""
    if algorithm == "auto":
        algo = getattr(comm, "_algorithm", "auto")
        if algo in _select.ALGORITHMS[collective]:
            return algo
    return algorithm


def check_op_applies(op, dtype, category, typename) -> None:
    """TypeError when ``op`` cannot reduce this data type: a predefined op outside its
    categories, or a user op on an ml_dtypes type (MPI has no datatype for it)."""
    _types.check_op_applies(op, category, typename)
    if _types.is_ml_type(dtype) and _types.op_name(op) is None:
        raise TypeError(f"op: a user-defined MPI.Op cannot be applied to {dtype} "
                        f"(MPI has no datatype for it); use a predefined op")


def check_apart(backend, a, b, argname, other, instead) -> None:
    """ValueError when arrays ``a`` (argument ``argname``) and ``b`` (argument ``other``)
    share memory: the one overlap test (:func:`overlaps`).  ``instead``: what to pass for
    the in-place form."""
    if overlaps(backend, a, b):
        raise ValueError(f"{argname}: expected memory apart from {other} (or {instead}), "
                         f"got an overlap")


# -- the array functions ------------------------------------------------------------


def _comm(comm):
    return check_comm(MPI.COMM_WORLD if comm is None else comm)


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _new_out(backend, x, shape):
    return backend.empty(_prod(shape), x.dtype).reshape(shape)


def _fortran(a) -> bool:
    """Whether an array is Fortran-ordered and not also C-ordered."""
    return a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous


def _rows(x):
    """(leading-dimension length, elements per row) of an array (0-d: one row of one)."""
    if x.ndim == 0:
        return 1, 1
    return x.shape[0], _prod(x.shape[1:])


def _out_arg(out, backend, x):
    """(backend, array, in place) of an ``out=`` argument; in place when it is ``x``'s memory
    exactly (the memory, not the object: a ``memoryview`` of ``x``'s ``bytearray`` too)."""
    obackend, arr = array_arg(out, "out")
    return obackend, arr, obackend is backend and same_memory(x, arr)


def _check_out(converted, backend, x, shape, what):
    """(out array, in place) for an ``out=`` argument converted by :func:`_out_arg`.

    Any overlap with ``x`` other than exactly its memory is a ValueError.
    """
    obackend, out, in_place = converted
    check_writable(out, "out", f"a writable array for an in-place {what}" if in_place else
                   "a writable buffer")
    if in_place:
        return out, True
    if obackend is not backend:
        raise TypeError(f"out: expected a {backend.name} array like x, got a {obackend.name} array")
    if out.dtype != x.dtype:
        raise TypeError(f"out: expected dtype {x.dtype} like x, got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    check_apart(backend, out, x, "out", "x", f"out=x, the same memory, for an in-place {what}")
    return out, False


def _c_order(backend, a, fill=True):
    """``a`` itself if C-contiguous, else a new C-ordered array (a copy of ``a`` if ``fill``).

    The algorithms see an array's elements in memory order; a C-ordered array
    puts them in logical order, which is the order the ranks agree on.
    """
    if a.flags.c_contiguous:
        return a
    tmp = _new_out(backend, a, tuple(a.shape))
    if fill:
        backend.copy(tmp, a)
    return tmp


def _copier(backend, dst, src):
    return lambda: backend.copy(dst, src)


def _logical(backend, x, out, held):
    """(send message or None in place, receive message, copy-back or None): ``x`` and
    ``out`` as C-ordered arrays, copies where a layout is not (``out`` copied back after).
    ``held``: in place, the array that holds the input (None: out of place)."""
    if held is not None:
        work = _c_order(backend, held)
        smsg = None
    else:
        work = _c_order(backend, out, fill=False)
        smsg = msg_of_array(_c_order(backend, x), backend)
    after = None if work is out else _copier(backend, out, work)
    return smsg, msg_of_array(work, backend), after


def allreduce(x, op=MPI.SUM, comm=None, out=None, algorithm="auto", timeout=None,
              deterministic=None, accumulate=None):
    """(call, result, after) of an allreduce."""
    comm = _comm(comm)
    timeout = _config.check_value("timeout", timeout)
    check_flags(deterministic, accumulate)
    _types.check_op(op)
    _select.check_algorithm("allreduce", algorithm)
    algorithm = forced(comm, "allreduce", algorithm)
    backend, x = array_arg(x, "x")
    if out is None:
        # same memory order as x (C unless x is Fortran-ordered)
        out = _new_out(backend, x, x.shape[::-1]).T if _fortran(x) else _new_out(backend, x, x.shape)
        in_place = False
    else:
        out, in_place = _check_out(_out_arg(out, backend, x), backend, x, x.shape, "allreduce")
    category, _, typename = dtype_info(x.dtype)
    check_op_applies(op, x.dtype, category, typename)
    # every rank reduces its elements in logical (C) order, whatever its layout
    smsg, rmsg, after = _logical(backend, x, out, x if in_place else None)
    return (Call("allreduce", comm, smsg, rmsg, None, None, op, algorithm, timeout,
                 deterministic, accumulate), out, after)


def allgather(x, comm=None, out=None, counts=None, algorithm="auto", timeout=None):
    """(call, result, after) of an allgather."""
    comm = _comm(comm)
    timeout = _config.check_value("timeout", timeout)
    _select.check_algorithm("allgather", algorithm)
    algorithm = forced(comm, "allgather", algorithm)
    size, rank = comm.Get_size(), comm.Get_rank()
    backend, x = array_arg(x, "x")
    converted = None if out is None else _out_arg(out, backend, x)  # converted once
    in_place = converted is not None and converted[2]
    xrows, rowsize = _rows(x)
    trailing = tuple(x.shape[1:])
    if counts is None:
        if in_place:
            if xrows % size:
                raise ValueError(f"x: expected a row count divisible by {size} ranks for an "
                                 f"in-place allgather, got {xrows}")
            counts = (xrows // size,) * size
        else:
            counts = (xrows,) * size
    else:
        counts = as_counts(counts, size, "counts")
        if not in_place and counts[rank] != xrows:
            raise ValueError(f"counts: expected counts[{rank}] = {xrows} (the rows of x), "
                             f"got {counts[rank]}")
    total = sum(counts)
    shape = (total,) + trailing if x.ndim else (total,)
    if out is None:
        out = _new_out(backend, x, shape)
    else:
        out, in_place = _check_out(converted, backend, x, shape, "allgather")
        if in_place and tuple(x.shape) != shape:
            raise ValueError(f"out: expected shape {shape} for an in-place allgather, got {tuple(x.shape)}")
    ecounts = [c * rowsize for c in counts]
    edispls = offsets(ecounts)[:-1]
    # rows in logical (C) order on every rank, whatever its layout
    smsg, rmsg, after = _logical(backend, x, out, out if in_place else None)
    return (Call("allgather", comm, smsg, rmsg, tuple(ecounts), tuple(edispls), None,
                 algorithm, timeout), out, after)


def reduce_scatter(x, op=MPI.SUM, comm=None, out=None, counts=None, algorithm="auto",
                   timeout=None, deterministic=None, accumulate=None):
    """(call, result, after) of a reduce_scatter."""
    comm = _comm(comm)
    timeout = _config.check_value("timeout", timeout)
    check_flags(deterministic, accumulate)
    _types.check_op(op)
    _select.check_algorithm("reduce_scatter", algorithm)
    algorithm = forced(comm, "reduce_scatter", algorithm)
    size, rank = comm.Get_size(), comm.Get_rank()
    backend, x = array_arg(x, "x")
    if x.ndim == 0:
        raise ValueError("x: expected an array with at least one dimension, got a 0-d array")
    xrows, rowsize = _rows(x)
    if counts is None:
        counts = tuple(split(xrows, size)[0])
    else:
        counts = as_counts(counts, size, "counts")
        if sum(counts) != xrows:
            raise ValueError(f"counts: expected a sum of {xrows} (the rows of x), "
                             f"got sum(counts) = {sum(counts)}")
    shape = (counts[rank],) + tuple(x.shape[1:])
    category, _, typename = dtype_info(x.dtype)
    check_op_applies(op, x.dtype, category, typename)
    if out is None:
        result, in_place = _new_out(backend, x, shape), False
    else:
        result, in_place = _check_out(_out_arg(out, backend, x), backend, x, shape, "reduce_scatter")
    ecounts = tuple(c * rowsize for c in counts)
    edispls = tuple(offsets(ecounts)[:-1])
    # rows in logical (C) order on every rank, whatever its layout
    src = _c_order(backend, x)
    if in_place:
        # the input is the whole of x; the result goes to its first rows
        result = x[: counts[rank]]
        after = None if src is x else _copier(backend, result, src[: counts[rank]])
        return (Call("reduce_scatter", comm, None, msg_of_array(src, backend), ecounts, edispls,
                     op, algorithm, timeout, deterministic, accumulate), result, after)
    work = _c_order(backend, result, fill=False)
    after = None if work is result else _copier(backend, result, work)
    return (Call("reduce_scatter", comm, msg_of_array(src, backend), msg_of_array(work, backend),
                 ecounts, edispls, op, algorithm, timeout, deterministic, accumulate),
            result, after)


# -- mpicoll.Comm's methods (``comm`` is the mpicoll.Comm) ----------------------------------


def _check_no_overlap(smsg, rmsg):
    if smsg.backend is rmsg.backend:
        check_apart(smsg.backend, smsg.array, rmsg.array, "sendbuf", "recvbuf",
                    "MPI.IN_PLACE as sendbuf for the in-place form")


def _send(sendbuf, rmsg, count=None, shown=None, what="receive count", blocks=0, op=None):
    """The send message of a call not in place, checked against the receive message: one
    type, ``count`` elements (None: checked elsewhere; the message shows ``shown``, default
    ``count``, as the ``what``), no memory shared.  ``op``: the reduction's (message)."""
    smsg = message(sendbuf, "sendbuf", writable=False, blocks=blocks, op=op)
    check_same_type(smsg, rmsg)
    if count is not None and smsg.count != count:
        raise ValueError(f"mismatch in send count {smsg.count} and {what} "
                         f"{count if shown is None else shown}")
    _check_no_overlap(smsg, rmsg)
    return smsg


def _blocks(per, size):
    """(counts, displs) of ``size`` blocks of ``per`` elements end to end."""
    counts = (per,) * size
    return counts, tuple(offsets(counts)[:-1])


def _comm_call(comm, collective, smsg, rmsg, counts=None, displs=None, op=None) -> Call:
    """The Call of an ``mpicoll.Comm`` method: its forced algorithm and numerics flags."""
    det, acc = getattr(comm, "_numerics", (None, None))
    return Call(collective, comm, smsg, rmsg, counts, displs, op,
                forced(comm, collective, "auto"), None, det, acc)


def Allreduce(comm, sendbuf, recvbuf, op=MPI.SUM):
    """The Call of ``comm.Allreduce(sendbuf, recvbuf, op)``."""
    _types.check_op(op)
    rmsg = message(recvbuf, "recvbuf", writable=True, op=op)
    smsg = None
    if not is_in_place(sendbuf):
        smsg = _send(sendbuf, rmsg, rmsg.count, op=op)
    check_op_applies(op, rmsg.dtype, rmsg.category, rmsg.typename)
    return _comm_call(comm, "allreduce", smsg, rmsg, op=op)


def Allgather(comm, sendbuf, recvbuf):
    """The Call of ``comm.Allgather(sendbuf, recvbuf)``."""
    size = comm.Get_size()
    rmsg = message(recvbuf, "recvbuf", writable=True, blocks=size)
    per = rmsg.count // size
    smsg = None
    if not is_in_place(sendbuf):
        smsg = _send(sendbuf, rmsg, per, per * size)
    counts, displs = _blocks(per, size)
    return _comm_call(comm, "allgather", smsg, rmsg, counts, displs)


def Allgatherv(comm, sendbuf, recvbuf):
    """The Call of ``comm.Allgatherv(sendbuf, recvbuf)``."""
    size, rank = comm.Get_size(), comm.Get_rank()
    rmsg = message(recvbuf, "recvbuf", writable=True, blocks=size, vector=True)
    smsg = None
    if not is_in_place(sendbuf):
        smsg = _send(sendbuf, rmsg, rmsg.counts[rank], what=f"receive count counts[{rank}]")
    if rmsg.layout is None:
        _check_disjoint_blocks(rmsg.counts, rmsg.displs)
    else:  # (the blocks as given, in elements of the datatype: packed ones never overlap)
        layout = rmsg.layout
        _check_disjoint_blocks([c for _, c in layout.segments],
                               [offset // layout.extent for offset, _ in layout.segments])
    return _comm_call(comm, "allgather", smsg, rmsg, tuple(rmsg.counts), tuple(rmsg.displs))


def Reduce_scatter_block(comm, sendbuf, recvbuf, op=MPI.SUM):
    """The Call of ``comm.Reduce_scatter_block(sendbuf, recvbuf, op)``."""
    _types.check_op(op)
    size = comm.Get_size()
    if is_in_place(sendbuf):
        rmsg = message(recvbuf, "recvbuf", writable=True, blocks=size, op=op)
        per = rmsg.count // size
        smsg = None
    else:
        rmsg = message(recvbuf, "recvbuf", writable=True, op=op)
        per = rmsg.count
        # as in mpi4py, a count in the send spec is per rank (block)
        smsg = _send(sendbuf, rmsg, per * size, blocks=size, op=op)
    check_op_applies(op, rmsg.dtype, rmsg.category, rmsg.typename)
    counts, displs = _blocks(per, size)
    return _comm_call(comm, "reduce_scatter", smsg, rmsg, counts, displs, op)


def Reduce_scatter(comm, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
    """The Call of ``comm.Reduce_scatter(sendbuf, recvbuf, recvcounts, op)``.

    Without ``recvcounts`` (and not in place) this exchanges the receive counts
    (collective), and each rank's verdict on its own arguments with them, so
    every rank raises if any rank's arguments are bad (none is left waiting).
    """
    rank = comm.Get_rank()
    if recvcounts is not None or is_in_place(sendbuf):
        smsg, rmsg, counts = _reduce_scatter_local(comm, sendbuf, recvbuf, recvcounts, op)
    else:
        error = None
        try:
            smsg, rmsg, _ = _reduce_scatter_local(comm, sendbuf, recvbuf, None, op)
            mine = (rmsg.count, smsg.count, 0)
        except (TypeError, ValueError) as exc:
            error, mine = exc, (0, 0, 1)
        table = exchange(comm, mine, "reduce_scatter.recvcounts")
        if error is not None:
            raise error
        refused = [r for r, (_, _, bad) in enumerate(table) if bad]
        if refused:
            raise ValueError(
                f"Reduce_scatter: rank(s) {refused} refused their arguments (the error is "
                f"raised there); nothing was sent"
            )
        counts = tuple(rcount for rcount, _, _ in table)
        _check_rs_counts(smsg.count, rmsg.count, counts, rank)
        total = sum(counts)
        for r, (_, scount, _) in enumerate(table):
            if scount != total:
                raise ValueError(
                    f"mismatch in send count {scount} and sum(counts) {total} on rank {r}"
                )
    return _comm_call(comm, "reduce_scatter", smsg, rmsg, tuple(counts),
                      tuple(offsets(counts)[:-1]), op)


def _reduce_scatter_local(comm, sendbuf, recvbuf, recvcounts, op):
    """(smsg or None, rmsg, counts or None) of a Reduce_scatter call, checked locally."""
    _types.check_op(op)
    size, rank = comm.Get_size(), comm.Get_rank()
    rmsg = message(recvbuf, "recvbuf", writable=True, op=op)
    counts = None if recvcounts is None else as_counts(recvcounts, size, "recvcounts")
    if counts is not None and rmsg.layout is not None:  # (in the message's elements)
        counts = tuple(c * rmsg.layout.n for c in counts)
    smsg = None
    if is_in_place(sendbuf):
        if counts is None:
            raise ValueError("recvcounts: expected one count per rank when sendbuf is "
                             "MPI.IN_PLACE, got None")
        if rmsg.count != sum(counts):
            raise ValueError(
                f"mismatch in receive count {rmsg.count} and sum(counts) {sum(counts)}"
            )
    else:
        smsg = _send(sendbuf, rmsg, op=op)
        if counts is not None:
            _check_rs_counts(smsg.count, rmsg.count, counts, rank)
    check_op_applies(op, rmsg.dtype, rmsg.category, rmsg.typename)
    return smsg, rmsg, counts


def exchange(comm, values, label):
    """Every rank's tuple of ints ``values`` (metadata, one allgather on mpicoll's channel)."""
    size, k = comm.Get_size(), len(values)
    out = np.zeros(size * k, dtype=np.int64)
    mine = np.array(values, dtype=np.int64)
    _run.run(Call("allgather", comm, msg_of_array(mine, NUMPY), msg_of_array(out, NUMPY),
                  (k,) * size, tuple(offsets([k] * size)[:-1]), label=label))
    return [tuple(int(v) for v in out[k * r:k * r + k]) for r in range(size)]


def _check_rs_counts(scount, rcount, counts, rank):
    if scount != sum(counts):
        raise ValueError(f"mismatch in send count {scount} and sum(counts) {sum(counts)}")
    if rcount != counts[rank]:
        raise ValueError(f"mismatch in receive count {rcount} and counts[{rank}] {counts[rank]}")


def _check_disjoint_blocks(counts, displs):
    """ValueError when two ranks' blocks of one receive buffer overlap (index ranges, one
    buffer: not a question of two arrays' memory, which check_apart answers)."""
    spans = sorted((d, d + c) for c, d in zip(counts, displs) if c)
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        if b0 < a1:
            raise ValueError(
                f"recvbuf: expected displacements that give every rank its own region, got "
                f"blocks that overlap (elements {a0}..{a1 - 1} and {b0}..{b1 - 1})"
            )


# --- buffer arguments: mpi4py message specs and arrays -------------------------------------
#
# Buffer arguments: mpi4py message specs and arrays -> one normalised form.
#
# A :class:`Msg` is what the algorithms need: a 1-D array view of the data in
# its backend (NumPy or a device backend), the element dtype, its category for
# op checks, the MPI datatype that carries it, and a printable type name.
#
# Accepted specs are mpi4py's, with mpi4py's meaning (see :func:`message`):
# a buffer-protocol, DLPack or CUDA-array object, or ``[buf, count, displ,
# datatype]`` with any of count, displ, datatype left out or None, count and
# displ also as a ``(count, displ)`` pair; ``Allgatherv``'s receive spec takes
# per-rank counts and displacements there.  ``[None, datatype]`` is an empty
# message; ``MPI.IN_PLACE`` / ``None`` as sendbuf means in place where the
# collective allows it.

def is_in_place(obj) -> bool:
    return obj is None or obj is MPI.IN_PLACE


def _check_layout(arr, argname, writable):
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise ValueError(
            f"{argname}: expected a contiguous buffer, got a non-contiguous array "
            f"with shape {tuple(arr.shape)} and strides {tuple(arr.strides)}"
        )
    if writable:
        check_writable(arr, argname)


def check_writable(arr, argname, expected="a writable buffer") -> None:
    """ValueError naming ``argname`` when ``arr`` is read-only."""
    if not is_writable(arr):
        raise ValueError(f"{argname}: expected {expected}, got a read-only one")


def is_writable(arr) -> bool:
    """False for read-only arrays (CuPy arrays have no such flag: always writable)."""
    return getattr(arr.flags, "writeable", True)


def _flat(arr):
    """1-D view in memory order of a contiguous array."""
    if arr.ndim == 1:
        return arr
    return arr.reshape(-1, order="A" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C")


def _to_array(obj, argname):
    """(backend, array) for a data object, without copying."""
    backend = _registry.backend_of(obj)
    if backend is None:
        raise TypeError(
            f"{argname}: got a device array ({type(obj).__name__}) but no device backend "
            f"is available; install CuPy (pip install 'mpicoll[cuda12]' or 'mpicoll[cuda13]')"
        )
    try:
        return backend, backend.asarray(obj)
    except TypeError as exc:
        detail = f" ({exc})" if str(exc) else ""
        raise TypeError(
            f"{argname}: expected a buffer (buffer protocol, DLPack or CUDA array interface), "
            f"got {type(obj).__name__}{detail}"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{argname}: {exc}") from None


# Python objects that cannot be the data of a message (they hold no buffer).
_NOT_DATA = (bool, int, float, complex, str, list, tuple, dict)


def _as_datatype(obj, argname):
    if isinstance(obj, MPI.Datatype):
        return obj
    if isinstance(obj, str):
        try:
            return _types.datatype_of_typecode(obj)
        except (KeyError, TypeError, ValueError):
            raise TypeError(f"{argname}: unknown typecode {obj!r}") from None
    raise TypeError(
        f"{argname}: expected an MPI.Datatype or a typecode string as the datatype, "
        f"got {type(obj).__name__}"
    )


def _as_count(obj, argname, what="count"):
    if isinstance(obj, bool) or not isinstance(obj, (int, np.integer)):
        raise TypeError(f"{argname}: expected an integer {what}, got {type(obj).__name__}")
    if obj < 0:
        raise ValueError(f"{argname}: expected a non-negative {what}, got {int(obj)}")
    return int(obj)


def as_counts(obj, size, argname, what="count"):
    """A tuple of ``size`` non-negative ints."""
    if isinstance(obj, (str, bytes)) or not hasattr(obj, "__len__"):
        raise TypeError(f"{argname}: expected a sequence of {size} integers, got {type(obj).__name__}")
    if len(obj) != size:
        raise ValueError(f"{argname}: expected {size} entries (one per rank), got {len(obj)}")
    return tuple(_as_count(c, argname, what) for c in obj)


# --- mpi4py message specs ------------------------------------------------------------
# The grammar is mpi4py's (src/mpi4py/MPI.src/msgbuffer.pxi, message_simple and
# message_vector), item for item, so every spec mpi4py accepts means the same here:
#
#   buf                                  a buffer (buffer protocol, DLPack, CUDA array)
#   [buf, T]                             T an MPI.Datatype or a typecode string
#   [buf, count]  [buf, (count, displ)]  no T: the buffer's own type
#   [buf, count, T]  [buf, (count, displ), T]
#   [buf, count, displ, T]
#
# count, displ and T may each be None (inferred).  In the vector form (Allgatherv's
# recvbuf) count is counts and displ displs: an integer (the same count for every
# rank; displs: a stride), a sequence of one per rank, or None (counts: the buffer
# split as evenly as possible; displs: packed); only a *tuple* is read as
# (counts, displs), a list is the counts.  Unlike mpi4py (which leaves it to MPI),
# every count and displacement is checked against the buffer.  One extension: a
# vector spec [buf, counts, displs] (three items, no datatype) is read as such.


def _has_buffer(obj) -> bool:
    """Whether ``obj`` exposes the buffer protocol (checked first, as mpi4py does)."""
    if isinstance(obj, (np.ndarray, bytes, bytearray, memoryview)):
        return True
    if isinstance(obj, (list, tuple, str)) or obj is None:
        return False
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def _is_datatype(obj) -> bool:
    return isinstance(obj, (MPI.Datatype, str))


def _split_pair(obj, argname, vector):
    if len(obj) != 2:
        what = "(counts, displs)" if vector else "(count, displ)"
        raise ValueError(f"{argname}: expected {what}, got {len(obj)} items")
    return obj[0], obj[1]


def _unpack(spec, argname, vector):
    """(data, count, displ, datatype) of a spec, as mpi4py unpacks it (None: not given)."""
    if _has_buffer(spec):
        return spec, None, None, None
    if isinstance(spec, (list, tuple)):
        if spec and isinstance(spec[0], _NOT_DATA):
            # a list of numbers is not a message: its first item must hold the data
            raise TypeError(
                f"{argname}: expected a buffer or a [buffer, ...] message, got a "
                f"{type(spec).__name__} of {type(spec[0]).__name__}"
            )
        pair = tuple if vector else (list, tuple)
        count = displ = datatype = None
        if len(spec) == 2:
            data, count = spec
            if _is_datatype(count):
                count, datatype = None, count
            elif isinstance(count, pair):
                count, displ = _split_pair(count, argname, vector)
        elif len(spec) == 3:
            data, count, datatype = spec
            if isinstance(count, pair):
                count, displ = _split_pair(count, argname, vector)
            elif vector and not (_is_datatype(datatype) or datatype is None):
                # mpicoll's extension, kept: [buf, counts, displs] (mpi4py refuses it)
                displ, datatype = datatype, None
        elif len(spec) == 4:
            data, count, displ, datatype = spec
        else:
            raise ValueError(
                f"{argname}: expected a buffer or a list/tuple of 2 to 4 items "
                f"[data, count, displ, datatype], got {len(spec)} item(s)"
            )
        return data, count, displ, datatype
    if hasattr(spec, "__dlpack__") or hasattr(spec, "__cuda_array_interface__"):
        return spec, None, None, None
    raise TypeError(
        f"{argname}: expected a buffer (buffer protocol, DLPack or CUDA array interface) "
        f"or a [buffer, ...] list/tuple, got {type(spec).__name__}"
    )


def _region(avail, count, displ, blocks, argname):
    """(start, elements, per block) of a simple spec over ``avail`` elements."""
    displ = 0 if displ is None else _as_count(displ, argname, "displacement")
    if count is None and displ > avail:
        raise ValueError(f"{argname}: displacement {displ} exceeds the buffer's {avail} elements")
    if count is None:
        left = avail - displ
        if blocks > 1 and left % blocks:
            raise ValueError(
                f"{argname}: holds {left} elements, not a multiple of the {blocks} ranks"
            )
        per = left // max(blocks, 1)
    else:
        per = _as_count(count, argname)
    total = per * max(blocks, 1)
    if displ + total > avail:
        ranks = f" ({per} per rank, {blocks} ranks)" if blocks > 1 else ""
        raise ValueError(
            f"{argname}: count {per} at displacement {displ} exceeds the buffer's "
            f"{avail} elements{ranks}"
        )
    return displ, total


def _filled(counts, displs, blocks, argname, avail):
    """(counts, displs) tuples of a vector spec as mpi4py fills them in; ``avail()``: the
    elements the buffer holds, read only where the counts are left out."""
    if counts is None:
        n = avail()
        counts = tuple(n // blocks + (n % blocks > i) for i in range(blocks))
    elif isinstance(counts, (int, np.integer)) and not isinstance(counts, bool):
        counts = (_as_count(counts, argname),) * blocks
    else:
        counts = as_counts(counts, blocks, argname)
    if displs is None:
        displs = tuple(offsets(counts)[:-1])
    elif isinstance(displs, (int, np.integer)) and not isinstance(displs, bool):
        stride = _as_count(displs, argname, "displacement")
        displs = tuple(stride * i for i in range(blocks))
    else:
        displs = as_counts(displs, blocks, argname, "displacement")
    return counts, displs


def _vector_layout(avail, counts, displs, blocks, argname):
    """(counts, displs) tuples of a vector spec, as mpi4py fills them in."""
    counts, displs = _filled(counts, displs, blocks, argname, lambda: avail)
    need = max((d + c for c, d in zip(counts, displs)), default=0)
    if need > avail:
        raise ValueError(
            f"{argname}: counts {list(counts)} at displacements {list(displs)} need "
            f"{need} elements, the buffer holds {avail}"
        )
    return counts, displs


def message(spec, argname, *, writable, blocks=0, vector=False, op=None) -> Msg:
    """Normalise one mpi4py-style buffer argument (not IN_PLACE).

    ``blocks``: the number of equal blocks the buffer holds (a block collective's
    ``recvbuf``): an inferred count is the buffer's elements over ``blocks``, a
    given count is per block, and the message covers ``count * blocks``
    elements.  ``vector``: ``Allgatherv``'s receive spec (``blocks`` ranks), whose
    Msg is the whole buffer with ``counts`` and ``displs``.  ``op``: the call's
    reduction (None: none); a derived datatype's message depends on it
    (:func:`derived_message`).
    """
    if spec is MPI.IN_PLACE or spec is MPI.BOTTOM:
        name = "MPI.IN_PLACE" if spec is MPI.IN_PLACE else "MPI.BOTTOM"
        raise ValueError(f"{argname}: expected a buffer, got {name} (only sendbuf may be MPI.IN_PLACE)")
    data, count, displ, datatype = _unpack(spec, argname, vector)
    if datatype is not None:
        datatype = _as_datatype(datatype, argname)
        if _derived.is_derived(datatype):
            return derived_message(data, count, displ, datatype, argname, writable, blocks,
                                   vector, op)

    if data is None:
        if datatype is None:
            raise TypeError(f"{argname}: an empty message [None, datatype] needs a datatype")
        dtype, category = _types.dtype_of_datatype(datatype)
        backend = _backend.NUMPY
        arr = np.empty(0, dtype=dtype)
    else:
        backend, arr = _to_array(data, argname)
        _check_layout(arr, argname, writable)
        if datatype is None and _dlpack.is_raw(arr):
            datatype = MPI.BYTE  # a DLPack type mpi4py moves as bytes (bfloat16, lanes, ...)
        if datatype is None:
            dtype = arr.dtype
            try:
                category = dtype_info(dtype)[0]
            except TypeError as exc:
                raise TypeError(f"{argname}: {exc}") from None
        else:
            dtype, category = _types.dtype_of_datatype(datatype)
            supports = getattr(backend, "supports", None)
            if supports is not None and not supports(dtype):
                raise TypeError(
                    f"{argname}: {_types.datatype_name(datatype)} cannot be used with a "
                    f"{backend.name} (device) buffer; use a host (NumPy) buffer for it"
                )
            raw = _flat(arr).view(np.uint8) if arr.dtype.itemsize else _flat(arr)
            if raw.size % dtype.itemsize:
                raise ValueError(
                    f"{argname}: buffer length {raw.size} is not a multiple of "
                    f"datatype extent {dtype.itemsize}"
                )
            arr = raw.view(dtype)
        arr = _flat(arr)

    if datatype is not None and category != "pair":
        mpitype = _types.wire_type(dtype) or datatype
        typename = _types.datatype_name(datatype)
        optype = datatype
    elif datatype is not None:
        mpitype = optype = datatype
        typename = _types.datatype_name(datatype)
    else:
        mpitype, typename = dtype_info(dtype)[1:]
        optype = _types.natural_type(dtype)

    avail = len(arr)
    if vector:
        counts, displs = _vector_layout(avail, count, displ, blocks, argname)
        return Msg(arr, dtype, category, mpitype, typename, backend, counts, displs, optype)
    if data is None and count is not None and _as_count(count, argname):
        raise ValueError(f"{argname}: got no data but a count of {count}")
    start, total = _region(avail, count, displ, blocks, argname)
    if start or total != avail:
        arr = arr[start:start + total]
    return Msg(arr, dtype, category, mpitype, typename, backend, optype=optype)


def derived_message(data, count, displ, datatype, argname, writable, blocks, vector, op) -> Msg:
    """:func:`message` of a spec whose datatype is derived (api.derived).

    Counts and displacements are in elements of the datatype and displacements
    count its extent, as in mpi4py; an inferred count is the buffer's length over
    the extent.  Unlike mpi4py (which leaves it to MPI), the bytes every element
    reaches must lie in the buffer.  Raises api.derived.Delegate where MPI runs
    the call.
    """
    info = _derived.decode(datatype)
    if data is None:
        backend, arr = NUMPY, np.empty(0, np.uint8)
    else:
        backend, arr = _to_array(data, argname)
        _check_layout(arr, argname, writable)
    _derived.check_runs(info, backend)
    raw = _flat(arr)
    if raw.dtype.itemsize:
        raw = raw.view(np.uint8)  # (the buffer's bytes: the datatype says what they hold)
    extent, nbytes = info.extent, len(raw)
    if vector:
        counts, displs = _derived_vector(nbytes, count, displ, blocks, extent, argname)
        segments = [(d * extent, c) for c, d in zip(counts, displs)]
    else:
        start = 0 if displ is None else _as_count(displ, argname, "displacement") * extent
        if start > nbytes:
            raise ValueError(f"{argname}: displacement {start // extent} exceeds the buffer's "
                             f"{nbytes // extent} elements of extent {extent}")
        if count is None:
            left = _derived_elements(nbytes - start, extent, argname)
            if blocks > 1 and left % blocks:
                raise ValueError(f"{argname}: holds {left} elements, not a multiple of the "
                                 f"{blocks} ranks")
            per = left // max(blocks, 1)
        else:
            per = _as_count(count, argname)
            if data is None and per:
                raise ValueError(f"{argname}: got no data but a count of {count}")
        segments = [(start, per * max(blocks, 1))]
    for offset, c in segments:
        _derived.check_bounds(info, nbytes, offset, c, argname)
    return _derived.message(info, datatype, raw, backend, segments, vector, op)


def _derived_elements(nbytes, extent, argname) -> int:
    """Elements of a datatype of ``extent`` in ``nbytes`` (ValueError unless a multiple)."""
    if nbytes % extent:
        raise ValueError(f"{argname}: buffer length {nbytes} is not a multiple of datatype "
                         f"extent {extent}")
    return nbytes // extent


def _derived_vector(nbytes, counts, displs, blocks, extent, argname):
    """(counts, displs) of a vector spec in elements of a derived datatype, as mpi4py fills
    them in (checked against the buffer by the caller, byte by byte)."""
    return _filled(counts, displs, blocks, argname,
                   lambda: _derived_elements(nbytes, extent, argname))


def count_of(spec, argname) -> int:
    """The element count of a simple spec as mpi4py reads it (given, or the buffer's length
    from the displacement over the datatype's extent): what a call MPI runs receives
    (api.delegate)."""
    data, count, displ, datatype = _unpack(spec, argname, False)
    if count is not None:
        return _as_count(count, argname)
    if data is None:
        return 0
    arr = _to_array(data, argname)[1]
    extent = arr.dtype.itemsize if datatype is None else \
        _as_datatype(datatype, argname).Get_extent()[1]
    start = (0 if displ is None else _as_count(displ, argname, "displacement")) * extent
    return max(arr.nbytes - start, 0) // max(extent, 1)


def check_same_type(smsg: Msg, rmsg: Msg) -> None:
    """TypeError unless send and receive messages have one datatype and backend."""
    if smsg.dtype != rmsg.dtype or smsg.category != rmsg.category:
        raise TypeError(
            f"mismatch in send and receive MPI datatypes: sendbuf holds {smsg.typename}, "
            f"recvbuf holds {rmsg.typename}"
        )
    if smsg.backend is not rmsg.backend:
        raise TypeError(
            f"mismatch in send and receive buffer kinds: sendbuf is a {smsg.backend.name} "
            f"buffer, recvbuf is a {rmsg.backend.name} buffer"
        )


def array_arg(x, argname):
    """(backend, array) for an array-function argument, of any memory layout.

    The array functions work in logical (C) element order whatever the
    layout, so unlike a message buffer the array need not be contiguous.
    """
    if isinstance(x, (list, tuple, int, float, complex, bool)) or x is None:
        raise TypeError(f"{argname}: expected an array, got {type(x).__name__}")
    backend, arr = _to_array(x, argname)
    if _dlpack.is_raw(arr):
        raise TypeError(f"{argname}: expected an array of a NumPy dtype, got a DLPack tensor "
                        f"of type {_dlpack.raw_type(arr)}")
    try:
        dtype_info(arr.dtype)
    except TypeError as exc:
        raise TypeError(f"{argname}: {exc}") from None
    return backend, arr


def _memory(a):
    """(address, shape, strides, type) of an array's elements: equal for views of the same ones."""
    iface = getattr(a, "__array_interface__", None)
    if iface is None:
        iface = a.__cuda_array_interface__
    shape = tuple(iface["shape"])
    strides = iface.get("strides")
    if strides is None:  # C-contiguous
        strides, step = [], a.dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        strides = strides[::-1]
    return iface["data"][0], shape, tuple(strides), iface["typestr"]


def same_memory(a, b) -> bool:
    """Whether two arrays (one backend) view exactly the same elements the same way.

    This, not object identity, is what makes a call in place: ``out`` may be
    another object over ``x``'s memory (a ``memoryview`` of a ``bytearray``,
    the same array converted twice).
    """
    if a is b:
        return True
    return _memory(a) == _memory(b)


def overlaps(backend, a, b) -> bool:
    """Whether two arrays of ``backend`` share any element (exactly, for NumPy)."""
    if not (a.size and b.size):
        return False
    if backend is _backend.NUMPY:
        return bool(np.shares_memory(a, b))
    return bool(backend.may_share_memory(a, b))


_DTYPE_INFO: dict = {}


def dtype_info(dtype):
    """(category, wire datatype, name) of a NumPy dtype MPI can carry; TypeError otherwise.

    Cached per dtype: every call that is not a repeat validates its buffers' dtypes, and the
    three lookups give the same answer for every call of one dtype.
    """
    info = _DTYPE_INFO.get(dtype)
    if info is None:
        info = (_types.category_of_dtype(dtype), _types.wire_type(dtype), str(dtype))
        _DTYPE_INFO[dtype] = info
    return info


def msg_of_array(arr, backend) -> Msg:
    """A Msg over an already checked array (all its elements, memory order)."""
    dtype = arr.dtype
    category, mpitype, typename = dtype_info(dtype)
    return Msg(_flat(arr), dtype, category, mpitype, typename, backend,
               optype=_types.natural_type(dtype))
