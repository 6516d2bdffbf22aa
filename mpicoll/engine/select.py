"""What runs: the algorithm (registry, "auto"'s table or tuning) and the type it reduces in.

``algorithm="auto"`` picks from :data:`THRESHOLDS` (or, for the layouts it was
measured on, the tuning file's :class:`Selection`, made once per context) by
collective, size, power-of-two rank count and op; ``MPICOLL_ALGORITHM``
replaces "auto" where it applies; an explicit ``algorithm=`` is obeyed or
refused with ValueError; the table and its order are on docs/algorithms.md.  The dtype
policy (:func:`policy`, the second half) decides how 16/8-bit floats and
deterministic reductions are reduced; engine.run applies it.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

from ..algorithms import bruck as _bruck
from ..algorithms import direct as _direct
from ..algorithms import halving as _halving
from ..algorithms import hierarchical as _hierarchical
from ..algorithms import recursive as _recursive
from ..algorithms import ring as _ring
from ..algorithms import shared as _shared
from ..core import config as _config
from ..core import types as _types
from . import tuning as _tuning

# Schedule builders ``build(shape) -> Schedule`` (algorithms.schedule), run by the
# executor (engine.executor), from each algorithm module's SCHEDULES table.
BUILDERS: dict = {"allreduce": {}, "reduce_scatter": {}, "allgather": {}}
for _module in (_ring, _recursive, _halving, _bruck, _direct, _hierarchical, _shared):
    for (_collective, _name), _build in _module.SCHEDULES.items():
        BUILDERS[_collective][_name] = _build

# The algorithms by name, for validation and the tools (the builders themselves).
ALGORITHMS = BUILDERS


def builder(collective: str, name: str):
    """The schedule builder of an algorithm."""
    return BUILDERS[collective][name]


# Algorithms that keep rank order and so accept non-commutative ops ("direct" folds
# in rank order from the left: also deterministic mode's; the shared ones inside one
# node, where they run unless the communicator spans nodes: engine.intranode refuses
# them there).
ORDER_PRESERVING = {"recursive_doubling", "direct", _shared.ONESHOT, _shared.TWOSHOT, _shared.NAME}

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


class Selection:
    """What "auto" picks for one layout: per collective, ((max bytes | None, name), ...).

    ``source``: where the rows come from (the built-in table, or the tuning
    file and entry); ``note``: why a tuning file was not applied, or None.
    ``segments``: the entry's segment and window rows, {(collective,
    algorithm): ((max bytes | None, segment bytes | None, window | None), ...)}.
    """

    __slots__ = ("rows", "source", "note", "entry", "segments")

    def __init__(self, rows: dict, source: str, note: str | None = None, entry=None):
        self.rows, self.source, self.note, self.entry = rows, source, note, entry
        self.segments = entry.segments if entry is not None else {}

    def segment(self, collective: str, name: str, nbytes: int):
        """(segment bytes | None, window | None) the entry gives an "auto" call of ``name``
        moving ``nbytes``, or None where it gives none (the options apply)."""
        rows = self.segments.get((collective, name))
        if rows is None:
            return None
        for limit, segment, window in rows:
            if limit is None or nbytes <= limit:
                return None if segment is None and window is None else (segment, window)
        return None

    def describe(self) -> list[str]:
        """Lines: the source, the note, then one line per collective (``<=4096 ring, ...``)."""
        lines = [f"source: {self.source}"]
        if self.note:
            lines.append(f"note: {self.note}")
        for collective, rows in self.rows.items():
            parts = [f"{'<=' + str(limit) if limit is not None else 'above'} {name}"
                     for limit, name in rows]
            tuned = self.entry is not None and collective in self.entry.selection
            lines.append(f"{collective}: {', '.join(parts)}"
                         f"{' (tuned)' if tuned else ' (built-in)' if self.entry else ''}")
        for (collective, name), rows in self.segments.items():
            parts = [f"{'<=' + str(limit) if limit is not None else 'above'} "
                     f"{'segment ' + str(seg) if seg else 'segment option'}, "
                     f"{'window ' + str(win) if win else 'window option'}"
                     for limit, seg, win in rows]
            lines.append(f"{collective} {name} segments: {'; '.join(parts)}")
        return lines


def builtin_rows(nranks: int) -> dict:
    """:data:`THRESHOLDS` for ``nranks`` ranks, as a Selection's rows."""
    pof2 = nranks & (nranks - 1) == 0
    return {c: tuple((limit, a if pof2 else b) for limit, a, b in rows)
            for c, rows in THRESHOLDS.items()}


_FILE: list = []        # [(TuningFile | None, note)] once loaded (once per process)
_SELECTIONS: dict = {}  # (nranks, nodes) -> Selection
_WARNED: set = set()


def tuning_file():
    """(TuningFile | None, note): the process's tuning file, found and read once (engine.tuning).

    ValueError (nothing cached) for a bad ``MPICOLL_TUNING``.
    """
    if not _FILE:
        _FILE.append(_tuning.find({c: tuple(t) for c, t in ALGORITHMS.items()}))
    return _FILE[0]


def reset() -> None:
    """Forget the tuning file and the selections, and read the environment again, as a new
    process would (a test that changes MPICOLL_TUNING)."""
    _config.read_environment()
    _FILE.clear()
    _SELECTIONS.clear()
    _WARNED.clear()


def _not_applied(note: str) -> None:
    if note not in _WARNED:
        _WARNED.add(note)
        warnings.warn(f"mpicoll: tuning file not applied, {note}; using the built-in table "
                      f"(python -m mpicoll.info shows the selection)", RuntimeWarning, stacklevel=3)


def selection(nranks: int, nodes: int = 1) -> Selection:
    """The Selection of a communicator of ``nranks`` ranks on ``nodes`` nodes.

    Reads the tuning file on the first call of the process (ValueError for
    a bad ``MPICOLL_TUNING``); a file or entry that does not fit is not
    applied, with a RuntimeWarning once and the reason in ``note``.
    """
    key = (nranks, nodes)
    sel = _SELECTIONS.get(key)
    if sel is not None:
        return sel
    tf, note = tuning_file()
    rows = builtin_rows(nranks)
    source = "built-in table (engine/select.py THRESHOLDS)"
    entry = None
    if tf is not None and note is None:
        entry = tf.entry(nranks, nodes)
        if entry is None:
            spans = "; ".join(f"{e.ranks[0]}-{e.ranks[1]} ranks on {e.nodes[0]}-{e.nodes[1]} nodes"
                              for e in tf.entries) or "no entries"
            note = f"{tf.path} has no entry for {nranks} ranks on {nodes} node(s) (it has: {spans})"
        else:
            rows = dict(rows)
            rows.update(entry.selection)
            source = f"tuning file {tf.path} ({entry.describe()})"
    if note is not None and tf is not None:
        _not_applied(note)
    sel = _SELECTIONS[key] = Selection(rows, source, note, entry)
    return sel


def adopted(raw, nranks: int, nodes: int, source: str) -> Selection:
    """The Selection of rank 0's tuning entry ``raw`` (None: the built-in table), which a
    communicator whose ranks read different files uses on every rank (engine.context)."""
    rows = builtin_rows(nranks)
    entry = None
    if raw is not None:
        entry = _tuning.Entry(raw, 0, {c: tuple(t) for c, t in ALGORITHMS.items()})
        rows = dict(rows)
        rows.update(entry.selection)
    return Selection(rows, f"rank 0's {source}", None, entry)


# "auto" across nodes: where the table above picks the ring (sizes above the
# collective's last limit), a communicator that spans more than one node with
# more than one rank on some node gets the hierarchical algorithm instead: it
# puts 2(k-1)/k * N on each of k node links where the ring on n ranks puts
# 2(n-1)/n * N (AllReduce; ReduceScatter and AllGather: half), and the
# extra steps inside a node cost latency the ring's sizes absorb.  The node
# layout is the context's (engine.context: each rank's host and boot, or
# MPICOLL_FAKE_NODES); docs/algorithms.md, "The hierarchical algorithms".
HIERARCHICAL_ABOVE = {collective: rows[-2][0] for collective, rows in THRESHOLDS.items()}


# "auto" and node memory (the ``intranode`` option, transport.shared): on a communicator
# whose ranks share one node, the first row of the collective whose size limit holds
# (max bytes, inclusive; None: no limit) gives the shared algorithm, or None: the table
# above.  Host rows: measured at 2 ranks with both MPIs (docs/performance.md, "Inside a
# node: the shared-memory algorithms").  Device rows (SHARED_DEVICE, below): the node path
# at every size, as ``intranode=shared`` (docs/gpu.md, "Shared memory inside a node
# (`intranode`)"): the ranks' own buffers through CUDA IPC, no copy through the host and
# no data through MPI; where its set-up fails, MPI's algorithms.  ``intranode=shared``
# takes SHARED_FORCED at every size, and on a communicator spanning nodes the
# hierarchical composition (algorithms.shared, commutative ops only); "auto" spanning
# nodes and ``intranode=mpi`` never a shared one.
SHARED_HOST = {
    "allreduce": ((None, None),),
    "reduce_scatter": ((None, None),),
    "allgather": ((None, None),),
}
# one shot up to this size: a rank reads every rank's chunk, with one sync per chunk
SHARED_FORCED = {
    "allreduce": ((256 << 10, _shared.ONESHOT), (None, _shared.TWOSHOT)),
    "reduce_scatter": ((None, _shared.NAME),),
    "allgather": ((None, _shared.NAME),),
}
# Device arrays on one node (``intranode=shared``): one shot up to this many bytes, two
# shot above.  On the ranks' own buffers (algorithms.shared, Shape.mapped) both take two
# syncs and one fold kernel per rank; one shot reads every rank's whole input (n bytes
# times the ranks) and writes its own output, two shot reads and writes 2n bytes a rank,
# part of them in the peers' memory.  The crossover is where one shot's extra reads stop
# hiding under a kernel launch: the GPU's to say (the device check's shared crossover
# line times both from 16 KiB to 4 MiB); until measured, 64 KiB: 256 KiB at 4 ranks,
# well under a microsecond of a GPU's memory bandwidth.
DEVICE_ONESHOT_BYTES = 64 << 10
SHARED_FORCED_DEVICE = dict(SHARED_FORCED, allreduce=(
    (DEVICE_ONESHOT_BYTES, _shared.ONESHOT), (None, _shared.TWOSHOT)))
SHARED_DEVICE = SHARED_FORCED_DEVICE


def shared_possible(mode: str, device: bool) -> bool:
    """Whether "auto" may take a shared algorithm under the ``intranode`` option ``mode`` for
    device or host arrays (some row of the table names one)."""
    if mode == "mpi":
        return False
    rows = _shared_rows(mode, device)
    return any(name is not None for table in rows.values() for _, name in table)


def shared_choice(collective: str, nbytes: int, mode: str, device: bool, spans: bool,
                  commutative: bool = True) -> str | None:
    """The shared algorithm "auto" runs for a call of ``nbytes`` under the ``intranode``
    option ``mode`` (device arrays or host; ``spans``: the communicator spans nodes), or
    None (an algorithm of :func:`choose`)."""
    if mode == "mpi":
        return None
    if spans:
        if mode != "shared" or not commutative:
            return None
        return _shared.TWOSHOT if collective == "allreduce" else _shared.NAME
    rows = _shared_rows(mode, device)
    for limit, name in rows[collective]:
        if limit is None or nbytes <= limit:
            return name
    return None


def _shared_rows(mode: str, device: bool) -> dict:
    if mode == "shared":
        return SHARED_FORCED_DEVICE if device else SHARED_FORCED
    return SHARED_DEVICE if device else SHARED_HOST


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
           staged: bool = False, forced: str | None = None,
           selection: Selection | None = None, nodes=None) -> str:
    """The name of the algorithm to run; ValueError if it cannot run this op.

    ``forced``: the ``algorithm`` option (MPICOLL_ALGORITHM, read with the
    communicator's options), which replaces "auto" where it applies.

    ``selection``: the communicator's :class:`Selection` (made once, with its
    context); None: the built-in table.  A collective the tuning file measured
    takes its rows; otherwise, across nodes (``nodes``: node label per rank),
    the sizes where the table picks the ring take the hierarchical algorithm
    (:func:`spans_nodes`).

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
        env = forced
        if env and env != "auto":
            check_forced(env)
            if env in table and (commutative or env in ORDER_PRESERVING):
                return env
        if not commutative:
            return next(a for a in table if a in ORDER_PRESERVING)
        if staged:
            return "ring"
        if selection is not None and selection.entry is not None \
                and collective in selection.entry.selection:
            for limit, name in selection.rows[collective]:
                if limit is None or nbytes <= limit:
                    return name
        if nodes is not None and spans_nodes(nodes) and nbytes > HIERARCHICAL_ABOVE[collective]:
            return "hierarchical"
        pof2 = nranks & (nranks - 1) == 0
        for limit, if_pof2, otherwise in THRESHOLDS[collective]:
            if limit is None or nbytes <= limit:
                return if_pof2 if pof2 else otherwise
    check_choice(collective, algorithm, commutative)
    return algorithm


def check_forced(name) -> None:
    """ValueError unless ``name`` (the ``algorithm`` option, MPICOLL_ALGORITHM) names an
    algorithm of some collective, or is "auto"/unset."""
    if name and name != "auto" and not any(name in t for t in ALGORITHMS.values()):
        raise ValueError(
            f"MPICOLL_ALGORITHM: expected one of "
            f"{', '.join(sorted({a for t in ALGORITHMS.values() for a in t}))}, got {name!r}")


def check_choice(collective: str, algorithm: str, commutative: bool) -> None:
    """ValueError when an explicit ``algorithm`` reorders operands and the op is not
    commutative (raised before any message)."""
    if algorithm != "auto" and not commutative and algorithm not in ORDER_PRESERVING \
            and collective != "allgather":
        raise ValueError(
            f"algorithm: {algorithm!r} reorders operands and cannot run a non-commutative op; "
            f"use 'auto' or one of "
            f"{', '.join(sorted(ORDER_PRESERVING & set(ALGORITHMS[collective])))}"
        )


def choose_on(ctx, collective: str, algorithm: str, nbytes: int, commutative: bool = True,
              staged: bool = False, selection: Selection | None = None) -> str:
    """:func:`choose` for a call on the communicator of context ``ctx``, with what the
    context knows: its options (the forced algorithm), its selection (``selection``
    replaces it) and its node layout.  What the engine runs, and what the benchmark
    reports as selected."""
    return choose(collective, algorithm, nbytes, ctx.size, commutative, staged=staged,
                  forced=_config.resolve(ctx.env)["algorithm"],
                  selection=ctx.selection if selection is None else selection, nodes=ctx.nodes)


# --- the type a call reduces in: the dtype policy ------------------------------------------
#
# Training numerics: the dtype policy the run path (engine.run) applies to a call.
#
# A call's dtype and flags (``Call.deterministic``, ``Call.accumulate``) decide
# how its elements are reduced; :func:`policy` turns them into a
# :class:`Policy`, or None for the common case (every type MPI reduces as it
# is).  The run path then binds and runs the call with it, one operation as
# every call (docs/numerics.md):
#
# * **SUM / PROD of float16, bfloat16, float8** accumulate in float32 with one
#   rounding to the input type at the end, by one of two schedules:
#
#   - the direct route (``algorithm="direct"``, deterministic mode, and "auto"
#     above :data:`DIRECT_ABOVE` per peer, host arrays): the blocks travel in
#     the input type, straight to their owner, who folds them in float32 in
#     rank order and rounds once (algorithms.direct with ``Shape.accumulate``).
#   - the float32 route (otherwise, ``Policy.widen``): the operation widens
#     the input into a float32 work array, runs the chosen algorithm on it in
#     place (float32 on the wire) and rounds the result into the output.  A
#     blocking AllReduce of more than :data:`SPLIT_BYTES` instead
#     reduce-scatters in float32, rounds its own block and all-gathers the
#     rounded blocks in the input type (``Policy.split``: 1.5x the bytes of an
#     all-16-bit AllReduce rather than 2x).
#
#   ``accumulate=False`` keeps wire-type partials (each hop rounds, as MPI and
#   NCCL do).
# * **bfloat16, float8_e4m3fn, float8_e5m2** (``ml_dtypes``) have no buffer
#   protocol: their messages move as unsigned words of the same size (the
#   binding's wire views, engine.executor), their reductions read the arrays.
# * **MIN / MAX** are exact in any type: no policy.
# * **deterministic** (``deterministic=True``, ``MPICOLL_DETERMINISTIC=1``):
#   floating and complex SUM/PROD and user-defined ops run the "direct"
#   schedule, whose result is the rank-order fold ``((x0 + x1) + x2) + ...``
#   in the accumulation type, the same for every algorithm, size, segment,
#   window, blocking or not, in place or not.

# A blocking SUM/PROD AllReduce of 16/8-bit floats above this many bytes (the input)
# reduce-scatters in float32 and all-gathers in the input type; at or below it, one
# float32 AllReduce (its latency-optimal algorithms) is faster.  Measured: docs/numerics.md.
SPLIT_BYTES = 256 << 10

# A SUM/PROD of 16/8-bit floats on host arrays with algorithm "auto" above this many
# bytes of input per peer (the input's bytes over n - 1) takes the direct route: the
# blocks travel in the input type and each rank folds its own in float32, n - 1 messages
# a rank, the ring's bytes.  At or below it, the float32 route: its latency-optimal
# algorithms take log2(n) steps where the direct one sends n - 1 messages.  None: never.
# Measured crossovers (2-4 ranks): docs/numerics.md.
DIRECT_ABOVE = {"allreduce": 2 << 10, "reduce_scatter": 256}

_ACCUMULATED = ("SUM", "PROD")
SPLIT_ALGORITHMS = {  # allreduce algorithm -> (reduce_scatter, allgather) of the split form
    "auto": ("auto", "auto"),
    "ring": ("ring", "ring"),
    "rabenseifner": ("recursive_halving", "recursive_doubling"),
}


class Policy(NamedTuple):
    """How a call's elements are reduced where that is not its own type, in its algorithm.

    ``algorithm``: what to run (the call's request, or "direct").
    ``accumulate``: the wider type a direct schedule folds in (``Shape.accumulate``).
    ``widen``: the type of the work array the operation widens the input into, runs
    on in place and rounds from (the float32 route).
    ``split``: (ReduceScatter, AllGather) algorithms of a blocking split AllReduce.
    """

    algorithm: str
    accumulate: object = None
    widen: object = None
    split: tuple | None = None


def policy(call, opts: dict, size: int, blocking: bool) -> Policy | None:
    """The :class:`Policy` of ``call`` under the communicator's options ``opts`` (its
    ``deterministic`` and forced ``algorithm``), or None: reduced as it is.

    ``blocking``: the call may run as two operations (the split AllReduce)."""
    if call.collective == "allgather" or call.op is None:
        return None
    msg = call.recv
    name = _types.op_name(call.op)
    wide = _types.accumulation_dtype(msg.dtype) if name in _ACCUMULATED \
        and call.accumulate is not False else None
    det = msg.category in ("floating", "complex") and (name in _ACCUMULATED or name is None) \
        and (opts["deterministic"] if call.deterministic is None else bool(call.deterministic))
    if wide is None and not det:
        return None
    algorithm = "direct" if det else call.algorithm
    if wide is None:
        return Policy(algorithm)
    if algorithm == "auto":
        # MPICOLL_ALGORITHM replaces "auto" here as in selection: a forced algorithm that
        # exists for the collective takes the route it names
        forced = opts["algorithm"]
        if forced and forced != "auto" and forced in ALGORITHMS[call.collective]:
            algorithm = forced
    src = call.recv.array if call.send is None else call.send.array
    if folds_at_owner(call.collective, algorithm, src.nbytes, msg.backend.name, size):
        return Policy("direct", accumulate=wide)
    split = SPLIT_ALGORITHMS.get(algorithm) if call.collective == "allreduce" else None
    if blocking and split is not None and size > 1 and src.nbytes > SPLIT_BYTES:
        return Policy(algorithm, widen=wide, split=split)
    return Policy(algorithm, widen=wide)


def direct_route(collective, algorithm, dtype, op, nbytes, size, backend="numpy") -> bool:
    """Whether a call of these (not deterministic, ``accumulate`` not False) takes the direct
    route: what the bench reports as the algorithm "auto" selected."""
    return collective != "allgather" and _types.op_name(op) in _ACCUMULATED and \
        _types.accumulation_dtype(np.dtype(dtype)) is not None and \
        folds_at_owner(collective, algorithm, nbytes, backend, size)


def folds_at_owner(collective, algorithm, nbytes, backend, size) -> bool:
    """Whether a 16/8-bit SUM/PROD of ``nbytes`` (the input) on ``size`` ranks, arrays of
    ``backend`` (its name), takes the direct route: its blocks travel in the input type
    and their owner folds them in float32.

    ``algorithm="direct"`` (and deterministic mode, which runs it) always does: the
    float32 fold in rank order is the same either way, the bytes half.  "auto" does above
    :data:`DIRECT_ABOVE` per peer.  Host arrays only: the device backends' staging was
    not measured with it, so device arrays keep the float32 route.
    """
    if backend != "numpy":
        return False
    if algorithm == "direct":
        return True
    limit = DIRECT_ABOVE[collective]
    return algorithm == "auto" and limit is not None and nbytes > limit * max(size - 1, 1)
