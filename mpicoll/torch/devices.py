"""torch GPU tensors as mpicoll device arrays: CuPy over the tensor's memory, on torch's current stream.

A collective on CUDA tensors runs on mpicoll's device path (CuPy arrays: on
one node the node path, else CUDA-aware MPI or mpicoll's pinned staging,
docs/gpu.md), without the host copies the
backend makes for tensors it cannot hand over.  :func:`layer_of` gives the
:class:`CudaLayer` for a CUDA device (None for the CPU, for other devices,
or where CuPy is missing: then the tensors go through host copies, as
before, with one warning).  The layer turns a contiguous tensor into a CuPy
array over its memory (no copy; made once per address and kept) and makes a
:class:`Scope`: torch's
current stream and device when the call is made, made current for CuPy and
torch wherever the call's device work runs (the caller's thread at the
start, the thread that completes it at the end), so that every kernel and
copy of the call -- torch's staging copies, mpicoll's reductions and
transfers, the copies back -- is ordered on that one stream:

- at the start, mpicoll orders its messages after the work already queued
  on the stream (its stream contract, docs/gpu.md);
- at the end, the work records an event on the stream after its last copy;
  ``wait()`` makes the waiting thread's current stream wait for it (as
  NCCL's works do), and the future, a CUDA future on the tensors' device,
  is completed with the stream current.

MPI's own collectives (broadcast, gather, scatter, all-to-all, send/recv)
take the tensors' device memory only where MPI is CUDA-aware
(:func:`mpicoll.cuda_aware_mpi`), after the stream is synchronised (mpi4py
passes pointers, not streams); otherwise host copies.
"""

from __future__ import annotations

import collections
import threading
import warnings

import torch

from ..backends import cuda as _cuda
from .tensors import DTYPES

_LAYERS: dict = {}  # device type -> layer, or None (made at the first tensor of that type)
_warned: list = []


def layer_of(device):
    """The device layer for ``device`` (a torch.device), or None: host arrays (the CPU) or
    host copies (any other device, or CUDA without CuPy)."""
    kind = device.type
    if kind == "cpu":
        return None
    if kind not in _LAYERS:
        _LAYERS[kind] = _make(kind)
    return _LAYERS[kind]


def describe(device) -> str:
    """How the backend moves tensors on ``device`` (a torch.device), in words (the examples
    print it)."""
    if device.type == "cpu":
        return "CPU tensors: NumPy arrays over their memory"
    if layer_of(device) is None:
        why = "CuPy cannot be imported" if device.type == "cuda" else f"no {device.type} path"
        return f"{device.type} tensors: through host copies ({why})"
    aware = _cuda.cuda_aware_mpi()
    builtins = ("on device memory" if aware.aware
                else "through host copies, MPI not being CUDA-aware")
    return (f"{device.type} tensors: CuPy arrays over their memory on torch's current stream "
            f"(mpicoll's device path); MPI's own collectives (broadcast, gather, scatter, "
            f"all-to-all, send/recv) {builtins}")


def _make(kind):
    if kind != "cuda":
        return None
    try:
        return CudaLayer()
    except ImportError as exc:
        if not _warned:
            _warned.append(True)
            warnings.warn(f"mpicoll.torch: CUDA tensors go through host copies, as CuPy cannot be "
                          f"imported ({exc}); pip install 'mpicoll[cuda12]' or 'mpicoll[cuda13]'",
                          RuntimeWarning, stacklevel=4)
        return None


# CuPy arrays kept per layer before its table starts again (each a few hundred bytes)
_VIEWS_MAX = 4096
# torch CUDA events a layer keeps per device for reuse (a call holds one until it is done)
_EVENTS_KEPT = 64


class CudaLayer:
    """CUDA tensors as CuPy arrays over their memory, on torch's current stream.

    What a call needs is made once and kept: the CuPy array over a tensor's
    memory (:meth:`array`, per address, size and dtype), the CuPy stream
    object of a torch stream, and torch events (:class:`_Events`), so a
    repeated call builds none of them.
    """

    def __init__(self):
        import cupy  # (ImportError: layer_of falls back to host copies)

        self.cupy = cupy
        self._views: dict = {}    # (address, elements, NumPy dtype, device) -> CuPy array
        self._streams: dict = {}  # (device, torch stream handle) -> CuPy ExternalStream
        self._events: dict = {}   # device -> _Events

    def array(self, t):
        """A CuPy array over the memory of ``t`` (contiguous, a dtype CuPy has), no copy.

        Made over the address alone (CuPy's ``UnownedMemory`` without an owner,
        as :func:`~mpicoll.torch.tensors.memory_view` on the host): it holds no
        reference to the tensor (the caller keeps it alive while the array is in
        use) and touches no stream, so it is made once and kept; a kept array
        is handed out only for a tensor that now has those bytes (same address,
        element count, dtype and device), so the same memory gives the same
        array on every call (engine.cache repeats a call on the same arrays).
        """
        n = t.numel()
        dtype = DTYPES.get(t.dtype)
        if not n or dtype is None:  # (no memory to see, or a dtype mpicoll refuses anyway)
            cp, index = self.cupy, t.device.index
            stream = torch.cuda.current_stream(t.device)
            with cp.cuda.Device(index), cp.cuda.ExternalStream(stream.cuda_stream, index):
                return cp.from_dlpack(t.detach())
        key = (t.data_ptr(), n, dtype, t.device.index)
        array = self._views.get(key)
        if array is None:
            if len(self._views) >= _VIEWS_MAX:
                self._views.clear()
            cuda = self.cupy.cuda
            memory = cuda.UnownedMemory(key[0], n * t.element_size(), None, key[3])
            array = self._views[key] = self.cupy.ndarray((n,), dtype, cuda.MemoryPointer(memory, 0))
        return array

    def scope(self, device) -> Scope:
        stream = torch.cuda.current_stream(device)
        key = (device.index, stream.cuda_stream)
        cupy_stream = self._streams.get(key)
        if cupy_stream is None:
            cupy_stream = self._streams[key] = self.cupy.cuda.ExternalStream(stream.cuda_stream,
                                                                             device.index)
        events = self._events.get(device.index)
        if events is None:
            events = self._events[device.index] = _Events()
        return Scope(self.cupy, device, stream, cupy_stream, events)

    def direct_mpi(self) -> bool:
        """Whether MPI's own collectives may take device memory (a CUDA-aware MPI)."""
        return _cuda.cuda_aware_mpi().aware


class _Events:
    """torch CUDA events of one device, reused once complete.

    A call records one at its end and holds it while it is not done.  An event
    is recorded again only once a query finds it complete, and a work drops
    its event once it has seen it complete (mpicoll.torch.work), so a work
    that still holds a reused event has not seen it complete: it sees the
    later work's end instead, never before its own work is done (a wait on it
    waits for no less), and once complete it stays complete.
    """

    def __init__(self):
        self._ring: collections.deque = collections.deque()
        self._lock = threading.Lock()  # (works complete on the progress thread too)

    def record(self, stream):
        with self._lock:
            ring = self._ring
            event = ring.popleft() if ring and ring[0].query() else torch.cuda.Event()
            event.record(stream)
            ring.append(event)
            if len(ring) > _EVENTS_KEPT:
                ring.popleft()  # (a call that holds it keeps it)
        return event


class Scope:
    """torch's current stream on a CUDA device when a call is made, made current again (for
    torch and CuPy, with the device) in ``with scope:`` on any thread.

    One context per entry: CuPy's stream object for the call's stream (made once per
    stream, :meth:`CudaLayer.scope`); CuPy's device and torch's stream only where they are
    not the call's already (the thread that makes the call has both: the stream is the one
    torch had current there).
    """

    def __init__(self, cupy, device, stream, cupy_stream, events):
        self.cupy = cupy
        self.device = device
        self.stream = stream
        self._cupy_stream = cupy_stream
        self._events = events
        self._entered = threading.local()

    def __enter__(self):
        entered = []
        if torch.cuda.current_stream(self.device).cuda_stream != self.stream.cuda_stream:
            entered.append(torch.cuda.stream(self.stream))  # (another thread, another stream)
        index = self.device.index
        if self.cupy.cuda.runtime.getDevice() != index:
            entered.append(self.cupy.cuda.Device(index))
        entered.append(self._cupy_stream)  # (CuPy's current stream is per thread and device)
        for c in entered:
            c.__enter__()
        stack = getattr(self._entered, "stack", None)
        if stack is None:
            stack = self._entered.stack = []
        stack.append(entered)
        return self

    def __exit__(self, *exc):
        for c in reversed(self._entered.stack.pop()):
            c.__exit__(None, None, None)
        return False

    def record(self):
        """An event on the call's stream, after the work queued on it so far (reused from the
        layer's, :class:`_Events`)."""
        return self._events.record(self.stream)

    def after(self, event) -> None:
        """Make the current stream (of this thread, on the call's device) wait for ``event``."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def done(self, event) -> bool:
        return event.query()

    def synchronize(self) -> None:
        """Wait for everything queued on the call's stream (before MPI reads device memory)."""
        self.stream.synchronize()

    def future(self):
        """A future whose consumers' streams are ordered after the call's (torch's CUDA
        future; completed inside the scope, it records its event on the call's stream)."""
        return torch.futures.Future(devices=[self.device])
