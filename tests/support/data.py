"""The suite's one rank-asymmetric input, and its exact sum over ranks.

Every rank holds different values (so a result that mixes up ranks, blocks or
operand order shows), chosen so that every dtype the tests use holds them
exactly and sums over a test's ranks are exact: the expected value of a SUM is
a function of rank and size (:func:`rank_sum`), no tolerance needed.
"""

from __future__ import annotations

import numpy as np


def rank_data(n, rank, dtype=np.float64, salt=0):
    """``n`` values (or a shape: a tuple, C order) of rank ``rank`` (``salt`` gives one rank other data for another call).

    bool: every third element true, shifted by rank; complex: real and
    imaginary parts in {-1, 0, 1} (products and a non-commutative op built
    from them stay exact); one-byte integers 1..5, wider ones 1..1021 (sums
    over 9 ranks stay in range, even in int16); half-precision floats the
    integers -11..11, wider ones -2049..2049 (exact sums in float32).  The
    wide kinds repeat only every 1021 or 4099 elements, so a block moved to
    the wrong offset shows.
    """
    shape = n if isinstance(n, tuple) else None
    n = int(np.prod(n))
    dtype = np.dtype(dtype)
    i = np.arange(n)
    if dtype.kind == "b":
        x = (i + rank + salt) % 3 == 0
    elif dtype.kind == "c":
        x = ((i * 3 + rank + salt) % 3 - 1 + 1j * ((i + 2 * rank + salt) % 3 - 1)).astype(dtype)
    elif dtype.kind in "iu":
        x = ((i * 7 + rank * 13 + salt) % (5 if dtype.itemsize == 1 else 1021) + 1).astype(dtype)
    else:
        x = ((i * 7 + rank * 13 + salt) % (23 if dtype.itemsize <= 2 else 4099)
             - (11 if dtype.itemsize <= 2 else 2049)).astype(dtype)
    return x if shape is None else x.reshape(shape)


def rank_sum(n, size, dtype=np.float64, salt=0):
    """The exact sum over ranks ``0..size-1`` of :func:`rank_data` (in ``dtype``)."""
    dtype = np.dtype(dtype)
    wide = np.complex128 if dtype.kind == "c" else np.float64 if dtype.kind == "f" else np.int64
    total = sum((rank_data(n, r, wide, salt) for r in range(size)), np.zeros(n, wide))
    return total.astype(dtype)


def half_types(ml_dtypes):
    """The 16/8-bit float types mpicoll reduces in float32: float16, and ml_dtypes'
    bfloat16 and two float8 types (the caller imports ml_dtypes, or skips)."""
    return [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16),
            np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2)]
