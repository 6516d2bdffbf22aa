"""Every argument check of the array functions and of ``mpicoll.Comm``'s methods.

One function per entry point turns its arguments into one
:class:`~mpicoll.core.message.Call` (or raises), the record the engine runs
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
(:func:`check_apart`, on buffers.overlaps), the numerics flags, the forced
algorithm of an ``mpicoll.Comm``.  Every error is raised before any message is
sent and names the argument, what was expected and what was got: TypeError
for a wrong type, ValueError for a wrong value.

Only a call that is not a repeat comes here: a repeat (engine.cache) is
proven valid by the signature of what these functions read.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..algorithms.ring import split
from ..algorithms.schedule import offsets
from ..backends.host import NUMPY
from ..core import config as _config
from ..core import types as _types
from ..core.comms import check_comm
from ..core.message import Call
from ..engine import run as _run
from ..engine import select as _select
from .buffers import (
    array_arg,
    as_counts,
    check_same_type,
    check_writable,
    dtype_info,
    is_in_place,
    message,
    msg_of_array,
    overlaps,
    same_memory,
)

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
    share memory: the one overlap test (buffers.overlaps).  ``instead``: what to pass for
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


def _send(sendbuf, rmsg, count=None, shown=None, what="receive count", blocks=0):
    """The send message of a call not in place, checked against the receive message: one
    type, ``count`` elements (None: checked elsewhere; the message shows ``shown``, default
    ``count``, as the ``what``), no memory shared."""
    smsg = message(sendbuf, "sendbuf", writable=False, blocks=blocks)
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
    rmsg = message(recvbuf, "recvbuf", writable=True)
    smsg = None
    if not is_in_place(sendbuf):
        smsg = _send(sendbuf, rmsg, rmsg.count)
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
    _check_disjoint_blocks(rmsg.counts, rmsg.displs)
    return _comm_call(comm, "allgather", smsg, rmsg, tuple(rmsg.counts), tuple(rmsg.displs))


def Reduce_scatter_block(comm, sendbuf, recvbuf, op=MPI.SUM):
    """The Call of ``comm.Reduce_scatter_block(sendbuf, recvbuf, op)``."""
    _types.check_op(op)
    size = comm.Get_size()
    if is_in_place(sendbuf):
        rmsg = message(recvbuf, "recvbuf", writable=True, blocks=size)
        per = rmsg.count // size
        smsg = None
    else:
        rmsg = message(recvbuf, "recvbuf", writable=True)
        per = rmsg.count
        # as in mpi4py, a count in the send spec is per rank (block)
        smsg = _send(sendbuf, rmsg, per * size, blocks=size)
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
        table = _exchange(comm, mine, "reduce_scatter.recvcounts")
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
    rmsg = message(recvbuf, "recvbuf", writable=True)
    counts = None if recvcounts is None else as_counts(recvcounts, size, "recvcounts")
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
        smsg = _send(sendbuf, rmsg)
        if counts is not None:
            _check_rs_counts(smsg.count, rmsg.count, counts, rank)
    check_op_applies(op, rmsg.dtype, rmsg.category, rmsg.typename)
    return smsg, rmsg, counts


def _exchange(comm, values, label):
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
