"""Array wrappers: put host values into the kind of buffer a user passes, and read them back.

One object per kind of buffer, all with the same four methods, used by
``python -m mpicoll.verify``, ``python -m mpicoll.bench``, the examples and
the tests to run the same check over NumPy, CuPy (or any registered device
runtime, the tests' fake GPU included), ``array.array``, ``bytearray``,
``memoryview`` and DLPack buffers::

    put(host)        a new buffer of this kind holding ``host``'s values (1-D)
    empty(n, dtype)  a new buffer of this kind for ``n`` elements
    get(buf, dtype)  the values as a host NumPy array, after the device is done
    sync()           wait for the device (nothing on the host)

``name`` says what the wrapper makes, ``device`` is "cpu" or "gpu".
:func:`to_host` reads any of them back without knowing the kind.
Nothing here imports CuPy: device wrappers take the runtime or module they use.
"""

from __future__ import annotations

import array as _array

import numpy as np

__all__ = ["NumpyArrays", "ArrayArrays", "BytearrayArrays", "MemoryviewArrays", "DLPackArrays",
           "DeviceArrays", "CupyArrays", "NUMPY", "HOST_KINDS", "host_kinds", "to_host"]


class NumpyArrays:
    """NumPy arrays (a copy of the host values)."""

    name = "numpy"
    device = "cpu"

    def supports(self, dtype) -> bool:
        return True

    def put(self, host):
        return np.array(host, copy=True)

    def empty(self, n, dtype):
        return np.empty(n, dtype)

    def get(self, buf, dtype=None):
        return np.asarray(buf)

    def sync(self):
        pass


class ArrayArrays(NumpyArrays):
    """``array.array`` of the dtype's typecode (types with a one-letter code only)."""

    name = "array.array"

    def supports(self, dtype) -> bool:
        dtype = np.dtype(dtype)
        return dtype.char in _array.typecodes and dtype.isnative and \
            _array.array(dtype.char).itemsize == dtype.itemsize

    def put(self, host):
        host = np.ascontiguousarray(host)
        buf = _array.array(host.dtype.char)
        buf.frombytes(host.tobytes())
        return buf

    def empty(self, n, dtype):
        return _array.array(np.dtype(dtype).char, bytes(n * np.dtype(dtype).itemsize))

    def get(self, buf, dtype=None):
        return np.frombuffer(buf, dtype or np.dtype(buf.typecode)).copy()


class BytearrayArrays(NumpyArrays):
    """``bytearray`` holding the raw bytes (the reader names the dtype)."""

    name = "bytearray"

    def put(self, host):
        return bytearray(np.ascontiguousarray(host).tobytes())

    def empty(self, n, dtype):
        return bytearray(n * np.dtype(dtype).itemsize)

    def get(self, buf, dtype=None):
        if dtype is None:
            raise TypeError("bytearray: get() needs the dtype")
        return np.frombuffer(buf, dtype).copy()


class MemoryviewArrays(NumpyArrays):
    """``memoryview`` of a NumPy array (its format and shape are the array's)."""

    name = "memoryview"

    def put(self, host):
        return memoryview(np.array(host, copy=True))

    def empty(self, n, dtype):
        return memoryview(np.empty(n, dtype))

    def get(self, buf, dtype=None):
        return np.array(buf, copy=True) if dtype is None else np.frombuffer(buf, dtype).copy()


class _DLPackOnly:
    """A buffer that speaks only DLPack (no buffer protocol, no ``__array__``)."""

    def __init__(self, arr):
        self._arr = arr

    def __dlpack__(self, *args, **kwargs):
        return self._arr.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()

    def __len__(self):
        return len(self._arr)


class DLPackArrays(NumpyArrays):
    """Host buffers reachable only through ``__dlpack__`` (what a JAX/PyTorch CPU tensor offers)."""

    name = "dlpack"

    def supports(self, dtype) -> bool:
        return np.dtype(dtype).kind in "biufc"

    def put(self, host):
        return _DLPackOnly(np.array(host, copy=True))

    def empty(self, n, dtype):
        return _DLPackOnly(np.empty(n, dtype))

    def get(self, buf, dtype=None):
        return np.from_dlpack(buf).copy()


class DeviceArrays:
    """Arrays of a device runtime with mpicoll's runtime interface (``xp``, ``to_host``, streams).

    ``mpicoll.backends.devices.CUPY.rt`` for CuPy; the tests' fake runtime
    (``tests/support/fakegpu.py``) for ``__cuda_array_interface__`` arrays over host memory.
    """

    device = "gpu"

    def __init__(self, rt, name: str = "device"):
        self.rt = rt
        self.xp = rt.xp
        self.name = name

    def supports(self, dtype) -> bool:
        return np.dtype(dtype).char not in "gG"

    def put(self, host):
        return self.xp.asarray(np.ascontiguousarray(host))

    def empty(self, n, dtype):
        return self.xp.empty(n, dtype)

    def get(self, buf, dtype=None):
        self.sync()
        return np.asarray(self.rt.to_host(buf))

    def sync(self):
        self.rt.synchronize(self.rt.current_stream())


class CupyArrays:
    """CuPy arrays, on the current device and stream."""

    name = "cupy"
    device = "gpu"

    def __init__(self, cupy):
        self.cp = cupy

    def supports(self, dtype) -> bool:
        return np.dtype(dtype).char not in "gG"

    def put(self, host):
        return self.cp.asarray(host)

    def empty(self, n, dtype):
        return self.cp.empty(n, dtype)

    def get(self, buf, dtype=None):
        self.sync()
        return self.cp.asnumpy(buf)

    def sync(self):
        self.cp.cuda.get_current_stream().synchronize()


NUMPY = NumpyArrays()
HOST_KINDS = (NUMPY, ArrayArrays(), BytearrayArrays(), MemoryviewArrays(), DLPackArrays())


def host_kinds(dtype) -> list:
    """The host wrappers that can hold ``dtype``."""
    return [k for k in HOST_KINDS if k.supports(dtype)]


def to_host(buf, dtype=None) -> np.ndarray:
    """The values of any buffer above (or a CuPy array) as a host NumPy array.

    Device arrays are copied back with their ``get()`` (which waits for
    the copy); DLPack-only buffers through ``numpy.from_dlpack``; anything
    with the buffer protocol is read as ``dtype`` (default: its own format).
    """
    if isinstance(buf, np.ndarray):
        return buf
    get = getattr(buf, "get", None)
    if callable(get) and hasattr(buf, "__cuda_array_interface__"):
        return np.asarray(get())
    if isinstance(buf, _DLPackOnly):
        return np.from_dlpack(buf)
    if dtype is not None and isinstance(buf, (bytes, bytearray, memoryview, _array.array)):
        return np.frombuffer(buf, dtype)
    return np.asarray(buf)
