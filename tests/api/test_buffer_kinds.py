"""Every kind of host buffer of mpicoll.tools.arrays through mpicoll.Comm, judged by tools.results.

NumPy, ``array.array``, ``bytearray``, ``memoryview`` and DLPack-only buffers,
passed as mpi4py buffer specs ``[buf, datatype]``; the result must match the
exact reference, be identical on every rank, and leave the input untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi4py.util import dtlib
from support import buffers, util
from support.data import rank_data

import mpicoll
from mpicoll.tools import arrays as _arrays
from mpicoll.tools import results as _results

# buffer handling: 1 rank (trivial path), 3 (peers, not a power of two)
pytestmark = pytest.mark.ranks(1, 3)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
DTYPES = ("int32", "float64", "complex128")
KINDS = [k.name for k in _arrays.HOST_KINDS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_allreduce_and_allgather_on_every_buffer_kind(kind, dtype):
    arrays = buffers.kind(kind)
    if not arrays.supports(dtype):
        pytest.skip(f"{kind} cannot hold {dtype}")
    dt = np.dtype(dtype)
    mpitype = dtlib.from_numpy_dtype(dt)
    comm = mpicoll.Comm(WORLD)
    problems = []
    n = 2 * SIZE + 3
    x = rank_data(n, RANK, dt)
    try:
        send, recv = arrays.put(x), arrays.empty(n, dt)
        comm.Allreduce([send, mpitype], [recv, mpitype], MPI.SUM)
        got = arrays.get(recv, dt)
        res = _results.compare(got, _results.reference_allreduce(WORLD, x, MPI.SUM), "SUM", SIZE)
        if not res.ok:
            problems.append(f"Allreduce: {res.worst}")
        if not _results.same_values(arrays.get(send, dt), x):
            problems.append("Allreduce: the input changed")
        if not _results.identical_across_ranks(WORLD, got):
            problems.append("Allreduce: ranks differ")
        gathered = arrays.empty(n * SIZE, dt)
        comm.Allgather([send, mpitype], [gathered, mpitype])
        want = np.concatenate([rank_data(n, r, dt) for r in range(SIZE)])
        if not _results.same_values(arrays.get(gathered, dt), want):
            problems.append("Allgather: wrong result")
    except Exception as exc:  # decided together below
        problems.append(f"{type(exc).__name__}: {exc}")
    util.assert_all(WORLD, not problems, "; ".join(problems))


def test_to_host_reads_every_kind():
    x = np.arange(5, dtype=np.float64) + RANK
    for arrays in _arrays.HOST_KINDS:
        buf = arrays.put(x)
        assert _results.same_values(_arrays.to_host(buf, x.dtype), x), arrays.name
