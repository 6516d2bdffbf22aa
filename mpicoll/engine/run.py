"""The one run path: a validated :class:`~mpicoll.core.types.Call` -> select -> schedule ->
transport -> bound operation.

Both public layers validate their arguments into a Call and hand it here;
nothing below this point raises for bad user input.  The context (engine.context),
the dtype policy and algorithm (engine.select), the schedule (cached on the
context; across nodes a large blocking call's becomes a pipeline), the transport
(engine.transports) and the binding (engine.executor) make one Operation; every
form is that operation started (:func:`run`, :func:`start`, :func:`persistent`),
and a call the API may see again is remembered (engine.cache).
docs/design.md, "How a call runs".
"""

from __future__ import annotations

import numpy as np

from ..algorithms import pipeline as _pipeline
from ..algorithms.schedule import packed
from ..backends import host as _host
from ..core import types as _types
from ..core.types import Call, Msg
from ..observe import calls as _observe
from ..observe import check as _check
from . import cache as _cache
from . import context as _context
from . import executor as _executor
from . import intranode as _intranode
from . import select as _select
from . import transports as _transports
from .executor import Operation

# Algorithms whose reductions all happen where the result is kept, so they can fold in a
# wider type than the one their messages carry (algorithms.schedule.Shape.accumulate).
ACCUMULATING = frozenset({"direct"})

BLOCKING, NONBLOCKING, PERSISTENT = "blocking", "non-blocking", "persistent"


class Bound:
    """A call bound to its context: the call, its schedule, its transport, its lease of work
    memory and its steps (what :class:`~mpicoll.engine.executor.Operation` runs), and what
    each start needs of them."""

    __slots__ = ("call", "schedule", "transport", "lease", "steps", "ctx", "label",
                 "wire", "msg", "total", "nbytes", "src", "dst", "widen", "check",
                 "timeout_arg", "claims", "enters", "ends", "kept", "holds", "name",
                 "__weakref__")

    @property
    def what(self) -> str:
        """The call's elements as messages name them (``"100 x float64"``): made where a
        message needs it, not at every binding (NumPy's dtype text is slow)."""
        return f"{self.total} x {_check.dtype_label(self.msg)}"

    # -- what executor.Operation asks at each start ----------------------------------
    def claim(self, op) -> None:
        self.transport.claim(op)

    def observed(self, op) -> bool:
        """Whether starts are observed now (a check, a trace or a traffic counter; a
        timeout alone is the operation's own), and the operation's deadline."""
        opts = self.ctx.options()
        op.timeout = opts["timeout"] if self.timeout_arg is None else self.timeout_arg
        self.check = bool(opts["check"])
        return self.check or self.ctx.observing

    def observe(self, op):
        """The observation of this start (observe.calls), or None: nothing observes it."""
        timeout = op.timeout
        if timeout is None and not self.check and not self.ctx.observing:
            return None
        c = self.call
        obs = _observe.begin(self.ctx, self.label, c.collective, op.algorithm, self.msg,
                             self.total, c.counts, c.displs, c.op, timeout, self.check)
        if obs is None:
            return None
        try:
            if self.check:
                obs.check(_executor.run_on)  # (its waits advance the operations in flight)
            obs.use_schedule(self.schedule)
        except BaseException:
            obs.end(True)
            raise
        return obs

    def enter(self, op) -> None:
        self.transport.enter(op)

    def ended(self, op, exc) -> None:
        """The start completed (``exc`` None) or failed: close it; an operation nobody keeps
        gives back what it holds."""
        obs, op.call = op.call, None
        try:
            self.transport.leave(op, exc)
        finally:
            if obs is not None:
                obs.end(exc is not None)
            if not self.kept:
                op.release()

    # -- binding -------------------------------------------------------------------
    def bind(self, src, dst, be) -> tuple:
        """The schedule bound to ``src``/``dst`` and the lease of work memory; with a policy
        that widens, to a work array of the wider type, between a widening copy of ``src``
        and the one rounding into ``dst``."""
        if self.lease is not None:
            self.lease.release()
        sched, t = self.schedule, self.transport
        self.lease = self.ctx.work.lease(be) if sched.work or self.widen is not None else None
        dtype = self.msg.dtype
        # a start on a region of node memory first waits for its holder (engine.intranode)
        first = ((_executor.AFTER, t.holder),) if getattr(t, "region", 0) else ()
        if self.widen is None:
            return first + _executor.bind(sched, t.views(sched, self.lease, dtype, src, dst,
                                                         self))
        # the float32 route (engine.select's dtype policy): in place on the widened copy
        work = self.lease.take(self.widen, len(src), "widened input")
        views = t.views(sched, self.lease, dtype, work, work[: len(dst)]
                        if self.call.collective == "reduce_scatter" else work, self)
        return first + ((_executor.COPY, work, src),) + _executor.bind(sched, views) + (
            (_executor.COPY, dst, views["dst"]),)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        self.transport.close()
        if self.holds:  # (a persistent operation: its context may go now, engine.context)
            self.holds = False
            self.ctx.let_go()


def prepare(call: Call, form: str = BLOCKING, *, keep: bool = False) -> Operation:
    """``call`` bound into an operation, not started: ``form`` is :data:`BLOCKING`,
    :data:`NONBLOCKING` or :data:`PERSISTENT`; ``keep``: its owner may start it again (the
    cache, a persistent request), so it keeps its work memory and requests
    (``op.bound.kept`` says whether it can: a non-blocking call on node memory cannot,
    its region changes from start to start)."""
    comm = call.comm
    # (before any message: an explicit algorithm the op cannot run, a bad MPICOLL_ALGORITHM)
    red0 = None if call.op is None else reducer(call.recv, call.op)
    commutative = True if red0 is None else red0.commutative
    _select.check_choice(call.collective, call.algorithm, commutative)
    ctx = _context.existing(comm)
    if ctx is None:  # the first call on comm sets it up, under the call's timeout
        ctx = _context.context(comm, call.timeout, _describe_first(call))
    _observe.check_usable(ctx)
    opts = ctx.options()  # (what the ranks agreed on: engine.context)
    c = _Choice()
    c.form, c.keep = form, keep
    c.device = call.recv.backend.name != "numpy"
    # device arrays: every start runs to the end (one call at a time per context)
    c.to_end = form == BLOCKING or c.device
    pol = _select.policy(call, opts, ctx.size, form == BLOCKING)
    if pol is not None and pol.split is not None:
        return _Split(call, pol)
    c.algorithm = call.algorithm if pol is None else pol.algorithm
    c.accumulate = None if pol is None else pol.accumulate
    c.widen = None if pol is None else pol.widen
    c.msg = msg = call.recv if c.widen is None else _widened(call.recv, c.widen)
    c.red = None if call.op is None else reducer(msg, call.op, c.accumulate)
    c.nbytes = nbytes = call.total * msg.dtype.itemsize
    per_step = getattr(msg.backend, "stages_per_step", None)  # device arrays (engine.select)
    c.staged = per_step is not None and per_step(ctx, nbytes)
    name = _select.choose_on(ctx, call.collective, c.algorithm, nbytes, commutative, c.staged)
    if c.accumulate is not None and name not in ACCUMULATING:
        raise ValueError(f"algorithm: {name!r} cannot fold in {c.accumulate}; "
                         f"use one of {', '.join(sorted(ACCUMULATING))}")
    label = call.label or call.collective
    c.name, c.region, setup = name, None, None
    if name in _intranode.ALGORITHMS or _select.shared_possible(ctx.intranode, c.device):
        # node memory (engine.intranode): a shared algorithm and its region, set up here
        # for a call that runs to the end, by the operation itself for a non-blocking one
        c.name, c.region, setup = _intranode.choose(
            ctx, call.collective, c.algorithm, name, nbytes, msg.backend, commutative,
            c.to_end, form == PERSISTENT, opts["timeout"] if call.timeout is None
            else call.timeout, lambda: (f"{label} #{ctx.seq + 1} ({c.name}, {call.total} x "
                                        f"{_check.dtype_label(msg)})", label, c.name),
            c.accumulate)
        c.fallback = name
    b = Bound()
    b.ctx, b.nbytes, b.total, b.widen = ctx, nbytes, call.total, c.widen
    b.label, b.wire, b.name = label, msg.mpitype.Get_size(), c.name
    b.timeout_arg, b.check, b.lease, b.holds = call.timeout, False, None, False
    b.call, b.msg, b.schedule, b.transport = call, msg, None, None
    b.kept = keep and not (c.region is not None and not c.to_end)
    if c.to_end:
        tag = None  # the blocking calls' tag
    elif form == PERSISTENT:
        # a tag of its own for the operation's life, from the persistent half of the
        # tags (every rank creates persistent operations in the same order)
        ctx.persistent_made += 1
        tag = _executor.tag_of(ctx.persistent_made, ctx.tag_ub, persistent=True)
    else:
        tag = "call"  # (each start: the tag of its call number)
    op = Operation((), None, None, None, bound=b, ctx=ctx, algorithm=c.name, tag=tag,
                   persistent=form == PERSISTENT or b.kept)
    op.blocking = c.to_end
    if form == PERSISTENT:  # (it keeps the context's duplicate until it is freed)
        b.holds = True
        ctx.holders += 1
    if setup is None:
        _bind(op, c)
    else:  # (the node memory's set-up: the first steps of its only start)
        b.claims, b.enters, b.ends = True, False, True
        b.transport = t = _transports.Deferred(ctx, c.region, setup)
        op.steps = op.program = _intranode.prelude(
            setup, t.holder, lambda: _executor.tag_of(op.seq, ctx.tag_ub),
            lambda: op.proceed(_bind(op, c, setup, t.holder)))
    return op


class _Choice:
    """What engine.run decided for a call, until its operation is bound (:func:`_bind`)."""

    __slots__ = ("form", "keep", "device", "to_end", "algorithm", "accumulate", "widen", "msg",
                 "red", "nbytes", "staged", "name", "region", "fallback")


def _bind(op, c, setup=None, holder=None) -> tuple:
    """Bind operation ``op`` of choice ``c``: its schedule, transport, steps (and program where
    its owner starts it again); the steps.  ``setup``: the node memory's set-up the
    operation ran first (engine.intranode.prelude), whose verdict may leave the shared
    algorithm for ``c.fallback``."""
    b, ctx = op.bound, op.ctx
    call, msg = b.call, c.msg
    if setup is not None:
        why = setup.finish()
        if why is not None:
            if c.algorithm != "auto":
                raise _intranode.unavailable(c.name, why)
            c.name, c.region = c.fallback, None
            op.algorithm = b.name = c.name
    src, dst = call.arrays(ctx.rank)
    b.schedule = _schedule(ctx, call, c.name, msg, c.red, call.send is None or c.widen is not None,
                           c.accumulate, c.staged, c.region, c.algorithm == "auto",
                           pipelined=c.form == BLOCKING and not c.device)
    op.schedule = b.schedule
    b.transport = _transport(ctx, call, msg, c.red, c.region, dst, holder)
    static = b.transport.static
    b.claims, b.enters = c.region is not None, not static
    b.ends = not (b.kept and static)
    if b.kept:  # (its arrays seen through views that keep nothing alive: engine.cache)
        b.call = call.without_arrays()
        b.msg = msg.described() if msg.array is not None else msg
        dst_view = _cache.raw(dst, msg.backend)
        src = dst_view if src is None or src is dst else _cache.raw(src, msg.backend)
        dst = dst_view
    b.src, b.dst = src, dst
    be = b.transport.backend
    b.steps = () if isinstance(b.transport, _transports.WholeStage) else b.bind(src, dst, be)
    ch = b.transport.channel
    if isinstance(op.tag, int):
        _executor.set_tag(ch, op.tag)
    op.steps, op.ch, op.red, op.be = b.steps, ch, b.transport.reducer, be
    op.parts, op.depth = b.schedule.parts, b.schedule.depth
    if (b.kept or c.form == PERSISTENT) and static and op.tag != "call" and not op.parts:
        # its program, made at its second start (executor.Operation._make_program)
        op.program, op._unmade, op._epoch = None, 1, -1
    if setup is not None:  # (the start in progress goes on with the call's own steps)
        op.call = b.observe(op)
        if ch is not None:
            op.use_channel(ch)
        if b.enters:
            b.enter(op)
    return b.steps


def _describe_first(call):
    """How the first call on a communicator names itself if its set-up times out."""
    label = call.label or call.collective
    return lambda: (f"{label} #1 ({call.algorithm}, {call.total} x "
                    f"{_check.dtype_label(call.recv)})", label, call.algorithm)


def run(call: Call, key=None) -> str:
    """Run ``call`` to the end (a blocking collective); the algorithm's name.  ``key``: the
    cache key of a public call (engine.cache), remembered if its operation can repeat."""
    op = prepare(call, BLOCKING, keep=key is not None)
    op.run()
    if op.bound is not None and op.bound.kept:
        _cache.remember(op, key)
    return op.algorithm


# The repeat of a remembered call (engine.cache): True if it ran, else False and the caller
# validates and runs the call; ``restart``: the same for a non-blocking call (its operation
# started again, or None).
repeat = _cache.repeat
restart = _cache.restart


def start(call: Call, key=None) -> Operation:
    """Start ``call`` (a non-blocking collective): its operation, in flight.  ``key``: as for
    :func:`run`; a remembered operation is restarted by the cache (engine.cache.restart)."""
    op = prepare(call, NONBLOCKING, keep=key is not None)
    if op.bound is not None and op.bound.kept:
        _cache.remember(op, key)
    if op.blocking:
        op.run()
    else:
        op.start()
    return op


def persistent(call: Call) -> Operation:
    """``call`` bound as a persistent operation: inactive until started."""
    return prepare(call, PERSISTENT, keep=True)


def start_persistent(op) -> None:
    """Start a persistent operation again on its buffers' current contents."""
    if op.blocking:
        op.run()
    else:
        op.start()


def free_persistent(op) -> None:
    """Give back a persistent operation's requests and work memory (an active one completes
    first); idempotent."""
    op.release()


class _Split:
    """A blocking split AllReduce (engine.select.Policy.split) as one operation's interface:
    ReduceScatter in the wide type on a widened copy, the one rounding of this rank's
    block, AllGather of the rounded blocks in place in the call's type."""

    bound = None
    blocking = True

    def __init__(self, call, pol):
        self.call, self.pol, self.algorithm = call, pol, None

    def run(self) -> None:
        from ..algorithms.ring import split as _blocks

        call, pol = self.call, self.pol
        comm, msg = call.comm, call.recv
        rank = comm.Get_rank()
        src, dst = call.arrays(rank)
        be = msg.backend
        work = be.empty(len(src), pol.widen)
        be.copy(work, src)
        counts, displs = _blocks(len(dst), comm.Get_size())
        rs, ag = pol.split
        wmsg = Msg(work, work.dtype, _types.category_of_dtype(work.dtype),
                   _types.wire_type(work.dtype), str(work.dtype), be)
        label = call.label or call.collective
        run(Call("reduce_scatter", comm, None, wmsg, tuple(counts), tuple(displs), call.op, rs,
                 call.timeout, label=label))
        mine, own = counts[rank], displs[rank]
        try:
            be.copy(dst[own:own + mine], work[:mine])  # the one rounding
        except _host.FP_CONDITIONS:  # (an overflow is written as inf, as MPI gives it)
            pass
        self.algorithm = run(Call("allgather", comm, None, msg, tuple(counts), tuple(displs),
                                  None, ag, call.timeout, label=label))

    def start(self) -> None:  # pragma: no cover - only blocking calls split
        self.run()


def _widened(msg, dtype) -> Msg:
    """The message type of ``msg``'s elements widened to ``dtype`` (no array: the binding
    takes the work array, engine.select)."""
    dtype = np.dtype(dtype)
    category = _types.category_of_dtype(dtype)
    mpitype = _types.wire_type(dtype)
    return Msg(None, dtype, category, mpitype, str(dtype), msg.backend)


def _transport(ctx, call, msg, red, region, dst, holder=None):
    """The transport of a call (engine.transports)."""
    device = msg.backend.name != "numpy"
    if region is not None:
        return _transports.NodeMemory(ctx, msg, red, region, holder)
    if not device:
        return _transports.Host(ctx, msg, red)
    if msg.backend.stages_whole(ctx, call.total * msg.dtype.itemsize):
        writes_all = call.collective != "allgather" or (
            packed(call.counts, call.displs) and sum(call.counts) == dst.size)
        return _transports.WholeStage(ctx, msg, red, call.op if red is not None else None,
                                      writes_all)
    return _transports.Device(ctx, msg, red)


def _schedule(ctx, call, name, msg, red, in_place, accumulate, staged, region, auto,
              pipelined):
    """The schedule of the call on ``ctx``, cached per call shape on the context; a pipeline
    of chunks (algorithms.pipeline) where the call is blocking, large and across nodes."""
    total = call.total
    counts = (total,) if call.collective == "allreduce" else call.counts
    displs = (0,) if call.collective == "allreduce" else call.displs
    commutative = True if red is None else red.commutative
    itemsize = msg.dtype.itemsize
    nbytes = total * itemsize
    # device arrays straight to a CUDA-aware MPI: the direct path's segment (engine.context)
    direct = region is None and msg.backend.name != "numpy" and ctx.cuda_aware()
    shape = _executor.shape_of(ctx, total, counts, displs, itemsize, in_place, commutative,
                               accumulate, ctx.segment_window(call.collective, name, nbytes,
                                                              auto, direct), staged)
    if region is not None:  # node memory: its slot (engine.intranode)
        shape = _intranode.shape(ctx, shape, msg.backend, region, itemsize)
    build, key = _select.builder(call.collective, name), name
    # (a pipeline runs across nodes only: on one node the transform is not consulted)
    if pipelined and len(set(shape.nodes)) > 1 \
            and _pipeline.applies(call.collective, name, shape, nbytes):
        # (each chunk's messages take a tag of their own: at most the blocking calls')
        chunks = min(_pipeline.chunks_of(call.collective, name, shape, nbytes),
                     _executor.CHUNKS)
        build = _pipeline.builder(call.collective, name, build, chunks,
                                  _select.ALGORITHMS["allreduce"].get(name))
        key = ("pipeline", name, chunks)
    return ctx.schedule(call.collective, key, build, shape)


def reducer(msg, op, accumulate=None):
    """The reducer of ``op`` on ``msg``'s elements, or (``accumulate``: a dtype) of a
    predefined op folding into that type (its operands: an accumulator and ``msg``'s type)."""
    if accumulate is not None:
        return msg.backend.reducer(op, _types.natural_type(accumulate), "floating")
    # msg.optype: user-defined ops see the datatype mpi4py would pass, not the wire type
    return msg.backend.reducer(op, msg.optype, msg.category)
