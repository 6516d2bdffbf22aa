"""Buffer arguments: mpi4py message specs and arrays -> one normalised form.

A :class:`Msg` is what the algorithms need: a 1-D array view of the data in
its backend (NumPy or a device backend), the element dtype, its category for
op checks, the MPI datatype that carries it, and a printable type name.

Accepted specs are mpi4py's, with mpi4py's meaning (see :func:`message`):
a buffer-protocol, DLPack or CUDA-array object, or ``[buf, count, displ,
datatype]`` with any of count, displ, datatype left out or None, count and
displ also as a ``(count, displ)`` pair; ``Allgatherv``'s receive spec takes
per-rank counts and displacements there.  ``[None, datatype]`` is an empty
message; ``MPI.IN_PLACE`` / ``None`` as sendbuf means in place where the
collective allows it.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..algorithms.schedule import offsets
from ..backends import dlpack as _dlpack
from ..backends import host as _backend
from ..backends import registry as _registry
from ..core import types as _types
from ..core.message import Msg


def is_in_place(obj) -> bool:
    return obj is None or obj is MPI.IN_PLACE


def _check_layout(arr, argname, writable):
    if not (arr.flags.c_contiguous or arr.flags.f_contiguous):
        raise ValueError(
            f"{argname}: expected a contiguous buffer, got a non-contiguous array "
            f"with shape {tuple(arr.shape)} and strides {tuple(arr.strides)}"
        )
    if writable:
        check_writable(arr, argname)


def check_writable(arr, argname, expected="a writable buffer") -> None:
    """ValueError naming ``argname`` when ``arr`` is read-only."""
    if not is_writable(arr):
        raise ValueError(f"{argname}: expected {expected}, got a read-only one")


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
    backend = _registry.backend_of(obj)
    if backend is None:
        raise TypeError(
            f"{argname}: got a device array ({type(obj).__name__}) but no device backend "
            f"is available; install CuPy (pip install 'mpicoll[cuda12]' or 'mpicoll[cuda13]')"
        )
    try:
        return backend, backend.asarray(obj)
    except TypeError as exc:
        detail = f" ({exc})" if str(exc) else ""
        raise TypeError(
            f"{argname}: expected a buffer (buffer protocol, DLPack or CUDA array interface), "
            f"got {type(obj).__name__}{detail}"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{argname}: {exc}") from None


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
    raise TypeError(
        f"{argname}: expected an MPI.Datatype or a typecode string as the datatype, "
        f"got {type(obj).__name__}"
    )


def _as_count(obj, argname, what="count"):
    if isinstance(obj, bool) or not isinstance(obj, (int, np.integer)):
        raise TypeError(f"{argname}: expected an integer {what}, got {type(obj).__name__}")
    if obj < 0:
        raise ValueError(f"{argname}: expected a non-negative {what}, got {int(obj)}")
    return int(obj)


def as_counts(obj, size, argname, what="count"):
    """A tuple of ``size`` non-negative ints."""
    if isinstance(obj, (str, bytes)) or not hasattr(obj, "__len__"):
        raise TypeError(f"{argname}: expected a sequence of {size} integers, got {type(obj).__name__}")
    if len(obj) != size:
        raise ValueError(f"{argname}: expected {size} entries (one per rank), got {len(obj)}")
    return tuple(_as_count(c, argname, what) for c in obj)


# --- mpi4py message specs ------------------------------------------------------------
# The grammar is mpi4py's (src/mpi4py/MPI.src/msgbuffer.pxi, message_simple and
# message_vector), item for item, so every spec mpi4py accepts means the same here:
#
#   buf                                  a buffer (buffer protocol, DLPack, CUDA array)
#   [buf, T]                             T an MPI.Datatype or a typecode string
#   [buf, count]  [buf, (count, displ)]  no T: the buffer's own type
#   [buf, count, T]  [buf, (count, displ), T]
#   [buf, count, displ, T]
#
# count, displ and T may each be None (inferred).  In the vector form (Allgatherv's
# recvbuf) count is counts and displ displs: an integer (the same count for every
# rank; displs: a stride), a sequence of one per rank, or None (counts: the buffer
# split as evenly as possible; displs: packed); only a *tuple* is read as
# (counts, displs), a list is the counts.  Unlike mpi4py (which leaves it to MPI),
# every count and displacement is checked against the buffer.  One extension: a
# vector spec [buf, counts, displs] (three items, no datatype) is read as such.


def _has_buffer(obj) -> bool:
    """Whether ``obj`` exposes the buffer protocol (checked first, as mpi4py does)."""
    if isinstance(obj, (np.ndarray, bytes, bytearray, memoryview)):
        return True
    if isinstance(obj, (list, tuple, str)) or obj is None:
        return False
    try:
        memoryview(obj).release()
    except TypeError:
        return False
    return True


def _is_datatype(obj) -> bool:
    return isinstance(obj, (MPI.Datatype, str))


def _split_pair(obj, argname, vector):
    if len(obj) != 2:
        what = "(counts, displs)" if vector else "(count, displ)"
        raise ValueError(f"{argname}: expected {what}, got {len(obj)} items")
    return obj[0], obj[1]


def _unpack(spec, argname, vector):
    """(data, count, displ, datatype) of a spec, as mpi4py unpacks it (None: not given)."""
    if _has_buffer(spec):
        return spec, None, None, None
    if isinstance(spec, (list, tuple)):
        if spec and isinstance(spec[0], _NOT_DATA):
            # a list of numbers is not a message: its first item must hold the data
            raise TypeError(
                f"{argname}: expected a buffer or a [buffer, ...] message, got a "
                f"{type(spec).__name__} of {type(spec[0]).__name__}"
            )
        pair = tuple if vector else (list, tuple)
        count = displ = datatype = None
        if len(spec) == 2:
            data, count = spec
            if _is_datatype(count):
                count, datatype = None, count
            elif isinstance(count, pair):
                count, displ = _split_pair(count, argname, vector)
        elif len(spec) == 3:
            data, count, datatype = spec
            if isinstance(count, pair):
                count, displ = _split_pair(count, argname, vector)
            elif vector and not (_is_datatype(datatype) or datatype is None):
                # mpicoll's extension, kept: [buf, counts, displs] (mpi4py refuses it)
                displ, datatype = datatype, None
        elif len(spec) == 4:
            data, count, displ, datatype = spec
        else:
            raise ValueError(
                f"{argname}: expected a buffer or a list/tuple of 2 to 4 items "
                f"[data, count, displ, datatype], got {len(spec)} item(s)"
            )
        return data, count, displ, datatype
    if hasattr(spec, "__dlpack__") or hasattr(spec, "__cuda_array_interface__"):
        return spec, None, None, None
    raise TypeError(
        f"{argname}: expected a buffer (buffer protocol, DLPack or CUDA array interface) "
        f"or a [buffer, ...] list/tuple, got {type(spec).__name__}"
    )


def _region(avail, count, displ, blocks, argname):
    """(start, elements, per block) of a simple spec over ``avail`` elements."""
    displ = 0 if displ is None else _as_count(displ, argname, "displacement")
    if count is None and displ > avail:
        raise ValueError(f"{argname}: displacement {displ} exceeds the buffer's {avail} elements")
    if count is None:
        left = avail - displ
        if blocks > 1 and left % blocks:
            raise ValueError(
                f"{argname}: holds {left} elements, not a multiple of the {blocks} ranks"
            )
        per = left // max(blocks, 1)
    else:
        per = _as_count(count, argname)
    total = per * max(blocks, 1)
    if displ + total > avail:
        ranks = f" ({per} per rank, {blocks} ranks)" if blocks > 1 else ""
        raise ValueError(
            f"{argname}: count {per} at displacement {displ} exceeds the buffer's "
            f"{avail} elements{ranks}"
        )
    return displ, total


def _vector_layout(avail, counts, displs, blocks, argname):
    """(counts, displs) tuples of a vector spec, as mpi4py fills them in."""
    if counts is None:
        counts = tuple(avail // blocks + (avail % blocks > i) for i in range(blocks))
    elif isinstance(counts, (int, np.integer)) and not isinstance(counts, bool):
        counts = (_as_count(counts, argname),) * blocks
    else:
        counts = as_counts(counts, blocks, argname)
    if displs is None:
        displs = tuple(offsets(counts)[:-1])
    elif isinstance(displs, (int, np.integer)) and not isinstance(displs, bool):
        stride = _as_count(displs, argname, "displacement")
        displs = tuple(stride * i for i in range(blocks))
    else:
        displs = as_counts(displs, blocks, argname, "displacement")
    need = max((d + c for c, d in zip(counts, displs)), default=0)
    if need > avail:
        raise ValueError(
            f"{argname}: counts {list(counts)} at displacements {list(displs)} need "
            f"{need} elements, the buffer holds {avail}"
        )
    return counts, displs


def message(spec, argname, *, writable, blocks=0, vector=False) -> Msg:
    """Normalise one mpi4py-style buffer argument (not IN_PLACE).

    ``blocks``: the number of equal blocks the buffer holds (a block collective's
    ``recvbuf``): an inferred count is the buffer's elements over ``blocks``, a
    given count is per block, and the message covers ``count * blocks``
    elements.  ``vector``: ``Allgatherv``'s receive spec (``blocks`` ranks), whose
    Msg is the whole buffer with ``counts`` and ``displs``.
    """
    if spec is MPI.IN_PLACE or spec is MPI.BOTTOM:
        name = "MPI.IN_PLACE" if spec is MPI.IN_PLACE else "MPI.BOTTOM"
        raise ValueError(f"{argname}: expected a buffer, got {name} (only sendbuf may be MPI.IN_PLACE)")
    data, count, displ, datatype = _unpack(spec, argname, vector)
    if datatype is not None:
        datatype = _as_datatype(datatype, argname)

    if data is None:
        if datatype is None:
            raise TypeError(f"{argname}: an empty message [None, datatype] needs a datatype")
        dtype, category = _types.dtype_of_datatype(datatype)
        backend = _backend.NUMPY
        arr = np.empty(0, dtype=dtype)
    else:
        backend, arr = _to_array(data, argname)
        _check_layout(arr, argname, writable)
        if datatype is None and _dlpack.is_raw(arr):
            datatype = MPI.BYTE  # a DLPack type mpi4py moves as bytes (bfloat16, lanes, ...)
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
    if vector:
        counts, displs = _vector_layout(avail, count, displ, blocks, argname)
        return Msg(arr, dtype, category, mpitype, typename, backend, counts, displs, optype)
    if data is None and count is not None and _as_count(count, argname):
        raise ValueError(f"{argname}: got no data but a count of {count}")
    start, total = _region(avail, count, displ, blocks, argname)
    if start or total != avail:
        arr = arr[start:start + total]
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


def array_arg(x, argname):
    """(backend, array) for an array-function argument, of any memory layout.

    The array functions work in logical (C) element order whatever the
    layout, so unlike a message buffer the array need not be contiguous.
    """
    if isinstance(x, (list, tuple, int, float, complex, bool)) or x is None:
        raise TypeError(f"{argname}: expected an array, got {type(x).__name__}")
    backend, arr = _to_array(x, argname)
    if _dlpack.is_raw(arr):
        raise TypeError(f"{argname}: expected an array of a NumPy dtype, got a DLPack tensor "
                        f"of type {_dlpack.raw_type(arr)}")
    try:
        dtype_info(arr.dtype)
    except TypeError as exc:
        raise TypeError(f"{argname}: {exc}") from None
    return backend, arr


def _memory(a):
    """(address, shape, strides, type) of an array's elements: equal for views of the same ones."""
    iface = getattr(a, "__array_interface__", None)
    if iface is None:
        iface = a.__cuda_array_interface__
    shape = tuple(iface["shape"])
    strides = iface.get("strides")
    if strides is None:  # C-contiguous
        strides, step = [], a.dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= n
        strides = strides[::-1]
    return iface["data"][0], shape, tuple(strides), iface["typestr"]


def same_memory(a, b) -> bool:
    """Whether two arrays (one backend) view exactly the same elements the same way.

    This, not object identity, is what makes a call in place: ``out`` may be
    another object over ``x``'s memory (a ``memoryview`` of a ``bytearray``,
    the same array converted twice).
    """
    if a is b:
        return True
    return _memory(a) == _memory(b)


def overlaps(backend, a, b) -> bool:
    """Whether two arrays of ``backend`` share any element (exactly, for NumPy)."""
    if not (a.size and b.size):
        return False
    if backend is _backend.NUMPY:
        return bool(np.shares_memory(a, b))
    return bool(backend.may_share_memory(a, b))


_DTYPE_INFO: dict = {}


def dtype_info(dtype):
    """(category, wire datatype, name) of a NumPy dtype MPI can carry; TypeError otherwise.

    Cached per dtype (why: docs/performance.md, "How a call runs", step 1).
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
