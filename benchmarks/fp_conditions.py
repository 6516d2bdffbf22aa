"""What a collective returns for floating-point conditions: overflow, inf - inf, NaN.

Run under an MPI launcher (2 ranks or more)::

    mpirun -n 3 python benchmarks/fp_conditions.py

Prints the Markdown table of docs/numerics.md ("Overflow, NaN and Inf"): for every
floating type, what mpicoll's AllReduce returns (every value any algorithm gave on any
rank, ``/`` between them) beside MPI's built-in where MPI has the type.  Each case
gives every rank its value: ``max`` is the type's largest finite value.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.engine import select

WORLD = MPI.COMM_WORLD


def _types():
    out = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16)]
    try:
        import ml_dtypes
        out += [np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn),
                np.dtype(ml_dtypes.float8_e5m2)]
    except ImportError:
        pass
    return out


def _show(values) -> str:
    vals = sorted({str(v) for v in values})
    return " / ".join(vals)


CASES = [  # (what, op, value(rank, max))
    ("max + max", MPI.SUM, lambda r, m: m if r < 2 else 0.0),
    ("max + max - max", MPI.SUM, lambda r, m: (m, m, -m)[r] if r < 3 else 0.0),
    ("inf + -inf", MPI.SUM, lambda r, m: np.inf if r == 0 else -np.inf if r == 1 else 0.0),
    ("MAX of NaN (rank 0) and 1", MPI.MAX, lambda r, m: np.nan if r == 0 else 1.0),
    ("MIN of 1 (rank 0) and NaN", MPI.MIN, lambda r, m: 1.0 if r == 0 else np.nan),
]


def main() -> int:
    rank = WORLD.rank
    rows = []
    for dtype in _types():
        native = dtype in (np.float64, np.float32, np.float16)
        top = float(np.finfo(dtype).max if native else __import__("ml_dtypes").finfo(dtype).max)
        for what, op, value in CASES:
            with np.errstate(all="ignore"):
                x = np.full(4, value(rank, top)).astype(dtype)
            got = {}
            for accumulate in (None, False):
                if accumulate is False and op is not MPI.SUM:
                    continue
                for algorithm in select.names("allreduce"):
                    y = mpicoll.allreduce(x, op=op, algorithm=algorithm, accumulate=accumulate)
                    got.setdefault(accumulate, set()).add(str(y[0].astype(np.float64)))
            builtin = "n/a"
            if native and dtype.itemsize >= 4:
                with np.errstate(all="ignore"):
                    ref = np.empty_like(x)
                    WORLD.Allreduce(x, ref, op=op)
                builtin = str(ref[0])
            every = WORLD.allgather((got, builtin))
            rows.append((str(dtype), what, _show(set().union(*[g[0].get(None, set())
                                                                  for g in every])),
                         _show(set().union(*[g[0].get(False, set()) for g in every]))
                         if op is MPI.SUM else "",
                         _show({g[1] for g in every})))
    if rank == 0:
        print("| type | case | mpicoll | `accumulate=False` | MPI's built-in |")
        print("|---|---|---|---|---|")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
