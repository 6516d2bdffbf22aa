"""Numerics on simulated ranks (tests/support/schedsim.py): float32 accumulation error to 512 ranks,
the direct schedule's rank-order fold under every tuning.

The composition engine.select runs for a 16-bit SUM (widen to float32, a
float32 ReduceScatter by the algorithm's own schedule, one rounding, an
AllGather of the rounded words) is run here with the real schedule builders
on every rank at once; its error against the exact sum of the bfloat16
inputs stays within 1.1x the floor (the exact sum rounded once).  Wire-type
partials (every hop rounds) are computed beside it for docs/numerics.md.  The
direct route (bfloat16 on the wire, the float32 fold at the owner) is checked
the same way to 512 ranks, and bitwise against the rank-order float32 fold.
"""

from __future__ import annotations

import numpy as np
import pytest
from support import schedsim as sim

from mpicoll.algorithms.ring import split
from mpicoll.engine import select as _select

ml_dtypes = pytest.importorskip("ml_dtypes")
pytestmark = pytest.mark.local  # simulated ranks in one process: no MPI peer

BF16 = np.dtype(ml_dtypes.bfloat16)


def inputs(n, count, seed=18):
    """Rank-asymmetric N(0.5, 1) values, rounded to bfloat16 (what each rank holds)."""
    rng = np.random.default_rng(seed)
    return [rng.normal(0.5, 1.0, count).astype(BF16) for _ in range(n)]


def reduce_scatter(xs, algorithm, op=np.add, dtype=np.float32, segment=1 << 17, window=2,
                   in_place=False, model="eager", counts=None):
    """Every rank's block of the ReduceScatter of ``xs`` (widened to ``dtype``) by ``algorithm``
    (``counts``: the blocks, default ``split``)."""
    n, total = len(xs), len(xs[0])
    counts = split(total, n)[0] if counts is None else counts
    build = _select.BUILDERS["reduce_scatter"][algorithm]
    schedules, bufs = [], []
    for r in range(n):
        shape = sim.shape("reduce_scatter", n, r, counts, segment=segment, window=window,
                          in_place=in_place)
        schedules.append(build(shape))
        src = xs[r].astype(dtype)
        bufs.append(sim.bind("reduce_scatter", shape, src, None) if in_place else
                    sim.bind("reduce_scatter", shape, src, np.empty(counts[r], dtype)))
    res = sim.simulate(schedules, bufs, op, model=model)
    return np.concatenate([res.dst(r) for r in range(n)])


def rel_error(got, exact):
    got = np.asarray(got, np.float64)
    return float(np.linalg.norm(got - exact) / np.linalg.norm(exact))


def bf16_partials(a, b, out):
    """A bfloat16 hop: the sum rounded to bfloat16 (wire-type partials, as NCCL's ring)."""
    np.copyto(out, np.add(a, b).astype(BF16).astype(np.float32))


# The simulator's cost grows with the ops of all ranks: the ring's are n * (n - 1) steps
# (1.3 million ops, about 27 s on a 2-core VM at 512 ranks), recursive halving's n * log2(n).
# So 512 ranks run recursive halving, on 2 elements a block, and the ring stops at 128
# ranks (its float32 partials lose about n * 2**-24 relative, far below bfloat16's one
# rounding, 2**-9, at any of these rank counts).
@pytest.mark.parametrize("n,algorithm,count", [(2, "ring", 4096), (3, "ring", 4096),
                                               (8, "ring", 4096), (128, "ring", 512),
                                               (3, "recursive_halving", 4096),
                                               (8, "recursive_halving", 4096),
                                               (512, "recursive_halving", 1024)])
def test_float32_accumulation_within_floor(n, algorithm, count):
    xs = inputs(n, count)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    floor = rel_error(exact.astype(BF16), exact)
    got = reduce_scatter(xs, algorithm).astype(BF16)  # the one rounding
    assert rel_error(got, exact) <= 1.1 * floor
    if n == 8 and algorithm == "ring":  # the contrast: a bfloat16 ring grows past the floor
        ring16 = reduce_scatter(xs, "ring", bf16_partials)
        assert rel_error(ring16, exact) > 1.1 * floor


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16])
def test_direct_is_the_rank_order_fold_for_every_tuning(n):
    """The fold's bits for every segment/window, in place or not, eager or rendezvous: the
    pieces change how messages are cut, never how the operands are grouped."""
    xs = [x.astype(np.float32) for x in inputs(n, 37, seed=n)]
    fold = xs[0].copy()
    for x in xs[1:]:
        fold = fold + x
    for segment, window, in_place, model in ((1, 1, False, "rendezvous"), (3, 2, True, "eager"),
                                             (5, 3, False, "eager"), (1 << 17, 8, True, "rendezvous")):
        got = reduce_scatter(xs, "direct", segment=segment, window=window, in_place=in_place,
                             model=model)
        assert got.tobytes() == fold.tobytes(), (segment, window, in_place, model)


@pytest.mark.parametrize("counts", [(0, 5, 3), (0, 0, 4, 1), (2, 0, 0, 1, 6)])
def test_direct_fold_with_empty_blocks(counts):
    """Empty blocks first (a rank other than 0 owns offset 0, which in place is its output):
    still the rank-order fold, in place or not, eager or rendezvous."""
    n = len(counts)
    xs = [x.astype(np.float32) for x in inputs(n, sum(counts), seed=n + 40)]
    fold = xs[0].copy()
    for x in xs[1:]:
        fold = fold + x
    for segment, window, in_place, model in ((1, 1, True, "rendezvous"), (2, 2, False, "eager"),
                                             (1 << 17, 2, True, "eager")):
        got = reduce_scatter(xs, "direct", segment=segment, window=window, in_place=in_place,
                             model=model, counts=counts)
        assert got.tobytes() == fold.tobytes(), (segment, window, in_place, model)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_direct_reduce_scatter_work_memory(n):
    """The first operand a rank does not hold is received straight into its output, so out
    of place only the other n - 2 peers' pieces take work memory (none at 2 ranks, as the
    ring's), and in place rank 0, whose block is its output, folds there with no staging
    buffer.  (Rank 0 received into work memory and folded out of it: a third array of the
    block per call, slower: benchmarks/direct.py times the two.)"""
    counts = tuple(split(10 * n, n)[0])
    window, piece = 2, 3
    for r in range(n):
        sh = sim.shape("reduce_scatter", n, r, counts, segment=piece, window=window)
        work = _select.BUILDERS["reduce_scatter"]["direct"](sh).work
        assert sum(work.values()) == window * (n - 2) * piece, (r, work)
    sh = sim.shape("reduce_scatter", n, 0, counts, segment=piece, window=window, in_place=True)
    assert "rank-order fold" not in _select.BUILDERS["reduce_scatter"]["direct"](sh).work


def direct_input_type(xs, segment=1 << 17, window=2, in_place=False, model="eager",
                      counts=None, op=np.add):
    """Every rank's block of the direct ReduceScatter of ``xs`` in their own type, folded in
    float32 at the owner (``Shape.accumulate``; engine.select's direct route) and rounded once."""
    n, total = len(xs), len(xs[0])
    counts = split(total, n)[0] if counts is None else counts
    build = _select.BUILDERS["reduce_scatter"]["direct"]
    schedules, bufs = [], []
    for r in range(n):
        shape = sim.shape("reduce_scatter", n, r, counts, segment=segment, window=window,
                          in_place=in_place, accumulate=np.dtype(np.float32))
        schedules.append(build(shape))
        src = xs[r].copy()
        bufs.append(sim.bind("reduce_scatter", shape, src, None) if in_place else
                    sim.bind("reduce_scatter", shape, src, np.empty(counts[r], src.dtype)))
    res = sim.simulate(schedules, bufs, op, model=model)
    return np.concatenate([res.dst(r) for r in range(n)])


def f32_fold(xs, op=np.add):
    """The rank-order fold ((x0 + x1) + x2) + ... in float32, rounded once to the inputs' type."""
    acc = xs[0].astype(np.float32)
    for x in xs[1:]:
        acc = op(acc, x.astype(np.float32))
    return acc.astype(xs[0].dtype)


# The direct schedule is n - 1 messages and n - 1 folds a rank with a block: on every rank,
# 512 ranks are a quarter million messages (over two minutes simulated on the shared 2-core
# VM).  Above 8 ranks the blocks are on 8 ranks only: each element's error is that of its
# fold, of all n operands, whoever owns it; the empty blocks only send no messages.
@pytest.mark.parametrize("n,count", [(8, 4096), (128, 4096), (512, 4096)])
def test_direct_input_type_within_floor(n, count):
    """bfloat16 on the wire, float32 in the fold: the error is the one rounding's, at every
    rank count (the bfloat16 ring's grows past it, test_float32_accumulation_within_floor)."""
    xs = inputs(n, count, seed=n)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    floor = rel_error(exact.astype(BF16), exact)
    counts = [count // 8 if r % (n // 8) == 0 else 0 for r in range(n)]
    got = direct_input_type(xs, counts=counts)
    assert got.dtype == BF16
    assert rel_error(got, exact) <= 1.1 * floor
    assert got.tobytes() == f32_fold(xs).tobytes()


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_direct_input_type_is_the_float32_fold_for_every_tuning(n):
    """The same bits as deterministic mode's float32 fold for every segment, window, in place
    or not, eager or rendezvous, uneven blocks (empty ones first) and PROD."""
    for counts in (None, (0,) * (n - 1) + (5,), tuple((r * 7 + 3) % 5 for r in range(n))):
        total = 37 if counts is None else sum(counts)
        xs = inputs(n, total, seed=n + 7)
        for op in (np.add, np.multiply):
            fold = f32_fold(xs, op)
            cut = split(total, n)[0] if counts is None else counts
            at = np.cumsum((0,) + tuple(cut))
            for segment, window, in_place, model in ((1, 1, False, "rendezvous"),
                                                     (3, 2, True, "eager"),
                                                     (5, 3, False, "eager"),
                                                     (1 << 17, 8, True, "rendezvous")):
                got = direct_input_type(xs, segment, window, in_place, model, counts, op)
                assert got.tobytes() == fold[at[0]:at[-1]].tobytes(), \
                    (counts, op, segment, window, in_place, model)


def test_direct_input_type_work_memory():
    """One float32 piece accumulates; what arrives stays in the input type."""
    n, piece = 3, 4
    counts = tuple(split(10 * n, n)[0])
    for r in range(n):
        sh = sim.shape("reduce_scatter", n, r, counts, segment=piece, window=2,
                       accumulate=np.dtype(np.float32))
        sched = _select.BUILDERS["reduce_scatter"]["direct"](sh)
        assert sched.types == {"accumulator": np.dtype(np.float32)}
        assert sched.work["accumulator"] == piece
        assert sched.work["received pieces"] == 2 * (n - 2) * piece
