"""The command line: measure and write the tuning file, ``--predict``, ``--check``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import mpi4py
import numpy as np
from mpi4py import MPI

import mpicoll

from ...core import config as _config
from ...engine import context as _context
from ...engine import select as _select
from ...engine import tuning as _tuning
from .. import costmodel as _costmodel
from ..harness import cli as _cli
from ..harness.workload import DTYPES
from . import choose, measure
from . import policy as P

PROG = "mpicoll.tune"


def rank_list(text: str) -> list[int]:
    """``"64"`` or ``"4,8,16"``: the rank counts of ``--predict``."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected rank counts such as 64 or 4,8,16, got {text!r}")
    return sorted(set(values))


def build_parser():
    p = _cli.Parser(
        prog="python -m mpicoll.tune",
        description="Measure the point-to-point cost curve and every algorithm, and write the "
                    "tuning file that algorithm='auto' reads (run under mpirun/srun).")
    p.add_argument("--quick", action="store_true", help="a coarse sweep (seconds)")
    p.add_argument("-o", "--output", metavar="PATH",
                   help="tuning file to write (default: this MPI library's file in the user's "
                        "cache directory, which auto reads)")
    p.add_argument("-C", "--collective", default="all",
                   help="comma-separated allreduce, reduce_scatter, allgather, or all (default)")
    p.add_argument("-d", "--datatype", default="float64", choices=sorted(DTYPES),
                   help="element type measured (default: float64)")
    p.add_argument("-b", "--minbytes", type=_cli.size_arg, help="smallest collective size")
    p.add_argument("-e", "--maxbytes", type=_cli.size_arg, help="largest collective size")
    p.add_argument("-f", "--stepfactor", type=_cli.factor_arg, help="size factor between steps")
    p.add_argument("-n", "--iters", type=_cli.positive_int, help="timed calls per size")
    p.add_argument("--p2p-max", type=_cli.size_arg, help="largest exchange of the p2p curve")
    p.add_argument("--predict", metavar="RANKS", type=rank_list,
                   help="print the crossovers the model predicts at RANKS ranks (one count or "
                        "several: 4,8,16; same ranks per node as measured), from the tuning file "
                        "(--file, MPICOLL_TUNING or the default); measures nothing. With -o: "
                        "also write them to that file as predicted entries (source \"model\"), "
                        "which auto uses where no measured entry fits")
    p.add_argument("--file", metavar="PATH", help="with --predict: the tuning file to read")
    p.add_argument("--ranks-per-node", type=_cli.positive_int, metavar="K",
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
    """Write a tuning file (a temporary file renamed into place: a reader sees the old file
    or the new one); :class:`~mpicoll.tools.harness.cli.ToolError` if it cannot."""
    try:
        # (private: mpicoll reads a tuning file only from folders no other user can write,
        # core.paths.read_trusted)
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    except OSError as exc:
        raise _cli.ToolError(f"cannot write {path}: {exc.strerror or exc}") from None

    def dump(f):
        json.dump(data, f, indent=1)
        f.write("\n")
    _cli.write_file(path, dump)


def _read(path: str | None):
    """The tuning file at ``path`` (None: MPICOLL_TUNING or the default file)."""
    algos = {c: tuple(t) for c, t in _select.ALGORITHMS.items()}
    try:
        if path:
            return _tuning.read(path, algos)
        tf, note = _tuning.find(algos)
    except (OSError, ValueError) as exc:
        raise _cli.ToolError(f"cannot read the tuning file: {exc}") from None
    if tf is None:
        raise _cli.ToolError(f"no tuning file ({note}); run python -m mpicoll.tune first")
    return tf


# --- --check -------------------------------------------------------------------------

def check_main(path, out) -> int:
    """``--check FILE``: the 5 % rule for every measured entry; 1 if a size breaks it."""
    tf = _read(path)
    measured = [e for e in tf.entries if e.source == "measured" and e.raw.get("times_us")]
    if not measured:
        raise _cli.ToolError(f"{path}: no measured entry with times (a tuning at 1 rank "
                             f"times no algorithm)")
    bad = 0
    for e in measured:
        bad += choose.write_rule(out, choose.rule_rows(e.raw), f"# {path}: {e.describe()}\n")
    out.flush()
    return 1 if bad else 0


# --- --predict -------------------------------------------------------------------------

def predict_main(args, out, argv=None) -> int:
    tf = _read(args.file)
    # the model needs an exchange curve: a tuning at 1 rank measured none (its p2p is {})
    measured = [e for e in tf.entries if e.source == "measured" and e.raw.get("p2p")]
    if not measured:
        raise _cli.ToolError(f"{tf.path}: no measured entry with an exchange curve to fit the "
                             f"model to (a tuning at 1 rank exchanges no message); tune at 2 "
                             f"ranks or more first")
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
            new.append(choose.predicted_entry(model, entry, n, min(ppn, n), itemsize, command))
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
    sizes = _cli.sizes(8 * n * itemsize if n > 1 else 8, 64 << 20, 2.0)
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
                ranges.append(f"{best} from {_cli.human(nbytes)}")
                prev = best
        out.write(f"# {collective} crossovers: {'; '.join(ranges)}\n")


# --- main -----------------------------------------------------------------------------

def _check_args(comm, parser, args):
    if args.collective == "all":
        args.collectives = list(_tuning.COLLECTIVES)
    else:
        args.collectives = [c.strip() for c in args.collective.split(",") if c.strip()]
        bad = [c for c in args.collectives if c not in _tuning.COLLECTIVES]
        if bad or not args.collectives:
            parser.error(f"-C/--collective: expected allreduce, reduce_scatter, allgather or all, "
                         f"got {args.collective!r}")
    if args.predict is None:
        for option, value in (("--file", args.file), ("--ranks-per-node", args.ranks_per_node)):
            if value is not None:
                parser.error(f"{option}: only with --predict")
    if args.check is None:  # (--predict -o: rank 0 writes; the measurement: rank 0 writes)
        _cli.check_outputs(comm, parser, {"-o/--output": args.output}, make_dirs=True)


@_cli.tool(PROG)
def main(argv=None, *, comm=None, out=None) -> int:
    """Run the tuning; returns the exit status (1 if a result was wrong, nothing written)."""
    out = sys.stdout if out is None else out
    comm = MPI.COMM_WORLD if comm is None else comm
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(comm, parser, args)
    if args.check is not None:
        return check_main(args.check, out) if comm.Get_rank() == 0 else 0
    if args.predict is not None:
        return predict_main(args, out, argv) if comm.Get_rank() == 0 else 0
    return tune_main(comm, args, out, argv)


def tune_main(comm, args, out, argv) -> int:
    """Measure, choose and write the tuning file."""
    root = comm.Get_rank() == 0
    t_start = time.perf_counter()
    sweep = dict(P.SWEEPS["quick" if args.quick else "full"])
    if args.p2p_max:
        sweep["p2p_max"] = args.p2p_max
    ident = _tuning.mpi_identity()
    path = args.output or _tuning.default_path(ident)
    path = comm.bcast(path, root=0)
    lay = measure.layout(comm)
    n = lay["ranks"]
    collectives = args.collectives
    dtype = np.dtype(DTYPES[args.datatype])
    itemsize = dtype.itemsize
    csizes, half = measure.collective_sizes(args, sweep, n, itemsize)
    peers = measure.pairs(lay["labels"]) if n > 1 else {}
    algos = {c: measure.algorithms_of(c, lay["labels"]) for c in collectives}
    npts = len(_cli.sizes(8, sweep["p2p_max"], 2.0)) * len(peers)
    ncoll = sum(len(algos[c]) for c in collectives) * len(csizes) if n > 1 else 0
    progress = _cli.Progress(PROG, sweep["passes"] * (npts + ncoll), args.quiet or not root)

    phases = {}  # seconds per phase (the report and the file say where the time went)
    p2p = {level: measure.p2p_curve(comm, peer, sweep, progress, level)
           for level, peer in peers.items()}
    piece, piece_times = None, {}
    if "inter" in peers:
        # measured before the algorithms, which then run with it, as "auto" will
        piece, piece_times = measure.node_piece(comm, peers["inter"], sweep["warmup"])
        _context.context(comm).node_piece = piece
    rate = comm.allreduce(measure.reduce_rate(), op=MPI.MAX)
    phases["p2p"] = time.perf_counter() - t_start
    seg, default_key = {}, measure.seg_key(_config.get("segment_bytes"), _config.get("window"))
    if n > 1:
        times, builtin, wrong = measure.measure_collectives(
            comm, collectives, csizes, dtype, sweep, args.iters, progress, algos, half)
        phases["algorithms"] = time.perf_counter() - t_start - sum(phases.values())
        if not args.no_segments:
            seg, default_key, w = measure.measure_segments(comm, collectives, times, csizes,
                                                           dtype, sweep, args.iters, progress)
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
        model.fit([(c, a, s, n, t) for c in times for a in times[c]
                   for s, t in times[c][a].items() if s <= P.FIT_MAX], ppn, itemsize)
    selection, segments = {}, {}
    eff, chosen, fastest = choose.choose_segments(times, seg, default_key)
    for c in collectives:
        if n > 1:
            selection[c] = choose.size_ranges(c, choose.winners(eff[c], fastest[c]), model, n,
                                              ppn, itemsize)
            rows = {a: choose.segment_rows(pts, default_key)
                    for a, pts in chosen.get(c, {}).items()}
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
            "mpi4py": mpi4py.__version__, "numpy": np.__version__,
            "python": platform.python_version(),
            "timing": "mpicoll.tools.harness: median over calls of the slowest rank, interleaved "
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
          f"{_cli.human(c['bytes'][-1])} {c['us'][-1]:.0f} us; cliffs: {cl}\n")
    if "node_piece_bytes" in entry:
        w(f"# pieces to another node: {_cli.human(entry['node_piece_bytes'])} ("
          + ", ".join(f"{_cli.human(int(k))} {v:.0f} us" for k, v in entry["node_piece_us"].items())
          + f" per {_cli.human(P.NODE_PIECE_BYTES)} exchange back to back; "
          f"MPICOLL_NODE_PIECE_BYTES overrides)\n")
    if model is not None:
        w(f"# model: reduce {1 / model.reduce_s_per_byte / 1e9:.2f} GB/s, per call "
          f"{model.call_s * 1e6:.2f} us, per schedule op {model.op_s * 1e6:.3f} us\n")
    rule = {(r["collective"], r["bytes"]): r for r in choose.rule_rows(entry)}
    for c, rows in entry["selection"].items():
        parts = [f"<= {_cli.human(lim)}: {a}" if lim is not None else f"above: {a}"
                 for lim, a in rows]
        w(f"# {c}: {'; '.join(parts)}\n")
        for a, srows in entry["segments"].get(c, {}).items():
            parts = [f"{'<= ' + _cli.human(lim) if lim is not None else 'above'}: "
                     f"{_cli.human(sg) + ' x ' + str(win) if sg else 'the options'}"
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
    kept = sum(choose.rule_holds(r) for r in rule.values())
    w(f"# the 5 % rule: the chosen algorithm within 5 % of the fastest measured at {kept} of "
      f"{len(rule)} sizes (python -m mpicoll.tune --check FILE prints them)\n")
    w(f"# wrote {path} ({note}); algorithm='auto' reads it "
      f"{'(the default file)' if path == _tuning.default_path(ident) else 'with MPICOLL_TUNING=' + path}\n")
    out.flush()
