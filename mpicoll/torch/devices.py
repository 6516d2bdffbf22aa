"""torch GPU tensors as mpicoll device arrays: CuPy over the tensor's memory, on torch's current stream.

A collective on CUDA tensors runs on mpicoll's device path (CuPy arrays,
CUDA-aware MPI or mpicoll's pinned staging), without the host copies the
backend makes for tensors it cannot hand over.  :func:`layer_of` gives the
:class:`CudaLayer` for a CUDA device (None for the CPU, for other devices,
or where CuPy is missing: then the tensors go through host copies, as
before, with one warning).  The layer turns a contiguous tensor into a CuPy
array over its memory (DLPack; no copy) and makes a :class:`Scope`: torch's
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

import threading
import warnings

import torch

from ..backends import cuda as _cuda

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


class CudaLayer:
    """CUDA tensors as CuPy arrays (DLPack), on torch's current stream."""

    def __init__(self):
        import cupy  # (ImportError: layer_of falls back to host copies)

        self.cupy = cupy

    def array(self, t):
        """A CuPy array over the memory of ``t`` (contiguous, a dtype CuPy has), no copy.

        The DLPack exchange names torch's current stream as the consumer's (the
        call's stream, wherever this runs), so torch adds no synchronisation.
        """
        cp, index = self.cupy, t.device.index
        stream = torch.cuda.current_stream(t.device)
        with cp.cuda.Device(index), cp.cuda.ExternalStream(stream.cuda_stream, index):
            return cp.from_dlpack(t.detach())

    def scope(self, device) -> Scope:
        return Scope(self.cupy, device)

    def direct_mpi(self) -> bool:
        """Whether MPI's own collectives may take device memory (a CUDA-aware MPI)."""
        return _cuda.cuda_aware_mpi().aware



class Scope:
    """torch's current stream on a CUDA device when a call is made, made current again (for
    torch and CuPy, with the device) in ``with scope:`` on any thread."""

    def __init__(self, cupy, device):
        self.cupy = cupy
        self.device = device
        self.stream = torch.cuda.current_stream(device)
        self._entered = threading.local()

    def __enter__(self):
        cp = self.cupy
        # torch: the stream (and its device); CuPy: the device, then the stream as an
        # external one (CuPy's current stream is per thread and per device)
        contexts = [torch.cuda.stream(self.stream), cp.cuda.Device(self.device.index),
                    cp.cuda.ExternalStream(self.stream.cuda_stream, self.device.index)]
        for c in contexts:
            c.__enter__()
        stack = getattr(self._entered, "stack", None)
        if stack is None:
            stack = self._entered.stack = []
        stack.append(contexts)
        return self

    def __exit__(self, *exc):
        for c in reversed(self._entered.stack.pop()):
            c.__exit__(None, None, None)
        return False

    def record(self):
        """An event on the call's stream, after the work queued on it so far."""
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

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
