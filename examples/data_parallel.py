"""Data-parallel training: shard the batch, AllReduce the gradients, take identical steps.

    mpirun -n 4 python examples/data_parallel.py
    mpirun -n 3 python examples/data_parallel.py --steps 500
    mpirun -n 4 python examples/data_parallel.py --device gpu
    mpirun -n 4 python examples/data_parallel.py --overlap

A two-layer perceptron (tanh hidden layer, logistic output) is trained by
full-batch gradient descent on synthetic data generated from a fixed seed.
Every rank holds the same initial weights and one shard of the batch (shard
sizes follow numpy.array_split, so they differ when the rank count does not
divide the batch).  Each step:

1. each rank computes the *sum* of per-sample gradients over its shard,
   divided by the global batch size (this is its shard's mean gradient
   weighted by shard size / batch size, so uneven shards are averaged exactly;
   a plain average of the shards' means would not be),
2. one ``mpicoll.allreduce`` on a flat buffer sums those contributions (the
   loss and the number of correct predictions ride along in the same buffer),
3. every rank applies the same SGD update to its copy of the weights.

At the end each rank also trains the same model in one process on the whole
batch and checks that the data-parallel weights equal those within a stated
tolerance (the sums are only grouped differently), and that all ranks hold
bitwise-identical weights.

``--overlap`` overlaps communication with the backward pass, as data-parallel
frameworks do: the gradient buffer is cut into buckets, one per layer, and
the backward pass hands each bucket to ``mpicoll.iallreduce`` as soon as it
is complete (the output layer's first, with the loss and count, then the
hidden layer's), so the reduction of one bucket runs while the next is
computed; both are waited for before the update.  Besides the checks above,
the run then trains once more with each bucket's reduction completed before
the backward pass goes on (the same calls, nothing overlapped) and checks that
the two give bitwise-identical weights: overlapping changes when a bucket is
reduced, never how.
"""

import _common as ex
import numpy as np
from mpi4py import MPI

import mpicoll

FEATURES, HIDDEN = 10, 16
# Final weights of data-parallel and single-process training may differ only by
# rounding (the gradient sums are grouped differently).  Measured differences
# are below 1e-14 on 1-8 ranks with the defaults; 1e-9 leaves a wide margin
# and still catches real errors: averaging the shards' mean gradients without
# weighting them ends 4e-4 (2 ranks) to 2e-3 (8 ranks) away.
TOLERANCE = 1e-9


class MLP:
    """Parameters as views into one flat vector, so one AllReduce moves every gradient."""

    shapes = {"W1": (FEATURES, HIDDEN), "b1": (HIDDEN,), "W2": (HIDDEN,), "b2": (1,)}

    def __init__(self, xp, flat):
        self.xp = xp
        self.flat = flat
        self.views = {}
        offset = 0
        for name, shape in self.shapes.items():
            size = int(np.prod(shape))
            self.views[name] = flat[offset: offset + size].reshape(shape)
            offset += size

    @classmethod
    def size(cls):
        return sum(int(np.prod(s)) for s in cls.shapes.values())

    @classmethod
    def split(cls):
        """Where the hidden layer's parameters (W1, b1) end in the flat vector."""
        return FEATURES * HIDDEN + HIDDEN

    def gradient(self, X, y, out, scale, ready=None):
        """Write scale * (sum of per-sample gradients) into ``out`` (same layout as
        the parameters) followed by scale * loss sum and the count of correct predictions.

        ``ready(bucket)``, if given, is called with each bucket of ``out`` as soon as
        the backward pass has filled it: ``out[split():]`` (the output layer, the loss
        and the count) first, then ``out[:split()]`` (the hidden layer).
        """
        xp, p = self.xp, self.views
        g = MLP(xp, out[: self.size()]).views
        h = xp.tanh(X @ p["W1"] + p["b1"])
        z = h @ p["W2"] + p["b2"][0]
        out[-2] = (xp.logaddexp(0.0, z) - y * z).sum() * scale
        out[-1] = ((z > 0) == (y > 0.5)).sum()
        dz = 1.0 / (1.0 + xp.exp(-z)) - y               # d loss / d z for the logistic loss
        g["W2"][...] = (h.T @ dz) * scale
        g["b2"][...] = dz.sum() * scale
        if ready is not None:
            ready(out[self.split():])
        dh = xp.outer(dz, p["W2"]) * (1.0 - h * h)
        g["W1"][...] = (X.T @ dh) * scale
        g["b1"][...] = dh.sum(axis=0) * scale
        if ready is not None:
            ready(out[: self.split()])


def make_data(n, seed=7):
    """Two-class data whose boundary is not linear, the same on every rank."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, FEATURES))
    w = rng.standard_normal(FEATURES)
    y = (np.sin(2.0 * X[:, 0]) + 0.5 * X @ w > 0).astype(np.float64)
    return X, y


def initial_weights(seed=11):
    """Every rank starts from the same weights (in practice: broadcast from rank 0)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal(MLP.size()) * 0.3


def train(xp, X, y, batch, steps, lr, allreduce=None, log=None, buckets=None):
    """Full-batch gradient descent; ``X``/``y`` are this process's shard of a ``batch``-sample batch.

    ``allreduce(buf)`` sums the whole gradient buffer after the backward pass;
    ``buckets`` instead is ``(ready, wait)``: ``ready(bucket)`` as each bucket is
    complete, ``wait()`` before the update.
    """
    model = MLP(xp, xp.asarray(initial_weights()))
    buf = xp.empty(MLP.size() + 2)
    for step in range(steps + 1):
        model.gradient(X, y, buf, 1.0 / batch, None if buckets is None else buckets[0])
        if allreduce is not None:
            allreduce(buf)
        if buckets is not None:
            buckets[1]()
        if log is not None and (step % max(steps // 5, 1) == 0 or step == steps):
            log(step, float(buf[-2]), float(buf[-1]) / batch)
        if step < steps:
            model.flat -= lr * buf[: MLP.size()]
    return model.flat


def main():
    p = ex.parser(__doc__.splitlines()[0])
    p.add_argument("--samples", type=ex.count, default=1001, help="global batch size (default 1001)")
    p.add_argument("--steps", type=ex.count, default=300, help="gradient steps (default 300)")
    p.add_argument("--lr", type=float, default=0.5, help="learning rate (default 0.5)")
    p.add_argument("--overlap", action="store_true",
                   help="reduce each layer's gradients with mpicoll.iallreduce as the backward "
                        "pass produces them (default: one allreduce after it)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    xp, device = ex.array_module(args.device)

    X, y = make_data(args.samples)
    counts, displs = ex.blocks(args.samples, size)
    lo, hi = displs[rank], displs[rank] + counts[rank]
    ex.print0(f"{args.samples} samples, MLP {FEATURES}-{HIDDEN}-1 ({MLP.size()} parameters), "
           f"{size} rank(s) on {device}, shard sizes {counts}")
    ex.print0(f"{'step':>6} {'loss':>10} {'accuracy':>9}")

    def log(step, loss, acc):
        ex.print0(f"{step:6d} {loss:10.6f} {acc:9.4f}")

    def allreduce(buf):
        mpicoll.allreduce(buf, op=MPI.SUM, out=buf)      # in place: the sum replaces buf

    in_flight = []

    def start(bucket):                                   # backward pass: bucket complete
        in_flight.append(mpicoll.iallreduce(bucket, op=MPI.SUM, out=bucket))

    def wait():                                          # before the update
        mpicoll.waitall(in_flight)
        in_flight.clear()

    Xs, ys = xp.asarray(X[lo:hi]), xp.asarray(y[lo:hi])
    if args.overlap:
        ex.print0("overlapped: each layer's gradient bucket is reduced with mpicoll.iallreduce "
                  "during the backward pass")
        theta = ex.to_host(train(xp, Xs, ys, args.samples, args.steps, args.lr, log=log,
                                 buckets=(start, wait)))
    else:
        theta = ex.to_host(train(xp, Xs, ys, args.samples, args.steps, args.lr, allreduce, log))

    # The same training in one process on the whole batch (every rank does it locally).
    ref = ex.to_host(train(xp, xp.asarray(X), xp.asarray(y), args.samples, args.steps, args.lr))
    diff = comm.allreduce(float(np.abs(theta - ref).max()), op=MPI.MAX)
    ex.print0(f"max |data-parallel - single-process| over all weights and ranks: {diff:.3g} "
           f"(tolerance {TOLERANCE:g})")
    ok = ex.report(ex.mismatch(theta, ref, TOLERANCE, "data-parallel weights",
                         "single-process training"))
    identical = ex.same_on_all_ranks(theta)
    ex.print0(f"weights bitwise identical on all {size} rank(s): {identical}")
    ok &= ex.check(identical, "ranks hold different weights")
    if args.overlap:
        # the same bucket reductions as blocking calls, before the backward pass goes on:
        # overlap changes when a bucket is reduced, never how (the same schedule runs)
        def reduce_now(bucket):
            mpicoll.allreduce(bucket, op=MPI.SUM, out=bucket)

        blocking = ex.to_host(train(xp, Xs, ys, args.samples, args.steps, args.lr,
                                    buckets=(reduce_now, lambda: None)))
        same = bool(np.array_equal(theta.view(np.uint64), blocking.view(np.uint64)))
        ex.print0(f"overlapped weights bitwise equal to blocking bucket reductions: "
                  f"{comm.allreduce(same, op=MPI.LAND)}")
        ok &= ex.check(same, "overlapped and blocking bucket reductions give different weights")
    ex.finish(ok, f"data-parallel training on {size} rank(s) equals single-process training ({device})")


if __name__ == "__main__":
    main()
