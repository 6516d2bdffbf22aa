"""Channels for device buffers: straight to a CUDA-aware MPI, or staged through pinned host memory.

Both have the interface of :class:`mpicoll._channel.Channel` (``isend``,
``irecv``, ``wait``, ``waitall``, ``sendrecv`` on 1-D arrays) and wrap a host
channel, which does the MPI calls.  All CUDA work goes through the runtime
object of the device backend (see _devices), so a test runtime can stand in.

Stream contract
    Device work is asynchronous.  The caller's current stream when the
    collective starts is the *compute stream*: mpicoll's reduction kernels run
    on it, after the caller's own work.  No buffer is handed to MPI before the
    work that produced it is complete, and when the collective returns, its
    result is ready for work on the compute stream (other streams must wait
    on it).

:class:`DirectChannel` (CUDA-aware MPI)
    Synchronises the compute stream before handing a device buffer to MPI,
    whenever device work was queued since it last did (the caller's, at the
    first call; mpicoll's reductions and copies after that).

:class:`StagingChannel` (any MPI)
    Every message moves through a pinned host buffer; the reduction stays on
    the GPU.  Two copy streams (one per direction) do the transfers, ordered
    against the compute stream by events, so the host blocks only to wait for
    a device-to-host copy before its MPI send::

        compute stream   reduce k ──ev──────────── reduce k+1 ──ev──── ...
        D2H stream              └─ wait ev, D2H k ─ev─┐   └─ wait, D2H k+1
        host (MPI)                                    └─ Isend k   (D2H k+1 runs meanwhile)
        receiver         Irecv k into pinned ── done ── H2D k on the H2D stream ──ev──┐
        compute stream   ............................................. wait ev ── reduce k

    Sends are handed to MPI in the order the algorithm issued them (MPI's
    non-overtaking rule then matches them as on the host).  At most
    ``max_send`` send buffers are in use per context; further sends wait in a
    queue, which every channel call advances, so no call blocks on a buffer.
    A receive buffer is reused only after its host-to-device copy has run.
"""

from __future__ import annotations

from collections import deque

from mpi4py import MPI

from ._channel import Channel, mpi_requests

QUEUED, COPYING, POSTED, DONE = range(4)

DEFAULT_SEND_BUFFERS = 4
_MIN_PINNED = 1 << 16


class DirectChannel:
    """Device buffers straight to a CUDA-aware MPI, after the stream that wrote them is idle."""

    __slots__ = ("inner", "backend", "stream", "_synced")

    def __init__(self, inner, backend, stream):
        self.inner = inner
        self.backend = backend
        self.stream = stream
        self._synced = None  # backend.launches at our last synchronize (None: never)

    def _ready(self):
        launches = self.backend.launches
        if launches != self._synced:
            self.backend.rt.synchronize(self.stream)
            self._synced = launches

    def isend(self, arr, dest):
        self._ready()
        return self.inner.isend(arr, dest)

    def irecv(self, arr, source):
        self._ready()  # kernels still reading arr's old contents must finish first
        return self.inner.irecv(arr, source)

    def wait(self, req):
        self.inner.wait(req)

    def waitall(self, reqs):
        self.inner.waitall(reqs)

    sendrecv = Channel.sendrecv


class StagingPool:
    """Pinned host buffers and copy streams of one context on one device.

    Send buffers: at most ``max_send``, each grown to the largest message it
    carried.  Receive buffers: as many as receives are outstanding at once (the
    algorithms keep a small window), each remembering the host-to-device copy
    that still reads it.
    """

    def __init__(self, rt, max_send: int = DEFAULT_SEND_BUFFERS):
        self.rt = rt
        self.d2h_stream = rt.new_stream()
        self.h2d_stream = rt.new_stream()
        self.max_send = max_send
        self._send_free: list = []
        self._send_count = 0
        self._recv_free: list = []  # [(buffer, event of the H2D copy reading it, or None)]
        self.allocated = 0          # pinned bytes held

    def _alloc(self, nbytes):
        size = _MIN_PINNED
        while size < nbytes:
            size *= 2
        self.allocated += size
        return self.rt.pinned(size)

    def _fit(self, buf, nbytes):
        if len(buf) >= nbytes:
            return buf
        self.allocated -= len(buf)
        return self._alloc(nbytes)

    def take_send(self, nbytes):
        """A free send buffer of at least ``nbytes``, or None when all are in use."""
        if self._send_free:
            return self._fit(self._send_free.pop(), nbytes)
        if self._send_count < self.max_send:
            self._send_count += 1
            return self._alloc(nbytes)
        return None

    def give_send(self, buf):
        self._send_free.append(buf)

    def take_recv(self, nbytes):
        """A receive buffer of at least ``nbytes`` that no copy reads any more."""
        rt = self.rt
        for i, (buf, event) in enumerate(self._recv_free):
            if len(buf) >= nbytes and (event is None or rt.done(event)):
                del self._recv_free[i]
                return buf
        if self._recv_free:
            buf, event = self._recv_free.pop(0)
            if event is not None:
                rt.event_synchronize(event)
            return self._fit(buf, nbytes)
        return self._alloc(nbytes)

    def give_recv(self, buf, event):
        self._recv_free.append((buf, event))


class _Request:
    """A staged transfer; ``Test()`` advances its channel (for callers that poll)."""

    __slots__ = ()

    def Test(self) -> bool:  # mpi4py's name, for callers that poll
        return self.ch.test(self)


class _Send(_Request):
    __slots__ = ("ch", "arr", "dest", "ready", "buf", "host", "copied", "req", "state")

    def __init__(self, ch, arr, dest, ready):
        self.ch = ch
        self.arr = arr
        self.dest = dest
        self.ready = ready  # event on the compute stream after the work producing arr
        self.buf = self.host = self.copied = self.req = None
        self.state = QUEUED


class _Recv(_Request):
    __slots__ = ("ch", "arr", "free", "buf", "host", "req", "state")

    def __init__(self, ch, arr, free, buf, host, req):
        self.ch = ch
        self.arr = arr
        self.free = free    # event on the compute stream after the last use of arr's old contents
        self.buf = buf
        self.host = host
        self.req = req
        self.state = POSTED


class StagingChannel:
    """Device messages through pinned host buffers, copies overlapped with MPI transfers."""

    def __init__(self, inner, backend, pool, stream):
        self.inner = inner
        self.rt = backend.rt
        self.backend = backend
        self.pool = pool
        self.stream = stream
        self._queue: deque = deque()  # sends QUEUED or COPYING, in isend order
        self._posted: list = []       # sends handed to MPI, not yet complete
        self._recvs: list = []        # receives not yet copied to the device

    # -- the channel interface ---------------------------------------------

    def isend(self, arr, dest):
        send = _Send(self, arr, dest, self.rt.record(self.stream))
        self._queue.append(send)
        self._progress(block_copies=False)
        return send

    def irecv(self, arr, source):
        free = self.rt.record(self.stream)
        buf = self.pool.take_recv(arr.nbytes)
        host = buf[: arr.nbytes].view(arr.dtype)
        recv = _Recv(self, arr, free, buf, host, self.inner.irecv(host, source))
        self._recvs.append(recv)
        return recv

    def wait(self, req):
        self.waitall((req,))

    def waitall(self, reqs):
        pending = [r for r in reqs if r.state != DONE]
        while pending:
            self._progress(block_copies=True)
            pending = [r for r in pending if r.state != DONE]
            if not pending:
                return
            # Nothing more can happen here until MPI completes a transfer:
            # one of ours, or a send whose buffer a queued send is waiting for.
            mpi = [r.req for r in self._recvs] + [s.req for s in self._posted]
            MPI.Request.Waitany(mpi_requests(mpi))  # (a large message's pieces)

    sendrecv = Channel.sendrecv

    def test(self, req) -> bool:
        """Advance without blocking; True when ``req`` is complete."""
        if req.state != DONE:
            self._progress(block_copies=False)
        return req.state == DONE

    # -- progress ----------------------------------------------------------

    def _progress(self, block_copies):
        """Do all work that needs no remote progress (``block_copies``: wait for D2H copies too)."""
        self._land_received()
        self._reap_sends()
        self._start_copies()
        self._post_copied(block_copies)
        # With block_copies, no copy is left unposted: a send still queued is
        # waiting for a buffer held by a posted send, which MPI will complete.

    def _land_received(self):
        """Queue the host-to-device copy of every receive MPI has completed."""
        if not self._recvs:
            return
        rt, pool = self.rt, self.pool
        still = []
        for r in self._recvs:
            if not r.req.Test():
                still.append(r)
                continue
            rt.wait_event(pool.h2d_stream, r.free)
            if r.arr.nbytes:
                rt.h2d(r.arr, r.host, pool.h2d_stream)
            landed = rt.record(pool.h2d_stream)
            rt.wait_event(self.stream, landed)
            pool.give_recv(r.buf, landed)
            r.state = DONE
        self._recvs = still

    def _reap_sends(self):
        if not self._posted:
            return
        still = []
        for s in self._posted:
            if s.req.Test():
                self.pool.give_send(s.buf)
                s.state = DONE
            else:
                still.append(s)
        self._posted = still

    def _start_copies(self):
        """Start device-to-host copies of queued sends, in order, while send buffers are free."""
        rt, pool = self.rt, self.pool
        for s in self._queue:
            if s.state != QUEUED:
                continue
            nbytes = s.arr.nbytes
            buf = pool.take_send(nbytes)
            if buf is None:
                return
            s.buf = buf
            s.host = buf[:nbytes].view(s.arr.dtype)
            rt.wait_event(pool.d2h_stream, s.ready)
            if nbytes:
                rt.d2h(s.host, s.arr, pool.d2h_stream)
            s.copied = rt.record(pool.d2h_stream)
            s.state = COPYING

    def _post_copied(self, block):
        """Hand sends whose copy finished to MPI, in isend order."""
        rt, queue = self.rt, self._queue
        while queue and queue[0].state == COPYING:
            s = queue[0]
            if not rt.done(s.copied):
                if not block:
                    return
                rt.event_synchronize(s.copied)
            queue.popleft()
            s.req = self.inner.isend(s.host, s.dest)
            s.state = POSTED
            self._posted.append(s)
