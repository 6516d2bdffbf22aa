"""Channels for device buffers: straight to a CUDA-aware MPI, or staged through pinned host memory.

Both have the interface of :class:`mpicoll.transport.channel.Channel` (``isend``,
``irecv``, ``wait``, ``waitall`` on 1-D arrays) and wrap a host
channel, which does the MPI calls.  All CUDA work goes through the runtime
object of the device backend (see backends.devices), so a test runtime can stand in.

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

    Sends to a peer are handed to MPI in the order the algorithm issued them
    (MPI's non-overtaking rule then matches them as on the host).  At most
    ``max_send`` send buffers are in use per destination; further sends to it
    wait in its queue, which every channel call advances, so no call blocks on
    a buffer.  The queues are per destination because a send handed to MPI
    may complete only once its receiver has posted the receive, and a
    receiver may first wait for what a third rank sends: with one queue for
    all peers, a rank whose buffers all held sends to one peer could not send
    to another, and the direct AllReduce at 3 ranks, in pieces, waited for
    ever in its ReduceScatter step (every rank's first peer waited on its
    second).  Per destination, each peer's sends wait only for that peer's
    receives, as on a ring link.
    A receive buffer is reused only after its host-to-device copy has run.

Events
    Both channels order work with CUDA events, about four per staged message
    (the send's data ready, its copy done, the receive's buffer free, its
    copy done): creating one is a driver call, 369 of them for one 64 MiB
    AllReduce at 4 ranks in 1 MiB segments.  :class:`EventPool` keeps them
    per context and device and reuses an event only once it completed and
    nothing reads it any more: the ready event once its send's copy was seen
    done (the copy stream waited for it), the free event with its receive's
    copy, the copy events when their buffers are reused, the event ending a
    call once a query says it completed.
"""

from __future__ import annotations

from collections import deque

from mpi4py import MPI

from .channel import is_null, mpi_requests

QUEUED, COPYING, POSTED, DONE = range(4)

DEFAULT_SEND_BUFFERS = 4
DEFAULT_RECV_BUFFERS = 8  # beyond this, a receive waits for a buffer's copy rather than allocate
_MIN_PINNED = 1 << 16
KEEP_LANDED = 2  # landed receive buffers kept for forwarding, besides those in use


def _completed(reqs) -> set:
    """Indices of the complete requests in ``reqs`` (one ``Testsome``, which frees them).

    A request completed earlier (by ``Waitany`` in :meth:`StagingChannel.waitall`)
    is already ``MPI.REQUEST_NULL``, which ``Testsome`` does not report: it counts too.
    """
    MPI.Request.Testsome(mpi_requests(reqs))
    return {i for i, req in enumerate(reqs) if is_null(req)}


def round_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 256 (alignment of a second array in a buffer)."""
    return (nbytes + 255) & ~255


def address(arr) -> int:
    """The device address of ``arr``'s first element."""
    return arr.__cuda_array_interface__["data"][0]


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

    def isend(self, arr, dest, chunk=0):
        self._ready()
        return self.inner.isend(arr, dest, chunk)

    def irecv(self, arr, source, chunk=0):
        self._ready()  # kernels still reading arr's old contents must finish first
        return self.inner.irecv(arr, source, chunk)

    def wait(self, req):
        self.inner.wait(req)

    def waitall(self, reqs):
        self.inner.waitall(reqs)



class EventPool:
    """The CUDA events of one context on one device, reused (see "Events" above).

    :meth:`record` takes a complete event (or one a query finds complete),
    else creates one; :meth:`reuse` gives back events the caller knows
    complete and no longer read, :meth:`release` one that may still be
    pending.  One call at a time uses a context's pool (engine.run).
    """

    def __init__(self, rt):
        self.rt = rt
        self._done: list = []         # complete and unread: reused first
        self._pending = deque()       # unread, maybe pending, oldest first
        self.created = 0              # events this pool created

    def record(self, stream):
        """An event recorded on ``stream`` now (it follows the work queued there)."""
        if self._done:
            event = self._done.pop()
        elif self._pending and self.rt.done(self._pending[0]):
            event = self._pending.popleft()
        else:
            event = self.rt.event()
            self.created += 1
        return self.rt.record(stream, event)

    def reuse(self, *events) -> None:
        """``events`` (None ignored) completed and nothing reads them any more."""
        self._done.extend(e for e in events if e is not None)

    def release(self, event) -> None:
        """``event`` (None ignored) is read no more, but may not have completed."""
        if event is not None:
            self._pending.append(event)
        pending = self._pending
        while len(pending) > 1 and self.rt.done(pending[0]):  # (at most one left waiting)
            self._done.append(pending.popleft())


class StagingPool:
    """Pinned host buffers, copy streams and events of one context on one device.

    Send buffers: at most ``max_send`` in use per destination of a call
    (:class:`StagingChannel` keeps the count), each grown to the largest
    message it carried.  Receive buffers: as many as receives are outstanding
    at once (the algorithms keep a small window), each remembering the
    host-to-device copy that still reads it.  ``events``: the context's
    :class:`EventPool` on this device (a new one if None).
    """

    def __init__(self, rt, max_send: int = DEFAULT_SEND_BUFFERS, events=None):
        self.rt = rt
        self.d2h_stream = rt.new_stream()
        self.h2d_stream = rt.new_stream()
        self.events = EventPool(rt) if events is None else events
        self.max_send = max_send
        self.max_recv = DEFAULT_RECV_BUFFERS
        self._recv_count = 0
        self._send_free: list = []
        self._send_count = 0
        # [(buffer, event of the H2D copy reading it or None, event of the receive's free
        # buffer or None: complete once the copy is, which waited for it)]
        self._recv_free: list = []
        self.allocated = 0          # pinned bytes held
        self._whole = None          # whole-array staging buffer (see backends.devices.WholeStage)

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

    def whole(self, nbytes):
        """The pinned buffer of whole-array staging (one per context and device, grown)."""
        buf = self._whole
        if buf is None or len(buf) < nbytes:
            if buf is not None:
                self.allocated -= len(buf)
            buf = self._whole = self._alloc(nbytes)
        return buf

    def take_send(self, nbytes):
        """A free send buffer of at least ``nbytes``, else a new one."""
        if self._send_free:
            return self._fit(self._send_free.pop(), nbytes)
        self._send_count += 1
        return self._alloc(nbytes)

    def give_send(self, buf):
        self._send_free.append(buf)

    def take_recv(self, nbytes, block=True):
        """A receive buffer of at least ``nbytes`` that no copy reads any more.

        A free one whose host-to-device copy has run; else a new one, up to
        ``max_recv``; beyond that the oldest, once its copy has run: the host
        waits for that copy, or with ``block=False`` gets None instead (the
        channel then advances its MPI transfers and asks again).
        """
        rt = self.rt
        for i, (buf, event, free) in enumerate(self._recv_free):
            if len(buf) >= nbytes and (event is None or rt.done(event)):
                del self._recv_free[i]
                self.events.reuse(event, free)
                return buf
        if self._recv_free and self._recv_count >= self.max_recv:
            buf, event, free = self._recv_free[0]
            if event is not None and not block and not rt.done(event):
                return None
            del self._recv_free[0]
            if event is not None:
                rt.event_synchronize(event)
            self.events.reuse(event, free)
            return self._fit(buf, nbytes)
        self._recv_count += 1
        return self._alloc(nbytes)

    def give_recv(self, buf, event, free=None):
        """``buf`` is free once ``event`` (its host-to-device copy) completed; ``free``: the
        receive's event the copy waited for, reused with it."""
        self._recv_free.append((buf, event, free))


class _Request:
    """A staged transfer; ``Test()`` advances its channel (for callers that poll)."""

    __slots__ = ()

    def Test(self) -> bool:  # mpi4py's name, for callers that poll
        return self.ch.test(self)


class _Send(_Request):
    __slots__ = ("ch", "arr", "dest", "chunk", "ready", "buf", "host", "copied", "req", "state",
                 "landed")

    def __init__(self, ch, arr, dest, ready, chunk=0):
        self.ch = ch
        self.arr = arr
        self.dest = dest
        self.chunk = chunk
        self.ready = ready  # event on the compute stream after the work producing arr
        self.buf = self.host = self.copied = self.req = None
        self.landed = None  # the _Landed receive buffer a forwarded send reads
        self.state = QUEUED


class _Landed:
    """A receive's pinned buffer kept after landing, so the data can be forwarded from it."""

    __slots__ = ("ptr", "nbytes", "buf", "event", "free", "users", "dropped")

    def __init__(self, ptr, nbytes, buf, event, free):
        self.ptr = ptr          # device address and size of the array the data landed in
        self.nbytes = nbytes
        self.buf = buf
        self.event = event      # the host-to-device copy reading buf
        self.free = free        # the receive's event that copy waited for
        self.users = 0          # forwarded sends still reading buf
        self.dropped = False    # no longer forwardable: buf goes back when users reach 0


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
        self._queues: dict = {}       # destination -> its sends QUEUED or COPYING, in isend order
        self._held: dict = {}         # destination -> send buffers its sends hold
        self._posted: list = []       # sends handed to MPI, not yet complete
        self._recvs: list = []        # receives not yet copied to the device
        self._landed: list = []       # _Landed buffers, oldest first (see forget())
        self._forwarding = 0          # forwarded sends in flight (at most pool.max_send)

    # -- the channel interface ---------------------------------------------

    def isend(self, arr, dest, chunk=0):
        send = _Send(self, arr, dest, None, chunk)
        landed = self._landed_holding(arr)
        if landed is not None and self._forwarding < self.pool.max_send:
            # Data that arrived here and was not changed since: send it from the
            # pinned buffer it arrived in, no device-to-host copy (AllGather).
            off = address(arr) - landed.ptr
            send.host = landed.buf[off: off + arr.nbytes].view(arr.dtype)
            send.landed = landed
            landed.users += 1
            self._forwarding += 1
            send.state = COPYING
        else:
            send.ready = self.pool.events.record(self.stream)
        queue = self._queues.get(dest)
        if queue is None:
            queue = self._queues[dest] = deque()
        queue.append(send)
        self._progress()
        return send

    def irecv(self, arr, source, chunk=0):
        self.forget(arr)  # its landed data is about to be overwritten
        free = self.pool.events.record(self.stream)
        buf = self._recv_buffer(arr.nbytes)
        host = buf[: arr.nbytes].view(arr.dtype)
        recv = _Recv(self, arr, free, buf, host, self.inner.irecv(host, source, chunk))
        self._recvs.append(recv)
        return recv

    def _recv_buffer(self, nbytes):
        """A pinned receive buffer; while the host would have to wait for a
        copy to free one, it advances this channel's MPI transfers instead and
        blocks on the copy only when no transfer of ours is outstanding."""
        while True:
            buf = self.pool.take_recv(nbytes, block=not (self._recvs or self._posted))
            if buf is not None:
                return buf
            self._progress()

    def wait(self, req):
        self.waitall((req,))

    def waitall(self, reqs):
        """Advance copies and MPI together until ``reqs`` are complete.

        Both are polled (``Testsome`` on the MPI requests, queries of the
        copy events); the host blocks only when one of them alone is left to
        wait for: in ``Waitany`` when no device-to-host copy is pending, in
        the copy's event when no MPI transfer is.
        """
        pending = [r for r in reqs if r.state != DONE]
        while pending:
            moved = self._progress()
            pending = [r for r in pending if r.state != DONE]
            if not pending or moved:
                continue
            mpi = [r.req for r in self._recvs] + [s.req for s in self._posted]
            head = next((q[0] for q in self._queues.values() if q and q[0].state == COPYING), None)
            if head is None and mpi:
                MPI.Request.Waitany(mpi_requests(mpi))  # only MPI can move: a transfer of ours, or a send
            elif head is not None and not mpi:  # whose buffer a queued send waits for
                self.rt.event_synchronize(head.copied)
            # both outstanding: poll again


    def test(self, req) -> bool:
        """Advance without blocking; True when ``req`` is complete."""
        if req.state != DONE:
            self._progress()
        return req.state == DONE

    # -- progress ----------------------------------------------------------

    def _progress(self) -> int:
        """Do all work that needs no waiting; how many steps moved (0: nothing could)."""
        return (self._land_received() + self._reap_sends() + self._start_copies()
                + self._post_copied())

    def _land_received(self):
        """Queue the host-to-device copy of every receive MPI has completed."""
        if not self._recvs:
            return 0
        rt, pool = self.rt, self.pool
        done = _completed([r.req for r in self._recvs])
        if not done:
            return 0
        still = []
        for i, r in enumerate(self._recvs):
            if i not in done:
                still.append(r)
                continue
            rt.wait_event(pool.h2d_stream, r.free)
            if r.arr.nbytes:
                rt.h2d(r.arr, r.host, pool.h2d_stream)
            landed = pool.events.record(pool.h2d_stream)
            rt.wait_event(self.stream, landed)
            if r.arr.nbytes:
                self._keep_landed(_Landed(address(r.arr), r.arr.nbytes, r.buf, landed, r.free))
            else:
                pool.give_recv(r.buf, landed, r.free)
            r.free = None
            r.state = DONE
        self._recvs = still
        return len(done)

    def _reap_sends(self):
        if not self._posted:
            return 0
        done = _completed([s.req for s in self._posted])
        if not done:
            return 0
        still = []
        for i, s in enumerate(self._posted):
            if i in done:
                if s.landed is None:
                    self.pool.give_send(s.buf)
                    self._held[s.dest] -= 1
                else:
                    self._forwarding -= 1
                    s.landed.users -= 1
                    self._release_if_unused(s.landed)
                s.state = DONE
            else:
                still.append(s)
        self._posted = still
        return len(done)

    def _start_copies(self):
        """Start device-to-host copies of queued sends, in order per destination, while it
        holds fewer than ``max_send`` send buffers."""
        rt, pool, held = self.rt, self.pool, self._held
        started = 0
        for dest, queue in self._queues.items():
            for s in queue:
                if s.state != QUEUED:
                    continue
                if held.get(dest, 0) >= pool.max_send:
                    break
                held[dest] = held.get(dest, 0) + 1
                nbytes = s.arr.nbytes
                s.buf = pool.take_send(nbytes)
                s.host = s.buf[:nbytes].view(s.arr.dtype)
                rt.wait_event(pool.d2h_stream, s.ready)
                if nbytes:
                    rt.d2h(s.host, s.arr, pool.d2h_stream)
                s.copied = pool.events.record(pool.d2h_stream)
                s.state = COPYING
                started += 1
        return started

    def _post_copied(self):
        """Hand sends whose copy finished to MPI, in isend order per destination."""
        rt = self.rt
        posted = 0
        for queue in self._queues.values():
            while queue and queue[0].state == COPYING:
                s = queue[0]
                if s.copied is not None and not rt.done(s.copied):
                    break
                queue.popleft()
                # the copy is done, and the ready event it waited for: both free for reuse
                self.pool.events.reuse(s.ready, s.copied)
                s.ready = s.copied = None
                s.req = self.inner.isend(s.host, s.dest, s.chunk)
                s.state = POSTED
                self._posted.append(s)
                posted += 1
        return posted

    # -- forwarding from landed receive buffers ----------------------------

    def _keep_landed(self, landed):
        self.forget_range(landed.ptr, landed.nbytes)
        self._landed.append(landed)
        # a forward follows its receive within the algorithm's window: keep a few
        unused = [e for e in self._landed if e.users == 0]
        for old in unused[: max(0, len(unused) - KEEP_LANDED)]:
            self._drop(old)

    def _landed_holding(self, arr):
        """The landed buffer whose data ``arr`` (device) holds unchanged, or None."""
        if not self._landed or not arr.nbytes:
            return None
        ptr = address(arr)
        for e in reversed(self._landed):
            if e.ptr <= ptr and ptr + arr.nbytes <= e.ptr + e.nbytes:
                return e
        return None

    def forget(self, arr):
        """Device work is about to write ``arr``: data landed there can no longer be forwarded."""
        if self._landed and arr.nbytes:
            self.forget_range(address(arr), arr.nbytes)

    def forget_range(self, ptr, nbytes):
        for e in [e for e in self._landed if e.ptr < ptr + nbytes and ptr < e.ptr + e.nbytes]:
            self._drop(e)

    def _drop(self, landed):
        self._landed.remove(landed)
        landed.dropped = True
        self._release_if_unused(landed)

    def _release_if_unused(self, landed):
        if landed.dropped and landed.users == 0:
            self.pool.give_recv(landed.buf, landed.event, landed.free)

    def close(self):
        """The call is over (every request complete): give back the kept receive buffers."""
        for e in list(self._landed):
            self._drop(e)
