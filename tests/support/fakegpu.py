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
  count/names/selection, CUDA IPC over the host's node memory (memfd), so that
  ranks map each other's buffers as with real IPC) plus a ``log`` of what
  happened, in order, for tests of the stream contract, and ``events_created``.

:func:`fake_backend` wraps a runtime in mpicoll's real
:class:`~mpicoll.backends.devices.DeviceBackend`, so the staging channel, the
reduction dispatch and the stream handling under test are mpicoll's own code;
:func:`registered` puts it first in mpicoll's backend list for a ``with`` block.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import numpy as np
from mpi4py import MPI

from mpicoll.backends import cuda as _cuda
from mpicoll.backends import devices as _devices
from mpicoll.backends import registry as _registry
from mpicoll.transport import shared as _shared

POISON = 0xA7
_names = itertools.count()


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
        h = np.empty(shape, dtype=dtype)
        h.view(np.uint8).reshape(-1)[:] = POISON if h.size else 0
        return FakeArray(self._rt, h, owndata=True)

    def asarray(self, obj):
        """Host data -> a new device array (a synchronous copy, as cupy.asarray does)."""
        if isinstance(obj, FakeArray):
            return obj
        h = np.array(obj, copy=True)
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


class FakeStream:
    """An in-order queue of work that runs when forced (``lazy``) or at once (``eager``)."""

    def __init__(self, rt, name, eager=False):
        self.rt = rt
        self.name = name
        self.eager = eager
        self.ops = []
        self.executed = 0  # ops run so far
        self.queued = 0    # ops ever queued

    def enqueue(self, fn, what):
        self.ops.append((fn, what))
        self.queued += 1
        self.rt.log.append(("queue", self.name, what))
        if self.eager:
            self.run_until(self.queued)

    def run_until(self, pos):
        while self.executed < pos:
            fn, what = self.ops.pop(0)
            self.executed += 1
            fn()
            self.rt.log.append(("run", self.name, what))

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
        self.pinned_buffers = []
        self.mpi_requests = []  # MPI requests of the RecordingChannel (see mpi_outstanding)
        self.devices = devices
        self.context_error = context_error
        self.device = 0
        self._streams = 0
        self.ipc_error = ipc_error  # ipc_export raises RuntimeError with it (IPC refused)
        self.ipc_opened = 0  # peers' buffers open now
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

    @property
    def current(self):
        """This thread's current stream (the null stream unless one was made current)."""
        return getattr(self._thread, "stream", self.null)

    @current.setter
    def current(self, stream):
        self._thread.stream = stream

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

    # node memory (mpicoll.transport.shared): CUDA IPC over the host's shared memory, so ranks
    # in other processes map each other's fake device buffers as they would real ones
    def ipc_export(self, nbytes):
        if self.ipc_error is not None:
            raise RuntimeError(self.ipc_error)
        seg = _shared.HostSegment.create(nbytes)
        self.log.append(("ipc export", seg.name))
        return seg.name.encode() + b"/" + seg.token, FakeArray(self, seg.array()), seg

    def ipc_open(self, handle, nbytes):
        name, _, token = handle.rstrip(b"\0").partition(b"/")
        token = (token + b"\0" * 16)[:16]  # (a token ending in zero bytes lost them above)
        seg = _shared.HostSegment.open(name.decode(), token, nbytes)
        self.log.append(("ipc open", seg.name))
        self.ipc_opened += 1
        return FakeArray(self, seg.array()), seg

    def ipc_close(self, seg):
        self.log.append(("ipc close", seg.name))
        self.ipc_opened -= 1
        seg.close()

    def ipc_settled(self, seg):
        seg.settle()

    def ipc_free(self, seg):
        self.log.append(("ipc free", seg.name))
        seg.close()

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

    def wait(self, req):
        self.inner.wait(req)

    def waitall(self, reqs):
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
