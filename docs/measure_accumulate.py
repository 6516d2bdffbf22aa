"""The two schedules of a float16/bfloat16 SUM, finely interleaved (docs/numerics.md).

"float32": the route "auto" took before the direct route existed (the input widened to
float32, reduced by the size's algorithm with float32 on the wire, rounded once; an
AllReduce above engine.select.SPLIT_BYTES reduce-scatters in float32 and all-gathers the
rounded words).  "direct": the blocks travel in the input type and their owner folds
them in float32 (``algorithm="direct"``).  To time the former under "auto", this script
switches the direct route's size rule off (``DIRECT_ABOVE``) for its own process.

Batches of blocking calls of ``mpicoll.Comm(...).Allreduce`` / ``Reduce_scatter_block``
alternate between the two after a Barrier, so both see the same load on a shared
machine; rank 0 prints, per collective and size, the median batch mean (µs per call)
of each and their ratio (direct / float32).

Run: mpirun -n 2 python docs/measure_accumulate.py [DTYPE [MINBYTES [MAXBYTES [BATCHES]]]]
(default float16, 4096 to 16 MiB by factors of 4, 15 batches)
"""

import sys

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.engine import select as _numerics

comm = MPI.COMM_WORLD


def dtype_of(name):
    if name == "float16":
        return np.dtype(np.float16)
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name))


def main():
    n, rank = comm.Get_size(), comm.Get_rank()
    dtype = dtype_of(sys.argv[1] if len(sys.argv) > 1 else "float16")
    lo = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    hi = int(sys.argv[3]) if len(sys.argv) > 3 else 16 << 20
    batches = int(sys.argv[4]) if len(sys.argv) > 4 else 15
    _numerics.DIRECT_ABOVE = dict.fromkeys(_numerics.DIRECT_ABOVE)  # "auto": float32 route
    routes = {"float32": mpicoll.Comm(comm), "direct": mpicoll.Comm(comm, algorithm="direct")}
    size = lo
    while size <= hi:
        count = size // dtype.itemsize // n * n
        x = ((np.arange(count) * (rank + 1)) % 7).astype(dtype)  # rank-asymmetric, exact
        y, block = np.empty_like(x), np.empty(count // n, dtype)
        calls = {"allreduce": lambda c, x=x, y=y: c.Allreduce(x, y),
                 "reduce_scatter": lambda c, x=x, y=block: c.Reduce_scatter_block(x, y)}
        per = max(1, min(20, (1 << 21) // size))  # calls per batch
        for collective, call in calls.items():
            times = {r: [] for r in routes}
            for r in routes:  # warm-up: contexts, schedules, plans
                for _ in range(3):
                    call(routes[r])
            for _ in range(batches):
                for r, c in routes.items():
                    comm.Barrier()
                    t0 = MPI.Wtime()
                    for _ in range(per):
                        call(c)
                    times[r].append((MPI.Wtime() - t0) / per)
            if rank == 0:
                med = {r: float(np.median(t)) * 1e6 for r, t in times.items()}
                print(f"{collective} {dtype} {size} float32={med['float32']:.1f}us "
                      f"direct={med['direct']:.1f}us ratio={med['direct'] / med['float32']:.2f}",
                      flush=True)
        size *= 4


if __name__ == "__main__":
    main()
