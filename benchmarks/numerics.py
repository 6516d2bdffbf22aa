"""Deterministic mode and the two bfloat16 AllReduce forms (docs/numerics.md).

Timed by mpicoll.tools.harness: the variants of a size interleaved, samples of several
calls back to back after a Barrier, the slowest rank's sample, the median (ms per call).
The bfloat16 forms switch ``engine.select.SPLIT_BYTES`` (whole: one float32 AllReduce;
split: ReduceScatter in float32, AllGather of the rounded words) around their batches.

Run: mpirun -n 2 python benchmarks/numerics.py
"""

import contextlib

import ml_dtypes
import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.engine import select as numerics
from mpicoll.tools.harness.timing import Variant, time_variants

comm = MPI.COMM_WORLD


@contextlib.contextmanager
def split_above(nbytes):
    saved, numerics.SPLIT_BYTES = numerics.SPLIT_BYTES, nbytes
    try:
        yield
    finally:
        numerics.SPLIT_BYTES = saved


def ms(comm, variants, nbytes):
    inner = 20 if nbytes <= 1 << 20 else 5
    t = time_variants(comm, variants, warmup=2, samples=7, inner=inner)
    return {k: v * 1e3 for k, v in t.items()}


def main():
    rows = []
    for nbytes in (1 << 20, 16 << 20):
        x = np.random.default_rng(comm.rank).normal(size=nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        t = ms(comm, {
            "builtin": Variant(lambda: comm.Allreduce(x, out)),  # noqa: B023 (this iteration)
            "default": Variant(lambda: mpicoll.allreduce(x, out=out)),  # noqa: B023
            "deterministic": Variant(
                lambda: mpicoll.allreduce(x, out=out, deterministic=True)),  # noqa: B023
        }, nbytes)
        rows.append(f"| float32 | {nbytes >> 10} KiB | {t['builtin']:.2f} | {t['default']:.2f} | "
                    f"{t['deterministic']:.2f} | {t['deterministic'] / t['default']:.2f} |")
    for nbytes in (64 << 10, 256 << 10, 1 << 20, 16 << 20):
        x = np.random.default_rng(comm.rank).normal(size=nbytes // 2).astype(ml_dtypes.bfloat16)
        out = np.empty_like(x)
        wide = x.astype(np.float32)
        wide_out = np.empty_like(wide)
        t = ms(comm, {
            "whole": Variant(lambda: mpicoll.allreduce(x, out=out),  # noqa: B023
                             lambda: split_above(1 << 62)),
            "split": Variant(lambda: mpicoll.allreduce(x, out=out),  # noqa: B023
                             lambda: split_above(0)),
            "builtin": Variant(lambda: comm.Allreduce(wide, wide_out)),  # noqa: B023
        }, nbytes)
        rows.append(f"| bfloat16 | {nbytes >> 10} KiB | {t['whole']:.2f} | {t['split']:.2f} | "
                    f"{t['builtin']:.2f} |")
    if comm.rank == 0:
        print(MPI.Get_library_version().splitlines()[0])
        print("\n".join(rows))


if __name__ == "__main__":
    main()
