"""The direct route of a 16/8-bit SUM/PROD: blocks travel in the input type and each rank
folds its own in float32, in rank order, rounding once (engine.select, algorithms.direct).

Through the array functions and mpicoll.Comm, AllReduce and ReduceScatter, in and out of
place, blocking and not, uneven blocks (empty ones, fewer elements than ranks, counts not
divisible by the rank count): bitwise the rank-order fold in float32 rounded once, the
same bits on every rank; on inputs whose float32 sums are exact, the exact sum rounded
once.  The route moves the input type's bytes (the ring's), and "auto" takes it where
benchmarks/accumulate.py measured it faster.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from support.data import half_types

import mpicoll
from mpicoll.algorithms.schedule import split
from mpicoll.api.args import msg_of_array
from mpicoll.backends.host import NUMPY
from mpicoll.core.types import Call
from mpicoll.engine import select as _numerics

ml_dtypes = pytest.importorskip("ml_dtypes")

WORLD = MPI.COMM_WORLD
HALF = half_types(ml_dtypes)
IDS = [str(d) for d in HALF]


def values(count, rank, dtype, seed=0):
    """Rank-asymmetric N(0.5, 1) values in ``dtype`` (their float32 sums round)."""
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.normal(0.5, 1.0, count).astype(dtype)


def exact_values(count, rank, dtype):
    """Rank-asymmetric multiples of 1/4 small enough for every type: float32 sums exact."""
    top = 8 if dtype.itemsize == 1 else 200
    return (((np.arange(count) * 7 + rank * 13) % top - top // 2) / 4).astype(dtype)


def fold(rows, op=np.add):
    """((x0 + x1) + x2) + ... in float32, rounded once to the rows' type."""
    acc = rows[0].astype(np.float32)
    for x in rows[1:]:
        acc = op(acc, x.astype(np.float32))
    return acc.astype(rows[0].dtype)


def bits(a):
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def same_on_every_rank(a):
    got = WORLD.allgather(bits(a).tobytes())
    assert all(g == got[0] for g in got)


def every_row(x):
    return [np.asarray(v) for v in WORLD.allgather(x)]


def above_auto_limit(collective, dtype):
    """A count (elements) at which "auto" takes the direct route, not divisible by the ranks."""
    limit = _numerics.DIRECT_ABOVE[collective] * max(WORLD.size - 1, 1)
    return limit // dtype.itemsize + 3 * WORLD.size + 1


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("count", [0, 1, "ranks-1", 1001, 70001, "auto"])
@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce_is_the_float32_fold(dtype, count, in_place):
    algorithm = "auto" if count == "auto" else "direct"
    count = {"ranks-1": WORLD.size - 1, "auto": above_auto_limit("allreduce", dtype)}.get(
        count, count)
    x = values(count, WORLD.rank, dtype)
    ref = fold(every_row(x))
    keep = x.copy()
    if in_place:
        y = mpicoll.allreduce(x, out=x, algorithm=algorithm)
    else:
        y = mpicoll.allreduce(x, algorithm=algorithm)
        assert np.array_equal(bits(x), bits(keep))
    assert y.dtype == dtype
    assert np.array_equal(bits(y), bits(ref))
    same_on_every_rank(y)


def _counts(kind, size):
    return {"empty": [0] * size, "one": [1 if r == size - 1 else 0 for r in range(size)],
            "fewer than ranks": split(max(size - 1, 0), size)[0],
            "not divisible": [(r * 7 + 3) % 5 for r in range(size)],
            "split": split(1000 * size + size // 2 + 1, size)[0],
            "auto": None}[kind]


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("kind", ["empty", "one", "fewer than ranks", "not divisible", "split",
                                  "auto"])
@pytest.mark.parametrize("in_place", [False, True])
def test_reduce_scatter_is_the_float32_fold(dtype, kind, in_place):
    size, rank = WORLD.size, WORLD.rank
    counts = _counts(kind, size)
    algorithm = "direct"
    if counts is None:
        algorithm, total = "auto", above_auto_limit("reduce_scatter", dtype)
        counts = split(total, size)[0]
    x = values(sum(counts), rank, dtype, seed=1)
    lo = sum(counts[:rank])
    ref = fold(every_row(x))[lo:lo + counts[rank]]
    keep = x.copy()
    y = mpicoll.reduce_scatter(x, out=x if in_place else None, counts=counts,
                               algorithm=algorithm)
    if not in_place:
        assert np.array_equal(bits(x), bits(keep))
    assert y.dtype == dtype and y.shape == (counts[rank],)
    assert np.array_equal(bits(y), bits(ref))
    blocks = WORLD.allgather(bits(y).tobytes())
    assert b"".join(blocks) == bits(fold(every_row(keep))).tobytes()


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
def test_exact_sums_are_rounded_once(dtype):
    """Inputs whose float32 sums are exact: the exact sum rounded once, both collectives."""
    x = exact_values(4099, WORLD.rank, dtype)
    exact = np.sum([r.astype(np.float64) for r in every_row(x)], axis=0).astype(dtype)
    assert np.array_equal(bits(mpicoll.allreduce(x, algorithm="direct")), bits(exact))
    counts, displs = split(len(x), WORLD.size)
    mine = slice(displs[WORLD.rank], displs[WORLD.rank] + counts[WORLD.rank])
    y = mpicoll.reduce_scatter(x, algorithm="direct")
    assert np.array_equal(bits(y), bits(exact[mine]))


@pytest.mark.parametrize("dtype", HALF[:2], ids=IDS[:2])
def test_prod_and_nonblocking(dtype):
    size, rank = WORLD.size, WORLD.rank
    x = (((np.arange(513) + rank) % 4 + 1) / 2 * (-1) ** rank).astype(dtype)
    ref = fold(every_row(x), np.multiply)
    assert np.array_equal(bits(mpicoll.allreduce(x, op=MPI.PROD, algorithm="direct")),
                          bits(ref))
    v = values(3001, rank, dtype, seed=2)
    ref = fold(every_row(v))
    h = mpicoll.iallreduce(v, algorithm="direct")
    assert np.array_equal(bits(h.wait()), bits(ref))
    comm = mpicoll.Comm(WORLD, algorithm="direct")
    out = np.empty_like(v)
    comm.Iallreduce(v, out).Wait()
    assert np.array_equal(bits(out), bits(ref))
    blk = np.empty(3001 // size if size else 0, dtype)
    w = v[:len(blk) * size]
    comm.Reduce_scatter_block(w, blk)
    lo = rank * len(blk)
    assert np.array_equal(bits(blk), bits(fold(every_row(w))[lo:lo + len(blk)]))


@pytest.mark.parametrize("dtype", HALF[:2], ids=IDS[:2])
def test_persistent_starts_read_the_input_anew(dtype):
    """A persistent operation on the route is one engine operation: each Start folds the
    buffer's current contents, and the result is in the receive buffer once it completes."""
    size, rank = WORLD.size, WORLD.rank
    comm = mpicoll.Comm(WORLD, algorithm="direct")
    x = values(2001, rank, dtype, seed=4)
    y = np.empty_like(x)
    blk = np.empty(2001 // size, dtype)
    req = comm.Allreduce_init(x, y)
    rs = comm.Reduce_scatter_block_init(x[:len(blk) * size], blk)
    try:
        for k in range(2):
            x[:] = values(2001, rank, dtype, seed=5 + k)
            req.Start()
            req.Wait()
            assert np.array_equal(bits(y), bits(fold(every_row(x))))
            rs.Start()
            rs.Wait()
            w = x[:len(blk) * size]
            lo = rank * len(blk)
            assert np.array_equal(bits(blk), bits(fold(every_row(w))[lo:lo + len(blk)]))
    finally:
        req.Free()
        rs.Free()


def test_moves_the_input_type():
    """The ring's bytes in the input type: every block but this rank's own once, then this
    rank's folded block to every other rank (float32 on the wire would be twice that)."""
    dtype = np.dtype(ml_dtypes.bfloat16)
    size, rank = WORLD.size, WORLD.rank
    x = values(10007, rank, dtype)
    mine = split(len(x), size)[0][rank]
    with mpicoll.traffic() as t:
        mpicoll.allreduce(x, algorithm="direct")
    assert t.bytes_sent == dtype.itemsize * ((len(x) - mine) + (size - 1) * mine)
    with mpicoll.traffic() as t:
        mpicoll.reduce_scatter(x, algorithm="direct")
    assert t.bytes_sent == dtype.itemsize * (len(x) - mine)


@pytest.mark.parametrize("forced", ["ring", "direct"])
def test_a_forced_algorithm_names_the_route(forced, monkeypatch):
    """The ``algorithm`` option (MPICOLL_ALGORITHM) replaces "auto" as in the engine: "ring"
    keeps float32 on the wire at any size, "direct" takes the direct route at any size."""
    monkeypatch.setenv("MPICOLL_ALGORITHM", forced)
    comm = WORLD.Dup()  # a new context: it reads the option
    try:
        size, rank = comm.size, comm.rank
        for count in (3, 20011):
            x = values(count, rank, np.dtype(ml_dtypes.bfloat16), seed=6)
            mine = split(count, size)[0][rank]
            direct_bytes = 2 * ((count - mine) + (size - 1) * mine)
            with mpicoll.traffic() as t:
                y = mpicoll.allreduce(x, comm=comm)
            if forced == "direct":
                assert t.bytes_sent == direct_bytes and t.calls[0].algorithm == "direct"
                assert np.array_equal(bits(y), bits(fold(every_row(x))))
            elif count > 3 and size > 1:
                # float32 partials: twice the bytes (the ring's steps send other blocks)
                assert t.bytes_sent > 1.9 * direct_bytes
                assert t.calls[0].algorithm == "ring" or size == 1
            same_on_every_rank(y)
    finally:
        comm.Free()


def test_deterministic_mode_takes_it():
    """Deterministic mode runs the direct schedule: for 16/8-bit types, this route (the
    same float32 fold in rank order, with the input type's bytes)."""
    x = values(5003, WORLD.rank, np.dtype(np.float16), seed=3)
    with mpicoll.traffic() as t:
        y = mpicoll.allreduce(x, deterministic=True, algorithm="ring")
    assert np.array_equal(bits(y), bits(fold(every_row(x))))
    mine = split(len(x), WORLD.size)[0][WORLD.rank]
    assert t.bytes_sent == 2 * ((len(x) - mine) + (WORLD.size - 1) * mine)


# What "auto" takes, by collective, rank count and input bytes (measured with
# benchmarks/accumulate.py: docs/developing.md, "Recording measurements"): where the
# direct route measured faster on both MPIs it must stay on it, and on float32 on the wire
# where that one did (AllReduce: 1 KiB and below; 4 KiB at 3 ranks on Open MPI, at 4 ranks
# even).
_LARGE = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
AUTO_DIRECT = {"allreduce": {2: (4 << 10,) + _LARGE, 3: _LARGE, 4: _LARGE},
               "reduce_scatter": {2: (1 << 10, 4 << 10) + _LARGE, 3: (4 << 10,) + _LARGE,
                                  4: (1 << 10, 4 << 10) + _LARGE}}
AUTO_FLOAT32 = {"allreduce": {2: (64, 256, 1 << 10), 3: (1 << 10, 4 << 10),
                              4: (64, 256, 1 << 10, 4 << 10)},
                "reduce_scatter": {}}


class _Comm:  # a communicator of ``size`` ranks with no context yet (options: the environment)
    def __init__(self, size):
        self.size = size

    def Get_size(self):
        return self.size

    def Get_rank(self):
        return 0

    def Get_attr(self, keyval):
        return None


def _route(collective, nbytes, size, dtype=np.float16, algorithm="auto"):
    """The engine.select Policy of such a call (blocking), not deterministic."""
    x = np.zeros(nbytes // np.dtype(dtype).itemsize, dtype)
    counts = tuple(split(len(x), size)[0]) if collective != "allreduce" else None
    displs = tuple(split(len(x), size)[1]) if collective != "allreduce" else None
    out = msg_of_array(np.empty_like(x), NUMPY)
    call = Call(collective, _Comm(size), msg_of_array(x, NUMPY), out, counts, displs, MPI.SUM,
                algorithm, None, False)
    return _numerics.policy(call, {"deterministic": False, "algorithm": None}, size, True)


@pytest.mark.local
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter"])
def test_auto_takes_the_direct_route_where_measured_faster(collective, monkeypatch):
    monkeypatch.delenv("MPICOLL_ALGORITHM", raising=False)  # "auto" as it is
    for size, sizes in AUTO_DIRECT[collective].items():
        for nbytes in sizes:
            for dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
                r = _route(collective, nbytes, size, dtype)
                assert r.accumulate == np.float32 and r.algorithm == "direct", \
                    (size, nbytes, dtype)
                # what the bench reports as selected
                assert _numerics.direct_route(collective, "auto", dtype, MPI.SUM, nbytes, size)
    for size, sizes in AUTO_FLOAT32[collective].items():
        for nbytes in sizes:
            assert _route(collective, nbytes, size).accumulate is None, (size, nbytes)
            assert not _numerics.direct_route(collective, "auto", np.float16, MPI.SUM, nbytes,
                                              size)
    assert _route(collective, 1 << 10, 4, algorithm="direct").accumulate == np.float32
    assert _route(collective, 16 << 20, 2, algorithm="ring").accumulate is None
