"""User-defined ops (``MPI.Op.Create``) see the datatype mpi4py would hand them.

An op written the usual mpi4py way reads its operands with
``dtlib.to_numpy_dtype(datatype)``.  mpicoll moves some dtypes as other MPI
types (float16 as 16-bit words, integers as the fixed-width types); the op
must still be handed the buffer's own datatype (``MPI.SHORT_FLOAT`` /
``MPIX_C_FLOAT16`` for float16, ``MPI.LONG`` for an int64 array, the
datatype of an explicit spec), exactly as the built-in ``Allreduce`` gives it.
Each case runs the same op through mpicoll and through mpi4py's own method on
the same input, and compares results bit for bit and the datatypes the op saw.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi4py.util import dtlib
from support import util
from support.data import rank_data

import mpicoll
from mpicoll.core import types as _types

# user ops: 1 rank, 2 (a power of two), 3 (not)
pytestmark = pytest.mark.ranks(1, 2, 3)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COMM = mpicoll.Comm(WORLD)

# every dtype mpicoll moves (typecodes as NumPy spells them; 'l'/'q' and 'L'/'Q' differ to mpi4py)
TYPECODES = [c for c in "?bhilqBHILQefdgFDG" if _types.wire_type(np.dtype(c)) is not None]

SEEN: list = []  # datatype handles the op was called with, in call order


def _mpi4py_style_add(inbuf, inoutbuf, datatype):
    """inout = in + inout, the operands typed by the datatype (logical or for bool)."""
    SEEN.append(datatype.handle)
    dtype = dtlib.to_numpy_dtype(datatype)
    a = np.frombuffer(inbuf, dtype=dtype)
    b = np.frombuffer(inoutbuf, dtype=dtype)
    if dtype.kind == "b":
        np.logical_or(a, b, out=b)
    else:
        np.add(a, b, out=b)


@pytest.fixture(scope="module")
def add_op():
    op = MPI.Op.Create(_mpi4py_style_add, commute=True)
    yield op
    op.Free()


def _run(call):
    """(result, datatypes seen) of ``call()``."""
    del SEEN[:]
    out = call()
    return out, list(SEEN)


def _name(handle):
    return MPI.Datatype.fromhandle(handle).Get_name()


def _compare(label, got, want, T, bad, calls):
    """Same result as the built-in; every op call on ``T``, the datatype mpi4py resolves."""
    (g, gseen), (w, wseen) = got, want
    if g.dtype != w.dtype or not np.array_equal(g, w):  # values: long double has padding bytes
        bad.append(f"{label}: mpicoll {g!r} != built-in {w!r}")
    if set(gseen) - {T.handle}:
        bad.append(f"{label}: op saw {sorted(map(_name, set(gseen)))}, mpi4py gives it "
                   f"{T.Get_name()}")
    if set(wseen) - {T.handle}:  # the premise: the built-in hands the op T
        bad.append(f"{label}: built-in gave {sorted(map(_name, set(wseen)))}, not {T.Get_name()}")
    calls.append(len(gseen))


def _check(bad, calls):
    """All ranks agree there is no failure, and mpicoll called the op somewhere (size > 1)."""
    total = WORLD.allreduce(sum(calls))
    if SIZE > 1 and total == 0:
        bad.append("mpicoll never called the user op")
    util.assert_all(WORLD, not bad, "; ".join(bad))


def _buffer_type(x):
    """The datatype mpi4py resolves for a bare buffer: its format through mpi4py's table."""
    return MPI._typedict[memoryview(x).format.lstrip("@=<>")]


@pytest.mark.parametrize("code", TYPECODES)
def test_user_op_every_dtype(add_op, code):
    """Allreduce, Reduce_scatter_block, Reduce_scatter and the array functions, bare buffers."""
    n, bad, calls = 5, [], []
    x = rank_data(n * SIZE, RANK, code)
    T = _buffer_type(x)
    for algo in ("auto", "ring", "recursive_doubling"):
        c = mpicoll.Comm(WORLD, algorithm=algo)
        got = _run(lambda c=c: (c.Allreduce(x, y := np.zeros_like(x), op=add_op), y)[1])
        want = _run(lambda: (WORLD.Allreduce(x, y := np.zeros_like(x), op=add_op), y)[1])
        _compare(f"Allreduce {algo}", got, want, T, bad, calls)
    got = _run(lambda: mpicoll.allreduce(x, op=add_op))
    want = _run(lambda: (WORLD.Allreduce(x, y := np.zeros_like(x), op=add_op), y)[1])
    _compare("allreduce()", got, want, T, bad, calls)
    got = _run(lambda: (COMM.Reduce_scatter_block(x, y := np.zeros(n, code), op=add_op), y)[1])
    want = _run(lambda: (WORLD.Reduce_scatter_block(x, y := np.zeros(n, code), op=add_op), y)[1])
    _compare("Reduce_scatter_block", got, want, T, bad, calls)
    counts = [n - 1 + (r % 3) for r in range(SIZE)]
    xs = rank_data(sum(counts), RANK, code)
    got = _run(lambda: (COMM.Reduce_scatter(xs, y := np.zeros(counts[RANK], code), counts,
                                            op=add_op), y)[1])
    want = _run(lambda: (WORLD.Reduce_scatter(xs, y := np.zeros(counts[RANK], code), counts,
                                              op=add_op), y)[1])
    _compare("Reduce_scatter", got, want, T, bad, calls)
    got = _run(lambda: mpicoll.reduce_scatter(x, op=add_op))
    want = _run(lambda: (WORLD.Reduce_scatter_block(x, y := np.zeros(n, code), op=add_op), y)[1])
    _compare("reduce_scatter()", got, want, T, bad, calls)
    _check(bad, calls)


def _spec_cases():
    """(label, typecode of the data, datatype or typecode string given in the spec)."""
    cases = [("'e'", "e", "e"), ("'i'", "i", "i"), ("'l'", "l", "l"), ("'q'", "q", "q"),
             ("'f8'", "d", "f8"), ("MPI.LONG", "l", MPI.LONG), ("MPI.INT64_T", "l", MPI.INT64_T),
             ("MPI.C_BOOL", "?", MPI.C_BOOL), ("MPI.SIGNED_CHAR", "b", MPI.SIGNED_CHAR)]
    half = MPI._typedict.get("e")  # MPI.SHORT_FLOAT (Open MPI) or MPIX_C_FLOAT16 (MPICH)
    if half is not None and half != MPI.DATATYPE_NULL:
        cases.append((half.Get_name(), "e", half))
    return cases


@pytest.mark.parametrize("label,code,T", _spec_cases(), ids=[c[0] for c in _spec_cases()])
def test_user_op_explicit_datatype(add_op, label, code, T):
    """[buf, T] specs: the op sees T itself (an int64 array given as MPI.INT64_T sees INT64_T)."""
    n, bad, calls = 4, [], []
    x = rank_data(n * SIZE, RANK, code)
    T = T if isinstance(T, MPI.Datatype) else MPI._typedict[T]
    got = _run(lambda: (COMM.Allreduce([x, T], [y := np.zeros_like(x), T], op=add_op), y)[1])
    want = _run(lambda: (WORLD.Allreduce([x, T], [y := np.zeros_like(x), T], op=add_op), y)[1])
    _compare(f"Allreduce {label}", got, want, T, bad, calls)
    got = _run(lambda: (COMM.Allreduce(MPI.IN_PLACE, [y := x.copy(), T], op=add_op), y)[1])
    want = _run(lambda: (WORLD.Allreduce(MPI.IN_PLACE, [y := x.copy(), T], op=add_op), y)[1])
    _compare(f"Allreduce in place {label}", got, want, T, bad, calls)
    _check(bad, calls)


def test_float16_sum_is_not_bit_patterns(add_op):
    """1.5 on every rank, summed by a user op, is 1.5 * size (not inf: read as bit patterns)."""
    y = mpicoll.allreduce(np.full(3, 1.5, np.float16), op=add_op)
    util.assert_all(WORLD, np.array_equal(y, np.full(3, 1.5 * SIZE, np.float16)), f"{y}")
