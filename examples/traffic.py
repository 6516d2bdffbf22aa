"""Bytes each rank sends: AllReduce vs ReduceScatter + AllGather vs AllGather, measured.

    mpirun -n 4 python examples/traffic.py
    mpirun -n 8 python examples/traffic.py --count 1000003 --dtype float32
    mpirun -n 4 python examples/traffic.py --device gpu

Every figure is counted by ``mpicoll.traffic()`` while the collective runs
(the messages mpicoll's channel completes on that rank), and printed beside
the formula of the ring algorithm, for an array of N bytes per rank on n
ranks:

=============================  ===================  =========
collective (ring)              bytes sent per rank  steps
=============================  ===================  =========
AllReduce                      2(n-1)/n * N         2(n-1)
ReduceScatter                  (n-1)/n * N          n-1
AllGather (N = gathered size)  (n-1)/n * N          n-1
ReduceScatter + AllGather      2(n-1)/n * N         2(n-1)
=============================  ===================  =========

The formulas are exact for the mean over ranks; one rank differs from it by
less than one element per collective (its own block is one element longer
or shorter when N is not a multiple of n elements).  Part 2 measures the
same AllReduce with every algorithm mpicoll has.  The example checks the
results against MPI's built-in, the means against the formulas and each
rank against the one-element bound, and prints OK or FAILED.
"""

from fractions import Fraction

import _common as ex
import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.engine import select as _select

DTYPES = ("float32", "float64", "int32", "int64")


def measure(fn):
    """(result, this rank's CallTraffic) of ``fn()``, run under mpicoll.traffic()."""
    with mpicoll.traffic() as t:
        result = fn()
    return result, t.calls[-1]


def main():
    p = ex.parser(__doc__.splitlines()[0])
    p.add_argument("--count", type=ex.count, default=1_000_003,
                   help="elements of the array each rank contributes (default 1000003)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="element type (default float32)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, n = comm.rank, comm.size
    xp, device = ex.array_module(args.device)
    dtype = np.dtype(args.dtype)
    N = args.count * dtype.itemsize
    ex.print0(f"{n} rank(s) on {device}; each rank contributes {args.count} {dtype} = N = {N:,} bytes")

    # Small integers: every sum is exact in any order, so results compare bitwise.
    host = ((np.arange(args.count) * 7 + rank) % 13).astype(dtype)
    x = xp.asarray(host)
    ref = np.empty_like(host)
    comm.Allreduce(host, ref, MPI.SUM)
    counts, displs = ex.blocks(args.count, n)

    ok = True
    ar, t_ar = measure(lambda: mpicoll.allreduce(x, algorithm="ring"))
    rs, t_rs = measure(lambda: mpicoll.reduce_scatter(x, algorithm="ring"))
    ag, t_ag = measure(lambda: mpicoll.allgather(rs, counts=counts, algorithm="ring"))
    ok &= ex.report(ex.mismatch(ex.to_host(ar), ref, name="allreduce"))
    ok &= ex.report(ex.mismatch(ex.to_host(rs), ref[displs[rank]: displs[rank] + counts[rank]],
                                name="reduce_scatter"))
    ok &= ex.report(ex.mismatch(ex.to_host(ag), ref, name="reduce_scatter + allgather"))

    rows = comm.gather((t_ar.bytes_sent, t_rs.bytes_sent, t_ag.bytes_sent,
                        t_ar.send_steps, t_rs.send_steps, t_ag.send_steps))
    one = Fraction(n - 1, n) * N
    formulas = (2 * one, one, one, 2 * one)
    names = ("AllReduce", "ReduceScatter", "AllGather", "RS + AG")
    ok_means = True
    if rank == 0:
        print(f"\nbytes sent per rank (ring algorithms), measured with mpicoll.traffic(); "
              f"formula with N = {N:,} B:")
        print(f"  {'rank':>6} " + " ".join(f"{h:>16}" for h in names))
        table = [(a, r, g, r + g) for a, r, g, *_ in rows]
        for r, vals in enumerate(table):
            print(f"  {r:>6} " + " ".join(f"{v:>16,}" for v in vals))
        means = [Fraction(sum(col), n) for col in zip(*table)]
        print(f"  {'mean':>6} " + " ".join(f"{float(m):>16,.1f}" for m in means))
        print(f"  {'formula':>6} " + " ".join(f"{float(f):>16,.1f}" for f in formulas))
        print("  formula: " + ", ".join(f"{h} {e}" for h, e in zip(
            names, ("2(n-1)/n*N", "(n-1)/n*N", "(n-1)/n*N", "2(n-1)/n*N"))))
        steps = sorted({(a, r, g) for *_, a, r, g in rows})
        print(f"  steps per rank (AllReduce, ReduceScatter, AllGather): {steps}; "
              f"formula ({2 * (n - 1)}, {n - 1}, {n - 1}) when every block is non-empty")
        for name, m, f, col in zip(names, means, formulas, zip(*table)):
            if m != f:
                ok_means = ex.report(f"{name}: mean {float(m):,.1f} bytes is not the formula {float(f):,.1f}")
            bound = dtype.itemsize * (2 if name in ("AllReduce", "RS + AG") else 1)
            worst = max(abs(v - f) for v in col)
            if worst >= bound:
                ok_means = ex.report(f"{name}: a rank is {float(worst)} bytes from the formula")
    ok &= comm.bcast(ok_means)

    # Part 2: the same AllReduce with every algorithm.
    algos = list(_select.ALGORITHMS["allreduce"])
    results = []
    for algo in algos:
        y, t = measure(lambda algo=algo: mpicoll.allreduce(x, algorithm=algo))
        ok &= ex.report(ex.mismatch(ex.to_host(y), ref, name=f"allreduce ({algo})"))
        results.append((t.bytes_sent, t.messages_sent, t.send_steps))
    everyone = comm.gather(results)
    if rank == 0:
        print("\nAllReduce by algorithm: bytes sent per rank (mean over ranks, in units of N), "
              "messages and steps (max over ranks)")
        print(f"  {'algorithm':>20} {'bytes/N':>10} {'messages':>9} {'steps':>6}")
        for i, algo in enumerate(algos):
            col = [everyone[r][i] for r in range(n)]
            mean = sum(c[0] for c in col) / n / N if N else 0.0
            steps = {c[2] for c in col}
            shown = max(steps) if None not in steps else "-"
            print(f"  {algo:>20} {mean:>10.4f} {max(c[1] for c in col):>9} {shown!s:>6}")
        print(f"  (ring formula 2(n-1)/n = {2 * (n - 1) / n:.4f}; steps: rounds in which a "
              f"rank sent, '-' where unknown)")

    ex.finish(ok, f"traffic of {n} rank(s) measured; means equal the ring formulas")


if __name__ == "__main__":
    main()
