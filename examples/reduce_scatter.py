"""ReduceScatter: reduce over all ranks, and rank r keeps only block r of the result.

    mpirun -n 4 python examples/reduce_scatter.py
    mpirun -n 4 python examples/reduce_scatter.py --device gpu

Part 1 shows what each rank holds before and after.  The input has 2n + 1
elements for n ranks, so the blocks follow numpy.array_split: the first
rank's block is one element longer.  Part 2 reduce-scatters a large random
array (different on every rank) and checks each rank's block against MPI's
own ``MPI_Reduce_scatter`` with the same counts.
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
    ex.print0(f"{size} rank(s) on {device}")

    # Part 1: rank r holds x[i] = 10r + i, i < 2n + 1.  The sum over ranks is
    # n*i + 10*n(n-1)/2; rank r receives block r of it.
    m = 2 * size + 1
    x = xp.arange(m) + 10 * rank
    ex.show(f"\nbefore: rank r holds x[i] = 10r + i, {m} elements", x)
    y = mpicoll.reduce_scatter(x, op=MPI.SUM)
    counts, displs = ex.blocks(m, size)
    ex.show(f"after y = mpicoll.reduce_scatter(x): rank r holds block r of the sum "
         f"(block lengths {counts})", y)
    total = size * np.arange(m) + 10 * size * (size - 1) // 2
    expected = total[displs[rank]: displs[rank] + counts[rank]]
    ok = ex.report(ex.mismatch(ex.to_host(y), expected, name="reduce_scatter",
                         reference="the expected block"))
    ex.print0(f"(the full sum would be {total}; an allreduce gives all of it to every rank)")

    # Part 2: a large array against MPI_Reduce_scatter with the same block counts.
    n = args.count
    counts, displs = ex.blocks(n, size)
    host = np.random.default_rng(2024 + rank).standard_normal(n)
    x = xp.asarray(host)
    y = mpicoll.reduce_scatter(x, op=MPI.SUM)
    ref = np.empty(counts[rank])
    comm.Reduce_scatter(host, ref, recvcounts=counts, op=MPI.SUM)
    abs_sum = np.empty(counts[rank])
    comm.Reduce_scatter(np.abs(host), abs_sum, recvcounts=counts, op=MPI.SUM)
    got = ex.to_host(y)
    # A sum of n numbers in any order is within gamma(n-1)*sum|x| of the exact sum,
    # gamma(k) ~ k*eps/2 (Higham); MPI's result is such a sum too, so mpicoll's may
    # differ from it by twice that: the one rule of mpicoll.tools.results, which
    # python -m mpicoll.verify, the benchmark and the tests use.
    ref = results.rounded_reference(ref, abs_sum, "SUM", size, "MPI_Reduce_scatter")
    tol = results.tolerance("SUM", host.dtype, size, ref.scale, ref.error)
    ref = ref.value
    ok &= ex.report(ex.mismatch(got, ref, tol, "reduce_scatter of the large array",
                          "MPI_Reduce_scatter"))
    ok &= ex.check(np.array_equal(ex.to_host(x), host), "the input array was modified")
    err = comm.allreduce(float(np.abs(got - ref).max()) if got.size else 0.0, op=MPI.MAX)
    ex.print0(f"\nlarge array: {n} float64, blocks of {min(counts)}..{max(counts)} elements; "
           f"max |mpicoll - MPI| = {err:.3g} (allowed: mpicoll's rounding rule)")
    ex.finish(ok, f"mpicoll reduce_scatter matches MPI_Reduce_scatter on {size} rank(s) ({device})")


if __name__ == "__main__":
    main()
