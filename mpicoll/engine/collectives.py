"""Start a validated collective: pick the algorithm, set up transport, run its schedule.

Both public layers (the drop-in :class:`mpicoll.Comm` and the array functions)
validate their arguments into :class:`~mpicoll.core.message.Msg` objects and then
call the ``start_*`` functions here (non-blocking and persistent operations)
or the ``run_*`` functions (blocking: ``start_*(...).wait()``, without the
per-operation tag); nothing below this point raises for bad user input.

This is also the one hook for reliability and observability (observe.calls):
when ``MPICOLL_CHECK``, a timeout, ``mpicoll.traffic()`` or ``mpicoll.trace()``
is on, each start agrees on the call fingerprint across ranks before any
payload message and runs the schedule on an observed channel.

Algorithms with a schedule builder (engine.select.BUILDERS) run on the
executor (engine.executor); the others still run as functions, to the end,
when the operation starts.
"""

from __future__ import annotations

from ..algorithms.schedule import DST, SRC
from ..core import config as _config
from ..observe import calls as _observe
from ..observe import check as _check
from . import context as _context
from . import executor as _executor
from . import plan as _plan
from . import select as _select
from .executor import Operation


class _Run:
    """What one operation runs with; :meth:`begin` sets up one start, :meth:`end` closes it."""

    __slots__ = ("name", "fn", "build", "ctx", "comm", "collective", "label", "msg", "smsg", "total",
                 "counts", "displs", "op", "red", "timeout", "check", "blocking", "tag",
                 "src", "dst", "in_place", "schedule", "lease", "bound", "nops", "ch", "be",
                 "call", "stage", "observed", "plannable", "_red0")

    def begin(self):
        """Set up one start: bound ops to run, or None once a schedule-less algorithm ran."""
        ctx = self.ctx
        ctx.seq += 1
        msg = self.msg
        be = msg.backend
        nbytes = self.total * msg.dtype.itemsize
        # small device calls on the staging path run the host algorithm on one
        # pinned copy (see backends.devices.WholeStage)
        whole = getattr(be, "whole_stage", None)
        stage = self.stage = None if whole is None else whole(ctx, nbytes, msg, self.op
                                                              if self._red0 is not None else None)
        if stage is not None:
            ch, run_be, red = stage.channel, stage.backend, stage.reducer
        else:
            ch, run_be, red = be.channel(ctx, msg.mpitype), be, self._red0
        if self.tag != _executor.TAG:
            _set_tag(ch, self.tag)
        call = self.call = _observe.begin(ctx, self.label, self.collective, self.name, msg,
                                          self.total, self.counts, self.displs, self.op,
                                          self.timeout, self.check)
        self.observed = call is not None or stage is not None
        if call is not None:
            if self.check:
                call.check(_executor.run_on)
            ch, run_be, red = call.wrap(ch, run_be, red)
        self.ch, self.be, self.red = ch, run_be, red
        be.prepare()
        src, dst = self.src, self.dst
        if stage is not None:
            src, dst = stage.enter(src, dst)
        if self.fn is not None:
            self._call_fn(src, dst)
            return None
        if self.schedule is None:
            self.schedule = _schedule(self, ctx, msg)
        sched = self.schedule
        if call is not None:
            call.use_schedule(sched)
        # bound ops are reused by a persistent operation's next start unless
        # they point at a stage's pinned copies or fused ops of another channel
        if self.bound is None or stage is not None or call is not None:
            self._bind(sched, src, dst, ch, run_be)
        return self.bound

    def _bind(self, sched, src, dst, ch, run_be):
        if self.lease is not None:
            self.lease.release()
            self.lease = None
        if sched.work:
            self.lease = self.ctx.work.lease(run_be)
        views = _executor.work_views(sched, self.lease, dst.dtype) if sched.work else {}
        views[DST] = dst
        views[SRC] = dst if src is None else src
        fuse = ch if self.blocking and type(ch) is _executor.Channel else None
        self.bound = _executor.bind(sched, views, fuse)
        self.nops = len(sched.ops)

    def _call_fn(self, src, dst):
        self.fn(*self.fnargs(src, dst))

    def fnargs(self, src=None, dst=None) -> tuple:
        """The arguments of the algorithm function (default: the call's own arrays)."""
        if src is None and dst is None:
            src, dst = self.src, self.dst
        if self.collective == "allreduce":
            return (self.ctx, self.ch, self.be, self.red, src, dst)
        if self.collective == "reduce_scatter":
            return (self.ctx, self.ch, self.be, self.red, src, dst, self.counts, self.displs)
        return (self.ctx, self.ch, self.be, None if self.in_place else src, dst,
                self.counts, self.displs)

    def end(self, failed: bool, release: bool = True) -> None:
        try:
            if not failed:
                if self.stage is not None:
                    self.stage.leave()
                self.msg.backend.finish()
        finally:
            if self.call is not None:
                self.call.end(failed)
                self.call = None
            if self.stage is not None:
                self.stage = None
                self.bound = None  # bound to the stage's pinned copies
            if failed:
                self.bound = None
            if release:
                self.release()

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None
            self.bound = None


def _set_tag(ch, tag):
    """Give the host channel under ``ch`` (device channels wrap one as ``inner``) the tag."""
    while ch is not None:
        if isinstance(ch, _executor.Channel):
            ch.tag = tag
            return
        ch = getattr(ch, "inner", None)


def _schedule(run, ctx, msg):
    """The schedule of ``run`` on ``ctx``, cached per call shape on the context."""
    counts = (run.total,) if run.collective == "allreduce" else run.counts
    displs = (0,) if run.collective == "allreduce" else run.displs
    commutative = True if run._red0 is None else run._red0.commutative
    shape = _executor.shape_of(ctx, run.total, counts, displs, msg.dtype.itemsize, run.in_place,
                               commutative)
    return ctx.schedule(run.collective, run.name, run.build, shape)


def _start(comm, collective, algorithm, msg, total, *, src, dst, in_place, red=None, op=None,
           counts=None, displs=None, timeout=None, label=None, persistent=False,
           blocking=False, memo=None) -> Operation:
    """Choose the algorithm, set up the context; start the operation unless persistent.

    ``total`` is the element count selection and the fingerprint use: the
    array reduced (AllReduce), the whole input (ReduceScatter) or the whole
    output (AllGather).  ``label`` names the call where it is not ``collective``.
    """
    size = comm.Get_size()
    commutative = True if red is None else red.commutative
    nbytes = total * msg.dtype.itemsize
    per_step = getattr(msg.backend, "stages_per_step", None)  # device arrays (see engine.select)
    name, entry = _select.choose(collective, algorithm, nbytes, size, commutative,
                                 staged=per_step is not None and per_step(nbytes))
    if timeout is None:
        timeout = _config.get("timeout")  # a bad MPICOLL_* value raises before anything starts
    check = bool(_config.get("check"))
    label = label or collective
    # the first call on comm sets it up, under the call's timeout
    ctx = _context.context(comm, timeout, lambda: (
        f"{label} #1 ({name}, {total} x {_check.dtype_label(msg)})", label, name))
    _observe.check_usable(ctx)
    if algorithm == "auto" and _select.spans_nodes(ctx.nodes):  # the layout is known from here on
        name, entry = _select.choose(collective, algorithm, nbytes, size, commutative,
                                     staged=per_step is not None and per_step(nbytes), nodes=ctx.nodes)
    run = _Run()
    run.name, run.ctx, run.collective, run.label = name, ctx, collective, label
    run.comm = comm
    build = _select.builder(collective, name)
    run.build, run.fn = build, (None if build is not None else entry)
    run.msg, run.total, run.counts, run.displs, run.op = msg, total, counts, displs, op
    run._red0 = red
    # run_* (the caller may keep it as a plan), or a non-blocking start with a memo
    # (kept for its repeat if it turns out plain, see _kept): engine.plan
    keep = memo is not None and not persistent
    run.plannable = blocking or keep
    # Device arrays: every operation runs to the end when it starts.  Their
    # transport (staging pool, pinned whole-call copy, the compute stream's
    # ordering of one call after the other; backends.devices) serves one call
    # at a time per context, so operations on them never overlap.
    blocking = blocking or msg.backend.name != "numpy"
    run.timeout, run.check, run.blocking = timeout, check, blocking
    run.src, run.dst, run.in_place = src, dst, in_place
    run.schedule = run.lease = run.bound = run.call = run.stage = None
    run.observed = False
    run.nops = 0
    if blocking:
        run.tag = _executor.TAG
    elif persistent:
        # a tag of its own for the operation's life, from the persistent half of the
        # tags (every rank creates persistent operations in the same order)
        ctx.persistent_made += 1
        run.tag = _executor.tag_of(ctx.persistent_made, ctx.tag_ub, persistent=True)
    else:
        run.tag = _executor.tag_of(ctx.seq + 1, ctx.tag_ub)  # begin() takes this call number
    operation = Operation(run, persistent)
    if not persistent:
        with _executor.LOCK:  # the progress thread may be advancing others
            operation._begin(blocking)
        if keep:
            _kept(operation, memo)
    return operation


def _kept(operation, memo) -> None:
    """After a non-blocking start with ``memo``: keep the operation for the call's repeat
    (engine.plan) when it is plain, as a blocking call is kept (:func:`_finished`)."""
    run = operation._run
    if not run.observed and run.msg.backend.name == "numpy" and run.bound is not None \
            and _observe.quiet():
        _plan.keep_started(run.ctx, run.comm, memo[0], memo[1], operation)
    else:
        run.plannable = False  # its work memory goes back when it ends
        if not operation._active:
            run.release()


def reducer(msg, op):
    # msg.optype: user-defined ops see the datatype mpi4py would pass, not the wire type
    return msg.backend.reducer(op, msg.optype, msg.category)


def start_allreduce(comm, smsg, rmsg, op, algorithm="auto", *, timeout=None, persistent=False,
                    memo=None, _blocking=False) -> Operation:
    """``rmsg`` <- reduction of every rank's ``smsg`` (None: in place in ``rmsg``).

    ``memo`` (non-blocking): (name, argument objects) of a public function whose
    arrays are ``smsg``/``rmsg`` themselves: the operation is kept for that call's
    repeat (engine.plan.restart).
    """
    return _start(comm, "allreduce", algorithm, rmsg, rmsg.count, red=reducer(rmsg, op), op=op,
                  src=rmsg.array if smsg is None else smsg.array, dst=rmsg.array,
                  in_place=smsg is None, timeout=timeout, persistent=persistent,
                  blocking=_blocking, memo=memo)


def start_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto", *, timeout=None,
                         persistent=False, memo=None, _blocking=False) -> Operation:
    """``rmsg`` <- this rank's block of the reduction; ``smsg`` None: input in ``rmsg``'s buffer.

    In place, ``rmsg.array`` is the whole input and the result goes to its start.
    """
    counts, displs = tuple(counts), tuple(displs)
    if smsg is None:
        src, dst = rmsg.array, rmsg.array[: counts[comm.Get_rank()]]
    else:
        src, dst = smsg.array, rmsg.array
    return _start(comm, "reduce_scatter", algorithm, rmsg, sum(counts), red=reducer(rmsg, op),
                  op=op, counts=counts, displs=displs, src=src, dst=dst, in_place=smsg is None,
                  timeout=timeout, persistent=persistent, blocking=_blocking, memo=memo)


def start_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto", *, timeout=None,
                    persistent=False, memo=None, _blocking=False, _label=None) -> Operation:
    """``rmsg`` block r (``counts[r]`` at ``displs[r]``) <- rank r's ``smsg`` (None: in place)."""
    counts, displs = tuple(counts), tuple(displs)
    return _start(comm, "allgather", algorithm, rmsg, sum(counts), counts=counts, displs=displs,
                  src=None if smsg is None else smsg.array, dst=rmsg.array,
                  in_place=smsg is None, timeout=timeout, label=_label, persistent=persistent,
                  blocking=_blocking, memo=memo)


def _finished(operation, memo) -> str:
    """After a blocking call: keep it as a plan (engine.plan) when ``memo`` and plain."""
    run = operation._run
    if memo is not None and not run.observed and run.msg.backend.name == "numpy" \
            and _observe.quiet():
        _plan.keep(run.ctx, run.comm, memo[0], memo[1], run)
    else:
        run.release()
    return operation.algorithm


def run_allreduce(comm, smsg, rmsg, op, algorithm="auto", *, timeout=None, memo=None):
    """Blocking :func:`start_allreduce`; returns the algorithm's name.

    ``memo``: (name, argument objects) of a public function whose arrays are
    ``smsg``/``rmsg`` themselves: the call is kept as that function's plan.
    """
    return _finished(start_allreduce(comm, smsg, rmsg, op, algorithm, timeout=timeout,
                                     _blocking=True), memo)


def run_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm="auto", *, timeout=None,
                       memo=None):
    """Blocking :func:`start_reduce_scatter`; returns the algorithm's name."""
    return _finished(start_reduce_scatter(comm, smsg, rmsg, counts, displs, op, algorithm,
                                          timeout=timeout, _blocking=True), memo)


def run_allgather(comm, smsg, rmsg, counts, displs, algorithm="auto", *, timeout=None,
                  label=None, memo=None):
    """Blocking :func:`start_allgather`; returns the algorithm's name."""
    return _finished(start_allgather(comm, smsg, rmsg, counts, displs, algorithm,
                                     timeout=timeout, _blocking=True, _label=label), memo)


def exchange_counts(comm, count: int) -> tuple[int, ...]:
    """Every rank's ``count`` (metadata for Reduce_scatter without recvcounts)."""
    import numpy as np

    from ..backends.host import NUMPY
    from ..core import types as _types
    from ..core.message import Msg

    size = comm.Get_size()
    out = np.zeros(size, dtype=np.int64)
    mine = np.array([count], dtype=np.int64)
    dt = out.dtype
    info = (_types.category_of_dtype(dt), _types.wire_type(dt), str(dt), NUMPY)
    optype = _types.natural_type(dt)
    run_allgather(comm, Msg(mine, dt, *info, optype=optype), Msg(out, dt, *info, optype=optype),
                  [1] * size, list(range(size)), label="reduce_scatter.recvcounts")
    return tuple(int(c) for c in out)
