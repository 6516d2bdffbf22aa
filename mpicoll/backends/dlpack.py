"""DLPack host buffers read the way mpi4py reads them.

mpi4py takes a DLPack producer's capsule, keeps it (unconsumed) as the owner
of the memory and moves the tensor's bytes: writable unless a versioned
(DLPack >= 1.0) producer sets its read-only flag, typed by the tensor's
(code, bits, lanes) (src/mpi4py/MPI.src/asdlpack.pxi).  ``np.from_dlpack`` is
not that: it marks every array from a legacy capsule read-only, and refuses
dtypes NumPy has no name for (bool through some producers, bfloat16, ...).

:func:`asarray` gives a NumPy array over the producer's memory with mpi4py's
rules.  The capsule lives as long as the array (its ``base``): when both are
gone the capsule's destructor calls the producer's deleter, as for mpi4py.
Tensors of a type mpi4py moves as raw bytes (``MPI.BYTE``: bfloat16,
vector lanes, ...) come back as uint8 arrays that :func:`is_raw` recognises,
except bfloat16 and the float8 types when ``ml_dtypes`` is installed: those
come back as arrays of ml_dtypes' types, with the tensor's shape, so that
they can be reduced (in float32) and returned in their own type.
"""

from __future__ import annotations

import ctypes
from ctypes import (
    POINTER,
    Structure,
    c_char_p,
    c_int,
    c_int32,
    c_int64,
    c_uint8,
    c_uint16,
    c_uint32,
    c_uint64,
    c_void_p,
    py_object,
)

import numpy as np

KDLCPU = 1
READ_ONLY = 1  # DLPACK_FLAG_BITMASK_READ_ONLY


class _Device(Structure):
    _fields_ = [("device_type", c_int), ("device_id", c_int32)]


class _DataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class _Tensor(Structure):
    _fields_ = [("data", c_void_p), ("device", _Device), ("ndim", c_int32), ("dtype", _DataType),
                ("shape", POINTER(c_int64)), ("strides", POINTER(c_int64)),
                ("byte_offset", c_uint64)]


class _Managed(Structure):  # DLManagedTensor (legacy, capsule "dltensor")
    _fields_ = [("dl_tensor", _Tensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class _Version(Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class _ManagedVersioned(Structure):  # DLManagedTensorVersioned (capsule "dltensor_versioned")
    _fields_ = [("version", _Version), ("manager_ctx", c_void_p), ("deleter", c_void_p),
                ("flags", c_uint64), ("dl_tensor", _Tensor)]


# private prototypes: setting argtypes on ctypes.pythonapi's shared objects would
# change them for every other user in the process
_capsule_is_valid = ctypes.PYFUNCTYPE(c_int, py_object, c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_pointer = ctypes.PYFUNCTYPE(c_void_p, py_object, c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))

_LONGDOUBLE_BITS = 8 * np.dtype(np.longdouble).itemsize

# (DLPack type code, bits) -> NumPy dtype, the types mpi4py names (lanes == 1)
_DTYPES = {
    (6, 8): np.dtype(np.bool_),
    (0, 8): np.dtype(np.int8), (0, 16): np.dtype(np.int16),
    (0, 32): np.dtype(np.int32), (0, 64): np.dtype(np.int64),
    (1, 8): np.dtype(np.uint8), (1, 16): np.dtype(np.uint16),
    (1, 32): np.dtype(np.uint32), (1, 64): np.dtype(np.uint64),
    (2, 16): np.dtype(np.float16), (2, 32): np.dtype(np.float32), (2, 64): np.dtype(np.float64),
    (2, _LONGDOUBLE_BITS): np.dtype(np.longdouble),
    (5, 64): np.dtype(np.complex64), (5, 128): np.dtype(np.complex128),
    (5, 2 * _LONGDOUBLE_BITS): np.dtype(np.clongdouble),
}
# (DLPack type code, bits) -> ml_dtypes type name (dlpack.h: kDLBfloat 4,
# kDLFloat8_e4m3fn 10, kDLFloat8_e5m2 12); NumPy has no names for these
_ML_CODES = {(4, 16): "bfloat16", (10, 8): "float8_e4m3fn", (12, 8): "float8_e5m2"}
# two float lanes: mpi4py reads them as one complex number
_PAIRS = {32: np.dtype(np.complex64), 64: np.dtype(np.complex128),
          _LONGDOUBLE_BITS: np.dtype(np.clongdouble)}


class _Owner:
    """Keeps the capsule alive for the array; describes the memory to NumPy."""

    __slots__ = ("capsule", "__array_interface__", "raw")

    def __init__(self, capsule, interface, raw):
        self.capsule = capsule
        self.__array_interface__ = interface
        self.raw = raw  # the DLPack (code, bits, lanes) of a tensor moved as bytes, else None


def _capsule(obj):
    """(capsule, versioned) from the producer, asking for DLPack 1.0 first (as mpi4py)."""
    try:
        try:
            capsule = obj.__dlpack__(max_version=(1, 0), copy=False)
        except TypeError:  # a producer older than DLPack 1.0
            capsule = obj.__dlpack__()
    except BufferError as exc:  # the producer cannot export this tensor
        raise TypeError(f"dlpack: {exc}") from None
    if _capsule_is_valid(capsule, b"dltensor_versioned"):
        return capsule, True
    if _capsule_is_valid(capsule, b"dltensor"):
        return capsule, False
    raise TypeError("dlpack: the producer returned no valid DLPack capsule")


def _ml_dtype(dt):
    """The ml_dtypes dtype of a bfloat16/float8 tensor, or None (another type, no ml_dtypes)."""
    name = _ML_CODES.get((dt.code, dt.bits)) if dt.lanes == 1 else None
    if name is None:
        return None
    try:
        import ml_dtypes
    except ImportError:  # then moved as bytes, as mpi4py moves it
        return None
    return np.dtype(getattr(ml_dtypes, name))


def _dtype(dt):
    if dt.lanes == 1:
        return _DTYPES.get((dt.code, dt.bits)) or _ml_dtype(dt)
    if dt.code == 2 and dt.lanes == 2:
        return _PAIRS.get(dt.bits)
    return None


def asarray(obj) -> np.ndarray:
    """A NumPy array over a CPU DLPack tensor's memory, writable unless marked read-only.

    Raises TypeError for a non-CPU tensor or a malformed capsule, ValueError
    for negative shapes or strides.
    """
    device = obj.__dlpack_device__()
    if int(device[0]) != KDLCPU:
        raise TypeError(f"dlpack: expected a CPU tensor, got device type {int(device[0])}")
    capsule, versioned = _capsule(obj)
    if versioned:
        managed = _ManagedVersioned.from_address(_capsule_pointer(capsule, b"dltensor_versioned"))
        if managed.version.major < 1:
            raise TypeError(f"dlpack: unexpected version {managed.version.major}")
        readonly = bool(managed.flags & READ_ONLY)
    else:
        managed = _Managed.from_address(_capsule_pointer(capsule, b"dltensor"))
        readonly = False  # legacy capsules carry no flag: writable, as in mpi4py
    t = managed.dl_tensor
    ndim = int(t.ndim)
    if ndim < 0:
        raise ValueError("dlpack: number of dimensions is negative")
    shape = tuple(int(t.shape[i]) for i in range(ndim))
    if any(n < 0 for n in shape):
        raise ValueError(f"dlpack: negative shape {shape}")
    estrides = None if not t.strides else tuple(int(t.strides[i]) for i in range(ndim))
    if estrides is not None and any(s < 0 for s in estrides):
        raise ValueError(f"dlpack: negative strides {estrides}")
    dtype = _dtype(t.dtype)
    raw = dtype is None
    nelems = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if raw:  # moved as MPI.BYTE (mpi4py's 'B' format): the tensor's bytes, packed
        nbytes = nelems * ((t.dtype.bits * t.dtype.lanes + 7) // 8)
        if estrides is not None and not _contiguous(shape, estrides):
            raise ValueError("dlpack: expected a contiguous buffer, got a strided tensor")
        dtype, shape, strides = np.dtype(np.uint8), (nbytes,), None
    else:
        strides = None if estrides is None else tuple(s * dtype.itemsize for s in estrides)
    address = (t.data or 0) + int(t.byte_offset)
    keep = capsule
    if nelems == 0 or not address:  # no memory to view (NULL is allowed): a stand-in address
        stand_in = np.empty(1, np.uint8)
        keep, address, strides = (capsule, stand_in), stand_in.ctypes.data, None
    # ml_dtypes types have no typestr NumPy reads back: describe them as bytes ("V2")
    # and view the result as the type
    view = dtype if dtype.kind == "V" or dtype.str[1:] == "f1" else None
    typestr = f"|V{dtype.itemsize}" if view is not None else dtype.str
    interface = {"version": 3, "shape": shape, "typestr": typestr, "strides": strides,
                 "data": (address, readonly)}
    dltype = (int(t.dtype.code), int(t.dtype.bits), int(t.dtype.lanes)) if raw else None
    arr = np.asarray(_Owner(keep, interface, dltype))
    return arr if view is None else arr.view(view)


def _contiguous(shape, strides) -> bool:
    """C- or F-contiguous in elements (dimensions of length 1 have any stride)."""
    def packed(order):
        size = 1
        for n, s in order:
            if n > 1 and s != size:
                return False
            size *= n
        return True
    pairs = list(zip(shape, strides))
    return packed(reversed(pairs)) or packed(pairs)


def is_raw(arr) -> bool:
    """Whether ``arr`` holds a DLPack tensor mpi4py would move as MPI.BYTE."""
    owner = getattr(arr, "base", None)
    return isinstance(owner, _Owner) and bool(owner.raw)


def raw_type(arr) -> str:
    """The DLPack type of a raw tensor, for messages: "(code 4, bits 16, lanes 1)"."""
    code, bits, lanes = arr.base.raw
    return f"(code {code}, bits {bits}, lanes {lanes})"
