"""AllReduce: every rank contributes an array, every rank gets the elementwise sum.

    mpirun -n 4 python examples/allreduce.py       # rank 0: 10.0 ... rank 3: 10.0, then OK
    mpirun -n 8 python examples/allreduce.py       # 36.0 on every rank
    mpirun -n 4 python examples/allreduce.py --device gpu

Part 1 is the classic demo: rank r contributes r + 1, so with n ranks every
rank receives 1 + 2 + ... + n = n(n+1)/2.  Part 2 reduces a large random
array (a different one on every rank, its length not a multiple of the rank
count) through the drop-in ``mpicoll.Comm`` and checks it against MPI's own
``MPI_Allreduce`` on the same data.
"""

import _common as ex
import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.tools import results


def main():
    p = ex.parser(__doc__.splitlines()[0])
    p.add_argument("--count", type=ex.count, default=2**20 + 3,
                   help="elements of the large array (default 2**20 + 3)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    xp, device = ex.array_module(args.device)

    # Part 1: rank r contributes r + 1; mpicoll.allreduce returns the sum on every rank.
    # Each rank's line is sent to rank 0 and printed there in rank order, so
    # lines from different ranks cannot interleave.
    ex.print0(f"{size} rank(s) on {device}; rank r contributes r + 1, every rank receives the sum:")
    x = xp.array([rank + 1.0])
    y = mpicoll.allreduce(x, op=MPI.SUM)
    total = float(y[0])
    ex.print_ordered(f"rank {rank}: {total}")
    expected = size * (size + 1) / 2
    ok = ex.check(total == expected, f"allreduce of rank + 1 gave {total}, expected {expected}")

    # Part 2: a large rank-dependent array through the drop-in Comm, against MPI's built-in.
    n = args.count
    host = np.random.default_rng(2024 + rank).standard_normal(n)
    x = xp.asarray(host)
    y = xp.empty_like(x)
    mpicoll.Comm(comm).Allreduce(x, y, op=MPI.SUM)           # mpicoll's ring (or small-message) algorithm
    ref = np.empty_like(host)
    comm.Allreduce(host, ref, op=MPI.SUM)                    # MPI's own, on host copies
    abs_sum = np.empty_like(host)
    comm.Allreduce(np.abs(host), abs_sum, op=MPI.SUM)
    got = ex.to_host(y)
    # A sum of n numbers in any order is within gamma(n-1)*sum|x| of the exact sum,
    # gamma(k) ~ k*eps/2 (Higham); MPI's result is such a sum too, so mpicoll's may
    # differ from it by twice that: the one rule of mpicoll.tools.results, which
    # python -m mpicoll.verify, the benchmark and the tests use.
    ref = results.rounded_reference(ref, abs_sum, "SUM", size, "MPI_Allreduce")
    tol = results.tolerance("SUM", host.dtype, size, ref.scale, ref.error)
    ref = ref.value
    ok &= ex.report(ex.mismatch(got, ref, tol, "allreduce of the large array", "MPI_Allreduce"))
    ok &= ex.check(np.array_equal(ex.to_host(x), host), "the input array was modified")
    ok &= ex.check(ex.same_on_all_ranks(y), "ranks hold different results")
    if n:
        ex.print0(f"large array: {n} float64 per rank, max |mpicoll - MPI| = "
               f"{np.abs(got - ref).max():.3g} (allowed: mpicoll's rounding rule, at most {tol.max():.3g})")
    ex.finish(ok, f"mpicoll allreduce matches MPI_Allreduce on {size} rank(s) ({device})")


if __name__ == "__main__":
    main()
