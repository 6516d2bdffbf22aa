"""Fast path for the latency-bound common case: AllReduce of plain NumPy arrays.

A 2-rank AllReduce of a few bytes is one message exchange, about 3 us on the
development machine; the general path (argument normalisation into
:class:`~mpicoll._buffers.Msg` objects, then :func:`mpicoll._collectives._launch`)
spends about 110 Python calls, 15 us there, before and around it.  The
functions here accept only the plain case and take the same decisions in
about a third of the calls:

* NumPy arrays (exactly ``numpy.ndarray``), C-contiguous, of a dtype MPI
  carries, the output writable, the same dtype and size, not overlapping;
* a predefined op object (``MPI.SUM`` & co.) that applies to the dtype;
* no check, timeout, trace or traffic counter active for the call.

Anything else returns ``NotImplemented`` *before doing anything*, and the
caller takes the general path, with its full validation and error messages.
What runs is what the general path runs: the same algorithm choice
(:func:`mpicoll._select.choose`), context, call counter, reducer and channel.
Keep this in step with ``_collectives._launch``.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import _config, _context, _observe, _select, _trace, _traffic, _types
from ._backend import NUMPY
from ._buffers import dtype_info

# predefined op object -> name (identity: a copy such as MPI.Op(MPI.SUM) takes the general path)
_OPS = {id(getattr(MPI, name)): name for name in _types.OP_CATEGORIES if name not in ("MINLOC", "MAXLOC")}
_OP_OBJECTS = [getattr(MPI, name) for name in _types.OP_CATEGORIES]  # keeps the ids valid
_ALLREDUCE = _select.ALGORITHMS["allreduce"]
_WORLD = MPI.COMM_WORLD
_ndarray = np.ndarray
_may_share_memory = np.may_share_memory


def allreduce(comm, x, out, op, algorithm, timeout):
    """The array function's AllReduce, or NotImplemented if this is not the plain case.

    ``comm`` None: COMM_WORLD; ``out`` None: a new array; ``out is x``: in place.
    """
    if type(x) is not _ndarray or not x.flags.c_contiguous:
        return NotImplemented
    in_place = out is x
    if in_place:
        if not x.flags.writeable:
            return NotImplemented
    elif out is not None and (type(out) is not _ndarray or out.dtype != x.dtype
                              or out.shape != x.shape or not out.flags.c_contiguous
                              or not out.flags.writeable):
        return NotImplemented
    if out is None:
        out = np.empty_like(x)
    elif not in_place and x.size and _may_share_memory(x, out):
        return NotImplemented
    return out if _run(comm, x, out, in_place, op, algorithm, timeout) else NotImplemented


def comm_allreduce(comm, sendbuf, recvbuf, op, algorithm):
    """``mpicoll.Comm.Allreduce`` with bare arrays (or IN_PLACE), or NotImplemented."""
    if type(recvbuf) is not _ndarray or not recvbuf.flags.c_contiguous or not recvbuf.flags.writeable:
        return NotImplemented
    in_place = sendbuf is MPI.IN_PLACE or sendbuf is None
    if not in_place:
        if (type(sendbuf) is not _ndarray or not sendbuf.flags.c_contiguous
                or sendbuf.dtype != recvbuf.dtype or sendbuf.size != recvbuf.size
                or (recvbuf.size and _may_share_memory(sendbuf, recvbuf))):
            return NotImplemented
    x = recvbuf if in_place else sendbuf
    return None if _run(comm, x, recvbuf, in_place, op, algorithm, None) else NotImplemented


_PLAN: dict = {}  # (id(op), dtype) -> (mpitype, Reducer), or None: not the plain case


def _plan(op, dtype):
    """The wire type and reducer for a predefined op on a dtype, or None."""
    key = (id(op), dtype)
    try:
        return _PLAN[key]
    except KeyError:
        pass
    plan = None
    name = _OPS.get(id(op))
    if name is not None:
        try:
            category, mpitype, _ = dtype_info(dtype)
        except TypeError:
            category = None
        if category in _types.OP_CATEGORIES[name]:
            plan = (mpitype, NUMPY.reducer(op, mpitype, category))
    _PLAN[key] = plan
    return plan


def _run(comm, x, out, in_place, op, algorithm, timeout) -> bool:
    """Run the AllReduce if the rest of the plain-case conditions hold; False if not.

    Errors the general path would raise for these (valid) arguments, such as a
    bad ``MPICOLL_*`` value, are raised in the same order it raises them.
    """
    plan = _plan(op, x.dtype) if timeout is None else None
    if plan is None or not (algorithm == "auto" or algorithm in _ALLREDUCE):
        return False
    comm = _WORLD if comm is None else _context.check_comm(comm)
    algo, fn = _select.choose("allreduce", algorithm, x.nbytes, comm.Get_size(), True)
    if (_config.get("timeout") is not None or _config.get("check")
            or _trace.active() or _traffic._active):
        return False  # observed: the general path sets that up
    ctx = _context.context(comm)
    _observe.check_usable(ctx)
    ctx.seq += 1
    mpitype, red = plan
    src = x if x.ndim == 1 else x.reshape(-1)
    dst = src if in_place else (out if out.ndim == 1 else out.reshape(-1))
    fn(ctx, _channel(ctx, mpitype), NUMPY, red, src, dst)
    return True


def _channel(ctx, mpitype):
    """The host channel for ``mpitype`` on ``ctx``, made once per context."""
    chans = ctx.__dict__.get("_fast_channels")
    if chans is None:
        chans = ctx.__dict__["_fast_channels"] = {}
    ch = chans.get(mpitype.handle)
    if ch is None:
        ch = chans[mpitype.handle] = NUMPY.channel(ctx, mpitype)
    return ch
