"""Device check, stress: random collectives on CuPy arrays against MPI's built-in.

    mpirun -n 4 python tests/device/stress.py PATH [--cases 300] [--seconds 90] [--seed 11]

Each case draws (same on every rank) a collective, dtype, size (0 to ~4M
elements, log-uniform), in place or not, algorithm, and how its input is made:
a kernel that spins ~1 ms before writing it, queued on the call's stream, or on
a separate lagging stream the call's stream waits on (an event), and the
call's stream alternates between two non-blocking streams and the default one,
so work memory is reused across streams while earlier calls still run.
Results are read back in batches of 8 calls (later calls start before earlier
ones are checked).  Expected values: MPI's built-in on host copies of the
same rank-asymmetric data (float16: NumPy over allgathered inputs).  Rank 0
appends one JSON row per case to PATH as it goes, then a summary row; exit 1
if any case was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from support import gpucases

import mpicoll
from mpicoll.algorithms.ring import split

DTYPES = ("float32", "float64", "int32", "float16")
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("path")
    p.add_argument("--cases", type=int, default=300)
    p.add_argument("--seconds", type=float, default=90.0)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    import cupy

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mpicoll.bind_device(comm)
    kernel = cupy.RawKernel(gpucases.LATE_COPY_SRC, "late_copy")
    streams = [cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True),
               cupy.cuda.Stream.null]
    lagging = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(args.seed)  # same draws on every rank
    out = open(args.path, "a") if rank == 0 else None
    t0 = time.perf_counter()
    failures = cases = 0
    batch = []

    def produce(host, stream, lag):
        host = np.ascontiguousarray(host)
        with stream:
            src = cupy.asarray(host)
            dst = cupy.empty_like(src)
            dst.view(cupy.uint8).fill(0xA7)
        run_on = lagging if lag else stream
        if lag:  # the producer runs on another stream; the call's stream waits for it
            run_on.wait_event(stream.record())
        if src.nbytes:
            with run_on:
                kernel((80,), (256,), (src.view(cupy.uint8), dst.view(cupy.uint8),
                                       np.int64(src.nbytes), np.int64(2_000_000)))
        if lag:
            stream.wait_event(run_on.record())
        return dst

    def check():
        nonlocal failures
        rows = []
        for info, stream, y, ref in batch:
            with stream:
                got = cupy.asnumpy(y)
            ok = got.shape == ref.shape and np.array_equal(got, ref)
            ok = all(comm.allgather(ok))
            failures += not ok
            rows.append(dict(info, ok=ok))
        batch.clear()
        if out is not None:
            for row in rows:
                out.write(json.dumps(row) + "\n")
            out.flush()

    while cases < args.cases and time.perf_counter() - t0 < args.seconds:
        collective = COLLECTIVES[rng.integers(3)]
        dtype = DTYPES[rng.integers(len(DTYPES))]
        n = int(np.exp(rng.uniform(0, np.log(4 << 20)))) - 1
        in_place = bool(rng.integers(2))
        algorithm = ["auto", *sorted(gpucases._select.ALGORITHMS[collective])][
            rng.integers(1 + len(gpucases._select.ALGORITHMS[collective]))]
        op = ("SUM", "MAX")[rng.integers(2)]
        stream = streams[cases % len(streams)]
        lag = bool(rng.integers(2))
        info = {"section": "stress", "case": cases, "ranks": size, "collective": collective,
                "dtype": dtype, "n": n, "in_place": in_place, "algorithm": algorithm,
                "op": op if collective != "allgather" else None, "stream": cases % len(streams),
                "lagging_producer": lag}
        mpi_op = getattr(MPI, op)
        h = gpucases.data(n, dtype, rank, salt=cases)
        if collective == "allgather":
            counts = split(n, size)[0]
            mine = h[: counts[rank]]
            ref = np.concatenate(comm.allgather(mine))
            if in_place:
                full = np.zeros(n, dtype)
                lo = sum(counts[:rank])
                full[lo: lo + counts[rank]] = mine
                x = produce(full, stream, lag)
            else:
                x = produce(mine, stream, lag)
            with stream:
                y = mpicoll.allgather(x, comm=comm, counts=counts, out=x if in_place else None,
                                      algorithm=algorithm)
        else:
            ref = gpucases._reduce_ref(comm, h, op)
            x = produce(h, stream, lag)
            with stream:
                if collective == "allreduce":
                    y = mpicoll.allreduce(x, mpi_op, comm=comm, out=x if in_place else None,
                                          algorithm=algorithm)
                else:
                    counts = split(n, size)[0]
                    lo = sum(counts[:rank])
                    ref = ref[lo: lo + counts[rank]]
                    y = mpicoll.reduce_scatter(x, mpi_op, comm=comm, out=x if in_place else None,
                                               algorithm=algorithm)
        batch.append((info, stream, y, ref))
        cases += 1
        if len(batch) == 8:
            check()
    check()
    if out is not None:
        row = {"section": "stress", "summary": True, "ranks": size, "cases": cases,
               "failures": failures, "seconds": round(time.perf_counter() - t0, 1)}
        out.write(json.dumps(row) + "\n")
        out.close()
        print(json.dumps(row), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
