"""The one run path: a validated :class:`~mpicoll.core.types.Call` -> select -> schedule -> bind
-> operation.

Both public layers (the array functions and :class:`mpicoll.Comm`) validate
their arguments into a Call and hand it to :func:`start` (non-blocking and
persistent operations) or :func:`run` (blocking: an operation started and
waited for).  Nothing below this point raises for bad user input.

1. **select**: the communicator's context (engine.context; the first call on
   a communicator sets it up, under the call's timeout), the dtype policy
   (engine.select's dtype policy) and the algorithm (engine.select);
2. **schedule**: the algorithm's schedule for the call's shape, cached on the
   context; across nodes a large blocking call's schedule is cut into a
   pipeline (algorithms.pipeline);
3. **bind**: the schedule's regions become array views (the call's arrays,
   work memory leased from the context), its messages go on the backend's
   channel, observed when a check, timeout, counter or trace is on
   (observe.calls), through one pinned host copy for small device calls on
   the staging path (backends.devices.WholeStage);
4. **operation**: engine.executor.Operation runs the bound steps (the one loop,
   the progress rule).

A plain call (host arrays on the plain channel, nothing observing it but a
timeout) is then remembered in the context's cache of bound calls
(engine.cache), whose repeat skips steps 1-3.  A persistent operation binds
once and starts many times (:func:`start_persistent`).
"""

from __future__ import annotations

import numpy as np

from ..algorithms import pipeline as _pipeline
from ..algorithms.schedule import DST, SRC, packed
from ..backends import host as _host
from ..core import config as _config
from ..core import types as _types
from ..core.types import Call, Msg
from ..observe import calls as _observe
from ..observe import check as _check
from . import cache as _cache
from . import context as _context
from . import executor as _executor
from . import intranode as _intranode
from . import select as _select
from .executor import Operation

# Algorithms whose reductions all happen where the result is kept, so they can fold in a
# wider type than the one their messages carry (algorithms.schedule.Shape.accumulate).
ACCUMULATING = frozenset({"direct"})


class Bound:
    """A call bound to its context: what its operation runs with, set up again by each
    start that needs it (:meth:`begin`) and closed by :meth:`ended`."""

    __slots__ = ("call", "ctx", "name", "auto", "msg", "red0", "src", "dst", "in_place",
                 "widen", "accumulate", "staged", "schedule", "timeout", "check", "blocking",
                 "tag", "lease", "steps", "ch", "be", "red", "stage", "observed", "timed",
                 "program", "operation", "seq", "region", "__weakref__")

    def begin(self, operation) -> None:
        """Set ``operation`` up for one start (it has not sent anything yet)."""
        ctx = self.ctx
        ctx.seq += 1
        self.seq = ctx.seq
        msg = self.msg
        be = msg.backend
        nbytes = self.total * msg.dtype.itemsize
        # small device calls on the staging path run the host algorithm on one
        # pinned copy (see backends.devices.WholeStage)
        whole = getattr(be, "whole_stage", None)
        if self.region is not None and _intranode.uses(self.schedule):  # (node memory: device)
            whole = None
        stage = self.stage = None if whole is None else whole(
            ctx, nbytes, msg, self.call.op if self.red0 is not None else None)
        if stage is not None:
            ch, run_be, red = stage.channel, stage.backend, stage.reducer
        else:
            ch = None if self.region is None else \
                _intranode.channel(ctx, be, msg.mpitype, self.schedule)  # (node memory)
            ch, run_be, red = ch or be.channel(ctx, msg.mpitype), be, self.red0
        if self.tag != _executor.TAG:
            _set_tag(ch, self.tag)
        ctx.options()  # (observers switched on or off since: ctx.observing)
        call = None if self.timeout is None and not self.check and not ctx.observing else \
            _observe.begin(ctx, self.label, self.call.collective, self.name, msg, self.total,
                           self.call.counts, self.call.displs, self.call.op, self.timeout,
                           self.check)
        self.observed = call is not None or stage is not None
        # observed for its timeout alone: the call may be remembered with a deadline
        self.timed = (stage is None and call is not None and not self.check
                      and not call.recorders and call.events is None)
        try:
            if call is not None:
                if self.check:
                    call.check(_executor.run_on)  # its waits advance the operations in flight
                ch, run_be, red = call.wrap(ch, run_be, red)
            be.prepare()
            src, dst = self.src, self.dst
            if stage is not None:
                src, dst = stage.enter(src, dst, self._writes_all(dst))
            if call is not None:
                call.use_schedule(self.schedule)
            # a persistent operation's steps are bound once, unless they point at a
            # stage's pinned copies or an observed channel
            if self.steps is None or stage is not None or call is not None:
                self._bind(src, dst, run_be)
        except BaseException:
            if call is not None:
                call.end(True)
            self.stage = None
            raise
        operation.steps, operation.ch, operation.be, operation.red = self.steps, ch, run_be, red
        operation.parts, operation.depth = self.schedule.parts, self.schedule.depth
        operation.call = call
        self.ch, self.be, self.red = ch, run_be, red

    @property
    def total(self) -> int:
        return self.call.total

    def about(self) -> tuple:
        """How a failure names this call (engine.executor.failure)."""
        msg = self.msg
        return (self.label, self.seq, self.name, f"{self.total} x {_check.dtype_label(msg)}",
                self.ctx, self.schedule, msg.mpitype.Get_size())

    @property
    def label(self) -> str:
        return self.call.label or self.call.collective

    def _writes_all(self, dst) -> bool:
        """Whether the call writes every element of ``dst`` (not: an AllGather whose
        blocks leave gaps, or end before ``dst`` does)."""
        c = self.call
        return c.collective != "allgather" or (
            packed(c.counts, c.displs) and sum(c.counts) == dst.size)

    def _bind(self, src, dst, be) -> None:
        """Bind the schedule to ``src``/``dst`` and a lease of work memory; with a policy
        that widens, to a work array of the wider type, between a widening copy of
        ``src`` and the one rounding into ``dst``."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        sched = self.schedule
        if sched.work or self.widen is not None:
            self.lease = self.ctx.work.lease(self.msg.backend if self.stage is None else be)
        views = _executor.work_views(sched, self.lease, self.msg.dtype) if sched.work else {}
        if self.widen is None:
            views[DST] = dst
            views[SRC] = dst if src is None else src
        else:
            # the float32 route (engine.select's dtype policy): in place on the widened copy
            work = self.lease.take(self.widen, len(src), "widened input")
            views[SRC] = work
            views[DST] = work[: len(dst)] if self.call.collective == "reduce_scatter" else work
        if self.region is not None:  # node memory (engine.intranode)
            views.update(_intranode.views(self.ctx, self.msg.backend, self.region, sched,
                                          self.msg.dtype, views, self))
        if self.widen is None:
            self.steps = _executor.bind(sched, views)
            return
        self.steps = ((_executor.COPY, work, src),) + _executor.bind(sched, views) + (
            (_executor.COPY, dst, views[DST]),)

    def ended(self, operation, exc) -> None:
        """The operation completed (``exc`` None) or failed: close this start."""
        call = operation.call
        operation.call = None
        try:
            if exc is None:
                if self.stage is not None:
                    self.stage.leave()
                self.msg.backend.finish()
        finally:
            if call is not None:
                call.end(exc is not None)
            if self.stage is not None or call is not None or exc is not None:
                self.stage = None
                self.steps = None  # bound to a stage's pinned copies or an observed channel
            if exc is not None and operation.persistent:
                self.program = None
            if not operation.persistent:
                self.release()

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        self.steps = None


def _set_tag(ch, tag):
    """Give the host channel under ``ch`` (device channels wrap one as ``inner``) the tag."""
    while ch is not None:
        if isinstance(ch, _executor.Channel):
            ch.tag = tag
            return
        ch = getattr(ch, "inner", None)


def start(call: Call, *, block: bool = False, persistent: bool = False,
          remember=None) -> Operation:
    """Start ``call``: an operation in flight (``block``: run to the end here; ``persistent``:
    bound, not started).  ``remember``: the cache key of a public call
    (engine.cache.remember) kept if the call turns out plain.  Returns the operation
    (``algorithm`` names what ran)."""
    comm = call.comm
    ctx = _context.existing(comm)
    if ctx is not None:
        env, opts = ctx.env, ctx.options()
    else:  # (the first call on comm: it sets the context up below, with this reading)
        env = _config.read_environment()
        opts = _config.resolve(env)
    timeout = opts["timeout"] if call.timeout is None else call.timeout
    pol = _select.policy(call, opts, comm.Get_size(), block and not persistent)
    if pol is not None and pol.split is not None:
        return _split(call, pol, timeout)
    algorithm = call.algorithm if pol is None else pol.algorithm
    accumulate = None if pol is None else pol.accumulate
    widen = None if pol is None else pol.widen
    msg = call.recv if widen is None else _widened(call.recv, widen)
    size = comm.Get_size()
    red = None if call.op is None else reducer(msg, call.op, accumulate)
    commutative = True if red is None else red.commutative
    nbytes = call.total * msg.dtype.itemsize
    per_step = getattr(msg.backend, "stages_per_step", None)  # device arrays (engine.select)
    staged = per_step is not None and per_step(nbytes)
    # (chosen before the set-up, so a bad explicit algorithm raises before any message)
    name = _select.choose(call.collective, algorithm, nbytes, size, commutative, staged=staged,
                          forced=opts["algorithm"])
    if accumulate is not None and name not in ACCUMULATING:
        raise ValueError(f"algorithm: {name!r} cannot fold in {accumulate}; "
                         f"use one of {', '.join(sorted(ACCUMULATING))}")
    label = call.label or call.collective
    if ctx is None:
        # the first call on comm sets it up, under the call's timeout
        ctx = _context.context(comm, timeout, lambda: (
            f"{label} #1 ({name}, {call.total} x {_check.dtype_label(msg)})", label, name), env)
    _observe.check_usable(ctx)
    if algorithm == "auto":  # with what the context knows: its selection and node layout
        name = _select.choose_on(ctx, call.collective, algorithm, nbytes, commutative, staged)
    device = msg.backend.name != "numpy"
    region = None
    if name in _intranode.ALGORITHMS or _select.shared_possible(ctx.intranode, device):
        # node memory (engine.intranode): a shared algorithm, its region set up
        name, region = _intranode.choose(
            ctx, call.collective, algorithm, name, nbytes, msg.backend, commutative,
            block or device, persistent, timeout,
            lambda: (f"{label} #{ctx.seq + 1} ({name}, {call.total} x "
                     f"{_check.dtype_label(msg)})", label, name), accumulate)
    src, dst = call.arrays(ctx.rank)
    b = Bound()
    b.call, b.ctx, b.name, b.auto = call, ctx, name, algorithm == "auto"
    b.msg, b.red0, b.accumulate, b.widen, b.staged = msg, red, accumulate, widen, staged
    # (the float32 route runs in place on its widened copy)
    b.src, b.dst, b.in_place = src, dst, call.send is None or widen is not None
    # Device arrays: every operation runs to the end when it starts.  Their
    # transport (staging pool, pinned whole-call copy, the compute stream's
    # ordering of one call after the other; backends.devices) serves one call
    # at a time per context, so operations on them never overlap.
    b.region = region
    b.timeout, b.check = timeout, bool(opts["check"])
    b.blocking = block or device
    b.lease = b.steps = b.stage = b.program = None
    b.timed = False
    b.schedule = _schedule(b, ctx, pipelined=block and not persistent and not device)
    if b.blocking:
        b.tag = _executor.TAG
    elif persistent:
        # a tag of its own for the operation's life, from the persistent half of the
        # tags (every rank creates persistent operations in the same order)
        ctx.persistent_made += 1
        b.tag = _executor.tag_of(ctx.persistent_made, ctx.tag_ub, persistent=True)
    else:
        b.tag = _executor.tag_of(ctx.seq + 1, ctx.tag_ub)  # begin() takes this call number
    operation = Operation((), None, None, None, run=b, ctx=None if b.blocking else ctx,
                          persistent=persistent, algorithm=name)
    operation.progress = _config.get("progress")  # (process-wide: api.requests's thread)
    # (persistent only: a bound call and its operation referring to each other form a
    # cycle, which keeps the call's arrays alive until the cyclic collector runs; a
    # persistent operation holds its buffers until Free anyway, which breaks it)
    b.operation = operation if persistent else None
    if not persistent:
        b.begin(operation)
        if region is not None:  # node memory: its region's previous operation done
            _intranode.claim(ctx, region, operation)
        operation.go(b.blocking)
        if remember is not None and pol is None and plain(b, operation):
            _cache.remember(ctx, remember, b, blocking=block)
            if repeat is not _cache.repeat:  # (the compiled repeat just loaded)
                _installed()
    return operation


def run(call: Call, *, remember=None) -> str:
    """Run ``call`` to the end (a blocking collective); the algorithm's name."""
    return start(call, block=True, remember=remember).algorithm


# The repeat of a remembered call: ``repeat(comm, name, a, b, c, d, t)`` runs the blocking
# call of function ``name`` with arguments ``a, b, c, d, t`` again if the cache proves it
# the same call (True), else False: the caller validates and runs it.  ``restart(...)``:
# the same for a non-blocking call, its operation started again (or None).  Both are the
# cache's (engine.cache); ``repeat`` becomes the compiled one once that loads (when a call
# is remembered), which :func:`start` then installs here.
repeat = _cache.repeat
restart = _cache.restart


def _installed() -> None:
    global repeat
    repeat = _cache.repeat


def _widened(msg, dtype) -> Msg:
    """The message type of ``msg``'s elements widened to ``dtype`` (no array: the binding
    takes the work array, engine.select)."""
    dtype = np.dtype(dtype)
    category = _types.category_of_dtype(dtype)
    mpitype = _types.wire_type(dtype)
    return Msg(None, dtype, category, mpitype, str(dtype), msg.backend)


def _split(call, pol, timeout) -> Operation:
    """A blocking split AllReduce (engine.select.Policy.split): ReduceScatter in the wide
    type on a widened copy, the one rounding of this rank's block, AllGather of the
    rounded blocks in place in the call's type; the AllGather's operation."""
    from ..algorithms.ring import split as _blocks

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
    run(Call("reduce_scatter", comm, None, wmsg, tuple(counts), tuple(displs), call.op, rs,
             timeout, label=call.label or call.collective))
    mine, own = counts[rank], displs[rank]
    try:
        be.copy(dst[own:own + mine], work[:mine])  # the one rounding
    except _host.FP_CONDITIONS:  # (an overflow is written as inf, as MPI gives it)
        pass
    return start(Call("allgather", comm, None, msg, tuple(counts), tuple(displs), None, ag,
                      timeout, label=call.label or call.collective), block=True)


def plain(b, operation, timed=True) -> bool:
    """Whether a started call may be remembered as a bound call: host arrays on the plain
    host channel, unobserved or (``timed``) observed for a timeout alone."""
    if operation.error is not None or b.msg.backend.name != "numpy":
        return False
    if b.region is not None and not _intranode.plain(b):  # (node memory: engine.intranode)
        return False
    if not b.observed:
        return type(b.ch) is _executor.Channel
    return timed and b.timed and type(b.ch.inner) is _executor.Channel


def start_persistent(operation) -> None:
    """Start a persistent operation again on its buffers' current contents."""
    b = operation.run
    _observe.check_usable(b.ctx)
    if b.program is not None and not _observe.observing():
        if b.region is not None:
            _intranode.claim(b.ctx, b.region, operation)  # (node memory)
        b.ctx.seq += 1  # every start is a call
        operation.steps, operation.ch, operation.red, operation.be = b.program
        operation.call = None
        operation.go(False)
        return
    b.begin(operation)
    if b.region is not None:
        _intranode.claim(b.ctx, b.region, operation)  # (node memory)
    operation.go(False)
    if b.program is None and plain(b, operation, timed=False):
        # its later starts run on persistent requests (bound once: the buffers are fixed)
        _cache.bind_once(b)


def free_persistent(operation) -> None:
    """Give back a persistent operation's requests and work memory (an active one completes
    first); idempotent."""
    if operation._active:
        operation.wait()
    b = operation.run
    b.program = None
    b.operation = None
    _cache.unbind(b)
    b.release()


def _schedule(b, ctx, pipelined):
    """The schedule of ``b`` on ``ctx``, cached per call shape on the context; a pipeline of
    chunks (algorithms.pipeline) where the call is blocking, large and across nodes."""
    call = b.call
    counts = (b.total,) if call.collective == "allreduce" else call.counts
    displs = (0,) if call.collective == "allreduce" else call.displs
    commutative = True if b.red0 is None else b.red0.commutative
    itemsize = b.msg.dtype.itemsize
    nbytes = b.total * itemsize
    shape = _executor.shape_of(ctx, b.total, counts, displs, itemsize, b.in_place,
                               commutative, b.accumulate,
                               ctx.segment_window(call.collective, b.name, nbytes, b.auto),
                               b.staged)
    if b.region is not None:  # node memory: its slot (engine.intranode)
        shape = _intranode.shape(ctx, shape, b.msg.backend, b.region, itemsize)
    name = b.name
    build, key = _select.builder(call.collective, name), name
    # (a pipeline runs across nodes only: on one node the transform is not consulted)
    if pipelined and len(set(shape.nodes)) > 1 \
            and _pipeline.applies(call.collective, name, shape, nbytes):
        # (each chunk's messages take a tag of their own: at most the blocking calls')
        chunks = min(_pipeline.chunks_of(call.collective, name, shape, nbytes), _executor.CHUNKS)
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
