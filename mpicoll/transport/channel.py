"""Point-to-point transport used by every algorithm.

A channel sends and receives whole 1-D arrays on the library's private
communicator with one tag (:data:`TAG` for blocking calls, one per operation
for non-blocking ones: see engine.executor); MPI's non-overtaking rule keeps
messages between two ranks in order, and every rank issues the same sequence
of messages in a collective, so no per-message tags are needed.

The executor only calls ``isend(arr, peer, chunk)``, ``irecv(arr, peer, chunk)``,
``wait``, ``waitall`` and ``testall`` (if there).  A message's ``chunk`` (0 but
in a pipeline, algorithms.pipeline) adds to the channel's tag: messages of
different chunks never match each other.  Other modules wrap or replace this class (host staging for GPU
buffers, timeouts, traffic accounting, traces) without touching algorithms.

A message longer than a piece travels as consecutive pieces of at most
that size (one ``Isend``/``Irecv`` each, all posted at once, so MPI moves
them back to back), and its request is a :class:`Pieces`.  The cut depends
only on the element count, the datatype and whether the two ranks share a
node, which both ends of a message agree on (the node labels are exchanged
when the context is made), so sender and receiver cut identically whatever
each rank's options.  It is what lets a timeout bound silence rather than
message size: a polling wait (_timeout) sees a completion at least every
piece, however large the message (a request of one huge message gives no
sign of progress until all of it has arrived).

A piece is :data:`PIECE_BYTES` between nodes by default (the option
``node_piece_bytes``, agreed by the ranks when the context is made): two 64 MiB
flows on one TCP link reached 50-67 % of it, 1 MiB pieces 97-98 %; with Open
MPI's TCP transport, exchanges back to back in pieces above its eager limit
(64 KiB) move at half the line and in 60 KiB pieces at the line (docs/design.md,
"Transport and pieces"; the tuning tool measures the piece: docs/tuning.md, "What the
tool does").
Inside a node it is :data:`LOCAL_PIECE_BYTES`: every piece is a rendezvous of
its own in MPI's shared-memory transport: with 1 MiB pieces a 2-rank
AllGather of 4 MiB took 1.30x the built-in, 1.10x with one message per block
(16 MiB: 1.08-1.11x against 0.97-0.99x), while 16 MiB still moves in a few
milliseconds, well inside any timeout.
"""

from __future__ import annotations

import threading

from mpi4py import MPI

TAG = 0  # blocking calls' tag: chunk k of a blocking call's pipeline is tag TAG + k
CHUNKS = 32  # (chunks k < CHUNKS; the fingerprint check and non-blocking calls tag above)
PIECE_BYTES = 1 << 20  # largest single MPI message of a channel to another node
LOCAL_PIECE_BYTES = 16 << 20  # ... and to a rank of the same node


class Pieces:
    """The requests of one message sent or received in pieces (mpi4py-like ``Test``/``Wait``)."""

    __slots__ = ("parts",)

    def __init__(self, parts):
        self.parts = parts

    def Test(self) -> bool:
        return testall(self.parts)

    def Wait(self) -> None:
        waitall(self.parts)

    def Cancel(self) -> None:
        for part in self.parts:
            if part != MPI.REQUEST_NULL:
                part.Cancel()


class RequestError(MPI.Exception):
    """A request completed with an error: MPI's own code for it (not the
    MPI_ERR_IN_STATUS of the wait that found it) and the request, so that the
    engine can say which message of which step failed (engine.executor)."""

    def __init__(self, code: int, request):
        super().__init__(code)
        self.request = request


def _failed(exc, reqs, statuses):
    """The error of the first request whose status holds one (else ``exc`` itself)."""
    for req, st in zip(reqs, statuses):
        code = st.Get_error()
        if code not in (MPI.SUCCESS, MPI.ERR_PENDING):
            return RequestError(code, req)
    return exc


_MINE = threading.local()  # each thread's statuses, by count (made once, read only on errors)
_Waitall = MPI.Request.Waitall
_Testall = MPI.Request.Testall


def _statuses(n: int) -> list:
    """``n`` statuses of this thread's own (what a failed wait names its request by): a list
    per count up to 16 (a small call's wait), else a slice of the longest."""
    try:
        return _MINE.by_count[n]
    except AttributeError:
        _MINE.by_count, _MINE.longest = {}, []
    except KeyError:
        pass
    if n <= 16:
        kept = _MINE.by_count[n] = [MPI.Status() for _ in range(n)]
        return kept
    if len(_MINE.longest) < n:
        _MINE.longest = [MPI.Status() for _ in range(n)]
    return _MINE.longest[:n]


def waitall(reqs) -> None:
    """``MPI.Request.Waitall(reqs)``; a failed request raises its own error (RequestError)."""
    statuses = _statuses(len(reqs))
    try:
        _Waitall(reqs, statuses)
    except MPI.Exception as exc:
        raise _failed(exc, list(reqs), statuses) from None


def testall(reqs) -> bool:
    """``MPI.Request.Testall(reqs)``; a failed request raises its own error (RequestError)."""
    statuses = _statuses(len(reqs))
    try:
        return _Testall(reqs, statuses)
    except MPI.Exception as exc:
        raise _failed(exc, list(reqs), statuses) from None


def mpi_requests(reqs) -> list:
    """The MPI requests behind channel requests (the parts of every :class:`Pieces`)."""
    for r in reqs:
        if type(r) is Pieces:
            break
    else:
        return reqs
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


def piece_elems(mpitype, local: bool = False, node_bytes: int = PIECE_BYTES) -> int:
    """Elements of ``mpitype`` per piece to a rank of another node, of ``node_bytes`` (the
    communicator's ``node_piece_bytes``, the same on every rank), or of this node
    (``local``): a function of the datatype, the pair of ranks and the communicator only."""
    size = LOCAL_PIECE_BYTES if local else node_bytes
    return max(1, size // max(mpitype.Get_extent()[1], 1))


def local_ranks(nodes, rank: int) -> tuple:
    """Per rank of a communicator, whether it is on ``rank``'s node (``nodes``: a label per rank)."""
    return tuple(n == nodes[rank] for n in nodes)


def peer_piece(peer: int, local: tuple, piece: int, local_piece: int) -> int:
    """``local_piece`` for a ``peer`` of this node (``local``: per rank), else ``piece``."""
    return local_piece if peer < len(local) and local[peer] else piece


class Channel:
    """Host-memory transport: arrays go straight to ``Isend``/``Irecv``.

    ``local``: per rank, whether it shares this rank's node (engine.context's
    node labels); without it every peer counts as on another node.
    ``node_bytes``: the piece to another node (the context's ``node_piece``).
    """

    __slots__ = ("comm", "mpitype", "piece", "local_piece", "local", "node_bytes", "tag")

    def __init__(self, comm, mpitype, tag: int = TAG, local: tuple = (),
                 node_bytes: int = PIECE_BYTES):
        self.comm = comm
        self.mpitype = mpitype
        self.piece = piece_elems(mpitype, False, node_bytes)
        self.local_piece = piece_elems(mpitype, True)
        self.local = local
        self.node_bytes = node_bytes
        self.tag = tag  # non-blocking operations get one of their own (engine.executor)

    def piece_for(self, peer: int) -> int:
        """Elements per piece of a message to or from ``peer``."""
        return peer_piece(peer, self.local, self.piece, self.local_piece)

    def isend(self, arr, dest, chunk=0):
        n = len(arr)
        if n <= self.piece:  # (a piece to any peer: the common case, one request)
            return self.comm.Isend([arr, self.mpitype], dest, self.tag + chunk)
        step = self.piece_for(dest)
        if n <= step:
            return self.comm.Isend([arr, self.mpitype], dest, self.tag + chunk)
        T, tag = self.mpitype, self.tag + chunk
        return Pieces([self.comm.Isend([arr[a: a + step], T], dest, tag)
                       for a in range(0, n, step)])

    def irecv(self, arr, source, chunk=0):
        n = len(arr)
        if n <= self.piece:
            return self.comm.Irecv([arr, self.mpitype], source, self.tag + chunk)
        step = self.piece_for(source)
        if n <= step:
            return self.comm.Irecv([arr, self.mpitype], source, self.tag + chunk)
        T, tag = self.mpitype, self.tag + chunk
        return Pieces([self.comm.Irecv([arr[a: a + step], T], source, tag)
                       for a in range(0, n, step)])

    def wait(self, req):
        req.Wait()

    def waitall(self, reqs):
        if reqs:
            waitall(mpi_requests(reqs))

    def testall(self, reqs) -> bool:
        """Whether every request of ``reqs`` has completed (never blocks)."""
        return testall(mpi_requests(reqs))
