"""Point-to-point transport used by every algorithm.

A channel sends and receives whole 1-D arrays on the library's private
communicator with one tag; MPI's non-overtaking rule keeps messages between
two ranks in order, and every rank issues the same sequence of messages in a
collective, so no per-message tags are needed.

Algorithms only call ``isend``, ``irecv``, ``wait``, ``waitall`` and
``sendrecv``.  Other modules wrap or replace this class (host staging for GPU
buffers, timeouts, traffic accounting, traces) without touching algorithms.
"""

from __future__ import annotations

from mpi4py import MPI

TAG = 0


class Channel:
    """Host-memory transport: arrays go straight to ``Isend``/``Irecv``."""

    __slots__ = ("comm", "mpitype")

    def __init__(self, comm, mpitype):
        self.comm = comm
        self.mpitype = mpitype

    def isend(self, arr, dest):
        return self.comm.Isend([arr, self.mpitype], dest, TAG)

    def irecv(self, arr, source):
        return self.comm.Irecv([arr, self.mpitype], source, TAG)

    def wait(self, req):
        req.Wait()

    def waitall(self, reqs):
        if reqs:
            MPI.Request.Waitall(reqs)

    def sendrecv(self, sendarr, dest, recvarr, source):
        """Send ``sendarr`` to ``dest`` while receiving ``recvarr`` from ``source``.

        Either array may be None (or empty) to skip that half.
        """
        recv = recvarr is not None and len(recvarr)
        send = sendarr is not None and len(sendarr)
        if recv and send and type(self) is Channel:
            # one MPI call instead of three (small messages are latency-bound);
            # subclasses and borrowers of this method may stage, tag or observe
            # messages in isend/irecv, so they take the general path
            T = self.mpitype
            self.comm.Sendrecv([sendarr, T], dest, TAG, [recvarr, T], source, TAG)
            return
        reqs = []
        if recv:
            reqs.append(self.irecv(recvarr, source))
        if send:
            reqs.append(self.isend(sendarr, dest))
        self.waitall(reqs)
