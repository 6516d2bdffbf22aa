"""Measure deterministic mode and the two bfloat16 AllReduce forms (docs/numerics.md).

Run: mpirun -n 2 python docs/measure_numerics.py   (ms per call, best of three runs)
"""

import ml_dtypes
import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.engine import select as numerics

comm = MPI.COMM_WORLD


def best(fn, reps):
    """Best of three runs of ``reps`` calls, in ms per call."""
    times = []
    for _ in range(3):
        fn()
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(reps):
            fn()
        comm.Barrier()
        times.append((MPI.Wtime() - t0) / reps * 1e3)
    return min(times)


def main():
    rows = []
    for nbytes in (1 << 20, 16 << 20):
        x = np.random.default_rng(comm.rank).normal(size=nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        reps = 20 if nbytes <= 1 << 20 else 5
        b = best(lambda: comm.Allreduce(x, out), reps)  # noqa: B023 (called in this iteration)
        d = best(lambda: mpicoll.allreduce(x, out=out), reps)  # noqa: B023
        e = best(lambda: mpicoll.allreduce(x, out=out, deterministic=True), reps)  # noqa: B023
        rows.append(f"| float32 | {nbytes >> 10} KiB | {b:.2f} | {d:.2f} | {e:.2f} | {e / d:.2f} |")
    saved = numerics.SPLIT_BYTES
    for nbytes in (64 << 10, 256 << 10, 1 << 20, 16 << 20):
        x = np.random.default_rng(comm.rank).normal(size=nbytes // 2).astype(ml_dtypes.bfloat16)
        out = np.empty_like(x)
        wide = x.astype(np.float32)
        wide_out = np.empty_like(wide)
        reps = 20 if nbytes <= 1 << 20 else 5
        numerics.SPLIT_BYTES = 1 << 62
        whole = best(lambda: mpicoll.allreduce(x, out=out), reps)  # noqa: B023
        numerics.SPLIT_BYTES = 0
        split = best(lambda: mpicoll.allreduce(x, out=out), reps)  # noqa: B023
        numerics.SPLIT_BYTES = saved
        builtin = best(lambda: comm.Allreduce(wide, wide_out), reps)  # noqa: B023
        rows.append(f"| bfloat16 | {nbytes >> 10} KiB | {whole:.2f} | {split:.2f} | {builtin:.2f} |")
    if comm.rank == 0:
        print(MPI.Get_library_version().splitlines()[0])
        print("\n".join(rows))


if __name__ == "__main__":
    main()
