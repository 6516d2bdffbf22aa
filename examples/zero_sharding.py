"""ZeRO-style sharded Adam: ReduceScatter the gradients, update one shard, AllGather the parameters.

    mpirun -n 4 python examples/zero_sharding.py
    mpirun -n 4 python examples/zero_sharding.py --params 10000000 --steps 5
    mpirun -n 4 python examples/zero_sharding.py --device gpu

Plain data parallelism keeps the whole optimizer state (Adam's m and v) on
every rank: AllReduce the gradients, every rank updates every parameter.  A
ZeRO-style optimizer (Rajbhandari et al., 2020, stages 1-2) shards it:

1. ReduceScatter the gradients: rank r receives only the summed gradient of
   its shard r of the parameters (shards follow numpy.array_split),
2. rank r updates its shard's parameters with its shard of m and v,
3. AllGather the updated shards so every rank holds all parameters again.

The example runs both versions side by side from the same start and checks
that they give bitwise-identical parameters (both sum each gradient element
along the same ring in the same order, and Adam works element by element),
then prints each rank's optimizer memory and the bytes each rank sent
(measured with ``mpicoll.traffic()``, checked against the ring formulas).
The sharded step sends exactly what the AllReduce step sends: the saving is
memory, not bytes on the wire.
"""

import _common as ex
import numpy as np
from mpi4py import MPI

import mpicoll

BETA1, BETA2, EPS, LR = 0.9, 0.999, 1e-8, 1e-2


def adam(w, g, m, v, t):
    """One Adam step (Kingma & Ba, Algorithm 1), in place on ``w``, ``m``, ``v``; elementwise."""
    m *= BETA1
    m += (1 - BETA1) * g
    v *= BETA2
    v += (1 - BETA2) * g * g
    mhat = m / (1 - BETA1 ** t)
    vhat = v / (1 - BETA2 ** t)
    w -= LR * mhat / (vhat ** 0.5 + EPS)


def main():
    p = ex.parser(__doc__.splitlines()[0])
    p.add_argument("--params", type=ex.count, default=1_000_003,
                   help="number of float32 parameters (default 1000003)")
    p.add_argument("--steps", type=ex.count, default=3, help="optimizer steps (default 3)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    xp, device = ex.array_module(args.device)
    n, dt = args.params, np.dtype(np.float32)

    # Rank r's loss is 0.5 * sum(c_r * (w - t_r)**2): its gradient c_r * (w - t_r)
    # differs on every rank and depends on the current parameters.
    rng = np.random.default_rng(100 + rank)
    c = xp.asarray(rng.uniform(0.5, 1.5, n).astype(dt))
    target = xp.asarray(rng.standard_normal(n).astype(dt))
    w0 = np.random.default_rng(1).standard_normal(n).astype(dt)   # same start on every rank

    counts, displs = ex.blocks(n, size)
    lo, hi = displs[rank], displs[rank] + counts[rank]

    # Unsharded: AllReduce the gradients, full Adam state on every rank.
    w_full = xp.asarray(w0)
    m_full, v_full = xp.zeros(n, dt), xp.zeros(n, dt)
    with mpicoll.traffic() as sent_full:
        for t in range(1, args.steps + 1):
            g = mpicoll.allreduce(c * (w_full - target), algorithm="ring")
            g /= size
            adam(w_full, g, m_full, v_full, t)

    # Sharded: same parameters everywhere, Adam state for this rank's shard only.
    w_zero = xp.asarray(w0)
    m_shard, v_shard = xp.zeros(counts[rank], dt), xp.zeros(counts[rank], dt)
    with mpicoll.traffic() as sent_zero:
        for t in range(1, args.steps + 1):
            g_shard = mpicoll.reduce_scatter(c * (w_zero - target), algorithm="ring")
            g_shard /= size
            adam(w_zero[lo:hi], g_shard, m_shard, v_shard, t)     # this rank's shard only
            mpicoll.allgather(w_zero, out=w_zero, counts=counts, algorithm="ring")

    ex.print0(f"{n} float32 parameters, {args.steps} Adam steps, {size} rank(s) on {device}")
    same = ex.mismatch(ex.to_host(w_zero), ex.to_host(w_full), name="sharded parameters",
                       reference="the unsharded AllReduce + Adam step")
    ok = ex.report(same)
    ex.print0("parameters after the sharded steps equal the unsharded ones bitwise: "
              f"{comm.allreduce(same is None, op=MPI.LAND)}")
    ok &= ex.check(ex.same_on_all_ranks(w_zero), "ranks hold different parameters")

    # Optimizer memory actually held (nbytes of m and v), per rank.
    ex.print0(f"\noptimizer state (Adam m and v) held per rank:\n"
              f"{'rank':>6} {'shard':>10} {'sharded':>14} {'unsharded':>14}")
    ex.print_ordered(f"{rank:6d} {counts[rank]:10d} {m_shard.nbytes + v_shard.nbytes:12d} B "
                     f"{m_full.nbytes + v_full.nbytes:12d} B")

    # Bytes each rank sent per step, counted by mpicoll.traffic().  Ring
    # ReduceScatter and ring AllGather each send every block but one: summed
    # over the ranks exactly (n-1) times the array, (n-1)/n of it per rank on
    # average; ring AllReduce is the two in a row.
    steps = max(args.steps, 1)
    rs = sent_zero.total("reduce_scatter").bytes_sent // steps
    ag = sent_zero.total("allgather").bytes_sent // steps
    ar = sent_full.total("allreduce").bytes_sent // steps
    full = n * dt.itemsize
    ex.print0(f"\nbytes sent per step, measured with mpicoll.traffic() ({full} B of gradients "
              f"or parameters per rank):\n"
              f"{'rank':>6} {'ReduceScatter':>14} {'AllGather':>12} {'ZeRO total':>12} {'AllReduce':>12}")
    ex.print_ordered(f"{rank:6d} {rs:14d} {ag:12d} {rs + ag:12d} {ar:12d}")
    totals = comm.allreduce(np.array([rs, ag, ar], dtype=np.int64))
    expected = (size - 1) * full if args.steps else 0
    ex.print0(f"{'mean':>6} {totals[0] / size:14.1f} {totals[1] / size:12.1f} "
              f"{(totals[0] + totals[1]) / size:12.1f} {totals[2] / size:12.1f}\n"
              f"formula (n-1)/n * {full} B = {expected / size:.1f} B per collective per rank; "
              f"AllReduce 2(n-1)/n * {full} B = {2 * expected / size:.1f} B")
    ok &= ex.check(totals.tolist() == [expected, expected, 2 * expected],
                   f"bytes sent over all ranks {totals.tolist()} differ from the ring formula "
                   f"{[expected, expected, 2 * expected]}")
    ex.finish(ok, f"sharded Adam equals unsharded Adam on {size} rank(s) ({device})")


if __name__ == "__main__":
    main()
