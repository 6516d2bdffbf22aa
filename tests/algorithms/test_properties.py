"""Property tests: random calls of every collective agree with the exact result.

Run under an MPI launcher (2-4 ranks is the intended range; any count works).
Hypothesis draws the collective's arguments (counts, dtype, op, algorithm,
API, in place or not, check on or off, a data seed) with ``derandomize=True``
and no example database, so every rank draws the same examples in the same
order; the data are generated from (seed, rank), so every rank holds
different values.  Each example decides pass/fail collectively (an
AllReduce of the local verdicts), so all ranks fail, shrink and stop
together instead of one rank leaving the others waiting.

Properties, per example:

* the result equals the exact reduction of the same inputs, judged by
  :mod:`mpicoll.tools.results` (exact for integers, bool and MIN/MAX; float
  and complex SUM/PROD within its one rounding rule).  Signed SUM/PROD inputs
  stay clear of overflow, which C leaves undefined (Open MPI's int8 SUM
  saturates where NumPy, hence mpicoll, wraps);
* AllReduce results are bitwise identical on every rank;
* inputs are unchanged (out of place);
* MPICOLL_CHECK on changes nothing;
* traffic is conserved: all ranks together receive the bytes they send.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import mpicoll
from mpicoll.core import types as _types
from mpicoll.engine import select as _select
from mpicoll.tools import results as _results

# random calls: 2-4 ranks, powers of two and not (1 rank: test_collectives)
pytestmark = [pytest.mark.timeout(600), pytest.mark.ranks(2, 3, 4)]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()

SETTINGS = settings(
    max_examples=30, deadline=None, derandomize=True, database=None, print_blob=False,
    suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink],
)

DTYPES = ["int8", "uint8", "int16", "int32", "int64", "uint64", "float16", "float32", "float64",
          "complex64", "complex128", "bool"]
CATEGORY = {"i": "integer", "u": "integer", "f": "floating", "c": "complex", "b": "logical"}


def ops_for(dtype):
    cat = CATEGORY[np.dtype(dtype).kind]
    return [name for name, cats in _types.OP_CATEGORIES.items() if cat in cats]


@st.composite
def calls(draw, collective):
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(ops_for(dtype))) if collective != "allgather" else None
    if collective == "allreduce":
        counts = [draw(st.one_of(st.integers(0, 40), st.integers(0, 3000)))] * SIZE
    else:
        counts = draw(st.lists(st.integers(0, 60), min_size=SIZE, max_size=SIZE))
    return {
        "collective": collective,
        "dtype": dtype,
        "op": op,
        "counts": counts,
        "algorithm": draw(st.sampled_from(_select.names(collective))),
        "api": draw(st.sampled_from(["array", "Comm"])),
        "in_place": draw(st.booleans()),
        "check": draw(st.booleans()),
        "seed": draw(st.integers(0, 2 ** 32 - 1)),
    }


def make_input(dtype, n, op, seed, rank=RANK):
    """Rank-asymmetric data; PROD factors near 1 so products stay finite."""
    rng = np.random.default_rng([seed, rank])
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, n).astype(bool)
    if dt.kind == "u":  # unsigned arithmetic wraps, in C as in NumPy: any values
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    if dt.kind == "i":
        # signed overflow is undefined in C (MPI's built-in may saturate, NumPy wraps):
        # keep sums and products in range so both are defined
        info = np.iinfo(dt)
        bound = 2 if op == "PROD" else info.max // SIZE
        if op in ("SUM", "PROD"):
            return rng.integers(-bound, bound, n, dtype=dt, endpoint=True)
        return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    if op == "PROD":
        real = rng.uniform(0.5, 1.5, n)
        imag = rng.uniform(-0.5, 0.5, n)
    else:
        real = rng.uniform(-100, 100, n)
        imag = rng.uniform(-100, 100, n)
    return (real + 1j * imag).astype(dt) if dt.kind == "c" else real.astype(dt)


def close(call, got, want):
    """(ok, detail) by mpicoll.tools.results' rule: exact unless a float/complex SUM/PROD."""
    res = _results.compare(got, want, call["op"], SIZE)
    if res.ok:
        return True, ""
    return False, f"{res.nbad} of {got.size} elements differ, {res.worst}"


def run(call):
    """Run one drawn call; (result, input, input copy, traffic) on this rank."""
    counts = call["counts"]
    total = sum(counts) if call["collective"] != "allreduce" else counts[0]
    n_in = {"allreduce": total, "reduce_scatter": total, "allgather": counts[RANK]}[call["collective"]]
    x = make_input(call["dtype"], n_in, call["op"], call["seed"])
    before = x.copy()
    op = None if call["op"] is None else getattr(MPI, call["op"])
    algo = call["algorithm"]
    with mpicoll.options(check=call["check"], timeout=60.0), mpicoll.traffic() as t:
        if call["api"] == "array":
            kw = {"algorithm": algo}
            if call["collective"] == "allgather":
                if call["in_place"]:
                    out = np.zeros(sum(counts), x.dtype)
                    lo = sum(counts[:RANK])
                    out[lo: lo + counts[RANK]] = x
                    before = out.copy()
                    x = out
                    result = mpicoll.allgather(out, out=out, counts=counts, **kw)
                else:
                    result = mpicoll.allgather(x, counts=counts, **kw)
            elif call["collective"] == "allreduce":
                result = mpicoll.allreduce(x, op, out=x if call["in_place"] else None, **kw)
            else:
                result = mpicoll.reduce_scatter(x, op, out=x if call["in_place"] else None,
                                                counts=counts, **kw)
        else:
            comm = mpicoll.Comm(WORLD, algorithm=algo)
            displs = [sum(counts[:r]) for r in range(SIZE)]
            if call["collective"] == "allreduce":
                result = x.copy() if call["in_place"] else np.empty_like(x)
                comm.Allreduce(MPI.IN_PLACE if call["in_place"] else x, result, op)
            elif call["collective"] == "reduce_scatter":
                if call["in_place"]:
                    buf = x.copy()
                    comm.Reduce_scatter(MPI.IN_PLACE, buf, counts, op)
                    result = buf[: counts[RANK]]
                else:
                    result = np.empty(counts[RANK], x.dtype)
                    comm.Reduce_scatter(x, result, counts, op)
            else:
                result = np.zeros(sum(counts), x.dtype)
                if call["in_place"]:
                    result[displs[RANK]: displs[RANK] + counts[RANK]] = x
                    comm.Allgatherv(MPI.IN_PLACE, [result, counts, displs])
                else:
                    comm.Allgatherv(x, [result, counts, displs])
    return result, x, before, t


def expected(call, x_original):
    """This rank's expected result: the exact reduction (mpicoll.tools.results), or the gather."""
    counts = call["counts"]
    if call["collective"] == "allgather":
        return np.concatenate([make_input(call["dtype"], counts[r], None, call["seed"], r)
                               for r in range(SIZE)]) if sum(counts) else np.zeros(0, call["dtype"])
    full = _results.reference_allreduce(WORLD, x_original, getattr(MPI, call["op"]))
    if call["collective"] == "allreduce":
        return full
    lo = sum(counts[:RANK])
    return full[lo: lo + counts[RANK]]


def verdict(call):
    """Run ``call``; the same (ok, report) on every rank."""
    problems = []
    try:
        x0 = make_input(call["dtype"], call["counts"][0] if call["collective"] == "allreduce"
                        else sum(call["counts"]), call["op"], call["seed"])
        result, x, before, t = run(call)
        if call["collective"] != "allgather":
            want = expected(call, x0)
        else:
            want = expected(call, None)
        ok, detail = close(call, np.asarray(result).reshape(-1), want)
        if not ok:
            problems.append(f"result: {detail}")
        if not call["in_place"] and x.tobytes() != before.tobytes():
            problems.append("input modified")
        if call["collective"] == "allreduce":
            digests = WORLD.allgather(np.asarray(result).tobytes())
            if len(set(digests)) != 1:
                problems.append("ranks hold different AllReduce results")
        sent = WORLD.allreduce(t.bytes_sent)
        received = WORLD.allreduce(t.bytes_received)
        if sent != received:
            problems.append(f"traffic not conserved: {sent} bytes sent, {received} received")
    except Exception as exc:  # reported collectively below
        problems.append(f"{type(exc).__name__}: {exc}")
    reports = WORLD.allgather("; ".join(problems))
    bad = [f"rank {r}: {m}" for r, m in enumerate(reports) if m]
    return not bad, "\n".join(bad)


def check(call):
    ok, report = verdict(call)
    assert ok, f"{call}\n{report}"


@SETTINGS
@given(calls("allreduce"))
def test_allreduce_matches_mpi(call):
    check(call)


@SETTINGS
@given(calls("reduce_scatter"))
def test_reduce_scatter_matches_mpi(call):
    check(call)


@SETTINGS
@given(calls("allgather"))
def test_allgather_matches_mpi(call):
    check(call)


def test_examples_are_the_same_on_every_rank():
    """The premise of the file: every rank draws the same examples."""
    drawn = []

    @settings(max_examples=10, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(calls("reduce_scatter"))
    def draw(call):
        drawn.append(call)

    draw()
    everyone = WORLD.allgather(repr(drawn))
    assert len(set(everyone)) == 1
