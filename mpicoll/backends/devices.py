"""GPU arrays: the CuPy backend and device binding.

The algorithms are written once, against the backend interface of
:mod:`mpicoll.backends.host`.  :class:`DeviceBackend` implements it for device
arrays; every CUDA primitive it needs (the array module, streams, events,
pinned host memory, asynchronous copies, device queries) comes from one small
*runtime* object.  :class:`CupyRuntime` is the real one; the test suite
supplies a fake one over host memory, so this module and _staging run
unchanged in CI without a GPU.

CuPy is imported only when the first device array arrives (or
:func:`bind_device` is called): importing mpicoll never imports CuPy.

Local reduction
    Predefined ops run as CuPy ufuncs with ``out=`` on the compute stream (the
    caller's current stream).  User-defined ops (``MPI.Op.Create``) and
    MINLOC/MAXLOC cannot read device memory through ``Op.Reduce_local``: their
    operands are copied to the host, reduced there with ``Reduce_local``, and
    the result copied back (synchronous, so slow: prefer predefined ops on
    GPU data).  A schedule's ``Fold`` of a predefined op (the node algorithms,
    algorithms.shared) is one kernel reading every operand once, generated per
    (op, dtype, operand count, output count) and kept (:data:`FOLDS`).
"""

from __future__ import annotations

import os
import threading

import numpy as np
from mpi4py import MPI

from ..core import types as _types
from ..core.comms import check_comm
from ..core.errors import MpicollError
from ..transport import staging as _staging
from . import host as _backend

_DLPACK_DEVICE_TYPES = (2, 13)  # kDLCUDA, kDLCUDAManaged

# dtypes CuPy arrays can hold (no long double, no structured MINLOC pairs).
_DEVICE_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
    np.uint64, np.float16, np.float32, np.float64, np.complex64, np.complex128,
))

# Calls moving at most this many bytes per rank (the size "auto" selects by) on
# the staging path copy their arrays to pinned host memory once, run the host
# algorithm there and copy the result back once (WholeStage), instead of
# staging every step.  Set at the largest size for which "auto" picks a
# whole-array algorithm (recursive doubling, Bruck, Rabenseifner's small
# range), not measured: the H200 runs (docs/gpu.md) timed sizes on either side,
# not one size both ways.  Tests set it to 0 to stage per step.
STAGE_WHOLE_BYTES = 512 << 10

# The fused fold: ``a = a op b`` as C++ for each predefined op, by the dtype kinds it takes
# (NumPy's ``dtype.kind``), with the NumPy ufunc's meaning in that type (the result of the
# pairwise ufuncs, in the same order): bool arithmetic through int and back (SUM is OR,
# PROD is AND), integers wrapping, float16 through CuPy's float16 type, MAX/MIN keeping a
# NaN.  Other pairs (LAND on floats, MAX on complex) fold pairwise with the ufuncs.
FOLDS = {
    "SUM": (("biufc", "a + b"),),
    "PROD": (("biufc", "a * b"),),
    "MAX": (("biu", "(a > b ? a : b)"), ("f", "((a > b || a != a) ? a : b)")),
    "MIN": (("biu", "(a < b ? a : b)"), ("f", "((a < b || a != a) ? a : b)")),
    "BAND": (("biu", "a & b"),),
    "BOR": (("biu", "a | b"),),
    "BXOR": (("biu", "a ^ b"),),
    "LAND": (("b", "a && b"),),
    "LOR": (("b", "a || b"),),
    "LXOR": (("b", "a != b"),),
}


def fold_expression(name: str, dtype) -> str | None:
    """The C++ of ``a op b`` for op ``name`` in ``dtype`` (:data:`FOLDS`), or None."""
    kind = np.dtype(dtype).kind
    for kinds, expr in FOLDS.get(name, ()):
        if kind in kinds:
            return expr
    return None


def fold_source(name: str, dtype, nx: int, nout: int) -> tuple:
    """(input parameters, output parameters, body) of the elementwise kernel that folds
    ``nx`` operands of op ``name`` from the left into ``nout`` outputs (CuPy loads every
    input of an element before the body writes an output, so an output may be an input)."""
    expr = fold_expression(name, dtype)
    body = ["T a = x0;"]
    body += [f"{{ const T b = x{i}; a = {expr}; }}" for i in range(1, nx)]
    body += [f"y{j} = a;" for j in range(nout)]
    return (", ".join(f"T x{i}" for i in range(nx)), ", ".join(f"T y{j}" for j in range(nout)),
            "\n".join(body))


_INSTALL_HINT = "install CuPy: pip install 'mpicoll[cuda12]' (CUDA 12) or 'mpicoll[cuda13]' (CUDA 13)"


class CupyRuntime:
    """The CUDA primitives mpicoll uses, from CuPy (imported when this is created)."""

    name = "cupy"

    def __init__(self):
        import cupy
        import cupyx

        self.xp = cupy
        self._cupyx = cupyx
        self._rt = cupy.cuda.runtime
        self._folds = {}  # (op, dtype, operands, outputs) -> the fold's kernel
        self._get_attributes = None  # cuPointerGetAttributes, once needed

    @property
    def version(self) -> str:
        return self.xp.__version__

    # arrays
    def claims(self, obj) -> bool:
        if isinstance(obj, self.xp.ndarray):
            return True
        if hasattr(obj, "__cuda_array_interface__"):
            return True
        dev = getattr(obj, "__dlpack_device__", None)
        if dev is None:
            return False
        try:
            return int(dev()[0]) in _DLPACK_DEVICE_TYPES
        except Exception:
            return False

    def asarray(self, obj):
        xp = self.xp
        if isinstance(obj, xp.ndarray):
            return obj
        if hasattr(obj, "__cuda_array_interface__"):
            return xp.asarray(obj)
        return xp.from_dlpack(obj)

    def ufunc(self, name: str):
        return getattr(self.xp, _types.NUMPY_UFUNCS[name].__name__)

    def address(self, arr) -> int:
        """The device address of ``arr``'s first element."""
        return arr.data.ptr

    def unowned(self, ptr: int, n: int, dtype):
        """A 1-D array of ``n`` elements of ``dtype`` at device address ``ptr`` that keeps
        nothing alive (engine.cache: a remembered call's views of its arrays)."""
        xp = self.xp
        if not n:
            return xp.empty(0, dtype)
        mem = xp.cuda.UnownedMemory(ptr, n * np.dtype(dtype).itemsize, None,
                                    self.current_device())
        return xp.ndarray(n, dtype=dtype, memptr=xp.cuda.MemoryPointer(mem, 0))

    # streams and events
    def current_stream(self):
        return self.xp.cuda.get_current_stream()

    def new_stream(self):
        return self.xp.cuda.Stream(non_blocking=True)

    def synchronize(self, stream):
        stream.synchronize()

    def event(self):
        return self.xp.cuda.Event(disable_timing=True)

    def record(self, stream, event=None):
        """Record ``event`` (a new one if None) on ``stream``; returns it."""
        event = self.event() if event is None else event
        event.record(stream)
        return event

    def wait_event(self, stream, event):
        stream.wait_event(event)

    def done(self, event) -> bool:
        return event.done

    def event_synchronize(self, event):
        event.synchronize()

    # host memory and copies
    def pinned(self, nbytes: int):
        """A page-locked host buffer of ``nbytes`` bytes (a uint8 NumPy array)."""
        return self._cupyx.empty_pinned(nbytes, dtype=np.uint8)

    def d2h(self, host, dev, stream):
        """Queue ``host[...] = dev`` on ``stream`` (``host`` pinned, both contiguous)."""
        self._rt.memcpyAsync(host.ctypes.data, dev.data.ptr, dev.nbytes,
                             self._rt.memcpyDeviceToHost, stream.ptr)

    def h2d(self, dev, host, stream):
        """Queue ``dev[...] = host`` on ``stream`` (``host`` pinned, both contiguous)."""
        self._rt.memcpyAsync(dev.data.ptr, host.ctypes.data, dev.nbytes,
                             self._rt.memcpyHostToDevice, stream.ptr)

    def to_host(self, dev):
        """A host copy of ``dev``, after the current stream's work (synchronous)."""
        return self.xp.asnumpy(dev)

    def to_device(self, dev, host):
        """``dev[...] = host`` on the current stream."""
        dev.set(host)

    # node memory (transport.shared): CUDA IPC
    def ipc_export(self, nbytes: int):
        """(handle, uint8 array, owner) of a dedicated device buffer other processes may
        open: its own allocation, not a pool block (a handle names a whole allocation)."""
        xp = self.xp
        mem = xp.cuda.Memory(nbytes)
        handle = bytes(self._rt.ipcGetMemHandle(mem.ptr))
        arr = xp.ndarray(nbytes, dtype=np.uint8, memptr=xp.cuda.MemoryPointer(mem, 0))
        return handle, arr, mem

    def ipc_open(self, handle: bytes, nbytes: int):
        """(uint8 array, pointer) of another process's buffer (:meth:`ipc_export`)."""
        xp = self.xp
        ptr = self._rt.ipcOpenMemHandle(handle, self._rt.cudaIpcMemLazyEnablePeerAccess)
        mem = xp.cuda.UnownedMemory(ptr, nbytes, self)
        return xp.ndarray(nbytes, dtype=np.uint8, memptr=xp.cuda.MemoryPointer(mem, 0)), ptr

    def ipc_close(self, ptr) -> None:
        self._rt.ipcCloseMemHandle(ptr)

    def ipc_settled(self, owner) -> None:
        """Every peer opened the buffer or gave up (nothing to do: the handle stays valid)."""

    def ipc_free(self, owner) -> None:
        """Nothing: the buffer goes with its last reference."""

    def ipc_device(self) -> str:
        """The current device's PCI bus id (which GPU a rank's buffer is on)."""
        return str(self._rt.deviceGetPCIBusId(self.current_device()))

    def ipc_range(self, ptr: int) -> tuple:
        """(base, bytes, buffer id) of the allocation holding device pointer ``ptr``: what
        ``cudaIpcGetMemHandle`` names (``cuPointerGetAttributes``: RANGE_START_ADDR,
        RANGE_SIZE, BUFFER_ID, a number the driver never gives another allocation of this
        process).  OSError where another process cannot open it that way (host, managed,
        ``cudaMallocAsync`` or ``cuMemCreate`` memory, another device)."""
        import ctypes

        get = self._pointer_attributes()
        values = (ctypes.c_ulonglong * len(_POINTER_ATTRIBUTES))()
        data = (ctypes.c_void_p * len(values))(
            *(ctypes.addressof(values) + 8 * i for i in range(len(values))))
        attrs = (ctypes.c_int * len(values))(*_POINTER_ATTRIBUTES)
        status = get(len(values), attrs, data, ctypes.c_ulonglong(ptr))
        memtype, bid, ordinal, legacy, base, size = (int(v) for v in values)
        if status != 0 or memtype != _CU_MEMORYTYPE_DEVICE or not legacy or not size:
            raise OSError(f"device pointer {ptr:#x}: not memory cudaIpcGetMemHandle can share "
                          f"(cuPointerGetAttributes: status {status}, memory type {memtype}, "
                          f"legacy IPC {legacy})")
        if (ordinal & 0xFFFFFFFF) != self.current_device():
            raise OSError(f"device pointer {ptr:#x}: on device {ordinal}, not the current one")
        return base, size, bid

    def _pointer_attributes(self):
        """``cuPointerGetAttributes`` of the CUDA driver CuPy already loaded (RTLD_NOLOAD:
        nothing is loaded here)."""
        get = self._get_attributes
        if get is None:
            import ctypes

            lib = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
            get = lib.cuPointerGetAttributes
            get.restype = ctypes.c_int
            get.argtypes = (ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong)
            self._get_attributes = get
        return get

    def ipc_handle(self, base: int) -> bytes:
        """``cudaIpcGetMemHandle`` of the allocation starting at ``base``."""
        return bytes(self._rt.ipcGetMemHandle(base))

    # interprocess events (transport.shared's ordering of node work without host waits)
    def ipc_event(self):
        """(handle, event): an event other processes may wait on (``cudaEventInterprocess |
        cudaEventDisableTiming``) and its ``cudaIpcGetEventHandle``."""
        event = self.xp.cuda.Event(block=False, disable_timing=True, interprocess=True)
        return bytes(self._rt.ipcGetEventHandle(event.ptr)), event

    def ipc_open_event(self, handle: bytes):
        """Another process's event (:meth:`ipc_event`), to wait on."""
        return self._rt.ipcOpenEventHandle(handle)

    def ipc_close_event(self, event) -> None:
        self._rt.eventDestroy(event)

    def record_ipc(self, stream, event) -> None:
        """Record this process's interprocess ``event`` on ``stream``."""
        event.record(stream)

    def wait_ipc(self, stream, event) -> None:
        """``stream`` waits for the last record of a peer's event (``cudaStreamWaitEvent``:
        the record made before this call, whatever the peer records later)."""
        self._rt.streamWaitEvent(stream.ptr, event)

    def fold(self, name: str, xs, outs) -> None:
        """Queue ``outs[k] = ((xs[0] op xs[1]) op ...)`` on the current stream: one kernel
        (:func:`fold_source`), made once per (op, dtype, operand and output count)."""
        key = (name, xs[0].dtype, len(xs), len(outs))
        kernel = self._folds.get(key)
        if kernel is None:
            kernel = self._folds[key] = self.xp.ElementwiseKernel(
                *fold_source(name, xs[0].dtype, len(xs), len(outs)), "mpicoll_fold")
        kernel(*xs, *outs)

    # devices
    def device_count(self) -> int:
        return int(self._rt.getDeviceCount())

    def device_name(self, index: int) -> str:
        name = self._rt.getDeviceProperties(index)["name"]
        return name.decode() if isinstance(name, bytes) else str(name)

    def current_device(self) -> int:
        return int(self._rt.getDevice())

    def use_device(self, index: int) -> None:
        """Make ``index`` current and create its CUDA context now (``cudaFree(0)``)."""
        self.xp.cuda.Device(index).use()
        self._rt.free(0)


# cuPointerGetAttributes' attributes (CUpointer_attribute), in the order ipc_range reads them
_POINTER_ATTRIBUTES = (2, 7, 9, 10, 11, 12)  # MEMORY_TYPE, BUFFER_ID, DEVICE_ORDINAL,
#                                              IS_LEGACY_CUDA_IPC_CAPABLE, RANGE_START_ADDR, RANGE_SIZE
_CU_MEMORYTYPE_DEVICE = 2


class DeviceReducer(_backend.Reducer):
    """``out = a op b`` on device arrays: a CuPy ufunc, or a host round trip for user ops."""

    __slots__ = ("host", "fused")

    def __init__(self, op, ufunc, mpitype, backend, category):
        super().__init__(op, ufunc, mpitype, backend)
        self.host = None if ufunc is not None else _backend.NUMPY.reducer(op, mpitype, category)
        # the op's name where a Fold may be one kernel (the runtime makes it: fold)
        self.fused = _types.op_name(op) if ufunc is not None else None

    def fold(self, xs, outs):
        """A schedule's ``Fold``: one kernel where the runtime makes one for the op and
        dtype (:data:`FOLDS`), else pairwise in the same order (user ops: on the host)."""
        be = self.backend
        name, dtype = self.fused, outs[0].dtype
        if name is not None and len(xs) > 1 and fold_expression(name, dtype) is not None \
                and all(x.dtype == dtype for x in xs) and hasattr(be.rt, "fold"):
            be.launches += 1
            for out in outs:
                be.writes(out)
            be.rt.fold(name, xs, outs)
            return
        super().fold(xs, outs)

    def __call__(self, a, b, out):
        be = self.backend
        be.launches += 1
        be.writes(out)
        if self.ufunc is not None:
            self.ufunc(a, b, out=out)
            return
        rt = be.rt
        ha, hb = rt.to_host(a), rt.to_host(b)
        hout = np.empty_like(hb)
        self.host(ha, hb, hout)
        rt.to_device(out, hout)


class _Call:
    """The device state of one call: its context, device key and stream (:meth:`DeviceBackend._begin`),
    and its staging channel (None on the other paths)."""

    __slots__ = ("ctx", "key", "stream", "staging")

    def __init__(self, ctx, key, stream):
        self.ctx, self.key, self.stream, self.staging = ctx, key, stream, None


class _Running(threading.local):
    """What a thread runs: the device call it is in (``call``: a device call runs from its
    start to its end in the thread that starts it, engine.run) and the device work mpicoll
    queued there (``launches``).  Per thread, so that calls running at once in several
    threads, each on its own communicator, keep their own state."""

    call = None
    launches = 0


class DeviceBackend:
    """GPU arrays through a runtime object (:class:`CupyRuntime` or a test double).

    The state of a call in progress (its stream, staging channel, the
    work it queued) is the call's own (:class:`_Call`), kept for the thread
    that runs it, not the backend's: one backend serves every thread.

    Args:
        runtime: a zero-argument callable returning the runtime; called on
            first use, so creating the backend imports nothing.
        name: the backend's name in messages and scratch-buffer keys.
    """

    device = "gpu"

    def __init__(self, runtime, name: str = "cupy"):
        self._make_runtime = runtime
        self._rt = None
        self.name = name
        self._running = _Running()

    @property
    def launches(self) -> int:
        """Device kernels and copies mpicoll queued in this thread (DirectChannel and the node
        channel synchronise only when it moved)."""
        return self._running.launches

    @launches.setter
    def launches(self, value: int) -> None:
        self._running.launches = value

    @property
    def rt(self):
        if self._rt is None:
            self._rt = self._make_runtime()
        return self._rt

    def available(self) -> bool:
        """True when the runtime can be created (CuPy importable)."""
        try:
            self.rt  # noqa: B018
        except ImportError:
            return False
        return True

    # -- what backend_of needs ----------------------------------------------
    def claims(self, obj) -> bool:
        if not _backend.is_device_object(obj) or not self.available():
            return False
        return self.rt.claims(obj)

    def is_array(self, obj) -> bool:
        return self.available() and self.rt.claims(obj)

    def asarray(self, obj):
        try:
            return self.rt.asarray(obj)
        except Exception as exc:
            raise TypeError(str(exc)) from exc

    def supports(self, dtype) -> bool:
        return np.dtype(dtype) in _DEVICE_DTYPES

    def native(self, obj) -> bool:
        """Whether ``obj`` is the runtime's own array type (CuPy's ndarray), whose address a
        remembered call reads without exporting it (engine.cache)."""
        return type(obj) is self.rt.xp.ndarray

    def address(self, arr) -> int:
        """The device address of array ``arr``'s first element."""
        return self.rt.address(arr)

    def unowned(self, arr):
        """A view of C-contiguous array ``arr``'s memory (1-D) that keeps nothing alive: what
        a remembered call is bound to (engine.cache)."""
        return self.rt.unowned(self.address(arr), arr.size, arr.dtype)

    # -- what the algorithms need --------------------------------------------
    def empty(self, n, dtype):
        return self.rt.xp.empty(n, dtype=dtype)

    def copy(self, dst, src):
        if dst.nbytes == src.nbytes and dst.dtype == src.dtype and dst.strides == src.strides \
                and (not dst.nbytes or _staging.address(dst) == _staging.address(src)):
            return  # (the same memory: a node buffer bound to the call's own, transport.shared)
        self.launches += 1
        self.writes(dst)
        self.rt.xp.copyto(dst, src)

    def writes(self, out):
        """mpicoll queues device work writing ``out``: the staging channel of this call
        must not forward data that landed there from its pinned buffer any more."""
        call = self._running.call
        if call is not None and call.staging is not None:
            call.staging.forget(out)

    def may_share_memory(self, a, b):
        return bool(self.rt.xp.may_share_memory(a, b))

    def prepare(self):
        """Nothing more to do here: :meth:`channel` ordered this call after the
        previous one on the context, and the device channels order every
        transfer after the work that produced its buffer (see transport.staging)."""

    def finish(self):
        """Mark the end of this call's device work on its context (see :meth:`channel`).

        Results are ready for the compute stream when the last receive is
        waited for (staging makes that stream wait on the copy), so an event
        recorded on it now follows every use of the context's device memory.
        """
        call = self._running.call
        if call is None:
            return
        self._running.call = None
        if call.staging is not None:
            call.staging.close()
        done = call.ctx.devices.setdefault("done", {})
        events = self.events(call.ctx)
        previous = done.get(call.key)
        done[call.key] = events.record(call.stream)
        events.release(previous)  # (the next call waits for the new one)

    def reducer(self, op, mpitype, category):
        name = _types.op_name(op)
        ufunc = None
        if category != "pair" and name in _types.NUMPY_UFUNCS:
            ufunc = self.rt.ufunc(name)
        return DeviceReducer(op, ufunc, mpitype, self, category)

    def host_channel(self, ctx, mpitype):
        """The host transport the device channels hand their MPI calls to."""
        return _backend.NUMPY.channel(ctx, mpitype)

    def channel(self, ctx, mpitype):
        """DirectChannel when MPI is CUDA-aware, else StagingChannel (see backends.cuda).

        Called once at the start of each call: the device work memory of
        ``ctx`` (scratch slots) is shared by every call on it, whatever the
        caller's stream, so the compute stream first waits for the event that
        the previous call on ``ctx`` recorded at its end (:meth:`finish`).  (On
        the same stream that wait is a no-op; it is queued anyway, as stream
        objects cannot be compared reliably.)
        """
        inner = self.host_channel(ctx, mpitype)
        stream = self._begin(ctx)
        if ctx.cuda_aware():
            return _staging.DirectChannel(inner, self, stream)
        call = self._running.call
        call.staging = _staging.StagingChannel(inner, self, self.staging_pool(ctx), stream)
        return call.staging

    def _begin(self, ctx):
        """Start this thread's call on ``ctx`` (its state, until :meth:`finish`), ordered
        after the previous call on ``ctx`` (see :meth:`channel`); its stream."""
        rt = self.rt
        stream = rt.current_stream()
        key = (self.name, rt.current_device())
        previous = ctx.devices.get("done", {}).get(key)
        if previous is not None:
            rt.wait_event(stream, previous)
        self._running.call = _Call(ctx, key, stream)
        return stream

    def stages_per_step(self, ctx, nbytes) -> bool:
        """True when a call of ``nbytes`` on ``ctx`` stages every message through host memory
        (``ctx.cuda_aware()``: what the ranks agreed on, engine.context)."""
        return nbytes > STAGE_WHOLE_BYTES and not ctx.cuda_aware()

    def stages_whole(self, ctx, nbytes) -> bool:
        """True when a call of ``nbytes`` on ``ctx`` runs on one pinned host copy
        (:class:`WholeStage`)."""
        return nbytes <= STAGE_WHOLE_BYTES and not ctx.cuda_aware()

    def whole_stage(self, ctx, nbytes, msg, op):
        """A :class:`WholeStage` for a call of ``nbytes`` on the staging path, else None.

        Small calls on the staging path (not CUDA-aware, at most
        :data:`STAGE_WHOLE_BYTES`) run the host algorithm on one pinned copy
        of their arrays instead of staging every step.
        """
        if not self.stages_whole(ctx, nbytes):
            return None
        return WholeStage(self, ctx, msg, op)

    def staging_pool(self, ctx):
        """The pinned buffers, copy streams and events kept for ``ctx`` on the current device."""
        pools = ctx.devices.setdefault("staging pools", {})
        key = (self.name, self.rt.current_device())
        pool = pools.get(key)
        if pool is None:
            pool = pools[key] = _staging.StagingPool(self.rt, events=self.events(ctx))
        return pool

    def events(self, ctx):
        """The CUDA events kept for ``ctx`` on the current device (transport.staging.EventPool)."""
        pools = ctx.devices.setdefault("events", {})
        key = (self.name, self.rt.current_device())
        pool = pools.get(key)
        if pool is None:
            pool = pools[key] = _staging.EventPool(self.rt)
        return pool


class WholeStage:
    """One call's arrays copied to pinned host memory once, the host algorithm run there.

    ``channel``, ``backend`` and ``reducer`` are the host ones the algorithm
    runs with; :meth:`enter` copies the input device-to-host (after the work
    that produced it, on the compute stream) and waits for that one copy;
    :meth:`leave` queues the one host-to-device copy of the result on the
    compute stream, so it is ready there when the call returns.  The pinned
    buffer is the context's (:meth:`StagingPool.whole`); the next call reuses
    it only after this call's copy, as it is ordered after this call's end
    event (:meth:`DeviceBackend.finish`).
    """

    def __init__(self, be, ctx, msg, op):
        self.be = be
        self.stream = be._begin(ctx)
        self.pool = be.staging_pool(ctx)
        self.channel = be.host_channel(ctx, msg.mpitype)
        self.backend = _backend.NUMPY
        self.reducer = None if op is None else _backend.NUMPY.reducer(op, msg.mpitype, msg.category)
        self._out = None

    def enter(self, src, dst, writes_all=True):
        """Host arrays (pinned) standing for ``src`` (None: in place) and ``dst``.

        ``writes_all``: the call writes every element of ``dst``.  Else (an AllGather whose
        blocks leave gaps in ``dst``) ``dst`` is copied in too, so that :meth:`leave`,
        which copies all of it back, returns the gaps as they were.
        """
        rt, stream = self.be.rt, self.stream
        prefix = src is not None and dst.nbytes <= src.nbytes and (
            src.nbytes == 0 or _staging.address(src) == _staging.address(dst))
        sbytes = 0 if src is None or prefix else _staging.round_bytes(src.nbytes)
        buf = self.pool.whole(sbytes + max(src.nbytes if prefix else dst.nbytes, 1))
        if prefix:  # in place: dst is the start of src (AllReduce, ReduceScatter)
            hsrc = buf[: src.nbytes].view(src.dtype)
            hdst = hsrc if src is dst else hsrc[: dst.size]  # the algorithms test "src is dst"
            copy_in = (hsrc, src)
        else:
            hsrc = None if src is None else buf[: src.nbytes].view(src.dtype)
            hdst = buf[sbytes: sbytes + dst.nbytes].view(dst.dtype)
            copy_in = (hdst, dst) if src is None else (hsrc, src)  # AllGather in place: all of dst
        copies = [copy_in] if copy_in[1].nbytes else []
        if not writes_all and src is not None and not prefix and dst.nbytes:
            copies.append((hdst, dst))
        for host, dev in copies:
            rt.d2h(host, dev, stream)
        if copies:
            copied = self.pool.events.record(stream)
            rt.event_synchronize(copied)
            self.pool.events.reuse(copied)
        self._out = (dst, hdst)
        return hsrc, hdst

    def leave(self):
        """Queue the copy of the result back to the device (on the compute stream)."""
        dst, hdst = self._out
        self._out = None
        if dst.nbytes:
            self.be.launches += 1
            self.be.rt.h2d(dst, hdst, self.stream)


CUPY = DeviceBackend(CupyRuntime, "cupy")  # (registered by backends.registry when needed)


# -- device binding -----------------------------------------------------------

_LOCAL_RANK_VARS = ("SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def bind_device(comm: MPI.Intracomm | None = None) -> int:
    """Make this rank's GPU the current CuPy device; returns its index.

    Ranks on one node get devices by their node-local rank (from
    ``comm.Split_type(MPI.COMM_TYPE_SHARED)``), modulo the number of visible
    devices, so more ranks than GPUs share them round-robin.  When the
    launcher's local-rank variable (``SLURM_LOCALID``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``) numbers the node's
    ranks 0..n-1 consistently, that numbering is used instead.  Collective
    over ``comm``.

    Args:
        comm: the ranks to place (default ``MPI.COMM_WORLD``).

    Returns:
        The CUDA device index this rank now uses (within ``CUDA_VISIBLE_DEVICES``).

    Raises:
        MpicollError: CuPy is not installed, or no GPU is visible.

    Example (4 ranks on a node with 2 GPUs)::

        dev = mpicoll.bind_device()          # ranks 0, 1, 2, 3 -> devices 0, 1, 0, 1
    """
    return _bind(check_comm(MPI.COMM_WORLD if comm is None else comm), runtime)


def runtime():
    """The CuPy runtime, or MpicollError saying how to get CuPy."""
    try:
        return CUPY.rt
    except ImportError as exc:
        raise MpicollError(f"bind_device: CuPy is not installed ({exc}); {_INSTALL_HINT}") from exc


def _bind(comm, get_runtime) -> int:
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        lrank, lsize = local.Get_rank(), local.Get_size()
        hints = local.allgather(_launcher_local_rank())
    finally:
        local.Free()
    if sorted(h for h in hints if h is not None) == list(range(lsize)):
        lrank = hints[lrank]
    failure, device = None, None
    try:
        rt = get_runtime()
        count = rt.device_count()
    except MpicollError as exc:
        failure, count = str(exc), 0
    except Exception as exc:  # CUDA driver missing or broken
        failure, count = f"bind_device: CUDA reports no usable device ({exc})", 0
    if failure is None and count < 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        failure = ("bind_device: no GPU visible to this rank"
                   + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""))
    if failure is None:
        # Creating the CUDA context can fail on one rank only (exclusive-process
        # compute mode, a MIG instance or the memory taken): it happens here,
        # before the ranks agree, so that failure reaches every rank too.
        device = lrank % count
        try:
            rt.use_device(device)
        except Exception as exc:
            failure = (f"bind_device: cannot create a CUDA context on device {device} "
                       f"({type(exc).__name__}: {exc})")
    # Every rank learns whether any failed, so none is left waiting in a later collective.
    failures = comm.allgather(failure)
    if failure is not None:
        raise MpicollError(failure)
    for rank, text in enumerate(failures):
        if text is not None:
            raise MpicollError(f"bind_device: failed on rank {rank}: {text}")
    return device


def _launcher_local_rank():
    for var in _LOCAL_RANK_VARS:
        value = os.environ.get(var)
        if value is not None and value.strip().isdigit():
            return int(value)
    return None
