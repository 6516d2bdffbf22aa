"""Measure this MPI and machine, and write the selection ``algorithm="auto"`` uses.

Usage (every rank runs it; rank 0 prints and writes)::

    mpirun -n 2 python -m mpicoll.tune --quick      # coarse sweep (seconds)
    mpirun -n 2 python -m mpicoll.tune              # the default sweep (a minute or two)
    srun -N 4 --ntasks-per-node 8 python -m mpicoll.tune -o tuning.json
    python -m mpicoll.tune --predict 1024           # predicted crossovers at 1024 ranks

What it measures, in one run on the communicator's layout (ranks, nodes):

1. the point-to-point cost curve: one ``Sendrecv`` exchange between rank 0
   and a rank on its node (``intra``) and, across nodes, the first rank of
   another node (``inter``), from 8 B up, doubling; where the time jumps
   (a protocol cliff such as an eager limit) probes bisect the jump to a
   few tens of bytes;
2. every algorithm of every collective at each size, timed and checked by
   the benchmark's own loop (:func:`mpicoll.tools.bench.measure`: median
   of the slowest rank, interleaved with the built-in, results checked
   against the exact values), and the rate of a local reduction;
3. the cost model (:mod:`mpicoll.tools.costmodel`) fitted to both.

The fastest algorithm per size becomes a list of size ranges: at every size
an algorithm within 5 % of the fastest measured, with the fewest switches
(noise between near-equal algorithms does not split a range); the boundary
between two measured sizes is where the model's curves cross.  The tuning
file (format: :mod:`mpicoll.engine.tuning`)
is keyed by the MPI library and version, holds one entry per layout (a new
run replaces the entry of its own layout and keeps the others), and records
when, where and how it was measured.  By default it is the default file of
this MPI library in the user's cache directory, which "auto" then reads;
``-o`` writes elsewhere (``MPICOLL_TUNING=path`` to use it).  The exit
status is 1 if any result was wrong (no file is written then).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicoll

from ..engine import select as _select
from ..engine import tuning as _tuning
from ..transport import topology as _topology
from . import bench as _bench
from . import costmodel as _costmodel

# the sweeps: sizes (bytes) of the exchange curve and of the collectives, timed calls
# (passes: every point is measured that many times, in alternating order, and keeps its
# fastest median: on a shared machine load only ever adds time)
SWEEPS = {
    "quick": {"p2p_max": 4 << 20, "coll": (256, 4 << 20, 4.0), "extra": (2048, 4096, 8192),
              "iters": 20, "warmup": 3, "bisect": 64, "passes": 2},
    "full": {"p2p_max": 16 << 20, "coll": (8, 16 << 20, 2.0), "extra": (),
             "iters": 40, "warmup": 5, "bisect": 16, "passes": 2},
}
FIT_MAX = 64 << 10  # the model's overheads are fitted to the sizes up to this
CLOSE = 1.05  # a winner by less than this keeps its neighbours' algorithm


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
    p.add_argument("--predict", metavar="RANKS", type=_bench.positive_int_arg,
                   help="print the crossovers the model predicts at RANKS ranks (same ranks per "
                        "node as measured), from the tuning file (--file, MPICOLL_TUNING or the "
                        "default); measures nothing")
    p.add_argument("--file", metavar="PATH", help="with --predict: the tuning file to read")
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

def _time(comm, call, warmup, iters) -> float:
    """Median seconds of ``call`` (slowest rank): the benchmark's loop."""
    return _bench.time_variants(comm, {"x": (call, contextlib.nullcontext)}, warmup, iters,
                                max(1, min(5, iters)))["x"]


def exchange_time(comm, peer, nbytes, warmup, iters) -> float:
    """Seconds of one Sendrecv of ``nbytes`` between rank 0 and ``peer`` (others idle)."""
    rank = comm.Get_rank()
    send = np.full(max(nbytes, 1), rank % 251, dtype=np.uint8)[:nbytes]
    recv = np.empty(max(nbytes, 1), dtype=np.uint8)[:nbytes]
    other = peer if rank == 0 else 0 if rank == peer else None
    if other is None:
        def call():
            pass
    else:
        def call():
            comm.Sendrecv(send, other, 7, recv, other, 7)
    t = _time(comm, call, warmup, iters)
    if other is not None and nbytes and int(recv[0]) != other % 251:
        raise RuntimeError(f"exchange of {nbytes} B with rank {other}: wrong data received")
    return t


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
        t = exchange_time(comm, peer, s, sweep["warmup"], iters)
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


def collective_sizes(args, sweep, nranks, itemsize) -> list[int]:
    lo, hi, factor = sweep["coll"]
    lo = args.minbytes or lo
    hi = args.maxbytes or hi
    factor = args.stepfactor or factor
    sizes = set(_bench.sizes(lo, hi, factor)) | {s for s in sweep["extra"] if lo <= s <= hi}
    if args.stepfactor is None and factor >= 2 and not args.minbytes:
        # the medium sizes, where the crossovers and cliffs sit, at half steps
        sizes |= {int(s * 1.5) for s in _bench.sizes(1024, min(hi, 1 << 20), 2.0)
                  if int(s * 1.5) <= hi and sweep is SWEEPS["full"]}
    unit = itemsize * nranks  # a whole number of elements per rank for every collective
    return sorted({max(unit, s // unit * unit) for s in sizes})


def measure_collectives(comm, collectives, sizes, dtype, sweep, iters_override, progress):
    """{collective: {algorithm: {bytes: seconds}}}, {collective: {bytes: built-in seconds}}, wrong."""
    times, builtin, wrong = {}, {}, 0
    device = _bench.HostDevice()

    def keep(table, key, seconds):
        table[key] = min(seconds, table.get(key, seconds))

    for k in range(sweep["passes"]):
        for collective in collectives:
            times.setdefault(collective, {a: {} for a in _select.ALGORITHMS[collective]})
            builtin.setdefault(collective, {})
            for nbytes in (sizes if k % 2 == 0 else sizes[::-1]):
                base = iters_override or sweep["iters"]
                iters = base if nbytes < (1 << 20) else max(3, base // (4 if nbytes < (8 << 20) else 8))
                args = _bench_args(dtype, iters, sweep["warmup"])
                for algorithm in _select.ALGORITHMS[collective]:
                    case = _bench.Case(comm, device, collective, algorithm, nbytes, args)
                    rec = _bench.measure(comm, case, device, args, {})
                    del case
                    keep(times[collective][algorithm], rec["bytes"], rec["time_us"] * 1e-6)
                    keep(builtin[collective], rec["bytes"], rec["builtin_time_us"] * 1e-6)
                    wrong += (rec["wrong"] or 0) + (rec["builtin_wrong"] or 0)
                    progress.step(f"{collective} {algorithm} {_bench.human(rec['bytes'])}")
    return times, builtin, wrong


# --- from times to size ranges -----------------------------------------------------

def winners(per_algo: dict) -> list[tuple[int, str]]:
    """[(size, algorithm)]: at every size an algorithm within 5 % of the fastest, with the
    fewest switches between sizes (noise between near-equal algorithms does not split a
    range); among equal choices the faster.
    """
    sizes = sorted(set.intersection(*(set(t) for t in per_algo.values())))
    algos = list(per_algo)
    # cost[a]: (switches, summed time relative to the best) of the best path ending in a
    cost, back = {}, []
    for i, s in enumerate(sizes):
        best = min(per_algo[a][s] for a in algos)
        near = [a for a in algos if per_algo[a][s] <= CLOSE * best]
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


# --- the file ------------------------------------------------------------------------

def merge(path: str, ident: dict, entry: dict) -> tuple[dict, str]:
    """The file's content with ``entry`` replacing the measured entry of its layout; a note."""
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
                kept = [e for e in old["entries"]
                        if not (e.get("ranks") == entry["ranks"] and e.get("nodes") == entry["nodes"])]
                data["entries"] = kept
                note = f"kept {len(kept)} entr{'y' if len(kept) == 1 else 'ies'} of other layouts"
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

def predict_main(args, out) -> int:
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
    ppn = max(1, int(m.get("ranks_per_node", [m.get("ranks", 1)])[-1]))
    n = args.predict
    nodes = -(-n // ppn)
    itemsize = np.dtype(m.get("dtype", "float64")).itemsize
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
    out.flush()
    return 0


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
    if args.predict is not None:
        return predict_main(args, out) if (comm or MPI.COMM_WORLD).Get_rank() == 0 else 0
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
    csizes = collective_sizes(args, sweep, n, itemsize)
    peers = pairs(lay["labels"]) if n > 1 else {}
    npts = len(_bench.sizes(8, sweep["p2p_max"], 2.0)) * len(peers)
    ncoll = sum(len(_select.ALGORITHMS[c]) for c in collectives) * len(csizes) if n > 1 else 0
    progress = Progress(sweep["passes"] * (npts + ncoll), args.quiet or not root)

    p2p = {level: p2p_curve(comm, peer, sweep, progress, level) for level, peer in peers.items()}
    rate = comm.allreduce(reduce_rate(), op=MPI.MAX)
    if n > 1:
        times, builtin, wrong = measure_collectives(comm, collectives, csizes, args.datatype, sweep,
                                                    args.iters, progress)
    else:
        times, builtin, wrong = {}, {}, 0
    progress.end()
    seconds = time.perf_counter() - t_start
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
    selection = {}
    for c in collectives:
        if n > 1:
            selection[c] = size_ranges(c, winners(times[c]), model, n, ppn, itemsize)
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
            "api": "comm", "seconds": round(seconds, 1), "mpicoll": mpicoll.__version__,
            "mpi4py": _bench.mpi4py_version(), "numpy": np.__version__,
            "python": platform.python_version(),
            "timing": "mpicoll.tools.bench: median over calls of the slowest rank, interleaved "
                      "with the built-in, results checked",
        },
        "selection": selection,
        "p2p": p2p,
        "model": model.to_json() if model else None,
        "times_us": {c: {a: {str(s): round(t * 1e6, 3) for s, t in sorted(times[c][a].items())}
                         for a in times[c]} for c in times},
        "builtin_us": {c: {str(s): round(t * 1e6, 3) for s, t in sorted(builtin[c].items())}
                       for c in builtin},
    }
    data, note = merge(path, ident, entry)
    write(path, data)
    _report(out, path, note, ident, lay, entry, times, builtin, model, ppn, itemsize)
    return 0


def _report(out, path, note, ident, lay, entry, times, builtin, model, ppn, itemsize):
    w = out.write
    m = entry["measured"]
    w(f"# mpicoll.tune: {ident['library']} {ident['version']}, {lay['ranks']} ranks on "
      f"{lay['nodes']} node(s), {m['sweep']} sweep, {m['seconds']:.1f} s\n")
    for level, c in entry["p2p"].items():
        cl = ", ".join(f"{x['below']}-{x['above']} B ({x['us_below']:.2f} -> {x['us_above']:.2f} us)"
                       for x in c["cliffs"]) or "none"
        i8 = c["bytes"].index(8)
        w(f"# p2p {level} (rank 0 <-> {c['peer']}): 8 B exchange {c['us'][i8]:.2f} us, "
          f"{_bench.human(c['bytes'][-1])} {c['us'][-1]:.0f} us; cliffs: {cl}\n")
    if model is not None:
        w(f"# model: reduce {1 / model.reduce_s_per_byte / 1e9:.2f} GB/s, per call "
          f"{model.call_s * 1e6:.2f} us, per schedule op {model.op_s * 1e6:.3f} us\n")
    for c, rows in entry["selection"].items():
        parts = [f"<= {_bench.human(lim)}: {a}" if lim is not None else f"above: {a}"
                 for lim, a in rows]
        w(f"# {c}: {'; '.join(parts)}\n")
        if c not in times:
            continue
        algos = list(times[c])
        w(f"#{'size (B)':>11} " + " ".join(f"{a[:18]:>18}" for a in algos)
          + f" {'built-in':>9}  {'chosen':>18} {'model':>8}\n")
        for s in sorted(builtin[c]):
            chosen = _select.Selection({c: tuple(tuple(r) for r in rows)}, "").rows[c]
            name = next(a for lim, a in chosen if lim is None or s <= lim)
            pred = model.predict(c, name, s, lay["ranks"], ppn, itemsize) * 1e6 if model else float("nan")
            w(f" {s:>11} " + " ".join(f"{times[c][a][s] * 1e6:>18.2f}" for a in algos)
              + f" {builtin[c][s] * 1e6:>9.2f}  {name:>18} {pred:>8.2f}\n")
    w(f"# wrote {path} ({note}); algorithm='auto' reads it "
      f"{'(the default file)' if path == _tuning.default_path(ident) else 'with MPICOLL_TUNING=' + path}\n")
    out.flush()


if __name__ == "__main__":
    sys.exit(main())
