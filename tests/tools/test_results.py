"""The result checker (mpicoll.tools.results): exact references, the one tolerance rule, compare.

Local tests (no peer): the rows stand for what each rank held.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from mpicoll.tools import results as R

pytestmark = pytest.mark.local


def rows_of(dtype, n=4, count=50, seed=1):
    rng = np.random.default_rng(seed)
    spread = 6 if np.dtype(dtype).itemsize <= 2 else 20  # float16 overflows at 65504
    return (rng.uniform(-1, 1, (n, count))
            * 2.0 ** rng.integers(-spread, spread, (n, count))).astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_float_sum_reference_is_the_exact_sum(dtype):
    rows = rows_of(dtype)
    ref = R.reduce_rows(rows, "SUM")
    exact = [math.fsum(map(float, col)) for col in rows.T]
    assert ref.value.tolist() == exact
    assert ref.error is not None and np.all(ref.error <= np.finfo(np.float64).eps * ref.scale)


def test_complex_sum_reference_is_exact_per_component():
    rows = rows_of("float64") + 1j * rows_of("float64", seed=2)
    ref = R.reduce_rows(rows.astype(np.complex128), "SUM")
    assert ref.value.real.tolist() == [math.fsum(c) for c in rows.real.T]
    assert ref.value.imag.tolist() == [math.fsum(c) for c in rows.imag.T]


def test_cancellation_exact_reference_and_rank_order_within_the_rule():
    rows = np.array([[1e16], [1.0], [-1e16]])
    ref = R.reduce_rows(rows, "SUM")
    assert ref.value.tolist() == [1.0]  # the rank-order sum in float64 is 0.0
    rank_order = rows.sum(axis=0)
    assert rank_order.tolist() == [0.0]
    assert R.compare(rank_order, ref, "SUM", 3).ok  # within gamma(2) * 2e16


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64", "complex128"])
@pytest.mark.parametrize("opname", ["SUM", "PROD"])
def test_any_order_passes_and_a_wrong_result_fails(dtype, opname):
    rows = rows_of(dtype, n=5)
    if opname == "PROD":
        rows = (1 + rows / 1e6).astype(dtype)
    ref = R.reduce_rows(rows, opname)
    ufunc = np.add if opname == "SUM" else np.multiply
    for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4, 1, 3]):
        acc = rows[order[0]].copy()
        for r in order[1:]:
            acc = ufunc(acc, rows[r])
        assert R.compare(acc, ref, opname, 5).ok, order
    tol = R.tolerance(opname, dtype, 5, ref.scale, ref.error)
    wrong = (ref.value + 3 * tol).astype(dtype)
    res = R.compare(wrong, ref, opname, 5)
    assert not res.ok and res.nbad > 0 and "tolerance" in res.worst


def test_integers_are_exact_and_wrap():
    rows = np.array([[250, 1], [10, 2]], np.uint8)
    ref = R.reduce_rows(rows, "SUM")
    assert ref.scale is None and ref.value.tolist() == [4, 3]
    assert not R.compare(np.array([5, 3], np.uint8), ref, "SUM", 2).ok
    assert R.tolerance("SUM", np.int32, 4, np.ones(2)) is None


def test_logical_op_on_integers_keeps_the_dtype():
    rows = np.array([[0, 3], [5, 7]], np.int16)
    ref = R.reduce_rows(rows, "LAND")
    assert ref.value.dtype == np.int16 and ref.value.tolist() == [0, 1]


def test_one_rank_bound_is_the_input():
    rows = rows_of("float32", n=1)
    ref = R.reduce_rows(rows, "SUM")
    assert R.compare(rows[0], ref, "SUM", 1).ok
    nudged = np.nextafter(rows[0], np.float32(np.inf))
    assert not R.compare(nudged, ref, "SUM", 1).ok


def test_same_values_ignores_long_double_padding():
    a = np.array([1.5, -2.25], np.longdouble)
    b = a.copy()
    raw = b.view(np.uint8).reshape(2, -1)
    if np.finfo(np.longdouble).nmant == 63 and raw.shape[1] > 10:
        raw[:, 10:] = 0xAB  # padding bytes only
    assert R.same_values(a, b)
    assert not R.same_values(a, a[::-1].copy())


def test_non_finite_values_reduce_as_ieee():
    rows = np.array([[np.inf, np.nan, 1e308], [-np.inf, 1.0, 1e308]])
    ref = R.reduce_rows(rows, "SUM")
    assert np.isnan(ref.value[0]) and np.isnan(ref.value[1]) and ref.value[2] == np.inf


def test_shape_mismatch_is_reported():
    res = R.compare(np.zeros(3), np.zeros(4), None, 2)
    assert not res.ok and "shape" in res.worst


@pytest.mark.local
def test_float32_accumulated_half_sum_bound():
    """The rule for 8/16-bit SUMs accumulated in float32 (one rounding at the end) holds for
    such a sum over 512 ranks, and a sum rounded to bfloat16 at every step breaks it."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    rows = np.random.default_rng(18).normal(0.5, 1.0, (512, 64)).astype(bf16)
    ref = R.reduce_rows(rows, "SUM")
    acc = np.zeros(64, np.float32)
    wire = np.zeros(64, bf16)
    for row in rows:  # one order of the n - 1 additions (the ring's, at one element)
        acc = acc + row.astype(np.float32)
        wire = (wire.astype(np.float32) + row.astype(np.float32)).astype(bf16)
    assert R.compare(acc.astype(bf16), ref, "SUM", 512).ok
    assert not R.compare(wire, ref, "SUM", 512).ok
    loose = R.tolerance("SUM", bf16, 512, ref.scale, ref.error, accumulated=False)
    assert np.all(loose >= R.tolerance("SUM", bf16, 512, ref.scale, ref.error, ref.value))
