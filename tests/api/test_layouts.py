"""Memory layouts and in place by memory.

Layouts: the array functions combine elements in *logical* order whatever each
rank's layout (C on one rank, Fortran or a strided view on another), and
accept any layout for ``out``; ``mpicoll.Comm`` takes raw buffers as mpi4py
does, so there the result must equal the built-in's on the same buffers.

In place by memory: ``out`` over exactly the memory of ``x`` is in place, whatever the
objects (``array.array``, ``bytearray``, ``memoryview``); a partial overlap is
a ValueError raised before any message.

Expected values come from MPI's built-in on C-ordered copies of the same data.
"""

from __future__ import annotations

import array

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll
from mpicoll.algorithms.ring import split
from mpicoll.tools import verify as V

# the API layer (arguments, shapes, layouts): 1 rank, 2 (a power of two), 3 (not);
# the algorithms behind it run at 1-5 ranks in test_collectives, through the same API
pytestmark = pytest.mark.ranks(1, 2, 3)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

AR_ALGOS = V.algorithms_for("allreduce", auto=True)
RS_ALGOS = V.algorithms_for("reduce_scatter", auto=True)
AG_ALGOS = V.algorithms_for("allgather", auto=True)


def laid_out(a, layout):
    """A copy of ``a`` (same logical values) in ``layout``: C, F or a strided view."""
    if layout == "C":
        return np.ascontiguousarray(a)
    if layout == "F":
        return np.asfortranarray(a)
    # every other element of a larger buffer, in Fortran order: neither C nor F contiguous
    big = np.zeros(tuple(2 * s for s in a.shape) or (2,), a.dtype, order="F")
    view = big[tuple(slice(None, None, 2) for _ in a.shape)] if a.ndim else big[:1].reshape(())
    view[...] = a
    return view


LAYOUTS = ["C", "F", "S"]


def _my_layout(shift=0):
    """Rank r uses LAYOUTS[(r + shift) % 3]: neighbouring ranks differ."""
    return LAYOUTS[(RANK + shift) % len(LAYOUTS)]


def _builtin_allreduce(a, op=MPI.SUM):
    out = np.empty_like(np.ascontiguousarray(a))
    WORLD.Allreduce(np.ascontiguousarray(a), out, op=op)
    return out


def _op(is_bytes):
    """SUM on float64; BXOR on bytes (a uint8 SUM that overflows is not portable across MPIs)."""
    return MPI.BXOR if is_bytes else MPI.SUM


# --- layouts: a 2x3 array, C on one rank and Fortran on another --------------------

def test_issue_2x3_c_on_one_rank_fortran_on_another():
    """Rank 0 C, rank 1 Fortran (then alternating): the logical sum on every rank."""
    x = np.arange(6).reshape(2, 3) * (RANK + 1)
    x = np.asfortranarray(x) if RANK % 2 else np.ascontiguousarray(x)
    y = mpicoll.allreduce(x)
    want = np.arange(6).reshape(2, 3) * (SIZE * (SIZE + 1) // 2)
    util.assert_all(WORLD, np.array_equal(y, want) and y.shape == (2, 3), f"got {y.tolist()}")


def test_fortran_x_with_out_empty_like():
    """allreduce(xF, out=np.empty_like(xF)) works and returns that (Fortran) out."""
    xf = np.asfortranarray(rank_data((3, 4), RANK, np.int64))
    out = np.empty_like(xf)
    got = mpicoll.allreduce(xf, out=out)
    ok = got is out and out.flags.f_contiguous and np.array_equal(out, _builtin_allreduce(xf))
    y = mpicoll.allreduce(xf)
    ok = ok and y.flags.f_contiguous and np.array_equal(y, out)
    util.assert_all(WORLD, ok, f"got {out.tolist()}")


# --- layouts: every combination, every algorithm -------------------------------------

@pytest.mark.parametrize("algorithm", AR_ALGOS)
@pytest.mark.parametrize("out_layout", ["new", "C", "F", "S", "in place"])
def test_allreduce_mixed_layouts(algorithm, out_layout):
    base = rank_data((5, 3), RANK, np.int64)
    want = _builtin_allreduce(base)
    x = laid_out(base, _my_layout())
    before = x.copy()
    if out_layout == "in place":
        got = mpicoll.allreduce(x, out=x, algorithm=algorithm)
        ok = np.array_equal(x, want)
    else:
        out = None if out_layout == "new" else laid_out(np.zeros_like(base), out_layout)
        got = mpicoll.allreduce(x, out=out, algorithm=algorithm)
        ok = np.array_equal(got, want) and np.array_equal(x, before)
        ok = ok and (out is None or got is out)
    util.assert_all(WORLD, ok, f"x {_my_layout()}, out {out_layout}: {np.asarray(got).tolist()}")


@pytest.mark.parametrize("algorithm", RS_ALGOS)
@pytest.mark.parametrize("out_layout", ["new", "C", "F", "S", "in place"])
def test_reduce_scatter_mixed_layouts(algorithm, out_layout):
    rows = 2 * SIZE + 1
    base = rank_data((rows, 3), RANK, np.int64)
    counts = split(rows, SIZE)[0]
    mine = counts[RANK]
    start = sum(counts[:RANK])
    want = _builtin_allreduce(base)[start: start + mine]
    x = laid_out(base, _my_layout(1))
    before = x.copy()
    if out_layout == "in place":
        got = mpicoll.reduce_scatter(x, out=x, algorithm=algorithm)
        ok = np.array_equal(got, want) and np.array_equal(x[:mine], want)
        ok = ok and np.array_equal(x[mine:], before[mine:])
    else:
        out = None if out_layout == "new" else laid_out(np.zeros((mine, 3), np.int64), out_layout)
        got = mpicoll.reduce_scatter(x, out=out, algorithm=algorithm)
        ok = np.array_equal(got, want) and np.array_equal(x, before)
        ok = ok and (out is None or got is out)
    util.assert_all(WORLD, ok, f"x {_my_layout(1)}, out {out_layout}: {np.asarray(got).tolist()}")


@pytest.mark.parametrize("algorithm", AG_ALGOS)
@pytest.mark.parametrize("out_layout", ["new", "C", "F", "S", "in place"])
def test_allgather_mixed_layouts(algorithm, out_layout):
    parts = [rank_data((2, 3), r, np.int64) for r in range(SIZE)]
    want = np.concatenate(parts)
    if out_layout == "in place":
        full = np.zeros_like(want)
        full[2 * RANK: 2 * RANK + 2] = parts[RANK]
        x = laid_out(full, _my_layout(2))
        got = mpicoll.allgather(x, out=x, algorithm=algorithm)
        ok = got is x and np.array_equal(x, want)
    else:
        x = laid_out(parts[RANK], _my_layout(2))
        before = x.copy()
        out = None if out_layout == "new" else laid_out(np.zeros_like(want), out_layout)
        got = mpicoll.allgather(x, out=out, algorithm=algorithm)
        ok = np.array_equal(got, want) and np.array_equal(x, before)
        ok = ok and (out is None or got is out)
    util.assert_all(WORLD, ok, f"x {_my_layout(2)}, out {out_layout}: {np.asarray(got).tolist()}")


# --- layouts: mpicoll.Comm moves raw memory, as mpi4py does ---------------------------

def test_comm_methods_fortran_buffers_match_the_builtin():
    """Fortran-ordered buffers through mpicoll.Comm give the built-in's bytes."""
    comm = mpicoll.Comm(WORLD)
    xf = np.asfortranarray(rank_data((SIZE, 3), RANK, np.int64))
    results = []
    for name, call in [
        ("Allreduce", lambda c, out: c.Allreduce(xf, out, op=MPI.SUM)),
        ("Reduce_scatter_block", lambda c, out: c.Reduce_scatter_block(xf, out[:3], op=MPI.SUM)),
        ("Allgather", lambda c, out: c.Allgather(np.asfortranarray(rank_data((3, 1), RANK, np.int64)), out[: 3 * SIZE])),
    ]:
        got = np.asfortranarray(np.zeros((SIZE, 3), np.int64))
        want = got.copy(order="F")
        call(comm, got.reshape(-1, order="A"))
        call(WORLD, want.reshape(-1, order="A"))
        results.append((name, util.same_bytes(got, want)))
    bad = [name for name, ok in results if not ok]
    util.assert_all(WORLD, not bad, f"differ from the built-in: {bad}")


# --- in place by memory, whatever the buffer object ----------------------------------

def _kinds(n):
    """(name, x, out) for each buffer kind over n float64 values; out over exactly x's memory."""
    vals = rank_data((n,), RANK, np.float64)
    arr = array.array("d", vals.tolist())
    ba = bytearray(vals.tobytes())
    mv_nd = memoryview(vals.copy())
    mv_ba = memoryview(bytearray(vals.tobytes()))
    arr2 = array.array("d", vals.tolist())
    nd = vals.copy()
    return [
        ("array.array", arr, arr),
        ("bytearray", ba, ba),
        ("memoryview of ndarray", mv_nd, mv_nd),
        ("memoryview of bytearray", mv_ba, mv_ba),
        ("array.array, out a memoryview of it", arr2, memoryview(arr2)),
        ("ndarray, out a second view of it", nd, nd.view()),
    ]


def _is_bytes(x) -> bool:
    return isinstance(x, bytearray) or (isinstance(x, memoryview) and x.format == "B")


@pytest.mark.parametrize("kind", range(6))
def test_in_place_allreduce_by_memory(kind):
    n = 4 * SIZE
    name, x, other = _kinds(n)[kind]
    is_bytes = _is_bytes(x)
    want_src = np.frombuffer(bytes(x), np.uint8) if is_bytes else rank_data((n,), RANK, np.float64)
    want = _builtin_allreduce(want_src, _op(is_bytes))
    got = mpicoll.allreduce(x, _op(is_bytes), out=other)
    now = np.frombuffer(bytes(x), want.dtype)
    ok = np.array_equal(now, want) and np.shares_memory(np.asarray(got), np.frombuffer(x, np.uint8))
    util.assert_all(WORLD, ok, f"{name}: {now.tolist()} want {want.tolist()}")


@pytest.mark.parametrize("kind", range(6))
def test_in_place_reduce_scatter_by_memory(kind):
    n = 4 * SIZE + 1
    name, x, other = _kinds(n)[kind]
    is_bytes = _is_bytes(x)
    src = np.frombuffer(bytes(x), np.uint8 if is_bytes else np.float64).copy()
    counts = split(len(src), SIZE)[0]
    start = sum(counts[:RANK])
    want = _builtin_allreduce(src, _op(is_bytes))[start: start + counts[RANK]]
    got = mpicoll.reduce_scatter(x, _op(is_bytes), out=other)
    now = np.frombuffer(bytes(x), src.dtype)
    ok = np.array_equal(np.asarray(got), want) and np.array_equal(now[: counts[RANK]], want)
    ok = ok and np.array_equal(now[counts[RANK]:], src[counts[RANK]:])
    util.assert_all(WORLD, ok, f"{name}: {now.tolist()} want {want.tolist()} first")


@pytest.mark.parametrize("kind", range(6))
def test_in_place_allgather_by_memory(kind):
    per = 3
    name, x, other = _kinds(per * SIZE)[kind]
    is_bytes = _is_bytes(x)
    dtype = np.uint8 if is_bytes else np.float64
    full = np.frombuffer(bytes(x), dtype).copy()
    want = np.empty_like(full)
    k = len(full) // SIZE
    WORLD.Allgather(full[RANK * k: (RANK + 1) * k].copy(), want)
    got = mpicoll.allgather(x, out=other)
    now = np.frombuffer(bytes(x), dtype)
    ok = np.array_equal(now, want) and np.array_equal(np.asarray(got), want)
    util.assert_all(WORLD, ok, f"{name}: {now.tolist()} want {want.tolist()}")


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
@pytest.mark.parametrize("kind", ["array.array", "bytearray", "ndarray"])
def test_partial_overlap_is_a_value_error(collective, kind):
    """out overlapping x in part: ValueError on every rank, no message, buffers untouched."""
    n = 2 * SIZE
    length = n * SIZE + n + 1
    if kind == "bytearray":
        base = bytearray(range(length))
    elif kind == "array.array":
        base = array.array("d", range(length))
    else:
        base = np.arange(float(length))
    mv = memoryview(base)
    x = mv[:n]
    out_len = {"allreduce": n, "reduce_scatter": split(n, SIZE)[0][RANK], "allgather": n * SIZE}
    out = mv[1: 1 + out_len[collective]]  # the right size, one element past x's start
    fn = getattr(mpicoll, collective)
    util.raises_everywhere(WORLD, ValueError, r"^out: expected memory apart from x \(or out=x",
                            lambda: fn(x, out=out), np.asarray(mv))


# --- the same rules on device arrays (the fake GPU: mpicoll's real device code) --------

@pytest.mark.parametrize("cuda_aware", [False, True], ids=["staging", "direct"])
def test_device_strided_and_in_place_by_memory(cuda_aware):
    from support import fakegpu

    be = fakegpu.fake_backend()
    rt = be.rt
    n = 3 * SIZE + 1
    base = rank_data((2 * n,), RANK, np.float64)
    want = _builtin_allreduce(base[::2])
    counts = split(n, SIZE)[0]
    start = sum(counts[:RANK])
    with fakegpu.registered(be), mpicoll.options(cuda_aware=cuda_aware):
        # a strided device view as x, a strided device view as out
        x = fakegpu.produce(rt, base)[::2]
        out = rt.xp.empty(2 * n, np.float64)[1::2]
        mpicoll.allreduce(x, out=out)
        got_ar = out.get()
        rs = mpicoll.reduce_scatter(x)
        got_rs = rs.get()
        # in place with out another device object over exactly x's memory
        y = fakegpu.produce(rt, base[:n])
        mpicoll.allreduce(y, out=y[:])
        got_in_place = y.get()
    ok = np.array_equal(got_ar, want) and np.array_equal(got_rs, want[start: start + counts[RANK]])
    ok = ok and np.array_equal(got_in_place, _builtin_allreduce(base[:n]))
    util.assert_all(WORLD, ok, f"{got_ar.tolist()} {got_rs.tolist()} {got_in_place.tolist()}")
