"""CuPy arrays on a real GPU: the cases of test_gpu_fake.py, plus large arrays and streams.

Skipped, with the reason, where CuPy or a GPU is missing (CPU CI: the same
code paths run on a fake GPU in test_gpu_fake.py).  Every input is written by
a kernel that is still spinning when the collective starts, so a missing
synchronisation gives wrong results, not a lucky pass.  Ranks share the
visible GPUs round-robin (mpicoll.bind_device), so this runs at any -n on a
single GPU.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI
from support import gpucases, util

import mpicoll
from mpicoll.backends import cuda as _cuda
from mpicoll.engine import context as _context

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (the fake-GPU suite covers this logic)")


def _gpu_count():
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:  # no driver / no device
        return 0


pytestmark = pytest.mark.skipif(_gpu_count() == 0, reason="CuPy is installed but no GPU is visible")

WORLD = MPI.COMM_WORLD
SPIN = 2_000_000  # GPU clock cycles the producer kernel waits before writing (~1 ms)



@pytest.fixture(scope="module", autouse=True)
def bound():
    return mpicoll.bind_device(WORLD)


@pytest.fixture(scope="module")
def late_copy():
    return cupy.RawKernel(gpucases.LATE_COPY_SRC, "late_copy")


def produce(kernel, host, spin=SPIN):
    """A device array that a kernel, busy for ``spin`` cycles first, fills with ``host``."""
    host = np.ascontiguousarray(host)
    src = cupy.asarray(host)
    dst = cupy.empty_like(src)
    dst.view(cupy.uint8).fill(0xA7)
    if src.nbytes:
        kernel((80,), (256,), (src.view(cupy.uint8), dst.view(cupy.uint8),
                               np.int64(src.nbytes), np.int64(spin)))
    return dst


def device(kernel):
    return gpucases.Device(make=lambda h: produce(kernel, h),
                           empty=lambda n, dtype: cupy.empty(n, dtype=dtype),
                           get=cupy.asnumpy)


def _direct_reason():
    """Why the direct-path cases cannot run here (None: they can).

    The decision a user gets (``MPICOLL_CUDA_AWARE``, else the library's report
    and the device probe).  ``MPICOLL_TEST_REQUIRE_CUDA_AWARE=1`` (the device
    check's CUDA-aware routes) turns the skip into a failure, so a detection
    that says no cannot pass as skipped direct-path cases.
    """
    aware, reason = _cuda.cuda_aware_mpi()
    if aware:
        return None
    why = f"MPI is not CUDA-aware here: {reason}"
    if os.environ.get("MPICOLL_TEST_REQUIRE_CUDA_AWARE") == "1":
        pytest.fail(f"{why} (MPICOLL_TEST_REQUIRE_CUDA_AWARE=1)")
    return why


@pytest.fixture(scope="module")
def comm():
    c = WORLD.Dup()
    with mpicoll.options(intranode="mpi"):  # the MPI transports, not the node path
        _context.context(c).segment_bytes = 256  # many pipelined segments per message
    yield c
    c.Free()


@pytest.fixture(params=["whole", "staging", "direct"])
def transport(request, monkeypatch):
    """Staging of small calls as one whole-array copy, staging per message, or direct."""
    if request.param == "direct":
        why = _direct_reason()
        if why:
            pytest.skip(why)
    if request.param == "staging":
        monkeypatch.setattr(mpicoll.backends.devices, "STAGE_WHOLE_BYTES", 0)
    with mpicoll.options(cuda_aware=request.param == "direct"):
        yield request.param


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_matches_mpi(transport, comm, late_copy, collective):
    failures = gpucases.run_all(comm, device(late_copy), collective)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_large_default_segments(transport, late_copy, collective):
    """4M float32 per rank with the default segment size, against MPI on host copies."""
    n = (1 << 22) + 3
    case = (n, None if collective == "allgather" else "SUM", "float32", "fn", False, "auto")
    problem = gpucases.RUNNERS[collective](WORLD, device(late_copy), case)
    assert problem is None, problem


def test_long_kernel_on_own_stream(transport, late_copy):
    """Input written on a non-default stream by a ~10 ms kernel; the call runs on that stream."""
    n = 1 << 20
    h = np.arange(n, dtype=np.float64) % 1000 + WORLD.rank
    ref = np.empty_like(h)
    WORLD.Allreduce(h, ref)
    with cupy.cuda.Stream(non_blocking=True) as stream:
        x = produce(late_copy, h, spin=20_000_000)
        y = mpicoll.allreduce(x)
        z = y * 2  # the caller's next kernel, on the same stream
        got = cupy.asnumpy(z, stream=stream)
    assert np.array_equal(got, 2 * ref)


def test_pinned_buffers_reused_and_bounded(late_copy):
    """Staged calls reuse their context's pinned buffers, a few segments in all whatever
    the array: on a communicator of its own (WORLD's pool holds what earlier tests took)."""
    from mpicoll.transport import staging as _staging

    comm = WORLD.Dup()
    problems = []
    try:
        with mpicoll.options(cuda_aware=False):
            x = produce(late_copy, np.ones(1 << 22, np.float32))  # 16 MiB per rank
            mpicoll.allreduce(x, comm=comm, algorithm="ring")
            mpicoll.allgather(x, comm=comm)
            pool = mpicoll.backends.devices.CUPY.staging_pool(_context.context(comm))
            allocated = pool.allocated
            for _ in range(3):
                y = mpicoll.allreduce(x, comm=comm, algorithm="ring")
                g = mpicoll.allgather(x, comm=comm)
            seg = max(_context.context(comm).segment_bytes, _staging._MIN_PINNED)
            limit = (pool.max_send + pool.max_recv) * seg
            if pool.allocated != allocated:
                problems.append(f"the pool grew from {allocated} to {pool.allocated} bytes")
            if allocated > limit:
                problems.append(f"{allocated} pinned bytes held > {limit}")
            if float(y[0]) != comm.size or float(g[-1]) != 1.0 or g.size != comm.size * x.size:
                problems.append("wrong result")
    finally:
        comm.Free()
    util.assert_all(WORLD, not problems, "; ".join(problems))


def test_user_op_on_device(late_copy):
    op = gpucases.user_op("user+")
    x = produce(late_copy, np.arange(100, dtype=np.int32) + WORLD.rank)
    y = mpicoll.allreduce(x, op)
    ref = np.arange(100, dtype=np.int32) * WORLD.size + WORLD.size * (WORLD.size - 1) // 2
    assert np.array_equal(cupy.asnumpy(y), ref)
