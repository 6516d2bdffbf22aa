"""Device check, ceilings: what the hardware allows, for the benchmark's "fraction of floor".

Run under mpirun at 2 and at 4 ranks (all on the one GPU); rank 0 appends one JSON
row per measurement to PATH (row by row, so a cut-off run keeps what it measured):

    mpirun -n 4 python tests/device/ceilings.py PATH

Every process measures in the same timed window: a Barrier, each process's copies
(or messages), a synchronisation of its stream, a Barrier; the window is the slowest
process's time from the first Barrier to the second, and the rate is the bytes all
processes moved over it.  So processes that share a copy engine or a bus are measured
sharing it, as the collectives' ranks do, not as rates of loops that overlapped only
in part, summed.  Best of three windows.

Rows: {"section": "ceiling", "what": ..., "procs": P, "bytes": B, "gbps_total": the
processes' bytes over the window (GB/s, 1e9 bytes/s), "gbps": gbps_total / P (each
process's share)}.  What: h2d_pinned, d2h_pinned (cudaMemcpyAsync from/to pinned
host memory), d2d (device copy), host_memcpy (NumPy copy), mpi_host_p2p (rank pairs
0-1, 2-3, ... ping-pong host NumPy buffers; the bytes one way over half the time
of a round trip, as one direction's bandwidth), at 4 MiB (the staged segment) and
64 MiB (the size the targets are judged at).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
from mpi4py import MPI

SIZES = (4 << 20, 64 << 20)
WINDOWS = 3
WINDOW_BYTES = 512 << 20  # each process's bytes per window (at least REPS_MIN copies)
REPS_MIN = 4


def window(comm, fn, reps, sync=lambda: None) -> float:
    """Seconds of the shortest of :data:`WINDOWS` windows in which every process runs
    ``fn`` ``reps`` times (then ``sync``), from one Barrier to the next: the slowest
    process's time (collective)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(WINDOWS):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        comm.Barrier()
        best = min(best, comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return best


def rates(moved: int, seconds: float, procs: int) -> tuple:
    """(total GB/s, per process GB/s) of ``moved`` bytes (all processes) in ``seconds``."""
    total = moved / seconds / 1e9
    return round(total, 3), round(total / procs, 3)


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

    def emit(what, nbytes, procs, moved, seconds):
        total, each = rates(moved, seconds, procs)
        if rank == 0:
            row = {"section": "ceiling", "what": what, "procs": procs, "bytes": nbytes,
                   "gbps": each, "gbps_total": total, "window_s": round(seconds, 6)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print(json.dumps(row), flush=True)

    def copies(n):
        host = cupyx.empty_pinned(n, dtype=np.uint8)
        host[:] = 1
        dev = cupy.empty(n, dtype=cupy.uint8)
        dev2 = cupy.empty(n, dtype=cupy.uint8)
        reps = max(REPS_MIN, WINDOW_BYTES // n)
        for what, dst, src, kind in (
                ("h2d_pinned", dev.data.ptr, host.ctypes.data, rt.memcpyHostToDevice),
                ("d2h_pinned", host.ctypes.data, dev.data.ptr, rt.memcpyDeviceToHost),
                ("d2d", dev2.data.ptr, dev.data.ptr, rt.memcpyDeviceToDevice)):
            def copy(dst=dst, src=src, kind=kind):
                rt.memcpyAsync(dst, src, n, kind, stream.ptr)
            emit(what, n, size, size * reps * n, window(comm, copy, reps, stream.synchronize))
        del host, dev, dev2

    def host_side(n):
        a, b = np.ones(n, np.uint8), np.empty(n, np.uint8)
        reps = max(REPS_MIN, WINDOW_BYTES // n // 4)
        emit("host_memcpy", n, size, size * reps * n, window(comm, lambda: np.copyto(b, a), reps))
        pairs = size // 2
        if pairs == 0:
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
        # a ping-pong moves one way at a time: each process's n bytes travel in half the window
        emit("mpi_host_p2p", n, 2 * pairs, 2 * pairs * reps * n, window(comm, pingpong, reps) / 2)

    for n in SIZES:
        copies(n)
        host_side(n)
    if out is not None:
        out.close()


if __name__ == "__main__":
    main(sys.argv[1])
