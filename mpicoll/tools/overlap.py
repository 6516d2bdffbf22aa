"""Measure how much a non-blocking AllReduce overlaps NumPy work.

Usage (every rank runs it; rank 0 prints)::

    mpirun -n 2 python -m mpicoll.tools.overlap
    mpirun -n 2 python -m mpicoll.tools.overlap --size 64M --reps 9 --dtype float32

One rank's array of ``--size`` bytes is reduced with ``mpicoll.iallreduce``
beside a run of matrix products (``--matrix`` square float64 products,
their number chosen so that they take about as long as the AllReduce alone,
the same on every rank).  Timed ``--reps`` times after a warm-up, the modes
interleaved, with a Barrier before each run and the slowest rank's time
counted:

``comm``      start + wait, nothing else
``compute``   the products alone
``wait``      start, the products, wait (progress only inside MPI calls)
``test``      start, the products with ``test()`` after each one, wait
``thread``    as ``wait`` with the progress thread on (``progress=True``)

Reported: medians, and for each overlapped mode
``overlap = (t_comm + t_compute - t_both) / min(t_comm, t_compute)``: 1 when
the shorter of the two is hidden completely, 0 when the two run one after
the other, negative when running them together costs more than that.  Every
result is checked exactly against MPI's built-in AllReduce (the inputs are
small integers, exact in every type); the exit status is 1 if any is wrong.

BLAS threads compete with the ranks and the progress thread for cores: run
with ``OMP_NUM_THREADS=1`` (the tool prints what it found).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys

import numpy as np
from mpi4py import MPI

import mpicoll

from ..core.config import parse_bytes

MODES = ("comm", "compute", "wait", "test", "thread")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mpicoll.tools.overlap",
                                description=__doc__.splitlines()[0])
    p.add_argument("--size", default="32M", help="bytes per rank's array (default 32M)")
    p.add_argument("--dtype", default="float64", choices=("float32", "float64", "int32", "int64"))
    p.add_argument("--matrix", type=int, default=256,
                   help="side of the square float64 matrices multiplied (default 256)")
    p.add_argument("--reps", type=int, default=7, help="timed repetitions per mode (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first (default 2)")
    return p


class _Bench:
    def __init__(self, comm, n, dtype, side):
        self.comm = comm
        rank = comm.Get_rank()
        # small integers: every sum is exact in every type
        self.x = ((np.arange(n) + 7 * rank) % 13).astype(dtype)
        self.y = np.empty_like(self.x)
        self.expected = np.empty_like(self.x)
        MPI.Intracomm.Allreduce(comm, self.x, self.expected, MPI.SUM)
        rng = np.random.default_rng(rank)
        self.a = rng.standard_normal((side, side))
        self.b = rng.standard_normal((side, side))
        self.c = np.empty((side, side))
        self.products = 1
        self.wrong = 0

    def product(self):
        np.matmul(self.a, self.b, out=self.c)

    def run(self, mode):
        """One repetition of ``mode``; returns this rank's seconds."""
        self.y.fill(0)
        self.comm.Barrier()
        t0 = MPI.Wtime()
        if mode == "compute":
            for _ in range(self.products):
                self.product()
            return MPI.Wtime() - t0
        with mpicoll.options(progress=mode == "thread"):
            h = mpicoll.iallreduce(self.x, out=self.y, comm=self.comm)
            if mode != "comm":
                for _ in range(self.products):
                    self.product()
                    if mode == "test":
                        h.test()
            h.wait()
        elapsed = MPI.Wtime() - t0
        self.wrong += int(np.count_nonzero(self.y != self.expected))
        return elapsed

    def medians(self, modes, reps, warmup):
        """{mode: median over ``reps`` of the slowest rank's time}, the modes interleaved.

        Each repetition runs every mode once, so a change in the machine's
        load affects all modes alike; ``warmup`` untimed rounds come first.
        """
        for _ in range(warmup):
            for mode in modes:
                self.run(mode)
        times = {mode: [] for mode in modes}
        for _ in range(reps):
            for mode in modes:
                times[mode].append(self.comm.allreduce(self.run(mode), op=MPI.MAX))
        return {mode: statistics.median(t) for mode, t in times.items()}


def overlap(t_comm: float, t_compute: float, t_both: float) -> float:
    """(t_comm + t_compute - t_both) / min(t_comm, t_compute): the fraction of the shorter hidden."""
    return (t_comm + t_compute - t_both) / min(t_comm, t_compute)


def main(argv=None, *, comm=None, out=None) -> int:
    """Measure and print (rank 0, to ``out``: default stdout); 1 if a result was wrong.

    ``comm``: the communicator (default ``MPI.COMM_WORLD``); every rank of it calls.
    """
    args = _parser().parse_args(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    out = sys.stdout if out is None else out
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    n = max(parse_bytes(args.size, "--size") // dtype.itemsize, 1)
    bench = _Bench(comm, n, dtype, args.matrix)
    # the products: as many as the AllReduce alone takes, the same count on every rank
    for _ in range(3):
        t = bench.medians(("comm", "compute"), 3, 1)
        t_product = t["compute"] / bench.products
        bench.products = max(1, round(t["comm"] / t_product))
    times = bench.medians(MODES, args.reps, args.warmup)
    wrong = comm.allreduce(bench.wrong, op=MPI.SUM)
    if rank == 0:
        threads = {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                   "MKL_NUM_THREADS") if os.environ.get(v)}
        lines = [
            f"# mpicoll overlap: {size} ranks, {MPI.Get_library_version().splitlines()[0].strip()}",
            f"# {platform.node()}: {os.cpu_count()} cores, BLAS threads {threads or 'not set'}, "
            f"load average {os.getloadavg()[0]:.2f}",
            f"# iallreduce of {n} x {dtype.name} ({n * dtype.itemsize / 2**20:.1f} MiB) beside "
            f"{bench.products} products of {args.matrix}x{args.matrix} float64 "
            f"({t_product * 1e3:.2f} ms each); median of {args.reps} reps, slowest rank",
            f"{'mode':>8} {'time (ms)':>10} {'overlap':>8}",
        ]
        for mode in MODES:
            ov = "" if mode in ("comm", "compute") else \
                f"{overlap(times['comm'], times['compute'], times[mode]):8.2f}"
            lines.append(f"{mode:>8} {times[mode] * 1e3:10.2f} {ov:>8}")
        lines.append(f"# wrong elements over all ranks and runs: {wrong}")
        print("\n".join(lines), file=out, flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
