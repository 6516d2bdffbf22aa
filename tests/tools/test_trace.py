"""mpicoll.trace(): valid Chrome trace JSON with every rank's steps, pipelining visible.

Run under an MPI launcher at any rank count.  Rank 0 reads the merged file
and checks the format trace viewers (Perfetto, chrome://tracing) need:
"traceEvents" of complete events (ph "X", ts/dur in microseconds, pid =
rank, tid = phase lane) that nest properly on every thread, named threads
and processes; then the content: events from every rank, one send/recv event
per message counted by mpicoll.traffic(), and the ring's pipelining (the
receive of segment i+1 is in flight while segment i is reduced; each
reduction starts after its own receive ended).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI
from support import util

import mpicoll
from mpicoll.engine import context as _context
from mpicoll.observe import trace as _trace

pytestmark = pytest.mark.timeout(120)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()


@pytest.fixture
def comm():
    c = WORLD.Dup()
    _context.context(c).segment_bytes = 256   # 32 float64 per segment
    yield c
    c.Free()


@pytest.fixture
def path():
    """One file name for all ranks, in a directory rank 0 makes and removes.

    (Not pytest's tmp_path: every rank's pytest would clean the same base directory.)
    """
    where = tempfile.mkdtemp(prefix="mpicoll-trace-") if RANK == 0 else None
    yield WORLD.bcast(None if where is None else os.path.join(where, "trace.json"))
    WORLD.Barrier()
    if where is not None:
        shutil.rmtree(where, ignore_errors=True)


def run_calls(comm):
    x = np.arange(1000, dtype=np.float64) + RANK
    mpicoll.allreduce(x, comm=comm, algorithm="ring")
    mpicoll.allreduce(x[:5], comm=comm, algorithm="recursive_doubling")
    mpicoll.allgather(x[: 3 + RANK], comm=comm, counts=[3 + r for r in range(SIZE)])
    mpicoll.reduce_scatter(x[: 50 * SIZE], comm=comm, algorithm="ring")


def nests(events) -> str:
    """'' if the X events of one thread are disjoint or nested, else a description."""
    stack = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1] <= e["ts"] + 1e-3:
            stack.pop()
        end = e["ts"] + e["dur"]
        if stack and end > stack[-1] + 1e-3:
            return f"{e['name']} [{e['ts']}, {end}] overlaps an enclosing slice ending {stack[-1]}"
        stack.append(end)
    return ""


def check_merged(path, sent, received):
    """Rank 0: the merged file against the Chrome trace format and the traffic counts."""
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    xs = [e for e in events if e["ph"] == "X"]
    meta = [e for e in events if e["ph"] == "M"]
    for e in xs:
        assert set(e) >= {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"}, e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
    assert {e["pid"] for e in xs} == set(range(SIZE))
    named = {(e["pid"], e["tid"]) for e in meta if e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in xs} <= named
    assert {e["pid"] for e in meta if e["name"] == "process_name"} == set(range(SIZE))
    threads = {}
    for e in xs:
        threads.setdefault((e["pid"], e["tid"]), []).append(e)
    bad = [f"{k}: {nests(v)}" for k, v in threads.items() if nests(v)]
    assert not bad, bad
    for r in range(SIZE):
        mine = [e for e in xs if e["pid"] == r]
        calls = [e for e in mine if e["tid"] // 100 == 1]
        assert [e["name"].split(" (")[0] for e in calls] == [
            "allreduce #1", "allreduce #2", "allgather #3", "reduce_scatter #4"]
        for i, seq in enumerate(range(1, 5)):
            nsend = sum(1 for e in mine if e["tid"] // 100 == 3 and e["args"]["call"] == seq)
            nrecv = sum(1 for e in mine if e["tid"] // 100 == 4 and e["args"]["call"] == seq)
            assert (nsend, nrecv) == (sent[r][i], received[r][i]), (r, seq)


def test_merged_file_is_valid_chrome_trace(comm, path):
    with mpicoll.traffic() as t, mpicoll.trace() as tr:
        run_calls(comm)
    written = tr.save(path, WORLD)
    sent = WORLD.gather([c.messages_sent for c in t.calls])
    received = WORLD.gather([c.messages_received for c in t.calls])
    problem = ""
    if RANK == 0:
        try:
            assert written == path
            check_merged(path, sent, received)
        except AssertionError as exc:
            problem = f"merged trace: {exc}"
    elif written is not None:
        problem = "save() returned a path on a rank other than 0"
    util.assert_all(WORLD, not problem, problem)


@pytest.mark.skipif(SIZE < 2, reason="no messages at one rank")
def test_ring_pipelining_is_visible(comm):
    """Ring AllReduce, many segments: receive i+1 is in flight while segment i is reduced."""
    x = np.arange(4000, dtype=np.float64) * (RANK + 1)
    with mpicoll.trace() as tr:
        mpicoll.allreduce(x, comm=comm, algorithm="ring")
    ev = tr.events
    recvs = [e for e in ev if e["phase"] == "recv"]
    reduces = [e for e in ev if e["phase"] == "reduce"]
    problems = []
    # one reduction per received reduce-scatter segment, in the same order
    rs = [e for e in recvs if e["stage"] == "reduce-scatter"]
    if [(e["step"], e["block"], e["segment"]) for e in reduces] != \
            [(e["step"], e["block"], e["segment"]) for e in rs]:
        problems.append("reductions do not follow the received segments")
    for i, red in enumerate(reduces):
        own = rs[i]
        if red["start"] < own["end"]:
            problems.append(f"reduce {i} starts before its receive ended")
        if i + 1 < len(rs):
            nxt = rs[i + 1]
            if not (nxt["start"] < red["start"] and nxt["end"] > red["end"]):
                problems.append(f"receive {i + 1} not in flight during reduce {i}")
    steps = [e["step"] for e in recvs]
    if steps != sorted(steps) or (steps and steps[-1] != 2 * SIZE - 3):
        problems.append(f"receive steps {steps[:3]}... not 0..2n-3 in order")
    util.assert_all(WORLD, not problems and len(reduces) > 2 * SIZE, "; ".join(problems[:5]))


def test_events_fields_and_scope(comm):
    x = np.ones(64)
    mpicoll.allreduce(x, comm=comm)           # before: not recorded
    with mpicoll.trace() as tr:
        mpicoll.allreduce(x, comm=comm, algorithm="ring")
    mpicoll.allreduce(x, comm=comm)           # after: not recorded
    ev = tr.events
    assert {e["phase"] for e in ev} >= {"collective"}
    assert all(set(e) == set(_trace.FIELDS) for e in ev)
    calls = [e for e in ev if e["phase"] == "collective"]
    assert len(calls) == 1 and calls[0]["call"] == 2 and calls[0]["algorithm"] == "ring"
    assert all(e["start"] <= e["end"] for e in ev)
    if SIZE > 1:
        sends = [e for e in ev if e["phase"] == "send"]
        ctx = _context.context(comm)
        right = ctx.ring[(ctx.ring_pos + 1) % SIZE]
        assert sends and all(e["peer"] == right for e in sends)
        assert sum(e["bytes"] for e in sends) > 0


def test_path_argument_saves_on_exit_and_chrome_dict(comm, path):
    with mpicoll.trace(path, comm=WORLD):
        mpicoll.allreduce(np.ones(10), comm=comm)
    doc = mpicoll.trace().chrome(WORLD)       # nothing recorded: only metadata
    ok = True
    if RANK == 0:
        with open(path) as f:
            saved = json.load(f)
        ok = any(e["ph"] == "X" and e["name"].startswith("allreduce #") for e in saved["traceEvents"])
        ok = ok and all(e["ph"] == "M" for e in doc["traceEvents"])
    else:
        ok = doc is None
    util.assert_all(WORLD, ok, "saved trace or chrome() result wrong")


def test_check_and_failures_are_traced(comm):
    with mpicoll.trace() as tr, mpicoll.options(check=True):
        mpicoll.allreduce(np.ones(8), comm=comm)
        if SIZE > 1:
            with pytest.raises(mpicoll.MismatchError):
                mpicoll.allreduce(np.ones(8 + (RANK == 1)), comm=comm)
    phases = [e["phase"] for e in tr.events]
    if SIZE > 1:
        assert phases.count("check") == 2
        failed = [e for e in tr.events if e["phase"] == "collective" and e["stage"] == "failed"]
        assert len(failed) == 1


def test_lanes_keep_slices_nested():
    recs = [("recv", 0.0, 3.0), ("recv", 1.0, 4.0), ("recv", 3.5, 5.0), ("reduce", 3.1, 3.2),
            ("recv", 4.0, 4.5)]
    recs = [r + (None,) * 9 for r in recs]
    tids = _trace._lanes(recs)
    assert tids == [400, 401, 400, 500, 401]
