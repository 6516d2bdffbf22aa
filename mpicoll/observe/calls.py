"""The observation hook: one :class:`Call` per collective, wrapping its transport.

:mod:`mpicoll.engine.run` asks :func:`begin` for a Call before running an
algorithm.  When nothing is switched on (no check, no timeout, no traffic
counter, no trace) it gets None and the algorithm runs on the backend's
channel untouched.  Otherwise the Call

* runs the fingerprint check (:mod:`_check`) before any payload message,
* hands the algorithm an :class:`ObservedChannel` that polls with a timeout
  (:mod:`_timeout`), counts messages and bytes (:mod:`_traffic`) and records
  send/receive intervals (:mod:`_trace`), and, when tracing, a reducer and a
  backend whose ``red``/``copy`` calls are timed,
* hands its counts and events to the active recorders when the call ends.

Message k of a call is labelled with step, block and segment from the
schedule the call runs (:meth:`Call.use_schedule`).
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


def _drop_cache(ctx) -> None:
    """No call on an unusable context repeats a bound call again (engine.cache)."""
    drop = getattr(ctx, "drop_cache", None)
    if drop is not None:
        drop()


def observing() -> bool:
    """Whether a traffic counter or a trace records calls now (then no call repeats a bound
    call: engine.cache)."""
    return bool(_traffic.ACTIVE or _trace.active())


def begin(ctx, label, collective, algorithm, msg, total, counts, displs, op, timeout, check):
    """A :class:`Call` for this collective, or None when nothing observes it."""
    tracers = _trace.active()
    if timeout is None and not check and not tracers and not _traffic.ACTIVE:
        return None
    return Call(ctx, label, collective, algorithm, msg, total, counts, displs, op, timeout,
                tuple(_traffic.ACTIVE), tracers)


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


class Call:
    """One collective call on one rank, as timeouts, counters and traces see it."""

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

        ``run(schedule, ctx, ch, be, red, src, dst)`` runs a schedule to the
        end (the engine passes its executor's run_on; see observe.check.agree).
        """
        if self.size == 1:
            return
        ch = _check.channel(self.ctx)
        if self.timeout is not None:
            ch = ObservedChannel(ch, self, account=False, phase="check")
        t0 = perf_counter()
        try:
            _check.agree(self, ch, run)
        finally:
            if self.events is not None:
                self.events.append(("check", t0, perf_counter(), None, 0, None, -1))

    def wrap(self, ch, be, red):
        """(channel, backend, reducer) the algorithm runs with (unchanged for the check alone)."""
        if self.timeout is None and not self.recorders and self.events is None:
            return ch, be, red
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

    # -- timeouts -------------------------------------------------------------
    def expired(self, left, idle, phase):
        """The CollectiveTimeout for requests ``left`` pending ``idle`` seconds."""
        r = next((r for r in left if r.kind == "recv"), left[0])
        peer = peer_name(self.ctx, r.peer)
        where = ""
        lab = None if phase == "check" else self.label_of(r.kind, r.k)
        if lab is not None:
            where = f", step {lab.step} of {self.schedule.nsteps} ({lab.phase}"
            if lab.block is not None:
                where += f", block {lab.block} segment {lab.segment}"
            where += ")"
        if phase == "check":
            doing = f"agreeing on the call fingerprint (MPICOLL_CHECK) with {peer}"
        elif r.kind == "recv":
            doing = f"waiting to receive {r.nbytes} bytes from {peer}{where}"
        else:
            doing = f"waiting for {peer} to receive {r.nbytes} bytes{where}"
        more = len(left) - 1
        also = f"; {more} more message(s) pending" if more else ""
        what = f"{self.total} x {_check.dtype_label(self.msg)}"
        Peer = peer[0].upper() + peer[1:]
        if phase == "check":
            why = (f"{Peer} has not joined the exchange: it may have skipped this call, be in a "
                   f"collective on another communicator, or be stuck or dead")
        else:
            part = "sent its part" if r.kind == "recv" else "taken this message"
            why = (f"{Peer} has not {part}: it, or a rank it waits for, may have skipped this call, "
                   f"called another collective, or be stuck or dead")
        msg = (
            f"{self.label} #{self.seq} ({self.algorithm}, {what}) on rank {self.rank}: "
            f"no progress for {idle:.3g} s (timeout {self.timeout:g} s) while {doing}{also}. "
            f"{why}. This communicator cannot be used again; end the job with mpicoll.abort()"
        )
        setattr(self.ctx, _BROKEN, f"{self.label} #{self.seq} timed out on rank {self.rank}")
        _drop_cache(self.ctx)
        return CollectiveTimeout(
            msg, collective=self.label, seq=self.seq, algorithm=self.algorithm, rank=self.rank,
            peer=r.peer, phase="check" if phase == "check" else r.kind,
            step=None if lab is None else lab.step, timeout=self.timeout)


class _Labels:
    """The labels of a call's sends and receives, in issue order, and its step count."""

    __slots__ = ("sends", "recvs", "nsteps")

    def __init__(self, sends, recvs, nsteps):
        self.sends, self.recvs, self.nsteps = sends, recvs, nsteps


def peer_name(ctx, peer) -> str:
    """'rank 3', plus its MPI.COMM_WORLD rank when that differs."""
    name = f"rank {peer}"
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
    """Channel wrapper: counts, times and (with a timeout) polls every message."""

    __slots__ = ("inner", "call", "account", "phase", "timed", "piece")

    def __init__(self, inner, call: Call, account: bool = True, phase: str | None = None):
        self.inner = inner
        self.call = call
        self.account = account
        self.phase = phase
        self.timed = call.events is not None
        # with a timeout, payload messages longer than a piece move windowed
        # (_timeout.Windowed), in the pieces the channel cuts: (to another node, to this one)
        mpitype = call.msg.mpitype
        self.piece = ((_channel.piece_elems(mpitype, False, call.ctx.node_piece),
                       _channel.piece_elems(mpitype, True))
                      if call.timeout is not None and account else None)

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
        if self.account:
            c.nsend = k + 1
            c.scounts.append(n)
        return Req(req, "send", dest, n * c.wire, k, t0)

    def irecv(self, arr, source, chunk=0):
        c = self.call
        t0 = perf_counter() if self.timed else 0.0
        req = self._post(self.inner.irecv, arr, source, "recv", chunk)
        k = c.nrecv
        n = len(arr)
        if self.account:
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
        c = self.call
        if c.timeout is not None:
            test = _timeout.tester(reqs, getattr(self.inner, "test", None), c.windowed)
            if test is not None:
                _timeout.wait(reqs, c.timeout, lambda left, idle: c.expired(left, idle, self.phase),
                              test)
        # the inner channel finishes the requests (host staging copies, ...);
        # polled MPI requests are already complete and return at once
        inner = []
        for r in reqs:
            if type(r.req) is _timeout.Windowed:
                inner.extend(r.req.posted)
            else:
                inner.append(r.req)
        if len(inner) == 1:
            self.inner.wait(inner[0])
        else:
            self.inner.waitall(inner)
        if not self.account:
            return
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
