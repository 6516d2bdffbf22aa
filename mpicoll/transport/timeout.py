"""Timeouts instead of hangs: wait for requests by polling, and ``abort``.

With a timeout set (``MPICOLL_TIMEOUT``, ``configure(timeout=...)`` or a
per-call ``timeout=``), the channel of a collective does not block in
``MPI_Wait``: it polls its requests with ``Test``/``Testsome`` and raises
:class:`~mpicoll.CollectiveTimeout` when none of them completes for that many
seconds.  The deadline restarts at every completed request, and at every
completed piece of a message the channel cut into pieces
(:class:`mpicoll.transport.channel.Pieces`), so the time between deadlines is bounded
by the piece size, not the message size: a long but progressing collective
never times out.

Polling spins for :data:`SPIN_S` after each completion (as ``MPI_Wait``
itself would) and then sleeps between polls, doubling the pause up to
:data:`MAX_SLEEP_S`, so a rank that waits a long time for a late peer leaves
the core to others.
"""

from __future__ import annotations

import sys
import time
from typing import NoReturn

from mpi4py import MPI

from .channel import Pieces, RequestError

SPIN_S = 2e-3        # poll without pausing this long after the last progress
MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3
CANCEL_WAIT_S = 0.1  # how long to wait for a cancelled receive to complete


WINDOW = 4  # pieces of one message in flight at a time (see Windowed)


def _test_requests(reqs, channel_test=None) -> list:
    """Indices of the completed requests among ``reqs`` (inner channel requests)."""
    if channel_test is not None:
        return [i for i, q in enumerate(reqs) if channel_test(q)]
    if any(type(q) is MPI.Prequest for q in reqs):
        # persistent requests stay (inactive) when they complete, so which one failed a
        # Testsome cannot tell: each is tested on its own, its error its own
        done = []
        for i, q in enumerate(reqs):
            try:
                if q.Test():
                    done.append(i)
            except MPI.Exception as exc:
                raise RequestError(exc.Get_error_code(), q) from None
        return done
    if all(type(q) is MPI.Request for q in reqs):
        live = [q != MPI.REQUEST_NULL for q in reqs]
        statuses = [MPI.Status() for _ in reqs]
        try:
            done = MPI.Request.Testsome(reqs, statuses)
        except MPI.Exception:
            # the failed request is one freed by this test: its own error, not
            # MPI_ERR_IN_STATUS (transport.channel.RequestError)
            freed = [q for q, was in zip(reqs, live) if was and q == MPI.REQUEST_NULL]
            codes = [c for c in (st.Get_error() for st in statuses)
                     if c not in (MPI.SUCCESS, MPI.ERR_PENDING)]
            if freed and codes:
                raise RequestError(codes[0], freed[0]) from None
            raise
        return range(len(reqs)) if done is None else done
    return [i for i, q in enumerate(reqs) if q.Test()]


def _pollable(req) -> bool:
    return isinstance(req, (MPI.Request, Pieces)) or hasattr(req, "Test")


class Windowed:
    """A message a polling wait moves in pieces, at most :data:`WINDOW` of them in flight.

    The pieces are those the channel itself would cut (:func:`_channel.piece_elems`,
    a function of the datatype only), each handed to the inner channel as a
    message of its own, so the peer may post the whole message at once or
    windowed: they match either way.  With every piece of a large message
    posted at once, MPI (Open MPI's shared-memory transport, for one) moves
    them side by side and they all complete near the end; a window makes them
    complete one after another, so a waiting rank sees progress at least every
    piece.

    MPI matches the messages between two ranks in the order they are posted,
    so pieces must be posted in message order: the messages to (from) one
    peer form a *queue* (a list, oldest first), and only the queue's first
    message posts; it leaves the queue once all its pieces are posted.  A
    message issued while its queue is busy, even a small one, joins the queue.
    :meth:`advance` posts the next pieces as earlier ones complete; the
    polling wait advances every windowed message of a call at each poll, so a
    message nobody is waiting for yet still moves.
    """

    __slots__ = ("post", "arr", "peer", "bounds", "queue", "kind", "inflight", "posted")

    def __init__(self, post, arr, peer, step: int, kind: str, queue: list):
        self.post = post        # the inner channel's isend or irecv
        self.arr = arr
        self.peer = peer
        self.kind = kind
        n = len(arr)
        # (start, stop) of the pieces not posted yet, last first (an empty message is one piece)
        self.bounds = [(a, min(a + step, n)) for a in range(0, n, step)][::-1] or [(0, 0)]
        self.inflight: list = []
        self.posted: list = []  # every inner request, for the inner channel's final wait
        self.queue = queue
        queue.append(self)
        _fill(queue)

    @property
    def finished(self) -> bool:
        return not self.inflight and not self.bounds

    def advance(self, channel_test=None) -> bool:
        """Test the pieces in flight and post the next ones; True if any completed."""
        done = set(_test_requests(self.inflight, channel_test)) if self.inflight else ()
        if done:
            self.inflight = [q for i, q in enumerate(self.inflight) if i not in done]
        _fill(self.queue)
        return bool(done)

    def Cancel(self) -> None:
        """Cancel the pieces in flight (receives only); the rest are never posted."""
        self.bounds = []
        for q in self.inflight:
            if isinstance(q, (MPI.Request, Pieces)) and q != MPI.REQUEST_NULL:
                q.Cancel()

    def Test(self) -> bool:
        return all(q.Test() for q in self.inflight)


def _fill(queue: list) -> None:
    """Post pieces of the queue's first messages, in order, up to WINDOW in flight each."""
    while queue:
        w = queue[0]
        while w.bounds and len(w.inflight) < WINDOW:
            a, b = w.bounds.pop()
            req = w.post(w.arr[a:b], w.peer)
            w.inflight.append(req)
            w.posted.append(req)
        if w.bounds:
            return
        queue.pop(0)


def tester(pending, channel_test=None, windowed=None):
    """How to poll ``pending``: a function left -> (indices of completed entries, progress), or None.

    ``channel_test(req) -> bool`` is the inner channel's own non-blocking test
    (a channel whose requests are not MPI requests, e.g. host staging of device
    buffers, provides one to make progress); otherwise requests are tested with
    ``Testsome`` (MPI requests) or their ``Test()`` method.  ``windowed``: a
    list of every :class:`Windowed` message still moving (entries of
    ``pending`` may be some of them); each poll advances them all, and any
    piece that completes counts as progress.  None: the requests cannot be polled.
    """
    if channel_test is None and not all(
            _pollable(r.req) or isinstance(r.req, Windowed) for r in pending):
        return None
    windowed = [] if windowed is None else windowed

    def run(left):
        progress = False
        if windowed:
            for w in windowed:
                progress |= w.advance(channel_test)
            windowed[:] = [w for w in windowed if not w.finished]
        plain = [i for i, r in enumerate(left) if type(r.req) is not Windowed]
        done = []
        if plain:
            got = _test_requests([left[i].req for i in plain], channel_test)
            done = [plain[j] for j in got]
            progress |= bool(done)
        if len(plain) < len(left):
            done += [i for i, r in enumerate(left) if type(r.req) is Windowed and r.req.finished]
        return done, progress
    return run


def wait(pending, timeout: float, expired, test, clock=time.perf_counter) -> None:
    """Poll until every request of ``pending`` has completed.

    Args:
        pending: objects with ``.req``, ``.kind`` ("send"/"recv") and ``.done``
            (None until complete; set here to the time the completion was seen).
        timeout: seconds without any completion before giving up.
        expired: ``expired(left, idle)`` returns the exception to raise for the
            requests still pending after ``idle`` seconds without progress.
        test: from :func:`tester`; any completion it reports restarts the deadline.
    """
    left = [r for r in pending if r.done is None]
    if not left:
        return
    last = clock()
    pause = 0.0
    final = False  # the poll after the deadline passed
    while True:
        done, progress = test(left)
        now = clock()
        if done or progress:
            final = False
            # (a windowed message may have completed while another wait polled it)
            for i in done:
                left[i].done = now
            left = [r for r in left if r.done is None]
            if not left:
                return
            last = now
            pause = 0.0
            continue
        idle = now - last
        if idle >= timeout:
            if not final:
                # Poll once more before giving up: this process may itself have
                # been descheduled past the deadline since the last poll, while
                # the requests completed (an overloaded machine, a debugger).
                final = True
                continue
            cancel(left)
            raise expired(left, idle)
        if idle > SPIN_S:
            pause = min(max(2 * pause, MIN_SLEEP_S), MAX_SLEEP_S, timeout - idle)
            time.sleep(pause)


def cancel(left) -> None:
    """Cancel pending receives (MPI-4 deprecates cancelling sends: they are left)."""
    recvs = [r.req for r in left
             if r.kind == "recv" and isinstance(r.req, (MPI.Request, Pieces, Windowed))]
    for req in recvs:
        try:
            req.Cancel()
        except MPI.Exception:
            pass
    end = time.perf_counter() + CANCEL_WAIT_S
    while recvs and time.perf_counter() < end:
        recvs = [req for req in recvs if not req.Test()]


def abort(comm=None, errorcode: int = 1, message: str | None = None) -> NoReturn:
    """Print ``message`` to stderr and end the whole job with ``MPI_Abort``.

    Use it after a :class:`~mpicoll.CollectiveTimeout` (or any error that left
    ranks waiting) so a batch job ends instead of holding its allocation until
    the wall-clock limit.

    Args:
        comm: communicator whose processes are aborted (default ``MPI.COMM_WORLD``;
            most MPI implementations end the whole job whatever it is).
        errorcode: exit status reported to ``mpirun``/``srun``.
        message: printed to stderr as ``mpicoll: rank R: message`` before aborting.

    Example::

        try:
            mpicoll.allreduce(x)
        except mpicoll.CollectiveTimeout as exc:
            mpicoll.abort(message=str(exc))
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm: expected an mpi4py.MPI.Comm, got {type(comm).__name__}")
    if isinstance(errorcode, bool) or not isinstance(errorcode, int):
        raise TypeError(f"errorcode: expected an int, got {type(errorcode).__name__}")
    sys.stdout.flush()
    if message:
        rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else "?"
        sys.stderr.write(f"mpicoll: rank {rank}: {message}\n")
    sys.stderr.flush()
    comm.Abort(errorcode)
    raise SystemExit(errorcode)  # not reached: MPI_Abort does not return
