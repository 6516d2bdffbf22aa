"""mpicoll.Comm with derived MPI datatypes, against MPI's own collectives on the same input.

Every collective, blocking, non-blocking and persistent, in place and out of
place, runs on the derived datatypes a user makes (:data:`TYPES`) and is
compared bit for bit with MPI's built-in on copies of the same buffers
(``MPI.Intracomm.Allreduce(WORLD, ...)``): the whole receive buffer, so the
bytes outside the type map (a vector's gaps, a subarray's border, one spare
element at the end) must stay as MPI leaves them, and the send buffer must be
unchanged.  Data are rank-asymmetric (support.data.rank_data), counts uneven and
zero on some ranks, Allgatherv's blocks placed in reverse rank order with holes.
A persistent request is started twice, the input changed in between.

Reductions run with ``MPI.SUM`` and with a user-defined op.  MPI defines its
predefined ops on predefined datatypes only (Open MPI and MPICH raise
``MPI_ERR_OP`` for them on any derived datatype), which mpicoll extends to the
datatypes of one type: a SUM is compared with MPI's built-in SUM of the
elements packed by hand (:data:`TYPES` says where they are).  A user op is
compared with MPI's built-in on the datatype itself; mpicoll runs it on the
contiguous datatypes and hands the others to MPI ("delegated": ``mpicoll.traffic``
names the algorithm), as it does every call of the struct of mixed types.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COMM = mpicoll.Comm(WORLD)
D = MPI.DOUBLE
MIXED_NAME = "struct (mixed types)"
CONTIGUOUS = ("contiguous", "struct (one type, no gaps)", "dup")  # (reduced by mpicoll)

# name -> (the datatype, as a user builds it; committed by the fixture), where its data are
# (float64 offsets from an element's start, in type-map order: what the test's op reads)
TYPES = {
    "contiguous": (lambda: D.Create_contiguous(3), (0, 1, 2)),
    "vector": (lambda: D.Create_vector(2, 2, 3), (0, 1, 3, 4)),
    "hvector": (lambda: D.Create_hvector(2, 1, 24), (0, 3)),
    "indexed": (lambda: D.Create_indexed([2, 1], [3, 0]), (3, 4, 0)),  # (out of memory order)
    "indexed_block": (lambda: D.Create_indexed_block(2, [4, 0]), (4, 5, 0, 1)),
    "hindexed": (lambda: D.Create_hindexed([1, 2], [16, 32]), (2, 4, 5)),
    "subarray": (lambda: D.Create_subarray([3, 4], [2, 2], [1, 1]), (5, 6, 9, 10)),
    # elements that interleave (extent 8, data 128 bytes apart), as an array's column
    "resized vector": (lambda: D.Create_vector(2, 1, 16).Create_resized(0, 8), (0, 16)),
    "struct (one type)": (lambda: MPI.Datatype.Create_struct([2, 1], [0, 24], [D, D]),
                          (0, 1, 3)),
    "struct (one type, no gaps)": (lambda: MPI.Datatype.Create_struct([1, 2], [0, 8], [D, D]),
                                   (0, 1, 2)),
    "dup": (lambda: D.Dup(), (0,)),
    MIXED_NAME: (lambda: MPI.Datatype.Create_struct([1, 1], [0, 8], [MPI.INT, D]), None),
}
DATA: dict = {}  # datatype handle -> (its float64 offsets, its extent in float64s)

MIXED = np.dtype({"names": ["i", "d"], "formats": [np.int32, np.float64], "offsets": [0, 8],
                  "itemsize": 16})


def _at(buf, n):
    """``n`` float64 from the start of an op's buffer (its memoryview covers count x extent
    bytes, an element's data may reach beyond: a resized type's)."""
    address = np.frombuffer(buf, np.uint8).__array_interface__["data"][0]
    return np.ctypeslib.as_array((ctypes.c_double * n).from_address(address))


def _add(inbuf, inoutbuf, datatype):
    """inout = in + inout on the data of each element of ``datatype`` (no byte beyond: MPI's
    scratch buffers hold only those)."""
    offsets, extent = DATA[datatype.handle]
    count = len(memoryview(inbuf).cast("B")) // (8 * extent)
    if count == 0:
        return
    at = (np.arange(count)[:, None] * extent + np.array(offsets)).ravel()
    n = int(at.max()) + 1
    a, b = _at(inbuf, n), _at(inoutbuf, n)
    b[at] += a[at]


def _mixed_add(inbuf, inoutbuf, datatype):
    """inout = in + inout, field by field, for the struct of an int and a double."""
    a, b = np.frombuffer(inbuf, MIXED), np.frombuffer(inoutbuf, MIXED)
    b["i"] += a["i"]
    b["d"] += a["d"]


@pytest.fixture(scope="module")
def types():
    made = {name: build().Commit() for name, (build, _) in TYPES.items()}
    for name, (_, offsets) in TYPES.items():
        DATA[made[name].handle] = (offsets, made[name].Get_extent()[1] // 8)
    ops = {"add": MPI.Op.Create(_add, commute=True),
           "mixed": MPI.Op.Create(_mixed_add, commute=True)}
    yield made, ops
    for t in made.values():
        t.Free()
    for op in ops.values():
        op.Free()


def _reach(T, count) -> int:
    """Bytes of a buffer that ``count`` elements of ``T`` at its start reach."""
    if count == 0:
        return 0
    lb, extent = T.Get_extent()
    true_lb, true_extent = T.Get_true_extent()
    return (count - 1) * extent + true_lb + true_extent


def _data(nbytes, salt) -> np.ndarray:
    """A float64 buffer of at least ``nbytes`` (and a spare element) of this rank's data."""
    return rank_data(-(-nbytes // 8) + 1, RANK, np.float64, salt)


def _blank(nbytes) -> np.ndarray:
    """A receive buffer of at least ``nbytes`` (and a spare element), every value distinct."""
    return -(np.arange(-(-nbytes // 8) + 1, dtype=np.float64) + 0.5)


def _vcounts():
    """Allgatherv's counts (uneven, 0 on rank 1) and displacements (reverse rank order, one
    element's hole after each block), in elements of the datatype; their extent."""
    counts = [(2, 0, 3, 1, 2)[r % 5] for r in range(SIZE)]
    displs, at = [0] * SIZE, 0
    for r in reversed(range(SIZE)):
        displs[r] = at
        at += counts[r] + 1
    return counts, displs, at


RS_COUNTS = [(1, 3, 0, 2, 1)[r % 5] for r in range(SIZE)]


AR_COUNT, BLOCK = 3, 2  # (elements of an Allreduce, per rank of a Reduce_scatter_block)


def _case(method, T, op, in_place, salt, counts=True):
    """(send array or None, receive array, args(send, recv) -> the method's arguments, bytes
    of the receive buffer compared: None for all of it)."""
    if method == "Allreduce":
        c = AR_COUNT
        nb = _reach(T, c)
        return (None if in_place else _data(nb, salt), _data(nb, salt) if in_place else _blank(nb),
                lambda s, r: (MPI.IN_PLACE if s is None else [s, c, T], [r, c, T], op), None)
    if method == "Allgather":
        c = 2
        nb = _reach(T, c * SIZE)
        return (None if in_place else _data(_reach(T, c), salt),
                _data(nb, salt) if in_place else _blank(nb),
                lambda s, r: (MPI.IN_PLACE if s is None else [s, c, T], [r, c, T]), None)
    if method == "Allgatherv":
        vc, vd, extent = _vcounts()
        nb = _reach(T, extent)
        return (None if in_place else _data(_reach(T, vc[RANK]), salt),
                _data(nb, salt) if in_place else _blank(nb),
                lambda s, r: (MPI.IN_PLACE if s is None else [s, vc[RANK], T],
                              [r, (vc, vd), T]), None)
    if method == "Reduce_scatter_block":
        c = BLOCK
        whole = _reach(T, c * SIZE)
        if in_place:  # (the result: the first block; the rest is MPI's scratch)
            return (None, _data(whole, salt), lambda s, r: (MPI.IN_PLACE, [r, c, T], op),
                    _reach(T, c))
        return (_data(whole, salt), _blank(_reach(T, c)),
                lambda s, r: ([s, c, T], [r, c, T], op), None)
    total = sum(RS_COUNTS)
    mine = RS_COUNTS[RANK]
    recvcounts = RS_COUNTS if counts else None
    if in_place:
        return (None, _data(_reach(T, total), salt),
                lambda s, r: (MPI.IN_PLACE, [r, total, T], RS_COUNTS, op), _reach(T, mine))
    return (_data(_reach(T, total), salt), _blank(_reach(T, mine)),
            lambda s, r: ([s, total, T], [r, mine, T], recvcounts, op), None)


def _copy(a):
    return None if a is None else a.copy()


def _compare(label, got, want, region, sent, sent0, bad):
    g, w = got.view(np.uint8), want.view(np.uint8)
    if region is not None:
        g, w = g[:region], w[:region]
    if not np.array_equal(g, w):
        diff = np.flatnonzero(g != w)
        bad.append(f"{label}: {len(diff)} bytes differ from MPI's, first at byte {diff[0]}")
    if sent is not None and not np.array_equal(sent.view(np.uint8), sent0.view(np.uint8)):
        bad.append(f"{label}: sendbuf changed")


def _mpicoll(method, form, args):
    """Run ``method`` of mpicoll.Comm in ``form``; the persistent request (or None)."""
    if form == "blocking":
        getattr(COMM, method)(*args)
        return None
    if form == "nonblocking":
        req = getattr(COMM, "I" + method[0].lower() + method[1:])(*args)
        req.Wait()
        return None
    req = getattr(COMM, method + "_init")(*args)
    req.Start()
    req.Wait()
    return req


def _reference(method, T, op, args, send, recv):
    """The receive buffer MPI's built-in leaves (on copies of ``send``, ``recv``): on ``T``
    itself, or for MPI.SUM (which MPI refuses on derived datatypes) on the elements of
    ``T`` packed by hand, the result written back to where they were."""
    send, recv = _copy(send), _copy(recv)
    if op != MPI.SUM:
        getattr(MPI.Intracomm, method)(WORLD, *args(send, recv))
        return recv
    offsets, extent = DATA[T.handle]

    def at(count):  # (the float64s of ``count`` elements of T)
        return (np.arange(count)[:, None] * extent + np.array(offsets, dtype=int)).ravel()

    src = recv if send is None else send
    n = len(offsets)
    if method == "Allreduce":
        total, mine, counts = AR_COUNT, AR_COUNT, None
    elif method == "Reduce_scatter_block":
        total, mine, counts = BLOCK * SIZE, BLOCK, [BLOCK * n] * SIZE
    else:
        total, mine, counts = sum(RS_COUNTS), RS_COUNTS[RANK], [k * n for k in RS_COUNTS]
    result = np.empty(mine * n)
    if counts is None:
        WORLD.Allreduce(src[at(total)], result, MPI.SUM)
    else:
        WORLD.Reduce_scatter(src[at(total)], result, counts, MPI.SUM)
    recv[at(mine)] = result
    return recv


def _run_case(method, name, T, op, in_place, form, bad, counts=True):
    label = (f"{method} {name} {'' if op is None or op == MPI.SUM else 'user op '}"
             f"{'in place' if in_place else 'out of place'} {form}")
    send, recv, args, region = _case(method, T, op, in_place, 0, counts)
    want = _reference(method, T, op, args, send, recv)
    sent0 = _copy(send)
    with mpicoll.traffic() as t:
        req = _mpicoll(method, form, args(send, recv))
    _compare(label, recv, want, region, send, sent0, bad)
    algos = {c.algorithm for c in t.calls if c.collective != "reduce_scatter.recvcounts"}
    delegated = name == MIXED_NAME or (op not in (None, MPI.SUM) and name not in CONTIGUOUS)
    if algos != ({"delegated"} if delegated else algos - {"delegated"}) or not algos:
        bad.append(f"{label}: ran {sorted(algos)}, expected {'' if delegated else 'not '}delegated")
    if req is not None:  # a second start, on new input in the same buffers
        send2, recv2, _, _ = _case(method, T, op, in_place, 1, counts)
        if send is not None:
            send[...] = send2
        recv[...] = recv2
        sent0 = _copy(send)
        want = _reference(method, T, op, args, send, recv)
        req.Start()
        req.Wait()
        req.Free()
        _compare(f"{label}, second start", recv, want, region, send, sent0, bad)


def _ops(method, name, ops):
    """The ops a case runs with: none for a gather; MPI.SUM and a user op for a reduction
    (the struct of mixed types: its user op alone)."""
    if "gather" in method:
        return [None]
    return [ops["mixed"]] if name == MIXED_NAME else [MPI.SUM, ops["add"]]


FORMS = ("blocking", "nonblocking", "persistent")
METHODS = ("Allreduce", "Allgather", "Allgatherv", "Reduce_scatter_block", "Reduce_scatter")


@pytest.mark.parametrize("method", METHODS)
def test_derived_matrix(types, method):
    """Every datatype x op x in place and out x blocking, non-blocking and persistent,
    against MPI's built-in."""
    made, ops = types
    bad = []
    for name, T in made.items():
        for op in _ops(method, name, ops):
            for in_place in (False, True):
                for form in FORMS:
                    _run_case(method, name, T, op, in_place, form, bad)
    util.assert_all(WORLD, not bad, "\n".join(bad[:8]))


def test_reduce_scatter_counts_exchanged(types):
    """Reduce_scatter without recvcounts (each rank's receive count exchanged first)."""
    made, ops = types
    bad = []
    for name, T in made.items():
        for op in _ops("Reduce_scatter", name, ops):
            for form in FORMS:
                _run_case("Reduce_scatter", name, T, op, False, form, bad, counts=False)
    util.assert_all(WORLD, not bad, "\n".join(bad[:8]))


# ---------------------------------------------------------------------------
# The calls of a distributed-array framework (a column gathered through a resized
# vector, a reduction through a contiguous type with a user op)
# ---------------------------------------------------------------------------


def _column_type(n):
    """One column of a (2, n) float64 array: a vector resized to one element."""
    return MPI.DOUBLE.Create_vector(2, 1, n).Create_resized(0, 8).Commit()


def test_allgather_of_columns():
    """Every rank's (2, 1) column x lands in column ``rank`` of y, through the column type."""
    n = SIZE
    col = _column_type(n)
    x = np.array([[RANK + 1.0], [10.0 * (RANK + 1)]])
    y, want = np.zeros((2, n)), np.zeros((2, n))
    COMM.Allgather([x, 2, MPI.DOUBLE], [y, 1, col])
    WORLD.Allgather([x, 2, MPI.DOUBLE], [want, 1, col])
    col.Free()
    util.assert_all(WORLD, np.array_equal(y, want) and y[1, -1] == 10.0 * n, f"got {y}, want {want}")


def test_allgatherv_of_columns():
    """The same with Allgatherv: one column per rank at displacement ``rank``."""
    n = SIZE
    col = _column_type(n)
    x = np.array([[RANK + 1.0], [10.0 * (RANK + 1)]])
    y, want = np.zeros((2, n)), np.zeros((2, n))
    COMM.Allgatherv([x, 2, MPI.DOUBLE], [y, ([1] * n, list(range(n))), col])
    WORLD.Allgatherv([x, 2, MPI.DOUBLE], [want, ([1] * n, list(range(n))), col])
    col.Free()
    util.assert_all(WORLD, np.array_equal(y, want) and y[0, -1] == n, f"got {y}, want {want}")


def _int_add(inbuf, inoutbuf, datatype):
    b = np.frombuffer(inoutbuf, np.intc)
    b += np.frombuffer(inbuf, np.intc)


def test_allreduce_in_place_contiguous_type_user_op():
    """In place, one element of a contiguous type of 4 ints, a user op: the elementwise sum."""
    quad = MPI.INT.Create_contiguous(4).Commit()
    op = MPI.Op.Create(_int_add, commute=True)
    buf = rank_data(8, RANK, np.intc)
    want = buf.copy()
    COMM.Allreduce(MPI.IN_PLACE, [buf, 1, quad], op)
    WORLD.Allreduce(MPI.IN_PLACE, [want, 1, quad], op)
    op.Free()
    quad.Free()
    util.assert_all(WORLD, np.array_equal(buf, want), f"got {buf}, want {want}")


# ---------------------------------------------------------------------------
# User-defined ops: handed the datatype itself, on every algorithm
# ---------------------------------------------------------------------------

SEEN: list = []  # datatype handles the op was called with


def _matmul(inbuf, inoutbuf, datatype):
    """inout = in @ inout for 2x2 int32 matrices, one per element of ``datatype`` (4 ints):
    associative, not commutative, exact (integer arithmetic wraps)."""
    SEEN.append(datatype.handle)
    a = np.frombuffer(inbuf, np.int32).reshape(-1, 2, 2)
    b = np.frombuffer(inoutbuf, np.int32).reshape(-1, 2, 2)
    b[...] = np.matmul(a, b)


def test_user_op_sees_the_datatype():
    """A non-commutative op on a contiguous type of 4 ints (a 2x2 matrix per element) runs on
    mpicoll's algorithms, is handed that datatype (as MPI hands it) and gives MPI's
    result bit for bit: AllReduce, ReduceScatter (block and vector), in place and out."""
    mat = MPI.INT.Create_contiguous(4).Commit()
    op = MPI.Op.Create(_matmul, commute=False)
    bad, calls = [], 0
    n = 3
    x = (rank_data(4 * n * SIZE, RANK, np.int32) % 3).astype(np.int32)
    cases = {
        "Allreduce": lambda c, y: c.Allreduce([x, n * SIZE, mat], [y, n * SIZE, mat], op),
        "Allreduce in place": lambda c, y: c.Allreduce(MPI.IN_PLACE, [y, n * SIZE, mat], op),
        "Reduce_scatter_block": lambda c, y: c.Reduce_scatter_block([x, n, mat], [y, n, mat], op),
        "Reduce_scatter": lambda c, y: c.Reduce_scatter([x, n * SIZE, mat], [y, n, mat],
                                                        [n] * SIZE, op),
    }
    for label, call in cases.items():
        y, want = x.copy(), x.copy()
        del SEEN[:]
        with mpicoll.traffic() as t:
            call(COMM, y)
        seen, calls = set(SEEN), calls + len(SEEN)
        call(WORLD, want)
        if not np.array_equal(y, want):
            bad.append(f"{label}: got {y}, want {want}")
        if seen - {mat.handle}:
            bad.append(f"{label}: the op saw {len(seen)} other datatype(s)")
        if any(c.algorithm == "delegated" for c in t.calls):
            bad.append(f"{label}: delegated")
    if SIZE > 1 and WORLD.allreduce(calls) == 0:
        bad.append("mpicoll never called the op")
    op.Free()
    mat.Free()
    util.assert_all(WORLD, not bad, "; ".join(bad))


@pytest.mark.parametrize("collective", ["allgather", "allreduce", "reduce_scatter"])
def test_every_algorithm(collective):
    """Every algorithm of ``mpicoll.Comm(algorithm=...)`` on derived datatypes: a gather of a
    packed type (Allgather and Allgatherv), a reduction of a contiguous type with a user op."""
    from mpicoll.tools import verify as V

    bad = []
    if collective == "allgather":
        T = MPI.DOUBLE.Create_vector(3, 1, 2).Commit()  # (packed: gaps between elements)
        vc = [(2, 0, 3, 1, 2)[r % 5] for r in range(SIZE)]
        vd = [sum(vc[:r]) for r in range(SIZE)]
        for algo in V.algorithms_for("allgather"):
            c = mpicoll.Comm(WORLD, algorithm=algo)
            for method, mine, blocks, whole in (("Allgather", 2, 2, 2 * SIZE),
                                                ("Allgatherv", vc[RANK], (vc, vd), sum(vc))):
                x = _data(_reach(T, mine), 0)
                y, want = _blank(_reach(T, whole)), _blank(_reach(T, whole))
                getattr(c, method)([x, mine, T], [y, blocks, T])
                getattr(WORLD, method)([x, mine, T], [want, blocks, T])
                if not np.array_equal(y, want):
                    bad.append(f"{method} {algo}")
    else:
        T = MPI.DOUBLE.Create_contiguous(2).Commit()
        op = MPI.Op.Create(_dadd, commute=True)
        n = 5
        for algo in V.algorithms_for(collective):
            c = mpicoll.Comm(WORLD, algorithm=algo)
            x = rank_data(2 * n * SIZE, RANK, np.float64)
            y, want = np.zeros_like(x), np.zeros_like(x)
            if collective == "allreduce":
                c.Allreduce([x, n * SIZE, T], [y, n * SIZE, T], op)
                WORLD.Allreduce([x, n * SIZE, T], [want, n * SIZE, T], op)
            else:
                c.Reduce_scatter_block([x, n, T], [y, n, T], op)
                WORLD.Reduce_scatter_block([x, n, T], [want, n, T], op)
            if not np.array_equal(y, want):
                bad.append(f"{collective} {algo}")
        op.Free()
    T.Free()
    util.assert_all(WORLD, not bad, "; ".join(bad))


def _dadd(inbuf, inoutbuf, datatype):
    b = np.frombuffer(inoutbuf, np.float64)
    b += np.frombuffer(inbuf, np.float64)


# ---------------------------------------------------------------------------
# Counts 0 and large, pair types
# ---------------------------------------------------------------------------


def test_counts_zero_and_large():
    """Count 0 everywhere, and large counts (Allgatherv of a packed type, Allreduce of a
    contiguous type with a user op), against MPI's built-in."""
    vec = MPI.DOUBLE.Create_vector(2, 2, 3).Commit()
    quad = MPI.DOUBLE.Create_contiguous(4).Commit()
    op = MPI.Op.Create(_dadd, commute=True)
    bad = []
    for count in (0, 20000):
        counts = [count + 7 * r for r in range(SIZE)] if count else [0] * SIZE
        x = _data(_reach(vec, counts[RANK]), 0)
        y, want = _blank(_reach(vec, sum(counts))), _blank(_reach(vec, sum(counts)))
        COMM.Allgatherv([x, counts[RANK], vec], [y, counts, vec])
        WORLD.Allgatherv([x, counts[RANK], vec], [want, counts, vec])
        if not np.array_equal(y, want):
            bad.append(f"Allgatherv, counts {counts}")
        x = rank_data(4 * count + 1, RANK, np.float64)
        y, want = _blank(8 * x.size), _blank(8 * x.size)
        COMM.Allreduce([x, count, quad], [y, count, quad], op)
        WORLD.Allreduce([x, count, quad], [want, count, quad], op)
        if not np.array_equal(y, want):
            bad.append(f"Allreduce, count {count}")
    for t in (vec, quad, op):
        t.Free()
    util.assert_all(WORLD, not bad, "; ".join(bad))


def test_pair_types_in_derived_types():
    """Derived types of MPI.DOUBLE_INT (whose 4 bytes of padding MPI never writes): gathered
    by mpicoll, the padding of the receive buffer untouched as MPI leaves it."""
    bad = []
    for label, T in (("contiguous", MPI.DOUBLE_INT.Create_contiguous(2).Commit()),
                     ("vector", MPI.DOUBLE_INT.Create_vector(2, 1, 2).Commit())):
        x = _data(_reach(T, 2), 0)
        y, want = _blank(_reach(T, 2 * SIZE)), _blank(_reach(T, 2 * SIZE))
        with mpicoll.traffic() as t:
            COMM.Allgather([x, 2, T], [y, 2, T])
        WORLD.Allgather([x, 2, T], [want, 2, T])
        if not np.array_equal(y.view(np.uint8), want.view(np.uint8)):
            bad.append(f"{label}: got {y}, want {want}")
        if any(c.algorithm == "delegated" for c in t.calls):
            bad.append(f"{label}: delegated")
        T.Free()
    util.assert_all(WORLD, not bad, "; ".join(bad))


# ---------------------------------------------------------------------------
# What MPI runs: shown as delegated, MPI's verdict, the progress rule
# ---------------------------------------------------------------------------


def test_predefined_op_on_mixed_types_is_mpis_verdict():
    """MPI.SUM on a struct of an int and a double is MPI's own collective, whose error (MPI
    defines SUM on neither the struct nor a pair of types) mpicoll.Comm raises as mpi4py
    does: MPI's exception, no TypeError."""
    T = MPI.Datatype.Create_struct([1, 1], [0, 8], [MPI.INT, MPI.DOUBLE]).Commit()
    x = rank_data(4, RANK, np.float64)
    verdicts = []
    for comm in (WORLD, COMM):
        try:
            comm.Allreduce([x, 2, T], [np.zeros(4), 2, T], MPI.SUM)
            verdicts.append("ran")
        except MPI.Exception as exc:
            verdicts.append(f"MPI error class {exc.Get_error_class()}")
        except Exception as exc:  # (the point: nothing mpi4py would not raise)
            verdicts.append(f"{type(exc).__name__}: {exc}")
    T.Free()
    util.assert_all(WORLD, verdicts[0] == verdicts[1],
                    f"MPI: {verdicts[0]}; mpicoll.Comm: {verdicts[1]}")


def test_delegated_shows_as_delegated():
    """A call MPI runs is counted by traffic() with the algorithm "delegated" and no bytes of
    mpicoll's, recorded by trace() as a "delegated" collective, and its request says so."""
    T = MPI.Datatype.Create_struct([1, 1], [0, 8], [MPI.INT, MPI.DOUBLE]).Commit()
    x = _data(16 * SIZE, 0)
    y = _blank(16 * SIZE)
    with mpicoll.trace() as tr, mpicoll.traffic() as t:
        COMM.Allgather([x, 1, T], [y, 1, T])
        req = COMM.Iallgather([x, 1, T], [y, 1, T])
        req.Wait()
    T.Free()
    calls = [(c.collective, c.algorithm, c.bytes_sent, c.messages_sent) for c in t.calls]
    coll = [(e["collective"], e["algorithm"]) for e in tr.events if e["phase"] == "collective"]
    ok = (calls == [("allgather", "delegated", 0, 0)] * 2 and coll == [("allgather", "delegated")] * 2
          and req.algorithm == "delegated")
    util.assert_all(WORLD, ok, f"traffic {calls}, trace {coll}, request {req.algorithm}")


def test_waiting_for_a_delegated_call_advances_mpicoll():
    """Ranks wait for an mpicoll operation and a delegated one in opposite orders, and a
    blocking delegated call runs while an mpicoll operation is in flight: every wait
    advances the other (the progress rule), so nothing hangs."""
    T = MPI.Datatype.Create_struct([1, 1], [0, 8], [MPI.INT, MPI.DOUBLE]).Commit()
    op = MPI.Op.Create(_mixed_add, commute=True)
    x = rank_data(1 << 16, RANK, np.float64)
    xs = _data(16 * 3, 0)
    y, ys, ys2 = np.zeros_like(x), _blank(16 * 3), _blank(16 * 3)
    mine = COMM.Iallreduce(x, y)  # (large: it needs several rounds of progress)
    theirs = COMM.Iallreduce([xs, 3, T], [ys, 3, T], op)
    first, second = (mine, theirs) if RANK % 2 else (theirs, mine)
    first.Wait()
    second.Wait()
    mine = COMM.Iallreduce(x, y)
    if RANK % 2 == 0:
        COMM.Allreduce([xs, 3, T], [ys2, 3, T], op)
        mine.Wait()
    else:
        mine.Wait()
        COMM.Allreduce([xs, 3, T], [ys2, 3, T], op)
    want = _blank(16 * 3)
    WORLD.Allreduce([xs, 3, T], [want, 3, T], op)
    op.Free()
    T.Free()
    util.assert_all(WORLD, np.array_equal(y, WORLD.allreduce(x)) and np.array_equal(ys, want)
                    and np.array_equal(ys2, want), "wrong results")


# ---------------------------------------------------------------------------
# Bad input, and a datatype freed and made again
# ---------------------------------------------------------------------------


def test_buffer_too_small_for_the_type_map():
    """Elements whose data reach past the buffer (a resized type's interleaved elements): a
    ValueError before any message, naming the bytes, buffers untouched."""
    col = MPI.DOUBLE.Create_vector(2, 1, 4).Create_resized(0, 8).Commit()
    x = np.zeros(2)
    y = np.zeros(4 * SIZE)  # (4 * SIZE elements of extent 8: the last ones reach past it)
    util.raises_everywhere(WORLD, ValueError, r"^recvbuf: count \d+ of the derived datatype "
                           r"\(2 x MPI\.DOUBLE\) at byte 0 needs bytes 0 to \d+, the buffer "
                           r"holds \d+$",
                           lambda: COMM.Allgather([x, 2, MPI.DOUBLE], [y, 4, col]),
                           x, y)
    col.Free()


def test_datatype_freed_and_made_again():
    """A datatype used, freed and another made (MPI may hand out the same handle): the new
    one's layout is used, not the old one's."""
    bad = []
    for build in (lambda: MPI.DOUBLE.Create_vector(2, 1, 3), lambda: MPI.DOUBLE.Create_contiguous(2),
                  lambda: MPI.DOUBLE.Create_indexed([1, 1], [2, 0])):
        T = build().Commit()
        x = _data(_reach(T, 2), 0)
        y, want = _blank(_reach(T, 2 * SIZE)), _blank(_reach(T, 2 * SIZE))
        COMM.Allgather([x, 2, T], [y, 2, T])
        WORLD.Allgather([x, 2, T], [want, 2, T])
        if not np.array_equal(y, want):
            bad.append(f"{T.decode()[1]}")
        T.Free()
        del T
    util.assert_all(WORLD, not bad, "; ".join(bad))


def test_info_says_who_runs_which_datatype(capsys):
    """``python -m mpicoll.info`` lists which datatypes mpicoll runs and which it delegates."""
    from mpicoll.api import derived
    from mpicoll.tools import info

    info.main([], comm=WORLD)
    out = capsys.readouterr().out
    want = ["datatypes: who runs mpicoll.Comm's calls"] + [
        f"  {what}: {who}" for what, who in derived.ROUTES]
    lines = out.splitlines()
    ok = RANK != 0 or all(line in lines for line in want) and any("delegated" in line for line in want)
    util.assert_all(WORLD, ok, out)


@pytest.mark.local
def test_contiguous_is_what_mpi_packs():
    """A datatype is contiguous (run on the buffer itself) exactly when MPI's own packing of
    one element reads its bytes in order with nothing between: for every constructor,
    nested ones, Fortran order, reordered blocks and resized bounds."""
    from mpicoll.api import derived

    I = MPI.INT  # noqa: E741
    builds = [
        lambda: D.Create_contiguous(4), lambda: D.Create_vector(3, 2, 2),
        lambda: D.Create_vector(3, 2, 3), lambda: D.Create_vector(1, 3, 7),
        lambda: D.Create_hvector(2, 2, 16), lambda: D.Create_hvector(2, 2, 24),
        lambda: D.Create_indexed([2, 3], [0, 2]), lambda: D.Create_indexed([2, 3], [3, 0]),
        lambda: D.Create_indexed([0, 2, 0, 1], [9, 0, 4, 2]),
        lambda: D.Create_indexed_block(2, [0, 2, 4]), lambda: D.Create_hindexed([1, 2], [0, 8]),
        lambda: D.Create_hindexed_block(1, [8, 0]),
        lambda: D.Create_subarray([3, 4], [3, 4], [0, 0]),
        lambda: D.Create_subarray([3, 4], [1, 4], [2, 0]),
        lambda: D.Create_subarray([3, 4], [2, 4], [1, 0], order=MPI.ORDER_FORTRAN),
        lambda: D.Create_subarray([4, 3], [4, 1], [0, 0], order=MPI.ORDER_FORTRAN),
        lambda: D.Create_subarray([4, 3], [4, 1], [0, 1], order=MPI.ORDER_FORTRAN),
        lambda: D.Create_subarray([2, 3, 4], [1, 3, 4], [1, 0, 0]),
        lambda: MPI.Datatype.Create_struct([1, 2], [0, 8], [D, D]),
        lambda: MPI.Datatype.Create_struct([2, 1], [8, 0], [D, D]),
        lambda: MPI.Datatype.Create_struct([1, 1], [0, 8], [D.Create_contiguous(1), D]),
        lambda: D.Create_contiguous(2).Create_vector(2, 1, 1),
        lambda: D.Create_contiguous(2).Create_resized(0, 24),
        lambda: D.Create_vector(2, 1, 2).Create_resized(0, 8),
        lambda: D.Create_contiguous(3).Create_resized(-8, 24), lambda: D.Dup().Dup(),
        lambda: I.Create_contiguous(3), lambda: MPI.DOUBLE_INT.Create_contiguous(2),
        # resized to their size: contiguous only if the data have no gap and run in order
        lambda: D.Create_subarray([3, 4], [1, 4], [0, 0]).Create_resized(0, 32),
        lambda: D.Create_subarray([4, 3], [4, 1], [0, 0],
                                  order=MPI.ORDER_FORTRAN).Create_resized(0, 32),
        lambda: D.Create_subarray([3, 4], [3, 1], [0, 0]).Create_resized(0, 24),
        lambda: D.Create_vector(3, 2, 3).Create_resized(0, 48),
        lambda: D.Create_hvector(2, 2, 24).Create_resized(0, 32),
        lambda: D.Create_indexed([1, 1], [0, 2]).Create_resized(0, 16),
        lambda: D.Create_indexed([1, 1], [1, 0]).Create_resized(0, 16),
        lambda: MPI.Datatype.Create_struct([1, 1], [0, 16], [D, D]).Create_resized(0, 16),
    ]
    bad = []
    for i, build in enumerate(builds):
        T = build().Commit()
        offsets = _packed_from(T)
        size = T.Get_size()
        truth = T.Get_extent()[1] == size and np.array_equal(offsets, np.arange(size))
        if derived.decode(T).contiguous != truth:
            bad.append(f"type {i}: decoded contiguous={not truth}, MPI packs bytes "
                       f"{offsets.tolist()} of extent {T.Get_extent()}")
        T.Free()
    assert not bad, "\n".join(bad)


def _packed_from(T):
    """The byte offsets MPI's ``Pack`` reads one element of ``T`` from, in order: each byte of
    a buffer tagged with (8 bits of) its offset, packed three times."""
    lb, extent = T.Get_extent()
    true_lb, true_extent = T.Get_true_extent()
    pad = max(0, -true_lb)
    total = pad + max(true_lb + true_extent, extent)
    offsets = np.zeros(T.Get_size(), np.int64)
    for k in range(3):
        tags = ((np.arange(total) >> (8 * k)) & 0xFF).astype(np.uint8)
        out = bytearray(T.Get_size())
        T.Pack(tags[pad: pad + extent], out, 0, MPI.COMM_SELF)
        offsets += np.frombuffer(bytes(out), np.uint8).astype(np.int64) << (8 * k)
    return offsets - pad
