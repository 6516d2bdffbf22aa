"""Step traces: every message, reduction and copy of every collective, as Chrome trace JSON.

``with mpicoll.trace() as tr:`` records, on each rank, one event per

========== ==================================================================
phase      interval
========== ==================================================================
collective the whole call (label "allreduce #17 (ring)")
check      the MPICOLL_CHECK fingerprint agreement
send       from ``Isend`` until the wait that saw it complete
recv       from ``Irecv`` until the wait that saw it complete
reduce     one local reduction ``out = a op b`` (labelled with the receive it consumes)
copy       one local copy
========== ==================================================================

with the collective, call number, algorithm, step, stage ("reduce-scatter",
"allgather", "fold", ...), block, segment, peer and bytes.
``tr.save("trace.json")`` (collective) merges every rank's events on rank 0
into a Chrome trace file: open it at https://ui.perfetto.dev or
chrome://tracing.  Each rank is a process (pid = rank); each phase is a
thread (tid), split into numbered lanes where its intervals overlap (several
receives in flight), because trace viewers need the slices of one thread to
nest.  Clocks are aligned to rank 0's by a ping-pong at save time where they
differ by more than the round-trip time.

``MPICOLL_TRACE=path.json`` (read at the first collective) traces the whole
run and saves at exit (if some rank does not reach the exit within
:data:`EXIT_WAIT_S`, each rank writes its own ``path.json.rank<R>`` instead).
"""

from __future__ import annotations

import atexit
import json
import os
import pickle
import sys
import time
from time import perf_counter

import numpy as np
from mpi4py import MPI

from ..algorithms.schedule import offsets
from ..core.comms import check_comm
from ..core.config import bump, get
from ..core.paths import unwritable

ENV = "MPICOLL_TRACE"
EXIT_WAIT_S = 60.0
PINGS = 4

# phase -> Chrome thread id base (lane k of a phase has tid base * 100 + k)
PHASE_TIDS = {"collective": 1, "check": 2, "send": 3, "recv": 4, "reduce": 5, "copy": 6}
FIELDS = ("phase", "start", "end", "collective", "call", "algorithm", "step", "stage",
          "block", "segment", "peer", "bytes")

# The traces recording now: MPICOLL_TRACE's first (once read), then the ``with trace()`` blocks
RECORDING: list = []
_env_trace: list = []  # [Trace or None] once MPICOLL_TRACE has been read


def active() -> tuple:
    """The traces that record the current call (``with trace()`` blocks and MPICOLL_TRACE).

    MPICOLL_TRACE is read at the first collective of the process.
    """
    if not _env_trace:
        path = get("trace")  # (core.config: the environment as read with the first context)
        tr = Trace() if path else None
        if tr is not None:
            atexit.register(_save_at_exit, tr, path)
            RECORDING.insert(0, tr)
            bump()
        _env_trace.append(tr)
    return tuple(RECORDING)


class Trace:
    """This rank's recorded events; see :func:`trace`."""

    def __init__(self, path: str | None = None, comm=None):
        self.path = path
        self.comm = comm
        self._records: list[tuple] = []

    def __enter__(self) -> Trace:
        RECORDING.append(self)
        bump()  # bound calls (engine.cache) must now take the observed path
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        RECORDING.remove(self)
        bump()
        if self.path is not None and exc_type is None:
            self.save(self.path, self.comm)

    # -- recording ------------------------------------------------------------
    def _add(self, call, t0: float, t1: float, failed: bool) -> None:
        """Store the events of one finished (or failed) call (an _observe.Call)."""
        name, seq, algo = call.label, call.seq, call.algorithm
        nbytes = call.total * call.wire
        self._records.append(("collective", t0, t1, name, seq, algo, None,
                              "failed" if failed else None, None, None, None, nbytes))
        for phase, a, b, peer, size, kind, k in call.events:
            lab = call.label_of(kind, k) if kind is not None else None
            if lab is None:
                step = stage = block = seg = None
            else:
                step, stage, block, seg = lab[:4]
            self._records.append((phase, a, b, name, seq, algo, step, stage, block, seg, peer, size))

    @property
    def events(self) -> list[dict]:
        """This rank's events as dicts (times in seconds of ``time.perf_counter``)."""
        return [dict(zip(FIELDS, r)) for r in self._records]

    # -- export ---------------------------------------------------------------
    def chrome(self, comm=None, root: int = 0, *, deadline: float | None = None) -> dict | None:
        """Every rank's events merged into a Chrome trace dict at ``root`` (collective).

        Returns the dict on ``root`` and None elsewhere.
        """
        comm = MPI.COMM_WORLD if comm is None else comm
        pc = _wait_dup(comm, deadline)
        try:
            offsets = _clock_offsets(pc, root, deadline)
            payload = pickle.dumps((MPI.Get_processor_name(), self._records))
            gathered = _gather_bytes(pc, payload, root, deadline)
        finally:
            pc.Free()
        if gathered is None:
            return None
        ranks = [pickle.loads(g) for g in gathered]
        return chrome_trace(ranks, offsets)

    def save(self, path: str, comm=None, root: int = 0, *, deadline: float | None = None):
        """Write the merged Chrome trace JSON to ``path`` on ``root`` (collective).

        Returns ``path`` on ``root``, None elsewhere.
        """
        doc = self.chrome(comm, root, deadline=deadline)
        if doc is None:
            return None
        with open(path, "w") as f:
            json.dump(doc, f)
        return path


def trace(path: str | None = None, *, comm=None) -> Trace:
    """Record every step of the collectives inside a ``with`` block.

    Args:
        path: if given, the merged trace is saved there when the block ends
            without an exception (collective over ``comm``; rank 0 of ``comm``
            writes).  Its folder must exist and be writable, checked here on
            every rank (ValueError otherwise), so a mistake is refused before
            the work, not after it.
        comm: communicator whose ranks' events are merged (default ``MPI.COMM_WORLD``);
            an intra-communicator.

    Returns:
        A :class:`Trace`: ``.events`` (this rank), ``.save(path)`` and
        ``.chrome()`` (collective, merged on rank 0).

    Example::

        with mpicoll.trace() as tr:
            mpicoll.allreduce(x)
        tr.save("allreduce.json")      # rank 0 writes; open in ui.perfetto.dev
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a str or None, got {type(path).__name__}")
    if comm is not None:
        check_comm(comm)
    if path is not None:
        path = os.fspath(path)
        # (on every rank: where all see the same folder, all raise alike, before any message)
        why = unwritable(path)
        if why is not None:
            raise ValueError(f"path: expected a file this rank can write, got {path!r}: {why}")
    return Trace(path, comm)


# -- merging --------------------------------------------------------------------
def chrome_trace(ranks, offsets, pids=None) -> dict:
    """Chrome trace dict from [(host, records)] per rank and per-rank clock offsets."""
    starts = [r[1] - offsets[i] for i, (_, recs) in enumerate(ranks) for r in recs]
    origin = min(starts, default=0.0)
    out = []
    for i, (host, recs) in enumerate(ranks):
        off = offsets[i]
        rank = i if pids is None else pids[i]
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"name": f"rank {rank} ({host})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                    "args": {"sort_index": rank}})
        lanes_used = set()
        for tid, rec in zip(_lanes(recs), recs):
            lanes_used.add((rec[0], tid))
            out.append(_event(rank, tid, rec, off, origin))
        for phase, tid in sorted(lanes_used, key=lambda pt: pt[1]):
            lane = tid % 100
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"name": phase if lane == 0 else f"{phase} {lane + 1}"}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                        "args": {"sort_index": tid}})
    return {"traceEvents": out, "displayTimeUnit": "ns",
            "otherData": {"source": "mpicoll.trace", "ranks": len(ranks)}}


def _lanes(recs):
    """A Chrome tid per record: overlapping intervals of one phase go to separate lanes."""
    ends: dict = {}
    tids = [0] * len(recs)
    for i in sorted(range(len(recs)), key=lambda i: (recs[i][1], -recs[i][2])):
        phase, start, end = recs[i][:3]
        lanes = ends.setdefault(phase, [])
        for lane, last in enumerate(lanes):
            if last <= start:
                lanes[lane] = end
                break
        else:
            lane = len(lanes)
            lanes.append(end)
        tids[i] = PHASE_TIDS[phase] * 100 + lane
    return tids


def _event(rank, tid, rec, off, origin) -> dict:
    phase, start, end, coll, seq, algo, step, stage, block, seg, peer, nbytes = rec
    if phase == "collective":
        name = f"{coll} #{seq} ({algo})" + (" FAILED" if stage == "failed" else "")
    elif phase == "check":
        name = "check fingerprint"
    else:
        where = "" if step is None else f" step {step}"
        if block is not None:
            where += f" block {block} seg {seg}"
        name = {"send": f"send{where} to {peer}", "recv": f"recv{where} from {peer}"}.get(
            phase, f"{phase}{where}")
    args = {"collective": coll, "call": seq, "algorithm": algo, "step": step, "stage": stage,
            "block": block, "segment": None if block is None else seg, "peer": peer,
            "bytes": nbytes}
    return {"name": name, "cat": coll, "ph": "X", "pid": rank, "tid": tid,
            "ts": round((start - off - origin) * 1e6, 3),
            "dur": round(max(end - start, 0.0) * 1e6, 3),
            "args": {k: v for k, v in args.items() if v is not None}}


# -- collective helpers with an optional deadline (perf_counter time) --------------
def _poll(reqs, deadline) -> None:
    if deadline is None:
        MPI.Request.Waitall(reqs)
        return
    while not MPI.Request.Testall(reqs):
        if perf_counter() > deadline:
            raise TimeoutError("trace merge: not every rank took part in time")
        time.sleep(1e-3)


def _wait_dup(comm, deadline):
    if deadline is None:
        return comm.Dup()
    newcomm, req = comm.Idup()
    _poll([req], deadline)
    return newcomm


def _clock_offsets(pc, root, deadline) -> list[float]:
    """Seconds to subtract from each rank's clock to get root's (0 where indistinguishable)."""
    n, rank = pc.Get_size(), pc.Get_rank()
    buf = np.zeros(1)
    offsets = [0.0] * n
    if rank != root:
        for _ in range(PINGS):
            _poll([pc.Irecv(buf, root, 7)], deadline)
            buf[0] = perf_counter()
            _poll([pc.Isend(buf, root, 8)], deadline)
    else:
        for r in range(n):
            if r == root:
                continue
            best = None
            for _ in range(PINGS):
                t0 = perf_counter()
                buf[0] = t0
                _poll([pc.Isend(buf, r, 7), pc.Irecv(buf, r, 8)], deadline)
                t1 = perf_counter()
                rtt, off = t1 - t0, buf[0] - (t0 + t1) / 2
                if best is None or rtt < best[0]:
                    best = (rtt, off)
            offsets[r] = best[1] if abs(best[1]) > best[0] / 2 else 0.0
    return offsets


def _gather_bytes(pc, payload: bytes, root, deadline):
    """[payload of every rank] at root, None elsewhere (Igather + Igatherv)."""
    n, rank = pc.Get_size(), pc.Get_rank()
    size = np.array([len(payload)], dtype=np.int64)
    sizes = np.zeros(n, dtype=np.int64)
    _poll([pc.Igather(size, sizes if rank == root else None, root)], deadline)
    data = np.frombuffer(payload, dtype=np.uint8)
    if rank == root:
        counts = sizes.tolist()
        at = offsets(counts)
        out = np.empty(at[-1], dtype=np.uint8)
        displs = at[:-1]
        _poll([pc.Igatherv(data, [out, (counts, displs), MPI.BYTE], root)], deadline)
        return [out[d:d + c].tobytes() for c, d in zip(counts, displs)]
    _poll([pc.Igatherv(data, None, root)], deadline)
    return None


def _save_at_exit(tr: Trace, path: str) -> None:
    """atexit handler for MPICOLL_TRACE: merged file, or one file per rank."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    rank = MPI.COMM_WORLD.Get_rank()
    try:
        # every rank must reach exit: wait for them without blocking forever
        deadline = perf_counter() + EXIT_WAIT_S
        _poll([MPI.COMM_WORLD.Ibarrier()], deadline)
        tr.save(path, MPI.COMM_WORLD, deadline=deadline)
    except TimeoutError:
        own = f"{path}.rank{rank}"
        with open(own, "w") as f:
            json.dump(chrome_trace([(MPI.Get_processor_name(), tr._records)], [0.0], [rank]), f)
        sys.stderr.write(f"mpicoll: rank {rank}: not every rank reached exit; trace in {own}\n")
