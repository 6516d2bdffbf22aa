"""Device check, ceilings: what the hardware allows, for the benchmark's "fraction of floor".

Run under mpirun at 1 and at 4 ranks (all on the one GPU); each rank measures at
once (after a Barrier), rank 0 appends one JSON row per measurement to PATH
(row by row, so a cut-off run keeps what it measured):

    mpirun -n 4 python tests/device/ceilings.py PATH

Rows: {"section": "ceiling", "what": ..., "procs": P, "bytes": B, "gbps": per-process
GB/s (1e9 bytes/s), "gbps_total": sum over processes}.  What: h2d_pinned, d2h_pinned
(cudaMemcpyAsync from/to pinned host memory), d2d (device copy), host_memcpy (NumPy
copy), mpi_host_p2p (ping-pong between rank pairs 0-1, 2-3, ..., host NumPy
buffers, one direction's bandwidth), at 1, 4 and 16 MiB.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

SIZES = (1 << 20, 4 << 20, 16 << 20)


def timeit(fn, reps, sync=lambda: None):
    fn()
    sync()
    best = float("inf")
    for _ in range(3):
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def main(path):
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    import cupy
    import cupyx

    import mpicoll
    mpicoll.bind_device(comm)
    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    out = open(path, "a") if rank == 0 else None

    def emit(what, nbytes, seconds):
        per = nbytes / seconds / 1e9
        rates = comm.gather(per, root=0)
        if rank == 0:
            row = {"section": "ceiling", "what": what, "procs": size, "bytes": nbytes,
                   "gbps": round(min(rates), 3), "gbps_total": round(sum(rates), 3)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)

    def copies(n):
        host = cupyx.empty_pinned(n, dtype=np.uint8)
        host[:] = 1
        dev = cupy.empty(n, dtype=cupy.uint8)
        dev2 = cupy.empty(n, dtype=cupy.uint8)
        reps = max(3, (64 << 20) // n)
        for what, dst, src, kind in (
                ("h2d_pinned", dev.data.ptr, host.ctypes.data, rt.memcpyHostToDevice),
                ("d2h_pinned", host.ctypes.data, dev.data.ptr, rt.memcpyDeviceToHost),
                ("d2d", dev2.data.ptr, dev.data.ptr, rt.memcpyDeviceToDevice)):
            def copy(dst=dst, src=src, kind=kind):
                rt.memcpyAsync(dst, src, n, kind, stream.ptr)
            emit(what, n, timeit(copy, reps, stream.synchronize))

    def host_side(n):
        a, b = np.ones(n, np.uint8), np.empty(n, np.uint8)
        reps = max(3, (64 << 20) // n)
        emit("host_memcpy", n, timeit(lambda: np.copyto(b, a), reps))
        if size < 2:
            return
        peer = rank ^ 1 if (rank ^ 1) < size else None

        def pingpong():
            if peer is None:
                return
            if rank % 2 == 0:
                comm.Send(a, peer, 5)
                comm.Recv(b, peer, 6)
            else:
                comm.Recv(b, peer, 5)
                comm.Send(a, peer, 6)
        emit("mpi_host_p2p", n, timeit(pingpong, reps) / 2)

    for n in SIZES:
        copies(n)
        host_side(n)
    if out is not None:
        out.close()


if __name__ == "__main__":
    main(sys.argv[1])
