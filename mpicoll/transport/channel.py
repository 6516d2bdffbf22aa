"""Point-to-point transport used by every algorithm.

A channel sends and receives whole 1-D arrays on the library's private
communicator with one tag (:data:`TAG` for blocking calls, one per operation
for non-blocking ones: see engine.executor); MPI's non-overtaking rule keeps
messages between two ranks in order, and every rank issues the same sequence
of messages in a collective, so no per-message tags are needed.

The executor only calls ``isend``, ``irecv``, ``wait``, ``waitall`` and
``testall`` (if there).  Other modules wrap or replace this class (host staging for GPU
buffers, timeouts, traffic accounting, traces) without touching algorithms.

A message longer than :data:`PIECE_BYTES` travels as consecutive pieces of
at most that size (one ``Isend``/``Irecv`` each, all posted at once, so MPI
moves them back to back), and its request is a :class:`Pieces`.  The cut
depends only on the element count and the datatype, which both ends of a
message share, so sender and receiver cut identically whatever each rank's
options.  It is what lets a timeout bound silence rather than message size:
a polling wait (_timeout) sees a completion at least every piece, however
large the message (a request of one huge message gives no sign of progress
until all of it has arrived).
"""

from __future__ import annotations

from mpi4py import MPI

TAG = 0
PIECE_BYTES = 1 << 20  # largest single MPI message of a channel


class Pieces:
    """The requests of one message sent or received in pieces (mpi4py-like ``Test``/``Wait``)."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = parts

    def Test(self) -> bool:
        return MPI.Request.Testall(self.parts)

    def Wait(self) -> None:
        MPI.Request.Waitall(self.parts)

    def Cancel(self) -> None:
        for part in self.parts:
            if part != MPI.REQUEST_NULL:
                part.Cancel()


def mpi_requests(reqs) -> list:
    """The MPI requests behind channel requests (the parts of every :class:`Pieces`)."""
    out = []
    for r in reqs:
        if type(r) is Pieces:
            out.extend(r.parts)
        else:
            out.append(r)
    return out


def is_null(req) -> bool:
    """Whether a channel request has completed and been freed (every part, for :class:`Pieces`)."""
    if type(req) is Pieces:
        return all(part == MPI.REQUEST_NULL for part in req.parts)
    return req == MPI.REQUEST_NULL


def piece_elems(mpitype) -> int:
    """Elements of ``mpitype`` per piece: a function of the datatype only."""
    return max(1, PIECE_BYTES // max(mpitype.Get_extent()[1], 1))


class Channel:
    """Host-memory transport: arrays go straight to ``Isend``/``Irecv``."""

    __slots__ = ("comm", "mpitype", "piece", "tag")

    def __init__(self, comm, mpitype, tag: int = TAG):
        self.comm = comm
        self.mpitype = mpitype
        self.piece = piece_elems(mpitype)
        self.tag = tag  # non-blocking operations get one of their own (engine.executor)

    def isend(self, arr, dest):
        T, n, step, tag = self.mpitype, len(arr), self.piece, self.tag
        if n <= step:
            return self.comm.Isend([arr, T], dest, tag)
        return Pieces([self.comm.Isend([arr[a: a + step], T], dest, tag)
                       for a in range(0, n, step)])

    def irecv(self, arr, source):
        T, n, step, tag = self.mpitype, len(arr), self.piece, self.tag
        if n <= step:
            return self.comm.Irecv([arr, T], source, tag)
        return Pieces([self.comm.Irecv([arr[a: a + step], T], source, tag)
                       for a in range(0, n, step)])

    def wait(self, req):
        req.Wait()

    def waitall(self, reqs):
        if reqs:
            MPI.Request.Waitall(mpi_requests(reqs))

    def testall(self, reqs) -> bool:
        """Whether every request of ``reqs`` has completed (never blocks)."""
        return MPI.Request.Testall(mpi_requests(reqs))
