"""The two schedules of a float16/bfloat16 SUM, finely interleaved (docs/numerics.md).

"float32": the route "auto" took before the direct route existed (the input widened to
float32, reduced by the size's algorithm with float32 on the wire, rounded once; an
AllReduce above engine.select.SPLIT_BYTES reduce-scatters in float32 and all-gathers the
rounded words).  "direct": the blocks travel in the input type and their owner folds
them in float32 (``algorithm="direct"``).  To time the former under "auto", this script
switches the direct route's size rule off (``engine.select.DIRECT_ABOVE``) for its own
process.

Blocking calls of ``mpicoll.Comm(...).Allreduce`` / ``Reduce_scatter_block``, timed by
mpicoll.tools.harness: samples of several calls back to back, the two routes alternating
after a Barrier, the slowest rank's sample; rank 0 prints, per collective and size, the
median (µs per call) of each and their ratio (direct / float32).

Run: mpirun -n 2 python benchmarks/accumulate.py [DTYPE [MINBYTES [MAXBYTES [SAMPLES]]]]
(default float16, 4096 to 16 MiB by factors of 4, 15 samples)
"""

import sys

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.engine import select as _numerics
from mpicoll.tools.harness.timing import Variant, time_variants
from mpicoll.tools.harness.workload import DTYPES, rank_data

comm = MPI.COMM_WORLD


def main():
    n, rank = comm.Get_size(), comm.Get_rank()
    dtype = DTYPES[sys.argv[1] if len(sys.argv) > 1 else "float16"]
    lo = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    hi = int(sys.argv[3]) if len(sys.argv) > 3 else 16 << 20
    samples = int(sys.argv[4]) if len(sys.argv) > 4 else 15
    _numerics.DIRECT_ABOVE = dict.fromkeys(_numerics.DIRECT_ABOVE)  # "auto": float32 route
    routes = {"float32": mpicoll.Comm(comm), "direct": mpicoll.Comm(comm, algorithm="direct")}
    size = lo
    while size <= hi:
        count = size // dtype.itemsize // n * n
        x = rank_data(rank, n, count, dtype, "sum")  # rank-asymmetric, exact
        y, block = np.empty_like(x), np.empty(count // n, dtype)
        calls = {"allreduce": lambda c, x=x, y=y: c.Allreduce(x, y),
                 "reduce_scatter": lambda c, x=x, y=block: c.Reduce_scatter_block(x, y)}
        inner = max(1, min(20, (1 << 21) // size))  # calls per sample
        for collective, call in calls.items():
            t = time_variants(comm, {r: Variant(lambda c=c, call=call: call(c))
                                     for r, c in routes.items()},
                              warmup=3, samples=samples, inner=inner)
            if rank == 0:
                print(f"{collective} {dtype} {size} float32={t['float32'] * 1e6:.1f}us "
                      f"direct={t['direct'] * 1e6:.1f}us ratio={t['direct'] / t['float32']:.2f}",
                      flush=True)
        size *= 4


if __name__ == "__main__":
    main()
