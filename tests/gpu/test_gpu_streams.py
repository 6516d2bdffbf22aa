"""Device work memory and streams: calls on different streams of one communicator (fake GPU).

mpicoll keeps device work memory (scratch slots, staging state) per
communicator; calls made on different CUDA streams share it.  These tests
alternate the caller's stream between calls while the previous call's work is
still queued (the fake streams run work only when forced), so a call that
reuses the memory without waiting for the previous user, whatever stream it
ran on, produces wrong results.
"""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest
from mpi4py import MPI
from support import fakegpu, gpucases, util

import mpicoll
from mpicoll.backends import devices as _devices
from mpicoll.engine import context as _context

# device streams: 1 rank, 2 (a power of two), 3 (not)
pytestmark = pytest.mark.ranks(1, 2, 3)

WORLD = MPI.COMM_WORLD


@pytest.fixture(scope="module")
def comm():
    c = WORLD.Dup()
    with mpicoll.options(intranode="mpi"):  # the MPI transports, not the node path
        _context.context(c).segment_bytes = 64  # many segments, so slots are reused within a call
    yield c
    c.Free()


def _expected(comm, collective, h, counts):
    if collective == "allgather":
        return np.concatenate(comm.allgather(h))
    total = np.empty_like(h)
    comm.Allreduce(h, total)
    if collective == "allreduce":
        return total
    lo = sum(counts[: comm.rank])
    return total[lo: lo + counts[comm.rank]]


def _call(comm, collective, x, algorithm, counts):
    """The collective in place on ``x`` (AllGather: x holds every block, this rank's filled)."""
    if collective == "allreduce":
        return mpicoll.allreduce(x, comm=comm, out=x, algorithm=algorithm)
    if collective == "reduce_scatter":
        return mpicoll.reduce_scatter(x, comm=comm, out=x, algorithm=algorithm)
    return mpicoll.allgather(x, comm=comm, counts=counts, out=x, algorithm=algorithm)


CASES = [(c, a) for c in ("reduce_scatter", "allreduce", "allgather")
         for a in sorted(gpucases._select.ALGORITHMS[c])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["staging", "direct", "whole"])
@pytest.mark.parametrize("collective, algorithm", CASES)
def test_alternating_streams(comm, transport, collective, algorithm, monkeypatch):
    """In-place calls on stream A, B, A, B of one communicator, inputs from queued producers,
    results read only at the end: every result right."""
    # staging per message, or the whole array once (see _devices.WholeStage)
    monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 1 << 30 if transport == "whole" else 0)
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    a, b = rt.new_stream(), rt.new_stream()
    n = 40 * comm.size + 3
    counts = gpucases.split(n, comm.size)[0]
    problems = []
    with fakegpu.registered(be), mpicoll.options(cuda_aware=transport == "direct", timeout=None):
        results = []
        for k, stream in enumerate((a, b, a, b)):
            h = gpucases.data(n, "float64", comm.rank, salt=k)
            if collective == "allgather":
                mine, h = h[: counts[comm.rank]], np.zeros(n)
                lo = sum(counts[: comm.rank])
                h[lo: lo + len(mine)] = mine
                ref = _expected(comm, collective, mine, counts)
            else:
                ref = _expected(comm, collective, h, counts)
            with rt.using(stream):
                x = fakegpu.produce(rt, h)  # a producer still queued on this stream
                y = _call(comm, collective, x, algorithm, counts)
            results.append((stream, y, ref))
        for k, (stream, y, ref) in enumerate(results):
            with rt.using(stream):
                got = y.get()
            if not np.array_equal(got, ref):
                bad = np.flatnonzero(got != ref)[:3].tolist()
                problems.append(f"call {k} on {stream.name}: wrong at {bad}")
    util.assert_all(comm, not problems, "; ".join(problems))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["staging", "direct", "whole"])
def test_threads_each_on_their_own_communicator(transport, monkeypatch):
    """Two threads run device collectives at once, each on its own communicator and stream,
    through the one backend: every result right, and every call's end event is its own,
    recorded on its thread's stream for its communicator (the runtime's log names the
    stream of every event recorded).  The state of a call in progress was the backend's:
    the threads finished each other's calls, or none."""
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("MPI runs without MPI_THREAD_MULTIPLE")
    monkeypatch.setattr(_devices, "STAGE_WHOLE_BYTES", 1 << 30 if transport == "whole" else 0)
    be = fakegpu.fake_backend(compute="lazy", copies="lazy")
    rt = be.rt
    comms = [WORLD.Dup() for _ in range(2)]
    for c in comms:
        _context.context(c).segment_bytes = 64  # (collective: set up before the threads)
    key = (be.name, rt.current_device())
    n, calls = 40 * WORLD.size + 3, 12
    problems = [[] for _ in comms]

    def run(i):
        comm, mine = comms[i], problems[i]
        ctx = _context.context(comm)
        stream = fakegpu.FakeStream(rt, f"thread{i}")
        try:
            with rt.using(stream):
                for k in range(calls):
                    h = gpucases.data(n, "float64", comm.rank, salt=10 * i + k)
                    x = fakegpu.produce(rt, h)
                    y = mpicoll.allreduce(x, comm=comm, algorithm="ring")
                    end = ctx.devices.get("done", {}).get(key)
                    if end is None or end.stream is not stream or end.pos != stream.queued:
                        mine.append(f"call {k}: its end event is "
                                    f"{'missing' if end is None else f'on {end.stream.name}@{end.pos}'}"
                                    f", not on thread{i}@{stream.queued}")
                    ref = np.empty_like(h)
                    comm.Allreduce(h, ref)
                    if not np.array_equal(y.get(), ref):
                        mine.append(f"call {k}: wrong result")
        except Exception as exc:  # reported with the others, on every rank
            mine.append(f"{type(exc).__name__}: {exc}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # (switch threads often: calls interleave)
    try:
        with fakegpu.registered(be), mpicoll.options(cuda_aware=transport == "direct",
                                                     timeout=60):
            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(interval)
        for c in comms:
            c.Free()
    found = [f"thread{i}: {p}" for i, ps in enumerate(problems) for p in ps[:2]]
    records = {e[1] for e in rt.log if e[0] == "record"}
    if not {"thread0", "thread1"} <= records:
        found.append(f"events recorded on {sorted(records)}")
    util.assert_all(WORLD, not found, "; ".join(found[:4]))
