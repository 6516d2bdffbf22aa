"""A fake GPU for CPU CI: device arrays over host memory, asynchronous streams.

mpi4py's own test suite checks its CUDA-array-interface path with objects
that expose ``__cuda_array_interface__`` over host memory; this module does
the same for mpicoll and adds what mpicoll's device code needs from CuPy and
CUDA, as a *runtime* object that replaces :class:`mpicoll.backends.devices.CupyRuntime`:

* :class:`FakeArray`: a CuPy-like array (``__cuda_array_interface__``,
  slicing, ``reshape``, ``view``, ``flags`` without ``writeable`` as in CuPy,
  no implicit conversion to NumPy).  Fresh arrays are filled with a poison
  byte pattern, so an element nobody wrote shows up as wrong.
* :class:`FakeStream`: work queued on a stream runs *later*, only when
  something forces it: a synchronize, an event query or synchronize, or a
  stream waiting on an event of it (which forces it up to the event when the
  wait itself runs).  A ``lazy`` stream never runs work on its own, an
  ``eager`` one runs it at once, like a fast engine.  So a missing
  synchronisation leaves stale bytes in host memory where MPI reads them, and
  the test sees wrong data instead of passing by luck.
* :class:`FakeRuntime`: the runtime interface (array module ``xp``, streams
  with a current one per thread, events, pinned buffers, async copies, device
  count/names/selection, CUDA IPC, the fused fold) plus a ``log`` of what
  happened, in order, for tests of the stream contract, and ``events_created``.
  Every device allocation is a file of its own in memory
  (``memfd_create``), with a buffer id as the driver gives one: another
  process maps it through ``/proc/<pid>/fd/<fd>`` as CUDA IPC maps an
  allocation (``ipc_range``, ``ipc_handle``, ``ipc_open``), and an allocation
  is freed when its last array goes.  Interprocess events are counters in
  such memory (records queued, records run, the record a peer's stream
  waits for): a stream waiting on a peer's event spins, when it runs, until
  the peer's stream ran that record.  As a GPU runs work nobody forced, a
  process runs its stream up to a record a peer waits for whenever its host
  waits (a message of mpicoll's channel, or a wait of its own stream):
  :meth:`FakeRuntime.serve`.  Nothing else runs, so a wait that is missing
  shows as stale data under lazy streams; a rank that never serves stops its
  peers (an error after :data:`EVENT_WAIT_S`, not a hang).

:func:`fake_backend` wraps a runtime in mpicoll's real
:class:`~mpicoll.backends.devices.DeviceBackend`, so the staging channel, the
reduction dispatch and the stream handling under test are mpicoll's own code;
:func:`registered` puts it first in mpicoll's backend list for a ``with`` block.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import stat
import struct
import threading
import time
import weakref

import numpy as np
from mpi4py import MPI

from mpicoll.backends import cuda as _cuda
from mpicoll.backends import devices as _devices
from mpicoll.backends import registry as _registry

POISON = 0xA7
_names = itertools.count()
_buffer_ids = itertools.count(1)  # (the driver's BUFFER_ID: never the same twice in a process)
_HEADER = 64  # bytes before an allocation's memory in its file: its token
_HANDLE = struct.Struct("<QiQ16sQ")  # pid, fd, buffer id, token, bytes
EVENT_WAIT_S = 60.0  # how long a stream waits for a peer's event before it raises


class FakeFlags:
    """CuPy's flags: no ``writeable`` (CuPy arrays are always writable)."""

    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, h, owndata):
        self.c_contiguous = bool(h.flags.c_contiguous)
        self.f_contiguous = bool(h.flags.f_contiguous)
        self.owndata = owndata


class FakeArray:
    """A device array whose memory is host memory (the CUDA array interface points at it)."""

    __slots__ = ("_h", "_rt", "_owndata", "__weakref__")

    def __init__(self, rt, h, owndata=False):
        self._rt = rt
        self._h = h
        self._owndata = owndata
        rt.arrays += 1

    # what mpicoll and the tests read
    shape = property(lambda self: self._h.shape)
    ndim = property(lambda self: self._h.ndim)
    size = property(lambda self: self._h.size)
    dtype = property(lambda self: self._h.dtype)
    nbytes = property(lambda self: self._h.nbytes)
    strides = property(lambda self: self._h.strides)
    itemsize = property(lambda self: self._h.itemsize)
    flags = property(lambda self: FakeFlags(self._h, self._owndata))

    @property
    def __cuda_array_interface__(self):
        h = self._h
        return {
            "shape": h.shape,
            "typestr": h.dtype.str,
            "data": (h.ctypes.data if h.size else 0, False),
            "strides": None if h.flags.c_contiguous else h.strides,
            "version": 3,
            "stream": None,
        }

    def __len__(self):
        return len(self._h)

    def __getitem__(self, index):
        return FakeArray(self._rt, self._h[index])

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed (FakeArray, like CuPy); "
                        "use .get()")

    def __repr__(self):
        return f"FakeArray(shape={self.shape}, dtype={self.dtype})"

    def reshape(self, *shape, order="C"):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        out = self._h.reshape(shape, order=order)
        if not np.shares_memory(out, self._h) and out.size:
            raise AssertionError("FakeArray.reshape would copy")  # mpicoll only reshapes contiguous arrays
        return FakeArray(self._rt, out)

    def ravel(self):
        return self.reshape(-1)

    def view(self, dtype):
        dtype = np.dtype(dtype)
        if dtype.fields is not None:
            raise TypeError(f"Unsupported dtype {dtype} (structured dtypes are not CuPy dtypes)")
        return FakeArray(self._rt, self._h.view(dtype))

    def copy(self):
        out = self._rt.xp.empty(self.shape, self.dtype)
        self._rt.xp.copyto(out, self)
        return out

    def get(self):
        return self._rt.to_host(self)


class FakeUfunc:
    """``ufunc(a, b, out=c)`` queued as a kernel on the current stream."""

    def __init__(self, rt, np_ufunc):
        self._rt = rt
        self._f = np_ufunc
        self.__name__ = np_ufunc.__name__

    def __call__(self, a, b, out):
        f = self._f
        ah, bh, oh = a._h, b._h, out._h
        self._rt.launch(lambda: f(ah, bh, out=oh), f"kernel {f.__name__}")
        return out


class FakeXp:
    """The part of the ``cupy`` module mpicoll and the tests use."""

    def __init__(self, rt):
        self._rt = rt
        self.ndarray = FakeArray
        for ufunc in _devices._types.NUMPY_UFUNCS.values():
            setattr(self, ufunc.__name__, FakeUfunc(rt, ufunc))

    def empty(self, shape, dtype=np.float64):
        h = self._rt.allocate(shape, dtype)
        h.view(np.uint8).reshape(-1)[:] = POISON if h.size else 0
        return FakeArray(self._rt, h, owndata=True)

    def asarray(self, obj):
        """Host data -> a new device array (a synchronous copy, as cupy.asarray does)."""
        if isinstance(obj, FakeArray):
            return obj
        data = np.asarray(obj)
        h = self._rt.allocate(data.shape, data.dtype)
        h[...] = data
        return FakeArray(self._rt, h, owndata=True)

    def asnumpy(self, a):
        return self._rt.to_host(a)

    def copyto(self, dst, src):
        dh, sh = dst._h, src._h
        self._rt.launch(lambda: np.copyto(dh, sh), "kernel copyto")

    def may_share_memory(self, a, b):
        return np.may_share_memory(a._h, b._h)


class FakeEvent:
    """An event: the work of ``stream`` up to ``pos`` when it was last recorded (recorded again,
    it stands for later work, as a CUDA event does)."""

    __slots__ = ("stream", "pos", "queries")

    def __init__(self, stream=None, pos=0):
        self.stream = stream
        self.pos = pos
        self.queries = 0

    @property
    def complete(self) -> bool:
        return self.stream.executed >= self.pos


class FakeIpcEvent:
    """An interprocess event, in memory both processes map: ``counts[0]`` records its owner
    queued, ``counts[1]`` the last one its owner's stream ran, ``counts[2]`` the last one a
    peer's stream waits for.  The owner's own object keeps ``pending``: (record, stream,
    position in it) of the records not run yet."""

    __slots__ = ("counts", "keep", "pid", "rt", "pending")

    def __init__(self, counts, keep, pid, rt):
        self.counts, self.keep, self.pid, self.rt = counts, keep, pid, rt
        self.pending: list = []

    def reached(self, target: int) -> None:
        """Return once the owner's stream ran its record ``target`` (a stream's wait), this
        process serving its own records meanwhile."""
        deadline = time.monotonic() + EVENT_WAIT_S
        counts = self.counts
        while counts[1] < target:
            if counts[2] < target:
                counts[2] = target
            self.rt.serve()
            if counts[1] >= target:
                return
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"fake GPU: waiting for an event of process {self.pid}, "
                                   f"which ended before its stream ran the record") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake GPU: a stream waited {EVENT_WAIT_S:g} s for record "
                                   f"{target} of process {self.pid}'s event; that process "
                                   f"never ran its stream so far")
            time.sleep(0.0005)


class _Mapped:
    """A peer's allocation mapped here (what ipc_open keeps)."""

    __slots__ = ("name", "mm")

    def __init__(self, name, mm):
        self.name, self.mm = name, mm


class FakeStream:
    """An in-order queue of work that runs when forced (``lazy``) or at once (``eager``)."""

    def __init__(self, rt, name, eager=False):
        self.rt = rt
        self.name = name
        self.eager = eager
        self.ops = []
        self.executed = 0  # ops run so far
        self.queued = 0    # ops ever queued
        self.running = False  # in one of its ops (which may wait: see FakeRuntime.serve)

    def enqueue(self, fn, what):
        self.ops.append((fn, what))
        self.queued += 1
        self.rt.log.append(("queue", self.name, what))
        if self.eager:
            self.run_until(self.queued)

    def run_until(self, pos):
        if self.running:  # (asked again from inside one of its ops: it is not there yet)
            return
        self.running = True
        try:
            while self.executed < pos:
                fn, what = self.ops.pop(0)
                self.executed += 1
                fn()
                self.rt.log.append(("run", self.name, what))
        finally:
            self.running = False

    def synchronize(self):
        self.run_until(self.queued)


class FakeRuntime:
    """The runtime interface of mpicoll.backends.devices over host memory (see the module docstring).

    Args:
        compute: "lazy" or "eager" for the default (caller's) stream.
        copies: "lazy" or "eager" for streams made with ``new_stream``.
        slow_queries: the first query of each event answers "not yet".
        query_lag: the first ``query_lag`` queries of each event answer "not
            yet" (default 1 with ``slow_queries``, else 0): work that takes a
            while, so a caller that blocks on it instead of polling shows up.
        devices: how many fake GPUs are visible.
        context_error: ``use_device`` raises RuntimeError with this text (a CUDA
            context that cannot be created: exclusive-process mode, MIG, memory).
    """

    name = "fakegpu"
    version = "0.0-fake"

    def __init__(self, compute="lazy", copies="lazy", slow_queries=True, devices=1,
                 context_error=None, query_lag=None, ipc_error=None):
        self.log = []
        self.copies_eager = copies == "eager"
        self.slow_queries = slow_queries
        self.query_lag = (1 if slow_queries else 0) if query_lag is None else query_lag
        self.null = FakeStream(self, "compute", eager=compute == "eager")
        self._thread = threading.local()  # the current stream, per thread (as CuPy's)
        self.events_created = 0
        self.arrays = 0  # FakeArray objects made: allocations and views (CuPy ndarrays)
        self.pinned_buffers = []
        self.mpi_requests = []  # MPI requests of the RecordingChannel (see mpi_outstanding)
        self.devices = devices
        self.context_error = context_error
        self.device = 0
        self._streams = 0
        self.ipc_error = ipc_error  # ipc_export raises RuntimeError with it (IPC refused)
        self.ipc_opened = 0  # peers' buffers open now
        self.allocations = {}  # base address -> (bytes, buffer id, fd, token) of live ones
        self._roots = weakref.WeakValueDictionary()  # base address -> its host array
        self.ipc_events = []  # this process's interprocess events (serve)
        self.xp = FakeXp(self)

    # arrays
    def claims(self, obj):
        return isinstance(obj, FakeArray)

    def asarray(self, obj):
        if not isinstance(obj, FakeArray):
            raise TypeError(f"not a fake device array: {type(obj).__name__}")
        return obj

    def ufunc(self, name):
        return getattr(self.xp, _devices._types.NUMPY_UFUNCS[name].__name__)

    def address(self, arr):
        return arr.__cuda_array_interface__["data"][0]

    def unowned(self, ptr, n, dtype):
        """A 1-D array of ``n`` elements at ``ptr`` that keeps no array object alive
        (UnownedMemory).  Its memory stays allocated while it lives: CuPy's pool reuses a
        freed block only after the work queued on its stream, where the fake frees host
        memory at once (a kernel still queued would write freed memory)."""
        dtype = np.dtype(dtype)
        if not n:
            return self.xp.empty(0, dtype)
        nbytes = n * dtype.itemsize
        for base, (size, _, _, _) in self.allocations.items():
            root = self._roots.get(base) if base <= ptr < base + size else None
            if root is not None:
                return FakeArray(self, root[ptr - base: ptr - base + nbytes].view(dtype))
        # (memory the fake did not allocate: the tests keep it alive)
        return FakeArray(self, np.frombuffer(MPI.buffer.fromaddress(ptr, nbytes), dtype))

    @property
    def current(self):
        """This thread's current stream (the null stream unless one was made current)."""
        return getattr(self._thread, "stream", self.null)

    @current.setter
    def current(self, stream):
        self._thread.stream = stream

    def allocate(self, shape, dtype):
        """A host array standing for a ``cudaMalloc`` of its bytes: a file in memory of its
        own (empty arrays: none), freed (its descriptor closed) when no array of it is left."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not nbytes:
            return np.empty(shape, dtype)
        fd = os.memfd_create("fakegpu", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _HEADER + nbytes)
            mm = mmap.mmap(fd, _HEADER + nbytes)
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(16)
        mm[:16] = token
        root = np.frombuffer(mm, np.uint8, nbytes, _HEADER)
        base = root.ctypes.data
        bid = next(_buffer_ids)
        self.allocations[base] = (nbytes, bid, fd, token)
        self._roots[base] = root
        weakref.finalize(root, _free, self.allocations, self.log, base, bid, fd)
        return root.view(dtype).reshape(shape)

    def ipc_range(self, ptr):
        """(base, bytes, buffer id) of the allocation holding ``ptr`` (cuPointerGetAttributes'
        RANGE_START_ADDR, RANGE_SIZE, BUFFER_ID); OSError for memory not allocated here."""
        for base, (nbytes, bid, _, _) in self.allocations.items():
            if base <= ptr < base + nbytes:
                return base, nbytes, bid
        raise OSError(f"{ptr:#x}: not device memory cudaIpcGetMemHandle can share")

    def ipc_handle(self, base):
        """The handle of the allocation starting at ``base`` (cudaIpcGetMemHandle)."""
        nbytes, bid, fd, token = self.allocations[base]
        self.log.append(("ipc handle", bid))
        return _HANDLE.pack(os.getpid(), fd, bid, token, nbytes)

    def _map(self, handle, nbytes):
        """(uint8 array of ``nbytes``, what keeps it) of a peer's allocation."""
        pid, fd, bid, token, size = _HANDLE.unpack(bytes(handle[:_HANDLE.size]))
        if size < nbytes:
            raise OSError(f"allocation {bid} of process {pid}: {size} bytes, not {nbytes}")
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
                    or st.st_size != _HEADER + size:
                raise OSError(f"allocation {bid} of process {pid}: not its file")
            mm = mmap.mmap(f, _HEADER + size)
        finally:
            os.close(f)
        if mm[:16] != token:
            raise OSError(f"allocation {bid} of process {pid}: gone (another file there now)")
        return np.frombuffer(mm, np.uint8, nbytes, _HEADER), _Mapped(f"{pid}:{bid}", mm)

    def fold(self, name, xs, outs):
        """A ``Fold`` as one queued kernel: the NumPy ufunc from the left, then every output."""
        f = _devices._types.NUMPY_UFUNCS[name]
        hs, os_ = [x._h for x in xs], [o._h for o in outs]

        def run():
            acc = hs[0].copy()
            for h in hs[1:]:
                f(acc, h, out=acc)
            for o in os_:
                o[...] = acc

        self.launch(run, "kernel fold")

    def launch(self, fn, what="kernel"):
        """Queue device work on the current stream (a kernel)."""
        self.current.enqueue(fn, what)

    @contextlib.contextmanager
    def using(self, stream):
        """Make ``stream`` current for a block (``with cupy.cuda.Stream():``)."""
        previous, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = previous

    # streams and events
    def current_stream(self):
        return self.current

    def new_stream(self):
        self._streams += 1
        return FakeStream(self, f"stream{self._streams}", eager=self.copies_eager)

    def synchronize(self, stream):
        self.log.append(("sync", stream.name))
        stream.synchronize()

    def event(self):
        """A new event (``events_created`` counts them)."""
        self.events_created += 1
        return FakeEvent()

    def record(self, stream, event=None):
        """Record ``event`` (a new one if None) on ``stream``: it stands for the work queued
        there so far.  Logged as ("record", stream)."""
        event = self.event() if event is None else event
        event.stream, event.pos, event.queries = stream, stream.queued, 0
        self.log.append(("record", stream.name))
        return event

    def wait_event(self, stream, event):
        # (the work the event stands for now: recording it again later changes nothing here)
        target, pos = event.stream, event.pos
        stream.enqueue(lambda: target.run_until(pos), f"wait {target.name}@{pos}")

    def done(self, event):
        event.queries += 1
        if event.queries <= self.query_lag and not event.complete:
            return False
        event.stream.run_until(event.pos)
        self.log.append(("event done", event.stream.name))
        return True

    def event_synchronize(self, event):
        event.stream.run_until(event.pos)
        self.log.append(("event sync", event.stream.name))

    # host memory and copies
    def pinned(self, nbytes):
        buf = np.empty(nbytes, dtype=np.uint8)
        self.pinned_buffers.append(buf)
        return buf

    def is_pinned(self, arr):
        base = arr
        while isinstance(base, np.ndarray) and base.base is not None:
            base = base.base
        return any(base is b for b in self.pinned_buffers)

    def d2h(self, host, dev, stream):
        dh = dev._h
        stream.enqueue(lambda: np.copyto(host.view(np.uint8), dh.view(np.uint8)), "d2h")

    def h2d(self, dev, host, stream):
        dh = dev._h
        stream.enqueue(lambda: np.copyto(dh.view(np.uint8), host.view(np.uint8)), "h2d")

    def to_host(self, dev):
        self.synchronize(self.current)
        return dev._h.copy()

    def to_device(self, dev, host):
        snapshot = np.array(host, copy=True)
        dh = dev._h
        self.launch(lambda: np.copyto(dh, snapshot), "to_device")

    # node memory (mpicoll.transport.shared): CUDA IPC over the allocations' files, so
    # ranks in other processes map each other's fake device buffers as real ones
    def ipc_export(self, nbytes):
        if self.ipc_error is not None:
            raise RuntimeError(self.ipc_error)
        arr = self.xp.empty(nbytes, np.uint8)
        base = arr._h.ctypes.data
        self.log.append(("ipc export", self.allocations[base][1]))
        return self.ipc_handle(base), arr, arr

    def ipc_open(self, handle, nbytes):
        h, keep = self._map(handle, nbytes)
        self.log.append(("ipc open", keep.name))
        self.ipc_opened += 1
        return FakeArray(self, h), keep

    def ipc_close(self, keep):
        self.log.append(("ipc close", keep.name))
        self.ipc_opened -= 1
        keep.mm = None

    def ipc_settled(self, keep):
        """(the handle stays valid while the allocation lives)"""

    def ipc_free(self, arr):
        self.log.append(("ipc free", self.allocations.get(arr._h.ctypes.data, (0, None))[1]))

    # interprocess events: FakeIpcEvent
    def ipc_event(self):
        arr = self.xp.empty(3, np.uint64)
        arr._h[:] = 0
        event = FakeIpcEvent(arr._h, arr, os.getpid(), self)
        self.ipc_events.append(event)
        return self.ipc_handle(arr._h.ctypes.data), event

    def ipc_open_event(self, handle):
        h, keep = self._map(handle, 24)
        self.log.append(("ipc open event", keep.name))
        pid = _HANDLE.unpack(bytes(handle[:_HANDLE.size]))[0]
        return FakeIpcEvent(h.view(np.uint64), keep, pid, self)

    def ipc_close_event(self, event):
        self.log.append(("ipc close event", event.keep.name))
        event.keep.mm = None

    def record_ipc(self, stream, event):
        counts = event.counts
        counts[0] += 1
        n = int(counts[0])
        event.pending.append((n, stream, stream.queued + 1))
        stream.enqueue(lambda: counts.__setitem__(1, max(int(counts[1]), n)), "record ipc event")

    def serve(self):
        """Run this process's streams up to the records its peers' streams wait for (what a
        GPU does on its own while the host waits; nothing more)."""
        for event in self.ipc_events:
            counts, pending = event.counts, event.pending
            want = int(counts[2])
            while pending and (pending[0][0] <= counts[1] or pending[0][0] <= want):
                n, stream, pos = pending[0]
                if n > counts[1]:
                    stream.run_until(pos)
                    if stream.executed < pos:
                        break  # (that stream is inside one of its own ops)
                pending.pop(0)

    def wait_ipc(self, stream, event):
        target = int(event.counts[0])  # (the last record queued now, as cudaStreamWaitEvent)
        stream.enqueue(lambda: event.reached(target), f"wait ipc event {event.pid}@{target}")

    def ipc_device(self):
        return f"fake:{self.device}"

    # devices
    def device_count(self):
        return self.devices

    def device_name(self, index):
        return f"Fake GPU {index}"

    def current_device(self):
        return self.device

    def use_device(self, index):
        if not 0 <= index < self.devices:
            raise ValueError(f"invalid device {index}")
        if self.context_error is not None:
            raise RuntimeError(self.context_error)
        self.device = index


def _free(allocations, log, base, bid, fd):
    """An allocation's last array went: its file goes (mappings in peers stay valid)."""
    if allocations.get(base, (0, None))[1] == bid:
        del allocations[base]
    log.append(("free", bid))
    os.close(fd)


class RecordingChannel:
    """The host channel under a device channel, logging each MPI call into the runtime's log."""

    def __init__(self, inner, rt):
        self.inner = inner
        self.rt = rt

    def isend(self, arr, dest, chunk=0):
        self.rt.log.append(("mpi isend", dest, arr))
        return self._keep(self.inner.isend(arr, dest, chunk))

    def irecv(self, arr, source, chunk=0):
        self.rt.log.append(("mpi irecv", source, arr))
        return self._keep(self.inner.irecv(arr, source, chunk))

    def _keep(self, req):
        """Remember ``req`` in the runtime's ``mpi_requests`` (for :func:`mpi_outstanding`)."""
        reqs = self.rt.mpi_requests
        reqs[:] = [r for r in reqs if r != MPI.REQUEST_NULL]
        reqs.append(req)
        return req

    def test(self, req):
        """Whether ``req`` completed (a timed wait polls this), serving meanwhile."""
        self.rt.serve()
        return self.inner.testall([req])

    def wait(self, req):
        self.waitall([req])

    def waitall(self, reqs):
        """Wait, running this process's streams up to what the peers' streams wait for
        meanwhile (FakeRuntime.serve)."""
        while not self.inner.testall(reqs):
            self.rt.serve()
            time.sleep(0.0001)
        self.inner.waitall(reqs)



class FakeBackend(_devices.DeviceBackend):
    """mpicoll's DeviceBackend on a FakeRuntime, with its MPI calls logged."""

    def host_channel(self, ctx, mpitype):
        return RecordingChannel(super().host_channel(ctx, mpitype), self.rt)


def fake_backend(**runtime_options) -> FakeBackend:
    rt = FakeRuntime(**runtime_options)
    return FakeBackend(lambda: rt, name=f"fakegpu{next(_names)}")


@contextlib.contextmanager
def registered(backend):
    """Put ``backend`` first in mpicoll's list of device backends for a block.

    Its memory is host memory, which MPI reads whatever its transport: in the
    block a forced yes (``cuda_aware=True``) stands whatever UCX this process
    loaded (mpicoll refuses it where that UCX has no CUDA transport, for real
    device memory).
    """
    saved = _cuda._ucx_without_cuda
    _cuda._ucx_without_cuda = lambda: None
    _registry.register(backend, first=True)
    try:
        yield backend
    finally:
        _registry.unregister(backend)
        _cuda._ucx_without_cuda = saved


def produce(rt, host):
    """A device array that a (lazy) kernel on the current stream fills with ``host``.

    Like launching a long kernel that writes a collective's input just before
    the call: until something forces the stream, the array holds poison.
    """
    host = np.ascontiguousarray(host)
    x = rt.xp.empty(host.shape, host.dtype)
    xh, snapshot = x._h, host.copy()
    rt.launch(lambda: np.copyto(xh, snapshot), "producer kernel")
    return x


def peek(x):
    """The bytes a device array holds right now, without running queued work."""
    return x._h.copy()


def mpi_outstanding(rt) -> int:
    """How many MPI requests of mpicoll's channel are incomplete now (without completing any)."""
    return sum(1 for r in rt.mpi_requests if r != MPI.REQUEST_NULL and not r.Get_status())
