"""mpicoll.Comm as a drop-in mpi4py communicator: buffer specs, user ops, pair types, counts.

Expected values are functions of rank and size or MPI's built-in collective
on the same input (``MPI.Comm.Allreduce(comm, ...)`` calls mpi4py's own
method even on an ``mpicoll.Comm``).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI
from mpi4py.util import dtlib
from support import util
from support.buffers import DLPackOnly
from support.data import rank_data, rank_sum

import mpicoll
from mpicoll.tools import verify as V

# the API layer (arguments, shapes, layouts): 1 rank, 2 (a power of two), 3 (not);
# the algorithms behind it run at 1-5 ranks in test_collectives, through the same API
pytestmark = pytest.mark.ranks(1, 2, 3)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COMM = mpicoll.Comm(WORLD)
SENTINEL = -7

AR_ALGOS = V.algorithms_for("allreduce", auto=True)
RS_ALGOS = V.algorithms_for("reduce_scatter", auto=True)


# ---------------------------------------------------------------------------
# mpi4py buffer specs
# ---------------------------------------------------------------------------


def test_comm_is_the_same_intracomm():
    assert isinstance(COMM, MPI.Intracomm)
    assert COMM == WORLD and COMM.Get_rank() == RANK and COMM.Get_size() == SIZE
    assert mpicoll.Comm(COMM) == WORLD
    assert COMM.allreduce(1) == SIZE  # mpi4py's own methods still work
    COMM.Barrier()


SPEC_FORMS = {
    "bare": (lambda x: x, lambda y: y, slice(None), slice(None)),
    "[buf, MPI.INT]": (lambda x: [x, MPI.INT], lambda y: [y, MPI.INT], slice(None), slice(None)),
    "[buf, count, MPI.INT]": (lambda x: [x, 4, MPI.INT], lambda y: [y, 4, MPI.INT],
                              slice(0, 4), slice(0, 4)),
    "[buf, (count, displ), MPI.INT]": (lambda x: [x, (3, 2), MPI.INT],
                                       lambda y: [y, (3, 1), MPI.INT], slice(2, 5), slice(1, 4)),
    "[buf, 'i']": (lambda x: [x, "i"], lambda y: [y, "i"], slice(None), slice(None)),
    "[buf, count, 'i']": (lambda x: [x, 5, "i"], lambda y: [y, 5, "i"], slice(0, 5), slice(0, 5)),
}


@pytest.mark.parametrize("algorithm", AR_ALGOS)
@pytest.mark.parametrize("form", list(SPEC_FORMS))
def test_allreduce_spec_forms(form, algorithm):
    """Only the described elements are read and written; the rest of recvbuf keeps its value."""
    send_spec, recv_spec, ssl, rsl = SPEC_FORMS[form]
    x = rank_data(6, RANK, np.int32)
    y = np.full(6, SENTINEL, np.int32)
    mpicoll.Comm(WORLD, algorithm=algorithm).Allreduce(send_spec(x), recv_spec(y), MPI.SUM)
    want = np.full(6, SENTINEL, np.int32)
    want[rsl] = rank_sum(6, SIZE, np.int32)[ssl]
    util.assert_all(WORLD, np.array_equal(y, want) and np.array_equal(x, rank_data(6, RANK, np.int32)),
                     f"{form}: got {y}, want {want}")


@pytest.mark.parametrize("inplace", [MPI.IN_PLACE, None], ids=["IN_PLACE", "None"])
@pytest.mark.parametrize("algorithm", AR_ALGOS)
def test_allreduce_in_place_spellings(inplace, algorithm):
    y = rank_data(7, RANK, np.float64)
    mpicoll.Comm(WORLD, algorithm=algorithm).Allreduce(inplace, y, MPI.SUM)
    util.assert_all(WORLD, np.array_equal(y, rank_sum(7, SIZE, np.float64)), f"got {y}")


def test_float_typecode_and_datatype_reinterpretation():
    """[buf, 'd'] / [buf, MPI.FLOAT] read the bytes as that type, whatever the array's dtype."""
    x = rank_data(4, RANK, np.float64)
    y = np.zeros(4)
    COMM.Allreduce([x, "d"], [y, "d"], MPI.SUM)
    raw_x = rank_data(6, RANK, np.float32).view(np.uint8)  # float32 data seen as bytes
    raw_y = np.zeros(24, np.uint8)
    COMM.Allreduce([raw_x, MPI.FLOAT], [raw_y, MPI.FLOAT], MPI.SUM)
    ok = np.array_equal(y, rank_sum(4, SIZE, np.float64)) and \
        np.array_equal(raw_y.view(np.float32), rank_sum(6, SIZE, np.float32))
    util.assert_all(WORLD, ok, f"{y} {raw_y.view(np.float32)}")


def test_empty_messages():
    """[None, MPI.INT] is an empty message in every collective."""
    e = [None, MPI.INT]
    COMM.Allreduce(e, [None, MPI.INT], MPI.SUM)
    COMM.Allreduce(MPI.IN_PLACE, e, MPI.MAX)
    COMM.Reduce_scatter_block(e, [None, MPI.INT], MPI.SUM)
    COMM.Reduce_scatter(e, [None, MPI.INT], [0] * SIZE, MPI.SUM)
    COMM.Reduce_scatter(e, [None, MPI.INT], None, MPI.SUM)
    COMM.Allgather(e, [None, MPI.INT])
    COMM.Allgatherv(e, [None, [0] * SIZE, [0] * SIZE, MPI.INT])
    util.assert_all(WORLD, True)


def test_bytearray_buffers():
    """bytearray send/receive buffers, bare (bytes, MPI.BYTE-like) and typed [ba, MPI.INT]."""
    xs = rank_data(5, RANK, np.int32)
    ba_x, ba_y = bytearray(xs.tobytes()), bytearray(20)
    COMM.Allreduce([ba_x, MPI.INT], [ba_y, MPI.INT], MPI.SUM)
    got_sum = np.frombuffer(bytes(ba_y), np.int32)
    bits = bytearray([(RANK * 37 + i) % 256 for i in range(9)])
    out = bytearray(9)
    COMM.Allreduce(bits, out, MPI.BXOR)
    want_bits = np.zeros(9, np.uint8)
    for r in range(SIZE):
        want_bits ^= np.array([(r * 37 + i) % 256 for i in range(9)], np.uint8)
    ok = np.array_equal(got_sum, rank_sum(5, SIZE, np.int32)) and bytes(out) == want_bits.tobytes() \
        and bytes(ba_x) == xs.tobytes()
    util.assert_all(WORLD, ok, f"{got_sum} {bytes(out)!r}")


@pytest.mark.parametrize("algorithm", AR_ALGOS)
def test_dlpack_only_objects(algorithm):
    """Objects with only __dlpack__/__dlpack_device__ work as send and receive buffers."""
    x = rank_data(9, RANK, np.float64)
    y = np.zeros(9)
    c = mpicoll.Comm(WORLD, algorithm=algorithm)
    c.Allreduce(DLPackOnly(x), DLPackOnly(y), MPI.SUM)
    g = np.zeros(9 * SIZE)
    c.Allgather(DLPackOnly(x), DLPackOnly(g))
    want_g = np.concatenate([rank_data(9, r, np.float64) for r in range(SIZE)])
    ok = np.array_equal(y, rank_sum(9, SIZE, np.float64)) and np.array_equal(g, want_g)
    util.assert_all(WORLD, ok, f"{y} {g}")


@pytest.mark.parametrize("order_x, order_y", [("C", "C"), ("F", "F"), ("C", "F"), ("F", "C")])
def test_multidimensional_and_fortran_buffers(order_x, order_y):
    """Buffers are memory: elements combine in memory order, whatever the shape or order."""
    x = np.array(rank_data(12, RANK, np.int32).reshape(3, 4), order=order_x)
    y = np.full((3, 4), SENTINEL, np.int32, order=order_y)
    COMM.Allreduce(x, y, MPI.SUM)
    flat_sum = sum(np.array(rank_data(12, r, np.int32).reshape(3, 4), order=order_x).ravel(order="K")
                   for r in range(SIZE))
    ok = np.array_equal(y.ravel(order="K"), flat_sum)
    g = np.zeros((SIZE, 3, 4), np.int32)
    COMM.Allgather(x, g)
    ok &= all(np.array_equal(g[r].ravel(), np.array(rank_data(12, r, np.int32).reshape(3, 4),
                                                     order=order_x).ravel(order="K"))
              for r in range(SIZE))
    util.assert_all(WORLD, ok, f"{y}")


# ---------------------------------------------------------------------------
# Block collectives: per-rank counts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", V.algorithms_for("allgather", auto=True))
def test_allgather_count_is_per_rank(algorithm):
    """[recvbuf, count, T]: count is what each rank contributes (as in mpi4py)."""
    x = rank_data(5, RANK, np.int32)
    y = np.full(2 * SIZE + 3, SENTINEL, np.int32)
    mpicoll.Comm(WORLD, algorithm=algorithm).Allgather([x, 2, MPI.INT], [y, 2, MPI.INT])
    want = np.full(2 * SIZE + 3, SENTINEL, np.int32)
    want[: 2 * SIZE] = np.concatenate([rank_data(2, r, np.int32) for r in range(SIZE)])
    util.assert_all(WORLD, np.array_equal(y, want), f"got {y}, want {want}")


@pytest.mark.parametrize("algorithm", RS_ALGOS)
def test_reduce_scatter_block_forms(algorithm):
    c = mpicoll.Comm(WORLD, algorithm=algorithm)
    per = 3
    x = rank_data(per * SIZE, RANK, np.int32)
    total = rank_sum(per * SIZE, SIZE, np.int32)
    mine = total[RANK * per:(RANK + 1) * per]
    y = np.full(per, SENTINEL, np.int32)
    c.Reduce_scatter_block(x, y, MPI.SUM)
    ok = np.array_equal(y, mine)
    y2 = np.full(per + 2, SENTINEL, np.int32)
    c.Reduce_scatter_block([x, MPI.INT], [y2, per, MPI.INT], MPI.SUM)
    ok &= np.array_equal(y2[:per], mine) and np.all(y2[per:] == SENTINEL)
    buf = x.copy()  # in place: result in the first block, the rest untouched
    c.Reduce_scatter_block(MPI.IN_PLACE, buf, MPI.SUM)
    ok &= np.array_equal(buf[:per], mine) and np.array_equal(buf[per:], x[per:])
    util.assert_all(WORLD, ok, f"{y} {y2} {buf}")


@pytest.mark.parametrize("algorithm", RS_ALGOS)
def test_reduce_scatter_without_recvcounts(algorithm):
    """Without recvcounts each rank's count is its recvbuf length (exchanged), zeros included."""
    counts = V.uneven_counts(2, SIZE)
    x = rank_data(sum(counts), RANK, np.int32)
    y = np.full(counts[RANK], SENTINEL, np.int32)
    mpicoll.Comm(WORLD, algorithm=algorithm).Reduce_scatter(x, y, None, MPI.SUM)
    lo = sum(counts[:RANK])
    want = rank_sum(sum(counts), SIZE, np.int32)[lo:lo + counts[RANK]]
    ref = np.empty(counts[RANK], np.int32)
    MPI.Comm.Reduce_scatter(WORLD, x, ref, counts, MPI.SUM)
    ok = np.array_equal(y, want) and np.array_equal(ref, want)
    util.assert_all(WORLD, ok, f"got {y}, want {want}, MPI {ref}")


@pytest.mark.parametrize("algorithm", RS_ALGOS)
def test_reduce_scatter_uneven_recvcounts(algorithm):
    """recvcounts with zeros (every rank but the last gets nothing) and an in-place variant."""
    counts = [0] * (SIZE - 1) + [7]
    x = rank_data(7, RANK, np.float64)
    y = np.full(counts[RANK], SENTINEL, np.float64)
    c = mpicoll.Comm(WORLD, algorithm=algorithm)
    c.Reduce_scatter(x, y, counts, MPI.SUM)
    want = rank_sum(7, SIZE, np.float64) if RANK == SIZE - 1 else np.zeros(0)
    buf = x.copy()
    c.Reduce_scatter(MPI.IN_PLACE, buf, counts, MPI.SUM)
    n = counts[RANK]
    ok = np.array_equal(y, want) and np.array_equal(buf[:n], want) and \
        np.array_equal(buf[n:], x[n:])
    util.assert_all(WORLD, ok, f"{y} {buf}")


VECTOR_FORMS = {
    "[buf, counts, displs, T]": lambda y, c, d: [y, c, d, MPI.INT],
    "[buf, counts, displs]": lambda y, c, d: [y, c, d],
    "[buf, (counts, displs), T]": lambda y, c, d: [y, (c, d), MPI.INT],
    "[buf, counts, T] (packed)": lambda y, c, d: [y, c, MPI.INT],
}


@pytest.mark.parametrize("algorithm", V.algorithms_for("allgather", auto=True))
@pytest.mark.parametrize("form", list(VECTOR_FORMS))
def test_allgatherv_forms(form, algorithm):
    """Uneven counts with zeros; gapped reversed displacements; gaps keep their value."""
    counts = V.uneven_counts(2, SIZE)
    if "packed" in form:
        displs = [sum(counts[:r]) for r in range(SIZE)]
        length = sum(counts) + 2
    else:
        displs, length = V.gapped_displs(counts)
    x = rank_data(counts[RANK], RANK, np.int32)
    y = np.full(length, SENTINEL, np.int32)
    mpicoll.Comm(WORLD, algorithm=algorithm).Allgatherv(x, VECTOR_FORMS[form](y, counts, displs))
    want = np.full(length, SENTINEL, np.int32)
    for r in range(SIZE):
        want[displs[r]:displs[r] + counts[r]] = rank_data(counts[r], r, np.int32)
    ok = np.array_equal(y, want)
    z = want.copy()  # in place: own block already there
    z[displs[RANK]:displs[RANK] + counts[RANK]] = x
    for r in range(SIZE):
        if r != RANK:
            z[displs[r]:displs[r] + counts[r]] = SENTINEL
    mpicoll.Comm(WORLD, algorithm=algorithm).Allgatherv(
        MPI.IN_PLACE, VECTOR_FORMS[form](z, counts, displs))
    ok &= np.array_equal(z, want)
    util.assert_all(WORLD, ok, f"got {y} / {z}, want {want}")


# ---------------------------------------------------------------------------
# MINLOC / MAXLOC on pair types
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", AR_ALGOS)
@pytest.mark.parametrize("pair", ["DOUBLE_INT", "FLOAT_INT", "TWOINT", "LONG_INT", "SHORT_INT"])
def test_minloc_maxloc_pairs(pair, algorithm):
    """Structured arrays (aligned fields f0 value, f1 index) vs MPI's built-in and the closed form.

    Values repeat across ranks so ties occur: MPI keeps the lowest index.
    """
    T = getattr(MPI, pair)
    dt = dtlib.to_numpy_dtype(T)
    count = 2 * SIZE + 3
    i = np.arange(count)

    def data(r):
        a = np.zeros(count, dt)
        a["f0"] = (3 * r + i) % 4
        a["f1"] = r
        return a

    x = data(RANK)
    c = mpicoll.Comm(WORLD, algorithm=algorithm)
    bad = []
    for opname in ("MINLOC", "MAXLOC"):
        op = getattr(MPI, opname)
        y = np.zeros(count, dt)
        c.Allreduce([x, T], [y, T], op)
        ref = np.zeros(count, dt)
        MPI.Comm.Allreduce(WORLD, [x, T], [ref, T], op)
        vals = np.stack([data(r)["f0"] for r in range(SIZE)])
        best = vals.min(axis=0) if opname == "MINLOC" else vals.max(axis=0)
        first = np.argmax(vals == best, axis=0)  # lowest rank holding the best value
        if not (np.array_equal(y["f0"], best) and np.array_equal(y["f1"], first)):
            bad.append(f"{opname}: got {y}, want values {best} at {first}")
        if not V.same_values(y, ref):
            bad.append(f"{opname}: differs from MPI's built-in {ref}")
        inplace = x.copy()
        c.Allreduce(MPI.IN_PLACE, [inplace, T], op)
        if not V.same_values(inplace, ref):
            bad.append(f"{opname} in place: {inplace}")
    util.assert_all(WORLD, not bad, "; ".join(bad))


# ---------------------------------------------------------------------------
# User-defined ops
# ---------------------------------------------------------------------------


def _int_add(inbuf, inoutbuf, datatype):
    dt = dtlib.to_numpy_dtype(datatype)
    a, b = np.frombuffer(inbuf, dt), np.frombuffer(inoutbuf, dt)
    b += a


def _affine_compose(inbuf, inoutbuf, datatype):
    """(a1, b1) o (a2, b2) = x -> a1 (a2 x + b2) + b1: associative, not commutative."""
    dt = dtlib.to_numpy_dtype(datatype)
    f, g = np.frombuffer(inbuf, dt), np.frombuffer(inoutbuf, dt)
    a1, b1, a2, b2 = f["f0"].copy(), f["f1"].copy(), g["f0"].copy(), g["f1"].copy()
    g["f0"] = a1 * a2
    g["f1"] = a1 * b2 + b1


def _keep_left(inbuf, inoutbuf, datatype):
    """a o b = a: associative, not commutative; the result is rank 0's data."""
    dt = dtlib.to_numpy_dtype(datatype)
    np.frombuffer(inoutbuf, dt)[:] = np.frombuffer(inbuf, dt)


@pytest.fixture(scope="module")
def user_ops():
    ops = {
        "add": MPI.Op.Create(_int_add, commute=True),
        "affine": MPI.Op.Create(_affine_compose, commute=False),
        "left": MPI.Op.Create(_keep_left, commute=False),
    }
    yield ops
    for op in ops.values():
        op.Free()


def _affine_data(count, r):
    a = np.zeros(count, dtlib.to_numpy_dtype(MPI.TWOINT))
    i = np.arange(count)
    a["f0"] = (r + i) % 3 - 1 + 2 * ((r + i) % 2)  # small, varied, some negative
    a["f1"] = 5 * r - i
    return a


def _affine_expected(count):
    acc = _affine_data(count, 0)
    for r in range(1, SIZE):
        nxt = _affine_data(count, r)
        acc["f1"] = acc["f0"] * nxt["f1"] + acc["f1"]
        acc["f0"] = acc["f0"] * nxt["f0"]
    return acc


@pytest.mark.parametrize("algorithm", AR_ALGOS)
def test_commutative_user_op(user_ops, algorithm):
    """A commutative Python op (integer add) on every algorithm equals MPI.SUM and MPI's built-in."""
    op = user_ops["add"]
    x = rank_data(3 * SIZE + 1, RANK, np.int64)
    y = np.zeros_like(x)
    c = mpicoll.Comm(WORLD, algorithm=algorithm)
    c.Allreduce(x, y, op)
    ref = np.zeros_like(x)
    MPI.Comm.Allreduce(WORLD, x, ref, op)
    per = 2
    rs = np.zeros(per, np.int64)
    rsx = rank_data(per * SIZE, RANK, np.int64)
    c.Reduce_scatter_block(rsx, rs, op)
    want_rs = rank_sum(per * SIZE, SIZE, np.int64)[RANK * per:(RANK + 1) * per]
    ok = np.array_equal(y, rank_sum(len(x), SIZE, np.int64)) and np.array_equal(y, ref) \
        and np.array_equal(rs, want_rs)
    util.assert_all(WORLD, ok, f"{y} vs {ref}; {rs} vs {want_rs}")


ORDERED_AR = [a for a in AR_ALGOS if a == "auto" or a in mpicoll.engine.select.ORDER_PRESERVING]
UNORDERED_AR = [a for a in AR_ALGOS if a not in ORDERED_AR]
ORDERED_RS = [a for a in RS_ALGOS if a == "auto" or a in mpicoll.engine.select.ORDER_PRESERVING]
UNORDERED_RS = [a for a in RS_ALGOS if a not in ORDERED_RS]


@pytest.mark.parametrize("algorithm", ORDERED_AR)
def test_noncommutative_user_op_allreduce(user_ops, algorithm):
    """Affine-map composition on [buf, MPI.TWOINT] gives MPI's rank-order result."""
    T = MPI.TWOINT
    count = 2 * SIZE + 1
    x = _affine_data(count, RANK)
    bad = []
    c = mpicoll.Comm(WORLD, algorithm=algorithm)
    y = np.zeros_like(x)
    c.Allreduce([x, T], [y, T], user_ops["affine"])
    ref = np.zeros_like(x)
    MPI.Comm.Allreduce(WORLD, [x, T], [ref, T], user_ops["affine"])
    if not (V.same_values(y, ref) and V.same_values(y, _affine_expected(count))):
        bad.append(f"affine: got {y}, MPI {ref}")
    z = x.copy()
    c.Allreduce(MPI.IN_PLACE, [z, T], user_ops["affine"])
    if not V.same_values(z, ref):
        bad.append(f"affine in place: got {z}, MPI {ref}")
    f = rank_data(5, RANK, np.float64)
    g = mpicoll.allreduce(f, user_ops["left"], algorithm=algorithm)
    if not np.array_equal(g, rank_data(5, 0, np.float64)):
        bad.append(f"left projection: got {g}")
    util.assert_all(WORLD, not bad, "; ".join(bad))


@pytest.mark.parametrize("algorithm", ORDERED_RS)
def test_noncommutative_user_op_reduce_scatter(user_ops, algorithm):
    """Reduce_scatter with a non-commutative op equals MPI's built-in Reduce_scatter."""
    T = MPI.TWOINT
    counts = V.uneven_counts(1, SIZE)
    x = _affine_data(sum(counts), RANK)
    y = np.zeros(counts[RANK], x.dtype)
    mpicoll.Comm(WORLD, algorithm=algorithm).Reduce_scatter([x, T], [y, T], counts,
                                                            user_ops["affine"])
    ref = np.zeros(counts[RANK], x.dtype)
    MPI.Comm.Reduce_scatter(WORLD, [x, T], [ref, T], counts, user_ops["affine"])
    lo = sum(counts[:RANK])
    ok = V.same_values(y, ref) and V.same_values(y, _affine_expected(sum(counts))[lo:lo + len(y)])
    util.assert_all(WORLD, ok, f"got {y}, MPI {ref}")


@pytest.mark.parametrize("collective, algorithm",
                         [("allreduce", a) for a in UNORDERED_AR] +
                         [("reduce_scatter", a) for a in UNORDERED_RS])
def test_noncommutative_op_refused_by_reordering_algorithms(user_ops, collective, algorithm):
    """Forcing a reordering algorithm with a non-commutative op: ValueError before any message."""
    x = rank_data(2 * SIZE, RANK, np.float64)
    y = x.copy()
    op = user_ops["left"]
    fn = getattr(mpicoll, collective)
    util.raises_everywhere(WORLD, ValueError, f"{algorithm}.*non-commutative",
                            lambda: fn(x, op, algorithm=algorithm), x, y)
    c = mpicoll.Comm(WORLD, algorithm=algorithm)
    call = (lambda: c.Allreduce(x, y, op)) if collective == "allreduce" else \
        (lambda: c.Reduce_scatter_block(x, y[:2], op))
    util.raises_everywhere(WORLD, ValueError, "non-commutative", call, x, y)


def test_noncommutative_op_ignores_env_override(user_ops, monkeypatch):
    """MPICOLL_ALGORITHM=ring does not apply to a non-commutative op: it stays in rank order."""
    monkeypatch.setenv("MPICOLL_ALGORITHM", "ring")
    f = rank_data(SIZE + 2, RANK, np.float64)
    g = mpicoll.allreduce(f, user_ops["left"])
    util.assert_all(WORLD, np.array_equal(g, rank_data(SIZE + 2, 0, np.float64)), f"{g}")


# ---------------------------------------------------------------------------
# Reduce_scatter without recvcounts: bad arguments on one rank stop every rank
# ---------------------------------------------------------------------------


def _rs_one_rank_bad(bad_rank, kind):
    x = rank_data(2 * SIZE, RANK, np.float64)
    y = np.zeros(2)
    if RANK == bad_rank and kind == "read-only recvbuf":
        y.flags.writeable = False
    if RANK == bad_rank and kind == "send count":
        x = rank_data(2 * SIZE + 1, RANK, np.float64)
    return x, y


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["read-only recvbuf", "send count"])
def test_reduce_scatter_exchange_refuses_on_every_rank(kind):
    """One rank's bad Reduce_scatter (counts exchanged) raises on every rank; nobody waits."""
    bad_rank = SIZE - 1
    x, y = _rs_one_rank_bad(bad_rank, kind)
    try:
        COMM.Reduce_scatter(x, y)
        raised = None
    except ValueError as exc:
        raised = str(exc)
    if kind == "read-only recvbuf":
        want = (r"recvbuf: expected a writable buffer" if RANK == bad_rank
                else rf"rank\(s\) \[{bad_rank}\] refused their arguments")
    else:
        want = (rf"mismatch in send count {2 * SIZE + 1} and sum\(counts\) {2 * SIZE}"
                if RANK == bad_rank else
                rf"mismatch in send count {2 * SIZE + 1} and sum\(counts\) {2 * SIZE} on rank")
    ok = raised is not None and re.search(want, raised) is not None
    # the communicator still works: a good call after the refused one
    x, y = rank_data(2 * SIZE, RANK, np.float64), np.zeros(2)
    COMM.Reduce_scatter(x, y)
    ok = ok and np.array_equal(y, rank_sum(2 * SIZE, SIZE, np.float64)[2 * RANK:2 * RANK + 2])
    util.assert_all(WORLD, ok, f"raised {raised!r}, want {want!r}; then {y}")
