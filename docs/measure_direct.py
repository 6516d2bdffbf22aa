"""Ring against direct (deterministic) ReduceScatter, finely interleaved (docs/numerics.md).

Batches of 10 blocking calls of ``mpicoll.Comm(algorithm=...).Reduce_scatter_block``
alternate between the algorithms after a Barrier, so both see the same load on a shared
machine; rank 0 prints the median batch mean (µs per call) and the ratio to the first.

Run: mpirun -n 3 python docs/measure_direct.py [BYTES [ALGORITHMS [BATCHES]]]
(BYTES a multiple of 4 x ranks; default 1 MiB at 2 ranks, ring,direct, 30 batches)
"""

import sys

import numpy as np
from mpi4py import MPI

import mpicoll

comm = MPI.COMM_WORLD


def main():
    n, rank = comm.Get_size(), comm.Get_rank()
    nbytes = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    algorithms = sys.argv[2].split(",") if len(sys.argv) > 2 else ["ring", "direct"]
    batches = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    count = nbytes // 4
    x = (np.arange(count, dtype=np.float32) * (rank + 1)) % 7  # rank-asymmetric
    y = np.empty(count // n, np.float32)
    comms = {a: mpicoll.Comm(comm, algorithm=a) for a in algorithms}
    times = {a: [] for a in algorithms}
    for a in algorithms:  # warm-up: contexts, schedules, plans
        for _ in range(5):
            comms[a].Reduce_scatter_block(x, y)
    for _ in range(batches):
        for a in algorithms:
            comm.Barrier()
            t0 = MPI.Wtime()
            for _ in range(10):
                comms[a].Reduce_scatter_block(x, y)
            times[a].append((MPI.Wtime() - t0) / 10)
    if rank == 0:
        med = {a: float(np.median(times[a])) * 1e6 for a in algorithms}
        base = med[algorithms[0]]
        print(" ".join(f"{a}={med[a]:.1f}us({med[a] / base:.2f})" for a in algorithms))


if __name__ == "__main__":
    main()
