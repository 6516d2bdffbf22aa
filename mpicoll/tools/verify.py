"""Check mpicoll against MPI's built-in collectives: ``mpirun -n 4 python -m mpicoll.verify``.

Every collective runs through mpicoll (each registered algorithm, in place and
out of place) and the same rank-asymmetric input runs through MPI's built-in
collective on the same communicator.  Rank 0 prints one row per (collective,
dtype, op) and a closing PASS/FAIL line; every rank exits with the same status
(0: all agree, 1: some case failed, 2: a bad option, or options that select
nothing to check, refused before any collective runs).  Op names are
case-insensitive (``--op sum`` or ``--op SUM``).

The data, reference and tolerance helpers below are also what mpicoll's own
test suite uses, so the tool and the tests judge results the same way.

Reference
    MPI's built-in reduction (``MPI.Comm.Allreduce`` on the plain
    communicator) where MPI can reduce the type, which every MPI tested can
    for all standard types.  Where it cannot (float16 has no MPI datatype;
    an MPI without long double reductions), the inputs are gathered with the
    built-in ``Allgather`` and reduced in rank order with NumPy in a wider
    precision (float16/float32 in float64).  Gathers are checked against the
    built-in ``Allgatherv`` of the same bytes.

Tolerance
    Integer, bool, MIN/MAX, logical, bitwise, MINLOC/MAXLOC and gather
    results must be identical.  For SUM and PROD on floating and complex types
    any evaluation order of the n-1 operations of a reduction over n ranks is
    within ``gamma(n-1) * scale`` of the exact result (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., sections 3.1 and 4.2), where
    ``gamma(k) = k*u / (1 - k*u)``, ``u = eps/2`` is the unit roundoff of the
    dtype, and ``scale`` is ``sum_i |x_i|`` for SUM (``|re|+|im|`` for
    complex) and ``prod_i |x_i|`` for PROD.  Complex multiplication rounds
    by at most ``sqrt(5)*u`` (Brent, Percival and Zimmermann, 2007), so
    complex PROD uses that ``u``.  mpicoll's and MPI's results are each within
    that bound, so they may differ by twice it::

        |mpicoll - reference| <= 2 * gamma(n-1) * scale  (~ (n-1) * eps * scale)

    elementwise, plus ``n`` times the smallest normal number for underflow.
    With one rank the bound is (almost) zero: the result is the input.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..core import types as _types
from ..engine import select as _select

__all__ = [
    "TypeInfo", "Reference", "Comparison", "CaseResult",
    "available_types", "type_info", "ops_for", "make_input", "uneven_counts", "gapped_displs",
    "builtin_can_reduce", "reference_allreduce", "reference_allgatherv",
    "tolerance", "compare", "identical_across_ranks", "value_bytes", "same_values",
    "COLLECTIVES", "algorithms_for", "Prepared", "prepare_case", "run_case", "main",
]

# ---------------------------------------------------------------------------
# Types and ops
# ---------------------------------------------------------------------------

REDUCTION_OPS = tuple(_types.OP_CATEGORIES)  # "SUM", ..., "MAXLOC"

_BASIC_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "float16", "float32", "float64", "longdouble", "complex64",
                 "complex128", "clongdouble")

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
    x = x.astype(dtype)
    if np.finfo(real).nmant > 52:  # long double: use the bits float64 lacks
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
# Reference results
# ---------------------------------------------------------------------------

_probe_cache: dict = {}


def builtin_can_reduce(op: MPI.Op, datatype) -> bool:
    """Whether MPI's own reductions apply ``op`` to ``datatype`` (probed with Reduce_local).

    User-defined ops always can.  float16 never (it has no MPI datatype).
    """
    if datatype is None:
        return False
    if _types.op_name(op) is None:
        return True
    key = (op.handle, datatype.handle)
    if key not in _probe_cache:
        from mpi4py.util import dtlib
        try:
            dt = dtlib.to_numpy_dtype(datatype)
            a, b = np.zeros(1, dt), np.zeros(1, dt)
            op.Reduce_local([a, datatype], [b, datatype])
            _probe_cache[key] = True
        except Exception:
            _probe_cache[key] = False
    return _probe_cache[key]


@dataclass
class Reference:
    """Expected result of a reduction and the error scale of floating SUM/PROD.

    ``value`` may be wider than the input dtype (NumPy fallback);
    ``scale`` is None where the result must be exact.
    """

    value: np.ndarray
    scale: np.ndarray | None
    source: str

    def __getitem__(self, index):
        return Reference(self.value[index],
                         None if self.scale is None else self.scale[index], self.source)


def _wide(dtype: np.dtype) -> np.dtype:
    """Precision the NumPy fallback reduces in."""
    if dtype.kind in "fc":
        return np.result_type(dtype, np.float64)
    return dtype


def _needs_tolerance(opname, dtype) -> bool:
    return opname in ("SUM", "PROD") and dtype.kind in "fc"


def _abs_metric(x, opname):
    """Per-element magnitude whose SUM/PROD over ranks is the error scale."""
    if x.dtype.kind == "c":
        if opname == "SUM":
            return (np.abs(x.real) + np.abs(x.imag)).astype(np.float64)
        return np.abs(x).astype(np.float64)
    return np.abs(x).astype(np.float64)


def _wire_or_none(info_dtype, datatype):
    """The MPI datatype MPI's own reductions see the elements as, or None.

    float16 has none: mpicoll moves it as 16-bit words, which MPI would
    reduce as integers.
    """
    if datatype is not None:
        return datatype
    dtype = np.dtype(info_dtype)
    if dtype.kind == "f" and dtype.itemsize == 2:
        return None
    return _types.wire_type(dtype)


def _gather_rows(comm, x):
    """Every rank's ``x`` (same length everywhere), stacked in rank order, via built-in Allgather."""
    size = comm.Get_size()
    raw = np.ascontiguousarray(x).view(np.uint8).reshape(-1)
    allraw = np.empty(size * raw.size, np.uint8)
    MPI.Comm.Allgather(comm, [raw, MPI.BYTE], [allraw, MPI.BYTE])
    return allraw.view(x.dtype).reshape(size, -1)


def reference_allreduce(comm, x: np.ndarray, op: MPI.Op, datatype=None) -> Reference:
    """The reduction of every rank's ``x`` over ``comm``, computed by MPI itself where it can.

    Collective over ``comm`` (mpi4py's built-ins only; mpicoll is not used).

    Args:
        comm: the communicator (an ``mpicoll.Comm`` is fine: its mpi4py methods are called).
        x: this rank's host input (1-D), same length on every rank.
        op: predefined or user-defined ``MPI.Op``.
        datatype: MPI datatype of the elements (pair types, user ops);
            default: the type mpicoll puts on the wire for ``x.dtype``.

    Returns:
        Reference with the result and, for floating SUM/PROD, the error scale.
    """
    x = np.ascontiguousarray(x)
    opname = _types.op_name(op)
    wire = _wire_or_none(x.dtype, datatype)
    scale = None
    if builtin_can_reduce(op, wire):
        value = np.empty_like(x)
        MPI.Comm.Allreduce(comm, [x, wire], [value, wire], op)
        if _needs_tolerance(opname, x.dtype):
            scale = np.empty(len(x), np.float64)
            MPI.Comm.Allreduce(comm, _abs_metric(x, opname), scale, getattr(MPI, opname))
        return Reference(value, scale, "MPI built-in")
    if opname is None or opname not in _types.NUMPY_UFUNCS:
        raise TypeError(f"no reference for {_types.op_label(op)} on {x.dtype}")
    rows = _gather_rows(comm, x)
    ufunc = _types.NUMPY_UFUNCS[opname]
    wide = _wide(x.dtype)
    value = rows[0].astype(wide)
    for row in rows[1:]:
        ufunc(value, row.astype(wide), out=value, casting="unsafe")
    if _needs_tolerance(opname, x.dtype):
        mags = np.stack([_abs_metric(row, opname) for row in rows]) if len(x) else np.zeros((1, 0))
        scale = mags.sum(axis=0) if opname == "SUM" else mags.prod(axis=0)
    return Reference(value, scale, "NumPy, rank order")


def reference_allgatherv(comm, x: np.ndarray, counts, displs, initial: np.ndarray) -> np.ndarray:
    """MPI's built-in ``Allgatherv`` of ``x`` into a copy of ``initial`` (byte-exact)."""
    x = np.ascontiguousarray(x)
    out = np.array(initial, copy=True)
    item = out.dtype.itemsize
    MPI.Comm.Allgatherv(comm, [x.view(np.uint8), MPI.BYTE],
                        [out.view(np.uint8), [c * item for c in counts],
                         [d * item for d in displs], MPI.BYTE])
    return out


# ---------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------


def _gamma(k: int, u: float) -> float:
    return k * u / (1 - k * u) if k else 0.0


def tolerance(opname: str | None, dtype, nranks: int, scale) -> np.ndarray | None:
    """Elementwise bound on |mpicoll - reference|, or None where results must be exact.

    ``2 * gamma(nranks-1) * scale + nranks * tiny``, see the module docstring.
    """
    dtype = np.dtype(dtype)
    if scale is None or not _needs_tolerance(opname, dtype):
        return None
    finfo = np.finfo(dtype)
    u = float(finfo.eps) / 2
    if opname == "PROD" and dtype.kind == "c":
        u *= math.sqrt(5)
    return 2 * _gamma(nranks - 1, u) * np.asarray(scale, np.float64) \
        + nranks * float(finfo.smallest_normal)


@dataclass
class Comparison:
    """Outcome of comparing a result with its reference."""

    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    nbad: int = 0
    worst: str = ""


def _to_float(a):
    """Values as a float array for reporting differences (long double kept)."""
    if a.dtype.kind == "b":
        return a.astype(np.float64)
    if a.dtype.kind in "iu":
        return a.astype(np.float64)
    if a.dtype.kind == "f":
        return a.astype(np.result_type(a.dtype, np.float64))
    return a.astype(np.result_type(a.dtype, np.complex128))


def compare(got: np.ndarray, ref: Reference | np.ndarray, opname: str | None, nranks: int,
            *, exact: bool | None = None) -> Comparison:
    """Compare ``got`` (host array) with a reference elementwise.

    Args:
        got: the result.
        ref: a Reference (or a plain array: exact comparison).
        opname: predefined op name, or None (gathers, user-defined ops).
        nranks: ranks in the reduction (for the tolerance).
        exact: force exact (True) or tolerance (False) comparison; default
            per :func:`tolerance`.

    Returns:
        Comparison with max absolute and relative differences, the number of
        elements out of tolerance, and a description of the worst one.
    """
    if not isinstance(ref, Reference):
        ref = Reference(np.asarray(ref), None, "array")
    want = ref.value
    if got.shape != want.shape:
        return Comparison(False, math.inf, math.inf, max(got.size, want.size),
                          f"shape {got.shape}, expected {want.shape}")
    if got.size == 0:
        return Comparison(True)
    if got.dtype.names:  # pair types: compare each field exactly
        bad = np.zeros(got.shape, bool)
        for name in got.dtype.names:
            bad |= got[name] != want[name].astype(got.dtype[name])
        diff = np.abs(_to_float(got["f0"]) - _to_float(want["f0"]))
        nbad = int(bad.sum())
        worst = ""
        if nbad:
            i = int(np.argmax(bad))
            worst = f"element {i}: got {got[i]}, expected {want[i]}"
        return Comparison(nbad == 0, float(diff.max()), 0.0, nbad, worst)
    tol = None if exact else tolerance(opname, got.dtype, nranks, ref.scale)
    if exact is False and tol is None:
        raise ValueError("compare: exact=False needs a floating SUM/PROD reference with a scale")
    if tol is None and want.dtype == got.dtype and np.array_equal(got, want):
        return Comparison(True)  # identical values (the usual case): nothing to measure
    g, w = _to_float(got), _to_float(want.astype(got.dtype) if tol is None else want)
    diff = np.abs(g - w)
    nonzero = w != 0
    rel = np.where(diff != 0, np.inf, 0.0).astype(diff.dtype)
    np.divide(diff, np.abs(w), out=rel, where=nonzero)
    if tol is None:
        if got.dtype.kind in "fc":
            bad = ~((g == w) | (np.isnan(g) & np.isnan(w)))
        else:
            bad = got != want.astype(got.dtype)
    else:
        bad = ~(diff <= tol)
    nbad = int(bad.sum())
    worst = ""
    if nbad:
        i = int(np.argmax(bad))
        bound = "" if tol is None else f", tolerance {float(tol[i]):.3g}"
        worst = f"element {i}: got {got[i]!r}, expected {want[i]!r}{bound}"
    return Comparison(nbad == 0, float(np.max(diff)), float(np.max(rel)), nbad, worst)


def value_bytes(arr) -> np.ndarray:
    """The bytes that carry ``arr``'s values, one row per element (padding left out).

    Padding (the unused bytes of x87 long double, the gap in MPI.DOUBLE_INT
    pairs) is never sent by MPI and holds whatever memory held, so bitwise
    comparisons look at these bytes only.
    """
    arr = np.ascontiguousarray(arr).reshape(-1)
    dtype = arr.dtype
    if dtype.names:
        parts = [value_bytes(arr[name]) for name in dtype.names]
        return np.concatenate(parts, axis=1)
    raw = arr.view(np.uint8).reshape(len(arr), dtype.itemsize)
    if dtype.char in "gG" and np.finfo(dtype).nmant == 63:  # x87 80-bit extended
        part = dtype.itemsize // (2 if dtype.kind == "c" else 1)
        cols = [k * part + j for k in range(dtype.itemsize // part) for j in range(10)]
        raw = raw[:, cols]
    return raw


def same_values(a, b) -> bool:
    """Whether two host arrays hold bitwise the same values (padding ignored)."""
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and \
        bool(np.array_equal(value_bytes(a), value_bytes(b)))


def _digest(arr) -> int:
    return int.from_bytes(hashlib.blake2b(value_bytes(arr).tobytes(), digest_size=8).digest(),
                          "little", signed=True)


def identical_across_ranks(comm, arr: np.ndarray) -> bool:
    """Whether ``arr`` holds bitwise the same values on every rank (collective)."""
    digests = comm.allgather((arr.shape, _digest(arr)))
    return all(d == digests[0] for d in digests)


# ---------------------------------------------------------------------------
# One case: a collective on one input, checked
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


class _NumpyArrays:
    name = "numpy"

    @staticmethod
    def put(host):
        return np.array(host, copy=True)

    @staticmethod
    def get(arr):
        return np.asarray(arr)

    @staticmethod
    def empty(n, dtype):
        return np.empty(n, dtype)


class _CupyArrays:
    name = "cupy"

    def __init__(self, cupy):
        self.cp = cupy

    def put(self, host):
        return self.cp.asarray(host)

    def get(self, arr):
        self.cp.cuda.get_current_stream().synchronize()
        return self.cp.asnumpy(arr)

    def empty(self, n, dtype):
        return self.cp.empty(n, dtype)


NUMPY_ARRAYS = _NumpyArrays()


@dataclass
class CaseResult:
    """Outcome of :func:`run_case`, the same on every rank."""

    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    identical: bool | None = None  # None: not applicable (ReduceScatter) or not checked
    problems: list = field(default_factory=list)  # "rank r: ..." strings

    def report(self) -> str:
        return "; ".join(self.problems) if self.problems else "ok"


def _exchange(comm, row, timeout: float) -> np.ndarray:
    """Allgather of one int64 row per rank; abort the job if some rank does not arrive in time.

    A rank that raised inside a collective may leave others waiting inside
    mpicoll for messages that never come: the ranks that can still arrive
    wait ``timeout`` seconds, then abort the job instead of hanging.
    """
    send = np.asarray(row, np.int64)
    recv = np.zeros((comm.Get_size(), len(send)), np.int64)
    req = MPI.Comm.Iallgather(comm, send, recv)
    deadline = time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > deadline:
            sys.stderr.write(
                f"mpicoll.verify: rank {MPI.COMM_WORLD.Get_rank()}: other ranks did not finish "
                f"the collective within {timeout:g} s; aborting the job\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        time.sleep(1e-4)
    return recv


def _unchanged(name, before, arr, arrays, problems):
    if not same_values(arrays.get(arr), before):
        problems.append(f"{name} changed")


@dataclass
class Prepared:
    """Input, layout and reference of one case (shared by its in-place/algorithm variants)."""

    x: np.ndarray                  # this rank's input (host)
    want: Reference                # expected result on this rank
    counts: list | None            # per-rank counts (None: Allreduce)
    displs: list | None = None     # gathers: where each rank's block goes
    initial: np.ndarray | None = None  # gathers: receive buffer before the call
    n: int = 0                     # reductions: elements of this rank's result


def _layout(collective, count, size):
    """(counts, total input length) of a reduction collective."""
    if collective in ("Allreduce", "allreduce"):
        return None, count
    if collective == "Reduce_scatter_block":
        return [count] * size, count * size
    if collective == "Reduce_scatter":
        counts = uneven_counts(count, size)
        return counts, sum(counts)
    from ..algorithms.ring import split  # array reduce_scatter: numpy.array_split rule
    return split(count, size)[0], count


def prepare_case(comm, collective: str, info: TypeInfo, opname: str | None, count: int,
                 seed: int = 0) -> Prepared:
    """Input and MPI built-in reference of a case (collective: built-ins only)."""
    reduces = COLLECTIVES[collective][2]
    size, rank = comm.Get_size(), comm.Get_rank()
    if reduces:
        counts, total = _layout(collective, count, size)
        x = make_input(info.dtype, total, rank, size, opname, seed)
        ref = reference_allreduce(comm, x, getattr(MPI, opname), info.datatype)
        lo, n = (0, total) if counts is None else (sum(counts[:rank]), counts[rank])
        return Prepared(x, ref[lo:lo + n], counts, n=n)
    if collective in ("Allgather", "allgather"):
        counts = [count] * size
        displs = [count * r for r in range(size)]
        length = count * size
    elif collective == "Allgatherv":
        counts = uneven_counts(count, size)
        displs, length = gapped_displs(counts)
    else:  # array allgather with counts: contiguous blocks
        counts = uneven_counts(count, size)
        displs = [sum(counts[:r]) for r in range(size)]
        length = sum(counts)
    x = make_input(info.dtype, counts[rank], rank, size, None, seed)
    initial = make_input(info.dtype, length, 0, size, "sentinel", seed + 1)
    want = Reference(reference_allgatherv(comm, x, counts, displs, initial), None, "MPI built-in")
    return Prepared(x, want, counts, displs, initial)


def run_case(comm, collective: str, info: TypeInfo, opname: str | None, count: int,
             in_place: bool, algorithm: str = "auto", *, arrays=NUMPY_ARRAYS, seed: int = 0,
             timeout: float = 120.0, prepared: Prepared | None = None) -> CaseResult:
    """Run one collective through mpicoll and MPI's built-in; check everything. Collective.

    Checks: result equals the reference (exact, or within :func:`tolerance`),
    bitwise identical on every rank (AllReduce, AllGather), inputs unchanged,
    in-place ReduceScatter writes only the result part, Allgatherv leaves
    the gaps between blocks unchanged.

    Args:
        comm: intra-communicator (mpicoll's calls run on ``mpicoll.Comm(comm)``).
        collective: a key of :data:`COLLECTIVES`.
        info: element type.
        opname: predefined op name for reductions (None for gathers).
        count: size parameter: elements per rank (Allreduce: the whole array;
            Reduce_scatter_block/Allgather: per rank; Reduce_scatter/Allgatherv:
            :func:`uneven_counts` of it; reduce_scatter: total, split as numpy.array_split).
        in_place: use MPI.IN_PLACE (``out=x`` for the array functions).
        algorithm: forced algorithm name, or "auto".
        arrays: where mpicoll's buffers live (NumPy; CuPy for ``--device gpu``).
        seed: varies the input.
        timeout: seconds to wait for the other ranks before aborting the job.
        prepared: :func:`prepare_case` of the same arguments, to reuse.

    Returns:
        CaseResult, identical on every rank.
    """
    from ..api.comm import Comm
    _, api, reduces = COLLECTIVES[collective]
    rank = comm.Get_rank()
    size = comm.Get_size()
    problems: list[str] = []
    op = getattr(MPI, opname) if opname else None
    dtype = info.dtype
    check_identical = collective not in ("Reduce_scatter_block", "Reduce_scatter",
                                         "reduce_scatter")
    if prepared is None:
        prepared = prepare_case(comm, collective, info, opname, count, seed)
    x, want, counts = prepared.x, prepared.want, prepared.counts
    displs, initial, n = prepared.displs, prepared.initial, prepared.n

    # ---- run mpicoll --------------------------------------------------------
    got = None
    raised = 0
    try:
        xd = arrays.put(x)
        if api == "comm":
            c = Comm(comm, algorithm=algorithm)
            spec = info.spec
            if reduces:
                if in_place:
                    buf = xd
                    if collective == "Allreduce":
                        c.Allreduce(MPI.IN_PLACE, spec(buf), op)
                    elif collective == "Reduce_scatter_block":
                        c.Reduce_scatter_block(MPI.IN_PLACE, spec(buf), op)
                    else:
                        c.Reduce_scatter(MPI.IN_PLACE, spec(buf), counts, op)
                    host = arrays.get(buf)
                    got = host[:n]
                    if not same_values(host[n:], x[n:]):
                        problems.append("in place: elements outside the result were written")
                else:
                    out = arrays.empty(n, dtype)
                    if collective == "Allreduce":
                        c.Allreduce(spec(xd), spec(out), op)
                    elif collective == "Reduce_scatter_block":
                        c.Reduce_scatter_block(spec(xd), spec(out), op)
                    else:
                        c.Reduce_scatter(spec(xd), spec(out), counts, op)
                    got = arrays.get(out)
                    _unchanged("sendbuf", x, xd, arrays, problems)
            else:
                buf = arrays.put(initial)
                if in_place:
                    own = initial.copy()
                    own[displs[rank]:displs[rank] + counts[rank]] = x
                    buf = arrays.put(own)
                    send = MPI.IN_PLACE
                else:
                    send = spec(xd)
                if collective == "Allgather":
                    c.Allgather(send, spec(buf))
                else:
                    rspec = ([buf, counts, displs] if info.datatype is None
                             else [buf, counts, displs, info.datatype])
                    c.Allgatherv(send, rspec)
                got = arrays.get(buf)
                if not in_place:
                    _unchanged("sendbuf", x, xd, arrays, problems)
        else:
            import mpicoll
            if collective == "allreduce":
                res = mpicoll.allreduce(xd, op, comm=comm, out=xd if in_place else None,
                                        algorithm=algorithm)
                got = arrays.get(res)
            elif collective == "reduce_scatter":
                res = mpicoll.reduce_scatter(xd, op, comm=comm, out=xd if in_place else None,
                                             algorithm=algorithm)
                got = arrays.get(res)
                if in_place:
                    host = arrays.get(xd)
                    if not same_values(host[n:], x[n:]):
                        problems.append("in place: elements outside the result were written")
            else:
                kw = {} if collective == "allgather" else {"counts": counts}
                if in_place:
                    own = initial.copy()
                    own[displs[rank]:displs[rank] + counts[rank]] = x
                    buf = arrays.put(own)
                    res = mpicoll.allgather(buf, comm=comm, out=buf, algorithm=algorithm, **kw)
                else:
                    res = mpicoll.allgather(xd, comm=comm, algorithm=algorithm, **kw)
                got = arrays.get(res)
            if not in_place:
                _unchanged("x", x, xd, arrays, problems)
    except Exception as exc:  # reported, then agreed on below
        raised = 1
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
        problems.append(f"raised {type(exc).__name__}: {exc}{where}")

    # ---- checks (local), then one exchange of every rank's outcome ------------
    max_abs = max_rel = 0.0
    digest = 0
    if not raised:
        cmp = compare(got, want, opname, size)
        max_abs, max_rel = cmp.max_abs, cmp.max_rel
        if not cmp.ok:
            problems.append(
                f"{cmp.nbad} of {got.size} elements differ from {want.source} ({cmp.worst})")
        digest = _digest(got) if check_identical else 0
    floats = np.array([max_abs, max_rel], np.float64).view(np.int64)
    rows = _exchange(comm, [raised, len(problems), digest, *floats], timeout)
    any_raised = bool(rows[:, 0].any())
    identical = None
    if check_identical and not any_raised:
        identical = bool((rows[:, 2] == rows[0, 2]).all())
    all_problems = []
    if rows[:, 1].any():
        everyone = comm.allgather(problems)
        all_problems = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
    if identical is False:
        all_problems.append("results are not bitwise identical across ranks")
    fl = np.ascontiguousarray(rows[:, 3:5]).view(np.float64)
    return CaseResult(
        ok=not all_problems,
        max_abs=float(fl[:, 0].max()),
        max_rel=float(fl[:, 1].max()),
        identical=identical,
        problems=all_problems,
    )


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

# A full run adds a large count (2**18 + 5: pipeline segments on the ring) for
# these types, with their first op (SUM) and in the gathers.
_LARGE_TYPES = ("int32", "int64", "float32", "float64", "complex128")


def _counts(size: int, quick: bool, large: bool = True) -> list[int]:
    """Counts tried: empty, one element (fewer than ranks), not divisible by the ranks, large."""
    if quick:
        counts = [0, 1, 7 * size + 3]
    else:
        counts = [0, 1, size - 1, size + 1, 7 * size + 3, 1000 * size + 17]
        if large:
            counts.append(2 ** 18 + 5)
    seen = []
    for c in counts:
        if c >= 0 and c not in seen:
            seen.append(c)
    return seen


def _placements(quick: bool, k: int, j: int, cells: int) -> tuple[bool, ...]:
    """In place and/or out of place for count k, algorithm j.

    --quick alternates them over the (count, algorithm) grid, so each count
    and each algorithm still runs both ways (given two or more of the other).
    """
    if not quick or cells < 2:
        return (False, True)
    return ((k + j) % 2 == 1,)


class _Parser(argparse.ArgumentParser):
    """argparse that prints only on rank 0 (every rank still exits the same way)."""

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def _csv(choices, spelling=None):
    """argparse type: a comma-separated list of ``choices`` (``spelling`` maps aliases to them)."""
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(choices)}, got {text!r}")
        if spelling is not None:
            items = [spelling(t) for t in items]
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        return list(dict.fromkeys(items))
    return parse


def _op_spelling(text):
    """An op name in any case as its canonical name ("sum" -> "SUM"); unknown names unchanged."""
    try:
        return _types.op_name(_types.predefined_op(text))
    except ValueError:
        return text


def _seconds(text):
    """argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    all_algos = sorted({a for table in _select.ALGORITHMS.values() for a in table})
    type_names = [t.name for t in available_types()]
    p = _Parser(
        prog="python -m mpicoll.verify",
        description="Check every mpicoll collective against MPI's built-in on this machine "
                    "(run under mpirun/srun; rank 0 prints). Exit status 0: all agree.")
    p.add_argument("--quick", action="store_true",
                   help="a short smoke test: fewer counts, in place and out of place alternating")
    p.add_argument("--collective", type=_csv(list(COLLECTIVES)), default=None,
                   help="comma-separated collectives (default: all)")
    p.add_argument("--dtype", type=_csv(type_names), default=None,
                   help="comma-separated element types (default: all)")
    p.add_argument("--op", type=_csv(list(REDUCTION_OPS), _op_spelling), default=None,
                   help="comma-separated reduction ops, any case (default: every op that applies)")
    p.add_argument("--algorithm", type=_csv(["auto"] + all_algos), default=None,
                   help="comma-separated algorithms (default: every registered one)")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="cpu",
                   help="where the buffers live: NumPy (cpu), CuPy (gpu), or gpu if usable")
    p.add_argument("--timeout", type=_seconds, default=120.0,
                   help="seconds to wait for the other ranks after a case before aborting")
    p.add_argument("--verbose", "-v", action="store_true", help="print every failing case")
    return p


class _EmptySelection(Exception):
    """The options select nothing to check (the message says which option and why)."""


def _plan(args, types) -> list:
    """What the options select: [(collective, algorithms, [(TypeInfo, op name or None)])].

    Local and the same on every rank.  Raises _EmptySelection when the
    selection is empty or an option given selects nothing.
    """
    named = args.collective is not None
    collectives = args.collective or list(COLLECTIVES)
    plan = []
    for collective in collectives:
        own = algorithms_for(collective)
        algos = [a for a in (args.algorithm or own) if a == "auto" or a in own]
        if not algos:
            if named:
                raise _EmptySelection(
                    f"--algorithm: {','.join(args.algorithm)} is no algorithm of {collective} "
                    f"(expected auto or one of {', '.join(own)})")
            continue
        _, api, reduces = COLLECTIVES[collective]
        usable = [t for t in types if api == "comm" or t.datatype is None]
        cells = []
        for info in usable:
            ops = ops_for(info) if reduces else (None,)
            if args.op and reduces:
                ops = [o for o in ops if o in args.op]
            cells += [(info, o) for o in ops]
        if not cells:
            if not named:
                continue
            if not usable:
                raise _EmptySelection(
                    f"--collective {collective}: takes plain arrays, not the pair types "
                    f"{', '.join(t.name for t in types)} (use the Comm methods, e.g. Allreduce)")
            raise _EmptySelection(
                f"--collective {collective}: --op {','.join(args.op)} applies to none of "
                f"{', '.join(t.name for t in usable)}")
        plan.append((collective, algos, cells))
    chosen = ", ".join(c for c, _, _ in plan) or ", ".join(collectives)
    for algo in args.algorithm or ():
        if not any(algo in algos for _, algos, _ in plan):
            raise _EmptySelection(f"--algorithm: {algo} is no algorithm of {chosen}")
    if args.op and not any(COLLECTIVES[c][2] for c in collectives):
        raise _EmptySelection(
            f"--op: none of the selected collectives ({', '.join(collectives)}) reduces")
    for name in args.op or ():
        if not any(op == name for _, _, cells in plan for _, op in cells):
            raise _EmptySelection(
                f"--op: {name} applies to none of {', '.join(t.name for t in types)}")
    for info in types if args.dtype else ():
        if not any(i.name == info.name for _, _, cells in plan for i, _ in cells):
            why = (f"a pair type goes through the Comm methods only, not {chosen}"
                   if info.datatype is not None and all(COLLECTIVES[c][1] == "array"
                                                         for c, _, _ in plan)
                   else f"--op {','.join(args.op or ())} does not apply to it")
            raise _EmptySelection(f"--dtype: nothing selected checks {info.name}: {why}")
    if not plan:
        raise _EmptySelection("nothing to check with these options")
    return plan


def _gpu_arrays():
    """(arrays, None) when CuPy and a GPU are usable here, else (None, reason). Local only."""
    import mpicoll
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not importable ({exc}); install mpicoll[cuda12] or mpicoll[cuda13]"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no GPU"
    except Exception as exc:
        return None, f"CuPy cannot use a GPU ({exc})"
    if getattr(mpicoll, "bind_device", None) is None:
        return None, "this mpicoll has no mpicoll.bind_device(): GPU support is missing"
    return _CupyArrays(cupy), None


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if math.isinf(v):
        return "inf"
    return f"{v:.2e}"


def main(argv=None) -> int:
    """Run the checks; returns the exit status (the same on every rank)."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    parser = _parser()
    args = parser.parse_args(argv)  # every rank parses the same argv: all exit 2 or none
    types = available_types()
    if args.dtype:
        types = [t for t in types if t.name in args.dtype]
    try:
        _plan(args, types)  # an empty selection is an error before any MPI call
    except _EmptySelection as exc:
        parser.error(str(exc))

    def say(text=""):
        if rank == 0:
            print(text, flush=True)

    device = args.device
    arrays = NUMPY_ARRAYS
    if device in ("gpu", "auto"):
        gpu, reason = _gpu_arrays()
        reasons = comm.allgather(reason)  # every rank decides the same way
        if gpu is not None and not any(reasons):
            import mpicoll
            mpicoll.bind_device(comm)  # collective
            arrays, device = gpu, "gpu"
        elif device == "gpu":
            if rank == 0:
                bad = next(r for r, why in enumerate(reasons) if why)
                sys.stderr.write(f"mpicoll.verify: --device gpu: rank {bad}: {reasons[bad]}\n")
            return 2
        else:
            device = "cpu"

    types = available_types(device=device)
    if args.dtype:
        missing = [name for name in args.dtype if name not in {t.name for t in types}]
        if missing:  # the same on every rank: the device was agreed on above
            say(f"mpicoll.verify: --dtype: {', '.join(missing)} cannot live on {device}")
            return 2
        types = [t for t in types if t.name in args.dtype]
    plan = _plan(args, types)

    import mpicoll
    lib = MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip()
    say(f"mpicoll.verify {mpicoll.__version__}: {size} rank(s), {lib}")
    say(f"mpi4py {__import__('mpi4py').__version__}, numpy {np.__version__}, "
        f"buffers: {arrays.name} ({device}), {'quick' if args.quick else 'full'} counts")
    say("reference: MPI's built-in collective on the same input; floating SUM/PROD within "
        "2*gamma(n-1)*scale (see python -m pydoc mpicoll.verify), everything else exact")
    say()
    aw = max([len(",".join(a)) for _, a, _ in plan] + [10])
    cw = max(len(",".join(map(str, _counts(size, args.quick)))), 6)
    head = (f"{'collective':<21} {'dtype':<15} {'op':<6} {'counts':<{cw}} {'algorithms':<{aw}} "
            f"{'max abs':>9} {'max rel':>9} {'identical':>9}  verdict")
    say(head)
    say("-" * len(head))

    rows = failed = cases = 0
    t0 = time.perf_counter()
    for collective, algos, cells in plan:
        for info, opname in cells:
            large = info.name in _LARGE_TYPES and opname in (None, ops_for(info)[0])
            counts = _counts(size, args.quick, large)
            max_abs = max_rel = 0.0
            identical = True
            bad = []
            for k, count in enumerate(counts):
                prepared = prepare_case(comm, collective, info, opname, count)
                for j, algo in enumerate(algos):
                    for in_place in _placements(args.quick, k, j, len(counts) * len(algos)):
                        res = run_case(comm, collective, info, opname, count, in_place, algo,
                                       arrays=arrays, timeout=args.timeout, prepared=prepared)
                        cases += 1
                        max_abs = max(max_abs, res.max_abs)
                        max_rel = max(max_rel, res.max_rel)
                        if res.identical is False:
                            identical = False
                        if not res.ok:
                            bad.append(f"count={count} {'in place' if in_place else 'out of place'}"
                                       f" {algo}: {res.report()}")
            rows += 1
            ident = "yes" if identical else "NO"
            if collective in ("Reduce_scatter_block", "Reduce_scatter", "reduce_scatter"):
                ident = "n/a"
            verdict = "ok" if not bad else f"FAIL ({len(bad)})"
            failed += bool(bad)
            say(f"{collective:<21} {info.name:<15} {opname or '-':<6} "
                f"{','.join(map(str, counts)):<{cw}} {','.join(algos):<{aw}} "
                f"{_fmt(max_abs):>9} {_fmt(max_rel):>9} {ident:>9}  {verdict}")
            for line in bad[: None if args.verbose else 3]:
                say(f"    {line}")
            if len(bad) > 3 and not args.verbose:
                say(f"    ... {len(bad) - 3} more (use --verbose)")
    elapsed = time.perf_counter() - t0
    failed = comm.allreduce(failed, op=MPI.MAX)
    say()
    if failed:
        say(f"FAIL: {failed} of {rows} checks failed ({cases} cases, {size} ranks, "
            f"{elapsed:.1f} s)")
    else:
        say(f"PASS: all {rows} checks agree with MPI's built-in ({cases} cases, {size} ranks, "
            f"{elapsed:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
