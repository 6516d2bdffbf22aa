"""The shared-memory path on device arrays, on the fake GPU (tests/support/fakegpu.py).

The fake runtime's CUDA IPC maps allocations across processes, and its
streams run queued work only when forced (or when a peer's stream waits for
it): a flag whose work is not ordered before a peer's reads leaves stale bytes
where the peer reads, and the results come out wrong.  Here: every collective
with slots of a few elements, lazy and eager streams, CUDA-aware MPI or not
(MPI only ever sees 0-byte host messages); the GPU ordered by interprocess
events, no host waiting for it (a call returns with its work queued), a wait
left out shows; AllReduce on the ranks' own buffers (registered: each peer
opens an allocation once, a slice of one is its base and offset, a freed one
is closed, memory that cannot be shared goes through a buffer of the rank's)
in one fused fold, bitwise the same on every rank; IPC handles closed at the
communicator's free and the buffers freed after their importers closed them;
IPC refused on one rank; fake nodes.
"""

from __future__ import annotations

import gc
import os
import time
import types

import numpy as np
import pytest
from mpi4py import MPI
from support import fakegpu, gpucases, util

import mpicoll
from mpicoll.algorithms import shared as _algorithms
from mpicoll.backends import devices as _devices
from mpicoll.engine import intranode as _intranode
from mpicoll.engine import select as _select
from mpicoll.tools import results
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


def _events_order_the_flags(log) -> str:
    """'' if, in ``log``, the compute stream was never synchronised, every MPI send came
    after an interprocess event recorded on the compute stream after the last work queued
    there, and every flag received made the stream wait on its sender's event; else the
    first offence."""
    last, waits, flags = None, 0, 0
    for i, e in enumerate(log):
        if e == ("sync", "compute"):
            return f"log entry {i}: the host waited for the compute stream"
        if e[:2] == ("queue", "compute"):
            last = e[2]
            waits += e[2].startswith("wait ipc event")
        elif e[0] == "mpi isend" and last != "record ipc event":
            return f"log entry {i}: a flag not after an event recorded after the work ({last})"
        elif e[0] == "mpi irecv":
            flags += 1
    return "" if waits == flags else f"{flags} flags received, the stream waited on {waits}"


@pytest.mark.parametrize("name", [_algorithms.ONESHOT, _algorithms.TWOSHOT])
def test_events_order_the_work_and_flags_carry_nothing(gpu, name):
    """The GPU work of an AllReduce on node memory is ordered by interprocess events: an
    event recorded before each flag after the work it publishes, the stream waiting on the
    sender's event for each flag received, no host waiting for the GPU (the call returns
    with its fold queued, not run); MPI only sees empty host buffers; nothing is staged."""
    be, comm = gpu
    rt = be.rt
    x = fakegpu.produce(rt, np.arange(40.0) + RANK)
    y = rt.xp.empty(40, np.float64)
    start = len(rt.log)
    mpicoll.allreduce(x, comm=comm, out=y, algorithm=name)
    during = rt.log[start:]
    queued = bool((fakegpu.peek(y).view(np.uint8) == fakegpu.POISON).all())
    ref = np.empty(40)
    MPI.Intracomm.Allreduce(comm, np.arange(40.0) + RANK, ref)
    calls = [e for e in during if e[0] in ("mpi isend", "mpi irecv")]
    bad = _events_order_the_flags(during)
    if not np.array_equal(y.get(), ref):
        bad += " wrong result"
    if any(not isinstance(a, np.ndarray) or a.size for _, _, a in calls):
        bad += " MPI saw a device or non-empty buffer"
    if SIZE > 1 and (rt.pinned_buffers or any(e[0] == "run" and e[2] in ("d2h", "h2d")
                                              for e in rt.log)):
        bad += " staged"
    if SIZE > 1 and not calls:
        bad += " no flags"
    if SIZE > 1 and not rt.null.eager and not queued:
        bad += " the fold ran before the call returned"
    util.assert_all(comm, not bad, bad)


@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
def test_a_missing_wait_shows(monkeypatch):
    """The events are what orders the peers' reads: with the stream's waits on them left
    out, a rank that runs its fold while its peers' inputs are still being produced (lazy
    streams, the peers not running theirs) reads stale bytes."""
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    comm = WORLD.Dup()
    monkeypatch.setattr(rt, "wait_ipc", lambda stream, event: None)
    try:
        with fakegpu.registered(be):
            x = fakegpu.produce(rt, np.full(10, RANK + 1.0))
            y = mpicoll.allreduce(x, comm=comm, algorithm=_algorithms.ONESHOT)
            got = y.get() if RANK == 0 else None  # (the peers' inputs not produced yet)
            WORLD.Barrier()
            if RANK:
                y.get()
        wrong = RANK != 0 or not np.array_equal(got, np.full(10, SIZE * (SIZE + 1) / 2))
    finally:
        comm.Free()
    util.assert_all(WORLD, wrong, "a missing wait went unnoticed")


def _opened(rt, start=0) -> list:
    return [e[1] for e in rt.log[start:] if e[0] == "ipc open"]


def _key(rt, x) -> str:
    """'pid:buffer id' of the allocation of ``x`` (how the fake logs a peer opening it)."""
    return f"{os.getpid()}:{rt.ipc_range(x._h.ctypes.data)[2]}"


@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
def test_registered_buffers_opened_once_and_closed():
    """Each peer's allocation is opened once per communicator (a repeat opens nothing, a
    slice of one is its base and an offset, a new allocation is opened once); one freed is
    closed by the peers once its owner registers another; the communicator's free closes
    what it opened, and the exporter's own buffers go after every peer closed them."""
    be = fakegpu.fake_backend(compute="eager", copies="eager", slow_queries=False)
    rt = be.rt
    comm = WORLD.Dup()
    peers = SIZE - 1
    bad = []

    def run(x, y):
        mpicoll.allreduce(x, comm=comm, out=y, algorithm=_algorithms.TWOSHOT)

    with fakegpu.registered(be):
        big = rt.xp.asarray(np.arange(64.0) + RANK)
        y = rt.xp.empty(16, np.float64)
        run(big[:16], y)  # (the first call also sets node memory up: its buffers)
        start = len(rt.log)
        run(big[:16], y)
        run(big[16:32], y)  # another part of the same allocation
        if _opened(rt, start):
            bad.append(f"repeats opened {_opened(rt, start)}")
        if not np.array_equal(y.get(), np.arange(16.0, 32.0) * SIZE + SIZE * (SIZE - 1) / 2):
            bad.append("wrong result from an offset")
        x2 = rt.xp.asarray(np.ones(16))
        start = len(rt.log)
        run(x2, y)
        if len(_opened(rt, start)) != peers:
            bad.append(f"a new allocation: opened {_opened(rt, start)}")
        gone = comm.allgather(_key(rt, x2))
        del x2
        gc.collect()
        start = len(rt.log)
        run(rt.xp.asarray(np.ones(16)), y)  # (a new one: its owner finds the old one gone)
        closed = [e[1] for e in rt.log[start:] if e[0] == "ipc close"]
        want = sorted(k for q, k in enumerate(gone) if q != RANK)
        if sorted(closed) != want:
            bad.append(f"closed {closed}, not the freed {want}")
        opened = rt.ipc_opened
        comm.Free()
    deadline = time.monotonic() + 30
    while _shared._RETIRED and time.monotonic() < deadline:
        _shared._reap()
        time.sleep(0.001)
    if rt.ipc_opened:
        bad.append(f"{rt.ipc_opened} of {opened} left open after the free")
    util.assert_all(WORLD, not bad, "; ".join(bad))


@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
@pytest.mark.parametrize("in_place", [False, True])
def test_memory_that_cannot_be_shared(in_place):
    """A rank whose buffers are not in memory another process can open (an allocator the
    pointer attributes refuse) goes through a buffer of its own: results right, in place
    too, and the peers open that buffer once."""
    be = fakegpu.fake_backend()
    rt = be.rt
    comm = WORLD.Dup()
    bad = []
    try:
        with fakegpu.registered(be):
            for name in (_algorithms.ONESHOT, _algorithms.TWOSHOT):
                for _ in range(2):
                    h = np.arange(37.0) * (RANK + 1)
                    x = fakegpu.FakeArray(rt, h.copy()) if RANK == 0 else fakegpu.produce(rt, h)
                    y = x if in_place else (fakegpu.FakeArray(rt, np.zeros(37)) if RANK == 0
                                            else rt.xp.empty(37, np.float64))
                    mpicoll.allreduce(x, comm=comm, out=y, algorithm=name)
                    want = np.arange(37.0) * SIZE * (SIZE + 1) / 2
                    if not np.array_equal(y.get(), want):
                        bad.append(f"{name}: wrong result")
        exports = sum(1 for e in rt.log if e[0] == "ipc export")
        if RANK == 0 and exports < 2:
            bad.append(f"rank 0 exported {exports} buffers (its slots and a bounce expected)")
    finally:
        comm.Free()
    util.assert_all(WORLD, not bad, "; ".join(bad))


@pytest.mark.parametrize("name", [_algorithms.ONESHOT, _algorithms.TWOSHOT])
def test_one_fold_in_rank_order(gpu, name):
    """The AllReduce on node memory is one fold kernel per rank, no copies (the call's own
    buffers): every rank's result is bitwise the fold from the left in local-rank order
    (float32 sums whose value depends on the order), the same bytes on every rank."""
    be, comm = gpu
    rt = be.rt
    rng = np.random.default_rng(7)
    every = (rng.standard_normal((SIZE, 33)) * 10.0 ** rng.integers(-6, 7, (SIZE, 33)))
    every = every.astype(np.float32)
    want = every[0].copy()
    for q in range(1, SIZE):
        want = want + every[q]  # ((x0 + x1) + x2) + ... in float32
    x = fakegpu.produce(rt, every[RANK])
    y = rt.xp.empty(33, np.float32)
    start = len(rt.log)
    mpicoll.allreduce(x, comm=comm, out=y, algorithm=name)
    kernels = [e[2] for e in rt.log[start:] if e[:2] == ("queue", "compute")
               and e[2].startswith("kernel")]
    got = y.get()
    bad = []
    if SIZE > 1 and kernels != ["kernel fold"]:
        bad.append(f"kernels {kernels}")
    if got.tobytes() != want.tobytes():
        bad.append("not the rank-order fold")
    if not results.identical_across_ranks(comm, got):
        bad.append("ranks differ")
    util.assert_all(comm, not bad, "; ".join(bad))


def test_handles_closed_at_free_and_buffers_freed_after():
    """Each rank opens its node peers' buffers once per region (and the allocation of
    their output, the same in every call); the communicator's free closes them, and each
    exporter frees its buffer once every importer closed it."""
    be = fakegpu.fake_backend(compute="eager", copies="eager", slow_queries=False)
    rt = be.rt
    comm = WORLD.Dup()
    with fakegpu.registered(be):
        y = rt.xp.empty(5 * SIZE, np.float64)
        for _ in range(3):
            mpicoll.allgather(fakegpu.produce(rt, np.ones(5)), comm=comm, out=y,
                              algorithm="shared")
        opened = rt.ipc_opened
        comm.Free()
    closed = rt.ipc_opened
    deadline = time.monotonic() + 30
    while _shared._RETIRED and time.monotonic() < deadline:
        _shared._reap()
        time.sleep(0.001)
    freed = sum(1 for e in rt.log if e[0] == "ipc free")
    ok = opened == 2 * (SIZE - 1) and closed == 0 and freed == (1 if SIZE > 1 else 0) \
        and not _shared._RETIRED
    util.assert_all(WORLD, ok, f"opened {opened}, then {closed}; freed {freed}")


@pytest.mark.timeout(120)
@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
@pytest.mark.parametrize("aware", [False, True])
def test_auto_takes_the_node_path_on_one_node(aware, monkeypatch):
    """Device arrays, ``intranode`` left at "auto", every rank on one node: the node path
    (one shot up to DEVICE_ONESHOT_BYTES, then two shot; ``shared`` for ReduceScatter and
    AllGather), no byte through MPI, staged or CUDA-aware alike.  Across (fake) nodes, MPI's
    algorithms: "auto" takes node memory there only under ``intranode=shared``."""
    be = fakegpu.fake_backend()
    rt = be.rt
    small, large = 4, (_select.DEVICE_ONESHOT_BYTES >> 3) + 1  # float64 elements a rank
    got = []
    for nodes in (None, "cyclic:2" if SIZE > 2 else "0,1"):
        if nodes is not None:
            util.env_options(monkeypatch).setenv("MPICOLL_FAKE_NODES", nodes)
        comm = WORLD.Dup()
        try:
            with fakegpu.registered(be), mpicoll.options(cuda_aware=aware), \
                    mpicoll.traffic() as t:
                for n in (small, large):
                    y = mpicoll.allreduce(fakegpu.produce(rt, np.full(n, 1.0 + RANK)), comm=comm)
                    assert np.array_equal(y.get(), np.full(n, SIZE * (SIZE + 1) / 2))
                x = fakegpu.produce(rt, np.full(SIZE * small, 1.0 + RANK))
                y = mpicoll.reduce_scatter(x, comm=comm)
                assert np.array_equal(y.get(), np.full(small, SIZE * (SIZE + 1) / 2))
                y = mpicoll.allgather(fakegpu.produce(rt, np.full(small, 1.0 + RANK)), comm=comm)
                assert np.array_equal(y.get(), np.repeat(np.arange(1.0, SIZE + 1), small))
        finally:
            comm.Free()
        got.append(([c.algorithm for c in t.calls], t.bytes_sent))
    one_node = ([_algorithms.ONESHOT, _algorithms.TWOSHOT, _algorithms.NAME, _algorithms.NAME], 0)
    ok = got[0] == one_node and not set(got[1][0]) & set(_intranode.ALGORITHMS) and got[1][1] > 0
    util.assert_all(WORLD, ok, f"one node: {got[0]}, expected {one_node}; across nodes: {got[1]}")


@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
def test_a_tuning_file_leaves_device_arrays_on_the_node_path():
    """A tuning file (python -m mpicoll.tune times host arrays) that chose an AllReduce
    algorithm decides for host arrays, not whether device arrays take the node path."""
    be = fakegpu.fake_backend()
    rt = be.rt
    comm = WORLD.Dup()
    try:
        with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
            ctx = _context(comm)
            entry = types.SimpleNamespace(selection={"allreduce": ((None, "ring"),)},
                                          segments={}, raw={})
            ctx.selection = _select.Selection(dict(_select.builtin_rows(SIZE),
                                                   allreduce=((None, "ring"),)),
                                              "a tuning file", None, entry)
            with mpicoll.traffic() as t:
                mpicoll.allreduce(fakegpu.produce(rt, np.full(5, 1.0 + RANK)), comm=comm)
                mpicoll.allreduce(np.full(5, 1.0 + RANK), comm=comm)
    finally:
        comm.Free()
    got = [c.algorithm for c in t.calls]
    util.assert_all(WORLD, got == [_algorithms.ONESHOT, "ring"], f"device, host: {got}")


@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
@pytest.mark.parametrize("mode", ["shared", "auto"])
def test_ipc_refused_on_one_rank(mode):
    """IPC refused on rank 0 (a container, say): every rank learns it; "auto" (under
    ``intranode=shared``, or left at "auto") stages as before, an explicit shared algorithm
    raises everywhere."""
    be = fakegpu.fake_backend(ipc_error="cudaErrorMapBufferObjectFailed" if RANK == 0 else None)
    rt = be.rt
    comm = WORLD.Dup()
    try:
        with fakegpu.registered(be), mpicoll.options(intranode=mode, cuda_aware=False):
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
