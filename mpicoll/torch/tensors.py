"""Tensors as NumPy arrays for mpicoll: the dtype table, host staging, bfloat16.

A CPU tensor that is contiguous is moved where it lies (``Tensor.numpy()``
shares its memory); any other tensor -- a strided view, a CUDA tensor -- is
moved through a contiguous host copy that is copied back when the collective
is complete (:class:`Staged`).

Some views have elements that share memory (``expand()``, ``unfold()``,
``as_strided`` with overlapping strides: :func:`shares_memory`).  As an input
such a view is read element by element into the copy.  Written back, each
memory location takes the value of the first element (row-major) that
refers to it (:func:`write_shared`; ``copy_`` refuses such a destination):
when every rank passes the same view, the elements that share a location
reduce equal values, so an all_reduce leaves each location the reduction of
its values (gloo's result).  A collective whose output holds a different
value per element (a gather, scatter, reduce_scatter, all_to_all, recv)
refuses such an output (:func:`check_output`).  Tensors that require grad are ``detach()``-ed
first: NumPy refuses them, and a collective is not part of autograd anyway.
A tensor's own memory is seen through :func:`memory_view`, one NumPy array
per address, size and dtype, made once: mpicoll runs a call again without
validating it when it gets the same array objects as last time (engine.cache).

bfloat16 is reduced by mpicoll itself where ``ml_dtypes`` is installed (the
``torch`` extra installs it): the tensor's memory seen as an ``ml_dtypes``
bfloat16 array, which mpicoll accumulates in float32 and rounds once.
Without ``ml_dtypes`` a float32 host copy stands in (:func:`to_reducible`).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

# torch dtype -> NumPy dtype of the same bits, for the dtypes the backend takes.
# bfloat16 has no NumPy dtype of its own: see bfloat16() and to_reducible.
DTYPES = {
    torch.bool: np.bool_,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}
SUPPORTED = tuple(DTYPES) + (torch.bfloat16,)
_SUPPORTED = frozenset(SUPPORTED)

# dtypes moved by gathers, scatters and broadcasts as the integer of the same width
_BITS = {torch.bfloat16: torch.int16}


_ML_BF16: list = []  # [ml_dtypes' bfloat16 NumPy dtype, or None]: looked up once, at first use


def bfloat16():
    """``ml_dtypes``' bfloat16 as a NumPy dtype, or None where ``ml_dtypes`` is not installed.

    Imported at the first bfloat16 reduction, not when mpicoll.torch is
    imported; mpicoll's array layer knows the type once ``ml_dtypes`` is imported.
    """
    if not _ML_BF16:
        try:
            import ml_dtypes
        except ImportError:
            _ML_BF16.append(None)
        else:
            _ML_BF16.append(np.dtype(ml_dtypes.bfloat16))
    return _ML_BF16[0]


def check_tensor(t, what: str, index=None, sparse: bool = False) -> None:
    """TypeError unless ``t`` is a dense tensor of a supported dtype (before any message).

    ``what`` names it in the message, as ``what[index]`` where ``index`` is given;
    ``sparse``: the call also takes sparse COO tensors (all_reduce), as the message says.
    """
    if type(t) is torch.Tensor and t.dtype in _SUPPORTED and t.layout is torch.strided:
        return  # (the usual case, without composing the name)
    if index is not None:
        what = f"{what}[{index}]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _SUPPORTED:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED)
        raise TypeError(f"{what}: dtype {str(t.dtype).replace('torch.', '')} is not supported "
                        f"by the mpicoll backend (supported: {names})")
    if t.layout is not torch.strided:
        kinds = "a dense (strided) or sparse COO tensor" if sparse else "a dense (strided) tensor"
        raise TypeError(f"{what}: expected {kinds}, got layout {t.layout}")


def check_same(tensors, dtype, what: str, output: bool = False) -> None:
    """TypeError unless every tensor of ``tensors`` has ``dtype`` (torch's backends refuse a mix);
    ``output``: each is also checked as :func:`check_output` does."""
    for i, t in enumerate(tensors):
        check_tensor(t, f"{what}[{i}]")
        if t.dtype != dtype:
            raise TypeError(f"{what}[{i}]: expected dtype {dtype} like the input, got {t.dtype}")
        if output:
            check_output(t, f"{what}[{i}]")


def check_output(t, what: str) -> None:
    """Also ValueError if elements of ``t`` share memory: an output that must hold a value per
    element (a gather's, a scatter's, a receive's)."""
    check_tensor(t, what)
    if not t.is_contiguous() and shares_memory(t):
        raise ValueError(f"{what}: elements of this tensor share memory (an expanded or "
                         f"overlapping view, shape {tuple(t.shape)}, strides {t.stride()}), but "
                         f"the collective writes a different value to each element; pass a "
                         f"tensor with its own memory per element (e.g. t.clone())")


def shares_memory(t) -> bool:
    """Whether two elements of ``t`` refer to one memory location (``expand()``, ``unfold()``)."""
    # the dimensions by stride: none overlaps where each stride is beyond every offset the
    # smaller ones reach (a transposed or sliced view); otherwise count the offsets
    reach = 0
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return _offsets(t).unique().numel() < t.numel()
        reach += (size - 1) * stride
    return False


def _offsets(t):
    """The storage offset of each element of ``t``, in row-major order (an int64 CPU tensor)."""
    offsets = torch.tensor(t.storage_offset(), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return offsets.reshape(-1)


def write_shared(t, values) -> None:
    """``t[...] = values`` (a contiguous tensor of ``t``'s element count) for a ``t`` whose
    elements share memory: each location takes the value of its first element (row-major)."""
    offsets = _offsets(t)
    unique, inverse = offsets.unique(return_inverse=True)
    n = offsets.numel()
    first = torch.full((unique.numel(),), n, dtype=torch.int64).scatter_reduce_(
        0, inverse, torch.arange(n, dtype=torch.int64), "amin")
    low = int(unique[0])
    region = t.as_strided((int(unique[-1]) - low + 1,), (1,), low)  # every location, once
    region[(unique - low).to(t.device)] = values.reshape(-1)[first].to(device=t.device,
                                                                        dtype=t.dtype)


class Staged:
    """A tensor's data as a flat C-ordered array mpicoll takes, copied back by :meth:`done`.

    ``mode``: ``"reduce"`` (an array mpicoll can reduce: bfloat16 as an
    ``ml_dtypes`` bfloat16 array over the same bytes, or, without ``ml_dtypes``
    and on a device, a float32 copy),
    ``"bits"`` (bfloat16 as int16: moving bytes), ``"out"`` (like bits, but the
    staging copy need not be filled: the tensor's old contents are overwritten).

    ``layer`` (mpicoll.torch.devices): the tensor's device layer; the array is
    then a device array (CuPy) over the tensor's memory, or over a copy on the
    device (strided views, bfloat16's float32).  Without one, a host NumPy
    array: over the tensor's memory (a contiguous CPU tensor) or a host copy.
    """

    __slots__ = ("tensor", "array", "_host", "_back", "_shared", "_layer")

    def __init__(self, tensor, mode: str = "reduce", layer=None):
        t = tensor.detach() if tensor.requires_grad else tensor
        self.tensor = t
        self._back = None
        self._shared = False
        self._layer = layer
        if layer is not None:
            self._on_device(t, mode, layer)
            return
        if t.dtype is not torch.bfloat16 and t.is_cpu and t.is_contiguous():
            self._host = t  # most calls: the tensor's own memory, in any mode
            self.array = memory_view(t)
            return
        native = None
        if mode == "reduce" and t.dtype is torch.bfloat16:
            native = bfloat16()
        if mode == "reduce" and t.dtype is torch.bfloat16 and native is None:
            host = to_reducible(t)
            self._back = host
            self._shared = not t.is_contiguous() and shares_memory(t)
        else:
            view = t.view(_BITS[t.dtype]) if t.dtype in _BITS else t
            if view.is_cpu and view.is_contiguous():
                host = view
            else:
                host = view.contiguous() if mode != "out" else torch.empty(
                    view.shape, dtype=view.dtype)
                if not view.is_cpu:
                    host = host.cpu()
                self._back = host
                self._shared = not view.is_contiguous() and shares_memory(view)
        self._host = host
        # the int16 bits of bfloat16 are read as ml_dtypes' bfloat16 where native, in the
        # tensor's memory or in its staging copy
        if self._back is not None:
            self.array = host.numpy().reshape(-1)
            if native is not None:
                self.array = self.array.view(native)
        else:
            self.array = memory_view(host, native)

    def _on_device(self, t, mode, layer):
        """The array on the tensor's device: its memory, or a copy there (no host copy)."""
        if mode == "reduce" and t.dtype is torch.bfloat16:
            # no bfloat16 on mpicoll's device path: a float32 copy, reduced, rounded back once
            # (the CPU's float32 stand-in: float32 accumulation, one rounding)
            host = t.to(dtype=torch.float32, memory_format=torch.contiguous_format)
            self._back = host
            self._shared = not t.is_contiguous() and shares_memory(t)
        else:
            view = t.view(_BITS[t.dtype]) if t.dtype in _BITS else t
            if view.is_contiguous():
                host = view
            else:
                host = view.contiguous() if mode != "out" else torch.empty(
                    view.shape, dtype=view.dtype, device=view.device)
                self._back = host
                self._shared = shares_memory(view)
        self._host = host
        self.array = layer.array(host.reshape(-1))

    @property
    def direct(self) -> bool:
        """Whether ``array`` is the tensor's own memory (no staging copy)."""
        return self._back is None

    def scale(self, factor) -> None:
        """Multiply the data by ``factor`` (rounded to its dtype first), in place."""
        if self._layer is None:
            self.array *= self.array.dtype.type(factor)
        else:  # (a kernel on the device, on torch's current stream: the call's)
            h = self._host
            h.mul_(torch.full((), factor, dtype=h.dtype, device=h.device))

    def divide(self, size) -> None:
        """Divide the (floating-point) data by ``size``, in place (AVG)."""
        if self._layer is None:
            self.array /= self.array.dtype.type(size)
        else:
            h = self._host
            h.div_(torch.full((), size, dtype=h.dtype, device=h.device))

    def fill(self, source) -> None:
        """Write ``source`` (elements of the array's dtype: a NumPy array on the host, a torch
        tensor on a device) into the array."""
        if self._layer is None:
            self.array[...] = source
        else:
            self._host.reshape(-1).copy_(source)

    def bytes_from(self, source) -> None:
        """Write the bytes ``source`` (a uint8 NumPy array on the host, a uint8 tensor on a
        device) into the array."""
        if self._layer is None:
            self.array.view(np.uint8)[...] = source
        else:
            self._host.reshape(-1).view(torch.uint8).copy_(source)

    def fresh(self) -> None:
        """Make ``array`` a copy of the tensor's data where it is the tensor's own memory (an
        input that must stay as it was: PREMUL_SUM scales it, an output overlaps it)."""
        if self._back is not None:
            return
        if self._layer is None:
            self.array = self.array.copy()
        else:  # (a copy on the device, on torch's current stream)
            self._host = self._host.clone(memory_format=torch.contiguous_format)
            self.array = self._layer.array(self._host.reshape(-1))

    @property
    def host(self):
        """The torch tensor ``array`` is a view of (the tensor itself where direct)."""
        return self._host

    def done(self) -> None:
        """Copy the staged result back into the tensor (nothing when moved in place)."""
        if self._back is None:
            return
        back, t = self._back, self.tensor
        if t.dtype is torch.bfloat16 and back.dtype is not torch.int16:
            if not self._shared:
                from_reducible(t, back)
                return
        elif t.dtype in _BITS:
            t = t.view(_BITS[t.dtype])
        if self._shared:
            write_shared(t, back)
        else:
            t.copy_(back)


_VIEWS: dict = {}  # (address, elements, torch dtype, NumPy dtype) -> memory_view's array
_VIEWS_MAX = 4096  # arrays kept before the table starts again (each is a few hundred bytes)


def memory_view(t, dtype=None):
    """A flat NumPy array over a contiguous CPU tensor's memory (read as ``dtype`` if given).

    Not ``Tensor.numpy()``: that would mark the storage as never resizable, and
    FSDP frees parameters by resizing their storage.  The array is made over
    the address alone (it holds no reference to the tensor: the caller keeps
    the tensor alive while the array is in use) and kept, so the same memory
    gives the same array object on every call, which lets mpicoll repeat a
    call without validating it again.  A kept array is only handed out for a
    tensor that now owns those bytes (same address, element count and dtype),
    so memory freed and reused since is never reached through a stale view.
    """
    n = t.numel()
    if not n:
        array = np.from_dlpack(t).reshape(-1)
        return array if dtype is None else array.view(dtype)
    key = (t.data_ptr(), n, t.dtype, dtype)
    array = _VIEWS.get(key)
    if array is None:
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        nbytes = n * t.element_size()
        memory = (ctypes.c_char * nbytes).from_address(key[0])
        array = _VIEWS[key] = np.frombuffer(memory, dtype=DTYPES[t.dtype] if dtype is None
                                            else dtype)
    return array


def to_reducible(t):
    """bfloat16 without ``ml_dtypes``: a float32 host copy of a bfloat16 tensor, which mpicoll reduces.

    mpicoll's array layer takes bfloat16 only as ``ml_dtypes`` arrays; without
    them, reducing in float32 and rounding once at the end
    (:func:`from_reducible`) gives what the native path gives for SUM (float32
    accumulation, one rounding), at the cost of a float32 copy each way.
    """
    return t.to(device="cpu", dtype=torch.float32).contiguous()


def from_reducible(t, reduced) -> None:
    """Write the float32 result of :func:`to_reducible` back into the bfloat16 tensor ``t``."""
    t.copy_(reduced)
