"""Run a validated collective: pick the algorithm, set up transport, call it.

Both public layers (the drop-in :class:`mpicoll.Comm` and the array functions)
validate their arguments into :class:`~mpicoll._buffers.Msg` objects and then
call the ``run_*`` functions here; nothing below this point raises for bad
user input.
"""

from __future__ import annotations

from . import _context, _select


def _launch(comm, collective, algorithm, nbytes, msg, red=None):
    size = comm.Get_size()
    commutative = True if red is None else red.commutative
    name, fn = _select.choose(collective, algorithm, nbytes, size, commutative)
    ctx = _context.context(comm)
    ctx.seq += 1
    ch = msg.backend.channel(ctx, msg.mpitype)
    return ctx, ch, name, fn


def reducer(msg, op):
    return msg.backend.reducer(op, msg.mpitype, msg.category)


def run_allreduce(comm, smsg, rmsg, op, algorithm="auto"):
    """``rmsg`` <- reduction of every rank's ``smsg`` (None: in place in ``rmsg``)."""
    be = rmsg.backend
    red = reducer(rmsg, op)
    nbytes = rmsg.count * rmsg.dtype.itemsize
    ctx, ch, name, fn = _launch(comm, "allreduce", algorithm, nbytes, rmsg, red)
    be.prepare()
    src = rmsg.array if smsg is None else smsg.array
    fn(ctx, ch, be, red, src, rmsg.array)
    be.finish()
    return name


def run_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto"):
    """``rmsg`` <- this rank's block of the reduction; ``smsg`` None: input in ``rmsg``'s buffer.

    In place, ``rmsg.array`` is the whole input and the result goes to its start.
    """
    be = rmsg.backend
    red = reducer(rmsg, op)
    rank = comm.Get_rank()
    total = sum(counts)
    nbytes = total * rmsg.dtype.itemsize
    ctx, ch, name, fn = _launch(comm, "reduce_scatter", algorithm, nbytes, rmsg, red)
    be.prepare()
    if smsg is None:
        src = rmsg.array
        dst = rmsg.array[: counts[rank]]
    else:
        src, dst = smsg.array, rmsg.array
    fn(ctx, ch, be, red, src, dst, counts, displs)
    be.finish()
    return name


def run_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto"):
    """``rmsg`` block r (``counts[r]`` at ``displs[r]``) <- rank r's ``smsg`` (None: in place)."""
    be = rmsg.backend
    nbytes = sum(counts) * rmsg.dtype.itemsize
    ctx, ch, name, fn = _launch(comm, "allgather", algorithm, nbytes, rmsg)
    be.prepare()
    fn(ctx, ch, be, None if smsg is None else smsg.array, rmsg.array, counts, displs)
    be.finish()
    return name


def exchange_counts(comm, count: int) -> tuple[int, ...]:
    """Every rank's ``count`` (metadata for Reduce_scatter without recvcounts)."""
    import numpy as np

    from ._backend import NUMPY
    from ._buffers import msg_of_array

    size = comm.Get_size()
    out = np.zeros(size, dtype=np.int64)
    mine = np.array([count], dtype=np.int64)
    run_allgather(comm, msg_of_array(mine, NUMPY), msg_of_array(out, NUMPY),
                  [1] * size, list(range(size)))
    return tuple(int(c) for c in out)
