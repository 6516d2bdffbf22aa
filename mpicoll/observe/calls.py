"""The observation hook: one :class:`Observed` per observed start, wrapping its channel.

An operation (engine.executor) asks :func:`begin` for an Observed at a start
that is not its plain program.  When nothing is switched on (no check, no
timeout, no traffic counter, no trace) it gets None and the steps run on the
transport's channel untouched.  Otherwise the Observed

* runs the fingerprint check (:mod:`_check`) before any payload message,
* hands the steps an :class:`ObservedChannel` (:meth:`Observed.channel`) that
  counts messages and bytes (:mod:`_traffic`), records send/receive intervals
  (:mod:`_trace`) and, under a timeout, moves long messages windowed so that
  the operation's deadline sees progress piece by piece (:mod:`_timeout`), and,
  when tracing, a reducer and a backend whose ``red``/``copy`` calls are timed,
* hands its counts and events to the active recorders when the start ends.

The deadline itself is the operation's (engine.executor); the words of a
timeout are :func:`timeout_error`'s, one text for every wait that gives up.
Message k of a call is labelled with step, block and segment from the
schedule the call runs (:meth:`Observed.use_schedule`).
"""

from __future__ import annotations

import functools
import itertools
from time import perf_counter

from mpi4py import MPI

from ..core.errors import CollectiveTimeout, MpicollError
from ..transport import channel as _channel
from ..transport import timeout as _timeout
from . import check as _check
from . import trace as _trace
from . import traffic as _traffic

_BROKEN = "mpicoll_unusable"  # Context attribute set after a timeout


def check_usable(ctx) -> None:
    """MpicollError if an earlier collective on this communicator timed out here."""
    why = getattr(ctx, _BROKEN, None)
    if why is not None:
        raise MpicollError(
            f"communicator unusable: {why}; messages of that call may still be in flight, "
            f"so end the job with mpicoll.abort() (see docs/reliability.md)"
        )


def mark_unusable(ctx, why: str) -> None:
    """After a timeout: every later call on ``ctx`` raises (:func:`check_usable`), and no
    remembered call repeats (engine.cache, through the context's ``drop_cache``)."""
    setattr(ctx, _BROKEN, why)
    drop = getattr(ctx, "drop_cache", None)
    if drop is not None:
        drop()


def observing() -> bool:
    """Whether a traffic counter or a trace records calls now (then no call repeats a bound
    call: engine.cache)."""
    return bool(_traffic.ACTIVE or _trace.active())


def begin(ctx, label, collective, algorithm, msg, total, counts, displs, op, timeout, check):
    """An :class:`Observed` for this start, or None when nothing observes it."""
    tracers = _trace.active()
    if timeout is None and not check and not tracers and not _traffic.ACTIVE:
        return None
    return Observed(ctx, label, collective, algorithm, msg, total, counts, displs, op,
                    timeout, tuple(_traffic.ACTIVE), tracers)


def timeout_error(ctx, label, seq, algorithm, what, messages, nsteps, idle, timeout,
                  phase=None) -> CollectiveTimeout:
    """The CollectiveTimeout of a wait that saw no progress for ``idle`` seconds; marks the
    communicator unusable.  ``messages``: (kind, peer, bytes, label or None) of each
    message still pending, a receive named first; ``what``: "N x dtype"; ``phase``:
    "check" for the fingerprint exchange."""
    messages = sorted(messages, key=lambda m: m[0] != "recv")
    kind, peer, nbytes, lab = messages[0] if messages else ("recv", None, 0, None)
    name = peer_name(ctx, peer) if peer is not None else "a peer"
    where = ""
    if lab is not None and phase != "check":
        where = f", step {lab.step} of {nsteps} ({lab.phase}"
        if lab.block is not None:
            where += f", block {lab.block} segment {lab.segment}"
        where += ")"
    if phase == "check":
        doing = f"agreeing on the call fingerprint (MPICOLL_CHECK) with {name}"
    elif kind == "recv":
        doing = f"waiting to receive {nbytes} bytes from {name}{where}"
    else:
        doing = f"waiting for {name} to receive {nbytes} bytes{where}"
    more = len(messages) - 1
    also = f"; {more} more message(s) pending" if more > 0 else ""
    Peer = name[0].upper() + name[1:]
    if phase == "check":
        why = (f"{Peer} has not joined the exchange: it may have skipped this call, be in a "
               f"collective on another communicator, or be stuck or dead")
    else:
        part = "sent its part" if kind == "recv" else "taken this message"
        why = (f"{Peer} has not {part}: it, or a rank it waits for, may have skipped this call, "
               f"called another collective, or be stuck or dead")
    text = (f"{label} #{seq} ({algorithm}, {what}) on rank {ctx.rank}: no progress for "
            f"{idle:.3g} s (timeout {timeout:g} s) while {doing}{also}. {why}. This "
            f"communicator cannot be used again; end the job with mpicoll.abort()")
    mark_unusable(ctx, f"{label} #{seq} timed out on rank {ctx.rank}")
    return CollectiveTimeout(
        text, collective=label, seq=seq, algorithm=algorithm, rank=ctx.rank, peer=peer,
        phase="check" if phase == "check" else kind,
        step=None if lab is None or phase == "check" else lab.step, timeout=timeout)


class Delegated:
    """A call handed to MPI's own collective (api.delegate) as counters and traces see it:
    the algorithm ``"delegated"``, no message of mpicoll's (zero messages and bytes), one
    "collective" interval in a trace.  Delegated calls are numbered among themselves, in
    the order this process made them (``seq``), as they have no mpicoll context."""

    algorithm = "delegated"
    total = wire = 0  # (no payload of mpicoll's: a trace's "bytes" of the call)
    events: tuple = ()
    _made = itertools.count(1)

    def __init__(self, label):
        self.label = label
        self.seq = next(Delegated._made)
        self.recorders = tuple(_traffic.ACTIVE)
        self.tracers = _trace.active()
        self.t0 = perf_counter()

    def end(self, failed: bool) -> None:
        """Hand the call to the recorders active when it started (also after an error)."""
        t1 = perf_counter()
        record = _traffic.CallTraffic(self.label, self.seq, self.algorithm, 0, 0, 0, 0,
                                      None, None)
        for rec in self.recorders:
            rec._add(record)
        for tr in self.tracers:
            tr._add(self, self.t0, t1, failed)


class Req:
    """A request as the observed channel hands it to an algorithm."""

    __slots__ = ("req", "kind", "peer", "nbytes", "k", "t0", "done")

    def __init__(self, req, kind, peer, nbytes, k, t0):
        self.req = req
        self.kind = kind
        self.peer = peer
        self.nbytes = nbytes
        self.k = k        # index among this call's sends (receives)
        self.t0 = t0
        self.done = None  # time completion was seen


class Observed:
    """One start of a collective on one rank, as the check, counters and traces see it."""

    def __init__(self, ctx, label, collective, algorithm, msg, total, counts, displs, op,
                 timeout, recorders, tracers):
        self.ctx = ctx
        self.rank = ctx.rank
        self.size = ctx.size
        self.seq = ctx.seq
        self.label = label              # name users see ("allreduce", ...)
        self.collective = collective    # algorithm family (_select key)
        self.algorithm = algorithm
        self.msg = msg
        self.total = total
        self.counts = counts
        self.displs = displs
        self.op = op
        self.timeout = timeout
        self.recorders = recorders
        self.tracers = tracers
        self.wire = msg.mpitype.Get_size()
        self.nsend = self.nrecv = 0
        self.scounts: list[int] = []    # elements of each send / receive, in issue order
        self.rcounts: list[int] = []
        self.sent = [0, 0]              # messages, bytes completed
        self.received = [0, 0]
        self.events = [] if tracers else None
        self.last_recv = -1
        self.windowed: list = []        # _timeout.Windowed messages still moving (timeout only)
        self.queues: dict = {}          # (kind, peer, chunk) -> Windowed messages not fully posted
        self._schedule = False
        self.t0 = perf_counter()
        self.last_progress = self.t0    # a completion or a piece seen (timeouts under test())

    # -- set-up ---------------------------------------------------------------
    def check(self, run) -> None:
        """Agree on the call fingerprint with every rank (MPICOLL_CHECK).

        ``run(schedule, ctx, ch, be, red, src, dst, timeout, expire)`` runs a
        schedule to the end under this start's deadline (the engine passes its
        executor's run_on; see observe.check.agree).
        """
        if self.size == 1:
            return
        ch = _check.channel(self.ctx)
        what = f"{self.total} x {_check.dtype_label(self.msg)}"

        def expire(messages, idle):
            return timeout_error(self.ctx, self.label, self.seq, self.algorithm, what,
                                 messages, 0, idle, self.timeout, "check")

        t0 = perf_counter()
        try:
            _check.agree(self, ch, functools.partial(run, timeout=self.timeout, expire=expire))
        finally:
            if self.events is not None:
                self.events.append(("check", t0, perf_counter(), None, 0, None, -1))

    def wrap(self, ch, be, red):
        """(channel, backend, reducer) the steps run with: the channel observed, and when
        tracing the backend's copies and the reductions timed."""
        ch = ObservedChannel(ch, self)
        if self.events is not None:
            be = _TimedBackend(be, self)
            red = None if red is None else _TimedReducer(red, self)
        return ch, be, red

    # -- labels ---------------------------------------------------------------
    def use_schedule(self, sched) -> None:
        """Label messages from the schedule the call runs (algorithms.schedule)."""
        self._schedule = _Labels([op.label for op in sched.sends()],
                                 [op.label for op in sched.recvs()], sched.nsteps)
        if not self._matches(self._schedule):
            self._schedule = None

    @property
    def schedule(self):
        """The labels of the schedule the call runs (see :meth:`use_schedule`), else None."""
        return self._schedule or None

    def _matches(self, sched) -> bool:
        for labels, issued in ((sched.sends, self.scounts), (sched.recvs, self.rcounts)):
            if len(issued) > len(labels):
                return False
            if any(lab.count != c for lab, c in zip(labels, issued)):
                return False
        return True

    def label_of(self, kind: str, k: int):
        """The Label (step, phase, block, segment, count) of send/recv ``k``, or None."""
        sched = self.schedule
        if k < 0 or sched is None:
            return None
        seq = sched.sends if kind == "send" else sched.recvs
        return seq[k] if k < len(seq) else None

    def _steps(self, kind: str):
        """Distinct steps in which this rank sent (received) a message, or None if unknown."""
        sched = self.schedule
        if sched is None:
            return None
        labels, n = (sched.sends, self.nsend) if kind == "send" else (sched.recvs, self.nrecv)
        if n != len(labels):
            return None
        return len({lab.step for lab in labels})

    # -- completion -----------------------------------------------------------
    def completed(self, r: Req) -> None:
        tally = self.sent if r.kind == "send" else self.received
        tally[0] += 1
        tally[1] += r.nbytes
        if r.kind == "recv":
            self.last_recv = r.k
        if self.events is not None:
            self.events.append((r.kind, r.t0, r.done, r.peer, r.nbytes, r.kind, r.k))

    def end(self, failed: bool) -> None:
        """Hand counts and events to the recorders (also after an error)."""
        t1 = perf_counter()
        if self.recorders:
            record = _traffic.CallTraffic(
                self.label, self.seq, self.algorithm, self.sent[0], self.sent[1],
                self.received[0], self.received[1],
                self._steps("send"), self._steps("recv"))
            for rec in self.recorders:
                rec._add(record)
        if self.events is not None:
            for tr in self.tracers:
                tr._add(self, self.t0, t1, failed)

class _Labels:
    """The labels of a call's sends and receives, in issue order, and its step count."""

    __slots__ = ("sends", "recvs", "nsteps")

    def __init__(self, sends, recvs, nsteps):
        self.sends, self.recvs, self.nsteps = sends, recvs, nsteps


def peer_name(ctx, peer) -> str:
    """'rank 3', plus its MPI.COMM_WORLD rank when that differs."""
    name = f"rank {peer}"
    if ctx.comm == MPI.COMM_NULL or MPI.Is_finalized():  # (never MPI on a freed handle)
        return name
    mine, world_group = ctx.comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        world = MPI.Group.Translate_ranks(mine, [peer], world_group)[0]
    except MPI.Exception:
        return name
    finally:
        mine.Free()
        world_group.Free()
    if world != peer and world != MPI.UNDEFINED:
        name += f" (world rank {world})"
    return name


class ObservedChannel:
    """Channel wrapper: counts and times every message; under a timeout, moves messages
    longer than a piece windowed (:class:`_timeout.Windowed`), so that the operation's
    deadline sees progress piece by piece."""

    __slots__ = ("inner", "call", "timed", "piece")

    def __init__(self, inner, call: Observed):
        self.inner = inner
        self.call = call
        self.timed = call.events is not None
        # (to another node, to this one): the pieces the channel cuts
        mpitype = call.msg.mpitype
        self.piece = ((_channel.piece_elems(mpitype, False, call.ctx.node_piece),
                       _channel.piece_elems(mpitype, True))
                      if call.timeout is not None else None)

    def _post(self, post, arr, peer, kind, chunk):
        if self.piece is None:
            return post(arr, peer, chunk)
        piece = _channel.peer_piece(peer, self.call.ctx.local, *self.piece)
        queues = self.call.queues
        # (messages of one tag match in order: one queue per kind, peer and chunk)
        key = (kind, peer, chunk)
        queue = queues.get(key)
        if len(arr) <= piece and not queue:
            return post(arr, peer, chunk)
        if queue is None:
            queue = queues[key] = []
        if chunk:
            post = functools.partial(_post_in, post, chunk)
        w = _timeout.Windowed(post, arr, peer, piece, kind, queue)
        self.call.windowed.append(w)
        return w

    def isend(self, arr, dest, chunk=0):
        c = self.call
        t0 = perf_counter() if self.timed else 0.0
        req = self._post(self.inner.isend, arr, dest, "send", chunk)
        k = c.nsend
        n = len(arr)
        c.nsend = k + 1
        c.scounts.append(n)
        return Req(req, "send", dest, n * c.wire, k, t0)

    def irecv(self, arr, source, chunk=0):
        c = self.call
        t0 = perf_counter() if self.timed else 0.0
        req = self._post(self.inner.irecv, arr, source, "recv", chunk)
        k = c.nrecv
        n = len(arr)
        c.nrecv = k + 1
        c.rcounts.append(n)
        return Req(req, "recv", source, n * c.wire, k, t0)

    def wait(self, r) -> None:
        self._complete((r,))

    def testall(self, reqs) -> bool:
        """Advance ``reqs`` without blocking (no timeout here); True when all are complete."""
        left = [r for r in reqs if r.done is None]
        if left:
            test = _timeout.tester(left, getattr(self.inner, "test", None), self.call.windowed)
            if test is None:
                return True  # cannot be polled: the next waitall blocks
            done, progress = test(left)
            now = perf_counter()
            if done or progress:
                self.call.last_progress = now
            for i in done:
                left[i].done = now
            if len(done) < len(left):
                return False
        return True

    def waitall(self, reqs) -> None:
        if reqs:
            self._complete(reqs)

    def _complete(self, reqs) -> None:
        """Finish ``reqs`` (complete already where the operation polled them under its
        deadline; else this blocks in the inner channel) and count them."""
        c = self.call
        inner = []
        for r in reqs:
            if type(r.req) is _timeout.Windowed:
                if c.windowed and not r.req.finished:  # (no deadline polled it: move it here)
                    while not r.req.finished:
                        r.req.advance(getattr(self.inner, "test", None))
                inner.extend(r.req.posted)
            else:
                inner.append(r.req)
        if len(inner) == 1:
            self.inner.wait(inner[0])
        else:
            self.inner.waitall(inner)
        now = perf_counter() if self.timed else 0.0
        for r in reqs:
            if r.done is None:
                r.done = now
            c.completed(r)


def _post_in(post, chunk, arr, peer):
    """``post(arr, peer, chunk)``: a windowed piece of a message of pipeline chunk ``chunk``."""
    return post(arr, peer, chunk)


class _TimedReducer:
    """``red`` that records a "reduce" event per call (tracing only)."""

    __slots__ = ("red", "call")

    def __init__(self, red, call):
        self.red = red
        self.call = call

    def __getattr__(self, name):
        return getattr(self.red, name)

    def __call__(self, a, b, out):
        t0 = perf_counter()
        self.red(a, b, out)
        c = self.call
        c.events.append(("reduce", t0, perf_counter(), None, len(out) * c.wire, "recv", c.last_recv))


class _TimedBackend:
    """Backend whose ``copy`` records a "copy" event (tracing only); the rest is forwarded."""

    __slots__ = ("be", "call")

    def __init__(self, be, call):
        self.be = be
        self.call = call

    def __getattr__(self, name):
        return getattr(self.be, name)

    def copy(self, dst, src):
        t0 = perf_counter()
        self.be.copy(dst, src)
        c = self.call
        c.events.append(("copy", t0, perf_counter(), None, len(dst) * c.wire, None, -1))
