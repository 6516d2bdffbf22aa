"""The staging pipeline on the fake GPU: copies and MPI progress together; AllGather
forwarding; small calls staged whole; device-aware "auto".

The fake runtime logs every copy and event wait and
the recording channel every MPI call, so these tests check *how* the staging
channel moves data, besides the results (test_gpu_fake checks those on every
case).
"""

from __future__ import annotations

import pytest
from mpi4py import MPI
from support import fakegpu, gpucases, util

import mpicoll
from mpicoll.algorithms.schedule import STAGED_SEGMENT_FACTOR
from mpicoll.backends import devices as _devices
from mpicoll.engine import context as _context
from mpicoll.engine import intranode
from mpicoll.engine import select as _select

# staging: 1 rank, 2 (a power of two), 3 (not; AllGather forwarding needs 3)
pytestmark = pytest.mark.ranks(1, 2, 3)

WORLD = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def comm():
    c = WORLD.Dup()
    with mpicoll.options(intranode="mpi"):  # the MPI transports, not the node path
        _context.context(c).segment_bytes = 64  # staged messages of 256 bytes (STAGED_SEGMENT_FACTOR)
    yield c
    c.Free()


@pytest.fixture(autouse=True)
def per_step_staging(monkeypatch):
    """Stage every message (these small cases would otherwise be staged whole)."""
    monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 0)


def _device(rt):
    return gpucases.Device(make=lambda h: fakegpu.produce(rt, h),
                           empty=lambda n, dtype: rt.xp.empty(n, dtype), get=lambda x: x.get())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
@pytest.mark.parametrize("recv_buffers", [None, 1])
def test_no_copy_wait_while_mpi_can_progress(comm, collective, recv_buffers):
    """The host never blocks on a copy while an MPI transfer of the call is incomplete: it
    polls both and blocks only when just one of them is left (item 4).  With one pinned
    receive buffer every receive after the first needs the previous one's host-to-device
    copy to have run, which the host must not wait for while its sends are in flight."""
    if comm.size == 1:
        pytest.skip("no messages on one rank")
    be = fakegpu.fake_backend(compute="lazy", copies="lazy", query_lag=4)  # slow copies
    if recv_buffers is not None:
        be.staging_pool(_context.context(comm)).max_recv = recv_buffers
    rt = be.rt
    blocked = []
    sync = rt.event_synchronize

    def event_synchronize(event):
        if event.stream.name != "compute" and not event.complete:
            blocked.append((event.stream.name, fakegpu.mpi_outstanding(rt)))
        sync(event)

    rt.event_synchronize = event_synchronize
    problems = []
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False, timeout=None):
        for algorithm in sorted(gpucases._select.ALGORITHMS[collective]):
            op = None if collective == "allgather" else "SUM"
            case = (40 * comm.size + 3, op, "float64", "fn", False, algorithm)
            problem = gpucases.RUNNERS[collective](comm, _device(rt), case)
            if problem:
                problems.append(problem)
    bad = [b for b in blocked if b[1] > 0]
    if bad:
        problems.append(f"{len(bad)} blocking copy waits with MPI requests outstanding, e.g. {bad[:3]}")
    util.assert_all(comm, not problems, "; ".join(problems))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_place", [False, True])
def test_allgather_forwards_from_pinned_receive_buffer(comm, in_place):
    """Ring AllGather on the staging path copies only this rank's own block device-to-host:
    blocks received are forwarded from the pinned buffer they arrived in (item 5)."""
    if comm.size < 3:
        pytest.skip("the ring forwards blocks only at 3 ranks or more")
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    n = 100  # elements per rank: several ring pieces of one 256-byte segment (staged)
    calls = 5
    problems = []
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False, timeout=None):
        pool = be.staging_pool(_context.context(comm))
        # At most max_send forwards are in flight (each holds its pinned buffer);
        # beyond that a forward is copied from the device again.  Where messages
        # need a rendezvous and a neighbour lags (4 ranks on 2 cores), a call can
        # reach that cap: raise it above the forwards of one call (2 blocks x 3
        # pieces at 4 ranks), so the count below does not depend on timing.
        pool.max_send = 16
        d2h = pool.d2h_stream.name
        for k in range(calls):
            start = len(rt.log)
            case = (n, None, "float64", "fn", in_place, "ring")
            counts = [(n + 2 * r) % (n + 3) for r in range(comm.size)]  # as gpucases.run_allgather
            problem = gpucases.RUNNERS["allgather"](comm, _device(rt), case)
            if problem:
                problems.append(problem)
            log = rt.log[start:]
            copies = sum(1 for e in log if e == ("queue", d2h, "d2h"))
            sends = sum(1 for e in log if e[0] == "mpi isend")
            # staged: pieces of the staged segment
            seg = _context.context(comm).segment_bytes * STAGED_SEGMENT_FACTOR // 8
            own = -(-counts[comm.rank] // seg)
            if copies != own:
                problems.append(f"call {k}: {copies} device-to-host copies for {sends} sends; "
                                f"expected {own} (this rank's own pieces only)")
    limit = 4 + pool.max_recv  # send buffers: one per own piece in flight (at most 4 here)
    if len(rt.pinned_buffers) > limit:
        problems.append(f"{len(rt.pinned_buffers)} pinned allocations in {calls} calls > {limit}")
    util.assert_all(comm, not problems, "; ".join(problems[:4]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_staged_messages_take_pinned_buffers_of_one_segment(collective):
    """Every algorithm's messages on the staging path are one staged segment
    (STAGED_SEGMENT_FACTOR segments) at most, so each pinned buffer is one, and the ring's
    ("auto" there: its receives are windowed) are a few in all, whatever the array.  The
    ring AllGather's pieces of AG_SEGMENT_FACTOR segments and the pairwise schedules'
    pieces of LOCAL_PIECE_FACTOR inside a node each took a pinned buffer of that size (on
    an H200, 40-75 MiB held for 16 MiB arrays with 1 MiB segments), copied whole before
    the send.  At 3 ranks and more, in pieces this short, the pairwise schedules also
    deadlocked on the send buffers (transport.staging's docstring); the timeout turns a
    hang into a failure."""
    be = fakegpu.fake_backend()
    rt = be.rt
    c = WORLD.Dup()
    ctx = _context.context(c)
    ctx.segment_bytes = (64 << 10) // STAGED_SEGMENT_FACTOR
    seg = 64 << 10  # the staged segment, _MIN_PINNED: a longer message needs a larger buffer
    per_rank = (1 << 20) // 4 + 5  # float32 elements: 1 MiB and a little, 17 segments
    n = per_rank if collective == "allgather" else per_rank * c.size
    problems = []
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False, timeout=60):
        # (the shared algorithms stage nothing: they read node memory, engine.intranode)
        for algorithm in ["ring", *sorted(set(_select.ALGORITHMS[collective]) - {"ring"}
                                          - intranode.ALGORITHMS)]:
            case = (n, None if collective == "allgather" else "SUM", "float32", "fn", False,
                    algorithm)
            problem = gpucases.RUNNERS[collective](c, _device(rt), case)
            if problem:
                problems.append(problem)
            largest = max((len(b) for b in rt.pinned_buffers), default=0)
            if largest > seg:
                problems.append(f"{algorithm}: a pinned buffer of {largest} bytes > {seg}")
            pool = be.staging_pool(ctx)
            limit = (pool.max_send + pool.max_recv) * seg  # of one staged segment each
            if algorithm == "ring" and pool.allocated > limit:
                problems.append(f"ring: {pool.allocated} pinned bytes held > {limit}")
    c.Free()
    util.assert_all(WORLD, not problems, "; ".join(problems[:4]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
@pytest.mark.parametrize("in_place", [False, True])
def test_small_calls_staged_whole_once(comm, collective, in_place, monkeypatch):
    """Below STAGE_WHOLE_BYTES a staged call copies its array to the host once, runs the host
    algorithm, and copies the result back once, whatever the algorithm's steps (item 6)."""
    monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 1 << 20)
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    problems = []
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False, timeout=None):
        # (the shared algorithms stage nothing: they read node memory, engine.intranode)
        for algorithm in ["auto", *sorted(set(_select.ALGORITHMS[collective])
                                          - intranode.ALGORITHMS)]:
            op = None if collective == "allgather" else "SUM"
            case = (40 * comm.size + 3, op, "float64", "fn", in_place, algorithm)
            start = len(rt.log)
            problem = gpucases.RUNNERS[collective](comm, _device(rt), case)
            if problem:
                problems.append(problem)
            queued = [e[2] for e in rt.log[start:] if e[0] == "queue"]
            copies = (queued.count("d2h"), queued.count("h2d"))
            if copies != (1, 1):
                problems.append(f"{algorithm}: {copies[0]} device-to-host and {copies[1]} "
                                f"host-to-device copies, expected 1 and 1")
    util.assert_all(comm, not problems, "; ".join(problems[:4]))


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_auto_on_staged_device_arrays_takes_the_ring(collective):
    """Device arrays staged per message: "auto" takes the ring, whose copies are per segment,
    where the host table would take a whole-array algorithm (item 6)."""
    for nranks in (2, 3, 4, 8):
        for nbytes in (1 << 10, 200 << 10, 300 << 10, 600 << 10):
            assert _select.choose(collective, "auto", nbytes, nranks, staged=True) == "ring"
    assert _select.choose("allreduce", "auto", 300 << 10, 4) == "rabenseifner"  # host table
    # explicit choices and non-commutative ops are unchanged
    assert _select.choose(collective, "recursive_doubling", 1 << 10, 4, staged=True) == \
        "recursive_doubling"
    if collective != "allgather":
        assert _select.choose(collective, "auto", 1 << 10, 4, False, staged=True) == \
            "recursive_doubling"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["staging", "whole", "direct"])
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_events_are_reused_across_calls(comm, collective, transport, monkeypatch):
    """CUDA events come from the context's pool, reused once complete: every staged message
    took two new ones at each end (369 for a 64 MiB AllReduce at 4 ranks), at every call.

    Whole-array staging and the direct path use one event per call (its end): a repeat
    creates none (from the third call: the second finds the first's not yet seen done).
    Staged per message, a send or receive holds two at most at once, so ten calls create
    at most what one call's sends and receives hold together, however far a rank runs
    ahead (its queued sends hold theirs); at two per send or receive and call, ten calls
    took 20 per send or receive."""
    if transport == "whole":
        monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 1 << 30)
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    n = 300 * comm.size + 7  # float64: with 64-byte segments, many staged messages per call
    created, messages = [], []
    with fakegpu.registered(be), mpicoll.options(cuda_aware=transport == "direct", timeout=None):
        for _ in range(10):
            before, moved = rt.events_created, len(_mpi_calls(rt))
            op = None if collective == "allgather" else "SUM"
            problem = gpucases.RUNNERS[collective](comm, _device(rt), (n, op, "float64", "fn",
                                                                        False, "ring"))
            assert problem is None, problem
            created.append(rt.events_created - before)
            messages.append(len(_mpi_calls(rt)) - moved)
    problems = []
    if transport != "staging" and any(created[2:]):
        problems.append(f"calls 3-10 created {created[2:]} events")
    if transport == "staging" and sum(created) > 2 * messages[0] + 4:
        problems.append(f"10 calls created {sum(created)} events for {messages[0]} sends and "
                        f"receives each")
    util.assert_all(comm, not problems, "; ".join(problems) + f" (created per call: {created})")


def _mpi_calls(rt):
    return [e for e in rt.log if e[0] in ("mpi isend", "mpi irecv")]
