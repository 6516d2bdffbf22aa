"""Measure this MPI and machine, and write the selection ``algorithm="auto"`` uses.

Usage (every rank runs it; rank 0 prints and writes)::

    mpirun -n 2 python -m mpicoll.tune --quick      # coarse sweep (seconds)
    mpirun -n 2 python -m mpicoll.tune              # the default sweep (a minute or two)
    srun -N 4 --ntasks-per-node 8 python -m mpicoll.tune -o tuning.json
    python -m mpicoll.tune --predict 1024           # predicted crossovers at 1024 ranks
    python -m mpicoll.tune --predict 64,128 --ranks-per-node 8 -o tuning.json
    python -m mpicoll.tune --check tuning.json      # the 5 % rule, size by size

What it measures, in one run on the communicator's layout (ranks, nodes):

1. the point-to-point cost curve: one ``Sendrecv`` exchange between rank 0
   and a rank on its node (``intra``) and, across nodes, the first rank of
   another node (``inter``), from 8 B up, doubling; where the time jumps
   (a protocol cliff such as an eager limit) probes bisect the jump to a
   few tens of bytes;
2. every algorithm of every collective at each size (the hierarchical one
   only where the ranks span nodes), each timed in its own loop with the
   built-in, as the benchmark does (:func:`mpicoll.tools.bench.time_variants`:
   median of the slowest rank, interleaved batches) and checked against the
   exact values (:func:`mpicoll.tools.bench.check_case`).  The second pass
   (sizes in the other order; each point keeps its fastest) measures again
   only the algorithms within :data:`WIDE` of the fastest of the size; from
   :data:`SEG_MIN` up an algorithm :data:`LOSING` times slower at two sizes
   in a row is not measured at the larger ones;
3. from :data:`SEG_MIN` up, the segment size and window (core.config's
   ``segment_bytes`` and ``window``) of the algorithms near the fastest: the
   segment sizes of the sweep, then its windows at the best segment size;
4. the rate of a local reduction, and the cost model
   (:mod:`mpicoll.tools.costmodel`) fitted to all of it.

The fastest algorithm per size becomes a list of size ranges: at every size
an algorithm within 5 % of the fastest measured (any algorithm, any segment
and window), with the fewest switches (noise between near-equal algorithms
does not split a range); the boundary between two measured sizes is where
the model's curves cross.  Per algorithm, the segment size and window chosen
by size (the options' values unless another beats them by more than 5 %).
The report, and ``--check FILE`` later, print per size the chosen
algorithm's time against the fastest measured.  The tuning file (format:
:mod:`mpicoll.engine.tuning`) is keyed by the MPI library and version,
holds one entry per layout (a new run replaces the entry of its own layout
and keeps the others), and records when, where and how it was measured.
By default it is the default file of this MPI library in the user's cache
directory, which "auto" then reads; ``-o`` writes elsewhere
(``MPICOLL_TUNING=path`` to use it).  ``--predict N -o FILE`` adds the
model's selection for N ranks as entries marked predicted (``"source":
"model"``, with the measured entry they come from), which "auto" uses where
no measured entry fits.  The exit status is 1 if any result was wrong (no
file is written then).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicoll

from ..core import config as _config
from ..engine import context as _context
from ..engine import select as _select
from ..engine import tuning as _tuning
from ..transport import channel as _channel
from ..transport import topology as _topology
from . import bench as _bench
from . import costmodel as _costmodel

# the sweeps: sizes (bytes) of the exchange curve and of the collectives, timed calls
# (passes: every point is measured up to that many times, in alternating order, and keeps its
# fastest median: on a shared machine load only ever adds time; segments, windows: the
# grid of segment sizes and windows tried at the large sizes, the options' values with them)
SWEEPS = {
    "quick": {"p2p_max": 4 << 20, "coll": (256, 4 << 20, 4.0), "extra": (2048, 4096, 8192),
              "iters": 20, "warmup": 3, "bisect": 64, "passes": 2,
              "segments": (256 << 10, 1 << 20, 4 << 20), "windows": (1, 2)},
    "full": {"p2p_max": 16 << 20, "coll": (8, 16 << 20, 2.0), "extra": (),
             "iters": 40, "warmup": 5, "bisect": 16, "passes": 2, "half_steps": True,
             "segments": (64 << 10, 256 << 10, 1 << 20, 4 << 20), "windows": (1, 2, 4)},
}
FIT_MAX = 64 << 10  # the model's overheads are fitted to the sizes up to this
CLOSE = 1.05  # a winner by less than this keeps its neighbours' algorithm
# measured again only within this of the fastest: a loser by more cannot come within CLOSE
# of it in another pass unless the first pass was off by a fifth
WIDE = 1.25
SEG_MIN = 256 << 10  # segment and window are tried from this size up (below, one segment)
SEG_WIDE = 1.15  # ... for the algorithms within this of the fastest there
# another segment/window must beat the options' by more than this (the options are the
# simpler choice; the algorithm's time is then within CLOSE of its fastest variant, and
# winners() compares it with the fastest measured, so the 5 % rule still holds)
PREFER_DEFAULT = CLOSE
# a size's loop stops early once every variant's interquartile range is within this of
# its median (after a quarter of the calls): the median's standard error is then under 2 %
SPREAD = 0.05
LOSING = 1.5  # from SEG_MIN up, an algorithm this much slower at two sizes stops there


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mpicoll.tune",
        description="Measure the point-to-point cost curve and every algorithm, and write the "
                    "tuning file that algorithm='auto' reads (run under mpirun/srun).")
    p.add_argument("--quick", action="store_true", help="a coarse sweep (seconds)")
    p.add_argument("-o", "--output", metavar="PATH",
                   help="tuning file to write (default: this MPI library's file in the user's "
                        "cache directory, which auto reads)")
    p.add_argument("-C", "--collective", default="all",
                   help="comma-separated allreduce, reduce_scatter, allgather, or all (default)")
    p.add_argument("-d", "--datatype", default="float64", choices=sorted(_bench.DTYPES),
                   help="element type measured (default: float64)")
    p.add_argument("-b", "--minbytes", type=_bench.size_arg, help="smallest collective size")
    p.add_argument("-e", "--maxbytes", type=_bench.size_arg, help="largest collective size")
    p.add_argument("-f", "--stepfactor", type=_bench.factor_arg, help="size factor between steps")
    p.add_argument("-n", "--iters", type=_bench.positive_int_arg, help="timed calls per size")
    p.add_argument("--p2p-max", type=_bench.size_arg, help="largest exchange of the p2p curve")
    p.add_argument("--predict", metavar="RANKS", type=rank_list,
                   help="print the crossovers the model predicts at RANKS ranks (one count or "
                        "several: 4,8,16; same ranks per node as measured), from the tuning file "
                        "(--file, MPICOLL_TUNING or the default); measures nothing. With -o: "
                        "also write them to that file as predicted entries (source \"model\"), "
                        "which auto uses where no measured entry fits")
    p.add_argument("--file", metavar="PATH", help="with --predict: the tuning file to read")
    p.add_argument("--ranks-per-node", type=_bench.positive_int_arg, metavar="K",
                   help="with --predict: ranks per node of the layout predicted (default: as "
                        "measured)")
    p.add_argument("--check", metavar="FILE",
                   help="print, per size, the time of the algorithm FILE's selection runs "
                        "against the fastest measured; exit status 1 if one is over 5 %% "
                        "slower; measures nothing")
    p.add_argument("--no-segments", action="store_true",
                   help="do not try segment sizes and windows (the options' values are kept)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    return p


class Progress:
    """The progress line on rank 0's stderr: what is being measured, step k of n, seconds."""

    def __init__(self, total: int, quiet: bool):
        self.total, self.done, self.quiet = total, 0, quiet
        self.t0 = time.perf_counter()

    def step(self, text: str, weight: int = 1) -> None:
        self.done += weight
        if self.quiet:
            return
        line = f"[mpicoll.tune] {text} ({self.done}/{self.total}, {time.perf_counter() - self.t0:.0f} s)"
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{line}\033[K")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        if not self.quiet and sys.stderr.isatty():
            sys.stderr.write("\n")


# --- the layout ------------------------------------------------------------------------

def layout(comm) -> dict:
    """{"ranks", "nodes", "ranks_per_node": [min, max], "labels"}: where the ranks sit."""
    labels = _topology.node_ids(comm)  # MPICOLL_FAKE_NODES: the emulated nodes
    per = {}
    for lab in labels:
        per[lab] = per.get(lab, 0) + 1
    return {"ranks": comm.Get_size(), "nodes": len(per),
            "ranks_per_node": [min(per.values()), max(per.values())], "labels": labels}


def pairs(labels) -> dict:
    """{level: peer of rank 0}: a rank on rank 0's node and the first rank of another node."""
    out = {}
    same = [r for r in range(1, len(labels)) if labels[r] == labels[0]]
    other = [r for r in range(1, len(labels)) if labels[r] != labels[0]]
    if same:
        out["intra"] = same[0]
    if other:
        out["inter"] = other[0]
    return out


# --- the point-to-point curve --------------------------------------------------------

def _time(comm, call, warmup, iters, batch=5) -> float:
    """Median seconds of ``call`` (slowest rank): the benchmark's loop, ``batch`` calls
    after each barrier."""
    return _bench.time_variants(comm, {"x": (call, contextlib.nullcontext)}, warmup, iters,
                                max(1, min(batch, iters)))["x"]


def exchange_time(comm, peer, nbytes, warmup, iters, local: bool = False,
                  node_bytes: int | None = None, batch: int = 1) -> float:
    """Seconds of one exchange of ``nbytes`` each way between rank 0 and ``peer`` (others
    idle), sent as mpicoll's channel sends it to a peer of this node (``local``) or of
    another (in its pieces, transport.channel; ``node_bytes``: those to another node,
    default the communicator's): the curve prices the algorithms' messages.  ``batch``
    exchanges after each barrier (1: each alone, see below)."""
    rank = comm.Get_rank()
    send = np.full(max(nbytes, 1), rank % 251, dtype=np.uint8)[:nbytes]
    recv = np.empty(max(nbytes, 1), dtype=np.uint8)[:nbytes]
    other = peer if rank == 0 else 0 if rank == peer else None
    if node_bytes is None:
        node_bytes = _context.context(comm).node_piece  # (on every rank: it is collective)
    if other is None:
        def call():
            pass
    else:
        ch = _channel.Channel(comm, MPI.BYTE, 7,
                              tuple(local and r == other for r in range(comm.Get_size())),
                              node_bytes)

        def call():
            ch.waitall([ch.irecv(recv, other), ch.isend(send, other)])
    # each exchange after a barrier: back to back, on the emulated cluster's TCP links
    # an exchange of 1 MiB took 17.9 ms against 8.8 ms alone (the line's time), while the
    # algorithms' steps inside a call move at the line's speed
    t = _time(comm, call, warmup, iters, batch)
    if other is not None and nbytes and int(recv[0]) != other % 251:
        raise RuntimeError(f"exchange of {nbytes} B with rank {other}: wrong data received")
    return t


# Pieces to another node the tool tries (transport.channel, node_piece_bytes): the
# default, and below Open MPI's TCP eager limit (64 KiB with its header), where its
# exchanges back to back stop running at half the line (docs/performance.md).
NODE_PIECES = (1 << 20, 256 << 10, 60 << 10)
NODE_PIECE_BYTES = 4 << 20  # the exchange each piece size is timed on
NODE_PIECE_ROUNDS = 3


def node_piece(comm, peer, warmup, iters) -> tuple[int, dict]:
    """(piece, {piece: seconds}): the largest of :data:`NODE_PIECES` whose exchanges back to
    back (a collective's steps follow each other so) of :data:`NODE_PIECE_BYTES` between
    rank 0 and ``peer``, on another node, are within 5 % of the fastest's (each piece's
    median over ``iters`` in a row, its slowest of :data:`NODE_PIECE_ROUNDS` runs).  Every
    rank gets the same answer (the times are the slowest rank's)."""
    # one batch of all ``iters``: the half speed sets in after a few exchanges in a row
    # (35, 35, 35, 38, 66, 88, 91 ms for 4 MiB in 1 MiB pieces), and not in every run (1 MiB
    # pieces: 83.5 ms in one run, 35.1 ms in the next): each piece's time is its slowest of
    # NODE_PIECE_ROUNDS, so a piece that ran at half speed once loses
    times = {piece: max(exchange_time(comm, peer, NODE_PIECE_BYTES, warmup, iters,
                                      node_bytes=piece, batch=iters)
                        for _ in range(NODE_PIECE_ROUNDS)) for piece in NODE_PIECES}
    best = min(times.values())
    return max(p for p, t in times.items() if t <= 1.05 * best), times


def _is_cliff(t_lo, t_hi, slope_below, lo, hi) -> bool:
    """A jump well above what the slope below the pair predicts."""
    predicted = t_lo + slope_below * (hi - lo)
    return t_hi > 1.4 * t_lo and t_hi - predicted > 0.25 * t_lo


def p2p_curve(comm, peer, sweep, progress, level) -> dict:
    """{"bytes": [...], "us": [...], "cliffs": [{"below", "above", "us_below", "us_above"}]}."""
    sizes = _bench.sizes(8, sweep["p2p_max"], 2.0)
    pts = {}

    def point(s):
        iters = sweep["iters"] if s < (1 << 20) else max(3, sweep["iters"] // 4)
        t = exchange_time(comm, peer, s, sweep["warmup"], iters, level == "intra")
        pts[s] = min(t, pts.get(s, t))
        return pts[s]

    for k in range(sweep["passes"]):
        for s in (sizes if k % 2 == 0 else sizes[::-1]):
            point(s)
            progress.step(f"p2p {level} {_bench.human(s)}")
    cliffs = []
    for i in range(1, len(sizes)):
        lo, hi = sizes[i - 1], sizes[i]
        below = (pts[lo] - pts[sizes[i - 2]]) / (lo - sizes[i - 2]) if i >= 2 else 0.0
        if hi > (1 << 20) or not _is_cliff(pts[lo], pts[hi], max(below, 0.0), lo, hi):
            continue
        point(hi)  # a cliff must survive another look at both ends
        point(lo)
        if not _is_cliff(pts[lo], pts[hi], max(below, 0.0), lo, hi):
            continue
        t_lo, t_hi = pts[lo], pts[hi]
        a, b = lo, hi
        while b - a > sweep["bisect"]:
            mid = (a + b) // 2 // 8 * 8 or (a + b) // 2
            if mid in (a, b):
                break
            t = point(mid)
            if t > (t_lo + t_hi) / 2:
                b = mid
            else:
                a = mid
        cliffs.append({"below": a, "above": b, "us_below": pts[a] * 1e6, "us_above": pts[b] * 1e6})
        progress.step(f"p2p {level} cliff {a}-{b} B", 0)
    xs = sorted(pts)
    return {"peer": peer, "bytes": xs, "us": [pts[s] * 1e6 for s in xs], "cliffs": cliffs}


def reduce_rate(nbytes: int = 256 << 10) -> float:
    """Seconds per byte of np.add(a, b, out=c) on float64 (this rank, best of 20, warm memory)."""
    a = np.ones(nbytes // 8)
    b = np.ones(nbytes // 8)
    c = np.zeros(nbytes // 8)  # written once: no first-touch page faults in the timing
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        np.add(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return best / nbytes


# --- the collectives -----------------------------------------------------------------

def _bench_args(dtype: str, iters: int, warmup: int):
    """The benchmark's arguments for one size (its parser, so defaults stay its own)."""
    parser = _bench.build_parser()
    args = parser.parse_args(["-d", dtype, "-o", "sum", "-n", str(iters), "-w", str(warmup),
                              "--batch", str(max(1, min(5, iters))), "-q"])
    args.collective = "all"
    _bench.check_args(parser, args)
    return args


def collective_sizes(args, sweep, nranks, itemsize) -> tuple[list[int], list[int]]:
    """(sizes measured, candidates): the sweep's sizes, and the sizes half a step between
    them (1 KiB to 1 MiB, full sweep, default steps) measured only where the fastest
    algorithm changes between their neighbours (:func:`measure_collectives`)."""
    lo, hi, factor = sweep["coll"]
    lo = args.minbytes or lo
    hi = args.maxbytes or hi
    factor = args.stepfactor or factor
    sizes = set(_bench.sizes(lo, hi, factor)) | {s for s in sweep["extra"] if lo <= s <= hi}
    half = set()
    if sweep.get("half_steps") and args.stepfactor is None and factor >= 2 and not args.minbytes:
        # the medium sizes, where the crossovers and cliffs sit
        half = {int(s * 1.5) for s in _bench.sizes(1024, min(hi, 1 << 20), 2.0)
                if int(s * 1.5) <= hi}
    unit = itemsize * nranks  # a whole number of elements per rank for every collective

    def whole(values):
        return {max(unit, s // unit * unit) for s in values}

    measured = whole(sizes)
    return sorted(measured), sorted(whole(half) - measured)


def algorithms_of(collective: str, labels) -> list[str]:
    """The algorithms worth measuring on this layout: the hierarchical one only where the
    ranks span nodes with more than one rank on some (elsewhere "auto" never runs it)."""
    names = list(_select.ALGORITHMS[collective])
    if not _select.spans_nodes(labels):
        names = [a for a in names if a != "hierarchical"]
    return names


def _iters(sweep, override, nbytes) -> int:
    base = override or sweep["iters"]
    return base if nbytes < (1 << 20) else max(3, base // (4 if nbytes < (8 << 20) else 8))


def time_size(comm, device, collective, variants: dict, nbytes, args):
    """({key: seconds}, built-in seconds, wrong elements) of one size: every variant
    (key -> (algorithm, communicator)) in its own loop with the built-in, as the
    benchmark times it (:func:`mpicoll.tools.bench.time_variants`), then its output
    checked (:func:`mpicoll.tools.bench.check_case`); the built-in keeps its fastest.

    One loop of several variants would evict each other's buffers from the cache
    between batches and penalise the cache-sensitive algorithms (recursive doubling
    at 64 KiB on MPICH, 2 ranks: 10.1 us alone, 16.8 us in one loop with three others).
    """
    out, builtin, wrong = {}, math.inf, 0
    for key, (algorithm, vcomm) in variants.items():
        case = _bench.Case(vcomm, device, collective, algorithm, nbytes, args)
        t = _bench.time_variants(comm, {"mpicoll": case.variants["mpicoll"],
                                        "builtin": case.variants["builtin"]},
                                 args.warmup_iters, args.iters, args.batch,
                                 min_iters=max(args.batch, args.iters // 4), spread=SPREAD)
        out[key], builtin = t["mpicoll"], min(builtin, t["builtin"])
        w, bw = _bench.check_case(comm, case, device, args)
        wrong += w + (bw or 0)
        del case
    return out, builtin, wrong


def measure_collectives(comm, collectives, sizes, dtype, sweep, iters_override, progress,
                        algos=None, half=()):
    """{collective: {algorithm: {bytes: seconds}}}, {collective: {bytes: built-in seconds}}, wrong.

    Every algorithm of a size is timed in its own loop with the built-in
    (:func:`time_size`).  The first pass measures every algorithm at every size; the later passes
    (alternating the order of sizes: on a shared machine load only adds time,
    so each point keeps its fastest) measure again only the algorithms within
    :data:`WIDE` of the fastest at that size, and skip a size where one
    algorithm is left: a loser by that margin cannot come within 5 % of the
    winner, and a clear winner is not in doubt.

    In the second pass a size of ``half`` (half a step between two measured
    sizes) is measured, every algorithm, where the fastest algorithm differs
    between its two neighbours: the crossovers get the finer steps, the rest
    of the range not.
    """
    times, builtin, wrong = {}, {}, 0
    device = _bench.HostDevice()
    algos = algos or {c: list(_select.ALGORITHMS[c]) for c in collectives}
    per_size = {}  # collective -> its sizes (the half steps join after the first pass)

    def keep(table, key, seconds):
        table[key] = min(seconds, table.get(key, seconds))

    for k in range(sweep["passes"]):
        for collective in collectives:
            names = algos[collective]
            times.setdefault(collective, {a: {} for a in names})
            builtin.setdefault(collective, {})
            done = []  # the sizes measured in this pass, in order
            order = per_size.setdefault(collective, list(sizes))
            if k == 1:
                order += around_crossovers(times[collective], order, half)
                order.sort()
            for nbytes in (order if k % 2 == 0 else order[::-1]):
                run = names
                if k == 0 and nbytes >= SEG_MIN and len(done) >= 2:
                    run = [a for a in names if not losing(times[collective], a, done[-2:])]
                elif k > 0 and any(nbytes in t for t in times[collective].values()):
                    tc = times[collective]
                    best = min(tc[a][nbytes] for a in names if nbytes in tc[a])
                    run = [a for a in names if tc[a].get(nbytes, math.inf) <= WIDE * best]
                    if len(run) < 2:
                        progress.step(f"{collective} {_bench.human(nbytes)}: clear", len(names))
                        continue
                done.append(nbytes)
                args = _bench_args(dtype, _iters(sweep, iters_override, nbytes), sweep["warmup"])
                t, tb, w = time_size(comm, device, collective, {a: (a, comm) for a in run},
                                     nbytes, args)
                for a, seconds in t.items():
                    keep(times[collective][a], nbytes, seconds)
                keep(builtin[collective], nbytes, tb)
                wrong += w
                progress.step(f"{collective} {len(run)} algorithms {_bench.human(nbytes)}",
                              len(names))
    return times, builtin, wrong


def around_crossovers(per_algo: dict, sizes: list, half) -> list[int]:
    """The sizes of ``half`` whose two neighbours in ``sizes`` have different fastest
    algorithms (each neighbour's fastest among the algorithms measured there)."""
    def fastest(nb):
        return min((t[nb], a) for a, t in per_algo.items() if nb in t)[1]

    out = []
    ordered = sorted(sizes)
    for m in half:
        below = [x for x in ordered if x < m]
        above = [x for x in ordered if x > m]
        if below and above and fastest(below[-1]) != fastest(above[0]):
            out.append(m)
    return out


def losing(per_algo: dict, name: str, below: list) -> bool:
    """Whether ``name`` was more than :data:`LOSING` times the fastest at both sizes
    ``below`` (the two measured last, ascending, from :data:`SEG_MIN` up): in the bandwidth
    regime the volume decides, and a loser by that much does not come back (it is not
    measured at the larger sizes)."""
    for nb in below:
        t = per_algo[name].get(nb)
        best = min(x[nb] for x in per_algo.values() if nb in x)
        if nb < SEG_MIN or t is None or t <= LOSING * best:
            return False
    return True


def seg_key(segment: int, window: int) -> str:
    """``"262144:4"``: a segment size and window as the tuning file's key."""
    return f"{segment}:{window}"


def measure_segments(comm, collectives, times, sizes, dtype, sweep, iters_override, progress):
    """{collective: {algorithm: {bytes: {seg_key: seconds}}}}, the default key, wrong.

    At the sizes from :data:`SEG_MIN` up (the doubling ones: the half steps
    only place crossovers), every algorithm within :data:`SEG_WIDE` of the
    fastest there is timed at the segment sizes of the sweep (with the
    options' window), the options' values among them, then at the windows
    of the sweep not yet measured with the fastest segment size: a
    coordinate search, half the calls of the whole grid.  Each variant runs
    on a duplicate communicator whose context was made with those options
    (as a user's would be).  ``times`` (the options' variant) keeps its
    fastest.  Calls from 1 MiB take a millisecond or more: one warm-up call and
    a few timed ones are enough there.
    """
    base = dict(_config.read_environment())
    default = (base["segment_bytes"], base["window"])
    comms, seg, wrong = {}, {c: {} for c in collectives}, 0
    device = _bench.HostDevice()
    tuned = []  # from SEG_MIN up, each size at least 1.9 times the last
    for nb in sorted(sizes):
        if nb >= SEG_MIN and (not tuned or nb >= 1.9 * tuned[-1]):
            tuned.append(nb)
    todo = []
    for c in collectives:
        for nb in tuned:
            best = min(t[nb] for t in times[c].values() if nb in t)
            todo += [(c, nb, a) for a in times[c]
                     if nb in times[c][a] and times[c][a][nb] <= SEG_WIDE * best]
    if not todo:
        return seg, seg_key(*default), 0

    def comm_of(sw):
        if sw == default:
            return comm
        if sw not in comms:
            dup = comm.Dup()
            _context.context(dup, env=dict(base, segment_bytes=sw[0], window=sw[1],
                                           node_piece_bytes=_context.context(comm).node_piece))
            comms[sw] = dup
        return comms[sw]

    def run(c, nb, a, variants):
        nonlocal wrong
        iters = _iters(sweep, iters_override, nb)
        args = _bench_args(dtype, min(iters, 5) if nb >= (1 << 20) else iters,
                           1 if nb >= (1 << 20) else sweep["warmup"])
        t, _, w = time_size(comm, device, c, {sw: (a, comm_of(sw)) for sw in variants}, nb, args)
        wrong += w
        got = seg[c].setdefault(a, {}).setdefault(nb, {})
        for sw, x in t.items():
            key = seg_key(*sw)
            got[key] = min(x, got.get(key, x))
        if default in t:
            times[c][a][nb] = min(times[c][a][nb], t[default])
        progress.step(f"{c} {a} {_bench.human(nb)}: {len(variants)} segment/window", 0)
        return got

    try:
        for c, nb, a in todo:
            got = run(c, nb, a, sorted({(sg, default[1]) for sg in sweep["segments"]} | {default}))
            bestseg = min(((sg, default[1]) for sg in sweep["segments"]),
                          key=lambda sw: got[seg_key(*sw)])[0]
            if got[seg_key(*default)] <= got[seg_key(bestseg, default[1])]:
                bestseg = default[0]
            more = sorted({(bestseg, w) for w in sweep["windows"]}
                          - {tuple(int(x) for x in k.split(":")) for k in got})
            if more:
                run(c, nb, a, more)
    finally:
        for dup in comms.values():
            dup.Free()
    return seg, seg_key(*default), wrong


def choose_segments(times, seg, default_key):
    """(times with each tuned point at its chosen variant's time, {collective: {algorithm:
    {bytes: key}}}, {collective: {bytes: fastest seconds over every algorithm and variant}}).

    A point keeps the options' variant (its fastest time in ``times``) unless
    another is faster by more than :data:`PREFER_DEFAULT`; the algorithm's
    time there is then its chosen variant's, and the fastest is the fastest
    measured at all, so the 5 % rule of :func:`winners` holds for what "auto"
    runs.
    """
    eff = {c: {a: dict(t) for a, t in per.items()} for c, per in times.items()}
    chosen, fastest = {}, {}
    for c, per in times.items():
        fastest[c] = {nb: min(t[nb] for t in per.values() if nb in t)
                      for nb in {x for t in per.values() for x in t}}
        for a, pts in seg.get(c, {}).items():
            for nb, variants in pts.items():
                cands = dict(variants)
                cands[default_key] = times[c][a][nb]
                best = min(cands, key=cands.get)
                key = default_key if cands[default_key] <= PREFER_DEFAULT * cands[best] else best
                chosen.setdefault(c, {}).setdefault(a, {})[nb] = key
                eff[c][a][nb] = cands[key]
                fastest[c][nb] = min(fastest[c][nb], cands[best])
            # a size measured with the options only (a half step) keeps the options: the
            # file then gives nothing there that was not measured
            for nb in times[c][a]:
                if nb >= SEG_MIN and nb not in pts:
                    chosen[c][a][nb] = default_key
    return eff, chosen, fastest


def segment_rows(points: dict, default_key: str) -> list:
    """[[max_bytes, segment_bytes | None, window | None], ...] of one algorithm's chosen
    variants ({bytes: key}): the options below the first tuned size and wherever the
    options' variant was chosen; between two tuned sizes the boundary is their geometric
    mean; the last tuned size's variant holds above it."""
    pts = sorted(points.items())
    rows = [[pts[0][0] - 1, None, None]]
    for i, (nb, key) in enumerate(pts):
        limit = None if i == len(pts) - 1 else int(math.sqrt(nb * pts[i + 1][0]))
        if key == default_key:
            row = [limit, None, None]
        else:
            sg, w = (int(x) for x in key.split(":"))
            row = [limit, sg, w]
        if rows[-1][1:] == row[1:]:
            rows[-1][0] = limit
        else:
            rows.append(row)
    if rows[-1][1:] == [None, None] and len(rows) > 1 and rows[-2][1:] == [None, None]:
        rows.pop(-2)
    return [] if all(r[1:] == [None, None] for r in rows) else rows


# --- from times to size ranges -----------------------------------------------------

def winners(per_algo: dict, fastest: dict | None = None) -> list[tuple[int, str]]:
    """[(size, algorithm)]: at every size an algorithm within 5 % of the fastest, with the
    fewest switches between sizes (noise between near-equal algorithms does not split a
    range); among equal choices the faster.  ``fastest``: {size: seconds} of the fastest
    measured there when that is not one of ``per_algo``'s (a variant not chosen).
    """
    sizes = sorted(set.union(*(set(t) for t in per_algo.values())))
    algos = list(per_algo)  # (one not measured at a size is not a choice there)
    # cost[a]: (switches, summed time relative to the best) of the best path ending in a
    cost, back = {}, []
    for i, s in enumerate(sizes):
        best = min(per_algo[a][s] for a in algos if s in per_algo[a])
        if fastest is not None and s in fastest:
            best = min(best, fastest[s])
        near = [a for a in algos if per_algo[a].get(s, math.inf) <= CLOSE * best]
        new, prev = {}, {}
        for a in near:
            rel = per_algo[a][s] / best if best > 0 else 1.0
            if i == 0:
                new[a], prev[a] = (0, rel), None
                continue
            b = min(cost, key=lambda b: (cost[b][0] + (b != a), cost[b][1]))
            new[a], prev[a] = (cost[b][0] + (b != a), cost[b][1] + rel), b
        cost = new
        back.append(prev)
    a = min(cost, key=lambda a: cost[a])
    path = [a]
    for prev in reversed(back[1:]):
        a = prev[a]
        path.append(a)
    return list(zip(sizes, reversed(path)))


def size_ranges(collective, wins, model, nranks, ppn, itemsize) -> list:
    """[[max_bytes, algorithm], ..., [None, algorithm]] from the per-size winners.

    Between a size won by A and the next won by B the boundary is the last
    size (a multiple of 8 elements' bytes, checked at 32 points) where the
    model predicts A no slower than B; where the model disagrees with both
    measurements it is the last measured size of A.
    """
    rows = []
    for (s0, a), (s1, b) in zip(wins, wins[1:]):
        if a == b:
            continue
        limit = s0
        if model is not None:
            grid = np.unique(np.geomspace(s0, s1, 34)[1:-1].astype(int) // (8 * itemsize) * 8 * itemsize)
            ok = [s for s in grid if s0 < s < s1 and
                  model.predict(collective, a, s, nranks, ppn, itemsize)
                  <= model.predict(collective, b, s, nranks, ppn, itemsize)]
            if ok:
                limit = int(max(ok))
        rows.append([limit, a])
    rows.append([None, wins[-1][1]])
    return rows


# --- the 5 % rule ---------------------------------------------------------------------

def rule_rows(raw: dict) -> list[dict]:
    """What an entry's selection runs at each measured size against the fastest measured.

    One dict per (collective, size): ``chosen`` (algorithm, or algorithm and
    ``seg:win`` where the entry's segments give another variant than the
    options'), ``chosen_us`` (None: that variant was not measured),
    ``fastest``, ``fastest_us`` (over every algorithm and variant measured)
    and ``ratio``.
    """
    algorithms = {c: tuple(t) for c, t in _select.ALGORITHMS.items()}
    sel = _tuning.parse_selection(raw.get("selection"), algorithms, "selection")
    segs = _tuning.parse_segments(raw.get("segments"), algorithms, "segments")
    default = raw.get("seg_default") or seg_key(_config.TABLE["segment_bytes"].default,
                                                 _config.TABLE["window"].default)
    dseg, dwin = (int(x) for x in default.split(":"))
    lookup = _select.Selection({}, "", entry=None)
    lookup.segments = segs
    out = []
    for c, per in (raw.get("times_us") or {}).items():
        if c not in sel or not per:
            continue
        seg_us = (raw.get("segment_us") or {}).get(c, {})
        for size in sorted({int(x) for t in per.values() for x in t}):
            key = str(size)
            combos = {a: t[key] for a, t in per.items() if key in t}
            for a, pts in seg_us.items():
                for k, us in pts.get(key, {}).items():
                    if k != default:  # the options' variant: times_us holds its fastest
                        combos[f"{a} {k}"] = us
            name = next(a for limit, a in sel[c] if limit is None or size <= limit)
            tuned = lookup.segment(c, name, size)
            if tuned is not None:
                k = seg_key(tuned[0] or dseg, tuned[1] or dwin)
                name = name if k == default else f"{name} {k}"
            best = min(combos, key=combos.get)
            got = combos.get(name)
            out.append({"collective": c, "bytes": size, "chosen": name, "chosen_us": got,
                        "fastest": best, "fastest_us": combos[best],
                        "ratio": got / combos[best] if got is not None and combos[best] > 0
                        else None})
    return out


def rule_holds(row) -> bool:
    # (the file keeps times to the nanosecond: a ratio at the limit may round over by 1e-3)
    return row["ratio"] is not None and row["ratio"] <= CLOSE + 1e-3


def write_rule(out, rows, header: str = "") -> int:
    """The 5 % rule's table; returns how many sizes break it."""
    w = out.write
    bad = 0
    if header:
        w(header)
    w(f"#{'collective':>14} {'size (B)':>10} {'chosen':>28} {'us':>9} {'fastest':>28} "
      f"{'us':>9} {'ratio':>6}\n")
    for r in rows:
        ok = rule_holds(r)
        bad += not ok
        got = f"{r['chosen_us']:9.2f}" if r["chosen_us"] is not None else f"{'-':>9}"
        ratio = f"{r['ratio']:6.3f}" if r["ratio"] is not None else f"{'-':>6}"
        w(f" {r['collective']:>14} {r['bytes']:>10} {r['chosen'][:28]:>28} {got} "
          f"{r['fastest'][:28]:>28} {r['fastest_us']:9.2f} {ratio}"
          f"{'' if ok else '  <- over 5 %' if r['ratio'] is not None else '  <- not measured'}\n")
    w(f"# the chosen algorithm within 5 % of the fastest measured: {len(rows) - bad} of "
      f"{len(rows)} sizes\n")
    return bad


def check_main(path, out) -> int:
    """``--check FILE``: the 5 % rule for every measured entry; 1 if a size breaks it."""
    algos = {c: tuple(t) for c, t in _select.ALGORITHMS.items()}
    try:
        tf = _tuning.read(path, algos)
    except (OSError, ValueError) as exc:
        out.write(f"cannot read the tuning file: {exc}\n")
        return 1
    bad = 0
    measured = [e for e in tf.entries if e.source == "measured" and e.raw.get("times_us")]
    if not measured:
        out.write(f"{path}: no measured entry with times\n")
        return 1
    for e in measured:
        bad += write_rule(out, rule_rows(e.raw), f"# {path}: {e.describe()}\n")
    out.flush()
    return 1 if bad else 0


# --- the file ------------------------------------------------------------------------

def merge(path: str, ident: dict, entry: dict) -> tuple[dict, str]:
    """The file's content with ``entry`` replacing the entry of its layout (None: the file's
    entries as they are); a note."""
    data = {"format": _tuning.FORMAT, "version": _tuning.VERSION,
            "mpi": {"library": ident["library"], "version": ident["version"], "line": ident["line"]},
            "entries": []}
    note = "new file"
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                old = json.load(f)
            algos = {c: tuple(t) for c, t in _select.ALGORITHMS.items()}
            tf = _tuning.TuningFile(old, path, algos)
        except (OSError, ValueError) as exc:
            note = f"replaced an unreadable file ({exc})"
        else:
            if tf.foreign(ident):
                note = f"replaced a file {tf.foreign(ident)}"
            else:
                kept = [e for e in old["entries"] if entry is None
                        or not (e.get("ranks") == entry["ranks"] and e.get("nodes") == entry["nodes"])]
                data["entries"] = kept
                note = f"kept {len(kept)} entr{'y' if len(kept) == 1 else 'ies'} of other layouts"
    if entry is not None:
        data["entries"].append(entry)
    return data, note


def write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


# --- --predict -------------------------------------------------------------------------

def rank_list(text: str) -> list[int]:
    """``"64"`` or ``"4,8,16"``: the rank counts of ``--predict``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected rank counts such as 64 or 4,8,16, got {text!r}")
    return sorted(set(values))


def predicted_entry(model, source, n: int, ppn: int, itemsize: int, command: str) -> dict:
    """The tuning-file entry the model predicts for ``n`` ranks, ``ppn`` per node: per
    collective the fastest predicted algorithm by size (boundaries where the curves
    cross), marked ``"source": "model"`` with the measured entry it comes from."""
    nodes = -(-n // ppn)
    labels = [r // ppn for r in range(n)]
    sizes = _bench.sizes(8 * n * itemsize, 64 << 20, 2.0)
    selection = {}
    for c in _tuning.COLLECTIVES:
        allowed = algorithms_of(c, labels)
        rows = _costmodel.crossovers(model, c, n, ppn, sizes, itemsize)
        wins = [(nb, min(allowed, key=times.get)) for nb, _, times in rows]
        selection[c] = size_ranges(c, wins, model, n, ppn, itemsize)
    m = source.raw["measured"]
    return {
        "source": "model", "ranks": [n, n], "nodes": [nodes, nodes],
        "measured": m,
        "predicted": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "ranks": n, "nodes": nodes, "ranks_per_node": ppn,
            "from": {"ranks": list(source.ranks), "nodes": list(source.nodes),
                     "date": m.get("date"), "host": m.get("host")},
        },
        "selection": selection,
    }


def predict_main(args, out, argv=None) -> int:
    algos = {c: tuple(t) for c, t in _select.ALGORITHMS.items()}
    try:
        if args.file:
            tf = _tuning.read(args.file, algos)
        else:
            tf, note = _tuning.find(algos)
            if tf is None:
                out.write(f"no tuning file ({note}); run python -m mpicoll.tune first\n")
                return 1
    except (OSError, ValueError) as exc:
        out.write(f"cannot read the tuning file: {exc}\n")
        return 1
    measured = [e for e in tf.entries if e.source == "measured" and "p2p" in e.raw]
    if not measured:
        out.write(f"{tf.path}: no measured entry with an exchange curve\n")
        return 1
    entry = max(measured, key=lambda e: (e.raw["measured"].get("nodes", 1), e.ranks[0]))
    model = _costmodel.Model.from_entry(entry.raw)
    m = entry.raw["measured"]
    ppn = args.ranks_per_node or max(1, int(m.get("ranks_per_node", [m.get("ranks", 1)])[-1]))
    itemsize = np.dtype(m.get("dtype", "float64")).itemsize
    new = []
    for n in args.predict:
        _predict_table(out, tf, entry, model, n, ppn, itemsize)
        if n > 1:
            command = "python -m mpicoll.tune " + " ".join(argv if argv is not None else sys.argv[1:])
            new.append(predicted_entry(model, entry, n, min(ppn, n), itemsize, command))
    if args.output:
        data, notes = tf.data, []
        if os.path.abspath(args.output) != os.path.abspath(tf.path):
            data, note = merge(args.output, tf.mpi, None)
            notes.append(note)
        data = json.loads(json.dumps(data))
        for e in new:
            same = [x for x in data["entries"]
                    if x.get("ranks") == e["ranks"] and x.get("nodes") == e["nodes"]]
            if any(x.get("source", "measured") == "measured" for x in same):
                notes.append(f"{e['ranks'][0]} ranks on {e['nodes'][0]} node(s) measured: "
                             f"not predicted")
                continue
            data["entries"] = [x for x in data["entries"] if x not in same] + [e]
            notes.append(f"predicted {e['ranks'][0]} ranks on {e['nodes'][0]} node(s)")
        write(args.output, data)
        out.write(f"# wrote {args.output}: {'; '.join(notes)}\n")
    out.flush()
    return 0


def _predict_table(out, tf, entry, model, n, ppn, itemsize) -> None:
    nodes = -(-n // ppn)
    out.write(f"# mpicoll.tune --predict {n}: {n} ranks on {nodes} node(s) ({ppn} per node), "
              f"model fitted to {tf.path}\n# entry: {entry.describe()}\n")
    if nodes > 1 and not model.measured_inter:
        out.write("# inter-node links were not measured (one node): they are assumed as fast as "
                  "the intra-node ones; tune on two nodes or more for a real prediction\n")
    sizes = _bench.sizes(8 * n * itemsize if n > 1 else 8, 64 << 20, 2.0)
    for collective in _tuning.COLLECTIVES:
        if n == 1:
            break
        rows = _costmodel.crossovers(model, collective, n, ppn, sizes, itemsize)
        out.write(f"#\n# {collective}: predicted time (us) per algorithm\n")
        names = list(_select.ALGORITHMS[collective])
        out.write(f"#{'size (B)':>11} " + " ".join(f"{a[:18]:>18}" for a in names) + "  fastest\n")
        for nbytes, best, times in rows:
            out.write(f" {nbytes:>11} " + " ".join(f"{times[a] * 1e6:>18.1f}" for a in names)
                      + f"  {best}\n")
        ranges, prev = [], None
        for nbytes, best, _ in rows:
            if best != prev:
                ranges.append(f"{best} from {_bench.human(nbytes)}")
                prev = best
        out.write(f"# {collective} crossovers: {'; '.join(ranges)}\n")


# --- main -----------------------------------------------------------------------------

def main(argv=None, *, comm=None, out=None) -> int:
    """Run the tuning; returns the exit status (1 if a result was wrong, nothing written)."""
    out = sys.stdout if out is None else out
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.collective == "all":
        collectives = list(_tuning.COLLECTIVES)
    else:
        collectives = [c.strip() for c in args.collective.split(",") if c.strip()]
        bad = [c for c in collectives if c not in _tuning.COLLECTIVES]
        if bad or not collectives:
            parser.error(f"-C/--collective: expected allreduce, reduce_scatter, allgather or all, "
                         f"got {args.collective!r}")
    if args.check is not None:
        return check_main(args.check, out) if (comm or MPI.COMM_WORLD).Get_rank() == 0 else 0
    if args.predict is not None:
        return predict_main(args, out, argv) if (comm or MPI.COMM_WORLD).Get_rank() == 0 else 0
    comm = MPI.COMM_WORLD if comm is None else comm
    root = comm.Get_rank() == 0
    t_start = time.perf_counter()
    sweep = dict(SWEEPS["quick" if args.quick else "full"])
    if args.p2p_max:
        sweep["p2p_max"] = args.p2p_max
    ident = _tuning.mpi_identity()
    path = args.output or _tuning.default_path(ident)
    path = comm.bcast(path, root=0)
    lay = layout(comm)
    n = lay["ranks"]
    itemsize = np.dtype(_bench.DTYPES[args.datatype]).itemsize
    csizes, half = collective_sizes(args, sweep, n, itemsize)
    peers = pairs(lay["labels"]) if n > 1 else {}
    algos = {c: algorithms_of(c, lay["labels"]) for c in collectives}
    npts = len(_bench.sizes(8, sweep["p2p_max"], 2.0)) * len(peers)
    ncoll = sum(len(algos[c]) for c in collectives) * len(csizes) if n > 1 else 0
    progress = Progress(sweep["passes"] * (npts + ncoll), args.quiet or not root)

    phases = {}  # seconds per phase (the report and the file say where the time went)
    p2p = {level: p2p_curve(comm, peer, sweep, progress, level) for level, peer in peers.items()}
    piece, piece_times = None, {}
    if "inter" in peers:
        # measured before the algorithms, which then run with it, as "auto" will
        piece, piece_times = node_piece(comm, peers["inter"], sweep["warmup"], 12)
        _context.context(comm).node_piece = piece
    rate = comm.allreduce(reduce_rate(), op=MPI.MAX)
    phases["p2p"] = time.perf_counter() - t_start
    seg, default_key = {}, seg_key(_config.get("segment_bytes"), _config.get("window"))
    if n > 1:
        times, builtin, wrong = measure_collectives(comm, collectives, csizes, args.datatype, sweep,
                                                    args.iters, progress, algos, half)
        phases["algorithms"] = time.perf_counter() - t_start - sum(phases.values())
        if not args.no_segments:
            seg, default_key, w = measure_segments(comm, collectives, times, csizes,
                                                   args.datatype, sweep, args.iters, progress)
            wrong += w
    else:
        times, builtin, wrong = {}, {}, 0
    progress.end()
    seconds = time.perf_counter() - t_start
    phases["segments"] = seconds - sum(phases.values())
    if not root:
        return 1 if wrong else 0
    if wrong:
        out.write(f"mpicoll.tune: {wrong} wrong result elements; no tuning file written\n")
        return 1
    ppn = lay["ranks_per_node"][1]
    model = None
    if p2p:
        model = _costmodel.Model(p2p, rate)
        # the overheads show at small sizes; above, the exchange curve decides
        model.fit([(c, a, s, n, t) for c in times for a in times[c]
                   for s, t in times[c][a].items() if s <= FIT_MAX], ppn, itemsize)
    selection, segments = {}, {}
    eff, chosen, fastest = choose_segments(times, seg, default_key)
    for c in collectives:
        if n > 1:
            selection[c] = size_ranges(c, winners(eff[c], fastest[c]), model, n, ppn, itemsize)
            rows = {a: segment_rows(pts, default_key) for a, pts in chosen.get(c, {}).items()}
            rows = {a: r for a, r in rows.items() if r}
            if rows:
                segments[c] = rows
        else:  # one rank: nothing moves, every algorithm is a copy
            selection[c] = [[None, "ring"]]
    entry = {
        "source": "measured",
        "ranks": [n, n], "nodes": [lay["nodes"], lay["nodes"]],
        "measured": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "ranks": n, "nodes": lay["nodes"],
            "ranks_per_node": lay["ranks_per_node"],
            "command": "python -m mpicoll.tune " + " ".join(argv if argv is not None else sys.argv[1:]),
            "sweep": "quick" if args.quick else "full", "dtype": args.datatype, "op": "sum",
            "api": "comm", "seconds": round(seconds, 1),
            "phase_seconds": {k: round(v, 1) for k, v in phases.items()}, "mpicoll": mpicoll.__version__,
            "mpi4py": _bench.mpi4py_version(), "numpy": np.__version__,
            "python": platform.python_version(),
            "timing": "mpicoll.tools.bench: median over calls of the slowest rank, interleaved "
                      "with the built-in, results checked",
        },
        "selection": selection,
        "segments": segments,
        "p2p": p2p,
        # across nodes: the piece "auto" cuts messages to other nodes into (engine.context)
        **({"node_piece_bytes": piece,
            "node_piece_us": {str(k): round(v * 1e6, 1) for k, v in piece_times.items()}}
           if piece is not None else {}),
        "model": model.to_json() if model else None,
        "times_us": {c: {a: {str(s): round(t * 1e6, 3) for s, t in sorted(times[c][a].items())}
                         for a in times[c]} for c in times},
        "builtin_us": {c: {str(s): round(t * 1e6, 3) for s, t in sorted(builtin[c].items())}
                       for c in builtin},
        # segment size and window variants: {collective: {algorithm: {bytes: {"seg:win": us}}}};
        # "seg_default": the options' variant (the one times_us holds)
        "seg_default": default_key,
        "segment_us": {c: {a: {str(nb): {k: round(t * 1e6, 3) for k, t in v.items()}
                               for nb, v in sorted(pts.items())} for a, pts in per.items()}
                       for c, per in seg.items() if per},
    }
    data, note = merge(path, ident, entry)
    write(path, data)
    _report(out, path, note, ident, lay, entry, times, builtin, model, ppn, itemsize)
    return 0


def _report(out, path, note, ident, lay, entry, times, builtin, model, ppn, itemsize):
    w = out.write
    m = entry["measured"]
    w(f"# mpicoll.tune: {ident['library']} {ident['version']}, {lay['ranks']} ranks on "
      f"{lay['nodes']} node(s), {m['sweep']} sweep, {m['seconds']:.1f} s ("
      + ", ".join(f"{k} {v:.1f} s" for k, v in m["phase_seconds"].items()) + ")\n")
    for level, c in entry["p2p"].items():
        cl = ", ".join(f"{x['below']}-{x['above']} B ({x['us_below']:.2f} -> {x['us_above']:.2f} us)"
                       for x in c["cliffs"]) or "none"
        i8 = c["bytes"].index(8)
        w(f"# p2p {level} (rank 0 <-> {c['peer']}): 8 B exchange {c['us'][i8]:.2f} us, "
          f"{_bench.human(c['bytes'][-1])} {c['us'][-1]:.0f} us; cliffs: {cl}\n")
    if "node_piece_bytes" in entry:
        w(f"# pieces to another node: {_bench.human(entry['node_piece_bytes'])} ("
          + ", ".join(f"{_bench.human(int(k))} {v:.0f} us" for k, v in entry["node_piece_us"].items())
          + f" per {_bench.human(NODE_PIECE_BYTES)} exchange back to back; MPICOLL_NODE_PIECE_BYTES "
          f"overrides)\n")
    if model is not None:
        w(f"# model: reduce {1 / model.reduce_s_per_byte / 1e9:.2f} GB/s, per call "
          f"{model.call_s * 1e6:.2f} us, per schedule op {model.op_s * 1e6:.3f} us\n")
    rule = {(r["collective"], r["bytes"]): r for r in rule_rows(entry)}
    for c, rows in entry["selection"].items():
        parts = [f"<= {_bench.human(lim)}: {a}" if lim is not None else f"above: {a}"
                 for lim, a in rows]
        w(f"# {c}: {'; '.join(parts)}\n")
        for a, srows in entry["segments"].get(c, {}).items():
            parts = [f"{'<= ' + _bench.human(lim) if lim is not None else 'above'}: "
                     f"{_bench.human(sg) + ' x ' + str(win) if sg else 'the options'}"
                     for lim, sg, win in srows]
            w(f"# {c} {a} segment x window: {'; '.join(parts)}\n")
        if c not in times:
            continue
        algos = list(times[c])
        w(f"#{'size (B)':>11} " + " ".join(f"{a[:18]:>18}" for a in algos)
          + f" {'built-in':>9}  {'chosen':>28} {'/fastest':>8} {'model':>8}\n")
        for s in sorted(builtin[c]):
            r = rule[(c, s)]
            name = r["chosen"].split()[0]
            pred = model.predict(c, name, s, lay["ranks"], ppn, itemsize) * 1e6 if model else float("nan")
            ratio = f"{r['ratio']:8.3f}" if r["ratio"] is not None else f"{'-':>8}"
            w(f" {s:>11} " + " ".join(f"{times[c][a][s] * 1e6:>18.2f}" if s in times[c][a]
                                      else f"{'-':>18}" for a in algos)
              + f" {builtin[c][s] * 1e6:>9.2f}  {r['chosen'][:28]:>28} {ratio} {pred:>8.2f}\n")
    kept = sum(rule_holds(r) for r in rule.values())
    w(f"# the 5 % rule: the chosen algorithm within 5 % of the fastest measured at {kept} of "
      f"{len(rule)} sizes (python -m mpicoll.tune --check FILE prints them)\n")
    w(f"# wrote {path} ({note}); algorithm='auto' reads it "
      f"{'(the default file)' if path == _tuning.default_path(ident) else 'with MPICOLL_TUNING=' + path}\n")
    out.flush()


if __name__ == "__main__":
    sys.exit(main())
