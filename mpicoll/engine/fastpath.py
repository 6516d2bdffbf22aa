"""Fast path for the latency-bound common case: collectives on plain NumPy arrays.

A 2-rank collective of a few bytes is one message exchange, about 3 us on the
development machine; the general path (argument normalisation into
:class:`~mpicoll.api.buffers.Msg` objects, then :func:`mpicoll.engine.collectives._launch`)
spends about 110 Python calls, 15 us there, before and around it.  The
functions here accept only the plain case and take the same decisions in
about a third of the calls:

* NumPy arrays (exactly ``numpy.ndarray``), C-contiguous (logical order is
  memory order), of a dtype MPI carries, the output writable, the same dtype,
  the sizes the call needs, input and output not overlapping (or, for the
  array AllReduce, the same memory: in place, as the general path decides);
* the default block layout (no ``counts``), a predefined op object
  (``MPI.SUM`` & co.) that applies to the dtype;
* no check, timeout, trace or traffic counter active for the call.

Anything else returns ``NotImplemented`` *before doing anything*, and the
caller takes the general path, with its full validation and error messages.
What runs is what the general path runs: the same algorithm choice
(:func:`mpicoll.engine.select.choose`), context, call counter, reducer and channel.
Keep this in step with ``_collectives._launch``.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..algorithms.ring import split
from ..api.buffers import dtype_info, same_memory
from ..backends.host import NUMPY
from ..core import config as _config
from ..core import types as _types
from ..observe import calls as _observe
from ..observe import trace as _trace
from ..observe import traffic as _traffic
from . import context as _context
from . import select as _select

# predefined op object -> name (identity: a copy such as MPI.Op(MPI.SUM) takes the general path)
_OPS = {id(getattr(MPI, name)): name for name in _types.OP_CATEGORIES if name not in ("MINLOC", "MAXLOC")}
_OP_OBJECTS = [getattr(MPI, name) for name in _types.OP_CATEGORIES]  # keeps the ids valid
_WORLD = MPI.COMM_WORLD
_IN_PLACE = MPI.IN_PLACE
_ndarray = np.ndarray
_may_share_memory = np.may_share_memory


def _plain(a, writable=False) -> bool:
    """An exact, C-contiguous NumPy array (writable if asked)."""
    if type(a) is not _ndarray:
        return False
    flags = a.flags
    return flags.c_contiguous and (flags.writeable or not writable)


def _flat(a):
    return a if a.ndim == 1 else a.reshape(-1)


_WIRE: dict = {}  # dtype -> MPI datatype, or None: MPI cannot carry it
_PLAN: dict = {}  # (id(op), dtype) -> (datatype, Reducer), or None: not the plain case


def _wire(dtype):
    try:
        return _WIRE[dtype]
    except KeyError:
        pass
    try:
        wire = dtype_info(dtype)[1]
    except TypeError:
        wire = None
    _WIRE[dtype] = wire
    return wire


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


def _begin(collective, comm, algorithm, nbytes):
    """(ctx, algorithm function) as ``_launch`` would set them up, or None if observed.

    ``comm`` must be valid already.  Errors the general path would raise for a
    valid call, such as a bad ``MPICOLL_*`` value, come in the same order.
    """
    fn = _select.choose(collective, algorithm, nbytes, comm.Get_size(), True)[1]
    if (_config.get("timeout") is not None or _config.get("check")
            or _trace.active() or _traffic._active):
        return None  # observed: the general path sets that up
    ctx = _context.context(comm)
    _observe.check_usable(ctx)
    ctx.seq += 1
    return ctx, fn


def _channel(ctx, mpitype):
    """The host channel for ``mpitype`` on ``ctx``, made once per context."""
    chans = ctx.__dict__.get("_fast_channels")
    if chans is None:
        chans = ctx.__dict__["_fast_channels"] = {}
    ch = chans.get(mpitype.handle)
    if ch is None:
        ch = chans[mpitype.handle] = NUMPY.channel(ctx, mpitype)
    return ch


_BLOCKS: dict = {}


def _blocks(counts):
    """(counts, displs) lists for a tuple of counts (cached for repeated layouts)."""
    got = _BLOCKS.get(counts)
    if got is None:
        if len(_BLOCKS) > 256:
            _BLOCKS.clear()
        displs = [0] * len(counts)
        for r in range(1, len(counts)):
            displs[r] = displs[r - 1] + counts[r - 1]
        got = _BLOCKS[counts] = (list(counts), displs)
    return got


def _comm(comm):
    return _WORLD if comm is None else _context.check_comm(comm)


def _ok(collective, algorithm) -> bool:
    return algorithm == "auto" or algorithm in _select.ALGORITHMS[collective]


# --- AllReduce ------------------------------------------------------------------

def allreduce(comm, x, out, op, algorithm, timeout):
    """The array function's AllReduce, or NotImplemented if this is not the plain case.

    ``comm`` None: COMM_WORLD; ``out`` None: a new array; ``out is x``: in place.
    """
    if timeout is not None or not _plain(x):
        return NotImplemented
    in_place = out is x
    if in_place:
        if not x.flags.writeable:
            return NotImplemented
    elif out is not None:
        if not _plain(out, True) or out.dtype != x.dtype or out.shape != x.shape:
            return NotImplemented
        if x.size and _may_share_memory(x, out):
            if not same_memory(x, out):
                return NotImplemented  # partial overlap: the general path says why
            in_place = True  # in place is a matter of memory, not of objects
    plan = _plan(op, x.dtype)
    if plan is None or not _ok("allreduce", algorithm):
        return NotImplemented
    run = _begin("allreduce", _comm(comm), algorithm, x.nbytes)
    if run is None:
        return NotImplemented
    if out is None:
        out = np.empty_like(x)
    ctx, fn = run
    src = _flat(x)
    fn(ctx, _channel(ctx, plan[0]), NUMPY, plan[1], src, src if in_place else _flat(out))
    return out


def comm_allreduce(comm, sendbuf, recvbuf, op, algorithm):
    """``mpicoll.Comm.Allreduce`` with bare arrays (or IN_PLACE); NotImplemented if not plain."""
    if not _plain(recvbuf, True):
        return NotImplemented
    in_place = sendbuf is _IN_PLACE or sendbuf is None
    if not in_place and (not _plain(sendbuf) or sendbuf.dtype != recvbuf.dtype
                         or sendbuf.size != recvbuf.size
                         or (recvbuf.size and _may_share_memory(sendbuf, recvbuf))):
        return NotImplemented
    plan = _plan(op, recvbuf.dtype)
    if plan is None or not _ok("allreduce", algorithm):
        return NotImplemented
    run = _begin("allreduce", comm, algorithm, recvbuf.nbytes)
    if run is None:
        return NotImplemented
    ctx, fn = run
    dst = _flat(recvbuf)
    fn(ctx, _channel(ctx, plan[0]), NUMPY, plan[1], dst if in_place else _flat(sendbuf), dst)
    return None


# --- AllGather ------------------------------------------------------------------

def allgather(comm, x, out, counts, algorithm, timeout):
    """The array function's AllGather (equal blocks, out of place), or NotImplemented."""
    if counts is not None or timeout is not None or out is x or not _plain(x):
        return NotImplemented
    wire = _wire(x.dtype)
    if wire is None or not _ok("allgather", algorithm):
        return NotImplemented
    comm = _comm(comm)
    n = comm.Get_size()
    shape = (n * x.shape[0],) + x.shape[1:] if x.ndim else (n,)
    if out is not None and (not _plain(out, True) or out.dtype != x.dtype or out.shape != shape
                            or (x.size and _may_share_memory(x, out))):
        return NotImplemented
    run = _begin("allgather", comm, algorithm, n * x.nbytes)
    if run is None:
        return NotImplemented
    if out is None:
        out = np.empty(shape, x.dtype)
    ctx, fn = run
    ecounts, edispls = _blocks((x.size,) * n)
    fn(ctx, _channel(ctx, wire), NUMPY, _flat(x), _flat(out), ecounts, edispls)
    return out


def comm_allgather(comm, sendbuf, recvbuf, algorithm):
    """``mpicoll.Comm.Allgather`` with bare arrays (or IN_PLACE); NotImplemented if not plain."""
    if not _plain(recvbuf, True):
        return NotImplemented
    n = comm.Get_size()
    total = recvbuf.size
    if total % n:
        return NotImplemented
    per = total // n
    in_place = sendbuf is _IN_PLACE or sendbuf is None
    if not in_place and (not _plain(sendbuf) or sendbuf.dtype != recvbuf.dtype or sendbuf.size != per
                         or (per and _may_share_memory(sendbuf, recvbuf))):
        return NotImplemented
    wire = _wire(recvbuf.dtype)
    if wire is None or not _ok("allgather", algorithm):
        return NotImplemented
    run = _begin("allgather", comm, algorithm, recvbuf.nbytes)
    if run is None:
        return NotImplemented
    ctx, fn = run
    ecounts, edispls = _blocks((per,) * n)
    fn(ctx, _channel(ctx, wire), NUMPY, None if in_place else _flat(sendbuf), _flat(recvbuf),
       ecounts, edispls)
    return None


# --- ReduceScatter --------------------------------------------------------------

def reduce_scatter(comm, x, out, op, counts, algorithm, timeout):
    """The array function's ReduceScatter (array_split rows, out of place), or NotImplemented."""
    if (counts is not None or timeout is not None or out is x or not _plain(x) or x.ndim == 0):
        return NotImplemented
    plan = _plan(op, x.dtype)
    if plan is None or not _ok("reduce_scatter", algorithm):
        return NotImplemented
    comm = _comm(comm)
    n, rank = comm.Get_size(), comm.Get_rank()
    rows = split(x.shape[0], n)[0]
    shape = (rows[rank],) + x.shape[1:]
    if out is not None and (not _plain(out, True) or out.dtype != x.dtype or out.shape != shape
                            or (out.size and x.size and _may_share_memory(x, out))):
        return NotImplemented
    run = _begin("reduce_scatter", comm, algorithm, x.nbytes)
    if run is None:
        return NotImplemented
    if out is None:
        out = np.empty(shape, x.dtype)
    ctx, fn = run
    rowsize = x.size // x.shape[0] if x.shape[0] else 0
    ecounts, edispls = _blocks(tuple(c * rowsize for c in rows))
    fn(ctx, _channel(ctx, plan[0]), NUMPY, plan[1], _flat(x), _flat(out), ecounts, edispls)
    return out


def comm_reduce_scatter_block(comm, sendbuf, recvbuf, op, algorithm):
    """``mpicoll.Comm.Reduce_scatter_block`` with bare arrays (or IN_PLACE), or NotImplemented."""
    if not _plain(recvbuf, True):
        return NotImplemented
    n = comm.Get_size()
    in_place = sendbuf is _IN_PLACE or sendbuf is None
    if in_place:
        if recvbuf.size % n:
            return NotImplemented
        per = recvbuf.size // n
    else:
        per = recvbuf.size
        if (not _plain(sendbuf) or sendbuf.dtype != recvbuf.dtype or sendbuf.size != per * n
                or (per and _may_share_memory(sendbuf, recvbuf))):
            return NotImplemented
    plan = _plan(op, recvbuf.dtype)
    if plan is None or not _ok("reduce_scatter", algorithm):
        return NotImplemented
    run = _begin("reduce_scatter", comm, algorithm, per * n * recvbuf.itemsize)
    if run is None:
        return NotImplemented
    ctx, fn = run
    ecounts, edispls = _blocks((per,) * n)
    if in_place:
        src = _flat(recvbuf)
        dst = src[:per]
    else:
        src, dst = _flat(sendbuf), _flat(recvbuf)
    fn(ctx, _channel(ctx, plan[0]), NUMPY, plan[1], src, dst, ecounts, edispls)
    return None
