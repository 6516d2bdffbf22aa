"""mpicoll.verify's case table: element types, ops, rank-asymmetric inputs, collectives.

Local (no MPI messages): what the tool and the tests run, not how they judge it
(that is :mod:`mpicoll.tools.results`).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from ...core import types as _types
from ...engine import select as _select

# ---------------------------------------------------------------------------
# Types and ops
# ---------------------------------------------------------------------------

REDUCTION_OPS = tuple(_types.OP_CATEGORIES)  # "SUM", ..., "MAXLOC"

_BASIC_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "float16", "float32", "float64", "longdouble", "complex64",
                 "complex128", "clongdouble")
# ml_dtypes' types (where it is installed): NumPy arrays MPI has no datatype for, which
# mpicoll moves as words and reduces in float32 (engine.select's dtype policy)
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")

# name -> attribute of mpi4py.MPI (MINLOC/MAXLOC pair types)
_PAIR_NAMES = {
    "float_int": "FLOAT_INT",
    "double_int": "DOUBLE_INT",
    "long_int": "LONG_INT",
    "short_int": "SHORT_INT",
    "2int": "TWOINT",
    "long_double_int": "LONG_DOUBLE_INT",
}


@dataclass(frozen=True)
class TypeInfo:
    """One element type as the tool and the tests use it.

    ``datatype`` is None for plain arrays (mpicoll infers the MPI type from
    the dtype) and the MPI pair datatype for MINLOC/MAXLOC types, passed
    as ``[buf, datatype]``.
    """

    name: str
    dtype: np.dtype
    datatype: object  # MPI.Datatype or None
    category: str

    def spec(self, arr):
        """The mpi4py buffer spec for ``arr`` holding this type."""
        return arr if self.datatype is None else [arr, self.datatype]

    def __str__(self):
        return self.name


def type_info(name: str) -> TypeInfo:
    """TypeInfo of a dtype name ("float64", "clongdouble") or a pair name ("double_int")."""
    if name in _PAIR_NAMES:
        datatype = getattr(MPI, _PAIR_NAMES[name])
        dtype, category = _types.dtype_of_datatype(datatype)
        return TypeInfo(name, dtype, datatype, category)
    dtype = np.dtype(name)
    category = _types.category_of_dtype(dtype)  # TypeError when MPI cannot carry it
    label = {"g": "longdouble", "G": "clongdouble"}.get(dtype.char, str(dtype))
    return TypeInfo(label, dtype, None, category)


def available_types(*, pairs: bool = True, device: str = "cpu") -> list[TypeInfo]:
    """Every element type mpicoll carries in this build (and on ``device``).

    long double types appear when NumPy's and MPI's long double have the
    same size; ``device="gpu"`` drops what CuPy has no dtype for.
    """
    out = []
    for name in _BASIC_DTYPES:
        try:
            info = type_info(name)
        except TypeError:
            continue
        if device == "gpu" and info.dtype.char in "gG":
            continue
        out.append(info)
    if device != "gpu":
        try:
            import ml_dtypes  # noqa: F401  (registers the names with NumPy)
        except ImportError:
            pass
        else:
            out.extend(type_info(name) for name in _ML_DTYPES)
    if pairs and device != "gpu":
        for name in _PAIR_NAMES:
            try:
                out.append(type_info(name))
            except TypeError:
                continue
    return out


def ops_for(info: TypeInfo) -> tuple[str, ...]:
    """Predefined reduction ops that apply to the type (MPI-4.1, 6.9.2)."""
    return tuple(op for op in REDUCTION_OPS if info.category in _types.OP_CATEGORIES[op])


# ---------------------------------------------------------------------------
# Rank-asymmetric input
# ---------------------------------------------------------------------------


def _key(text: str) -> int:
    return zlib.crc32(text.encode())


def make_input(dtype, count: int, rank: int, size: int, op: str | None = None,
               seed: int = 0) -> np.ndarray:
    """Deterministic input of rank ``rank`` of ``size``, suited to ``op``.

    Every rank and every element gets different data, drawn so that the
    reduction over any number of ranks stays in range: integer SUM operands
    are within [min // size, max // size]; PROD operands are +-1 except one
    rank per element (rank i % size) that holds 2 or 3, floating PROD
    operands are within 1 +- 0.5/size; logical operands mix zeros and
    non-zeros so LAND and LOR results are not constant; MINLOC/MAXLOC values
    repeat so ties (broken by the lower index) occur.

    Args:
        dtype: NumPy dtype (a pair type's structured dtype for MINLOC/MAXLOC).
        count: number of elements.
        rank, size: the calling rank and the number of ranks.
        op: op name the data is for (None: any data, e.g. for gathers).
        seed: varies the draw.

    Returns:
        A new 1-D array.
    """
    dtype = np.dtype(dtype)
    rng = np.random.default_rng([seed & 0xFFFFFFFF, rank, size, count,
                                 _key(str(dtype.descr)), _key(op or "")])
    if dtype.names:
        out = np.zeros(count, dtype)
        value = dtype.fields["f0"][0]
        out["f0"] = rng.integers(0, 4, count).astype(value)
        out["f1"] = rng.integers(0, 3 * size + 1, count)
        return out
    owner = (np.arange(count) % max(size, 1)) == rank  # PROD: one rank per element
    kind = dtype.kind
    if kind == "b":
        p = {"LAND": 0.85, "LOR": 0.15}.get(op, 0.5)
        return rng.random(count) < p
    if kind in "iu":
        info = np.iinfo(dtype)
        if op == "SUM":
            return rng.integers(info.min // size, info.max // size, count, dtype=dtype,
                                endpoint=True)
        if op == "PROD":
            if kind == "i":
                x = np.where(rng.random(count) < 0.5, -1, 1)
            else:
                x = np.ones(count, dtype=np.int64)
            x = np.where(owner, rng.integers(2, 4, count), x)
            return x.astype(dtype)
        x = rng.integers(info.min, info.max, count, dtype=dtype, endpoint=True)
        if op in ("LAND", "LOR", "LXOR"):
            p = {"LAND": 0.85, "LOR": 0.15}.get(op, 0.5)
            x[rng.random(count) >= p] = 0
        return x
    # floating and complex: draw in float64, then widen long double's extra bits
    real = np.dtype(dtype.char.lower()) if kind == "c" else dtype

    def draw():
        if op == "SUM":
            return rng.uniform(-1, 1, count) * 2.0 ** rng.integers(-4, 5, count)
        if op == "PROD":
            return 1 + rng.uniform(-0.5, 0.5, count) / size
        if op in ("MIN", "MAX"):
            return rng.uniform(-1000, 1000, count)
        return rng.normal(0, 100, count)

    if kind == "c":
        if op == "PROD":
            x = draw() * np.exp(1j * rng.uniform(-np.pi, np.pi, count))
        else:
            x = draw() + 1j * draw()
    else:
        x = draw()
    if _types.is_ml_type(dtype) and dtype.itemsize == 1 and op in ("MIN", "MAX", None):
        x = x / 10  # within float8_e4m3fn's range (448)
    x = x.astype(dtype)
    if not _types.is_ml_type(dtype) and np.finfo(real).nmant > 52:  # long double: use the bits float64 lacks
        x = x + x * np.asarray(rng.random(count) * 2.0 ** -60).astype(real)
    return x


def uneven_counts(count: int, size: int) -> list[int]:
    """Per-rank counts around ``count``: ``count + r``, but 0 on ranks r = 1 (mod 3).

    ``count == 0`` gives all zeros (an empty collective).
    """
    if count == 0:
        return [0] * size
    return [0 if r % 3 == 1 else count + r for r in range(size)]


def gapped_displs(counts) -> tuple[list[int], int]:
    """Displacements placing blocks in reverse rank order with a one-element gap after each.

    Returns:
        (displs, total length of the receive buffer).
    """
    displs = [0] * len(counts)
    pos = 0
    for r in reversed(range(len(counts))):
        displs[r] = pos
        pos += counts[r] + 1
    return displs, pos


# ---------------------------------------------------------------------------
# Collectives
# ---------------------------------------------------------------------------

# collective -> (algorithm family in _select.ALGORITHMS, API, reduces?)
COLLECTIVES = {
    "Allreduce": ("allreduce", "comm", True),
    "Reduce_scatter_block": ("reduce_scatter", "comm", True),
    "Reduce_scatter": ("reduce_scatter", "comm", True),
    "Allgather": ("allgather", "comm", False),
    "Allgatherv": ("allgather", "comm", False),
    "allreduce": ("allreduce", "array", True),
    "reduce_scatter": ("reduce_scatter", "array", True),
    "allgather": ("allgather", "array", False),
    "allgatherv": ("allgather", "array", False),
}


def algorithms_for(collective: str, *, auto: bool = False) -> tuple[str, ...]:
    """Algorithms registered for a collective (plus "auto" if asked)."""
    names = tuple(_select.ALGORITHMS[COLLECTIVES[collective][0]])
    return (("auto",) if auto else ()) + names
