"""Run a validated collective: pick the algorithm, set up transport, call it.

Both public layers (the drop-in :class:`mpicoll.Comm` and the array functions)
validate their arguments into :class:`~mpicoll.api.buffers.Msg` objects and then
call the ``run_*`` functions here; nothing below this point raises for bad
user input.

This is also the one hook for reliability and observability (_observe):
when ``MPICOLL_CHECK``, a timeout, ``mpicoll.traffic()`` or ``mpicoll.trace()``
is on, :func:`_launch` agrees on the call fingerprint across ranks before any
payload message and runs the algorithm on an observed channel.
"""

from __future__ import annotations

from ..core import config as _config
from ..observe import calls as _observe
from ..observe import check as _check
from . import context as _context
from . import select as _select


class _Run:
    """One call: the algorithm and what it runs with; ``with`` closes the observation."""

    __slots__ = ("name", "fn", "ctx", "ch", "be", "red", "call", "stage")

    def enter(self, src, dst):
        """The arrays the algorithm runs on: host copies when the call is staged whole."""
        return (src, dst) if self.stage is None else self.stage.enter(src, dst)

    def leave(self):
        if self.stage is not None:
            self.stage.leave()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.call is not None:
            self.call.end(exc_type is not None)


def _launch(comm, collective, algorithm, msg, total, *, red=None, op=None, counts=None,
            displs=None, timeout=None, label=None) -> _Run:
    """Choose the algorithm, set up the channel and observers; check the call if asked.

    ``total`` is the element count selection and the fingerprint use: the
    array reduced (AllReduce), the whole input (ReduceScatter) or the whole
    output (AllGather).  ``label`` names the call where it is not ``collective``.
    Plain NumPy AllReduce calls with nothing observing them skip this (see
    :mod:`mpicoll.engine.fastpath`, which must take the same decisions).
    """
    size = comm.Get_size()
    commutative = True if red is None else red.commutative
    nbytes = total * msg.dtype.itemsize
    per_step = getattr(msg.backend, "stages_per_step", None)  # device arrays (see engine.select)
    name, fn = _select.choose(collective, algorithm, nbytes, size, commutative,
                              staged=per_step is not None and per_step(nbytes))
    if timeout is None:
        timeout = _config.get("timeout")  # a bad MPICOLL_* value raises before anything starts
    check = bool(_config.get("check"))
    label = label or collective
    # the first call on comm sets it up, under the call's timeout
    ctx = _context.context(comm, timeout, lambda: (
        f"{label} #1 ({name}, {total} x {_check.dtype_label(msg)})", label, name))
    _observe.check_usable(ctx)
    ctx.seq += 1
    run = _Run()
    run.name, run.fn, run.ctx = name, fn, ctx
    # small device calls on the staging path run the host algorithm on one
    # pinned copy (see backends.devices.WholeStage)
    whole = getattr(msg.backend, "whole_stage", None)
    run.stage = None if whole is None else whole(ctx, nbytes, msg, op if red is not None else None)
    if run.stage is not None:
        run.ch, run.be, red = run.stage.channel, run.stage.backend, run.stage.reducer
    else:
        run.ch, run.be = msg.backend.channel(ctx, msg.mpitype), msg.backend
    run.red = red
    call = _observe.begin(ctx, label, collective, name, msg, total, counts, displs,
                          op, timeout, check)
    run.call = call
    if call is not None:
        try:
            if check:
                call.check()
        except BaseException:
            call.end(True)
            raise
        run.ch, run.be, run.red = call.wrap(run.ch, run.be, red)
    return run


def reducer(msg, op):
    # msg.optype: user-defined ops see the datatype mpi4py would pass, not the wire type
    return msg.backend.reducer(op, msg.optype, msg.category)


def run_allreduce(comm, smsg, rmsg, op, algorithm="auto", *, timeout=None):
    """``rmsg`` <- reduction of every rank's ``smsg`` (None: in place in ``rmsg``)."""
    be = rmsg.backend
    red = reducer(rmsg, op)
    run = _launch(comm, "allreduce", algorithm, rmsg, rmsg.count, red=red, op=op, timeout=timeout)
    with run:
        be.prepare()
        src, dst = run.enter(rmsg.array if smsg is None else smsg.array, rmsg.array)
        run.fn(run.ctx, run.ch, run.be, run.red, src, dst)
        run.leave()
        be.finish()
    return run.name


def run_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto", *, timeout=None):
    """``rmsg`` <- this rank's block of the reduction; ``smsg`` None: input in ``rmsg``'s buffer.

    In place, ``rmsg.array`` is the whole input and the result goes to its start.
    """
    be = rmsg.backend
    red = reducer(rmsg, op)
    rank = comm.Get_rank()
    run = _launch(comm, "reduce_scatter", algorithm, rmsg, sum(counts), red=red, op=op,
                  counts=counts, displs=displs, timeout=timeout)
    with run:
        be.prepare()
        if smsg is None:
            src = rmsg.array
            dst = rmsg.array[: counts[rank]]
        else:
            src, dst = smsg.array, rmsg.array
        src, dst = run.enter(src, dst)
        run.fn(run.ctx, run.ch, run.be, run.red, src, dst, counts, displs)
        run.leave()
        be.finish()
    return run.name


def run_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto", *, timeout=None,
                  label=None):
    """``rmsg`` block r (``counts[r]`` at ``displs[r]``) <- rank r's ``smsg`` (None: in place)."""
    be = rmsg.backend
    run = _launch(comm, "allgather", algorithm, rmsg, sum(counts), counts=counts, displs=displs,
                  timeout=timeout, label=label)
    with run:
        be.prepare()
        src, dst = run.enter(None if smsg is None else smsg.array, rmsg.array)
        run.fn(run.ctx, run.ch, run.be, src, dst, counts, displs)
        run.leave()
        be.finish()
    return run.name


def exchange_counts(comm, count: int) -> tuple[int, ...]:
    """Every rank's ``count`` (metadata for Reduce_scatter without recvcounts)."""
    import numpy as np

    from ..api.buffers import msg_of_array
    from ..backends.host import NUMPY

    size = comm.Get_size()
    out = np.zeros(size, dtype=np.int64)
    mine = np.array([count], dtype=np.int64)
    run_allgather(comm, msg_of_array(mine, NUMPY), msg_of_array(out, NUMPY),
                  [1] * size, list(range(size)), label="reduce_scatter.recvcounts")
    return tuple(int(c) for c in out)
