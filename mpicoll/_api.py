"""Array functions: ``allreduce``, ``allgather``, ``reduce_scatter`` on whole arrays."""

from __future__ import annotations

from mpi4py import MPI

from . import _collectives, _config, _fastpath, _select, _types
from ._buffers import array_arg, as_counts, is_writable, msg_of_array
from ._context import check_comm


def _comm(comm):
    return check_comm(MPI.COMM_WORLD if comm is None else comm)


def _new_out(backend, x, shape):
    return backend.empty(_prod(shape), x.dtype).reshape(shape)


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


def _check_out(out, backend, x, shape, argname="out"):
    obackend, out = array_arg(out, argname, writable=True, c_order=True)
    if obackend is not backend:
        raise TypeError(
            f"{argname}: expected a {backend.name} array like x, got a {obackend.name} array"
        )
    if out.dtype != x.dtype:
        raise TypeError(f"{argname}: expected dtype {x.dtype} like x, got {out.dtype}")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{argname}: expected shape {tuple(shape)}, got {tuple(out.shape)}")
    return out


def _rows(x):
    """(leading-dimension length, elements per row) of an array (0-d: one row of one)."""
    if x.ndim == 0:
        return 1, 1
    return x.shape[0], _prod(x.shape[1:])


def allreduce(x, op=MPI.SUM, *, comm=None, out=None, algorithm="auto", timeout=None):
    """Reduce ``x`` elementwise over all ranks; every rank gets the result.

    Args:
        x: array (NumPy, CuPy, or any DLPack/buffer object) of the same shape on every rank.
        op: an ``MPI.Op`` (SUM, PROD, MIN, MAX, LAND, LOR, LXOR, BAND, BOR, BXOR
            or a user op from ``MPI.Op.Create``).
        comm: intra-communicator (default ``MPI.COMM_WORLD``).
        out: array to write into (same shape and dtype); ``out is x`` reduces in place.
        algorithm: ``"auto"``, ``"ring"`` or ``"recursive_doubling"``.
        timeout: seconds without progress before raising ``mpicoll.CollectiveTimeout``
            (default: the ``timeout`` option / ``MPICOLL_TIMEOUT``; None there: wait forever).

    Returns:
        The reduced array (``out`` when given).

    Example (4 ranks)::

        x = np.array([rank, 10 * rank])      # rank r: [r, 10r]
        y = mpicoll.allreduce(x)             # every rank: [6, 60]
    """
    fast = _fastpath.allreduce(comm, x, out, op, algorithm, timeout)  # plain NumPy case
    if fast is not NotImplemented:
        return fast
    comm = _comm(comm)
    timeout = _config._check_value("timeout", timeout)
    _types.check_op(op)
    _select.check_algorithm("allreduce", algorithm)
    backend, x = array_arg(x, "x")
    in_place = out is x
    if in_place:
        if not is_writable(x):
            raise ValueError("out: expected a writable array for an in-place allreduce, got a read-only one")
        out = x
    elif out is None:
        # same memory order as x: elements combine in memory order
        out = _new_out(backend, x, x.shape[::-1]).T if _fortran(x) else _new_out(backend, x, x.shape)
    else:
        out = _check_out(out, backend, x, x.shape)
    smsg = msg_of_array(x, backend)
    _types.check_op_applies(op, smsg.category, smsg.typename)
    if not in_place and x.size and backend.may_share_memory(x, out):
        raise ValueError("out: overlaps x; pass out=x to reduce in place")
    if not in_place and _fortran(x) and not _fortran(out):
        # a Fortran-ordered x into a C-ordered out: reduce a C-ordered copy of x
        xc = _new_out(backend, x, x.shape)
        backend.copy(xc, x)
        smsg = msg_of_array(xc, backend)
    rmsg = msg_of_array(out, backend)
    _collectives.run_allreduce(comm, None if in_place else smsg, rmsg, op, algorithm,
                               timeout=timeout)
    return out


def _fortran(a) -> bool:
    """Whether a contiguous array's memory order differs from C order."""
    return a.ndim > 1 and not a.flags.c_contiguous


def allgather(x, *, comm=None, out=None, counts=None, algorithm="auto", timeout=None):
    """Concatenate every rank's ``x`` along axis 0, in rank order, on every rank.

    Args:
        x: array; rank r contributes ``counts[r]`` rows (all rows have the same shape).
            A 0-d array counts as one row of one element.
        comm: intra-communicator (default ``MPI.COMM_WORLD``).
        out: array of shape ``(sum(counts), *x.shape[1:])`` to write into.
            ``out is x`` means in place: ``x`` is already the full output
            and holds this rank's rows at their place.
        counts: rows contributed by each rank (an allgatherv); default: every
            rank contributes ``len(x)`` rows.
        algorithm: ``"auto"`` or ``"ring"``.
        timeout: seconds without progress before raising ``mpicoll.CollectiveTimeout``
            (default: the ``timeout`` option / ``MPICOLL_TIMEOUT``; None there: wait forever).

    Returns:
        The gathered array.

    Example (3 ranks)::

        x = np.full(2, rank)                 # rank r: [r, r]
        y = mpicoll.allgather(x)             # every rank: [0, 0, 1, 1, 2, 2]
    """
    fast = _fastpath.allgather(comm, x, out, counts, algorithm, timeout)  # plain NumPy case
    if fast is not NotImplemented:
        return fast
    comm = _comm(comm)
    timeout = _config._check_value("timeout", timeout)
    _select.check_algorithm("allgather", algorithm)
    size, rank = comm.Get_size(), comm.Get_rank()
    backend, x = array_arg(x, "x", c_order=True)
    in_place = out is x
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
    if in_place:
        if not is_writable(x):
            raise ValueError("out: expected a writable array for an in-place allgather, got a read-only one")
        if tuple(x.shape) != shape:
            raise ValueError(f"out: expected shape {shape} for an in-place allgather, got {tuple(x.shape)}")
        out = x
    elif out is None:
        out = _new_out(backend, x, shape)
    else:
        out = _check_out(out, backend, x, shape)
        if x.size and backend.may_share_memory(x, out):
            raise ValueError("out: overlaps x; pass out=x for an in-place allgather")
    ecounts = [c * rowsize for c in counts]
    edispls = [0] * size
    for r in range(1, size):
        edispls[r] = edispls[r - 1] + ecounts[r - 1]
    rmsg = msg_of_array(out, backend)
    smsg = None if in_place else msg_of_array(x, backend)
    _collectives.run_allgather(comm, smsg, rmsg, ecounts, edispls, algorithm, timeout=timeout)
    return out


def reduce_scatter(x, op=MPI.SUM, *, comm=None, out=None, counts=None, algorithm="auto",
                   timeout=None):
    """Reduce ``x`` over all ranks and give rank r only its rows (block r along axis 0).

    Args:
        x: array with at least one dimension, the same shape on every rank.
        op: an ``MPI.Op`` as for :func:`allreduce`.
        comm: intra-communicator (default ``MPI.COMM_WORLD``).
        out: array of shape ``(counts[rank], *x.shape[1:])``.  ``out is x``
            reduces in place: the result goes to ``x[:counts[rank]]``, the rest
            of ``x`` is left as it was, and that view is returned.
        counts: rows per rank; default: ``len(x)`` split as numpy.array_split
            does (the first ``len(x) % size`` ranks get one row more).
        algorithm: ``"auto"``, ``"ring"`` or ``"recursive_doubling"``.
        timeout: seconds without progress before raising ``mpicoll.CollectiveTimeout``
            (default: the ``timeout`` option / ``MPICOLL_TIMEOUT``; None there: wait forever).

    Returns:
        This rank's reduced rows.

    Example (2 ranks)::

        x = np.arange(4) + 10 * rank         # rank 0: [0,1,2,3]  rank 1: [10,11,12,13]
        y = mpicoll.reduce_scatter(x)        # rank 0: [10, 12]    rank 1: [14, 16]
    """
    fast = _fastpath.reduce_scatter(comm, x, out, op, counts, algorithm, timeout)  # plain NumPy case
    if fast is not NotImplemented:
        return fast
    comm = _comm(comm)
    timeout = _config._check_value("timeout", timeout)
    _types.check_op(op)
    _select.check_algorithm("reduce_scatter", algorithm)
    size, rank = comm.Get_size(), comm.Get_rank()
    backend, x = array_arg(x, "x", c_order=True)
    if x.ndim == 0:
        raise ValueError("x: expected an array with at least one dimension, got a 0-d array")
    xrows, rowsize = _rows(x)
    if counts is None:
        from ._ring import split
        counts = tuple(split(xrows, size)[0])
    else:
        counts = as_counts(counts, size, "counts")
        if sum(counts) != xrows:
            raise ValueError(f"counts: sum(counts) is {sum(counts)} but x has {xrows} rows")
    shape = (counts[rank],) + tuple(x.shape[1:])
    in_place = out is x
    smsg = msg_of_array(x, backend)
    _types.check_op_applies(op, smsg.category, smsg.typename)
    if in_place:
        if not is_writable(x):
            raise ValueError(
                "out: expected a writable array for an in-place reduce_scatter, got a read-only one"
            )
        result = x[: counts[rank]]
    elif out is None:
        result = _new_out(backend, x, shape)
    else:
        result = _check_out(out, backend, x, shape)
        if result.size and x.size and backend.may_share_memory(x, result):
            raise ValueError("out: overlaps x; pass out=x to reduce in place")
    ecounts = [c * rowsize for c in counts]
    edispls = [0] * size
    for r in range(1, size):
        edispls[r] = edispls[r - 1] + ecounts[r - 1]
    if in_place:
        _collectives.run_reduce_scatter(comm, None, smsg, ecounts, edispls, op, algorithm,
                                        timeout=timeout)
    else:
        _collectives.run_reduce_scatter(comm, smsg, msg_of_array(result, backend),
                                        ecounts, edispls, op, algorithm, timeout=timeout)
    return result
