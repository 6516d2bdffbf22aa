"""Algorithm registry and automatic selection.

``algorithm="auto"`` picks from :data:`THRESHOLDS` by collective, message size
in bytes (the whole array each rank contributes to AllReduce / ReduceScatter,
the whole gathered array for AllGather) and op.  The environment variable
``MPICOLL_ALGORITHM`` replaces "auto" by a named algorithm where that
algorithm applies (a ring cannot keep a non-commutative op's rank order, so
such calls stay on "auto").  An explicit ``algorithm=`` argument is obeyed or
refused with ValueError.
"""

from __future__ import annotations

import os

from . import _bruck, _halving, _recursive, _ring

ALGORITHMS = {
    "allreduce": {
        "ring": _ring.allreduce,
        "recursive_doubling": _recursive.allreduce,
        "rabenseifner": _halving.allreduce,
    },
    "reduce_scatter": {
        "ring": _ring.reduce_scatter,
        "recursive_doubling": _recursive.reduce_scatter,
        "recursive_halving": _halving.reduce_scatter,
    },
    "allgather": {
        "ring": _ring.allgather,
        "recursive_doubling": _recursive.allgather,
        "bruck": _bruck.allgather,
    },
}

# Algorithms that keep rank order and so accept non-commutative ops.
ORDER_PRESERVING = {"recursive_doubling"}

# (collective) -> [(max bytes inclusive, algorithm)], first match wins; the
# last entry must have None (no limit).  Measured with python -m mpicoll.bench.
THRESHOLDS = {
    "allreduce": [(16 << 10, "recursive_doubling"), (None, "ring")],
    "reduce_scatter": [(4 << 10, "recursive_doubling"), (None, "ring")],
    "allgather": [(None, "ring")],
}


def names(collective: str) -> tuple[str, ...]:
    return ("auto",) + tuple(ALGORITHMS[collective])


def check_algorithm(collective: str, algorithm, argname: str = "algorithm") -> None:
    if not isinstance(algorithm, str):
        raise TypeError(f"{argname}: expected a str, got {type(algorithm).__name__}")
    if algorithm != "auto" and algorithm not in ALGORITHMS[collective]:
        raise ValueError(
            f"{argname}: expected one of {', '.join(names(collective))} for {collective}, "
            f"got {algorithm!r}"
        )


def choose(collective: str, algorithm: str, nbytes: int, nranks: int, commutative: bool = True):
    """(name, function) of the algorithm to run; ValueError if it cannot run this op."""
    table = ALGORITHMS[collective]
    if algorithm == "auto":
        env = os.environ.get("MPICOLL_ALGORITHM", "").strip()
        if env and env != "auto":
            if env not in table and not any(env in t for t in ALGORITHMS.values()):
                raise ValueError(
                    f"MPICOLL_ALGORITHM: expected one of "
                    f"{', '.join(sorted({a for t in ALGORITHMS.values() for a in t}))}, got {env!r}"
                )
            if env in table and (commutative or env in ORDER_PRESERVING):
                return env, table[env]
        if not commutative:
            name = next(a for a in table if a in ORDER_PRESERVING)
            return name, table[name]
        for limit, name in THRESHOLDS[collective]:
            if limit is None or nbytes <= limit:
                return name, table[name]
    if not commutative and algorithm not in ORDER_PRESERVING and collective != "allgather":
        raise ValueError(
            f"algorithm: {algorithm!r} reorders operands and cannot run a non-commutative op; "
            f"use 'auto' or one of {', '.join(sorted(ORDER_PRESERVING & set(table)))}"
        )
    return algorithm, table[algorithm]
