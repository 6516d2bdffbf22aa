"""Measure how much a non-blocking AllReduce overlaps computation, on the host or the GPU.

Usage (every rank runs it; rank 0 prints)::

    mpirun -n 2 python benchmarks/overlap.py
    mpirun -n 2 python benchmarks/overlap.py --size 64M --reps 9 --dtype float32
    mpirun -n 4 python benchmarks/overlap.py --device gpu --size 64M --dtype float32

One rank's array of ``--size`` bytes is reduced with ``mpicoll.iallreduce``
beside a run of matrix products: ``--matrix`` square products, as many as
the AllReduce alone takes (at least; the same number on every rank).  On the
host (``--device cpu``) they are NumPy float64 products on the calling
thread; on the GPU (``--device gpu``: CuPy arrays, each rank binds a GPU with
``mpicoll.bind_device()``) CuPy float32 products queued on a stream of their
own, beside the AllReduce on the current stream.  Modes, timed by
:mod:`mpicoll.tools.harness` (the modes interleaved, a Barrier before each
run, the slowest rank's time, the median over ``--reps``):

``comm``      start + wait, nothing else
``compute``   the products alone (GPU: until their stream is done)
``wait``      start, the products, wait (progress only inside MPI calls)
``test``      start, the products with ``test()`` after each one, wait
``thread``    as ``wait`` with the progress thread on (``progress=True``)

Reported: medians, and for each overlapped mode
``overlap = (t_comm + t_compute - t_both) / min(t_comm, t_compute)``: with
the products at least as long as the AllReduce, the fraction of the
communication hidden; 1 when it is hidden completely, 0 when the two run one
after the other, negative when running them together costs more than that.
Every result is checked against the exact values (the inputs are small
integers, exact in every type); the exit status is 1 if any is wrong.

BLAS threads compete with the ranks and the progress thread for cores: run
with ``OMP_NUM_THREADS=1`` (the tool prints what it found).
"""

from __future__ import annotations

import math
import os
import platform
import sys

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.tools.harness import cli as _cli
from mpicoll.tools.harness import records as _records
from mpicoll.tools.harness.timing import Variant, time_variants
from mpicoll.tools.harness.workload import count_wrong, expected, rank_data

MODES = ("comm", "compute", "wait", "test", "thread")
MATRIX = {"cpu": 256, "gpu": 2048}  # --matrix by device: a product of a fraction of a ms


def _parser():
    p = _cli.Parser(prog="python benchmarks/overlap.py", description=__doc__.splitlines()[0])
    p.add_argument("--size", type=_cli.size_arg, default=32 << 20,
                   help="bytes per rank's array (default 32M)")
    p.add_argument("--dtype", default="float64", choices=("float32", "float64", "int32", "int64"))
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                   help="NumPy arrays and products (cpu) or CuPy ones (gpu) (default: cpu)")
    p.add_argument("--matrix", type=_cli.positive_int, default=None,
                   help=f"side of the square matrices multiplied (default {MATRIX['cpu']}, "
                        f"gpu {MATRIX['gpu']})")
    p.add_argument("--reps", type=_cli.positive_int, default=7,
                   help="timed repetitions per mode (default 7)")
    p.add_argument("--warmup", type=_cli.nonnegative_int, default=2,
                   help="untimed repetitions first (default 2)")
    p.add_output("--json", metavar="PATH", help="write one record per mode as JSON")
    return p


class HostProducts:
    """NumPy float64 products on the calling thread (``launch`` returns when done)."""

    def __init__(self, side, rank):
        rng = np.random.default_rng(rank)
        self.a = rng.standard_normal((side, side))
        self.b = rng.standard_normal((side, side))
        self.c = np.empty((side, side))

    def launch(self):
        np.matmul(self.a, self.b, out=self.c)

    def finish(self):
        pass


class CupyProducts:
    """CuPy float32 products queued on a stream of their own (``finish`` waits for them)."""

    def __init__(self, cp, side, rank):
        self.cp = cp
        self.stream = cp.cuda.Stream(non_blocking=True)
        host = HostProducts(side, rank)
        self.a = cp.asarray(host.a.astype(np.float32))
        self.b = cp.asarray(host.b.astype(np.float32))
        self.c = cp.empty((side, side), dtype=np.float32)

    def launch(self):
        with self.stream:
            self.cp.matmul(self.a, self.b, out=self.c)

    def finish(self):
        self.stream.synchronize()


class Bench:
    """The AllReduce, the products and the modes on one device (``xp``: CuPy, or None: NumPy)."""

    def __init__(self, comm, count, dtype, products, xp=None):
        self.comm = comm
        rank, n = comm.Get_rank(), comm.Get_size()
        host = rank_data(rank, n, count, dtype, "sum")
        self.xp = xp
        self.x = host if xp is None else xp.asarray(host)
        # an output per mode: each mode's last result is checked
        self.y = {mode: np.empty_like(host) if xp is None else xp.empty(count, dtype)
                  for mode in MODES}
        self.want = expected("allreduce", n, count, dtype, "sum", rank)
        self.work = products
        self.products = 1

    def sync(self):
        """Wait for the AllReduce's stream (the current one; nothing on the host)."""
        if self.xp is not None:
            self.xp.cuda.get_current_stream().synchronize()

    def wrong(self, modes) -> int:
        """Wrong elements of each mode's last AllReduce, summed (this rank)."""
        host = (lambda a: a) if self.xp is None else self.xp.asnumpy
        n = self.comm.Get_size()
        return sum(count_wrong(host(self.y[m]), self.want, self.want.dtype, n)
                   for m in modes if m != "compute")

    def run(self, mode):
        """One repetition of ``mode`` (the harness times it)."""
        work = self.work
        if mode == "compute":
            for _ in range(self.products):
                work.launch()
            work.finish()
            return
        with mpicoll.options(progress=mode == "thread"):
            h = mpicoll.iallreduce(self.x, out=self.y[mode], comm=self.comm)
            if mode != "comm":
                for _ in range(self.products):
                    work.launch()
                    if mode == "test":
                        h.test()
            h.wait()
            self.sync()
            if mode != "comm":
                work.finish()

    def medians(self, modes, reps, warmup):
        """{mode: median seconds of the slowest rank}, the modes interleaved (the harness);
        each AllReduce's output cleared before its run, untimed."""
        def clear(mode):
            def reset():
                self.y[mode].fill(0)
                self.sync()
            return reset

        variants = {mode: Variant(lambda mode=mode: self.run(mode),
                                  reset=None if mode == "compute" else clear(mode))
                    for mode in modes}
        return time_variants(self.comm, variants, warmup=warmup, samples=reps)


def overlap(t_comm: float, t_compute: float, t_both: float) -> float:
    """(t_comm + t_compute - t_both) / min(t_comm, t_compute): the fraction of the shorter hidden."""
    return (t_comm + t_compute - t_both) / min(t_comm, t_compute)


def _cupy(comm):
    """Bind this rank's GPU and return CuPy (:class:`ToolError` on every rank if a rank
    cannot)."""
    try:
        mpicoll.bind_device(comm)  # every rank raises, or none
    except mpicoll.MpicollError as exc:
        raise _cli.ToolError(f"--device gpu: {exc}", agreed=True) from None
    import cupy
    return cupy


@_cli.tool("benchmarks/overlap.py")
def main(argv=None, *, comm=None, out=None, cupy=None) -> int:
    """Measure and print (rank 0, to ``out``: default stdout); 1 if a result was wrong.

    ``comm``: the communicator (default ``MPI.COMM_WORLD``); every rank of it calls.
    ``cupy``: with ``--device gpu``, the CuPy module to use, its device already bound
    (tests); default: bind this rank's GPU and import CuPy.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    args = _parser().parse_args(argv, comm=comm)
    out = sys.stdout if out is None else out
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    side = args.matrix or MATRIX[args.device]
    n = max(args.size // dtype.itemsize, 1)
    if args.device == "gpu":
        xp = cupy if cupy is not None else _cupy(comm)
        products = CupyProducts(xp, side, rank)
    else:
        xp, products = None, HostProducts(side, rank)
    bench = Bench(comm, n, dtype, products, xp)
    # the products: at least as long as the AllReduce alone, the same count on every rank
    for _ in range(3):
        t = bench.medians(("comm", "compute"), 3, 1)
        t_product = t["compute"] / bench.products
        bench.products = max(1, math.ceil(t["comm"] / t_product))
    times = bench.medians(MODES, args.reps, args.warmup)
    wrong = comm.allreduce(bench.wrong(MODES), op=MPI.SUM)
    meta = _records.environment(comm)
    if rank == 0:
        threads = {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                   "MKL_NUM_THREADS") if os.environ.get(v)}
        what = ("NumPy float64" if xp is None else "CuPy float32, on their own stream,")
        lines = [
            f"# mpicoll overlap: {size} ranks, {meta['mpi_library']}, device {args.device}",
            f"# {platform.node()}: {os.cpu_count()} cores, BLAS threads {threads or 'not set'}",
            f"# iallreduce of {n} x {dtype.name} ({n * dtype.itemsize / 2**20:.1f} MiB) beside "
            f"{bench.products} {what} products of {side}x{side} "
            f"({t_product * 1e3:.2f} ms each); median of {args.reps} reps, slowest rank",
            f"{'mode':>8} {'time (ms)':>10} {'overlap':>8}",
        ]
        records = []
        for mode in MODES:
            ov = None if mode in ("comm", "compute") else \
                overlap(times["comm"], times["compute"], times[mode])
            lines.append(f"{mode:>8} {times[mode] * 1e3:10.2f} "
                         f"{'' if ov is None else f'{ov:8.2f}':>8}")
            records.append({"tool": "overlap", "mode": mode, "time_ms": times[mode] * 1e3,
                            "overlap": ov, "device": args.device, "bytes": n * dtype.itemsize,
                            "dtype": dtype.name, "matrix": side, "products": bench.products,
                            "reps": args.reps, "blas_threads": threads or None, **meta})
        lines.append(f"# wrong elements over all ranks and runs: {wrong}")
        print("\n".join(lines), file=out, flush=True)
        if args.json:
            _records.write_json(args.json, records)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
