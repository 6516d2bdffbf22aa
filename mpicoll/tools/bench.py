"""Benchmark mpicoll's collectives against MPI's built-ins, in the layout of nccl-tests.

Usage (every rank runs it; rank 0 prints)::

    mpirun -n 4 python -m mpicoll.bench -C allreduce -b 8 -e 64M -f 2 -d float32 -o sum
    mpirun -n 4 python -m mpicoll.bench --algorithm all -b 1K -e 1M --json out.json

For each collective, algorithm and size it times mpicoll and MPI's built-in
collective in the same run, on the same input:

* warm-up: ``-w`` calls of each;
* timed: ``-n`` calls of each, in alternating batches of ``--batch`` calls
  (mpicoll first in odd batches, the built-in first in even ones), with a
  Barrier before every batch; each call is timed on every rank with
  ``MPI.Wtime`` and the call's time is that of the slowest rank;
* reported: the median over calls, algbw = size / time and busbw = algbw x
  the collective's factor (AllReduce 2(n-1)/n, AllGather and ReduceScatter
  (n-1)/n, as nccl-tests), and the time ratio mpicoll / built-in;
* checked (``-c 1``): the inputs are small integers (exact in every type);
  mpicoll's output and the built-in's are each compared with the exact
  expected values by the one rule of :mod:`mpicoll.tools.results`
  (integers exactly, floating SUM/PROD within ``gamma(n-1) * sum|x|``);
  ``#wrong`` counts wrong elements over all ranks.

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

import argparse
import contextlib
import csv
import datetime
import json
import math
import platform
import sys

import numpy as np
from mpi4py import MPI

import mpicoll

from ..core import types as _types
from ..core.config import parse_bytes
from ..engine import context as _context
from ..engine import select as _select
from . import arrays as _arrays
from . import results as _results

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter")

# nccl-tests' bus bandwidth factors: busbw = algbw * factor(n)
# The run's first size, when small, is warmed up with at least this many calls of each
# implementation.  A new process's first few hundred small calls run slow (at 2 ranks on
# MPICH, 8 B AllReduces: every third to fifth of the first 20 took 12-17 us against 4;
# the median of the first 50 up to 1.5x the later ones'), so with 5 warm-up calls the
# first cell of a run (8 B) took 1.5-2.3x the next size's time in 5 of 13 runs, with 100
# in none of 9 (docs/performance.md).  Later sizes find the process warm.
FIRST_WARMUP = 100
FIRST_WARMUP_MAX_BYTES = 64 << 10

BUSBW_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}

# -o/--op choices: the predefined ops with a NumPy ufunc for the exact expected
# values (_types' tables), named in lower case as nccl-tests does; any case is accepted.
OPS = tuple(name.lower() for name in _types.NUMPY_UFUNCS)

def _builtin_dtypes() -> dict:
    """-d/--datatype choices: every dtype mpicoll carries (core.types) that MPI's built-in
    collectives reduce natively, by NumPy name, plus the nccl-tests / C spellings.

    float16 is left out (it has no MPI datatype), long double too (its name
    and size differ between platforms).
    """
    out = {}
    for code in np.typecodes["AllInteger"] + np.typecodes["AllFloat"]:
        dtype = np.dtype(code)
        if dtype.char in "eEgG":
            continue
        try:
            _types.category_of_dtype(dtype)
        except TypeError:  # no MPI datatype for it in this build
            continue
        out[dtype.name] = dtype
    out.update(int=np.dtype(np.int32), float=np.dtype(np.float32), double=np.dtype(np.float64))
    return out


def _half_dtypes() -> dict:
    """The 8/16-bit floats mpicoll reduces in float32 (float16; bfloat16 and float8 with
    ml_dtypes).  MPI has no datatype for them, so the built-in they are timed against is
    the one a user of plain MPI runs: the same count in float32 (reductions; the result
    rounded to the type for the check), or the same bytes (AllGather)."""
    out = {"float16": np.dtype(np.float16)}
    try:
        import ml_dtypes
    except ImportError:
        return out
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        out[name] = np.dtype(getattr(ml_dtypes, name))
    return out


DTYPES = {**_builtin_dtypes(), **_half_dtypes()}

RECORD_FIELDS = (
    "collective", "algorithm", "selected", "nranks", "dtype", "op", "bytes", "count",
    "time_us", "algbw_gbps", "busbw_gbps", "wrong",
    "builtin_time_us", "builtin_algbw_gbps", "builtin_busbw_gbps", "builtin_wrong",
    "ratio", "check_time_us", "check_overhead", "scratch_bytes", "peak_alloc_bytes",
    "device", "api", "warmup", "iters", "mpi_library", "mpi4py", "numpy", "date", "selection",
)


# --- arguments ----------------------------------------------------------------

def size_arg(text):
    try:
        return parse_bytes(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("size: ", "")) from None


def positive_int_arg(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _nonnegative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _op(text):
    """argparse type: an op name in any case, as bench names it ("SUM" -> "sum")."""
    try:
        return _types.op_name(_types.predefined_op(text)).lower()
    except ValueError:
        return text  # argparse's choices check names the valid ones


def factor_arg(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 1, got {text!r}") from None
    if not value > 1:
        raise argparse.ArgumentTypeError(f"expected a number > 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mpicoll.bench",
        description="Time mpicoll's collectives against MPI's built-ins (run under mpirun; "
                    "rank 0 prints a table in the layout of nccl-tests).",
    )
    p.add_argument("-C", "--collective", default="all",
                   help="comma-separated list of allreduce, allgather, reduce_scatter, or all "
                        "(default: all)")
    p.add_argument("-b", "--minbytes", type=size_arg, default=8,
                   help="smallest size, e.g. 8, 4K, 1M (default: 8)")
    p.add_argument("-e", "--maxbytes", type=size_arg, default=64 << 20,
                   help="largest size (default: 64M)")
    p.add_argument("-f", "--stepfactor", type=factor_arg, default=2.0,
                   help="multiply the size by this factor between steps (default: 2)")
    p.add_argument("-d", "--datatype", default="float32", choices=sorted(DTYPES),
                   help="element type (default: float32)")
    p.add_argument("-o", "--op", type=_op, default="sum", choices=OPS,
                   help="reduction operation, any case (default: sum)")
    p.add_argument("-w", "--warmup_iters", type=_nonnegative_int, default=5,
                   help="untimed calls of each implementation per size (default: 5)")
    p.add_argument("-n", "--iters", type=positive_int_arg, default=20,
                   help="timed calls of each implementation per size (default: 20)")
    p.add_argument("--batch", type=positive_int_arg, default=5,
                   help="timed calls per batch; batches of mpicoll and the built-in "
                        "alternate, each after a Barrier (default: 5)")
    p.add_argument("-c", "--check", type=int, choices=(0, 1), default=1,
                   help="check results (default: 1)")
    p.add_argument("-a", "--algorithm", default="auto",
                   help="auto, an algorithm name, a comma-separated list of those (e.g. "
                        "auto,direct: both in the same run), or all (default: auto)")
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
    p.add_argument("--overlap", metavar="SIZE", type=size_arg,
                   help="afterwards, measure how much an iallreduce of SIZE bytes per rank "
                        "overlaps NumPy matrix products (python -m mpicoll.tools.overlap; "
                        "host arrays only)")
    p.add_argument("--json", metavar="PATH", help="write one record per measurement as JSON")
    p.add_argument("--csv", metavar="PATH", help="write one row per measurement as CSV")
    p.add_argument("--plot", metavar="PATH.png",
                   help="plot bus bandwidth and time ratio against size (needs matplotlib: "
                        "pip install 'mpicoll[plot]')")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    return p


def check_args(parser, args):
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
    for c in args.collectives:
        names = _select.ALGORITHMS[c]
        for a in args.algorithms:
            if a not in ("auto", "all") and a not in names:
                parser.error(f"--algorithm: {a!r} is not an algorithm of {c} "
                             f"(expected auto, all or one of {', '.join(names)})")
    args.dtype = np.dtype(DTYPES[args.datatype])
    category = _types.category_of_dtype(args.dtype)
    if any(c != "allgather" for c in args.collectives):
        try:
            _types.check_op_applies(_types.predefined_op(args.op), category, str(args.dtype))
        except TypeError as exc:
            parser.error(f"-o/--op: {exc}".replace("op: ", ""))
    if args.overlap is not None and args.device != "cpu":
        parser.error("--overlap: measures host arrays only; drop --device gpu or run it alone")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, which is not installed; "
                         "install it with: pip install 'mpicoll[plot]'")


def sizes(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    """minbytes, minbytes*factor, ... up to maxbytes (each step at least one byte more)."""
    out = []
    s = minbytes
    while s <= maxbytes:
        out.append(s)
        s = max(s + 1, int(s * factor))
    return out


# --- data and the check -------------------------------------------------------

def rank_data(rank: int, nranks: int, count: int, dtype: np.dtype, op: str, offset: int = 0):
    """Rank ``rank``'s input: small integers (exact in every type), different per rank and element."""
    i = np.arange(offset, offset + count, dtype=np.int64)
    if op == "prod":
        v = np.ones(count, dtype=np.int64)
        v[i % nranks == rank] = 2  # one factor 2 per element: products stay tiny
        if dtype.kind != "u":
            v[(i + rank) % 5 == 0] *= -1
    else:
        v = (rank * 7 + i * 3) % 13
        if dtype.kind not in "ub" and op not in ("band", "bor", "bxor"):
            v -= 6
    if dtype.kind == "c":
        return (v + 1j * ((rank * 5 + i) % 7 - 3)).astype(dtype)
    return v.astype(dtype)


def expected(collective, nranks, count, dtype, op, rank):
    """The exact result this rank should hold."""
    if collective == "allgather":
        per = count // nranks
        return np.concatenate([rank_data(r, nranks, per, dtype, op) for r in range(nranks)])
    ufunc = _types.NUMPY_UFUNCS[op.upper()]
    acc = rank_data(0, nranks, count, dtype, op)
    for r in range(1, nranks):
        acc = ufunc(acc, rank_data(r, nranks, count, dtype, op)).astype(dtype, copy=False)
    if collective == "reduce_scatter":
        per = count // nranks
        return acc[rank * per: (rank + 1) * per]
    return acc


def error_scale(collective, nranks, count, dtype, op, rank):
    """``sum_r |x_r|`` (SUM) or ``prod_r |x_r|`` (PROD) of this rank's result elements, or None.

    The scale of mpicoll.tools.results' tolerance rule; None where the result must be exact.
    """
    opname = op.upper()
    if collective == "allgather" or not _results.needs_tolerance(opname, dtype):
        return None
    scale = None
    for r in range(nranks):
        mag = _results.magnitude(rank_data(r, nranks, count, dtype, op), opname)
        scale = mag if scale is None else (scale + mag if opname == "SUM" else scale * mag)
    if collective == "reduce_scatter":
        per = count // nranks
        scale = scale[rank * per: (rank + 1) * per]
    return scale


def count_wrong(got, want, dtype, nranks, op=None, scale=None) -> int:
    """Elements of ``got`` that differ from the exact ``want`` (mpicoll.tools.results' rule).

    With ``op`` and ``scale`` (:func:`error_scale`) floating SUM/PROD may
    differ by rounding, within ``gamma(n-1) * scale``; everything else must
    be identical.
    """
    got = np.asarray(got)
    if got.shape != np.shape(want):
        return max(got.size, np.size(want))
    ref = _results.Reference(np.asarray(want, dtype), scale, "exact")
    opname = op.upper() if op is not None and scale is not None else None
    return _results.compare(got, ref, opname, nranks).nbad


# --- devices --------------------------------------------------------------------

class HostDevice(_arrays.NumpyArrays):
    """NumPy arrays (mpicoll.tools.arrays); the input is used as it is, nothing to synchronise."""

    name = "cpu"

    @staticmethod
    def upload(host):
        return host

    def download(self, arr):
        return self.get(arr)

    def builtin_call(self, call, sbuf, rbuf):
        """The built-in collective as a user of these arrays calls it."""
        def run():
            call(sbuf, rbuf)
        return run


class GpuDevice(_arrays.DeviceArrays):
    """Device arrays of a registered mpicoll device backend (CuPy by default)."""

    def __init__(self, backend):
        super().__init__(backend.rt, "gpu")
        self.backend = backend

    def upload(self, host):
        return self.put(host)

    def download(self, arr):
        return self.get(arr)

    def _pinned(self, n, dtype):
        return self.rt.pinned(max(n, 1) * dtype.itemsize).view(dtype)[:n]

    def builtin_call(self, call, sbuf, rbuf):
        """Copy the input to pinned host memory, run MPI there, copy the result back."""
        hs = self._pinned(len(sbuf), sbuf.dtype)
        hr = self._pinned(len(rbuf), rbuf.dtype)
        rt, stream_of = self.rt, self.rt.current_stream

        def run():
            stream = stream_of()
            rt.d2h(hs, sbuf, stream)
            rt.synchronize(stream)
            call(hs, hr)
            rt.h2d(rbuf, hr, stream)
            rt.synchronize(stream)
        return run


def _gpu_device(comm, backend=None):
    """Bind this rank's GPU and return the device wrapper (MpicollError if there is none)."""
    if backend is None:
        from ..backends import devices as _devices
        bind = getattr(mpicoll, "bind_device", None) or _devices.bind_device
        bind(comm)
        backend = _devices.CUPY
    return GpuDevice(backend)


# --- one measurement ------------------------------------------------------------

class Case:
    """Buffers and calls for one (collective, algorithm, size)."""

    def __init__(self, comm, device, collective, algorithm, nbytes, args):
        n, rank = comm.size, comm.rank
        dtype = args.dtype
        item = dtype.itemsize
        if collective == "allreduce":
            count = max(nbytes // item, 1)
            per = count
        else:
            per = max(nbytes // (item * n), 1)
            count = per * n
        self.collective, self.algorithm = collective, algorithm
        self.count, self.nbytes = count, count * item
        self.dtype = dtype
        op_name = args.op
        op = _types.predefined_op(op_name)
        if collective == "allreduce":
            host_in = rank_data(rank, n, count, dtype, op_name)
            out_len = count
        elif collective == "reduce_scatter":
            host_in = rank_data(rank, n, count, dtype, op_name)
            out_len = per
        else:
            host_in = rank_data(rank, n, per, dtype, op_name)
            out_len = count
        self.sbuf = device.upload(host_in)
        self.out_m = device.empty(out_len, dtype)
        self.out_b = device.empty(out_len, dtype)
        sbuf_b = self.sbuf
        if _types.accumulation_dtype(dtype) is not None:  # no MPI datatype (_half_dtypes)
            if collective == "allgather":
                words = _types.view_dtype(dtype)
                sbuf_b = device.upload(host_in.view(words))
                self.out_b = device.empty(out_len, words)
            else:
                wide = _types.accumulation_dtype(dtype)
                sbuf_b = device.upload(host_in.astype(wide))
                self.out_b = device.empty(out_len, wide)
        sync = device.sync
        s, om = self.sbuf, self.out_m
        algo = algorithm
        if args.api == "comm":
            mcomm = mpicoll.Comm(comm, algorithm=algo)
            mpicoll_call = {
                "allreduce": lambda: mcomm.Allreduce(s, om, op),
                "allgather": lambda: mcomm.Allgather(s, om),
                "reduce_scatter": lambda: mcomm.Reduce_scatter_block(s, om, op),
            }[collective]
        else:
            mpicoll_call = {
                "allreduce": lambda: mpicoll.allreduce(s, op, comm=comm, out=om, algorithm=algo),
                "allgather": lambda: mpicoll.allgather(s, comm=comm, out=om, algorithm=algo),
                "reduce_scatter": lambda: mpicoll.reduce_scatter(s, op, comm=comm, out=om,
                                                                 algorithm=algo),
            }[collective]

        def run_mpicoll():
            mpicoll_call()
            sync()

        builtin = {
            "allreduce": lambda a, b: comm.Allreduce(a, b, op),
            "allgather": lambda a, b: comm.Allgather(a, b),
            "reduce_scatter": lambda a, b: comm.Reduce_scatter_block(a, b, op),
        }[collective]
        # variant name -> (call, options in force around its batches)
        self.variants = {
            "mpicoll": (run_mpicoll, lambda: mpicoll.options(check=False)),
            "builtin": (device.builtin_call(builtin, sbuf_b, self.out_b), contextlib.nullcontext),
        }
        if args.check_cost:
            self.variants["check"] = (run_mpicoll, lambda: mpicoll.options(check=True))
        # Extra per-size measurements (e.g. traffic counts) belong here as more
        # variants, or as fields measure() adds to the record.
        # what "auto" (or MPICOLL_ALGORITHM) picks for this call, as the engine chooses it:
        # with the communicator's selection and node layout (across nodes the ring's sizes
        # go hierarchical); predefined ops commute
        self.selected = _select.choose_on(_context.context(comm), collective, algorithm,
                                          self.nbytes,
                                          selection=getattr(args, "selection", None))
        # a 16/8-bit SUM/PROD may take engine.select's direct route instead (by its size rule)
        if _select.direct_route(collective, algorithm, dtype, op, self.nbytes, n,
                                  "numpy" if device.name == "cpu" else device.name):
            self.selected = "direct"

        def call_on(c):
            """One mpicoll call of this case on communicator ``c`` (array API)."""
            if collective == "allreduce":
                mpicoll.allreduce(s, op, comm=c, out=om, algorithm=algo)
            elif collective == "allgather":
                mpicoll.allgather(s, comm=c, out=om, algorithm=algo)
            else:
                mpicoll.reduce_scatter(s, op, comm=c, out=om, algorithm=algo)
            sync()

        self.call_on = call_on


def memory_probe(comm, case) -> tuple[int, int | None]:
    """(scratch bytes held, tracemalloc peak bytes) of one call on a fresh communicator, max over ranks.

    The fresh communicator gets a new mpicoll context, so the call allocates
    its work arrays; what the context holds afterwards is what every later
    call of that size reuses.  tracemalloc sees host (NumPy) allocations only:
    the peak is None for device arrays.
    """
    import tracemalloc

    from ..engine import context as _context

    dup = comm.Dup()
    try:
        ctx = _context.context(dup)  # created (collectively) before the measurement
        started = not tracemalloc.is_tracing()
        if started:
            tracemalloc.start()
        try:
            dup.Barrier()
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            case.call_on(dup)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            if started:
                tracemalloc.stop()
        held = ctx.work.nbytes
    finally:
        dup.Free()
    held = comm.allreduce(held, op=MPI.MAX)
    peak = comm.allreduce(peak, op=MPI.MAX)
    return held, (peak if isinstance(case.sbuf, np.ndarray) else None)


def time_variants(comm, variants, warmup, iters, batch, min_iters=None, spread=None) -> dict:
    """Median over calls of the slowest rank's time (seconds), per variant; interleaved batches.

    ``spread``: stop early, after at least ``min_iters`` calls of each variant,
    once every variant's interquartile range is within ``spread`` times its
    median on every rank (one agreement per round of batches): more calls
    would not move a median that steady.
    """
    names = list(variants)
    for name in names:
        call, opts = variants[name]
        with opts():
            for _ in range(warmup):
                call()
    times = {name: np.empty(iters) for name in names}
    done = dict.fromkeys(names, 0)
    rnd = 0
    wtime = MPI.Wtime
    while done[names[0]] < iters:
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            call, opts = variants[name]
            k0 = done[name]
            k1 = min(k0 + batch, iters)
            t = times[name]
            with opts():
                comm.Barrier()
                for k in range(k0, k1):
                    t0 = wtime()
                    call()
                    t[k] = wtime() - t0
            done[name] = k1
        rnd += 1
        if spread is not None and done[names[0]] < iters and done[names[0]] >= (min_iters or 1):
            steady = True
            for name in names:
                q1, q2, q3 = np.percentile(times[name][:done[name]], (25, 50, 75))
                steady = steady and q3 - q1 <= spread * q2
            if comm.allreduce(steady, op=MPI.LAND):
                break
    out = {}
    for name in names:
        t = times[name][:done[name]]
        comm.Allreduce(MPI.IN_PLACE, t, MPI.MAX)
        out[name] = float(np.median(t))
    return out


def check_case(comm, case, device, args, builtin: bool = True) -> tuple:
    """(wrong elements of mpicoll's output, of the built-in's or None), summed over ranks:
    the outputs of the calls timed last against the exact values."""
    n = comm.size
    want = expected(case.collective, n, case.count, case.dtype, args.op, comm.rank)
    scale = error_scale(case.collective, n, case.count, case.dtype, args.op, comm.rank)
    got_m = device.download(case.out_m)
    wrong = comm.allreduce(count_wrong(got_m, want, case.dtype, n, args.op, scale))
    builtin_wrong = None
    if builtin:
        got_b = device.download(case.out_b)
        if got_b.dtype != case.dtype:  # float32 or words (_half_dtypes)
            got_b = got_b.view(case.dtype) if got_b.dtype.kind == "u" else got_b.astype(case.dtype)
        builtin_wrong = comm.allreduce(count_wrong(got_b, want, case.dtype, n, args.op, scale))
    return wrong, builtin_wrong


def first_warmup(warmup: int, nbytes: int) -> int:
    """Warm-up calls of the run's first size (``warmup``: the option; 0 stays 0)."""
    if warmup and nbytes <= FIRST_WARMUP_MAX_BYTES:
        return max(warmup, FIRST_WARMUP)
    return warmup


def measure(comm, case, device, args, meta, warmup=None) -> dict:
    n = comm.size
    warmup = args.warmup_iters if warmup is None else warmup
    t = time_variants(comm, case.variants, warmup, args.iters, args.batch)
    wrong = builtin_wrong = None
    if args.check:
        wrong, builtin_wrong = check_case(comm, case, device, args)
    factor = BUSBW_FACTOR[case.collective](n)

    def bw(seconds):
        return case.nbytes / seconds / 1e9 if seconds > 0 else float("inf")

    rec = {
        "collective": case.collective, "algorithm": case.algorithm, "selected": case.selected,
        "nranks": n, "dtype": str(case.dtype), "op": args.op,
        "bytes": case.nbytes, "count": case.count,
        "time_us": t["mpicoll"] * 1e6, "algbw_gbps": bw(t["mpicoll"]),
        "busbw_gbps": bw(t["mpicoll"]) * factor, "wrong": wrong,
        "builtin_time_us": t["builtin"] * 1e6, "builtin_algbw_gbps": bw(t["builtin"]),
        "builtin_busbw_gbps": bw(t["builtin"]) * factor, "builtin_wrong": builtin_wrong,
        "ratio": t["mpicoll"] / t["builtin"] if t["builtin"] > 0 else float("inf"),
        "check_time_us": t["check"] * 1e6 if "check" in t else None,
        "check_overhead": t["check"] / t["mpicoll"] if "check" in t and t["mpicoll"] > 0 else None,
    }
    if args.memory:
        rec["scratch_bytes"], rec["peak_alloc_bytes"] = memory_probe(comm, case)
    else:
        rec["scratch_bytes"] = rec["peak_alloc_bytes"] = None
    rec.update(meta)
    rec["warmup"] = warmup  # (the run's first size: first_warmup)
    return rec


# --- output ---------------------------------------------------------------------

def _library_version() -> str:
    lines = MPI.Get_library_version().strip().splitlines()
    return lines[0].strip() if lines else "unknown"


def _meta(comm, args, device) -> dict:
    return {
        "device": device.name, "api": args.api, "warmup": args.warmup_iters, "iters": args.iters,
        "mpi_library": _library_version(), "mpi4py": mpi4py_version(),
        "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def mpi4py_version() -> str:
    import mpi4py
    return mpi4py.__version__


def _nodes(comm) -> int:
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        leaders = comm.allreduce(1 if shared.Get_rank() == 0 else 0)
    finally:
        shared.Free()
    return leaders


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


class Table:
    """The nccl-tests style text table on rank 0."""

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
          f", timed {args.iters} calls of each implementation "
          f"(batches of {args.batch}, interleaved, Barrier before each batch);\n"
          f"# time: median over calls of the slowest rank; busbw factors: allreduce 2(n-1)/n, "
          f"allgather and reduce_scatter (n-1)/n\n")
        w(f"# auto: {meta['selection']}\n")
        w(f"# check {args.check}: #wrong = wrong elements over all ranks (mpicoll and the "
          f"built-in each against the exact values, mpicoll.tools.results' rule)\n")
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
        w("#\n")
        w(f"# {collective}, algorithm {algorithm}\n")
        w("#" + " " * 71 + "mpicoll" + " " * 24 + "MPI built-in" + " " * 7 + h1 + "\n")
        w(f"#{'size':>11} {'count':>12} {'type':>10} {'redop':>6} {'algorithm':>18} "
          f"{'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} "
          f"{'time':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'ratio':>6}{h2}\n")
        w(f"#{'(B)':>11} {'(elements)':>12} {'':>10} {'':>6} {'':>18} "
          f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} "
          f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'':>6}{h3}\n")

    def row(self, rec):
        redop = rec["op"] if rec["collective"] != "allgather" else "none"
        line = (f" {rec['bytes']:>11} {rec['count']:>12} {rec['dtype']:>10} {redop:>6} "
                f"{rec['selected'][:18]:>18} "
                f"{_fmt_time(rec['time_us'])} {_fmt_num(rec['algbw_gbps'], 7, 2)} "
                f"{_fmt_num(rec['busbw_gbps'], 7, 2)} {_fmt_wrong(rec['wrong']):>6} "
                f"{_fmt_time(rec['builtin_time_us'])} {_fmt_num(rec['builtin_algbw_gbps'], 7, 2)} "
                f"{_fmt_num(rec['builtin_busbw_gbps'], 7, 2)} {_fmt_wrong(rec['builtin_wrong']):>6} "
                f"{_fmt_num(rec['ratio'], 6, 2)}")
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
            avg_m = sum(r["busbw_gbps"] for r in recs) / len(recs)
            avg_b = sum(r["builtin_busbw_gbps"] for r in recs) / len(recs)
            ratios = sorted(r["ratio"] for r in recs)
            w(f"# {collective}: avg bus bandwidth mpicoll {avg_m:.3f} GB/s, built-in {avg_b:.3f} GB/s; "
              f"median time ratio {ratios[len(ratios) // 2]:.2f} over {len(recs)} sizes\n")
        wrong = [r["wrong"] for r in records if r["wrong"] is not None]
        bwrong = [r["builtin_wrong"] for r in records if r["builtin_wrong"] is not None]
        if wrong or bwrong:
            w(f"# Out of bounds values : {sum(wrong)} wrong (mpicoll), {sum(bwrong)} wrong (built-in) "
              f"{'OK' if not sum(wrong) and not sum(bwrong) else 'FAILED'}\n")
        else:
            w("# Out of bounds values : not checked (-c 0)\n")
        w("#\n")


def write_json(path, records):
    with open(path, "w") as f:
        json.dump(records, f, indent=1)
        f.write("\n")


def write_csv(path, records):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=RECORD_FIELDS)
        writer.writeheader()
        for rec in records:
            writer.writerow({k: ("" if rec.get(k) is None else rec.get(k)) for k in RECORD_FIELDS})


def write_plot(path, records):
    """Bus bandwidth (top) and time ratio (bottom) against size, one column per collective."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colls = [c for c in COLLECTIVES if any(r["collective"] == c for r in records)]
    fig, axes = plt.subplots(2, len(colls), figsize=(5.5 * len(colls), 7), squeeze=False)
    for j, c in enumerate(colls):
        recs = [r for r in records if r["collective"] == c]
        top, bottom = axes[0][j], axes[1][j]
        for algo in dict.fromkeys(r["algorithm"] for r in recs):
            rs = sorted((r for r in recs if r["algorithm"] == algo), key=lambda r: r["bytes"])
            x = [r["bytes"] for r in rs]
            top.plot(x, [r["busbw_gbps"] for r in rs], marker="o", ms=3, label=f"mpicoll {algo}")
            bottom.plot(x, [r["ratio"] for r in rs], marker="o", ms=3, label=f"mpicoll {algo}")
        rs = sorted(recs, key=lambda r: r["bytes"])
        seen = {}
        for r in rs:  # one built-in curve (median over the algorithms' runs of a size)
            seen.setdefault(r["bytes"], []).append(r["builtin_busbw_gbps"])
        xb = sorted(seen)
        top.plot(xb, [float(np.median(seen[b])) for b in xb], "k--", label="MPI built-in")
        bottom.axhline(1.0, color="k", ls="--", lw=1)
        n = recs[0]["nranks"]
        top.set_title(f"{c}, {n} ranks, {recs[0]['dtype']}")
        top.set_ylabel("bus bandwidth (GB/s)")
        bottom.set_ylabel("time mpicoll / built-in")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size (bytes)")
            ax.grid(True, which="both", alpha=0.3)
        bottom.set_yscale("log")
        top.legend(fontsize=7)
    fig.suptitle(f"mpicoll vs {records[0]['mpi_library'][:60]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _progress(text, quiet):
    if quiet:
        return
    if sys.stderr.isatty():  # one line, rewritten in place
        sys.stderr.write(f"\r[mpicoll.bench] {text}\033[K")
    else:
        sys.stderr.write(f"[mpicoll.bench] {text}\n")
    sys.stderr.flush()


def human(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


# --- main -----------------------------------------------------------------------

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
    args = parser.parse_args(argv)
    check_args(parser, args)
    root = comm.rank == 0
    device = HostDevice() if args.device == "cpu" else _gpu_device(comm, device_backend)
    meta = _meta(comm, args, device)
    meta["date"] = comm.bcast(meta["date"], root=0)
    nodes = _nodes(comm)
    # what "auto" picks here (a tuning file of this MPI and layout, or the built-in table)
    args.selection = _select.selection(comm.size, nodes)
    meta["selection"] = args.selection.source
    table = Table(out, args)
    if root:
        table.header(comm, args, meta, nodes)
    plan = []
    for collective in args.collectives:
        algos = [x for a in args.algorithms
                 for x in (_select.ALGORITHMS[collective] if a == "all" else [a])]
        for algo in algos:
            plan.append((collective, algo, sizes(args.minbytes, args.maxbytes, args.stepfactor)))
    total = sum(len(s) for _, _, s in plan)
    records = []
    done = 0
    for collective, algo, size_list in plan:
        if root:
            table.section(collective, algo)
        for nbytes in size_list:
            done += 1
            if root:
                _progress(f"{collective} {algo} {human(nbytes)} ({done}/{total})", args.quiet)
            case = Case(comm, device, collective, algo, nbytes, args)
            warmup = first_warmup(args.warmup_iters, nbytes) if done == 1 else None
            rec = measure(comm, case, device, args, meta, warmup)
            del case
            records.append(rec)
            if root:
                table.row(rec)
                out.flush()
    if root:
        if not args.quiet and sys.stderr.isatty():
            sys.stderr.write("\n")
        table.footer(records)
        out.flush()
        if args.json:
            write_json(args.json, records)
        if args.csv:
            write_csv(args.csv, records)
        if args.plot:
            write_plot(args.plot, records)
    bad = any((r["wrong"] or 0) or (r["builtin_wrong"] or 0) for r in records)
    if args.overlap is not None:
        from . import overlap as _overlap
        bad = _overlap.main(["--size", str(args.overlap)], comm=comm, out=out) != 0 or bad
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
