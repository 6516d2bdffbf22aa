"""The shared-memory path on device arrays, on the fake GPU (tests/support/fakegpu.py).

The fake runtime's CUDA IPC maps buffers across processes through the host's
shared memory, and its streams run queued work only when forced: a flag sent
before the device work it publishes leaves stale bytes where a peer reads, and
the results come out wrong.  Here: every collective with slots of a few
elements, lazy and eager streams, CUDA-aware MPI or not (MPI only ever sees
0-byte host messages); the stream is synchronised before every flag; nothing
is staged; IPC handles are closed at the communicator's free and the buffers
freed after their importers closed them; IPC refused on one rank; fake nodes.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from mpi4py import MPI
from support import fakegpu, gpucases, util

import mpicoll
from mpicoll.algorithms import shared as _algorithms
from mpicoll.backends import devices as _devices
from mpicoll.transport import shared as _shared

pytestmark = pytest.mark.ranks(1, 2, 3)  # the node's ranks: none, a pair, three

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
NAMES = {"allreduce": [_algorithms.ONESHOT, _algorithms.TWOSHOT],
         "reduce_scatter": [_algorithms.NAME], "allgather": [_algorithms.NAME]}


def _device(be):
    rt = be.rt
    return gpucases.Device(make=lambda h: fakegpu.produce(rt, h),
                           empty=lambda n, dtype: rt.xp.empty(n, dtype), get=lambda x: x.get())


@pytest.fixture(params=["lazy-staging", "eager-aware"])
def gpu(request, monkeypatch):
    """A fake GPU, a communicator whose node memory has 64-byte slots (many chunks)."""
    streams, aware = request.param.split("-")
    be = fakegpu.fake_backend(compute=streams, copies=streams, slow_queries=streams == "lazy")
    monkeypatch.setattr(_shared, "DEVICE_SLOT_BYTES", 64)
    monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 1 << 30)  # (whole staging: refused)
    comm = WORLD.Dup()
    with fakegpu.registered(be), mpicoll.options(cuda_aware=aware == "aware"):
        yield be, comm
    comm.Free()


def _shared_cases(collective, size, commutative_only=False):
    """gpucases' (n, op, dtype, api, in place, algorithm) for the shared algorithms: every
    op and dtype, each count, API and in-place choice in turn, each shared algorithm."""
    sizes = sorted({0, 1, max(size - 1, 0), 3 * size + 1, 257})
    ops = gpucases.OPS if collective != "allgather" else [
        (None, d) for d in ("float64", "int16", "float16", "complex128", "bool")]
    out, k = [], 0
    for op, dtype in ops:
        if commutative_only and op is not None and not gpucases.op_of(op).Is_commutative():
            continue
        for n in sizes:
            for algorithm in NAMES[collective]:
                out.append((n, op, dtype, ("fn", "comm")[k % 2], bool((k // 2) % 2), algorithm))
                k += 1
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("collective", list(NAMES))
def test_matches_mpi(gpu, collective, monkeypatch):
    """gpucases' cases of the shared algorithms (dtypes and ops, counts 0 to many chunks, both
    APIs, in place and out) against MPI's built-in on host copies."""
    be, comm = gpu
    monkeypatch.setattr(gpucases, "cases", _shared_cases)
    failures = gpucases.run_all(comm, _device(be), collective)
    assert not failures, "\n".join(failures[:20])


def _flags_follow_the_work(rt) -> str:
    """'' if every MPI send of the log came after a synchronisation of the compute stream
    that followed the last work queued on it, else the first offence."""
    queued_since_sync = False
    for i, e in enumerate(rt.log):
        if e[:2] == ("queue", "compute"):
            queued_since_sync = True
        elif e == ("sync", "compute"):
            queued_since_sync = False
        elif e[0] == "mpi isend" and queued_since_sync:
            return f"log entry {i}: a flag sent before the compute stream's work ran"
    return ""


def test_flags_wait_for_the_work_and_carry_nothing(gpu):
    """Before each flag the compute stream is synchronised (the work it publishes is done);
    MPI only sees empty host buffers; nothing is staged through pinned memory."""
    be, comm = gpu
    rt = be.rt
    x = fakegpu.produce(rt, np.arange(40.0) + RANK)
    y = mpicoll.allreduce(x, comm=comm, algorithm=_algorithms.TWOSHOT)
    ref = np.empty(40)
    MPI.Intracomm.Allreduce(comm, np.arange(40.0) + RANK, ref)
    calls = [e for e in rt.log if e[0] in ("mpi isend", "mpi irecv")]
    bad = _flags_follow_the_work(rt)
    if not np.array_equal(y.get(), ref):
        bad += " wrong result"
    if any(not isinstance(a, np.ndarray) or a.size for _, _, a in calls):
        bad += " MPI saw a device or non-empty buffer"
    if SIZE > 1 and (rt.pinned_buffers or any(e[0] == "run" and e[2] in ("d2h", "h2d")
                                              for e in rt.log)):
        bad += " staged"
    if SIZE > 1 and not calls:
        bad += " no flags"
    util.assert_all(comm, not bad, bad)


@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
def test_a_missing_synchronisation_shows(monkeypatch):
    """The check above can fail: flags sent without synchronising are seen in the log (the
    data may come out right or not, by how the ranks' lazy streams happen to run)."""
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    comm = WORLD.Dup()

    def isend(self, arr, dest, chunk=0):  # no synchronisation
        return self.inner.isend(_shared._EMPTY, dest, chunk)

    monkeypatch.setattr(_shared.SyncChannel, "isend", isend)
    try:
        with fakegpu.registered(be):
            mpicoll.allreduce(fakegpu.produce(be.rt, np.full(10, RANK + 1.0)), comm=comm,
                              algorithm=_algorithms.ONESHOT)
    finally:
        comm.Free()
    util.assert_all(WORLD, bool(_flags_follow_the_work(be.rt)),
                     "a missing synchronisation went unnoticed")


def test_handles_closed_at_free_and_buffers_freed_after():
    """Each rank opens its node peers' buffers once per region; the communicator's free
    closes them, and each exporter frees its buffer once every importer closed it."""
    be = fakegpu.fake_backend(compute="eager", copies="eager", slow_queries=False)
    rt = be.rt
    comm = WORLD.Dup()
    with fakegpu.registered(be):
        for _ in range(3):
            mpicoll.allgather(fakegpu.produce(rt, np.ones(5)), comm=comm, algorithm="shared")
        opened = rt.ipc_opened
        comm.Free()
    closed = rt.ipc_opened
    deadline = time.monotonic() + 30
    while _shared._RETIRED and time.monotonic() < deadline:
        _shared._reap()
        time.sleep(0.001)
    freed = sum(1 for e in rt.log if e[0] == "ipc free")
    ok = opened == SIZE - 1 and closed == 0 and freed == (1 if SIZE > 1 else 0) \
        and not _shared._RETIRED
    util.assert_all(WORLD, ok, f"opened {opened}, then {closed}; freed {freed}")


@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
def test_ipc_refused_on_one_rank():
    """IPC refused on rank 0 (a container, say): every rank learns it; "auto" under
    ``intranode=shared`` stages as before, an explicit shared algorithm raises everywhere."""
    be = fakegpu.fake_backend(ipc_error="cudaErrorMapBufferObjectFailed" if RANK == 0 else None)
    rt = be.rt
    comm = WORLD.Dup()
    try:
        with fakegpu.registered(be), mpicoll.options(intranode="shared", cuda_aware=False):
            with mpicoll.traffic() as t:
                y = mpicoll.allreduce(fakegpu.produce(rt, np.full(6, 1.0 + RANK)), comm=comm)
            err = None
            try:
                mpicoll.allreduce(fakegpu.produce(rt, np.ones(6)), comm=comm,
                                  algorithm=_algorithms.ONESHOT)
            except mpicoll.MpicollError as exc:
                err = str(exc)
            line = _shared.status(_context(comm), be)
    finally:
        comm.Free()
    ok = t.calls[0].algorithm not in NAMES["allreduce"] and t.bytes_sent > 0 \
        and np.array_equal(y.get(), np.full(6, SIZE * (SIZE + 1) / 2)) \
        and err is not None and "node memory unavailable" in err and line.startswith("no (")
    if RANK == 0:
        ok = ok and "cudaErrorMapBufferObjectFailed" in line
    util.assert_all(WORLD, ok, f"{t.calls[0].algorithm} {err} {line}")


def _context(comm):
    from mpicoll.engine import context
    return context.context(comm)


@pytest.mark.timeout(300)
@pytest.mark.skipif(SIZE < 2, reason="one rank is one node")
@pytest.mark.parametrize("aware", [False, True])
def test_fake_nodes(aware, monkeypatch):
    """Device arrays on (fake) nodes: node memory inside each node, the ring across them on
    the backend's channel (staged, or direct on a CUDA-aware MPI)."""
    env = util.env_options(monkeypatch)
    env.setenv("MPICOLL_FAKE_NODES", "cyclic:2" if SIZE > 2 else "0,0")
    monkeypatch.setattr(_shared, "DEVICE_SLOT_BYTES", 64)
    be = fakegpu.fake_backend()
    comm = WORLD.Dup()
    try:
        with fakegpu.registered(be), mpicoll.options(cuda_aware=aware):
            monkeypatch.setattr(gpucases, "cases",
                                lambda c, n: _shared_cases(c, n, commutative_only=True))
            failures = []
            for collective in NAMES:
                failures += gpucases.run_all(comm, _device(be), collective)
    finally:
        comm.Free()
    assert not failures, "\n".join(failures[:20])
