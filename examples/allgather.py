"""AllGather: every rank contributes a block, every rank gets all blocks in rank order.

    mpirun -n 4 python examples/allgather.py
    mpirun -n 4 python examples/allgather.py --device gpu

Part 1 shows what each rank holds before and after, for equal blocks
(``mpicoll.allgather(x)``) and for blocks of different lengths
(``counts=``, MPI's Allgatherv).  Part 2 gathers a large array whose blocks
follow numpy.array_split (lengths differ by at most one) and checks it
bitwise against MPI's own ``MPI_Allgatherv``.
"""

import _common as ex
import numpy as np
from mpi4py import MPI

import mpicoll


def main():
    p = ex.parser(__doc__.splitlines()[0])
    p.add_argument("--count", type=ex.count, default=2**20 + 3,
                   help="elements of the large gathered array (default 2**20 + 3)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    xp, device = ex.array_module(args.device)
    ex.print0(f"{size} rank(s) on {device}")

    # Part 1a: equal blocks.  Rank r holds [10r, 10r + 1].
    x = xp.array([10 * rank, 10 * rank + 1])
    ex.show("\nbefore: rank r holds x = [10r, 10r+1]", x)
    y = mpicoll.allgather(x)
    ex.show("after y = mpicoll.allgather(x): every rank holds all blocks in rank order", y)
    expected = np.array([10 * r + i for r in range(size) for i in (0, 1)])
    ok = ex.report(ex.mismatch(ex.to_host(y), expected, name="allgather", reference="the expected blocks"))

    # Part 1b: blocks of different lengths.  Rank r holds r + 1 copies of r.
    counts = [r + 1 for r in range(size)]
    x = xp.full(counts[rank], rank)
    ex.show(f"\nbefore: rank r holds r + 1 copies of r; counts = {counts}", x)
    y = mpicoll.allgather(x, counts=counts)
    ex.show("after y = mpicoll.allgather(x, counts=counts)  (an allgatherv)", y)
    expected = np.repeat(np.arange(size), counts)
    ok &= ex.report(ex.mismatch(ex.to_host(y), expected, name="allgather with counts",
                          reference="the expected blocks"))

    # Part 2: a large array, blocks split as numpy.array_split does, against MPI_Allgatherv.
    counts, displs = ex.blocks(args.count, size)
    host = np.random.default_rng(2024 + rank).standard_normal(counts[rank])
    x = xp.asarray(host)
    y = mpicoll.allgather(x, counts=counts)
    ref = np.empty(args.count)
    comm.Allgatherv(host, [ref, counts, displs, MPI.DOUBLE])
    ok &= ex.report(ex.mismatch(ex.to_host(y), ref, name="allgather of the large array",
                          reference="MPI_Allgatherv"))
    ok &= ex.check(np.array_equal(ex.to_host(x), host), "the input block was modified")
    ok &= ex.check(ex.same_on_all_ranks(y), "ranks hold different results")
    ex.print0(f"\nlarge array: {args.count} float64 gathered from blocks of "
           f"{min(counts)}..{max(counts)} elements; compared bitwise with MPI_Allgatherv")
    ex.finish(ok, f"mpicoll allgather matches MPI_Allgatherv on {size} rank(s) ({device})")


if __name__ == "__main__":
    main()
