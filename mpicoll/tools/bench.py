"""Benchmark mpicoll's collectives against MPI's built-ins, in the layout of nccl-tests.

Usage (every rank runs it; rank 0 prints)::

    mpirun -n 4 python -m mpicoll.bench -C allreduce -b 8 -e 64M -f 2 -d float32 -o sum
    mpirun -n 4 python -m mpicoll.bench --algorithm all -b 1K -e 1M --json out.json

For each collective, algorithm and size it times four variants in the same
run, on the same input (:mod:`mpicoll.tools.harness`): mpicoll out of place and
in place, and MPI's built-in out of place and in place (``MPI.IN_PLACE``, the
form torch and DDP use):

* warm-up: ``-w`` calls of each;
* timed: ``-n`` calls of each, in alternating batches of ``--batch`` calls,
  the order of the variants flipped every round, with a Barrier before every
  batch; each call is timed on every rank with ``MPI.Wtime`` and the call's
  time is that of the slowest rank;
* reported: the median over calls, algbw = size / time and busbw = algbw x
  the collective's factor (AllReduce 2(n-1)/n, AllGather and ReduceScatter
  (n-1)/n, as nccl-tests), and the time ratios mpicoll / built-in, out of
  place and in place (each form against MPI's same form);
* checked (``-c 1``): the inputs are small integers (exact in every type);
  each output is compared with the exact expected values by the one rule of
  :mod:`mpicoll.tools.results` (integers exactly, floating SUM/PROD within
  ``gamma(n-1) * sum|x|``); ``#wrong`` counts wrong elements over all ranks.

Sizes follow nccl-tests: ``size`` is the whole array in bytes (AllReduce:
each rank's array; AllGather: the gathered array; ReduceScatter: each rank's
input), rounded down to a whole number of elements per rank; ``count`` is
its number of elements.

``--device gpu`` runs on CuPy arrays (each rank binds a GPU with
``mpicoll.bind_device()``); the built-in then runs on host arrays and its time
includes the device-to-host copy of the input and the host-to-device copy of
the result that a user of MPI without CUDA support would need (pinned
buffers, synchronised).  ``--check-cost`` also times mpicoll with
``mpicoll.options(check=True)`` (the cross-rank agreement check) and reports
its overhead.  The exit status is 1 if any result is wrong.
"""

from __future__ import annotations

import math
import platform
import sys

import numpy as np
from mpi4py import MPI

import mpicoll

from ..core import types as _types
from ..engine import select as _select
from .harness import cli as _cli
from .harness import records as _records
from .harness import workload as _workload
from .harness.timing import Variant, time_variants
from .harness.workload import BUSBW_FACTOR, COLLECTIVES, DTYPES, OPS, Case

# The run's first size, when small, is warmed up with at least this many calls of each
# variant: a new process's first few hundred small calls run slow, and with fewer the
# run's first cell often took twice the next size's time (docs/performance.md, "How the tools measure").
FIRST_WARMUP = 100
FIRST_WARMUP_MAX_BYTES = 64 << 10

# the variants' column groups, in the table's order: (variant, title, record prefix)
GROUPS = (("mpicoll", "out-of-place", ""), ("in_place", "in-place", "inplace_"),
          ("builtin", "MPI built-in", "builtin_"),
          ("builtin_in_place", "MPI built-in in-place", "builtin_inplace_"))

RECORD_FIELDS = (
    "collective", "algorithm", "selected", "nranks", "dtype", "op", "bytes", "count",
    "time_us", "algbw_gbps", "busbw_gbps", "wrong",
    "inplace_time_us", "inplace_algbw_gbps", "inplace_busbw_gbps", "inplace_wrong",
    "builtin_time_us", "builtin_algbw_gbps", "builtin_busbw_gbps", "builtin_wrong",
    "builtin_inplace_time_us", "builtin_inplace_algbw_gbps", "builtin_inplace_busbw_gbps",
    "builtin_inplace_wrong", "ratio", "inplace_ratio", "check_time_us", "check_overhead",
    "scratch_bytes", "peak_alloc_bytes",
    "device", "api", "warmup", "iters", "mpi_library", "mpicoll", "mpi4py", "numpy", "python",
    "host", "cores", "nodes", "date", "selection",
)


# --- arguments ----------------------------------------------------------------

def _op(text):
    """argparse type: an op name in any case, as bench names it ("SUM" -> "sum")."""
    try:
        return _types.op_name(_types.predefined_op(text)).lower()
    except ValueError:
        return text  # argparse's choices check names the valid ones


def build_parser():
    p = _cli.Parser(
        prog="python -m mpicoll.bench",
        description="Time mpicoll's collectives against MPI's built-ins (run under mpirun; "
                    "rank 0 prints a table in the layout of nccl-tests).",
    )
    p.add_argument("-C", "--collective", default="all",
                   help="comma-separated list of allreduce, allgather, reduce_scatter, or all "
                        "(default: all)")
    p.add_argument("-b", "--minbytes", type=_cli.size_arg, default=8,
                   help="smallest size, e.g. 8, 4K, 1M (default: 8)")
    p.add_argument("-e", "--maxbytes", type=_cli.size_arg, default=64 << 20,
                   help="largest size (default: 64M)")
    p.add_argument("-f", "--stepfactor", type=_cli.factor_arg, default=2.0,
                   help="multiply the size by this factor between steps (default: 2)")
    p.add_argument("-d", "--datatype", default="float32", choices=sorted(DTYPES),
                   help="element type (default: float32)")
    p.add_argument("-o", "--op", type=_op, default="sum", choices=OPS,
                   help="reduction operation, any case (default: sum)")
    p.add_argument("-w", "--warmup_iters", type=_cli.nonnegative_int, default=5,
                   help="untimed calls of each variant per size (default: 5)")
    p.add_argument("-n", "--iters", type=_cli.positive_int, default=20,
                   help="timed calls of each variant per size (default: 20)")
    p.add_argument("--batch", type=_cli.positive_int, default=5,
                   help="timed calls per batch; the variants' batches alternate, each after "
                        "a Barrier (default: 5)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="check results (default: 1)")
    p.add_argument("-a", "--algorithm", default="auto",
                   help="auto, an algorithm name, a comma-separated list of those (e.g. "
                        "auto,direct: both in the same run; each runs for the collectives "
                        "that have it), or all (default: auto)")
    p.add_argument("--api", choices=("comm", "array"), default="comm",
                   help="time mpicoll.Comm methods (comm, the drop-in for mpi4py) or the array "
                        "functions mpicoll.allreduce & co. (array) (default: comm)")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="NumPy arrays (cpu) or CuPy arrays (gpu) (default: cpu)")
    p.add_argument("--check-cost", action="store_true",
                   help="also time mpicoll with mpicoll.options(check=True) and report the overhead")
    p.add_argument("--memory", action="store_true",
                   help="also measure mpicoll's work memory per size: the scratch bytes its "
                        "context holds and the tracemalloc peak during one call (fresh communicator)")
    p.add_output("--json", metavar="PATH",
                 help="write one record per measurement as JSON (the file is rewritten as each "
                      "measurement ends, so a run cut short keeps what it measured)")
    p.add_output("--csv", metavar="PATH", help="write one row per measurement as CSV")
    p.add_output("--plot", metavar="PATH.png", plot=True,
                 help="plot bus bandwidth and time ratio against size, in the format its "
                      "extension names (png, pdf, svg, ...; needs matplotlib: "
                      f"{_cli.PLOT_PACKAGE})")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    return p


def check_args(comm, parser, args):
    if args.collective == "all":
        args.collectives = list(COLLECTIVES)
    else:
        args.collectives = [c.strip() for c in args.collective.split(",") if c.strip()]
        bad = [c for c in args.collectives if c not in COLLECTIVES]
        if bad or not args.collectives:
            parser.error(f"-C/--collective: expected allreduce, allgather, reduce_scatter or all, "
                         f"got {args.collective!r}")
    if args.minbytes > args.maxbytes:
        parser.error(f"-b/--minbytes ({args.minbytes}) is larger than -e/--maxbytes ({args.maxbytes})")
    args.algorithms = [a.strip() for a in args.algorithm.split(",") if a.strip()] or ["auto"]
    # (a name runs for the collectives that have it: -C all -a auto,ring,shared_oneshot,shared)
    for a in args.algorithms:
        if a not in ("auto", "all") and not any(a in _select.ALGORITHMS[c]
                                                 for c in args.collectives):
            names = sorted({n for c in args.collectives for n in _select.ALGORITHMS[c]})
            parser.error(f"--algorithm: {a!r} is not an algorithm of "
                         f"{' or '.join(args.collectives)} "
                         f"(expected auto, all or one of {', '.join(names)})")
    args.dtype = np.dtype(DTYPES[args.datatype])
    category = _types.category_of_dtype(args.dtype)
    if any(c != "allgather" for c in args.collectives):
        try:
            _types.check_op_applies(_types.predefined_op(args.op), category, str(args.dtype))
        except TypeError as exc:
            parser.error(f"-o/--op: {exc}".replace("op: ", ""))


sizes = _cli.sizes


def first_warmup(warmup: int, nbytes: int) -> int:
    """Warm-up calls of the run's first size (``warmup``: the option; 0 stays 0)."""
    if warmup and nbytes <= FIRST_WARMUP_MAX_BYTES:
        return max(warmup, FIRST_WARMUP)
    return warmup


# --- one measurement ------------------------------------------------------------

def measure(comm, case, args, meta, warmup=None) -> dict:
    """One record: every variant of ``case`` timed, checked and summarised."""
    n = comm.size
    warmup = args.warmup_iters if warmup is None else warmup
    variants = dict(case.variants)
    if args.check_cost:
        variants["check"] = Variant(case.call, lambda: mpicoll.options(check=True))
    t = time_variants(comm, variants, warmup=warmup, samples=args.iters, batch=args.batch)
    selected = case.ran()
    wrong = _workload.check_case(comm, case) if args.check else {}
    factor = BUSBW_FACTOR[case.collective](n)

    def bw(seconds):
        return case.nbytes / seconds / 1e9 if seconds > 0 else float("inf")

    rec = {"collective": case.collective, "algorithm": case.algorithm, "selected": selected,
           "nranks": n, "dtype": str(case.dtype), "op": args.op,
           "bytes": case.nbytes, "count": case.count}
    for variant, _, prefix in GROUPS:
        rec.update({prefix + "time_us": t[variant] * 1e6, prefix + "algbw_gbps": bw(t[variant]),
                    prefix + "busbw_gbps": bw(t[variant]) * factor,
                    prefix + "wrong": wrong.get(variant)})
    rec["ratio"] = t["mpicoll"] / t["builtin"] if t["builtin"] > 0 else float("inf")
    rec["inplace_ratio"] = (t["in_place"] / t["builtin_in_place"] if t["builtin_in_place"] > 0
                            else float("inf"))
    rec["check_time_us"] = t["check"] * 1e6 if "check" in t else None
    rec["check_overhead"] = t["check"] / t["mpicoll"] if "check" in t and t["mpicoll"] > 0 else None
    if args.memory:
        rec["scratch_bytes"], rec["peak_alloc_bytes"] = _workload.memory_probe(comm, case)
    else:
        rec["scratch_bytes"] = rec["peak_alloc_bytes"] = None
    rec.update(meta)
    rec["warmup"] = warmup  # (the run's first size: first_warmup)
    return rec


# --- output ---------------------------------------------------------------------

def _fmt_wrong(w):
    return "N/A" if w is None else str(w)


def _fmt_num(x, width, digits):
    if x is None:
        return "N/A".rjust(width)
    if math.isinf(x):
        return "inf".rjust(width)
    return f"{x:{width}.{digits}f}"


def _fmt_time(us, width=9):
    if us >= 1e5:
        return f"{us:{width}.0f}"
    if us >= 100:
        return f"{us:{width}.1f}"
    return f"{us:{width}.2f}"


def _fmt_bytes(b, width):
    return "N/A".rjust(width) if b is None else f"{b:{width}d}"


# Optional column groups: (args attribute that turns it on, group title,
# [(header, unit, width, record -> text)]).  A new per-size measurement adds
# its option in build_parser(), its fields in measure() and RECORD_FIELDS,
# and a group here.
EXTRA_COLUMNS = (
    ("check_cost", "with check", [
        ("time", "(us)", 9, lambda r: _fmt_time(r["check_time_us"])),
        ("ovh", "x", 5, lambda r: _fmt_num(r["check_overhead"], 5, 2)),
    ]),
    ("memory", "work memory", [
        ("scratch", "(B)", 11, lambda r: _fmt_bytes(r["scratch_bytes"], 11)),
        ("peak", "(B)", 11, lambda r: _fmt_bytes(r["peak_alloc_bytes"], 11)),
    ]),
)

_GROUP_WIDTH = 33  # " time algbw busbw #wrong": 1+9 + 1+7 + 1+7 + 1+6


class Table:
    """The nccl-tests style text table on rank 0: out-of-place, in-place, MPI's built-in."""

    def __init__(self, out, args):
        self.out = out
        self.extra = [(title, cols) for attr, title, cols in EXTRA_COLUMNS if getattr(args, attr)]

    def header(self, comm, args, meta, nodes):
        w = self.out.write
        w(f"# mpicoll.bench: mpicoll {mpicoll.__version__} against MPI's built-in collectives\n")
        w(f"# MPI library: {meta['mpi_library']}\n")
        w(f"# mpi4py {meta['mpi4py']}, numpy {meta['numpy']}, Python {platform.python_version()}, "
          f"host {platform.node()}\n")
        w(f"# ranks {comm.size} on {nodes} node(s), device {args.device}, api {args.api}, "
          f"date {meta['date']}\n")
        first = first_warmup(args.warmup_iters, args.minbytes)
        w(f"# warm-up {args.warmup_iters} calls"
          f"{f' (the first size: {first}, a new process runs slow)' if first != args.warmup_iters else ''}"
          f", timed {args.iters} calls of each variant "
          f"(batches of {args.batch}, interleaved, Barrier before each batch);\n"
          f"# time: median over calls of the slowest rank; busbw factors: allreduce 2(n-1)/n, "
          f"allgather and reduce_scatter (n-1)/n; ratio: out-of-place time / built-in time; "
          f"ip ratio: in-place time / built-in in-place time\n")
        w(f"# auto: {meta['selection']}\n")
        w(f"# check {args.check}: #wrong = wrong elements over all ranks (each variant against "
          f"the exact values, mpicoll.tools.results' rule)\n")
        if args.memory:
            w("# work memory: scratch = bytes mpicoll's context holds after one call on a fresh "
              "communicator, peak = tracemalloc peak during that call (host allocations), "
              "max over ranks\n")

    def section(self, collective, algorithm):
        w = self.out.write
        h1 = h2 = h3 = ""
        for title, cols in self.extra:
            span = sum(width + 1 for _, _, width, _ in cols)
            h1 += title.rjust(span)
            h2 += "".join(" " + name.rjust(width) for name, _, width, _ in cols)
            h3 += "".join(" " + unit.rjust(width) for _, unit, width, _ in cols)
        groups = "".join(title.center(_GROUP_WIDTH) for _, title, _ in GROUPS)
        names = f"{'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6}"
        units = f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6}"
        w("#\n")
        w(f"# {collective}, algorithm {algorithm}\n")
        w(("#" + " " * 61 + groups + " " * 14 + h1).rstrip() + "\n")
        w(f"#{'size':>11} {'count':>12} {'type':>10} {'redop':>6} {'algorithm':>18}"
          + "".join(" " + names for _ in GROUPS) + f" {'ratio':>6} {'ip':>6}{h2}\n")
        w((f"#{'(B)':>11} {'(elements)':>12} {'':>10} {'':>6} {'':>18}"
           + "".join(" " + units for _ in GROUPS) + f" {'':>6} {'ratio':>6}{h3}").rstrip() + "\n")

    def row(self, rec):
        redop = rec["op"] if rec["collective"] != "allgather" else "none"
        line = (f" {rec['bytes']:>11} {rec['count']:>12} {rec['dtype']:>10} {redop:>6} "
                f"{rec['selected'][:18]:>18}")
        for _, _, p in GROUPS:
            line += (f" {_fmt_time(rec[p + 'time_us'])} {_fmt_num(rec[p + 'algbw_gbps'], 7, 2)} "
                     f"{_fmt_num(rec[p + 'busbw_gbps'], 7, 2)} {_fmt_wrong(rec[p + 'wrong']):>6}")
        line += f" {_fmt_num(rec['ratio'], 6, 2)} {_fmt_num(rec['inplace_ratio'], 6, 2)}"
        for _, cols in self.extra:
            line += "".join(" " + fmt(rec).rjust(width) for _, _, width, fmt in cols)
        self.out.write(line + "\n")

    def footer(self, records):
        w = self.out.write
        w("#\n")
        for collective in COLLECTIVES:
            recs = [r for r in records if r["collective"] == collective]
            if not recs:
                continue
            avg = {p: sum(r[p + "busbw_gbps"] for r in recs) / len(recs) for _, _, p in GROUPS}
            ratios = sorted(r["ratio"] for r in recs)
            ip_ratios = sorted(r["inplace_ratio"] for r in recs)
            w(f"# {collective}: avg bus bandwidth mpicoll {avg['']:.3f} GB/s (in place "
              f"{avg['inplace_']:.3f}), built-in {avg['builtin_']:.3f} GB/s (in place "
              f"{avg['builtin_inplace_']:.3f}); median time ratio "
              f"{ratios[len(ratios) // 2]:.2f} (in place {ip_ratios[len(ip_ratios) // 2]:.2f}) "
              f"over {len(recs)} sizes\n")
        mine = [r[k] for r in records for k in ("wrong", "inplace_wrong") if r[k] is not None]
        theirs = [r[k] for r in records for k in ("builtin_wrong", "builtin_inplace_wrong")
                  if r[k] is not None]
        if mine or theirs:
            w(f"# Out of bounds values : {sum(mine)} wrong (mpicoll), {sum(theirs)} wrong (built-in) "
              f"{'OK' if not sum(mine) and not sum(theirs) else 'FAILED'}\n")
        else:
            w("# Out of bounds values : not checked (-c 0)\n")
        both = [r[k] for r in records for k in ("busbw_gbps", "inplace_busbw_gbps")]
        w(f"# Avg bus bandwidth    : {sum(both) / len(both):.3f} GB/s (mpicoll, out-of-place "
          f"and in-place)\n")
        w("#\n")


# --- main -----------------------------------------------------------------------

@_cli.tool("mpicoll.bench")
def main(argv=None, *, comm=None, out=None, device_backend=None) -> int:
    """Run the benchmark; returns the exit status (1 if any result is wrong).

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        comm: communicator to benchmark on (default ``MPI.COMM_WORLD``).
        out: where rank 0 writes the table (default ``sys.stdout``).
        device_backend: with ``--device gpu``, the mpicoll device backend to
            use instead of binding a GPU and using CuPy (for tests).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    out = sys.stdout if out is None else out
    parser = build_parser()
    args = parser.parse_args(argv, comm=comm)
    check_args(comm, parser, args)
    root = comm.rank == 0
    device = (_workload.HostDevice() if args.device == "cpu"
              else _workload.gpu_device(comm, device_backend))
    meta = _records.environment(comm)
    meta.update(device=device.name, api=args.api, warmup=args.warmup_iters, iters=args.iters)
    nodes = meta["nodes"]
    # what "auto" picks here (a tuning file of this MPI and layout, or the built-in table)
    meta["selection"] = _select.selection(comm.size, nodes).source
    table = Table(out, args)
    if root:
        table.header(comm, args, meta, nodes)
    plan = []
    for collective in args.collectives:
        algos = [x for a in args.algorithms
                 for x in (_select.ALGORITHMS[collective] if a == "all" else [a])
                 if x == "auto" or x in _select.ALGORITHMS[collective]]
        for algo in algos:
            plan.append((collective, algo, sizes(args.minbytes, args.maxbytes, args.stepfactor)))
    progress = _cli.Progress("mpicoll.bench", sum(len(s) for _, _, s in plan),
                             args.quiet or not root)
    records = []
    for collective, algo, size_list in plan:
        if root:
            table.section(collective, algo)
        for nbytes in size_list:
            progress.step(f"{collective} {algo} {_cli.human(nbytes)}")
            case = Case(comm, device, collective, algo, nbytes, args.dtype, args.op, args.api)
            warmup = first_warmup(args.warmup_iters, nbytes) if not records else None
            rec = measure(comm, case, args, meta, warmup)
            del case
            records.append(rec)
            if root:
                table.row(rec)
                out.flush()
                if args.json:  # (a run stopped by a time limit keeps its measurements)
                    _records.keep_json(args.json, records)
    progress.end()
    if root:
        table.footer(records)
        out.flush()
    bad = any(r[k] for r in records
              for k in ("wrong", "inplace_wrong", "builtin_wrong", "builtin_inplace_wrong"))
    if root:  # (last: a file that cannot be written ends rank 0 alone, after every collective)
        if args.json:
            _records.write_json(args.json, records)
        if args.csv:
            _records.write_csv(args.csv, records, RECORD_FIELDS)
        if args.plot:
            _records.write_plot(args.plot, records, COLLECTIVES)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
