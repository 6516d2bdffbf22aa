"""Buffer arguments: mpi4py message specs and arrays -> one normalised form.

A :class:`Msg` is what the algorithms need: a 1-D array view of the data in
its backend (NumPy or a device backend), the element dtype, its category for
op checks, the MPI datatype that carries it, and a printable type name.

Accepted specs follow mpi4py (``Comm.Allreduce`` & co.):

* ``buf``                          any buffer-protocol, DLPack or CUDA-array object
* ``[buf, datatype]``              datatype an ``MPI.Datatype`` or a typecode str
* ``[buf, count, datatype]``       the first ``count`` elements
* ``[buf, (count, displ), datatype]``
* ``[buf, counts, displs, datatype]``  vector form (``Allgatherv``)
* ``[None, datatype]``             an empty message
* ``MPI.IN_PLACE`` / ``None``      in place, where the collective allows it
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from . import _backend, _types


class Msg:
    __slots__ = ("array", "dtype", "category", "mpitype", "typename", "backend",
                 "counts", "displs", "optype")

    def __init__(self, array, dtype, category, mpitype, typename, backend,
                 counts=None, displs=None, optype=None):
        self.array = array        # 1-D view, exactly the message's elements
        self.dtype = dtype
        self.category = category
        self.mpitype = mpitype    # datatype used on the wire
        # datatype handed to user-defined ops: the one mpi4py would pass for this spec
        self.optype = optype or mpitype
        self.typename = typename  # for messages: "float64", "MPI.INT", ...
        self.backend = backend
        self.counts = counts      # vector specs only
        self.displs = displs

    @property
    def count(self) -> int:
        return len(self.array)


def is_in_place(obj) -> bool:
    return obj is None or obj is MPI.IN_PLACE


def _check_layout(arr, argname, writable):
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise ValueError(
            f"{argname}: expected a contiguous buffer, got a non-contiguous array "
            f"with shape {tuple(arr.shape)} and strides {tuple(arr.strides)}"
        )
    if writable and not is_writable(arr):
        raise ValueError(f"{argname}: expected a writable buffer, got a read-only one")


def is_writable(arr) -> bool:
    """False for read-only arrays (CuPy arrays have no such flag: always writable)."""
    return getattr(arr.flags, "writeable", True)


def _flat(arr):
    """1-D view in memory order of a contiguous array."""
    if arr.ndim == 1:
        return arr
    return arr.reshape(-1, order="A" if arr.flags.f_contiguous and not arr.flags.c_contiguous else "C")


def _to_array(obj, argname):
    """(backend, array) for a data object, without copying."""
    backend = _backend.backend_of(obj)
    if backend is None:
        raise TypeError(
            f"{argname}: got a device array ({type(obj).__name__}) but no device backend "
            f"is available; install CuPy (pip install 'mpicoll[cuda12]' or 'mpicoll[cuda13]')"
        )
    try:
        return backend, backend.asarray(obj)
    except TypeError:
        raise TypeError(
            f"{argname}: expected a buffer (buffer protocol, DLPack or CUDA array interface), "
            f"got {type(obj).__name__}"
        ) from None


# Python objects that cannot be the data of a message (they hold no buffer).
_NOT_DATA = (bool, int, float, complex, str, list, tuple, dict)


def _as_datatype(obj, argname):
    if isinstance(obj, MPI.Datatype):
        return obj
    if isinstance(obj, str):
        try:
            return _types.datatype_of_typecode(obj)
        except (KeyError, TypeError, ValueError):
            raise TypeError(f"{argname}: unknown typecode {obj!r}") from None
    raise TypeError(f"{argname}: expected an MPI.Datatype, got {type(obj).__name__}")


def _sequence_pair(obj) -> bool:
    """Whether ``obj`` is (counts, displs): a list/tuple of two sequences."""
    return isinstance(obj, (list, tuple)) and len(obj) == 2 and all(
        hasattr(v, "__len__") and not isinstance(v, (str, bytes)) for v in obj)


def _as_count(obj, argname, what="count"):
    if isinstance(obj, bool) or not isinstance(obj, (int, np.integer)):
        raise TypeError(f"{argname}: expected an integer {what}, got {type(obj).__name__}")
    if obj < 0:
        raise ValueError(f"{argname}: expected a non-negative {what}, got {int(obj)}")
    return int(obj)


def as_counts(obj, size, argname):
    """A tuple of ``size`` non-negative ints."""
    if isinstance(obj, (str, bytes)) or not hasattr(obj, "__len__"):
        raise TypeError(f"{argname}: expected a sequence of {size} integers, got {type(obj).__name__}")
    if len(obj) != size:
        raise ValueError(f"{argname}: expected {size} entries (one per rank), got {len(obj)}")
    return tuple(_as_count(c, argname) for c in obj)


def message(spec, argname, *, writable, comm_size=None) -> Msg:
    """Normalise one mpi4py-style buffer argument (not IN_PLACE)."""
    if spec is MPI.IN_PLACE or spec is MPI.BOTTOM:
        name = "MPI.IN_PLACE" if spec is MPI.IN_PLACE else "MPI.BOTTOM"
        raise ValueError(f"{argname}: expected a buffer, got {name} (only sendbuf may be MPI.IN_PLACE)")
    datatype = None
    count = displ = None
    counts = displs = None
    if isinstance(spec, (list, tuple)):
        if spec and isinstance(spec[0], _NOT_DATA):
            # a list of numbers is not a message: its first item must hold the data
            raise TypeError(
                f"{argname}: expected a buffer or a [buffer, ...] message, got a "
                f"{type(spec).__name__} of {type(spec[0]).__name__}"
            )
        if not 1 <= len(spec) <= 4:
            raise ValueError(f"{argname}: expected [data, (count,) datatype], got {len(spec)} items")
        data, rest = spec[0], list(spec[1:])
        if rest and isinstance(rest[-1], (MPI.Datatype, str)):
            datatype = _as_datatype(rest.pop(), argname)
        if len(rest) == 2:
            if comm_size is None:
                raise ValueError(f"{argname}: per-rank counts and displacements are not allowed here")
            counts = as_counts(rest[0], comm_size, argname)
            displs = as_counts(rest[1], comm_size, argname)
        elif len(rest) == 1:
            c = rest[0]
            if comm_size is not None and _sequence_pair(c):
                # mpi4py's vector form [data, (counts, displs), datatype]
                counts = as_counts(c[0], comm_size, argname)
                displs = as_counts(c[1], comm_size, argname)
            elif isinstance(c, (list, tuple)) and comm_size is not None and len(c) == comm_size:
                counts = as_counts(c, comm_size, argname)
            elif isinstance(c, (list, tuple)):
                if len(c) != 2:
                    raise ValueError(f"{argname}: expected (count, displ), got {len(c)} items")
                count = _as_count(c[0], argname)
                displ = _as_count(c[1], argname, "displacement")
            elif c is not None:
                count = _as_count(c, argname)
        elif rest:
            raise ValueError(f"{argname}: expected [data, count, datatype], got {len(spec)} items")
    else:
        data = spec

    if data is None:
        if datatype is None:
            raise TypeError(f"{argname}: an empty message [None, datatype] needs a datatype")
        if (count or 0) != 0 or (counts is not None and any(counts)):
            raise ValueError(f"{argname}: got no data but a count of {count}")
        dtype, category = _types.dtype_of_datatype(datatype)
        backend = _backend.NUMPY
        arr = np.empty(0, dtype=dtype)
    else:
        backend, arr = _to_array(data, argname)
        _check_layout(arr, argname, writable)
        if datatype is None:
            dtype = arr.dtype
            try:
                category = dtype_info(dtype)[0]
            except TypeError as exc:
                raise TypeError(f"{argname}: {exc}") from None
        else:
            dtype, category = _types.dtype_of_datatype(datatype)
            supports = getattr(backend, "supports", None)
            if supports is not None and not supports(dtype):
                raise TypeError(
                    f"{argname}: {_types.datatype_name(datatype)} cannot be used with a "
                    f"{backend.name} (device) buffer; use a host (NumPy) buffer for it"
                )
            raw = _flat(arr).view(np.uint8) if arr.dtype.itemsize else _flat(arr)
            if raw.size % dtype.itemsize:
                raise ValueError(
                    f"{argname}: buffer length {raw.size} is not a multiple of "
                    f"datatype extent {dtype.itemsize}"
                )
            arr = raw.view(dtype)
        arr = _flat(arr)

    if datatype is not None and category != "pair":
        mpitype = _types.wire_type(dtype) or datatype
        typename = _types.datatype_name(datatype)
        optype = datatype
    elif datatype is not None:
        mpitype = optype = datatype
        typename = _types.datatype_name(datatype)
    else:
        mpitype, typename = dtype_info(dtype)[1:]
        optype = _types.natural_type(dtype)

    avail = len(arr)
    if counts is not None:
        if displs is None:
            displs = tuple(np.cumsum((0,) + counts[:-1]).tolist())
        need = max((d + c for c, d in zip(counts, displs)), default=0)
        if need > avail:
            raise ValueError(
                f"{argname}: counts and displacements need {need} elements, "
                f"the buffer holds {avail}"
            )
        return Msg(arr, dtype, category, mpitype, typename, backend, counts, displs, optype)
    displ = displ or 0
    if count is None:
        count = avail - displ if displ <= avail else -1
    if displ + count > avail or count < 0:
        raise ValueError(
            f"{argname}: count {count} at displacement {displ} exceeds the buffer's "
            f"{avail} elements"
        )
    if displ or count != avail:
        arr = arr[displ:displ + count]
    return Msg(arr, dtype, category, mpitype, typename, backend, optype=optype)


def check_same_type(smsg: Msg, rmsg: Msg) -> None:
    """TypeError unless send and receive messages have one datatype and backend."""
    if smsg.dtype != rmsg.dtype or smsg.category != rmsg.category:
        raise TypeError(
            f"mismatch in send and receive MPI datatypes: sendbuf holds {smsg.typename}, "
            f"recvbuf holds {rmsg.typename}"
        )
    if smsg.backend is not rmsg.backend:
        raise TypeError(
            f"mismatch in send and receive buffer kinds: sendbuf is a {smsg.backend.name} "
            f"buffer, recvbuf is a {rmsg.backend.name} buffer"
        )


def array_arg(x, argname, *, writable=False, c_order=False):
    """(backend, array) for an array-function argument, with the same checks."""
    if isinstance(x, (list, tuple, int, float, complex, bool)) or x is None:
        raise TypeError(f"{argname}: expected an array, got {type(x).__name__}")
    backend, arr = _to_array(x, argname)
    _check_layout(arr, argname, writable)
    if c_order and arr.ndim > 1 and not arr.flags.c_contiguous:
        raise ValueError(f"{argname}: expected a C-contiguous array, got a Fortran-ordered one")
    try:
        dtype_info(arr.dtype)
    except TypeError as exc:
        raise TypeError(f"{argname}: {exc}") from None
    return backend, arr


_DTYPE_INFO: dict = {}


def dtype_info(dtype):
    """(category, wire datatype, name) of a NumPy dtype MPI can carry; TypeError otherwise.

    Cached per dtype: ``str(dtype)`` alone costs microseconds, which matters
    for small messages.
    """
    info = _DTYPE_INFO.get(dtype)
    if info is None:
        info = (_types.category_of_dtype(dtype), _types.wire_type(dtype), str(dtype))
        _DTYPE_INFO[dtype] = info
    return info


def msg_of_array(arr, backend) -> Msg:
    """A Msg over an already checked array (all its elements, memory order)."""
    dtype = arr.dtype
    category, mpitype, typename = dtype_info(dtype)
    return Msg(_flat(arr), dtype, category, mpitype, typename, backend,
               optype=_types.natural_type(dtype))
