"""Algorithm registry and automatic selection.

``algorithm="auto"`` picks from :data:`THRESHOLDS` by collective, message
size in bytes (the whole array each rank contributes to AllReduce /
ReduceScatter, the whole gathered array for AllGather), whether the rank
count is a power of two, and op: non-commutative ops always go to an
order-preserving algorithm (:data:`ORDER_PRESERVING`).  The environment
variable ``MPICOLL_ALGORITHM`` replaces "auto" by a named algorithm where
that algorithm exists for the collective and applies to the op (so such
calls with a non-commutative op stay on "auto").  An explicit
``algorithm=`` argument is obeyed or refused with ValueError.
"""

from __future__ import annotations

from ..algorithms import bruck as _bruck
from ..algorithms import direct as _direct
from ..algorithms import halving as _halving
from ..algorithms import recursive as _recursive
from ..algorithms import ring as _ring

# Schedule builders ``build(shape) -> Schedule`` (algorithms.schedule), run by the
# executor (engine.executor), from each algorithm module's SCHEDULES table.
BUILDERS: dict = {"allreduce": {}, "reduce_scatter": {}, "allgather": {}}
for _module in (_ring, _recursive, _halving, _bruck, _direct):
    for (_collective, _name), _build in _module.SCHEDULES.items():
        BUILDERS[_collective][_name] = _build

# The algorithms by name, for validation and the tools (the builders themselves).
ALGORITHMS = BUILDERS


def builder(collective: str, name: str):
    """The schedule builder of an algorithm."""
    return BUILDERS[collective][name]


# Algorithms that keep rank order and so accept non-commutative ops ("direct" folds
# in rank order from the left: also deterministic mode's, see api.numerics).
ORDER_PRESERVING = {"recursive_doubling", "direct"}

# "auto": the first row of the collective whose size limit holds (max bytes,
# inclusive; None: no limit) gives the algorithm, one for power-of-two rank
# counts and one for the others.  The size crossovers were measured with
# python -m mpicoll.bench -a all at 2 ranks on a 2-core machine (Open MPI
# 5.0 and MPICH 5.0, five runs each, both MPIs agree); 3-4 ranks on 2 cores
# were too noisy to rank the algorithms, so the rank-count columns follow
# their step and volume counts.  Commands and tables: docs/performance.md.
#
#   collective        max bytes   power-of-two ranks    other rank counts
THRESHOLDS = {
    "allreduce": (
        (256 << 10, "recursive_doubling", "recursive_doubling"),
        (512 << 10, "rabenseifner", "ring"),
        (None, "ring", "ring"),
    ),
    "reduce_scatter": (
        (256 << 10, "recursive_halving", "recursive_halving"),
        (None, "ring", "ring"),
    ),
    "allgather": (
        (64 << 10, "recursive_doubling", "bruck"),
        (None, "ring", "ring"),
    ),
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


def choose(collective: str, algorithm: str, nbytes: int, nranks: int, commutative: bool = True,
           staged: bool = False, forced: str | None = None) -> str:
    """The name of the algorithm to run; ValueError if it cannot run this op.

    ``forced``: the ``algorithm`` option (MPICOLL_ALGORITHM, read with the
    communicator's options), which replaces "auto" where it applies.

    ``staged``: device arrays whose every message is staged through host
    memory (see backends.devices.DeviceBackend.stages_per_step).  "auto" then takes
    the ring, whose copies are per segment and overlap the transfers; the
    other algorithms send whole arrays or halves, one staged copy per step.
    (Small device calls are not staged per step: they run the host table on
    one host copy.)
    """
    table = ALGORITHMS[collective]
    if algorithm == "auto":
        env = forced
        if env and env != "auto":
            if env not in table and not any(env in t for t in ALGORITHMS.values()):
                raise ValueError(
                    f"MPICOLL_ALGORITHM: expected one of "
                    f"{', '.join(sorted({a for t in ALGORITHMS.values() for a in t}))}, got {env!r}"
                )
            if env in table and (commutative or env in ORDER_PRESERVING):
                return env
        if not commutative:
            return next(a for a in table if a in ORDER_PRESERVING)
        if staged:
            return "ring"
        pof2 = nranks & (nranks - 1) == 0
        for limit, if_pof2, otherwise in THRESHOLDS[collective]:
            if limit is None or nbytes <= limit:
                return if_pof2 if pof2 else otherwise
    if not commutative and algorithm not in ORDER_PRESERVING and collective != "allgather":
        raise ValueError(
            f"algorithm: {algorithm!r} reorders operands and cannot run a non-commutative op; "
            f"use 'auto' or one of {', '.join(sorted(ORDER_PRESERVING & set(table)))}"
        )
    return algorithm
