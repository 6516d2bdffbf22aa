"""Measuring: the layout, the point-to-point curve, the pieces to other nodes, the local
reduction rate, every algorithm at every size, and the segment/window variants.

Every timing goes through :mod:`mpicoll.tools.harness` (the slowest rank's
median, interleaved with MPI's built-in) and every collective's output is
checked against the exact values (:func:`~mpicoll.tools.harness.workload.check_case`).
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from ...core import config as _config
from ...engine import context as _context
from ...engine import select as _select
from ...transport import channel as _channel
from ...transport import topology as _topology
from ..harness import cli as _cli
from ..harness.timing import Variant, time_variants
from ..harness.workload import Case, HostDevice, check_case
from . import policy as P

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


def algorithms_of(collective: str, labels) -> list[str]:
    """The algorithms worth measuring on this layout: the hierarchical one only where the
    ranks span nodes with more than one rank on some (elsewhere "auto" never runs it)."""
    names = list(_select.ALGORITHMS[collective])
    if not _select.spans_nodes(labels):
        names = [a for a in names if a != "hierarchical"]
    return names


# --- the point-to-point curve --------------------------------------------------------

def exchange_time(comm, peer, nbytes, warmup, iters, local: bool = False,
                  node_bytes: int | None = None, batch: int = 1) -> float:
    """Seconds of one exchange of ``nbytes`` each way between rank 0 and ``peer`` (others
    idle), sent as mpicoll's channel sends it to a peer of this node (``local``) or of
    another (in its pieces, transport.channel; ``node_bytes``: those to another node,
    default the communicator's): the curve prices the algorithms' messages.  ``batch``
    exchanges after each barrier (1: each alone: back to back, exchanges on TCP links
    queue behind each other and take up to twice the line's time, while an algorithm's
    steps inside a call move at the line's speed)."""
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
    t = time_variants(comm, {"x": Variant(call)}, warmup=warmup, samples=iters,
                      batch=max(1, min(batch, iters)))["x"]
    if other is not None and nbytes and int(recv[0]) != other % 251:
        raise RuntimeError(f"exchange of {nbytes} B with rank {other}: wrong data received")
    return t


def node_piece(comm, peer, warmup) -> tuple[int, dict]:
    """(piece, {piece: seconds}): the largest of :data:`~policy.NODE_PIECES` whose
    exchanges back to back (a collective's steps follow each other so) are within
    :data:`~policy.CLOSE` of the fastest's (policy.NODE_PIECE_*).  Every rank gets the
    same answer (the times are the slowest rank's)."""
    iters = P.NODE_PIECE_ITERS
    times = {piece: max(exchange_time(comm, peer, P.NODE_PIECE_BYTES, warmup, iters,
                                      node_bytes=piece, batch=iters)
                        for _ in range(P.NODE_PIECE_ROUNDS)) for piece in P.NODE_PIECES}
    best = min(times.values())
    return max(p for p, t in times.items() if t <= P.CLOSE * best), times


def _is_cliff(t_lo, t_hi, slope_below, lo, hi) -> bool:
    """A jump well above what the slope below the pair predicts (policy.CLIFF_*)."""
    predicted = t_lo + slope_below * (hi - lo)
    return t_hi > P.CLIFF_RATIO * t_lo and t_hi - predicted > P.CLIFF_EXCESS * t_lo


def p2p_curve(comm, peer, sweep, progress, level) -> dict:
    """{"bytes": [...], "us": [...], "cliffs": [{"below", "above", "us_below", "us_above"}]}."""
    sizes = _cli.sizes(8, sweep["p2p_max"], 2.0)
    pts = {}

    def point(s):
        t = exchange_time(comm, peer, s, sweep["warmup"], P.p2p_iters_at(sweep["iters"], s),
                          level == "intra")
        pts[s] = min(t, pts.get(s, t))
        return pts[s]

    for k in range(sweep["passes"]):
        for s in (sizes if k % 2 == 0 else sizes[::-1]):
            point(s)
            progress.step(f"p2p {level} {_cli.human(s)}")
    cliffs = []
    for i in range(1, len(sizes)):
        lo, hi = sizes[i - 1], sizes[i]
        below = (pts[lo] - pts[sizes[i - 2]]) / (lo - sizes[i - 2]) if i >= 2 else 0.0
        if hi > P.CLIFF_MAX or not _is_cliff(pts[lo], pts[hi], max(below, 0.0), lo, hi):
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
    """Seconds per byte of np.add(a, b, out=c) on float64 (this rank alone, warm memory: the
    harness on ``MPI.COMM_SELF``, median of 20)."""
    a = np.ones(nbytes // 8)
    b = np.ones(nbytes // 8)
    c = np.zeros(nbytes // 8)  # written once: no first-touch page faults in the timing
    t = time_variants(MPI.COMM_SELF, {"add": Variant(lambda: np.add(a, b, out=c))},
                      warmup=1, samples=20)
    return t["add"] / nbytes


# --- the collectives -----------------------------------------------------------------

def collective_sizes(args, sweep, nranks, itemsize) -> tuple[list[int], list[int]]:
    """(sizes measured, candidates): the sweep's sizes, and the sizes half a step between
    them (1 KiB to 1 MiB, full sweep, default steps) measured only where the fastest
    algorithm changes between their neighbours (:func:`measure_collectives`)."""
    lo, hi, factor = sweep["coll"]
    lo = args.minbytes or lo
    hi = args.maxbytes or hi
    factor = args.stepfactor or factor
    sizes = set(_cli.sizes(lo, hi, factor)) | {s for s in sweep["extra"] if lo <= s <= hi}
    half = set()
    if sweep.get("half_steps") and args.stepfactor is None and factor >= 2 and not args.minbytes:
        # the medium sizes, where the crossovers and cliffs sit
        half = {int(s * 1.5) for s in _cli.sizes(1024, min(hi, 1 << 20), 2.0)
                if int(s * 1.5) <= hi}
    unit = itemsize * nranks  # a whole number of elements per rank for every collective

    def whole(values):
        return {max(unit, s // unit * unit) for s in values}

    measured = whole(sizes)
    return sorted(measured), sorted(whole(half) - measured)


def time_size(comm, device, collective, variants: dict, nbytes, dtype, iters, warmup):
    """({key: seconds}, built-in seconds, wrong elements) of one size: every variant
    (key -> (algorithm, communicator)) in its own loop with the built-in (the harness),
    then its output checked; the built-in keeps its fastest.

    One loop of several variants would evict each other's buffers from the cache
    between batches and penalise the cache-sensitive algorithms.
    """
    out, builtin, wrong = {}, math.inf, 0
    batch = max(1, min(5, iters))
    for key, (algorithm, vcomm) in variants.items():
        case = Case(vcomm, device, collective, algorithm, nbytes, dtype, "sum")
        t = time_variants(comm, {"mpicoll": case.variants["mpicoll"],
                                 "builtin": case.variants["builtin"]},
                          warmup=warmup, samples=iters, batch=batch,
                          min_samples=max(batch, iters // 4), spread=P.SPREAD)
        out[key], builtin = t["mpicoll"], min(builtin, t["builtin"])
        w = check_case(comm, case, in_place=False)
        wrong += w["mpicoll"] + w["builtin"]
        del case
    return out, builtin, wrong


def measure_collectives(comm, collectives, sizes, dtype, sweep, iters_override, progress,
                        algos=None, half=()):
    """{collective: {algorithm: {bytes: seconds}}}, {collective: {bytes: built-in seconds}}, wrong.

    Every algorithm of a size is timed in its own loop with the built-in
    (:func:`time_size`).  The first pass measures every algorithm at every size; the later passes
    (alternating the order of sizes: on a shared machine load only adds time,
    so each point keeps its fastest) measure again only the algorithms within
    :data:`~policy.WIDE` of the fastest at that size, and skip a size where one
    algorithm is left: a loser by that margin cannot come within 5 % of the
    winner, and a clear winner is not in doubt.

    In the second pass a size of ``half`` (half a step between two measured
    sizes) is measured, every algorithm, where the fastest algorithm differs
    between its two neighbours: the crossovers get the finer steps, the rest
    of the range not.
    """
    times, builtin, wrong = {}, {}, 0
    device = HostDevice()
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
                if k == 0 and nbytes >= P.SEG_MIN and len(done) >= 2:
                    run = [a for a in names if not losing(times[collective], a, done[-2:])]
                elif k > 0 and any(nbytes in t for t in times[collective].values()):
                    tc = times[collective]
                    best = min(tc[a][nbytes] for a in names if nbytes in tc[a])
                    run = [a for a in names if tc[a].get(nbytes, math.inf) <= P.WIDE * best]
                    if len(run) < 2:
                        progress.step(f"{collective} {_cli.human(nbytes)}: clear", len(names))
                        continue
                done.append(nbytes)
                t, tb, w = time_size(comm, device, collective, {a: (a, comm) for a in run},
                                     nbytes, dtype, P.iters_at(iters_override or sweep["iters"],
                                                               nbytes), sweep["warmup"])
                for a, seconds in t.items():
                    keep(times[collective][a], nbytes, seconds)
                keep(builtin[collective], nbytes, tb)
                wrong += w
                progress.step(f"{collective} {len(run)} algorithms {_cli.human(nbytes)}",
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
    """Whether ``name`` was more than :data:`~policy.LOSING` times the fastest at both
    sizes ``below`` (the two measured last, ascending, from :data:`~policy.SEG_MIN` up):
    it is then not measured at the larger sizes."""
    for nb in below:
        t = per_algo[name].get(nb)
        best = min(x[nb] for x in per_algo.values() if nb in x)
        if nb < P.SEG_MIN or t is None or t <= P.LOSING * best:
            return False
    return True


def seg_key(segment: int, window: int) -> str:
    """``"262144:4"``: a segment size and window as the tuning file's key."""
    return f"{segment}:{window}"


def measure_segments(comm, collectives, times, sizes, dtype, sweep, iters_override, progress):
    """{collective: {algorithm: {bytes: {seg_key: seconds}}}}, the default key, wrong.

    At the sizes from :data:`~policy.SEG_MIN` up (the doubling ones), every
    algorithm within :data:`~policy.SEG_WIDE` of the fastest there is timed at
    the segment sizes of the sweep (with the options' window), the options'
    values among them, then at the windows of the sweep not yet measured with
    the fastest segment size: a coordinate search, half the calls of the whole
    grid.  Each variant runs on a duplicate communicator whose context was
    made with those options (as a user's would be).  ``times`` (the options'
    variant) keeps its fastest.
    """
    base = dict(_config.read_environment())
    default = (base["segment_bytes"], base["window"])
    comms, seg, wrong = {}, {c: {} for c in collectives}, 0
    device = HostDevice()
    tuned = []
    for nb in sorted(sizes):
        if nb >= P.SEG_MIN and (not tuned or nb >= P.SEG_STEP * tuned[-1]):
            tuned.append(nb)
    todo = []
    for c in collectives:
        for nb in tuned:
            best = min(t[nb] for t in times[c].values() if nb in t)
            todo += [(c, nb, a) for a in times[c]
                     if nb in times[c][a] and times[c][a][nb] <= P.SEG_WIDE * best]
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
        iters, warmup = P.segment_iters_at(iters_override or sweep["iters"], sweep["warmup"], nb)
        t, _, w = time_size(comm, device, c, {sw: (a, comm_of(sw)) for sw in variants}, nb,
                            dtype, iters, warmup)
        wrong += w
        got = seg[c].setdefault(a, {}).setdefault(nb, {})
        for sw, x in t.items():
            key = seg_key(*sw)
            got[key] = min(x, got.get(key, x))
        if default in t:
            times[c][a][nb] = min(times[c][a][nb], t[default])
        progress.step(f"{c} {a} {_cli.human(nb)}: {len(variants)} segment/window", 0)
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
