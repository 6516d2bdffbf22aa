"""Device arrays without a GPU: mpicoll's real device code on a fake CUDA runtime (see fakegpu).

Runs under any number of ranks (``mpirun -n N python -m pytest tests/gpu/test_gpu_fake.py``).
Both transports are covered: host staging (``cuda_aware=False``: pinned
buffers, copy streams, events), per message or of the whole array once
(small calls, see _devices.WholeStage), and direct (``cuda_aware=True``: the fake
arrays' CUDA array interface points at host memory, so mpi4py hands their
pointers to MPI as a CUDA-aware MPI would get them).  The fake streams run
queued work only when forced, so a missing synchronisation shows up as
wrong data: every input is written by a kernel still queued when the
collective starts.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from support import fakegpu, gpucases, util

import mpicoll
from mpicoll.algorithms.schedule import DIRECT_SEGMENT_BYTES
from mpicoll.backends import cuda as _cuda
from mpicoll.backends import devices as _devices
from mpicoll.engine import context as _context
from mpicoll.transport import staging as _staging

# fake-GPU device paths: 1 rank, 2 (a power of two), 3 (not)
pytestmark = pytest.mark.ranks(1, 2, 3)

WORLD = MPI.COMM_WORLD

# (transport, fake stream behaviour, MPICOLL timeout: polling waits)
SETUPS = {
    "whole-lazy": ("whole", dict(compute="lazy", copies="lazy"), None),
    "whole-eager": ("whole", dict(compute="eager", copies="eager", slow_queries=False), 60.0),
    "staging-lazy": ("staging", dict(compute="lazy", copies="lazy"), None),
    "staging-fastcopy": ("staging", dict(compute="lazy", copies="eager"), 60.0),
    "staging-eager": ("staging", dict(compute="eager", copies="eager", slow_queries=False), None),
    "direct-lazy": ("direct", dict(compute="lazy", copies="lazy"), None),
    "direct-eager": ("direct", dict(compute="eager", copies="eager"), 60.0),
}


@pytest.fixture(scope="module")
def comm():
    """A private communicator with tiny ring segments (many pipelined messages)."""
    c = WORLD.Dup()
    with mpicoll.options(intranode="mpi"):  # the MPI transports, not the node path
        ctx = _context.context(c)
    ctx.segment_bytes = 64
    yield c
    c.Free()


@pytest.fixture(autouse=True)
def per_step_staging(monkeypatch):
    """Stage every message (the small cases here would otherwise be staged whole)."""
    monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 0)


@pytest.fixture(params=sorted(SETUPS))
def gpu(request, comm, monkeypatch):
    transport, streams, timeout = SETUPS[request.param]
    if transport == "whole":  # small calls: one host copy, the host algorithm
        monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 1 << 30)
    be = fakegpu.fake_backend(**streams)
    with fakegpu.registered(be), mpicoll.options(cuda_aware=transport == "direct", timeout=timeout):
        yield be


def device(be):
    rt = be.rt
    return gpucases.Device(make=lambda h: fakegpu.produce(rt, h),
                           empty=lambda n, dtype: rt.xp.empty(n, dtype),
                           get=lambda x: x.get())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_matches_mpi(gpu, comm, collective):
    failures = gpucases.run_all(comm, device(gpu), collective)
    assert not failures, "\n".join(failures[:20])


@pytest.mark.timeout(240)
def test_verify_cases(gpu, comm):
    """mpicoll.verify's cases on the fake GPU (the CuPy run of ``verify --device gpu`` needs a
    GPU): its layouts go beyond gpucases', e.g. Allgatherv blocks in reverse rank order with
    a gap after each, which must come back unchanged.  Whole-array staging copied its stale
    pinned buffer over those gaps (found by the first H200 run, 2026-12-04)."""
    from mpicoll.tools.arrays import DeviceArrays
    from mpicoll.tools.verify import cases as vcases
    from mpicoll.tools.verify import runner

    arrays = DeviceArrays(gpu.rt, "gpu")
    info = vcases.type_info("float32")
    failures = []
    for collective, (_, _, reduces) in vcases.COLLECTIVES.items():
        for k, algorithm in enumerate(vcases.algorithms_for(collective)):
            for count in (0, 2 * comm.size + 1):
                for in_place in (False, True):
                    res = runner.run_case(comm, collective, info, "SUM" if reduces else None, count,
                                          in_place, algorithm, arrays=arrays, seed=k, timeout=60)
                    if not res.ok:
                        failures.append(f"{collective} {algorithm} count={count} "
                                        f"in_place={in_place}: {res.report()}")
    assert not failures, "\n".join(failures[:10])


def _mpi_calls(rt):
    return [e for e in rt.log if e[0] in ("mpi isend", "mpi irecv")]


def test_staging_moves_only_pinned_host_buffers(comm):
    be = fakegpu.fake_backend()
    rt = be.rt
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
        x = fakegpu.produce(rt, np.arange(1000.0) + comm.rank)
        y = mpicoll.allreduce(x, comm=comm)
        ref = np.empty(1000)
        comm.Allreduce(np.arange(1000.0) + comm.rank, ref)
        assert np.array_equal(y.get(), ref)
    calls = _mpi_calls(rt)
    assert len(calls) == (0 if comm.size == 1 else len(calls))
    for _, _, arr in calls:
        assert isinstance(arr, np.ndarray), f"device array handed to MPI on the staging path: {arr!r}"
        assert rt.is_pinned(arr), "staging sent or received through a buffer that is not pinned"


def test_staging_orders_copy_after_producer(comm):
    """The D2H copy of the input runs after the kernel that wrote it, and before its MPI send."""
    if comm.size == 1:
        pytest.skip("no messages on one rank")
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
        x = fakegpu.produce(rt, np.full(64, comm.rank + 1.0))
        assert np.all(fakegpu.peek(x).view(np.uint8) == fakegpu.POISON)  # the kernel has not run
        mpicoll.allreduce(x, comm=comm, algorithm="ring")
    log = rt.log
    producer = log.index(("run", "compute", "producer kernel"))
    first_d2h = next(i for i, e in enumerate(log) if e[0] == "run" and e[2] == "d2h")
    first_send = next(i for i, e in enumerate(log) if e[0] == "mpi isend")
    assert producer < first_d2h < first_send


def test_direct_synchronizes_before_first_mpi_call(comm):
    if comm.size == 1:
        pytest.skip("no messages on one rank")
    be = fakegpu.fake_backend(compute="lazy")
    rt = be.rt
    with fakegpu.registered(be), mpicoll.options(cuda_aware=True):
        x = fakegpu.produce(rt, np.full(64, comm.rank + 1.0))
        y = mpicoll.allreduce(x, comm=comm)
        assert np.all(y.get() == comm.size * (comm.size + 1) / 2)
    log = rt.log
    first_mpi = next(i for i, e in enumerate(log) if e[0].startswith("mpi "))
    syncs = [i for i, e in enumerate(log) if e == ("sync", "compute")]
    assert syncs and syncs[0] < first_mpi
    producer = log.index(("run", "compute", "producer kernel"))
    assert producer < first_mpi
    # device arrays themselves go to MPI on this path
    assert any(isinstance(e[2], fakegpu.FakeArray) for e in _mpi_calls(rt))


def _ring_work(rt, comm, nbytes, **options):
    """(sends, receives, kernels, stream synchronisations) of this rank in the second of two
    float32 AllReduces of ``nbytes`` on the direct path (a communicator of its own, made
    under ``options``: the first call sets its context up)."""
    n = nbytes // 4
    mine = comm.Dup()
    try:
        with mpicoll.options(cuda_aware=True, **options):
            x = fakegpu.produce(rt, np.full(n, comm.rank + 1.0, np.float32))
            y = rt.xp.empty(n, np.float32)
            mpicoll.allreduce(x, comm=mine, out=y, algorithm="ring")
            start = len(rt.log)
            mpicoll.allreduce(x, comm=mine, out=y, algorithm="ring")
            log = rt.log[start:]
            assert np.all(y.get() == comm.size * (comm.size + 1) / 2)
    finally:
        mine.Free()
    return (sum(e[0] == "mpi isend" for e in log), sum(e[0] == "mpi irecv" for e in log),
            sum(e[0] == "queue" and e[2].startswith("kernel") for e in log),
            sum(e[0] == "sync" for e in log))


@pytest.mark.ranks(2, 3, 4)  # whole blocks at 4 ranks, two segments a block at 2 and 3
@pytest.mark.timeout(120)
def test_direct_path_has_a_segment_of_its_own(monkeypatch):
    """Device arrays handed straight to MPI move in the direct path's segment
    (DIRECT_SEGMENT_BYTES), not the host's 1 MiB: a 64 MiB ring AllReduce at 4 ranks makes
    6 sends, 6 receives, 3 reduction kernels and 4 stream synchronisations a rank, where
    1 MiB segments made 96, 96, 48 and 49.  MPICOLL_SEGMENT_BYTES, where set, still applies."""
    if WORLD.size == 1:
        pytest.skip("no messages on one rank")
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    n, nbytes = WORLD.size, 64 << 20

    def expected(segment):
        nseg = -(-(-(-nbytes // 4 // n) * 4) // segment)  # segments of the largest block
        steps = 2 * (n - 1) * nseg
        return steps, steps, steps // 2, steps // 2 + 1

    with fakegpu.registered(be):
        got = _ring_work(be.rt, WORLD, nbytes, intranode="mpi")
        util.env_options(monkeypatch).setenv("MPICOLL_SEGMENT_BYTES", "4M")
        explicit = _ring_work(be.rt, WORLD, nbytes, intranode="mpi")
    util.assert_all(WORLD, got == expected(DIRECT_SEGMENT_BYTES) and explicit == expected(4 << 20),
                    f"(sends, receives, kernels, syncs): {got}, expected "
                    f"{expected(DIRECT_SEGMENT_BYTES)}; with MPICOLL_SEGMENT_BYTES=4M: {explicit}, "
                    f"expected {expected(4 << 20)}")


def test_result_ready_for_callers_stream_only(comm):
    """After return, the result is ordered before later work on the caller's stream."""
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
        x = fakegpu.produce(rt, np.arange(300.0) * (comm.rank + 1))
        y = mpicoll.allreduce(x, comm=comm, algorithm="ring")
        z = rt.xp.empty(300, np.float64)
        rt.xp.add(y, y, out=z)  # the caller's next kernel, on the same stream
        ref = np.arange(300.0) * comm.size * (comm.size + 1) / 2
        assert np.array_equal(z.get(), 2 * ref)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_send", [1, 2])
def test_few_send_buffers(comm, max_send):
    """A send queue longer than the pinned buffers still completes, in order."""
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
        pool = be.staging_pool(_context.context(comm))
        old, pool.max_send = pool.max_send, max_send
        try:
            for collective in ("allreduce", "reduce_scatter", "allgather"):
                case = (700, "SUM" if collective != "allgather" else None, "float64", "fn", False, "ring")
                problem = gpucases.RUNNERS[collective](comm, device(be), case)
                assert problem is None, problem
        finally:
            pool.max_send = old


def test_pinned_buffers_reused_and_bounded(comm):
    """Pinned staging memory is a few reused buffers, whatever the number of calls.

    How many buffers one call takes depends on timing (sends in flight at
    once), so the test bounds the total over many calls rather than comparing
    two calls; every check is collective so one rank's failure cannot leave
    the others waiting in the next collective.
    """
    be = fakegpu.fake_backend()
    rt = be.rt
    calls = 12
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
        h = np.arange(5000.0) + comm.rank
        x = rt.xp.asarray(h)
        for _ in range(calls):
            y = mpicoll.allreduce(x, comm=comm, algorithm="ring")
        pool = be.staging_pool(_context.context(comm))
        ref = np.empty_like(h)
        comm.Allreduce(h, ref)
        correct = np.array_equal(y.get(), ref)
    # a few segments' worth of pinned memory, not the array, and not one per call
    seg = _context.context(comm).segment_bytes
    limit = _staging.DEFAULT_SEND_BUFFERS + 8
    problems = []
    if not correct:
        problems.append("wrong result")
    if pool._send_count > _staging.DEFAULT_SEND_BUFFERS:
        problems.append(f"{pool._send_count} send buffers > {_staging.DEFAULT_SEND_BUFFERS}")
    if pool.allocated > 16 * max(seg, _staging._MIN_PINNED):
        problems.append(f"{pool.allocated} pinned bytes held")
    if len(rt.pinned_buffers) > limit:
        problems.append(f"{len(rt.pinned_buffers)} pinned allocations in {calls} calls > {limit}")
    util.assert_all(comm, not problems, "; ".join(problems))


def test_comm_block_collectives(comm):
    """Allgather / Reduce_scatter_block with [buf, count, type] specs and IN_PLACE."""
    be = fakegpu.fake_backend()
    rt = be.rt
    size, rank = comm.size, comm.rank
    c = mpicoll.Comm(comm)
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
        mine = np.arange(3, dtype=np.int32) + 10 * rank
        y = rt.xp.empty(3 * size, np.int32)
        c.Allgather([fakegpu.produce(rt, mine), MPI.INT], [y, 3, MPI.INT])
        assert np.array_equal(y.get(), np.concatenate([np.arange(3) + 10 * r for r in range(size)]))

        full = np.zeros(3 * size, np.int32)
        full[3 * rank: 3 * rank + 3] = mine
        z = fakegpu.produce(rt, full)
        c.Allgather(MPI.IN_PLACE, z)
        assert np.array_equal(z.get(), y.get())

        src = np.arange(2 * size, dtype=np.float32) * (rank + 1)
        r = rt.xp.empty(2, np.float32)
        c.Reduce_scatter_block([fakegpu.produce(rt, src), MPI.FLOAT], [r, MPI.FLOAT])
        total = np.arange(2 * size, dtype=np.float32) * size * (size + 1) / 2
        assert np.array_equal(r.get(), total[2 * rank: 2 * rank + 2])

        w = fakegpu.produce(rt, src)
        c.Reduce_scatter_block(MPI.IN_PLACE, [w, 2, MPI.FLOAT])
        assert np.array_equal(w.get()[:2], total[2 * rank: 2 * rank + 2])


def test_device_errors_before_any_message(comm):
    be = fakegpu.fake_backend()
    rt = be.rt
    c = mpicoll.Comm(comm)
    with fakegpu.registered(be):
        x = rt.xp.asarray(np.zeros(8, np.float64))
        with pytest.raises(TypeError, match="MPI.DOUBLE_INT cannot be used with a fakegpu"):
            c.Allreduce(MPI.IN_PLACE, [x, MPI.DOUBLE_INT], op=MPI.MINLOC)
        with pytest.raises(TypeError, match="buffer kinds"):
            c.Allreduce(np.zeros(8), x)
        with pytest.raises(TypeError, match="expected a fakegpu"):
            mpicoll.allreduce(x, comm=comm, out=np.zeros(8))
        assert np.array_equal(x.get(), np.zeros(8))
    assert not _mpi_calls(rt)


def test_forced_direct_without_ucx_cuda_transport_refused_before_any_message(comm):
    """cuda_aware=True where the MPI's UCX has no CUDA transport (real device memory would
    be read as host memory): ValueError naming the setting and what is missing, on every
    rank, before any message; the input untouched."""
    be = fakegpu.fake_backend()
    rt = be.rt
    with fakegpu.registered(be), mpicoll.options(cuda_aware=True):
        accepted = _cuda._ucx_without_cuda  # (the fake GPU's stand-in, restored below)
        _cuda._ucx_without_cuda = lambda: (
            "the UCX transport loaded no CUDA transport (no libuct_cuda in this process)")
        try:
            x = rt.xp.asarray(np.arange(16.0) + comm.rank)
            util.raises_everywhere(
                comm, ValueError, r"mpicoll\.configure\(cuda_aware=True\): expected an MPI "
                r"that can read device memory, but the UCX transport loaded no CUDA transport",
                lambda: mpicoll.allreduce(x, comm=comm))
        finally:
            _cuda._ucx_without_cuda = accepted
        assert np.array_equal(x.get(), np.arange(16.0) + comm.rank)
    assert not _mpi_calls(rt)


def test_no_device_backend_names_cupy():
    """A CUDA array with no backend able to take it: TypeError that says to install CuPy."""
    pytest.importorskip("mpicoll.backends.devices")
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed: it would claim the object")
    except ImportError:
        pass
    rt = fakegpu.FakeRuntime()
    x = rt.xp.asarray(np.zeros(4))
    with pytest.raises(TypeError, match="install CuPy"):
        mpicoll.allreduce(x)


def test_user_op_goes_through_host(comm):
    """A user-defined op on device data: host round trip, stream-ordered, correct."""
    be = fakegpu.fake_backend(compute="lazy")
    rt = be.rt
    op = gpucases.user_op("user+")
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
        x = fakegpu.produce(rt, np.arange(50, dtype=np.int32) + comm.rank)
        y = mpicoll.allreduce(x, op, comm=comm)
        ref = np.arange(50, dtype=np.int32) * comm.size + comm.size * (comm.size - 1) // 2
        assert np.array_equal(y.get(), ref)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["staging", "whole", "direct"])
@pytest.mark.parametrize("form", ["array", "comm", "comm-in-place"])
def test_device_repeat_binds_nothing_new(comm, transport, form, monkeypatch):
    """A repeated call on the same device arrays starts its kept operation (engine.cache), as
    on host arrays: from the second call it makes no device array (a CuPy view) and from the
    third no event (the second finds the first's end event not yet seen done; staged per
    message, the pool grows to what the messages of a call hold at once however far a rank
    runs ahead: test_events_are_reused_across_calls).  Device calls were never kept: every
    call validated and bound its arrays again, views of each."""
    if transport == "whole":
        monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 1 << 30)
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    c = mpicoll.Comm(comm)
    n = 40 * comm.size + 3  # float64: with 64-byte segments, several messages per call
    made, created, wrong = [], [], []
    with fakegpu.registered(be), mpicoll.options(cuda_aware=transport == "direct", timeout=None):
        x, y = rt.xp.empty(n, np.float64), rt.xp.empty(n, np.float64)
        for k in range(5):
            data = np.arange(n, dtype=np.float64) * (comm.rank + 1) + k
            expected = np.empty_like(data)
            comm.Allreduce(data, expected)
            target = y if form == "comm-in-place" else x
            rt.launch(lambda h=target._h, d=data: np.copyto(h, d), "producer kernel")
            arrays, events = rt.arrays, rt.events_created
            if form == "array":
                mpicoll.allreduce(x, comm=comm, out=y)
            elif form == "comm":
                c.Allreduce(x, y)
            else:
                c.Allreduce(MPI.IN_PLACE, y)
            made.append(rt.arrays - arrays)
            created.append(rt.events_created - events)
            if not np.array_equal(y.get(), expected):
                wrong.append(k)
    problems = []
    if wrong:
        problems.append(f"calls {wrong} wrong")
    if any(made[1:]):
        problems.append(f"device arrays made per call: {made}")
    if transport != "staging" and any(created[2:]):
        problems.append(f"events created per call: {created}")
    util.assert_all(comm, not problems, "; ".join(problems))
