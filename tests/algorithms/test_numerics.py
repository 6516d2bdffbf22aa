"""16/8-bit floats and deterministic mode through the array functions and mpicoll.Comm.

bfloat16 / float8 (ml_dtypes) and float16 through the three collectives x
every algorithm x in/out of place, against the exact result: the inputs are
small multiples of 1/4, whose float32 sums are exact, so a float32-accumulated
result is the exact sum rounded once, bitwise.  Deterministic mode: bitwise
the rank-order fold for every algorithm, size, blocking or not, in place or
not.  A torch bfloat16 tensor through DLPack when torch is installed.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from support.data import half_types

import mpicoll
from mpicoll.engine import select as _select

ml_dtypes = pytest.importorskip("ml_dtypes")

WORLD = MPI.COMM_WORLD
HALF = half_types(ml_dtypes)
IDS = [str(d) for d in HALF]


def data(count, rank, dtype, seed=0):
    """Rank-asymmetric multiples of 1/4 small enough for every type (float8: below 8)."""
    top = 8 if dtype.itemsize == 1 else 200
    v = ((np.arange(count) * 7 + rank * 13 + seed) % top - top // 2) / 4
    return v.astype(dtype)


def every_input(x):
    return np.array(WORLD.allgather(x.astype(np.float64)))


def bits(a):
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("algorithm", _select.names("allreduce"))
@pytest.mark.parametrize("count", [0, 1, 3, 1000, 70000])
@pytest.mark.parametrize("in_place", [False, True])
def test_allreduce_half_sum_is_one_rounding(dtype, algorithm, count, in_place):
    x = data(count, WORLD.rank, dtype)
    keep = x.copy()
    exact = every_input(x).sum(axis=0).astype(dtype)
    if in_place:
        y = mpicoll.allreduce(x, out=x, algorithm=algorithm)
    else:
        y = mpicoll.allreduce(x, algorithm=algorithm)
        assert np.array_equal(bits(x), bits(keep))
    assert y.dtype == dtype
    assert np.array_equal(bits(y), bits(exact))


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("opname", ["MIN", "MAX", "PROD"])
def test_allreduce_half_other_ops(dtype, opname):
    x = data(257, WORLD.rank, dtype, seed=3)
    if opname == "PROD":  # exact in float32: +-1/2, 1, 3/2, 2
        x = (((np.arange(257) + WORLD.rank) % 4 + 1) / 2 * (-1) ** WORLD.rank).astype(dtype)
    rows = every_input(x)
    ref = {"MIN": rows.min(axis=0), "MAX": rows.max(axis=0), "PROD": rows.prod(axis=0)}[opname]
    y = mpicoll.allreduce(x, op=getattr(MPI, opname))
    assert np.array_equal(bits(y), bits(ref.astype(dtype)))


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("algorithm", _select.names("reduce_scatter"))
@pytest.mark.parametrize("rows", [0, 1, 5, 4099])
@pytest.mark.parametrize("in_place", [False, True])
def test_reduce_scatter_half(dtype, algorithm, rows, in_place):
    size, rank = WORLD.size, WORLD.rank
    x = data(rows * 2, rank, dtype).reshape(rows, 2)
    exact = every_input(x).sum(axis=0).astype(dtype)
    lo = sum(np.array_split(np.arange(rows), size)[r].size for r in range(rank))
    mine = np.array_split(np.arange(rows), size)[rank].size
    y = mpicoll.reduce_scatter(x, out=x if in_place else None, algorithm=algorithm)
    assert y.dtype == dtype and y.shape == (mine, 2)
    assert np.array_equal(bits(y), bits(exact[lo:lo + mine]))


@pytest.mark.parametrize("dtype", HALF, ids=IDS)
@pytest.mark.parametrize("algorithm", _select.names("allgather"))
@pytest.mark.parametrize("in_place", [False, True])
def test_allgather_moves_words(dtype, algorithm, in_place):
    size, rank = WORLD.size, WORLD.rank
    # every bit pattern goes through unchanged, NaNs included
    blocks = [(np.arange(300, dtype=np.uint16) * 97 + r).astype(f"u{dtype.itemsize}").view(dtype)
              for r in range(size)]
    if in_place:
        out = np.zeros(300 * size, dtype)
        out[300 * rank:300 * (rank + 1)] = blocks[rank]
        y = mpicoll.allgather(out, out=out, algorithm=algorithm)
    else:
        y = mpicoll.allgather(blocks[rank], algorithm=algorithm)
    assert y.dtype == dtype
    assert np.array_equal(bits(y), bits(np.concatenate(blocks)))


def test_accumulate_false_keeps_wire_partials():
    """Opt-out: still a valid sum, the same bits on every rank."""
    x = np.full(4, 1 + WORLD.rank / 3).astype(ml_dtypes.bfloat16)
    y = mpicoll.allreduce(x, accumulate=False, algorithm="ring")
    got = WORLD.allgather(bits(y).tobytes())
    assert all(g == got[0] for g in got)
    with pytest.raises(TypeError, match="accumulate"):
        mpicoll.allreduce(x, accumulate="yes")


def test_comm_half_and_nonblocking():
    dtype = np.dtype(ml_dtypes.bfloat16)
    comm = mpicoll.Comm(WORLD)
    x = data(1001, WORLD.rank, dtype)
    exact = every_input(x).sum(axis=0).astype(dtype)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    assert np.array_equal(bits(y), bits(exact))
    g = np.empty(1001 * WORLD.size, dtype)
    comm.Allgather(x, g)
    assert np.array_equal(bits(g), bits(np.concatenate(WORLD.allgather(x))))
    h = mpicoll.iallreduce(x)
    assert np.array_equal(bits(h.wait()), bits(exact))
    comm.Iallgather(x, g).Wait()
    assert np.array_equal(bits(g), bits(np.concatenate(WORLD.allgather(x))))
    with pytest.raises(TypeError, match="user-defined"):
        mpicoll.allreduce(x, op=MPI.Op.Create(lambda a, b, t: None, commute=True))


@pytest.mark.parametrize("dtype", HALF[:2], ids=IDS[:2])
def test_comm_requests_round_a_float32_result(dtype):
    """Comm's non-blocking and persistent forms accumulate in float32 too (the request's
    completion step rounds); a persistent Start reads the input anew."""
    size, rank = WORLD.size, WORLD.rank
    comm = mpicoll.Comm(WORLD)
    x = data(1001, rank, dtype)
    exact = every_input(x).sum(axis=0).astype(dtype)
    y = np.empty_like(x)
    comm.Iallreduce(x, y).Wait()
    assert np.array_equal(bits(y), bits(exact))
    y[:] = 0
    req = comm.Iallreduce(x, y)
    while not req.Test():
        pass
    assert np.array_equal(bits(y), bits(exact))
    req = comm.Allreduce_init(x, y)
    for seed in (1, 2):
        x[:] = data(1001, rank, dtype, seed)
        req.Start()
        req.Wait()
        assert np.array_equal(bits(y), bits(every_input(x).sum(axis=0).astype(dtype))), seed
    req.Free()
    x = data(7 * size, rank, dtype, seed=5)
    exact = every_input(x).sum(axis=0).astype(dtype)[7 * rank:7 * (rank + 1)]
    out = np.empty(7, dtype)
    comm.Ireduce_scatter_block(x, out).Wait()
    assert np.array_equal(bits(out), bits(exact))
    out[:] = 0
    req = comm.Reduce_scatter_block_init(x, out)
    req.Start()
    while not req.Test():
        pass
    assert np.array_equal(bits(out), bits(exact))
    req.Free()


# -- deterministic mode -------------------------------------------------------------

def fold(x, dtype):
    """The rank-order fold ((x0 + x1) + x2) + ... in the accumulation type, rounded once."""
    acc = np.float32 if dtype.itemsize <= 2 else dtype
    rows = WORLD.allgather(x)
    total = rows[0].astype(acc)
    for r in rows[1:]:
        total = total + r.astype(acc)
    return total.astype(dtype)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64),
                                   np.dtype(ml_dtypes.bfloat16)], ids=str)
@pytest.mark.parametrize("count", [1, 2, 1000, 1 << 18])  # 4 B .. 1 MiB of float32
def test_deterministic_bitwise_everywhere(dtype, count):
    rng = np.random.default_rng(100 + WORLD.rank)
    x = rng.normal(0.5, 1.0, count).astype(dtype)  # rounding differs with the grouping
    want = bits(fold(x, dtype))
    for algorithm in _select.names("allreduce"):
        assert np.array_equal(bits(mpicoll.allreduce(x, algorithm=algorithm, deterministic=True)),
                              want), algorithm
        h = mpicoll.iallreduce(x, algorithm=algorithm, deterministic=True)
        assert np.array_equal(bits(h.wait()), want), algorithm
        y = x.copy()
        mpicoll.allreduce(y, out=y, algorithm=algorithm, deterministic=True)
        assert np.array_equal(bits(y), want), algorithm
    lo = np.array_split(np.arange(count), WORLD.size)
    start = sum(b.size for b in lo[:WORLD.rank])
    mine = want[start:start + lo[WORLD.rank].size]
    for algorithm in _select.names("reduce_scatter"):
        got = mpicoll.reduce_scatter(x, algorithm=algorithm, deterministic=True)
        assert np.array_equal(bits(got), mine), algorithm
        got = mpicoll.ireduce_scatter(x, algorithm=algorithm, deterministic=True).wait()
        assert np.array_equal(bits(got), mine), algorithm
        y = x.copy()  # in place: rank 0 folds into its own block, the others via work memory
        got = mpicoll.reduce_scatter(y, out=y, algorithm=algorithm, deterministic=True)
        assert np.array_equal(bits(got), mine), algorithm
    comm = mpicoll.Comm(WORLD, deterministic=True)
    y = np.empty_like(x)
    comm.Allreduce(x, y)
    assert np.array_equal(bits(y), want)
    comm.Iallreduce(x, y).Wait()
    assert np.array_equal(bits(y), want)


def test_deterministic_option_and_environment():
    """MPICOLL_DETERMINISTIC, read when a communicator is set up, and configure(deterministic=)
    (which wins over it) send a floating SUM to the rank-order fold whatever ``algorithm=``."""
    import os

    from mpicoll.core import config as _config

    x = np.random.default_rng(7 + WORLD.rank).normal(0.5, 1.0, 999).astype(np.float32)
    want = bits(fold(x, x.dtype))
    os.environ["MPICOLL_DETERMINISTIC"] = "1"
    comm = WORLD.Dup()
    try:
        h = mpicoll.iallreduce(x, comm=comm, algorithm="ring")
        assert h.algorithm == "direct" and np.array_equal(bits(h.wait()), want)
        with mpicoll.options(deterministic=False):
            h = mpicoll.iallreduce(x, comm=comm, algorithm="ring")
            h.wait()
            assert h.algorithm == "ring"
    finally:
        del os.environ["MPICOLL_DETERMINISTIC"]
        comm.Free()
        _config.read_environment()  # the process-wide values: without the variable again
    with mpicoll.options(deterministic=True):
        assert np.array_equal(bits(mpicoll.allreduce(x, algorithm="recursive_doubling")), want)
    h = mpicoll.iallreduce(x, algorithm="ring")
    h.wait()
    assert h.algorithm == "ring"
    with pytest.raises(TypeError, match="deterministic"):
        mpicoll.configure(deterministic="yes")


def test_torch_bfloat16_through_dlpack():
    # torch.utils.dlpack, not torch: without torch installed, "torch" imports as the
    # namespace package of tests/torch (the rootdir is on sys.path)
    pytest.importorskip("torch.utils.dlpack")
    import torch
    rank, size = WORLD.rank, WORLD.size
    t = torch.full((3,), float(rank + 1), dtype=torch.bfloat16)
    y = mpicoll.allreduce(t)  # not garbage: 1 + 2 + ... + size
    assert y.astype(np.float64).tolist() == [size * (size + 1) / 2] * 3
    g = mpicoll.allgather(torch.arange(4, dtype=torch.float32).add(rank).to(torch.bfloat16))
    want = np.concatenate([np.arange(4) + r for r in range(size)])
    assert np.array_equal(g.astype(np.float64), want)
    mpicoll.allreduce(t, out=t)  # in place into the tensor's own memory
    assert t.float().tolist() == [size * (size + 1) / 2] * 3
