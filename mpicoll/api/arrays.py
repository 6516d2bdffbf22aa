"""Array functions: ``allreduce``, ``allgather``, ``reduce_scatter`` on whole arrays.

Rules common to the three functions:

* Logical order.  Elements are combined and gathered by index, whatever the
  memory layout of ``x`` and ``out`` on each rank (C or Fortran order,
  strided views; ranks may differ).  The algorithms move C-ordered memory: a
  C-contiguous array is used as it is, any other layout through a C-ordered
  copy.
* In place by memory.  ``out`` viewing exactly the memory of ``x`` (the same
  object, another object over the same buffer) is the in-place form; an
  ``out`` overlapping ``x`` in part is a ValueError.
* One call path.  A call with ``out=`` first tries its plan (engine.plan): the
  same ``x`` and ``out`` objects (and op, algorithm) as its last plain call
  run again with no validation.  Otherwise ``_*_args`` validates and returns
  the arguments of engine.collectives.start_* (the non-blocking forms use
  the same functions), the array to return and what to do after the data
  moved (a copy back into a non-C-ordered ``out``, or None).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..algorithms.schedule import offsets
from ..core import config as _config
from ..core import types as _types
from ..core.comms import check_comm
from ..engine import collectives as _collectives
from ..engine import plan as _plan
from ..engine import select as _select
from . import numerics as _numerics
from . import requests as _requests
from .buffers import array_arg, as_counts, dtype_info, is_writable, msg_of_array, overlaps, same_memory

_WORLD = MPI.COMM_WORLD
_ndarray = np.ndarray


def _comm(comm):
    return check_comm(MPI.COMM_WORLD if comm is None else comm)


def _forced(comm, collective, algorithm):
    """``"auto"`` on an ``mpicoll.Comm`` made with ``algorithm=``: that algorithm, where it
    exists for the collective (as its own methods do)."""
    if algorithm == "auto":
        algo = getattr(comm, "_algo", None)
        if algo is not None:
            return algo(collective)
    return algorithm


def _new_out(backend, x, shape):
    return backend.empty(_prod(shape), x.dtype).reshape(shape)


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _out_arg(out, backend, x):
    """(backend, array, in place) of an ``out=`` argument; in place when it is ``x``'s memory exactly.

    ``out`` may be another object over the same memory as ``x`` (a
    ``memoryview`` of it, the same ``bytearray`` converted again): the memory,
    not the object, makes the call in place.
    """
    obackend, arr = array_arg(out, "out")
    return obackend, arr, obackend is backend and same_memory(x, arr)


def _check_out(converted, backend, x, shape, what):
    """(out array, in place) for an ``out=`` argument converted by :func:`_out_arg`.

    Any overlap with ``x`` other than exactly its memory is a ValueError.
    """
    obackend, out, in_place = converted
    if not is_writable(out):
        if in_place:
            raise ValueError(f"out: expected a writable array for an in-place {what}, got a read-only one")
        raise ValueError("out: expected a writable buffer, got a read-only one")
    if in_place:
        return out, True
    if obackend is not backend:
        raise TypeError(f"out: expected a {backend.name} array like x, got a {obackend.name} array")
    if out.dtype != x.dtype:
        raise TypeError(f"out: expected dtype {x.dtype} like x, got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"out: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    if overlaps(backend, x, out):
        raise ValueError(
            f"out: overlaps x; pass out=x (the same memory) for an in-place {what}, "
            f"or an out that does not overlap x"
        )
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


def _rows(x):
    """(leading-dimension length, elements per row) of an array (0-d: one row of one)."""
    if x.ndim == 0:
        return 1, 1
    return x.shape[0], _prod(x.shape[1:])


def allreduce(x, op=MPI.SUM, *, comm=None, out=None, algorithm="auto", timeout=None,
              deterministic=None, accumulate=None):
    """Reduce ``x`` elementwise over all ranks; every rank gets the result.

    Args:
        x: array (NumPy, CuPy, or any DLPack/buffer object) of the same shape on every
            rank, any memory layout: elements combine by index.
        op: an ``MPI.Op`` (SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR
            or a user op from ``MPI.Op.Create``).
        comm: intra-communicator (default ``MPI.COMM_WORLD``).
        out: array to write into (same shape and dtype, any layout).  ``out=x``, or
            any object over exactly ``x``'s memory, reduces in place.
        algorithm: ``"auto"``, ``"ring"`` or ``"recursive_doubling"``.
        timeout: seconds without progress before raising ``mpicoll.CollectiveTimeout``
            (default: the ``timeout`` option / ``MPICOLL_TIMEOUT``; None there: wait forever).
        deterministic: True: a floating SUM/PROD is the rank-order fold, bitwise the same
            for every algorithm and setting (default: ``MPICOLL_DETERMINISTIC``).
        accumulate: False: SUM/PROD of 16/8-bit floats keep partial results in the
            input type (default: accumulated in float32, rounded once).  See docs/numerics.md.

    Returns:
        The reduced array: ``out`` when given, else a new array in ``x``'s
        memory order (C unless ``x`` is Fortran-ordered).

    Example (4 ranks)::

        x = np.array([rank, 10 * rank])      # rank r: [r, 10r]
        y = mpicoll.allreduce(x)             # every rank: [6, 60]
    """
    plain = deterministic is None and accumulate is None  # numerics: see api.numerics
    if plain and out is not None and timeout is None and _plan.repeat(
            _WORLD if comm is None else comm, "allreduce", x, out, op, algorithm):
        return out
    key = _plan.key(x, out, op, algorithm)
    args, timeout, result, after = _allreduce_args(x, op, comm, out, algorithm, timeout)
    # -- numerics: 16/8-bit floats, deterministic mode (api.numerics) --
    _numerics.check_flags(deterministic, accumulate)
    route = _numerics.route("allreduce", args[0], args[1], args[2], args[3], args[4],
                            deterministic=deterministic, accumulate=accumulate)
    if route is not None:
        route.run(timeout)
    # -- end numerics --
    else:
        _collectives.run_allreduce(*args, timeout=timeout,
                                   memo=_memo("allreduce", key, x, out, result, after, op))
    if after is not None:
        after()
    return result


def _allreduce_args(x, op=MPI.SUM, comm=None, out=None, algorithm="auto", timeout=None):
    """((comm, smsg, rmsg, op, algorithm), timeout, result, after) of an allreduce call."""
    comm = _comm(comm)
    timeout = _config.check_value("timeout", timeout)
    _types.check_op(op)
    _select.check_algorithm("allreduce", algorithm)
    algorithm = _forced(comm, "allreduce", algorithm)
    backend, x = array_arg(x, "x")
    if out is None:
        # same memory order as x (C unless x is Fortran-ordered)
        out = _new_out(backend, x, x.shape[::-1]).T if _fortran(x) else _new_out(backend, x, x.shape)
        in_place = False
    else:
        out, in_place = _check_out(_out_arg(out, backend, x), backend, x, x.shape, "allreduce")
    category, _, typename = dtype_info(x.dtype)
    _types.check_op_applies(op, category, typename)
    # every rank reduces its elements in logical (C) order, whatever its layout
    smsg, rmsg, after = _logical(backend, x, out, x if in_place else None)
    return (comm, smsg, rmsg, op, algorithm), timeout, out, after


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


def _copier(backend, dst, src):
    return lambda: backend.copy(dst, src)


def _memo(name, key, x, out, result, after, op=None, counts=None):
    """(name, key) to keep a plain call as a plan (or its operation, non-blocking): the
    default counts, the result ``out`` itself (not, in place, a view of ``x``), C-ordered
    NumPy ``x`` and ``out`` moved as they are (no copy after) and a predefined op; else None."""
    if (counts is None and result is out and after is None and type(x) is _ndarray
            and type(out) is _ndarray and x.flags.c_contiguous
            and (op is None or _types.op_name(op) is not None)):
        return name, key
    return None


def _fortran(a) -> bool:
    """Whether an array is Fortran-ordered and not also C-ordered."""
    return a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous


def allgather(x, *, comm=None, out=None, counts=None, algorithm="auto", timeout=None):
    """Concatenate every rank's ``x`` along axis 0, in rank order, on every rank.

    Args:
        x: array of any memory layout; rank r contributes ``counts[r]`` rows (all
            rows have the same shape).  A 0-d array counts as one row of one element.
        comm: intra-communicator (default ``MPI.COMM_WORLD``).
        out: array of shape ``(sum(counts), *x.shape[1:])``, any layout, to write into.
            ``out=x`` (or another object over exactly ``x``'s memory) means in
            place: ``x`` is already the full output and holds this rank's rows
            at their place.
        counts: rows contributed by each rank (an allgatherv); default: every
            rank contributes ``len(x)`` rows.
        algorithm: ``"auto"`` or ``"ring"``.
        timeout: seconds without progress before raising ``mpicoll.CollectiveTimeout``
            (default: the ``timeout`` option / ``MPICOLL_TIMEOUT``; None there: wait forever).

    Returns:
        The gathered array (``out`` when given, else a new C-ordered array).

    Example (3 ranks)::

        x = np.full(2, rank)                 # rank r: [r, r]
        y = mpicoll.allgather(x)             # every rank: [0, 0, 1, 1, 2, 2]
    """
    if out is not None and counts is None and timeout is None and \
            _plan.repeat(_WORLD if comm is None else comm, "allgather", x, out, algorithm):
        return out
    key = _plan.key(x, out, algorithm)
    args, timeout, result, after = _allgather_args(x, comm, out, counts, algorithm, timeout)
    # -- numerics: ml_dtypes types move as words (api.numerics) --
    route = _numerics.route("allgather", args[0], args[1], args[2], None, args[5], args[3],
                            args[4])
    if route is not None:
        route.run(timeout)
    # -- end numerics --
    else:
        _collectives.run_allgather(*args, timeout=timeout,
                                   memo=_memo("allgather", key, x, out, result, after,
                                              counts=counts))
    if after is not None:
        after()
    return result


def _allgather_args(x, comm=None, out=None, counts=None, algorithm="auto", timeout=None):
    """((comm, smsg, rmsg, counts, displs, algorithm), timeout, result, after) of an allgather."""
    comm = _comm(comm)
    timeout = _config.check_value("timeout", timeout)
    _select.check_algorithm("allgather", algorithm)
    algorithm = _forced(comm, "allgather", algorithm)
    size, rank = comm.Get_size(), comm.Get_rank()
    backend, x = array_arg(x, "x")
    converted = None if out is None else _out_arg(out, backend, x)  # converted once
    in_place = converted is not None and converted[2]
    xrows, rowsize = _rows(x)
    trailing = tuple(x.shape[1:])
    if counts is None:
        if in_place:
            if xrows % size:
                raise ValueError(
                    f"x: an in-place allgather needs a row count divisible by {size} ranks, got {xrows}"
                )
            counts = (xrows // size,) * size
        else:
            counts = (xrows,) * size
    else:
        counts = as_counts(counts, size, "counts")
        if not in_place and counts[rank] != xrows:
            raise ValueError(f"counts: counts[{rank}] is {counts[rank]} but x has {xrows} rows")
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
    return (comm, smsg, rmsg, ecounts, edispls, algorithm), timeout, out, after


def reduce_scatter(x, op=MPI.SUM, *, comm=None, out=None, counts=None, algorithm="auto",
                   timeout=None, deterministic=None, accumulate=None):
    """Reduce ``x`` over all ranks and give rank r only its rows (block r along axis 0).

    Args:
        x: array with at least one dimension, the same shape on every rank, any
            memory layout.
        op: an ``MPI.Op`` as for :func:`allreduce`.
        comm: intra-communicator (default ``MPI.COMM_WORLD``).
        out: array of shape ``(counts[rank], *x.shape[1:])``, any layout.  ``out=x``
            (or another object over exactly ``x``'s memory) reduces in place: the
            result goes to ``x[:counts[rank]]``, the rest of ``x`` is left as it
            was, and that view is returned.
        counts: rows per rank; default: ``len(x)`` split as numpy.array_split
            does (the first ``len(x) % size`` ranks get one row more).
        algorithm: ``"auto"``, ``"ring"`` or ``"recursive_doubling"``.
        timeout: seconds without progress before raising ``mpicoll.CollectiveTimeout``
            (default: the ``timeout`` option / ``MPICOLL_TIMEOUT``; None there: wait forever).
        deterministic, accumulate: as for :func:`allreduce`.

    Returns:
        This rank's reduced rows (``out`` when given, else a new C-ordered array).

    Example (2 ranks)::

        x = np.arange(4) + 10 * rank         # rank 0: [0,1,2,3]  rank 1: [10,11,12,13]
        y = mpicoll.reduce_scatter(x)        # rank 0: [10, 12]    rank 1: [14, 16]
    """
    plain = deterministic is None and accumulate is None  # numerics: see api.numerics
    if plain and out is not None and counts is None and timeout is None and \
            _plan.repeat(_WORLD if comm is None else comm, "reduce_scatter", x, out, op, algorithm):
        return out
    key = _plan.key(x, out, op, algorithm)
    args, timeout, result, after = _reduce_scatter_args(x, op, comm, out, counts, algorithm,
                                                        timeout)
    # -- numerics: 16/8-bit floats, deterministic mode (api.numerics) --
    _numerics.check_flags(deterministic, accumulate)
    route = _numerics.route("reduce_scatter", args[0], args[1], args[2], args[5], args[6],
                            args[3], args[4], deterministic=deterministic, accumulate=accumulate)
    if route is not None:
        route.run(timeout)
    # -- end numerics --
    else:
        _collectives.run_reduce_scatter(*args, timeout=timeout,
                                        memo=_memo("reduce_scatter", key, x, out, result, after,
                                                   op, counts))
    if after is not None:
        after()
    return result


def _reduce_scatter_args(x, op=MPI.SUM, comm=None, out=None, counts=None, algorithm="auto",
                         timeout=None):
    """((comm, smsg, rmsg, counts, displs, op, algorithm), timeout, result, after)."""
    comm = _comm(comm)
    timeout = _config.check_value("timeout", timeout)
    _types.check_op(op)
    _select.check_algorithm("reduce_scatter", algorithm)
    algorithm = _forced(comm, "reduce_scatter", algorithm)
    size, rank = comm.Get_size(), comm.Get_rank()
    backend, x = array_arg(x, "x")
    if x.ndim == 0:
        raise ValueError("x: expected an array with at least one dimension, got a 0-d array")
    xrows, rowsize = _rows(x)
    if counts is None:
        from ..algorithms.ring import split
        counts = tuple(split(xrows, size)[0])
    else:
        counts = as_counts(counts, size, "counts")
        if sum(counts) != xrows:
            raise ValueError(f"counts: sum(counts) is {sum(counts)} but x has {xrows} rows")
    shape = (counts[rank],) + tuple(x.shape[1:])
    category, _, typename = dtype_info(x.dtype)
    _types.check_op_applies(op, category, typename)
    if out is None:
        result, in_place = _new_out(backend, x, shape), False
    else:
        result, in_place = _check_out(_out_arg(out, backend, x), backend, x, shape, "reduce_scatter")
    ecounts = [c * rowsize for c in counts]
    edispls = offsets(ecounts)[:-1]
    # rows in logical (C) order on every rank, whatever its layout
    src = _c_order(backend, x)
    if in_place:
        # the input is the whole of x; the result goes to its first rows
        result = x[: counts[rank]]
        after = None if src is x else _copier(backend, result, src[: counts[rank]])
        return ((comm, None, msg_of_array(src, backend), ecounts, edispls, op, algorithm), timeout,
                result, after)
    work = _c_order(backend, result, fill=False)
    after = None if work is result else _copier(backend, result, work)
    return ((comm, msg_of_array(src, backend), msg_of_array(work, backend), ecounts, edispls, op,
             algorithm), timeout, result, after)


# -- non-blocking forms (see mpicoll.api.requests) ------------------------------------
# The same checks as the blocking functions (the one validation path), then the
# engine's start_* function.


# A repeated call with ``out`` (the same array objects, the last handle seen complete)
# restarts the operation that call left (engine.plan.restart): no validation.


def _istart(name, start, validate, comm, x, out, op, algorithm, counts, timeout, numerics=None):
    """A handle of ``name``'s kept operation restarted (its result: ``out``), else of a new
    one started on ``validate()`` (the function's ``_*_args`` call) and kept for the call's
    repeat if plain (:func:`_memo`).  The handle keeps ``x`` and ``out`` alive until it has
    seen the operation complete.  ``numerics``: (deterministic, accumulate) (api.numerics)."""
    _requests.check_progress()
    plain = numerics is None or numerics == (None, None)
    if plain and out is not None and counts is None and timeout is None:
        operation = _plan.restart(_WORLD if comm is None else comm, name, x, out, op, algorithm)
        if operation is not None:
            return _requests.Handle(operation, _finisher(out, None), (x, out))
    key = _plan.key(x, out, op, algorithm)
    args, timeout, result, after = validate()
    # -- numerics: 16/8-bit floats, deterministic mode (api.numerics) --
    route = _istart_route(name, args, numerics)
    if route is not None:
        return _requests.Handle(route.start(timeout), _finisher(result, after, route.finish),
                                (x, out))
    # -- end numerics --
    memo = _memo(name, key, x, out, result, after, op, counts)
    return _requests.Handle(start(*args, timeout=timeout, memo=memo), _finisher(result, after),
                            (x, out))


def _istart_route(name, args, numerics):
    """The api.numerics route of a non-blocking call's validated ``args``, or None."""
    det, acc = (None, None) if numerics is None else numerics
    _numerics.check_flags(det, acc)
    if name == "iallgather":
        return _numerics.route("allgather", args[0], args[1], args[2], None, args[5], args[3],
                               args[4], one_operation=True)
    if name == "iallreduce":
        return _numerics.route("allreduce", *args[:5], deterministic=det, accumulate=acc,
                               one_operation=True)
    return _numerics.route("reduce_scatter", args[0], args[1], args[2], args[5], args[6], args[3],
                           args[4], deterministic=det, accumulate=acc, one_operation=True)


def _finisher(result, after, first=None):
    """``finish()``: the result, once ``first`` (api.numerics' rounding) and ``after`` (the
    copy out of a C-ordered work array) ran."""
    def finish():
        if first is not None:
            first()
        if after is not None:
            after()
        return result
    return finish


def iallreduce(x, op=MPI.SUM, *, comm=None, out=None, algorithm="auto", timeout=None,
               deterministic=None, accumulate=None):
    """Start an :func:`allreduce`; returns a handle whose ``wait()`` returns the result.

    The arguments are :func:`allreduce`'s.  ``x`` and ``out`` belong to the
    collective until ``wait()`` returns (or ``test()`` returns True).

    Example (2 ranks)::

        h = mpicoll.iallreduce(np.full(3, rank + 1.0))   # rank r: [r+1, r+1, r+1]
        ...                                              # other work meanwhile
        y = h.wait()                                     # every rank: [3., 3., 3.]
    """
    return _istart("iallreduce", _requests.start_allreduce,
                   lambda: _allreduce_args(x, op, comm, out, algorithm, timeout),
                   comm, x, out, op, algorithm, None, timeout, (deterministic, accumulate))


def iallgather(x, *, comm=None, out=None, counts=None, algorithm="auto", timeout=None):
    """Start an :func:`allgather` (same arguments); ``wait()`` on the handle returns the result."""
    return _istart("iallgather", _requests.start_allgather,
                   lambda: _allgather_args(x, comm, out, counts, algorithm, timeout),
                   comm, x, out, None, algorithm, counts, timeout, (None, None))


def ireduce_scatter(x, op=MPI.SUM, *, comm=None, out=None, counts=None, algorithm="auto",
                    timeout=None, deterministic=None, accumulate=None):
    """Start a :func:`reduce_scatter` (same arguments); ``wait()`` on the handle returns the result."""
    # (in-place calls are not kept: their result is a view of x; see _memo)
    return _istart("ireduce_scatter", _requests.start_reduce_scatter,
                   lambda: _reduce_scatter_args(x, op, comm, out, counts, algorithm, timeout),
                   comm, x, out, op, algorithm, counts, timeout, (deterministic, accumulate))
