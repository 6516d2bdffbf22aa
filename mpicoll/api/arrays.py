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
* One call path.  A call with ``out=`` first tries the cache of bound calls
  (engine.cache): the same ``x`` and ``out`` (and op, algorithm, timeout) as a
  call it remembered run again with no validation.  Otherwise api.args
  validates the arguments into a Call, the array to return and what to do
  after the data moved (a copy back into a non-C-ordered ``out``, or None),
  and engine.run runs the call.
"""

from __future__ import annotations

from mpi4py import MPI

from ..core import types as _types
from ..engine import run as _run
from ..engine.cache import plain as _plain
from . import args as _args
from . import requests as _requests

_WORLD = MPI.COMM_WORLD
_repeat = _run.repeat


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
        algorithm: ``"auto"`` (chosen by size, rank count, op and node layout) or one of
            ``"ring"``, ``"recursive_doubling"``, ``"rabenseifner"``, ``"direct"``,
            ``"hierarchical"``, ``"shared_oneshot"``, ``"shared_twoshot"``
            (docs/algorithms.md).
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
    if out is not None and deterministic is None and accumulate is None and _repeat(
            _WORLD if comm is None else comm, "allreduce", x, out, op, algorithm, timeout):
        return out
    call, result, after = _args.allreduce(x, op, comm, out, algorithm, timeout, deterministic,
                                          accumulate)
    _run.run(call, _key("allreduce", (x, out, op, algorithm, timeout), op, result, after, call))
    if after is not None:
        after()
    return result


def _key(name, args, op, result, after, call, counts=None):
    """The cache key (name, ``args``: the arguments its repeat compares, flat) under which a
    call may be remembered (engine.cache), or None: the default counts, no numerics
    flags, the result ``out`` itself (not, in place, a view of ``x``), C-ordered ``x``
    and ``out`` moved as they are (no copy after: NumPy's or a device backend's own
    arrays, engine.cache.plain) and a predefined op.  ``flat`` False: validation read
    shapes and strides."""
    x, out = args[0], args[1]
    if (counts is None and result is out and after is None and _plain(x) and _plain(out)
            and call.deterministic is None and call.accumulate is None
            and (op is None or _types.op_name(op) is not None)):
        return name, args, False
    return None


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
        algorithm: ``"auto"`` (chosen by size, rank count and node layout) or one of
            ``"ring"``, ``"recursive_doubling"``, ``"bruck"``, ``"hierarchical"``,
            ``"shared"`` (docs/algorithms.md).
        timeout: seconds without progress before raising ``mpicoll.CollectiveTimeout``
            (default: the ``timeout`` option / ``MPICOLL_TIMEOUT``; None there: wait forever).

    Returns:
        The gathered array (``out`` when given, else a new C-ordered array).

    Example (3 ranks)::

        x = np.full(2, rank)                 # rank r: [r, r]
        y = mpicoll.allgather(x)             # every rank: [0, 0, 1, 1, 2, 2]
    """
    if out is not None and counts is None and _repeat(
            _WORLD if comm is None else comm, "allgather", x, out, None, algorithm, timeout):
        return out
    call, result, after = _args.allgather(x, comm, out, counts, algorithm, timeout)
    _run.run(call, _key("allgather", (x, out, None, algorithm, timeout), None, result, after,
                        call, counts))
    if after is not None:
        after()
    return result


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
        algorithm: ``"auto"`` (chosen by size, rank count, op and node layout) or one of
            ``"ring"``, ``"recursive_doubling"``, ``"recursive_halving"``, ``"direct"``,
            ``"hierarchical"``, ``"shared"`` (docs/algorithms.md).
        timeout: seconds without progress before raising ``mpicoll.CollectiveTimeout``
            (default: the ``timeout`` option / ``MPICOLL_TIMEOUT``; None there: wait forever).
        deterministic, accumulate: as for :func:`allreduce`.

    Returns:
        This rank's reduced rows (``out`` when given, else a new C-ordered array).

    Example (2 ranks)::

        x = np.arange(4) + 10 * rank         # rank 0: [0,1,2,3]  rank 1: [10,11,12,13]
        y = mpicoll.reduce_scatter(x)        # rank 0: [10, 12]    rank 1: [14, 16]
    """
    if out is not None and counts is None and deterministic is None and accumulate is None \
            and _repeat(_WORLD if comm is None else comm, "reduce_scatter", x, out, op,
                        algorithm, timeout):
        return out
    call, result, after = _args.reduce_scatter(x, op, comm, out, counts, algorithm, timeout,
                                               deterministic, accumulate)
    _run.run(call, _key("reduce_scatter", (x, out, op, algorithm, timeout), op, result, after,
                        call, counts))
    if after is not None:
        after()
    return result


# -- non-blocking forms (see mpicoll.api.requests) ------------------------------------
# The same validation as the blocking functions, then engine.run.start.  A repeated call
# with ``out`` (the same array objects, the last handle seen complete) restarts the
# operation the cache remembered (engine.cache.restart): no validation.


def _istart(name, validate, comm, x, out, op, algorithm, counts, timeout, flags):
    """A handle of ``name``'s remembered operation restarted (its result: ``out``), else of a
    new one started on ``validate()`` (the function's api.args call) and remembered for
    the call's repeat (:func:`_key`).  The handle keeps ``x`` and ``out`` alive until it
    has seen the operation complete.  ``flags``: (deterministic, accumulate)."""
    _requests.check_progress()
    if flags == (None, None) and out is not None and counts is None:
        operation = _run.restart(_WORLD if comm is None else comm, name, x, out, op,
                                   algorithm, timeout)
        if operation is not None:
            return _requests.Handle(operation, _finisher(out, None), (x, out))
    call, result, after = validate()
    key = _key(name, (x, out, op, algorithm, timeout), op, result, after, call, counts)
    return _requests.Handle(_run.start(call, key), _finisher(result, after), (x, out))


def _finisher(result, after):
    """``finish()``: the result, once ``after`` (the copy out of a C-ordered work array) ran."""
    def finish():
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
    return _istart("iallreduce", lambda: _args.allreduce(
        x, op, comm, out, algorithm, timeout, deterministic, accumulate),
        comm, x, out, op, algorithm, None, timeout, (deterministic, accumulate))


def iallgather(x, *, comm=None, out=None, counts=None, algorithm="auto", timeout=None):
    """Start an :func:`allgather` (same arguments); ``wait()`` on the handle returns the result."""
    return _istart("iallgather", lambda: _args.allgather(x, comm, out, counts, algorithm, timeout),
                   comm, x, out, None, algorithm, counts, timeout, (None, None))


def ireduce_scatter(x, op=MPI.SUM, *, comm=None, out=None, counts=None, algorithm="auto",
                    timeout=None, deterministic=None, accumulate=None):
    """Start a :func:`reduce_scatter` (same arguments); ``wait()`` on the handle returns the result."""
    # (in-place calls are not remembered: their result is a view of x; see _key)
    return _istart("ireduce_scatter", lambda: _args.reduce_scatter(
        x, op, comm, out, counts, algorithm, timeout, deterministic, accumulate),
        comm, x, out, op, algorithm, counts, timeout, (deterministic, accumulate))
