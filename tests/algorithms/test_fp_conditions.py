"""Floating-point conditions inside a collective: overflow, inf and NaN never raise.

A sum that overflows, or inf - inf, sets the CPU's floating-point flags, and
NumPy turns those into a RuntimeWarning (or, under ``np.seterr(all="raise")``, a
FloatingPointError).  Under ``python -W error`` or pytest's ``filterwarnings =
error`` that warning is an exception on the one rank that reduced the element,
mid-collective, and the other ranks would wait for it forever.  MPI's built-in
returns IEEE results on every rank; so must every algorithm here, whatever the
caller's warning filters and NumPy error state.  Every call carries a timeout,
so a regression fails instead of hanging.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from mpi4py import MPI
from support import util

import mpicoll
from mpicoll.engine import select as _select

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.rank, WORLD.size
pytestmark = pytest.mark.ranks(2, 3, 4)  # 1: no reduction; 2, 4: recursive exact; 3: remainder
TIMEOUT = 30.0


class _strict:
    """Warnings as errors and NumPy raising on every floating-point condition."""

    def __enter__(self):
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("error")
        self._np = np.seterr(all="raise")
        return self

    def __exit__(self, *exc):
        np.seterr(**self._np)
        self._w.__exit__(*exc)
        return False


def _overflowing(n=9):
    """Rank-asymmetric float64 values whose sum overflows at element 1 and gives inf - inf
    (NaN) at element 2 (rank 0 holds +inf there, rank 1 -inf)."""
    x = np.arange(n, dtype=np.float64) + RANK
    x[1] = 1e308
    x[2] = np.inf if RANK == 0 else (-np.inf if RANK == 1 else 1.0)
    return x


def _builtin_allreduce(x, op=MPI.SUM):
    with np.errstate(all="ignore"):
        want = np.empty_like(x)
        WORLD.Allreduce(x, want, op=op)
    return want


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", _select.names("allreduce"))
def test_allreduce_overflow_and_nan_match_the_builtin_under_strict_warnings(algorithm):
    x = _overflowing()
    want = _builtin_allreduce(x)
    errors = []
    out = np.empty_like(x)
    with _strict():
        # (out=: the second and third are repeats, compiled where the module builds, and
        # without a timeout: the repeat takes no timed waits)
        for kw in ({"timeout": TIMEOUT}, {"out": out}, {"out": out}, {"out": out}):
            try:
                got = mpicoll.allreduce(x, algorithm=algorithm, **kw)
                errors.append(None if util.same_bytes(got, want) else f"{got} != {want}")
            except Exception as exc:  # (every rank goes on: the next call must not hang)
                errors.append(f"{type(exc).__name__}: {exc}")
    util.assert_all(WORLD, errors == [None] * 4, f"{algorithm}: {errors}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", _select.names("reduce_scatter"))
def test_reduce_scatter_overflow_matches_the_builtin_under_strict_warnings(algorithm):
    x = np.concatenate([_overflowing() for _ in range(SIZE)])
    want = np.empty(9)
    with np.errstate(all="ignore"):
        WORLD.Reduce_scatter_block(x, want)
    with _strict():
        try:
            got = mpicoll.reduce_scatter(x, algorithm=algorithm, timeout=TIMEOUT)
            error = None if util.same_bytes(got, want) else f"{got} != {want}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    util.assert_all(WORLD, error is None, f"{algorithm}: {error}")


@pytest.mark.timeout(120)
def test_comm_and_non_blocking_forms_under_strict_warnings():
    mc = mpicoll.Comm(WORLD)
    x = _overflowing()
    want = _builtin_allreduce(x)
    outs = [np.empty_like(x) for _ in range(3)]
    errors = []
    with _strict():
        try:
            mc.Allreduce(x, outs[0])
            mc.Iallreduce(x, outs[1]).Wait()
            mpicoll.iallreduce(x, out=outs[2], timeout=TIMEOUT).wait()
            errors = [i for i, o in enumerate(outs) if not util.same_bytes(o, want)]
        except Exception as exc:
            errors = [f"{type(exc).__name__}: {exc}"]
    util.assert_all(WORLD, not errors, f"{errors}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("accumulate", [None, False])
def test_float16_sum_past_its_range_is_inf_on_every_rank(accumulate):
    """40000 per rank: the float32 sum is exact and its one rounding to float16 overflows
    (a casting overflow); with accumulate=False the first partial sum overflows."""
    x = np.full(5, 40000.0, dtype=np.float16)
    x[0] = 1.0
    with _strict():
        try:
            got = mpicoll.allreduce(x, timeout=TIMEOUT, accumulate=accumulate)
            error = None
            if not (np.isinf(got[1:]).all() and got[0] == SIZE):
                error = f"{got}"
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
    util.assert_all(WORLD, error is None, f"{error}")
