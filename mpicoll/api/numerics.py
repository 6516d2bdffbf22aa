"""Training numerics: 8/16-bit floats reduced in float32, ml_dtypes types moved as words, and
deterministic reductions; composed from the engine's collectives (docs/numerics.md).

The array functions and :class:`mpicoll.Comm` validate a call into messages
(api.buffers) and hand it here first (:func:`route`); a call this module
does not change (most) goes on to engine.collectives as it is.  What changes:

* **bfloat16, float8_e4m3fn, float8_e5m2** (``ml_dtypes`` arrays; DLPack
  tensors of those types): NumPy cannot give MPI their memory, so they move
  as 16/8-bit unsigned words (an AllGather moves only those).
* **SUM / PROD of float16, bfloat16, float8** accumulate in float32 with one
  rounding to the input type at the end, by one of two schedules:

  - the direct route (``algorithm="direct"``, deterministic mode, and "auto"
    above :data:`DIRECT_ABOVE` per peer, host arrays): the blocks travel in
    the input type, straight to their owner, who folds them in float32 in
    rank order and rounds once (algorithms.direct with ``Shape.accumulate``);
    an AllReduce then sends each folded block to every rank.  The ring's
    bytes, n - 1 messages a rank a phase; one engine operation.
  - the float32 route (otherwise): the input is widened to float32, reduced
    by the chosen algorithm in float32 (float32 on the wire), rounded.  An
    AllReduce of more than :data:`SPLIT_BYTES` instead reduce-scatters in
    float32, rounds its own block and all-gathers the rounded blocks in the
    input type (1.5x the bytes of an all-16-bit AllReduce rather than 2x).

  ``accumulate=False`` keeps wire-type partials (each hop rounds, as MPI and
  NCCL do).
* **MIN / MAX** are exact in any type: 16/8-bit values are compared in
  their own type (an op on their words for the ml_dtypes types).
* **deterministic** (``deterministic=True``, ``MPICOLL_DETERMINISTIC=1``):
  floating and complex SUM/PROD and user-defined ops run the "direct"
  schedule (algorithms.direct), whose result is the rank-order fold
  ``((x0 + x1) + x2) + ...`` in the accumulation type, the same for every
  algorithm, size, segment, window, blocking or not, in place or not.
  ``algorithm=`` then names nothing that changes the value.

Each routed call is one engine operation (plus, on the float32 route, local
conversions before and after), except the split AllReduce above, which
blocking calls only use.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..backends.host import NUMPY
from ..core import config as _config
from ..core import types as _types
from ..engine import collectives as _collectives
from ..engine import select as _select
from .buffers import msg_of_array

# A blocking SUM/PROD AllReduce of 16/8-bit floats above this many bytes (the input)
# reduce-scatters in float32 and all-gathers in the input type; at or below it, one
# float32 AllReduce (its latency-optimal algorithms) is faster.  Measured: docs/numerics.md.
SPLIT_BYTES = 256 << 10

# A SUM/PROD of 16/8-bit floats on host arrays with algorithm "auto" above this many
# bytes of input per peer (the input's bytes over n - 1) takes the direct route
# (_folds_at_owner): the blocks travel in the input type and each rank folds its own in
# float32, n - 1 messages a rank, the ring's bytes.  At or below it, the float32 route
# above: its latency-optimal algorithms take log2(n) steps where the direct one sends
# n - 1 messages.  None: never.  Measured crossovers (2-4 ranks): docs/numerics.md.
DIRECT_ABOVE = {"allreduce": 2 << 10, "reduce_scatter": 256}

_ACCUMULATED = ("SUM", "PROD")
_SPLIT_ALGORITHMS = {  # allreduce algorithm -> (reduce_scatter, allgather) of the split form
    "auto": ("auto", "auto"),
    "ring": ("ring", "ring"),
    "rabenseifner": ("recursive_halving", "recursive_doubling"),
}


def is_deterministic(deterministic, comm=None) -> bool:
    """``deterministic``, else the option in force for ``comm``: configure()'s setting, else
    MPICOLL_DETERMINISTIC as read when the communicator's context was made (before its first
    call: the environment now, which the set-up then reads; the set-up itself is the
    engine's, under the call's timeout; None: the latest read)."""
    if deterministic is not None:
        return bool(deterministic)
    return bool(_option("deterministic", comm))


def _option(name, comm=None):
    """The option ``name`` in force for ``comm`` (see :func:`is_deterministic`)."""
    if comm is None:
        return _config.get(name)
    from ..engine import context as _context

    ctx = _context.existing(comm)
    env = _config.read_environment() if ctx is None else ctx.env
    return _config.resolve(env)[name]


class Route:
    """How one routed call runs: engine arguments, then a local step at the end (or None)."""

    __slots__ = ("collective", "args", "finish", "prepare", "accumulate")

    def __init__(self, collective, args, finish=None, prepare=None, accumulate=None):
        """``prepare``: the local step before the engine's, run again by each restart of a
        persistent operation (it was run once here, when the route was made).
        ``accumulate``: the dtype the engine's schedule folds in (the direct route)."""
        self.collective, self.args, self.finish, self.prepare = collective, args, finish, prepare
        self.accumulate = accumulate

    def run(self, timeout):
        _RUN[self.collective](*self.args, timeout=timeout, accumulate=self.accumulate)
        if self.finish is not None:
            self.finish()

    def start(self, timeout, persistent=False):
        return _START[self.collective](*self.args, timeout=timeout, persistent=persistent,
                                       accumulate=self.accumulate)


def _allgather(*args, accumulate=None, **kw):  # (nothing to accumulate)
    return _collectives.run_allgather(*args, **kw)


def _start_allgather(*args, accumulate=None, **kw):
    return _collectives.start_allgather(*args, **kw)


_RUN = {"allreduce": _collectives.run_allreduce, "reduce_scatter": _collectives.run_reduce_scatter,
        "allgather": _allgather}
_START = {"allreduce": _collectives.start_allreduce,
          "reduce_scatter": _collectives.start_reduce_scatter,
          "allgather": _start_allgather}


def _words(arr):
    """A message over the unsigned words of an ml_dtypes array (MPI can read those)."""
    return msg_of_array(arr.view(_types.view_dtype(arr.dtype)), NUMPY)


_WORD_OPS: dict = {}


def _word_op(name, dtype):
    """An MPI op applying the ufunc of ``name`` to words holding ``dtype`` (ml_dtypes)."""
    key = (name, dtype)
    op = _WORD_OPS.get(key)
    if op is None:
        ufunc, words = _types.NUMPY_UFUNCS[name], _types.view_dtype(dtype)

        def apply(inbuf, inoutbuf, datatype, ufunc=ufunc, words=words, dtype=dtype):
            a = np.frombuffer(inbuf, words).view(dtype)
            b = np.frombuffer(inoutbuf, words).view(dtype)
            ufunc(a, b, out=b)

        op = _WORD_OPS[key] = MPI.Op.Create(apply, commute=True)
    return op


def route(collective, comm, smsg, rmsg, op=None, algorithm="auto", counts=None, displs=None, *,
          deterministic=None, accumulate=None, one_operation=False):
    """The :class:`Route` of a validated call, or None when it runs as it is.

    ``smsg`` None: in place.  ``one_operation``: the call must be one engine
    operation (non-blocking, persistent).  ``accumulate``: None or True:
    16/8-bit SUM/PROD in float32; False: in the input type.
    """
    dtype = rmsg.dtype
    ml = _types.is_ml_type(dtype)
    if collective == "allgather":
        if not ml:
            return None
        return Route("allgather", (comm, None if smsg is None else _words(smsg.array),
                                   _words(rmsg.array), counts, displs, algorithm))
    name = _types.op_name(op)
    wide = _types.accumulation_dtype(dtype) if name in _ACCUMULATED and accumulate is not False \
        else None
    det = rmsg.category in ("floating", "complex") and (name in _ACCUMULATED or name is None) \
        and is_deterministic(deterministic, comm)
    if not (ml or wide is not None or det):
        return None
    if det:
        algorithm = "direct"
    src = rmsg.array if smsg is None else smsg.array
    if wide is not None and algorithm == "auto":
        # MPICOLL_ALGORITHM replaces "auto" here as in the engine: a forced algorithm that
        # exists for the collective takes the route it names
        forced = _option("algorithm", comm)
        if forced and forced != "auto" and forced in _select.ALGORITHMS[collective]:
            algorithm = forced
    if wide is not None and _folds_at_owner(collective, algorithm, src.nbytes,
                                            rmsg.backend.name, comm.Get_size()):
        args = (comm, smsg, rmsg, op, "direct") if collective == "allreduce" else \
            (comm, smsg, rmsg, counts, displs, op, "direct")
        return Route(collective, args, accumulate=wide)
    if collective == "allreduce":
        return _allreduce(comm, src, rmsg.array, op, algorithm, wide, smsg, rmsg, one_operation)
    mine = counts[comm.Get_rank()]
    out = rmsg.array[:mine] if smsg is None else rmsg.array
    if wide is not None:
        be = rmsg.backend
        work = _widened(be, src, wide)
        args = (comm, None, msg_of_array(work, be), counts, displs, op, algorithm)
        return Route("reduce_scatter", args, _rounder(be, out, work[:mine]),
                     lambda: be.copy(work, src))
    if ml:
        args = (comm, None if smsg is None else _words(smsg.array), _words(rmsg.array), counts,
                displs, _word_op(name, dtype), algorithm)
        return Route("reduce_scatter", args)
    return Route("reduce_scatter", (comm, smsg, rmsg, counts, displs, op, algorithm))


def direct_route(collective, algorithm, dtype, op, nbytes, size, backend="numpy") -> bool:
    """Whether a call of these (not deterministic, ``accumulate`` not False) takes the direct
    route: what the bench reports as the algorithm "auto" selected."""
    return collective != "allgather" and _types.op_name(op) in _ACCUMULATED and \
        _types.accumulation_dtype(np.dtype(dtype)) is not None and \
        _folds_at_owner(collective, algorithm, nbytes, backend, size)


def _folds_at_owner(collective, algorithm, nbytes, backend, size) -> bool:
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


def _widened(be, src, wide):
    """A new ``wide`` copy of ``src`` made by the array's backend (device arrays stay there:
    the backend's copy casts, as numpy.copyto and cupy.copyto do)."""
    work = be.empty(len(src), wide)
    be.copy(work, src)
    return work


def _rounder(be, dst, wide):
    def finish():
        be.copy(dst, wide)  # the one rounding (a casting copy)
    return finish


def _allreduce(comm, src, dst, op, algorithm, wide, smsg, rmsg, one_operation):
    dtype = dst.dtype
    if wide is not None:
        be = rmsg.backend
        work = _widened(be, src, wide)
        split = _SPLIT_ALGORITHMS.get(algorithm)
        if not one_operation and split is not None and comm.Get_size() > 1 and \
                src.nbytes > SPLIT_BYTES:
            return _SplitRoute(comm, work, dst, op, split, be)
        return Route("allreduce", (comm, None, msg_of_array(work, be), op, algorithm),
                     _rounder(be, dst, work), lambda: be.copy(work, src))
    if _types.is_ml_type(dtype):
        return Route("allreduce", (comm, None if smsg is None else _words(src), _words(dst),
                                   _word_op(_types.op_name(op), dtype), algorithm))
    return Route("allreduce", (comm, smsg, rmsg, op, algorithm))


class _SplitRoute(Route):
    """ReduceScatter in float32, round this rank's block, AllGather the rounded blocks."""

    __slots__ = ("work", "dst", "op", "algorithms", "backend")

    def __init__(self, comm, work, dst, op, algorithms, backend):
        super().__init__("allreduce", (comm,))
        self.work, self.dst, self.op, self.algorithms = work, dst, op, algorithms
        self.backend = backend

    def run(self, timeout):
        from ..algorithms.ring import split

        comm = self.args[0]
        n, rank = comm.Get_size(), comm.Get_rank()
        counts, displs = split(len(self.dst), n)
        mine, own = counts[rank], displs[rank]
        rs, ag = self.algorithms
        be = self.backend
        _collectives.run_reduce_scatter(comm, None, msg_of_array(self.work, be), counts, displs,
                                        self.op, rs, timeout=timeout)
        be.copy(self.dst[own:own + mine], self.work[:mine])  # the one rounding
        words = self.dst.view(_types.view_dtype(self.dst.dtype))
        _collectives.run_allgather(comm, None, msg_of_array(words, be), counts, displs, ag,
                                   timeout=timeout)

    def start(self, timeout, persistent=False):  # pragma: no cover - route(one_operation=True)
        raise AssertionError("a split AllReduce is not one operation")
