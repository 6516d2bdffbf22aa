"""Every collective against MPI's built-in: types x ops x counts x in place x algorithms x communicators.

The judge is :mod:`mpicoll.verify`'s runner with the checker of
:mod:`mpicoll.tools.results` (the same ones ``python -m mpicoll.verify``
uses): inputs are rank-asymmetric, the reference is every rank's input
reduced exactly (fsum for floating SUM, a wider precision for PROD; gathers:
MPI's built-in Allgatherv), floating SUM/PROD results must be within the one
tolerance rule (``gamma(n-1)*scale`` plus the reference's own error),
everything else bitwise; results must be bitwise identical across ranks,
inputs unchanged, and in-place ReduceScatter may write only its result part.

The product is not a full cartesian one: every (type, op) at one count,
every count at a few types, every communicator at one (type, op); in place
and out of place alternate over the (count, algorithm) grid.
Algorithms come from ``mpicoll.engine.select.ALGORITHMS``, so new ones are tested
without touching this file.  Each algorithm's own function also runs on MPI
directly (``util.algorithm_functions``), with 3-element segments and a window of 2.
Closed-form tests at the end check the machinery itself against values
computed from rank and size alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll
from mpicoll.algorithms.ring import split
from mpicoll.backends.host import NUMPY
from mpicoll.engine import context as _context
from mpicoll.engine import select as _select
from mpicoll.tools import results as _results
from mpicoll.tools import verify as V
from mpicoll.transport.channel import Channel

WORLD = MPI.COMM_WORLD
SIZE = WORLD.Get_size()

COLLECTIVES = V.COLLECTIVES
COMM_REDUCTIONS = [c for c, (_, api, red) in COLLECTIVES.items() if red and api == "comm"]
ARRAY_REDUCTIONS = [c for c, (_, api, red) in COLLECTIVES.items() if red and api == "array"]
GATHERS = [c for c, (_, _, red) in COLLECTIVES.items() if not red]
TYPES = V.available_types()
PLAIN_TYPES = [t for t in TYPES if t.datatype is None]
BY_NAME = {t.name: t for t in TYPES}

ONE = [7 * SIZE + 3]            # not divisible by the ranks; blocks of several elements
ALL_COUNTS = sorted({0, 1, max(SIZE - 1, 0), SIZE + 1, 7 * SIZE + 3})
LARGE = 2 ** 18 + 5


def run_cases(comm, collective, info, opname, counts, algorithms, *, both=False):
    """Yield (label, CaseResult) for every count x algorithm (all collective).

    ``both``: each (count, algorithm) in place and out of place; otherwise they
    alternate along the (count, algorithm) grid, so every count and every
    algorithm still runs both ways when there are two or more of the other.
    """
    both = both or len(counts) * len(algorithms) < 2
    for k, count in enumerate(counts):
        prepared = V.prepare_case(comm, collective, info, opname, count)
        for j, algo in enumerate(algorithms):
            for ip in ((False, True) if both else ((k + j) % 2 == 1,)):
                label = f"count={count} {'in place' if ip else 'out of place'} algorithm={algo}"
                yield label, V.run_case(comm, collective, info, opname, count, ip, algo,
                                        prepared=prepared)


def _params(collectives, types, ops=None):
    out = []
    for c in collectives:
        reduces = COLLECTIVES[c][2]
        for t in types:
            if COLLECTIVES[c][1] == "array" and t.datatype is not None:
                continue
            names = (ops(t) if ops else V.ops_for(t)) if reduces else (None,)
            for o in names:
                out.append(pytest.param(c, t, o, id=f"{c}-{t.name}-{o or 'gather'}"))
    return out


def _first_and_last_op(info):
    ops = V.ops_for(info)
    return tuple(dict.fromkeys((ops[0], ops[-1])))


# ---------------------------------------------------------------------------
# Every (type, op) pair at one count, every registered algorithm (in place and
# out of place alternate over the algorithms); the counts are covered below
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("collective, info, opname", _params(COMM_REDUCTIONS, TYPES))
def test_comm_reduction_every_type_and_op(collective, info, opname):
    """Comm.Allreduce / Reduce_scatter_block / Reduce_scatter, all types incl. MINLOC/MAXLOC pairs."""
    util.check_cases(WORLD, run_cases(WORLD, collective, info, opname, ONE,
                                       V.algorithms_for(collective)))


@pytest.mark.parametrize("collective, info, opname",
                         _params(ARRAY_REDUCTIONS, PLAIN_TYPES, _first_and_last_op))
def test_array_reduction_every_type(collective, info, opname):
    """mpicoll.allreduce / reduce_scatter on every plain dtype (first and last op that applies)."""
    util.check_cases(WORLD, run_cases(WORLD, collective, info, opname, ONE,
                                       V.algorithms_for(collective)))


@pytest.mark.parametrize("collective, info, opname", _params(GATHERS, TYPES))
def test_gather_every_type(collective, info, opname):
    """Allgather / Allgatherv (gapped, reversed displacements) / allgather(v) on every type."""
    util.check_cases(WORLD, run_cases(WORLD, collective, info, opname, ONE,
                                       V.algorithms_for(collective)))


# ---------------------------------------------------------------------------
# Every count (0, 1, size-1, size+1, 7*size+3), a few types, "auto" included
# ---------------------------------------------------------------------------

COUNT_TYPES = [("float64", "SUM"), ("int32", "BXOR"), ("float16", "SUM"), ("bool", "LOR"),
               ("complex128", "PROD")]


def _count_params():
    out = []
    for c in COLLECTIVES:
        reduces = COLLECTIVES[c][2]
        for tname, op in COUNT_TYPES:
            if tname in BY_NAME:
                out.append(pytest.param(c, BY_NAME[tname], op if reduces else None,
                                        id=f"{c}-{tname}-{op if reduces else 'gather'}"))
    return out


@pytest.mark.parametrize("collective, info, opname", _count_params())
def test_every_count(collective, info, opname):
    util.check_cases(WORLD, run_cases(WORLD, collective, info, opname, ALL_COUNTS,
                                       V.algorithms_for(collective, auto=True)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("collective", ["Allreduce", "Reduce_scatter_block", "Allgather",
                                        "allreduce", "reduce_scatter"])
@pytest.mark.parametrize("tname, op", [("float64", "SUM"), ("int32", "BXOR")])
def test_large_count(collective, tname, op):
    """About 2**18 elements in all (several pipeline segments per block on the ring)."""
    reduces = COLLECTIVES[collective][2]
    count = LARGE if collective in ("Allreduce", "allreduce", "reduce_scatter") else LARGE // SIZE
    util.check_cases(WORLD, run_cases(WORLD, collective, BY_NAME[tname], op if reduces else None,
                                       [count], V.algorithms_for(collective, auto=True)))


# ---------------------------------------------------------------------------
# Every communicator kind
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", util.COMM_KINDS)
@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_communicators(comms, kind, collective):
    """COMM_WORLD, a Dup, Split into two halves by parity, Split with the rank order reversed."""
    comm = comms[kind]
    reduces = COLLECTIVES[collective][2]
    cases = [("float64", "SUM")] if reduces else [("int16", None)]
    counts = [0, 1, comm.Get_size() + 1, 7 * comm.Get_size() + 3]
    results = []
    for tname, op in cases:
        results += [(f"{tname} {op} {label}", res) for label, res in
                    run_cases(comm, collective, BY_NAME[tname], op, counts,
                              V.algorithms_for(collective, auto=True))]
    util.check_cases(comm, results)


@pytest.mark.parametrize("collective", ["Allreduce", "Reduce_scatter", "Allgatherv"])
def test_ring_with_many_small_segments(collective):
    """Pipelined ring with 16-byte segments and windows of 1-3: many segments per block."""
    comm = WORLD.Dup()
    try:
        ctx = _context.context(comm)
        results = []
        for window in (1, 2, 3):
            ctx.segment_bytes, ctx.window = 16, window
            for tname in ("float64", "int8", "complex128"):
                op = "SUM" if COLLECTIVES[collective][2] else None
                results += [(f"window={window} {tname} {label}", res) for label, res in
                            run_cases(comm, collective, BY_NAME[tname], op, [7 * SIZE + 3],
                                      ["ring"], both=True)]
        util.check_cases(comm, results)
    finally:
        comm.Free()


# ---------------------------------------------------------------------------
# Every algorithm's function on MPI, with tiny segments
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_comm():
    """A Dup of COMM_WORLD whose context uses 3-element segments and window 2."""
    comm = WORLD.Dup()
    ctx = _context.context(comm)
    ctx.segment_bytes = 24
    ctx.window = 2
    yield comm
    comm.Free()


def _reference(comm, kind, x, counts=None):
    """The checker's reference (mpicoll.tools.results): exact sums, gathers by MPI's built-in."""
    if kind == "allgather":
        return np.asarray(_results.reference_allgatherv(
            comm, x, counts, [sum(counts[:r]) for r in range(comm.size)],
            np.zeros(sum(counts), x.dtype)))
    ref = _results.reference_allreduce(comm, x, MPI.SUM)
    if kind == "reduce_scatter":
        lo = sum(counts[:comm.rank])
        ref = ref[lo:lo + counts[comm.rank]]
    return ref


@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", list(_select.ALGORITHMS))
def test_every_algorithm_matches_mpi(tiny_comm, collective):
    comm = tiny_comm
    n, rank = comm.size, comm.rank
    ctx = _context.context(comm)
    for name, fn in util.algorithm_functions(collective).items():
        for N in (0, 1, n + 1, 50, 1001):
            for dtype in (np.int64, np.float32):
                counts = split(N, n)[0]
                displs = [sum(counts[:r]) for r in range(n)]
                x = rank_data(N if collective != "allgather" else counts[rank], rank, dtype)
                ch = Channel(ctx.comm, MPI._typedict[np.dtype(dtype).char])
                red = NUMPY.reducer(MPI.SUM, ch.mpitype, "integer" if dtype == np.int64 else "floating")
                if collective == "allreduce":
                    out = np.empty_like(x)
                    fn(ctx, ch, NUMPY, red, x, out)
                elif collective == "reduce_scatter":
                    out = np.empty(counts[rank], dtype)
                    fn(ctx, ch, NUMPY, red, x, out, counts, displs)
                else:
                    out = np.empty(N, dtype)
                    fn(ctx, ch, NUMPY, x, out, counts, displs)
                ref = _reference(comm, collective, x, counts)
                res = _results.compare(out, ref, None if collective == "allgather" else "SUM", n)
                assert res.ok, f"{name} N={N} {np.dtype(dtype)}: {res.worst}"


# ---------------------------------------------------------------------------
# Closed forms: expected values from rank and size alone (checks the judge too)
# ---------------------------------------------------------------------------

ALLREDUCE_ALGOS = V.algorithms_for("allreduce", auto=True)
RS_ALGOS = V.algorithms_for("reduce_scatter", auto=True)
AG_ALGOS = V.algorithms_for("allgather", auto=True)


@pytest.mark.parametrize("kind", ["world", "split_reversed"])
@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_closed_form_allreduce(comms, kind, dtype):
    """x_r[i] = (r+1)(i+1): SUM = (i+1) n(n+1)/2, MAX = (i+1) n, PROD over i = 0 is n!."""
    comm = comms[kind]
    r, n = comm.Get_rank(), comm.Get_size()
    count = 3 * n + 2
    i = np.arange(count)
    x = ((r + 1) * (i + 1)).astype(dtype)
    bad = []
    for algo in ALLREDUCE_ALGOS:
        s = mpicoll.allreduce(x, MPI.SUM, comm=comm, algorithm=algo)
        if not np.array_equal(s, (i + 1) * n * (n + 1) // 2):
            bad.append(f"SUM {algo}: {s}")
        m = mpicoll.allreduce(x, MPI.MAX, comm=comm, algorithm=algo)
        if not np.array_equal(m, (i + 1) * n):
            bad.append(f"MAX {algo}: {m}")
        p = mpicoll.allreduce(x[:1].copy(), MPI.PROD, comm=comm, algorithm=algo)
        if p[0] != np.prod(np.arange(1, n + 1)):
            bad.append(f"PROD {algo}: {p}")
    util.assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("kind", ["world", "split_parity"])
def test_closed_form_reduce_scatter(comms, kind):
    """x_r[i] = 1000 r + i: rank q gets its array_split block of 1000 n(n-1)/2 + n i."""
    comm = comms[kind]
    r, n = comm.Get_rank(), comm.Get_size()
    total = 5 * n + 3
    x = (1000 * r + np.arange(total)).astype(np.int64)
    lo = sum(len(b) for b in np.array_split(np.arange(total), n)[:r])
    hi = lo + len(np.array_split(np.arange(total), n)[r])
    want = 1000 * n * (n - 1) // 2 + n * np.arange(lo, hi)
    bad = []
    for algo in RS_ALGOS:
        got = mpicoll.reduce_scatter(x, comm=comm, algorithm=algo)
        if not np.array_equal(got, want):
            bad.append(f"{algo}: got {got}, want {want}")
        y = np.empty(hi - lo, np.int64)
        mpicoll.Comm(comm, algorithm=algo).Reduce_scatter(
            x, y, [len(b) for b in np.array_split(np.arange(total), n)])
        if not np.array_equal(y, want):
            bad.append(f"Comm.Reduce_scatter {algo}: got {y}, want {want}")
    util.assert_all(comm, not bad, "; ".join(bad))


@pytest.mark.parametrize("kind", ["world", "split_reversed"])
def test_closed_form_allgatherv(comms, kind):
    """Rank r contributes r % 3 elements 100 r + j; everyone gets them in rank order."""
    comm = comms[kind]
    r, n = comm.Get_rank(), comm.Get_size()
    counts = [q % 3 for q in range(n)]
    x = (100 * r + np.arange(counts[r])).astype(np.int32)
    want = np.concatenate([100 * q + np.arange(counts[q]) for q in range(n)]).astype(np.int32)
    bad = []
    for algo in AG_ALGOS:
        got = mpicoll.allgather(x, comm=comm, counts=counts, algorithm=algo)
        if not np.array_equal(got, want):
            bad.append(f"{algo}: got {got}, want {want}")
    util.assert_all(comm, not bad, "; ".join(bad))


def test_closed_form_float16_sum_is_exact_for_small_integers():
    """float16 (no MPI datatype: moved as 16-bit words, reduced locally) sums small integers exactly."""
    r, n = WORLD.Get_rank(), WORLD.Get_size()
    x = np.full(2 * n + 1, r + 1, dtype=np.float16)
    bad = []
    for algo in ALLREDUCE_ALGOS:
        got = mpicoll.allreduce(x, comm=WORLD, algorithm=algo)
        if got.dtype != np.float16 or not np.all(got == n * (n + 1) / 2):
            bad.append(f"{algo}: {got!r}")
    util.assert_all(WORLD, not bad, "; ".join(bad))


# ---------------------------------------------------------------------------
# The judge can fail: wrong results are caught
# ---------------------------------------------------------------------------


def test_judge_catches_wrong_results():
    """compare() rejects an integer off by one, a float beyond the bound, a wrong pair index."""
    n = 4
    ints = np.arange(10, dtype=np.int32)
    bad = ints.copy()
    bad[3] += 1
    assert V.compare(ints, ints, "SUM", n).ok
    res = V.compare(bad, ints, "SUM", n)
    assert not res.ok and res.nbad == 1 and "element 3" in res.worst

    scale = np.full(5, 10.0)
    tol = V.tolerance("SUM", np.float64, n, scale)
    u = np.finfo(np.float64).eps / 2
    assert np.allclose(tol, 2 * (3 * u / (1 - 3 * u)) * 10.0)
    ref = V.Reference(np.ones(5), scale, "test")
    near = np.ones(5) + 0.5 * tol
    far = np.ones(5)
    far[2] += 2 * tol[2]
    assert V.compare(near, ref, "SUM", n).ok
    assert not V.compare(far, ref, "SUM", n).ok
    assert not V.compare(near, ref, "SUM", 1).ok  # one rank: the result must be the input

    assert not V.compare(np.array([1.0, 2.0]), np.array([1.0, 2.5]), "MAX", n).ok

    pair = V.type_info("double_int").dtype
    a = np.zeros(3, pair)
    a["f0"], a["f1"] = [1, 2, 3], [0, 1, 2]
    b = a.copy()
    b["f1"][1] = 5
    assert V.compare(a, a.copy(), "MINLOC", n).ok
    assert not V.compare(b, a, "MINLOC", n).ok


def test_value_bytes_ignore_padding():
    """Pair types and x87 long double have padding bytes MPI never sends: not compared."""
    pair = V.type_info("double_int").dtype
    a = np.zeros(2, pair)
    raw = a.view(np.uint8).reshape(2, pair.itemsize)
    b = a.copy()
    b.view(np.uint8).reshape(2, pair.itemsize)[:, 12:] = 0xAB  # the padding after the int
    assert raw.shape[1] == 16 and V.same_values(a, b)
    b["f1"][0] = 1
    assert not V.same_values(a, b)


def test_make_input_is_rank_asymmetric():
    """Every rank gets different data, and the data is the same on every call."""
    n = WORLD.Get_size()
    for info in TYPES:
        for op in V.ops_for(info) or (None,):
            rows = [V.make_input(info.dtype, 50, r, max(n, 2), op) for r in range(max(n, 2))]
            again = V.make_input(info.dtype, 50, 0, max(n, 2), op)
            assert V.same_values(rows[0], again), (info.name, op)
            assert not V.same_values(rows[0], rows[1]), (info.name, op)


def test_reference_is_exact_and_mpi_is_within_the_rule():
    """The float32 SUM reference is the exact sum (fsum); MPI's built-in result is within the rule."""
    r, n = WORLD.Get_rank(), WORLD.Get_size()
    x = V.make_input(np.float32, 40, r, n, "SUM")
    ref = V.reference_allreduce(WORLD, x, MPI.SUM)
    rows = np.stack([V.make_input(np.float32, 40, q, n, "SUM") for q in range(n)])
    exact = np.array([math.fsum(col) for col in rows.astype(np.float64).T])
    builtin = np.empty_like(x)
    WORLD.Allreduce(x, builtin, MPI.SUM)
    res = V.compare(builtin, ref, "SUM", n)
    util.assert_all(WORLD, res.ok and np.array_equal(ref.value, exact),
                     f"{res.worst}; reference {ref.source}")
