"""Ring against direct (deterministic) ReduceScatter, finely interleaved (docs/numerics.md).

Blocking calls of ``mpicoll.Comm(algorithm=...).Reduce_scatter_block``, timed by
mpicoll.tools.harness: samples of 10 calls back to back, the algorithms alternating after
a Barrier, the slowest rank's sample; rank 0 prints the median (µs per call) and the
ratio to the first.

Run: mpirun -n 3 python benchmarks/direct.py [BYTES [ALGORITHMS [SAMPLES]]]
(BYTES a multiple of 4 x ranks; default 1 MiB, ring,direct, 30 samples)
"""

import sys

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.tools.harness.timing import Variant, time_variants
from mpicoll.tools.harness.workload import rank_data

comm = MPI.COMM_WORLD


def main():
    n, rank = comm.Get_size(), comm.Get_rank()
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    algorithms = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ring", "direct"]
    samples = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    count = nbytes // 4
    x = rank_data(rank, n, count, np.dtype(np.float32), "sum")  # rank-asymmetric
    y = np.empty(count // n, np.float32)
    comms = {a: mpicoll.Comm(comm, algorithm=a) for a in algorithms}
    t = time_variants(comm, {a: Variant(lambda c=c: c.Reduce_scatter_block(x, y))
                             for a, c in comms.items()},
                      warmup=5, samples=samples, inner=10)
    if rank == 0:
        base = t[algorithms[0]]
        print(" ".join(f"{a}={t[a] * 1e6:.1f}us({t[a] / base:.2f})" for a in algorithms))


if __name__ == "__main__":
    main()
