"""INTERIM non-blocking and persistent collectives on MPI's built-ins (replaced at the merge).

This module stands in for the ``start_*`` functions and the ``Operation``
class that the schedule executor (:mod:`mpicoll.engine.executor`) provides
once it lands; :mod:`mpicoll.api.requests` imports them from here in one
place.  It has exactly their interface::

    start_allreduce(comm, smsg, rmsg, op, algorithm="auto", *, timeout=None, persistent=False)
    start_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto", *, ...)
    start_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto", *, ...)

with the arguments of the ``run_*`` functions in :mod:`mpicoll.engine.collectives`
(``smsg`` None: in place).  Host arrays run MPI's own ``Iallreduce`` /
``Allreduce_init`` (etc.) on the context's private communicator, so they do
not run mpicoll's algorithms (``Operation.algorithm`` is ``"mpi_builtin"``);
device arrays run mpicoll's blocking ``run_*`` at start and are complete
when it returns.  Delete this file when the executor's versions replace it.
"""

from __future__ import annotations

import time

from mpi4py import MPI

from ..core import config as _config
from ..core.errors import CollectiveTimeout
from . import collectives as _collectives
from . import context as _context

BUILTIN = "mpi_builtin"
# MPI's own methods: the private duplicate of an mpicoll.Comm is an mpicoll.Comm
_MPI_COMM = MPI.Intracomm


def _host(msg) -> bool:
    return msg is None or getattr(msg.backend, "device", None) == "cpu"


def _spec(msg):
    return [msg.array, msg.count, msg.mpitype]


class Operation:
    """One started (or, persistent, startable) collective on a communicator.

    Attributes:
        algorithm: the algorithm run (``"mpi_builtin"`` here for host arrays).
        done: whether the result is in ``rmsg``'s buffer.
    """

    def __init__(self, collective, comm, make, algorithm, timeout, persistent, eager=None):
        self.collective = collective
        self.algorithm = algorithm
        self.persistent = persistent
        self.done = True  # an inactive persistent operation counts as done
        self._comm = comm
        self._make = make          # (ctx.comm) -> request (non-blocking or persistent)
        self._eager = eager        # device arrays: the blocking run_* call
        self._timeout = timeout
        self._req = None
        self._freed = False
        self._started_at = 0.0
        if not persistent:
            self.done = False
            self._begin()
        elif eager is None:
            self._req = make(self._ctx())

    def _ctx(self):
        # the first call on a communicator sets up its context (collective)
        return _context.context(self._comm, self._timeout).comm

    def _begin(self):
        self._started_at = time.monotonic()
        if self._eager is not None:
            self.algorithm = self._eager()
            self.done = True
            return
        if self.persistent:
            self._req.Start()
        else:
            self._req = self._make(self._ctx())
        self.done = False

    def start(self) -> None:
        """Persistent only: run the collective again on the buffers' current contents."""
        if not self.persistent:
            raise ValueError("start: expected a persistent operation, got a non-blocking one")
        if self._freed:
            raise ValueError("start: the persistent operation has been freed")
        if not self.done:
            raise ValueError("start: the persistent operation is still active; wait for it first")
        self._begin()

    def test(self) -> bool:
        """Advance without blocking; True once complete."""
        if self.done:
            return True
        if self._req.Test():
            self._complete()
        else:
            self._check_timeout()
        return self.done

    def wait(self) -> None:
        """Block until complete (CollectiveTimeout after the timeout)."""
        if self.done:
            return
        if self._timeout is None:
            self._req.Wait()
            self._complete()
            return
        while not self.test():
            time.sleep(20e-6)

    def free(self) -> None:
        """Persistent: release the request (idempotent); an active one is waited for first."""
        if self._freed:
            return
        if not self.done:
            self.wait()
        self._freed = True
        if self._req is not None and self.persistent and not MPI.Is_finalized():
            self._req.Free()
        self._req = None

    def _complete(self):
        self.done = True
        if not self.persistent:
            self._req = None

    def _check_timeout(self):
        if self._timeout is not None and time.monotonic() - self._started_at > self._timeout:
            rank = self._comm.Get_rank()
            raise CollectiveTimeout(
                f"{self.collective} on rank {rank}: not complete after {self._timeout:g} s "
                f"(timeout); some rank may not have started it",
                collective=self.collective, algorithm=self.algorithm, rank=rank,
                phase="recv", timeout=self._timeout)


def _timeout_of(timeout):
    return _config.get("timeout") if timeout is None else timeout


def start_allreduce(comm, smsg, rmsg, op, algorithm="auto", *, timeout=None, persistent=False):
    """Start ``rmsg`` <- reduction of every rank's ``smsg`` (None: in place)."""
    timeout = _timeout_of(timeout)
    if not _host(rmsg):
        return Operation("allreduce", comm, None, algorithm, timeout, persistent, lambda: (
            _collectives.run_allreduce(comm, smsg, rmsg, op, algorithm, timeout=timeout)))
    sbuf = MPI.IN_PLACE if smsg is None else _spec(smsg)
    rbuf = _spec(rmsg)
    if persistent:
        def make(c):
            return _MPI_COMM.Allreduce_init(c, sbuf, rbuf, op)
    else:
        def make(c):
            return _MPI_COMM.Iallreduce(c, sbuf, rbuf, op)
    return Operation("allreduce", comm, make, BUILTIN, timeout, persistent)


def start_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto", *,
                         timeout=None, persistent=False):
    """Start ``rmsg`` <- this rank's block of the reduction (``smsg`` None: input in ``rmsg``)."""
    timeout = _timeout_of(timeout)
    if not _host(rmsg):
        return Operation("reduce_scatter", comm, None, algorithm, timeout, persistent, lambda: (
            _collectives.run_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm,
                                            timeout=timeout)))
    counts = list(counts)
    # the ring's block layout is contiguous in rank order, as MPI's Reduce_scatter's
    sbuf = MPI.IN_PLACE if smsg is None else _spec(smsg)
    rbuf = [rmsg.array, rmsg.mpitype] if smsg is None else _spec(rmsg)
    if persistent:
        def make(c):
            return _MPI_COMM.Reduce_scatter_init(c, sbuf, rbuf, counts, op)
    else:
        def make(c):
            return _MPI_COMM.Ireduce_scatter(c, sbuf, rbuf, counts, op)
    return Operation("reduce_scatter", comm, make, BUILTIN, timeout, persistent)


def start_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto", *, timeout=None,
                    persistent=False):
    """Start ``rmsg`` block r (``counts[r]`` at ``displs[r]``) <- rank r's ``smsg`` (None: in place)."""
    timeout = _timeout_of(timeout)
    if not _host(rmsg):
        return Operation("allgather", comm, None, algorithm, timeout, persistent, lambda: (
            _collectives.run_allgather(comm, smsg, rmsg, counts, displs, algorithm,
                                       timeout=timeout)))
    sbuf = MPI.IN_PLACE if smsg is None else _spec(smsg)
    rbuf = [rmsg.array, (list(counts), list(displs)), rmsg.mpitype]
    if persistent:
        def make(c):
            return _MPI_COMM.Allgatherv_init(c, sbuf, rbuf)
    else:
        def make(c):
            return _MPI_COMM.Iallgatherv(c, sbuf, rbuf)
    return Operation("allgather", comm, make, BUILTIN, timeout, persistent)
