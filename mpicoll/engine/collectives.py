"""Start a validated collective: pick the algorithm, set up transport, run its schedule.

Both public layers (the drop-in :class:`mpicoll.Comm` and the array functions)
validate their arguments into :class:`~mpicoll.core.message.Msg` objects and then
call the ``start_*`` functions here (non-blocking and persistent operations)
or the ``run_*`` functions (blocking: an operation started and waited for);
nothing below this point raises for bad user input.

This is also the one hook for reliability and observability (observe.calls):
when the check, a timeout, ``mpicoll.traffic()`` or ``mpicoll.trace()`` is
on, each start agrees on the call fingerprint across ranks before any payload
message and runs the schedule on an observed channel.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.schedule import DST, SRC, packed
from ..core import config as _config
from ..core import types as _types
from ..core.message import Msg
from ..observe import calls as _observe
from ..observe import check as _check
from . import context as _context
from . import executor as _executor
from . import intranode as _intranode
from . import plan as _plan
from . import select as _select
from .executor import Operation


class _Run:
    """What one collective's operation runs with: :meth:`begin` sets up one start (the
    operation's steps, channel, reducer, observation), :meth:`ended` closes it."""

    __slots__ = ("name", "build", "ctx", "comm", "collective", "label", "msg", "total",
                 "counts", "displs", "op", "red0", "timeout", "check", "blocking", "tag",
                 "src", "dst", "in_place", "schedule", "lease", "steps", "ch", "be", "red",
                 "stage", "program", "observed", "timed", "operation", "accumulate", "auto",
                 "staged", "region", "__weakref__")

    def begin(self, operation) -> None:
        """Set ``operation`` up for one start (it has not sent anything yet)."""
        ctx = self.ctx
        ctx.seq += 1
        msg = self.msg
        be = msg.backend
        nbytes = self.total * msg.dtype.itemsize
        # small device calls on the staging path run the host algorithm on one
        # pinned copy (see backends.devices.WholeStage)
        whole = getattr(be, "whole_stage", None)
        if self.region is not None and _intranode.uses(self.schedule):  # (node memory: on the device)
            whole = None
        stage = self.stage = None if whole is None else whole(
            ctx, nbytes, msg, self.op if self.red0 is not None else None)
        if stage is not None:
            ch, run_be, red = stage.channel, stage.backend, stage.reducer
        else:
            ch = None if self.region is None else \
                _intranode.channel(ctx, be, msg.mpitype, self.schedule)  # (node memory)
            ch, run_be, red = ch or be.channel(ctx, msg.mpitype), be, self.red0
        if self.tag != _executor.TAG:
            _set_tag(ch, self.tag)
        call = _observe.begin(ctx, self.label, self.collective, self.name, msg, self.total,
                              self.counts, self.displs, self.op, self.timeout, self.check)
        self.observed = call is not None or stage is not None
        # observed for its timeout alone: the call may keep a timed plan (engine.plan)
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
            sched = self.schedule
            if call is not None:
                call.use_schedule(sched)
            # a persistent operation's steps are bound once, unless they point at a
            # stage's pinned copies or an observed channel
            if self.steps is None or stage is not None or call is not None:
                self._bind(sched, src, dst)
        except BaseException:
            if call is not None:
                call.end(True)
            self.stage = None
            raise
        operation.steps, operation.ch, operation.be, operation.red = self.steps, ch, run_be, red
        operation.call = call
        self.ch, self.be, self.red = ch, run_be, red

    def _writes_all(self, dst) -> bool:
        """Whether the call writes every element of ``dst`` (not: an AllGather whose
        blocks leave gaps, or end before ``dst`` does)."""
        return self.collective != "allgather" or (
            packed(self.counts, self.displs) and sum(self.counts) == dst.size)

    def _bind(self, sched, src, dst):
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if sched.work:
            self.lease = self.ctx.work.lease(self.msg.backend if self.stage is None
                                             else self.stage.backend)
        views = _executor.work_views(sched, self.lease, dst.dtype) if sched.work else {}
        if self.region is not None:  # node memory (transport.shared)
            views.update(_intranode.views(self.ctx, self.msg.backend, self.region, sched, dst.dtype))
        views[DST] = dst
        views[SRC] = dst if src is None else src
        self.steps = _executor.bind(sched, views)

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


def _start(comm, collective, algorithm, msg, total, *, src, dst, in_place, red=None, op=None,
           counts=None, displs=None, timeout=None, label=None, persistent=False,
           blocking=False, memo=None, accumulate=None) -> Operation:
    """Choose the algorithm, set up the context; start the operation unless persistent.

    ``total`` is the element count selection and the fingerprint use: the
    array reduced (AllReduce), the whole input (ReduceScatter) or the whole
    output (AllGather).  ``label`` names the call where it is not ``collective``.
    ``memo``: (function name, its arguments, flat) of a public call that may be
    kept as a plan (engine.plan) if it turns out plain.  ``accumulate``: the
    wider dtype an algorithm of :data:`ACCUMULATING` folds in (``red`` is its
    reducer; messages carry ``msg``'s type), or None.
    """
    label = label or collective
    ctx = _context.existing(comm)
    env = ctx.env if ctx is not None else _config.read_environment()
    opts = _config.resolve(env)
    if timeout is None:
        timeout = opts["timeout"]
    size = comm.Get_size()
    commutative = True if red is None else red.commutative
    nbytes = total * msg.dtype.itemsize
    per_step = getattr(msg.backend, "stages_per_step", None)  # device arrays (see engine.select)
    staged = per_step is not None and per_step(nbytes)
    # (chosen before the set-up, so a bad explicit algorithm raises before any message)
    name = _select.choose(collective, algorithm, nbytes, size, commutative, staged=staged,
                          forced=opts["algorithm"])
    if accumulate is not None and name not in ACCUMULATING:
        raise ValueError(f"algorithm: {name!r} cannot fold in {accumulate}; "
                         f"use one of {', '.join(sorted(ACCUMULATING))}")
    if ctx is None:
        # the first call on comm sets it up, under the call's timeout
        ctx = _context.context(comm, timeout, lambda: (
            f"{label} #1 ({name}, {total} x {_check.dtype_label(msg)})", label, name), env)
    _observe.check_usable(ctx)
    if algorithm == "auto":  # with what the context knows: its selection and node layout
        name = _select.choose_on(ctx, collective, algorithm, nbytes, commutative, staged)
    # node memory (transport.shared): a shared algorithm, its region set up
    name, region = _intranode.choose(
        ctx, collective, algorithm, name, nbytes, msg.backend, commutative,
        blocking or msg.backend.name != "numpy", persistent, timeout,
        lambda: (f"{label} #{ctx.seq + 1} ({name}, {total} x {_check.dtype_label(msg)})",
                 label, name), accumulate)
    if blocking and name != "ring" and not (in_place and collective == "reduce_scatter") \
            and nbytes >= PIPELINE_BYTES and msg.backend.name == "numpy" \
            and len(set(ctx.nodes)) > 1 and (counts is None or min(counts) >= 2):
        return _pipelined(comm, collective, name, label, msg, src, dst, in_place, red, op,
                          counts, displs, timeout, accumulate, nbytes)
    run = _Run()
    run.name, run.ctx, run.collective, run.label, run.comm = name, ctx, collective, label, comm
    run.auto = algorithm == "auto"
    run.staged = staged  # (its schedule's messages: at most a segment each, Shape.staged)
    run.build = _select.builder(collective, name)
    run.msg, run.total, run.counts, run.displs, run.op = msg, total, counts, displs, op
    run.red0, run.accumulate = red, accumulate
    # Device arrays: every operation runs to the end when it starts.  Their
    # transport (staging pool, pinned whole-call copy, the compute stream's
    # ordering of one call after the other; backends.devices) serves one call
    # at a time per context, so operations on them never overlap.
    device = msg.backend.name != "numpy"
    run.timeout, run.check = timeout, bool(opts["check"])
    run.blocking = blocking or device
    run.src, run.dst, run.in_place = src, dst, in_place
    run.lease = run.steps = run.stage = run.program = None
    run.timed = False
    run.region = region
    run.schedule = _schedule(run, ctx, msg)
    if run.blocking:
        run.tag = _executor.TAG
    elif persistent:
        # a tag of its own for the operation's life, from the persistent half of the
        # tags (every rank creates persistent operations in the same order)
        ctx.persistent_made += 1
        run.tag = _executor.tag_of(ctx.persistent_made, ctx.tag_ub, persistent=True)
    else:
        run.tag = _executor.tag_of(ctx.seq + 1, ctx.tag_ub)  # begin() takes this call number
    operation = Operation((), None, None, None, run=run, ctx=None if run.blocking else ctx,
                          persistent=persistent, algorithm=name)
    operation.progress = _config.get("progress")  # (process-wide: api.requests's thread)
    # (persistent only: a run and its operation referring to each other form a cycle,
    # which keeps the call's arrays alive until the cyclic collector runs; a persistent
    # operation holds its buffers until Free anyway, which breaks it)
    run.operation = operation if persistent else None
    if not persistent:
        run.begin(operation)
        _intranode.claim(ctx, region, operation)  # (its region's previous operation done)
        operation.go(run.blocking)
        if memo is not None and _plain(run, operation):
            if blocking:
                _plan.keep(ctx, comm, memo, run)
            else:
                _plan.keep_started(ctx, comm, memo, run)
    return operation


# A blocking collective across nodes from this size runs as a pipeline of chunks
# (_pipelined): PIPELINE_CHUNKS of at least PIPELINE_CHUNK_BYTES, PIPELINE_DEPTH in
# flight; every algorithm but the ring, which pipelines its own segments, and not a
# ReduceScatter in place (its result overwrites the start of the input: part c of
# block 0, which another chunk still reads).  The sizes are
# the emulated cluster's best (docs/performance.md, "Pipelines across nodes"): deeper
# or finer gained nothing there, 2 in flight lost at 16 MiB.
PIPELINE_BYTES = 2 << 20
# A ReduceScatter whose schedule is an AllReduce of the input's span (from 0 to the last
# block's end) into a work array, then a copy of this rank's block: as chunks of its
# blocks each chunk would move the whole span (32x the bytes), so the pipeline cuts the
# span, each chunk an AllReduce of the same algorithm into the work array.
SPAN = frozenset({("reduce_scatter", "recursive_doubling")})
PIPELINE_CHUNKS = 32
PIPELINE_CHUNK_BYTES = 512 << 10
PIPELINE_DEPTH = 4


def _pipelined(comm, collective, name, label, msg, src, dst, in_place, red, op, counts,
               displs, timeout, accumulate, nbytes):
    """A blocking collective as a pipeline: cut into chunks, each its own non-blocking
    call of algorithm ``name`` (its own tag), ``PIPELINE_DEPTH`` in flight.

    One operation runs its steps in turn, and the link across nodes idles while it
    reduces, copies, or (hierarchical) works inside the node.  With several chunks in
    flight, waiting for the oldest advances the others (the progress rule,
    engine.executor): one chunk's messages cross the link while the next is reduced.
    AllReduce cuts the array; ReduceScatter and AllGather cut every rank's block alike
    (chunk c: part c of each block, at its place in the input or output), so each chunk
    is an ordinary vector call on the same buffers; a ReduceScatter of :data:`SPAN` cuts
    its input's span instead, each chunk an AllReduce into one work array, and copies
    this rank's block out of it at the end.  Each chunk is a call of
    its own of the same algorithm, so results are bitwise equal across ranks as that
    algorithm's are.  Returns the last chunk's operation (its ``algorithm`` names the
    call's)."""
    chunks = max(2, min(PIPELINE_CHUNKS, nbytes // PIPELINE_CHUNK_BYTES))
    rank = comm.Get_rank()
    span = (collective, name) in SPAN
    if span:
        total = max(d + k for d, k in zip(displs, counts))
        chunks = min(chunks, total)
        # the whole span reduced, from the context's work memory as one call's work array
        # is (a new array per call, 64 MiB of fresh pages at 64 MiB: 1.19x the link model
        # against 1.11x at 2 nodes x 2, docs/performance.md)
        lease = _context.existing(comm).work.lease(msg.backend)
        whole = lease.take(dst.dtype, total, "whole result")
    elif counts is not None:
        chunks = min(chunks, min(counts))

    def part(arr, a, b):
        return Msg(arr[a:b], msg.dtype, msg.category, msg.mpitype, msg.typename, msg.backend,
                   optype=msg.optype)

    def start(c):
        if span:
            a, b = total * c // chunks, total * (c + 1) // chunks
            out = part(whole, a, b)
            return _start(comm, "allreduce", name, out, b - a, red=red, op=op, src=src[a:b],
                          dst=out.array, in_place=False, timeout=timeout, label=label,
                          accumulate=accumulate)
        if collective == "allreduce":
            n = len(dst)
            a, b = n * c // chunks, n * (c + 1) // chunks
            out = part(dst, a, b)
            return _start(comm, collective, name, out, b - a, red=red, op=op,
                          src=out.array if in_place else src[a:b], dst=out.array,
                          in_place=in_place, timeout=timeout, label=label,
                          accumulate=accumulate)
        # chunk c of block r: elements counts[r]*c//chunks .. counts[r]*(c+1)//chunks of it
        lo = [k * c // chunks for k in counts]
        cc = tuple(k * (c + 1) // chunks - x for k, x in zip(counts, lo))
        cd = tuple(d + x for d, x in zip(displs, lo))
        mine = slice(lo[rank], lo[rank] + cc[rank])
        if collective == "reduce_scatter":  # (out of place: see _start)
            return _start(comm, collective, name, part(dst, mine.start, mine.stop), sum(cc),
                          red=red, op=op, counts=cc, displs=cd, src=src, dst=dst[mine],
                          in_place=False, timeout=timeout, label=label, accumulate=accumulate)
        return _start(comm, collective, name, msg, sum(cc), counts=cc, displs=cd,
                      src=None if in_place else src[mine], dst=dst, in_place=in_place,
                      timeout=timeout, label=label)

    started = []
    for c in range(chunks):
        if len(started) >= PIPELINE_DEPTH:
            started.pop(0).wait()
        started.append(start(c))
    for operation in started:
        operation.wait()
    if span:
        np.copyto(dst, whole[displs[rank]:displs[rank] + counts[rank]])
        # (only now: after a failure a chunk still in flight may write into it)
        lease.release()
    return started[-1]


def _plain(run, operation, timed=True) -> bool:
    """Whether a started call may be kept as a plan: host arrays on the plain host channel,
    unobserved or (``timed``) observed for a timeout alone (engine.plan)."""
    if operation.error is not None or run.msg.backend.name != "numpy":
        return False
    if not _intranode.plain(run):  # (node memory: engine.intranode)
        return False
    if not run.observed:
        return type(run.ch) is _executor.Channel
    return timed and run.timed and type(run.ch.inner) is _executor.Channel


def start_persistent(operation) -> None:
    """Start a persistent operation again on its buffers' current contents."""
    run = operation.run
    _observe.check_usable(run.ctx)
    if run.program is not None and not _observe.observing():
        _intranode.claim(run.ctx, run.region, operation)  # (node memory)
        run.ctx.seq += 1  # every start is a call
        operation.steps, operation.ch, operation.red, operation.be = run.program
        operation.call = None
        operation.go(False)
        return
    run.begin(operation)
    _intranode.claim(run.ctx, run.region, operation)  # (node memory)
    operation.go(False)
    if run.program is None and _plain(run, operation, timed=False):
        # its later starts run on persistent requests (bound once: the buffers are fixed)
        steps, requests = _executor.compile_bound(run.steps, run.ch, run.red, run.be)
        if steps is not None:
            run.program = (steps, run.ch, run.red, run.be)
            _executor.hold(run, requests)
            run.ctx.programs.add(run)


def free_persistent(operation) -> None:
    """Give back a persistent operation's requests and work memory (an active one completes
    first); idempotent."""
    if operation._active:
        operation.wait()
    run = operation.run
    run.program = None
    run.operation = None
    _executor.unhold(run)
    run.release()


def drop_programs(ctx) -> None:
    """Free the programs of the inactive persistent operations of ``ctx`` (its communicator
    is freed or unusable); their later starts take the general path."""
    for run in list(ctx.programs):
        if run.operation is not None and run.operation._active:
            continue  # its current start runs on them; they go with Free or at exit
        run.program = None
        _executor.unhold(run)
    ctx.programs.clear()


def _schedule(run, ctx, msg):
    """The schedule of ``run`` on ``ctx``, cached per call shape on the context."""
    counts = (run.total,) if run.collective == "allreduce" else run.counts
    displs = (0,) if run.collective == "allreduce" else run.displs
    commutative = True if run.red0 is None else run.red0.commutative
    itemsize = msg.dtype.itemsize
    shape = _executor.shape_of(ctx, run.total, counts, displs, itemsize, run.in_place,
                               commutative, run.accumulate,
                               ctx.segment_window(run.collective, run.name,
                                                  run.total * itemsize, run.auto), run.staged)
    if run.region is not None:  # node memory: its slot (transport.shared)
        shape = _intranode.shape(ctx, shape, msg.backend, run.region, itemsize)
    return ctx.schedule(run.collective, run.name, run.build, shape)


# Algorithms whose reductions all happen where the result is kept, so they can fold in a
# wider type than the one their messages carry (algorithms.schedule.Shape.accumulate).
ACCUMULATING = frozenset({"direct"})


def reducer(msg, op, accumulate=None):
    """The reducer of ``op`` on ``msg``'s elements, or (``accumulate``: a dtype) of a
    predefined op folding into that type (its operands: an accumulator and ``msg``'s type)."""
    if accumulate is not None:
        return msg.backend.reducer(op, _types.natural_type(accumulate), "floating")
    # msg.optype: user-defined ops see the datatype mpi4py would pass, not the wire type
    return msg.backend.reducer(op, msg.optype, msg.category)


def start_allreduce(comm, smsg, rmsg, op, algorithm="auto", *, timeout=None, persistent=False,
                    memo=None, _blocking=False, accumulate=None) -> Operation:
    """``rmsg`` <- reduction of every rank's ``smsg`` (None: in place in ``rmsg``).

    ``accumulate``: a wider floating dtype that the result is folded in and rounded from
    once, with messages in ``rmsg``'s type (an algorithm of :data:`ACCUMULATING`).
    """
    return _start(comm, "allreduce", algorithm, rmsg, rmsg.count,
                  red=reducer(rmsg, op, accumulate), op=op,
                  src=rmsg.array if smsg is None else smsg.array, dst=rmsg.array,
                  in_place=smsg is None, timeout=timeout, persistent=persistent,
                  blocking=_blocking, memo=memo, accumulate=accumulate)


def start_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto", *, timeout=None,
                         persistent=False, memo=None, _blocking=False,
                         accumulate=None) -> Operation:
    """``rmsg`` <- this rank's block of the reduction; ``smsg`` None: input in ``rmsg``'s buffer.

    In place, ``rmsg.array`` is the whole input and the result goes to its start.
    ``accumulate``: as for :func:`start_allreduce`.
    """
    counts, displs = tuple(counts), tuple(displs)
    if smsg is None:
        src, dst = rmsg.array, rmsg.array[: counts[comm.Get_rank()]]
    else:
        src, dst = smsg.array, rmsg.array
    return _start(comm, "reduce_scatter", algorithm, rmsg, sum(counts),
                  red=reducer(rmsg, op, accumulate), op=op, counts=counts, displs=displs,
                  src=src, dst=dst, in_place=smsg is None, timeout=timeout,
                  persistent=persistent, blocking=_blocking, memo=memo, accumulate=accumulate)


def start_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto", *, timeout=None,
                    persistent=False, memo=None, _blocking=False, _label=None) -> Operation:
    """``rmsg`` block r (``counts[r]`` at ``displs[r]``) <- rank r's ``smsg`` (None: in place)."""
    counts, displs = tuple(counts), tuple(displs)
    return _start(comm, "allgather", algorithm, rmsg, sum(counts), counts=counts, displs=displs,
                  src=None if smsg is None else smsg.array, dst=rmsg.array,
                  in_place=smsg is None, timeout=timeout, label=_label, persistent=persistent,
                  blocking=_blocking, memo=memo)


def run_allreduce(comm, smsg, rmsg, op, algorithm="auto", *, timeout=None, memo=None,
                  accumulate=None):
    """Blocking :func:`start_allreduce`; returns the algorithm's name.

    ``memo``: (name, argument objects) of a public function whose arrays are
    ``smsg``/``rmsg`` themselves: the call is kept as that function's plan.
    """
    return start_allreduce(comm, smsg, rmsg, op, algorithm, timeout=timeout, memo=memo,
                           _blocking=True, accumulate=accumulate).algorithm


def run_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto", *, timeout=None,
                       memo=None, accumulate=None):
    """Blocking :func:`start_reduce_scatter`; returns the algorithm's name."""
    return start_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm, timeout=timeout,
                                memo=memo, _blocking=True, accumulate=accumulate).algorithm


def run_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto", *, timeout=None,
                  label=None, memo=None):
    """Blocking :func:`start_allgather`; returns the algorithm's name."""
    return start_allgather(comm, smsg, rmsg, counts, displs, algorithm, timeout=timeout,
                           memo=memo, _blocking=True, _label=label).algorithm
