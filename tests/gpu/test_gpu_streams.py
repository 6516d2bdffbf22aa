"""Device work memory and streams: calls on different streams of one communicator (fake GPU).

mpicoll keeps device work memory (scratch slots, staging state) per
communicator; calls made on different CUDA streams share it.  These tests
alternate the caller's stream between calls while the previous call's work is
still queued (the fake streams run work only when forced), so a call that
reuses the memory without waiting for the previous user, whatever stream it
ran on, produces wrong results.
"""

from __future__ import annotations

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
