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
from ..algorithms import halving as _halving
from ..algorithms import hierarchical as _hierarchical
from ..algorithms import recursive as _recursive
from ..algorithms import ring as _ring
from ..core.config import env_value
from . import executor as _executor

# Schedule builders ``build(shape) -> Schedule`` (algorithms.schedule), run by the
# executor (engine.executor), from each algorithm module's SCHEDULES table.
BUILDERS: dict = {"allreduce": {}, "reduce_scatter": {}, "allgather": {}}
for _module in (_ring, _recursive, _halving, _bruck, _hierarchical):
    for (_collective, _name), _build in _module.SCHEDULES.items():
        BUILDERS[_collective][_name] = _build

# collective -> algorithm name -> function of the old algorithm signature
# (ctx, ch, be, [red,] src, dst, ...): each builder run through the executor
# (executor.as_function; tests drive them on simulated channels).  An entry
# added here without a builder (a test's deliberately broken algorithm) runs
# as that function when its operation starts.
ALGORITHMS = {collective: {name: _executor.as_function(collective, build)
                           for name, build in table.items()}
              for collective, table in BUILDERS.items()}


def builder(collective: str, name: str):
    """The schedule builder of an algorithm, or None if it still runs as a function."""
    return BUILDERS[collective].get(name)


# Algorithms that keep rank order and so accept non-commutative ops.
ORDER_PRESERVING = {"recursive_doubling"}

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


# "auto" across nodes: where the table above picks the ring (sizes above the
# collective's last limit), a communicator that spans more than one node with
# more than one rank on some node gets the hierarchical algorithm instead: it
# puts 2(k-1)/k * N on each of k node links where the ring on n ranks puts
# 2(n-1)/n * N (AllReduce; ReduceScatter and AllGather: half), and the
# extra steps inside a node cost latency the ring's sizes absorb.  The node
# layout is the context's (transport.topology: Split_type(COMM_TYPE_SHARED),
# or MPICOLL_FAKE_NODES); docs/performance.md "Across nodes".
HIERARCHICAL_ABOVE = {collective: rows[-2][0] for collective, rows in THRESHOLDS.items()}


def spans_nodes(nodes) -> bool:
    """More than one node, and more than one rank on some node (node label per rank)."""
    k = len(set(nodes)) if nodes else 0
    return 1 < k < len(nodes)


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
           staged: bool = False, nodes=None):
    """(name, function) of the algorithm to run; ValueError if it cannot run this op.

    ``staged``: device arrays whose every message is staged through host
    memory (see backends.devices.DeviceBackend.stages_per_step).  "auto" then takes
    the ring, whose copies are per segment and overlap the transfers; the
    other algorithms send whole arrays or halves, one staged copy per step.
    (Small device calls are not staged per step: they run the host table on
    one host copy.)  ``nodes``: the node label of every rank, where known
    (see :data:`HIERARCHICAL_ABOVE`).
    """
    table = ALGORITHMS[collective]
    if algorithm == "auto":
        env = env_value("MPICOLL_ALGORITHM")
        env = env.strip() if env else None
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
        if staged:
            return "ring", table["ring"]
        if nodes is not None and spans_nodes(nodes) and nbytes > HIERARCHICAL_ABOVE[collective]:
            return "hierarchical", table["hierarchical"]
        pof2 = nranks & (nranks - 1) == 0
        for limit, if_pof2, otherwise in THRESHOLDS[collective]:
            if limit is None or nbytes <= limit:
                name = if_pof2 if pof2 else otherwise
                return name, table[name]
    if not commutative and algorithm not in ORDER_PRESERVING and collective != "allgather":
        raise ValueError(
            f"algorithm: {algorithm!r} reorders operands and cannot run a non-commutative op; "
            f"use 'auto' or one of {', '.join(sorted(ORDER_PRESERVING & set(table)))}"
        )
    return algorithm, table[algorithm]
