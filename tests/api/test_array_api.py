"""Array functions: mpicoll.allreduce / allgather / reduce_scatter on whole arrays.

Shapes, dtypes and return values; ``out=`` (new array, given array, ``out is
x`` in place); row counts for the gathers and scatters.  Expected values are
functions of rank and size.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.buffers import DLPackOnly
from support.data import rank_data, rank_sum

import mpicoll
from mpicoll.tools import verify as V

# the API layer (arguments, shapes, layouts): 1 rank, 2 (a power of two), 3 (not);
# the algorithms behind it run at 1-5 ranks in test_collectives, through the same API
pytestmark = pytest.mark.ranks(1, 2, 3)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

AR_ALGOS = V.algorithms_for("allreduce", auto=True)
RS_ALGOS = V.algorithms_for("reduce_scatter", auto=True)
AG_ALGOS = V.algorithms_for("allgather", auto=True)


SHAPES = [(), (1,), (5,), (3, 4), (2, 3, 2), (0,), (4, 0)]


@pytest.mark.parametrize("algorithm", AR_ALGOS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_allreduce_shapes(shape, algorithm):
    x = rank_data(shape, RANK, np.int64)
    before = x.copy()
    y = mpicoll.allreduce(x, algorithm=algorithm)
    ok = (isinstance(y, np.ndarray) and y.shape == x.shape and y.dtype == x.dtype
          and y is not x and np.array_equal(y, rank_sum(shape, SIZE, np.int64))
          and np.array_equal(x, before))
    util.assert_all(WORLD, ok, f"shape {shape}: got {y!r}")


@pytest.mark.parametrize("algorithm", AR_ALGOS)
def test_allreduce_out_and_in_place(algorithm):
    x = rank_data((3, 5), RANK, np.int64).astype(np.float32)
    out = np.full((3, 5), -1, np.float32)
    r1 = mpicoll.allreduce(x, MPI.MAX, out=out, algorithm=algorithm)
    every = [rank_data((3, 5), r, np.int64).astype(np.float32) for r in range(SIZE)]
    z = x.copy()
    r2 = mpicoll.allreduce(z, MPI.MIN, out=z, algorithm=algorithm)
    ok = r1 is out and np.array_equal(out, np.max(every, axis=0)) and r2 is z and \
        np.array_equal(z, np.min(every, axis=0))
    util.assert_all(WORLD, ok, f"{out} {z}")


@pytest.mark.parametrize("order", ["F", "C"])
def test_allreduce_fortran_order(order):
    """Fortran-ordered arrays reduce elementwise; the result has x's shape."""
    x = np.array(rank_data((4, 3), RANK, np.int64), order=order)
    y = mpicoll.allreduce(x)
    out = np.zeros((4, 3), np.int64)
    mpicoll.allreduce(x, out=out)
    z = x.copy(order="K")
    mpicoll.allreduce(z, out=z)
    ok = y.shape == (4, 3) and np.array_equal(y, rank_sum((4, 3), SIZE, np.int64))
    want = rank_sum((4, 3), SIZE, np.int64)
    ok = ok and np.array_equal(out, want) and np.array_equal(z, want)
    util.assert_all(WORLD, ok, f"{order}: {y}")


def test_allreduce_dlpack_object():
    x = rank_data((6,), RANK, np.int64).astype(np.float64)
    y = mpicoll.allreduce(DLPackOnly(x))
    util.assert_all(WORLD, np.array_equal(y, rank_sum((6,), SIZE, np.int64).astype(np.float64)), f"{y}")


@pytest.mark.parametrize("algorithm", AG_ALGOS)
@pytest.mark.parametrize("shape", [(), (2,), (3, 2), (0, 4), (1, 2, 2)], ids=str)
def test_allgather_shapes(shape, algorithm):
    """Rows are concatenated along axis 0 in rank order; a 0-d array is one row."""
    x = rank_data(shape, RANK, np.int16)
    y = mpicoll.allgather(x, algorithm=algorithm)
    parts = [rank_data(shape, r, np.int16).reshape(-1, *shape[1:]) if shape else
             rank_data(shape, r, np.int16).reshape(1) for r in range(SIZE)]
    want = np.concatenate(parts)
    ok = y.dtype == np.int16 and y.shape == want.shape and np.array_equal(y, want)
    util.assert_all(WORLD, ok, f"{shape}: {y.shape} {y}")


@pytest.mark.parametrize("algorithm", AG_ALGOS)
def test_allgather_counts_out_and_in_place(algorithm):
    """counts= gives uneven row counts (zeros too); out= and out is x (in place)."""
    counts = V.uneven_counts(1, SIZE)
    x = rank_data((counts[RANK], 3), RANK, np.float64)
    want = np.concatenate([rank_data((counts[r], 3), r, np.float64) for r in range(SIZE)])
    out = np.empty_like(want)
    r1 = mpicoll.allgather(x, counts=counts, out=out, algorithm=algorithm)
    buf = np.full_like(want, np.nan)
    lo = sum(counts[:RANK])
    buf[lo:lo + counts[RANK]] = x
    r2 = mpicoll.allgather(buf, counts=counts, out=buf, algorithm=algorithm)
    per = np.full((SIZE * 2,), -1, np.int32)
    per[2 * RANK:2 * RANK + 2] = [RANK, -RANK]
    r3 = mpicoll.allgather(per, out=per, algorithm=algorithm)
    want3 = np.array([v for r in range(SIZE) for v in (r, -r)], np.int32)
    ok = r1 is out and np.array_equal(out, want) and r2 is buf and np.array_equal(buf, want) \
        and r3 is per and np.array_equal(per, want3)
    util.assert_all(WORLD, ok, f"{out} {buf} {per}")


@pytest.mark.parametrize("algorithm", RS_ALGOS)
@pytest.mark.parametrize("rows", [0, 1, SIZE, 2 * SIZE + 1])
def test_reduce_scatter_default_split(rows, algorithm):
    """Default counts: numpy.array_split of the rows (first rows % size ranks get one more)."""
    x = rank_data((rows, 2), RANK, np.int64)
    y = mpicoll.reduce_scatter(x, algorithm=algorithm)
    want = np.array_split(rank_sum((rows, 2), SIZE, np.int64), SIZE)[RANK]
    ok = y.shape == want.shape and np.array_equal(y, want)
    util.assert_all(WORLD, ok, f"rows {rows}: {y} want {want}")


@pytest.mark.parametrize("algorithm", RS_ALGOS)
def test_reduce_scatter_counts_out_and_in_place(algorithm):
    counts = [0] * (SIZE - 1) + [3] if SIZE > 1 else [3]
    counts = counts[::-1]  # rank 0 gets all three rows, the others none
    x = rank_data((3, 2), RANK, np.int64).astype(np.int32)
    want = rank_sum((3, 2), SIZE, np.int64).astype(np.int32)[sum(counts[:RANK]):sum(counts[:RANK + 1])]
    out = np.full((counts[RANK], 2), -1, np.int32)
    r1 = mpicoll.reduce_scatter(x, counts=counts, out=out, algorithm=algorithm)
    z = x.copy()
    r2 = mpicoll.reduce_scatter(z, counts=counts, out=z, algorithm=algorithm)
    n = counts[RANK]
    ok = r1 is out and np.array_equal(out, want)
    ok = ok and r2.shape == (n, 2) and np.array_equal(r2, want)
    ok = ok and (n == 0 or np.shares_memory(r2, z))  # in place: a view of z's first rows
    ok = ok and np.array_equal(z[n:], x[n:])  # rows past the result stay as they were
    util.assert_all(WORLD, ok, f"{out} {r2} {z}")


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint64", "float16", "float32", "complex64",
                                   "longdouble", "clongdouble"])
def test_dtype_preserved(dtype):
    try:
        info = V.type_info(dtype)
    except TypeError:
        pytest.skip(f"{dtype} is not carried by this MPI build")
    op = V.ops_for(info)[0]
    x = V.make_input(info.dtype, 2 * SIZE + 1, RANK, SIZE, op)
    y = mpicoll.allreduce(x, getattr(MPI, op))
    g = mpicoll.allgather(x)
    s = mpicoll.reduce_scatter(x, getattr(MPI, op))
    ref = V.reference_allreduce(WORLD, x, getattr(MPI, op))
    ok = y.dtype == g.dtype == s.dtype == info.dtype and V.compare(y, ref, op, SIZE).ok
    util.assert_all(WORLD, ok, f"{dtype}: {y.dtype} {g.dtype} {s.dtype}")
