"""Training numerics: the dtype policy the run path (engine.run) applies to a call.

A call's dtype and flags (``Call.deterministic``, ``Call.accumulate``) decide
how its elements are reduced; :func:`policy` turns them into a
:class:`Policy`, or None for the common case (every type MPI reduces as it
is).  The run path then binds and runs the call with it, one operation as
every call (docs/numerics.md):

* **SUM / PROD of float16, bfloat16, float8** accumulate in float32 with one
  rounding to the input type at the end, by one of two schedules:

  - the direct route (``algorithm="direct"``, deterministic mode, and "auto"
    above :data:`DIRECT_ABOVE` per peer, host arrays): the blocks travel in
    the input type, straight to their owner, who folds them in float32 in
    rank order and rounds once (algorithms.direct with ``Shape.accumulate``).
  - the float32 route (otherwise, ``Policy.widen``): the operation widens
    the input into a float32 work array, runs the chosen algorithm on it in
    place (float32 on the wire) and rounds the result into the output.  A
    blocking AllReduce of more than :data:`SPLIT_BYTES` instead
    reduce-scatters in float32, rounds its own block and all-gathers the
    rounded blocks in the input type (``Policy.split``: 1.5x the bytes of an
    all-16-bit AllReduce rather than 2x).

  ``accumulate=False`` keeps wire-type partials (each hop rounds, as MPI and
  NCCL do).
* **bfloat16, float8_e4m3fn, float8_e5m2** (``ml_dtypes``) have no buffer
  protocol: their messages move as unsigned words of the same size (the
  binding's wire views, engine.executor), their reductions read the arrays.
* **MIN / MAX** are exact in any type: no policy.
* **deterministic** (``deterministic=True``, ``MPICOLL_DETERMINISTIC=1``):
  floating and complex SUM/PROD and user-defined ops run the "direct"
  schedule, whose result is the rank-order fold ``((x0 + x1) + x2) + ...``
  in the accumulation type, the same for every algorithm, size, segment,
  window, blocking or not, in place or not.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..core import types as _types
from . import select as _select

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
        if forced and forced != "auto" and forced in _select.ALGORITHMS[call.collective]:
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
