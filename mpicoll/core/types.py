"""What a call is made of: the dtype and op tables, the message, the call.

The tables (NumPy dtype <-> MPI datatype, MPI.Op -> local reduction, op/dtype
rules) are lookups; nothing builds names from strings.  :class:`Msg` is one
buffer's elements and their type, :class:`Call` one validated collective
call: the record every layer after validation reads.
Categories follow the MPI standard's groups of basic datatypes (MPI-4.1, 6.9.2):

==========  =========================================================
category    ops that apply
==========  =========================================================
integer     SUM PROD MIN MAX LAND LOR LXOR BAND BOR BXOR
floating    SUM PROD MIN MAX
complex     SUM PROD
logical     LAND LOR LXOR            (bool / MPI.C_BOOL)
byte        BAND BOR BXOR            (MPI.BYTE)
pair        MINLOC MAXLOC            (MPI.FLOAT_INT, MPI.DOUBLE_INT, ...)
==========  =========================================================

float16 counts as floating: MPI has no standard half-precision datatype, so
mpicoll moves it as 16-bit words (``MPI.UINT16_T``) and reduces it locally.
The ``ml_dtypes`` types (bfloat16, float8_e4m3fn, float8_e5m2) count as
floating too and move as 16- or 8-bit words; NumPy cannot hand MPI their
memory (no buffer protocol), so engine.select moves them through unsigned views
and reduces them in float32 (see :func:`accumulation_dtype`).
User-defined ops (``MPI.Op.Create``) apply to every datatype; they are
applied with ``Op.Reduce_local`` on the datatype mpi4py would hand them for
the same buffer (:func:`natural_type`, or the datatype the caller gave), never
on the wire type: an op on a float16 buffer sees ``MPI.SHORT_FLOAT`` (Open
MPI) or ``MPIX_C_FLOAT16`` (MPICH), not ``MPI.UINT16_T``.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

import numpy as np
from mpi4py import MPI
from mpi4py.util import dtlib

# (dtype.kind, dtype.itemsize) -> predefined MPI datatype used on the wire.
_WIRE_TYPES = {
    ("b", 1): MPI.C_BOOL,
    ("i", 1): MPI.INT8_T,
    ("i", 2): MPI.INT16_T,
    ("i", 4): MPI.INT32_T,
    ("i", 8): MPI.INT64_T,
    ("u", 1): MPI.UINT8_T,
    ("u", 2): MPI.UINT16_T,
    ("u", 4): MPI.UINT32_T,
    ("u", 8): MPI.UINT64_T,
    ("f", 2): MPI.UINT16_T,  # float16: moved as 16-bit words, reduced locally
    ("f", 4): MPI.FLOAT,
    ("f", 8): MPI.DOUBLE,
    ("c", 8): MPI.C_FLOAT_COMPLEX,
    ("c", 16): MPI.C_DOUBLE_COMPLEX,
}
if np.dtype(np.longdouble).itemsize == MPI.LONG_DOUBLE.Get_size():
    _WIRE_TYPES[("f", np.dtype(np.longdouble).itemsize)] = MPI.LONG_DOUBLE
if np.dtype(np.clongdouble).itemsize == MPI.C_LONG_DOUBLE_COMPLEX.Get_size():
    _WIRE_TYPES[("c", np.dtype(np.clongdouble).itemsize)] = MPI.C_LONG_DOUBLE_COMPLEX

_KIND_CATEGORY = {
    "b": "logical",
    "i": "integer",
    "u": "integer",
    "f": "floating",
    "c": "complex",
}

_PAIR_TYPES = (
    MPI.FLOAT_INT, MPI.DOUBLE_INT, MPI.LONG_INT, MPI.SHORT_INT,
    MPI.INT_INT if hasattr(MPI, "INT_INT") else MPI.TWOINT, MPI.LONG_DOUBLE_INT,
)

# op name -> (NumPy ufunc, categories it applies to).  Keys are the predefined
# ops; the name is only a label for messages and the backend ufunc tables.
OP_NAMES = ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR",
            "MINLOC", "MAXLOC", "REPLACE", "NO_OP")

OP_CATEGORIES = {
    "SUM": ("integer", "floating", "complex"),
    "PROD": ("integer", "floating", "complex"),
    "MIN": ("integer", "floating"),
    "MAX": ("integer", "floating"),
    "LAND": ("integer", "logical"),
    "LOR": ("integer", "logical"),
    "LXOR": ("integer", "logical"),
    "BAND": ("integer", "byte"),
    "BOR": ("integer", "byte"),
    "BXOR": ("integer", "byte"),
    "MINLOC": ("pair",),
    "MAXLOC": ("pair",),
}

NUMPY_UFUNCS = {
    "SUM": np.add,
    "PROD": np.multiply,
    "MIN": np.minimum,
    "MAX": np.maximum,
    "LAND": np.logical_and,
    "LOR": np.logical_or,
    "LXOR": np.logical_xor,
    "BAND": np.bitwise_and,
    "BOR": np.bitwise_or,
    "BXOR": np.bitwise_xor,
}


@functools.cache
def _predefined_ops():
    return {getattr(MPI, name).handle: name for name in OP_NAMES}


def op_name(op: MPI.Op) -> str | None:
    """The name of a predefined op ("SUM", ...), or None for a user-defined op."""
    return _predefined_ops().get(op.handle)


def op_label(op: MPI.Op) -> str:
    name = op_name(op)
    return f"MPI.{name}" if name else "user-defined MPI.Op"


def wire_type(dtype: np.dtype) -> MPI.Datatype | None:
    """The predefined MPI datatype that carries ``dtype``, or None if there is none."""
    if dtype.byteorder not in "=|" and dtype.byteorder != _NATIVE:
        return None
    wire = _WIRE_TYPES.get((dtype.kind, dtype.itemsize))
    if wire is None or dtype.kind == "V" or dtype.itemsize == 1:
        extra = ml_types()
        if dtype in extra:
            return extra[dtype][0]
    return wire


# ml_dtypes names -> (wire datatype, unsigned view dtype); read only once ml_dtypes is
# imported: an array of these types cannot exist before, and importing it here
# would be work at import time for every user.
_ML_NAMES = {
    "bfloat16": (MPI.UINT16_T, np.dtype(np.uint16)),
    "float8_e4m3fn": (MPI.UINT8_T, np.dtype(np.uint8)),
    "float8_e5m2": (MPI.UINT8_T, np.dtype(np.uint8)),
}
_ML: dict = {}


def ml_types() -> dict:
    """{ml_dtypes dtype: (wire datatype, unsigned view dtype)}; empty until ml_dtypes is imported."""
    if not _ML:
        module = sys.modules.get("ml_dtypes")
        if module is None:
            return _ML
        for name, entry in _ML_NAMES.items():
            _ML[np.dtype(getattr(module, name))] = entry
    return _ML


def is_ml_type(dtype) -> bool:
    """Whether ``dtype`` is one of the ml_dtypes types (no buffer protocol: moved through views)."""
    return (dtype.kind == "V" or dtype.itemsize == 1) and dtype in ml_types()


def view_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned integer dtype of the same size that carries ``dtype``'s bits."""
    return np.dtype(f"u{dtype.itemsize}")


_F32 = np.dtype(np.float32)


def accumulation_dtype(dtype: np.dtype) -> np.dtype | None:
    """float32 for the 8- and 16-bit floating types (float16, bfloat16, float8), else None.

    SUM and PROD of these types are accumulated in float32 and rounded once
    to ``dtype`` at the end (see docs/numerics.md).
    """
    if dtype.itemsize <= 2 and (dtype.kind == "f" or is_ml_type(dtype)):
        return _F32
    return None


_NATIVE = "<" if np.little_endian else ">"

_NATURAL: dict = {}


def natural_type(dtype: np.dtype) -> MPI.Datatype | None:
    """The datatype mpi4py gives a buffer of ``dtype`` (``MPI.SHORT_FLOAT`` for float16, ...).

    mpi4py maps the buffer's format character through its type table: an int64
    array travels as ``MPI.LONG``, a float16 one as ``MPI.SHORT_FLOAT`` (Open MPI)
    or ``MPIX_C_FLOAT16`` (MPICH).  This is the datatype user-defined ops are
    handed, whatever type mpicoll moves the data as.  None when mpi4py has no
    datatype for it (or the MPI library lacks that type).
    """
    key = (dtype.char, dtype.byteorder)  # not dtype: int64 'l' == longlong 'q' as dtypes
    try:
        return _NATURAL[key]
    except KeyError:
        pass
    datatype = None
    if wire_type(dtype) is not None and not is_ml_type(dtype):  # no buffer format for those
        fmt = memoryview(np.empty(0, dtype)).format.lstrip("@=<>!")
        datatype = MPI._typedict.get(fmt)
        if datatype is not None and (datatype == MPI.DATATYPE_NULL
                                     or datatype.Get_size() != dtype.itemsize):
            datatype = None
    _NATURAL[key] = datatype
    return datatype


def datatype_name(datatype: MPI.Datatype) -> str:
    name = datatype.Get_name() or "derived datatype"
    return name.replace("MPI_", "MPI.", 1)


def dtype_of_datatype(datatype: MPI.Datatype) -> tuple[np.dtype, str]:
    """NumPy dtype and category of an MPI datatype given by the user.

    Raises TypeError when mpicoll cannot reduce or move it.
    """
    if datatype == MPI.DATATYPE_NULL:
        raise TypeError("datatype: expected an MPI datatype, got MPI.DATATYPE_NULL")
    if datatype == MPI.BYTE:
        return np.dtype(np.uint8), "byte"
    for pair in _PAIR_TYPES:
        if datatype == pair:
            return dtlib.to_numpy_dtype(datatype), "pair"
    try:
        dtype = dtlib.to_numpy_dtype(datatype)
    except Exception as exc:  # derived datatypes mpi4py cannot describe
        raise TypeError(
            f"datatype: expected a predefined MPI datatype, got {datatype_name(datatype)}"
        ) from exc
    category = _KIND_CATEGORY.get(dtype.kind)
    if category is None or dtype.itemsize != datatype.Get_size():
        raise TypeError(
            f"datatype: expected a predefined numeric MPI datatype, got {datatype_name(datatype)}"
        )
    return dtype, category


def category_of_dtype(dtype: np.dtype) -> str:
    """Category of a NumPy dtype; TypeError if MPI cannot carry it."""
    category = _KIND_CATEGORY.get(dtype.kind)
    if is_ml_type(dtype):
        category = "floating"
    if category is None or wire_type(dtype) is None:
        raise TypeError(
            f"expected an array of bool, integer, floating or complex numbers in native "
            f"byte order, got dtype {dtype}"
        )
    return category


def check_op(op, argname: str = "op") -> None:
    """TypeError unless ``op`` is an MPI.Op usable in a reduction."""
    if not isinstance(op, MPI.Op):
        raise TypeError(f"{argname}: expected an MPI.Op, got {type(op).__name__}")
    if op == MPI.OP_NULL:
        raise ValueError(f"{argname}: expected a reduction operation, got MPI.OP_NULL")
    name = op_name(op)
    if name in ("REPLACE", "NO_OP"):
        raise ValueError(
            f"{argname}: MPI.{name} is only valid in one-sided accumulate operations, "
            f"not in collective reductions"
        )


def check_op_applies(op: MPI.Op, category: str, typename: str) -> None:
    """TypeError naming op and type when a predefined op does not apply to the type."""
    name = op_name(op)
    if name is None:  # user-defined op: applies to what its author says
        return
    if category not in OP_CATEGORIES[name]:
        raise TypeError(f"op: MPI.{name} does not apply to {typename}")


def datatype_of_typecode(code: str) -> MPI.Datatype:
    """The MPI datatype mpi4py gives a typecode such as 'i', 'e' or 'f8' (KeyError if none)."""
    datatype = MPI._typedict.get(code)
    if datatype is None or datatype == MPI.DATATYPE_NULL:
        raise KeyError(code)
    return datatype


def predefined_op(name: str) -> MPI.Op:
    """The predefined reduction op called ``name``, in any case ("sum" or "SUM": ``MPI.SUM``).

    The command-line tools' ``--op`` lookup; ValueError naming the choices otherwise.
    """
    key = name.strip().upper() if isinstance(name, str) else None
    if key not in OP_CATEGORIES:
        raise ValueError(f"expected one of {', '.join(OP_CATEGORIES)} (any case), got {name!r}")
    return getattr(MPI, key)


# --- messages and calls --------------------------------------------------------------------
#
# What a collective call is made of: its buffers as messages, and the call itself.
#
# The public API (api.args, api.args) checks its arguments and builds one
# :class:`Call`; the engine, the observers and the backends read its fields and
# never change them.

class Msg:
    """One buffer's elements and their type: a 1-D view and how MPI carries it."""

    __slots__ = ("array", "dtype", "category", "mpitype", "typename", "backend",
                 "counts", "displs", "optype", "layout")

    def __init__(self, array, dtype, category, mpitype, typename, backend,
                 counts=None, displs=None, optype=None, layout=None):
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
        # a spec with a derived datatype: where its elements are in the user's buffer
        # (api.derived.Layout); None for every other message
        self.layout = layout

    @property
    def count(self) -> int:
        return len(self.array)

    def described(self) -> Msg:
        """This message without its array: what it is, for whoever must not keep the
        array alive (a remembered call, engine.cache)."""
        return Msg(None, self.dtype, self.category, self.mpitype, self.typename, self.backend,
                   self.counts, self.displs, self.optype)


class Call(NamedTuple):
    """One collective call, validated: everything the engine reads of it, and nothing else.

    ``recv`` is the output message (the whole buffer; in place also the
    input); ``send`` the input, None in place.  ``counts``/``displs``: each
    rank's block of a ReduceScatter's input or an AllGather's output, in
    elements (None for AllReduce).  ``timeout`` and the dtype policy
    (``deterministic``, ``accumulate``, engine.select) are the arguments as
    given: None means the communicator's option.  ``label`` names the call in
    messages where it is not ``collective`` (an internal exchange).
    """

    collective: str
    comm: Any
    send: Msg | None
    recv: Msg
    counts: tuple | None = None
    displs: tuple | None = None
    op: Any = None
    algorithm: str = "auto"
    timeout: float | None = None
    deterministic: bool | None = None
    accumulate: bool | None = None
    label: str | None = None

    @property
    def total(self) -> int:
        """The elements "auto" selects by: the array reduced (AllReduce), the whole input
        (ReduceScatter) or the whole output (AllGather)."""
        return self.recv.count if self.counts is None else sum(self.counts)

    def without_arrays(self) -> Call:
        """This call without its arrays (a remembered call keeps no user memory alive)."""
        return self._replace(send=None if self.send is None else self.send.described(),
                             recv=self.recv.described())

    def arrays(self, rank: int) -> tuple:
        """(source, destination) 1-D arrays on ``rank``: an in-place ReduceScatter reads all
        of ``recv`` and writes its start; an in-place AllGather has no source (None)."""
        dst = self.recv.array
        if self.send is not None:
            return self.send.array, dst
        if self.collective == "reduce_scatter":
            return dst, dst[: self.counts[rank]]
        if self.collective == "allgather":
            return None, dst
        return dst, dst
