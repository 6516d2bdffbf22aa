"""The node path's GPU pieces on CuPy: the fused fold kernel, the ranks' own buffers.

Skipped, with the reason, where CuPy or a GPU is missing (the fake-GPU suite,
test_shared_gpu_fake.py, runs the same logic in CPU CI).  Here what only a
GPU can say: every kernel :data:`mpicoll.backends.devices.FOLDS` generates
compiles and gives the bytes of the pairwise ufuncs in the same order, an
output that is also an operand included; the pointer attributes name a
pool block's allocation and offset; and an AllReduce on node memory run again
on the same arrays opens nothing new.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.algorithms import shared as _algorithms
from mpicoll.backends import devices as _devices
from mpicoll.engine import context as _context
from mpicoll.transport import shared as _shared

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (test_shared_gpu_fake.py covers this logic)")


def _gpu_count():
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver / no device
        return 0


pytestmark = pytest.mark.skipif(_gpu_count() == 0, reason="CuPy is installed but no GPU is visible")

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
DTYPES = sorted(_devices._DEVICE_DTYPES, key=str)


@pytest.fixture(scope="module", autouse=True)
def bound():
    return mpicoll.bind_device(WORLD)


def _operands(dtype, n=1000, k=3):
    rng = np.random.default_rng(5)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        hs = [rng.integers(0, 2, n).astype(dtype) for _ in range(k)]
    elif dtype.kind in "iu":
        hs = [rng.integers(0, 100, n).astype(dtype) for _ in range(k)]
    else:
        hs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(dtype)
              for _ in range(k)]
        if dtype.kind == "f":
            hs[1][::7] = np.nan
    return [cupy.asarray(h) for h in hs]


@pytest.mark.parametrize("name", sorted(_devices.FOLDS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fold_kernel_is_the_pairwise_ufuncs(name, dtype):
    """One kernel per (op, dtype): the bytes of ((x0 op x1) op x2) by CuPy's ufuncs, into
    two outputs, one of them the first operand."""
    if _devices.fold_expression(name, dtype) is None:
        pytest.skip(f"{name} on {np.dtype(dtype)} folds pairwise")
    rt = _devices.CUPY.rt
    xs = _operands(dtype)
    ufunc = rt.ufunc(name)
    want = xs[0].copy()
    for x in xs[1:]:
        ufunc(want, x, out=want)
    other = cupy.empty_like(xs[0])
    rt.fold(name, xs, [other, xs[0]])
    assert other.get().tobytes() == want.get().tobytes()
    assert xs[0].get().tobytes() == want.get().tobytes()


def test_pointer_attributes_name_the_allocation():
    """A slice of a pool block: its allocation's base, size and buffer id, its offset."""
    rt = _devices.CUPY.rt
    x = cupy.empty(1 << 20, cupy.float32)
    base, size, bid = rt.ipc_range(x.data.ptr + 4096)
    assert base <= x.data.ptr < x.data.ptr + 4096 < base + size
    assert rt.ipc_range(base) == (base, size, bid)
    assert len(rt.ipc_handle(base)) == 64


@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
@pytest.mark.parametrize("name", [_algorithms.ONESHOT, _algorithms.TWOSHOT])
def test_repeat_opens_nothing(name):
    """The second AllReduce on the same arrays opens no peer allocation; the result is the
    sum in rank order on every rank."""
    comm = WORLD.Dup()
    try:
        x = cupy.arange(1 << 16, dtype=cupy.float32) + RANK
        y = cupy.empty_like(x)
        mpicoll.allreduce(x, comm=comm, out=y, algorithm=name)
        registry = _shared.node_memory(_context.context(comm)).calls
        opened = [dict(r.opened) for r in registry.values()]
        mpicoll.allreduce(x, comm=comm, out=y, algorithm=name)
        again = [dict(r.opened) for r in registry.values()]
        want = np.arange(1 << 16, dtype=np.float32) * SIZE + SIZE * (SIZE - 1) // 2
        ok = opened == again and bool(opened) and np.array_equal(y.get(), want)
    finally:
        comm.Free()
    assert WORLD.allreduce(ok, op=MPI.LAND), (opened, again)

