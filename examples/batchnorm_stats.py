"""Synchronised batch-norm statistics: exact global mean and variance from per-rank batches.

    mpirun -n 4 python examples/batchnorm_stats.py
    mpirun -n 4 python examples/batchnorm_stats.py --device gpu

Each rank holds a batch of a different size (rank r: 3 + 5r samples by
default; its data also has a different mean and spread), with C channels.
Batch norm across ranks needs the mean and variance of all samples together.
Each rank computes (count, mean, M2) of its own batch, where M2 is the sum of
squared deviations from its mean; one ``mpicoll.allgather`` gives every rank
every rank's triple, and every rank combines them in rank order with the
pairwise formula of Chan, Golub & LeVeque (1979):

    n = na + nb,  d = mean_b - mean_a
    mean = mean_a + d * nb / n
    M2   = M2_a + M2_b + d**2 * na * nb / n

so all ranks get bitwise-identical statistics, equal (within rounding) to
those of the concatenated data, which every rank here can regenerate to check.
Two shortcuts are shown for contrast: averaging the per-rank means (wrong
when batch sizes differ), and the one-pass sum / sum-of-squares formula
(exact in real arithmetic, but it cancels catastrophically when the mean is
large compared with the spread).
"""

import _common as ex
import numpy as np
from mpi4py import MPI

import mpicoll

CHANNELS = 4
OFFSET = 1e4   # channel means are around 1e4 with unit spread: hard for the one-pass formula
EPS = np.finfo(np.float64).eps


def tolerances(data, mean, var, nranks):
    """Allowed |error| of the global mean and variance (per channel), from rounding.

    mean: each sum of N terms is within (N-1)*eps/2*sum|x| of the exact sum, and
    the combination adds one rounding per rank, so 2*(N + nranks)*eps*mean|x|.
    variance: both computations round x - mean with an error of about
    eps*|mean|, which perturbs the mean of squared deviations by about
    2*eps*|mean|*std; 64*eps*(|mean|*std + var) leaves a wide margin (measured
    errors with the defaults on 1-8 ranks stay below 1*eps*(|mean|*std + var))
    and still fails the one-pass formula, which with the defaults is off by 50
    to 700 times this tolerance.
    """
    n = data.shape[0]
    mean_tol = 2 * (n + nranks) * EPS * np.abs(data).mean(axis=0)
    var_tol = 64 * EPS * (np.abs(mean) * np.sqrt(var) + var)
    return mean_tol, var_tol


def batch(rank, size_of):
    """Rank ``rank``'s batch: ``size_of(rank)`` samples x CHANNELS, reproducible anywhere."""
    rng = np.random.default_rng(500 + rank)
    loc = OFFSET + rank + np.arange(CHANNELS)
    return rng.normal(loc, 1.0 + 0.5 * rank, (size_of(rank), CHANNELS))


def local_stats(xp, x):
    """[count, mean (C), M2 (C)] of one batch, as one row."""
    count = x.shape[0]
    mean = x.mean(axis=0) if count else xp.zeros(x.shape[1])
    m2 = ((x - mean) ** 2).sum(axis=0)
    return xp.concatenate([xp.array([float(count)]), mean, m2])


def combine(rows):
    """Fold per-rank [count, mean, M2] rows, in order, with Chan et al.'s formula."""
    n, mean, m2 = 0.0, rows[0, 1:1 + CHANNELS] * 0, rows[0, 1 + CHANNELS:] * 0
    for row in rows:
        nb, mean_b, m2_b = row[0], row[1:1 + CHANNELS], row[1 + CHANNELS:]
        if nb == 0:
            continue
        total = n + nb
        d = mean_b - mean
        mean = mean + d * (nb / total)
        m2 = m2 + m2_b + d * d * (n * nb / total)
        n = total
    return n, mean, m2


def main():
    p = ex.parser(__doc__.splitlines()[0])
    p.add_argument("--base", type=ex.count, default=3, help="rank r holds base + step * r samples (default 3)")
    p.add_argument("--step", type=ex.count, default=5, help="see --base (default 5)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    if args.base + args.step * (size - 1) == 0:
        p.error("--base and --step leave every rank without samples")
    xp, device = ex.array_module(args.device)

    def size_of(r):
        return args.base + args.step * r

    x = xp.asarray(batch(rank, size_of))
    mine = local_stats(xp, x)
    ex.print0(f"{size} rank(s) on {device}; {CHANNELS} channels; samples per rank: "
              f"{[size_of(r) for r in range(size)]}")
    ex.print0("per-rank statistics of channel 0 (count, mean, variance):")
    ex.print_ordered(f"  rank {rank}: {size_of(rank):4d} {float(mine[1]):14.6f} "
                     f"{float(mine[1 + CHANNELS]) / max(size_of(rank), 1):10.6f}")

    rows = mpicoll.allgather(mine[None, :])            # (size, 1 + 2C): every rank's triple
    count, mean, m2 = combine(ex.to_host(rows))
    var = m2 / count                                   # biased variance, as batch norm uses

    # Check against the statistics of the concatenated data (regenerated here).
    everything = np.concatenate([batch(r, size_of) for r in range(size)])
    ref_mean, ref_var = everything.mean(axis=0), everything.var(axis=0)
    ok = ex.check(count == everything.shape[0], f"count {count} != {everything.shape[0]}")
    mean_tol, var_tol = tolerances(everything, ref_mean, ref_var, size)
    ok &= ex.report(ex.mismatch(mean, ref_mean, mean_tol, "global mean",
                                "the mean of the concatenated data"))
    ok &= ex.report(ex.mismatch(var, ref_var, var_tol, "global variance",
                                "the variance of the concatenated data"))
    ok &= ex.check(ex.same_on_all_ranks(np.concatenate([mean, var])),
                   "ranks hold different statistics")

    ex.print0(f"\nglobal statistics of all {int(count)} samples (every rank, via one allgather):")
    ex.print0(f"  mean     {np.array2string(mean, precision=9)}")
    ex.print0(f"  variance {np.array2string(var, precision=9)}")
    ex.print0(f"  error vs the concatenated data, as a fraction of the tolerance: mean "
              f"{np.max(np.abs(mean - ref_mean) / mean_tol):.2g}, variance "
              f"{np.max(np.abs(var - ref_var) / var_tol):.2g} (must be <= 1)")

    # The shortcuts, for contrast (printed, not used).
    naive_mean = mpicoll.allreduce(x.mean(axis=0) if size_of(rank) else xp.zeros(CHANNELS)) / size
    sums = mpicoll.allreduce(xp.concatenate([x.sum(axis=0), (x * x).sum(axis=0)]))
    s1, s2 = ex.to_host(sums[:CHANNELS]), ex.to_host(sums[CHANNELS:])
    onepass_var = s2 / count - (s1 / count) ** 2
    ex.print0(f"  average of per-rank means: max error {np.max(np.abs(ex.to_host(naive_mean) - ref_mean)):.3g}"
              f" (wrong whenever batch sizes differ)")
    ex.print0(f"  one-pass sum/sum-of-squares variance: error {np.max(np.abs(onepass_var - ref_var) / var_tol):.3g}"
              f" x the tolerance (cancellation, mean ~{OFFSET:g})")
    ex.finish(ok, f"synchronised batch-norm statistics on {size} rank(s) equal those of the "
                  f"concatenated data ({device})")


if __name__ == "__main__":
    main()
