"""The runner: one operation type, bound once, started any number of times; one loop.

An algorithm's :class:`~mpicoll.algorithms.schedule.Schedule` is bound once
(:func:`bind`) into an :class:`Operation`; a blocking call is one start run to
the end (:meth:`Operation.run`), a non-blocking call one start in flight
(:meth:`Operation.start`), a persistent request and a remembered call the same
operation started again.  :meth:`Operation._run` is the only loop over steps;
where messages keep one tag, :func:`on_requests` binds the steps to persistent
requests once (the *program*).  The rules this module keeps -- every wait
advances every operation in flight, one deadline, no lock across an MPI wait,
tags, failures that stay with their operation -- are docs/design.md's
"The progress rule"; how a call reaches here, its "How a call runs".
"""

from __future__ import annotations

import atexit
import functools
import threading
import time
from operator import setitem
from time import perf_counter

import numpy as np
from mpi4py import MPI

from ..algorithms.schedule import DST, SRC, Copy, Fold, Recv, Reduce, Send, Shape, Wait
from ..backends.host import FP_CONDITIONS, NUMPY
from ..core import config as _config
from ..core import types as _types
from ..core.config import EPOCH
from ..core.errors import MessageError, MpicollError
from ..observe import calls as _observe
from ..transport import channel as _channel
from ..transport import timeout as _timeout
from ..transport.channel import CHUNKS, TAG, Channel, mpi_requests

# operations started and not yet complete (non-blocking and persistent), oldest first
IN_FLIGHT: list = []
_MEMBERS = threading.Lock()  # guards IN_FLIGHT's membership; never held across MPI

# step kinds (the first item of each step tuple)
SEND, RECV, WAIT, REDUCE, COPY, CALL, AFTER, FOLD = range(8)

# Tags 0..CHUNKS-1 are the blocking calls' (transport.channel.TAG, and the chunks of a
# pipeline), CHUNKS the fingerprint check's (observe.check.TAG); non-blocking and
# persistent operations take tags from CHUNKS + 1 up.
FIRST_TAG = CHUNKS + 1

_Startall = MPI.Prequest.Startall
_NO_REQUESTS: list = []  # (what a program's start keeps: its requests are its own)
_Waitall = MPI.Request.Waitall
_Testall = MPI.Request.Testall


def tag_of(seq: int, tag_ub: int, persistent: bool = False) -> int:
    """The tag of the non-blocking start that is call ``seq`` of a context, or
    (``persistent``) of the ``seq``-th persistent operation made on it.

    Non-blocking starts take the lower half of ``FIRST_TAG..tag_ub``,
    persistent operations the upper half: a persistent operation keeps its tag
    for its whole life, so however many calls later a non-blocking one starts,
    it cannot get that tag.  Within a half a tag repeats only after half as
    many starts (creations) as there are tags: 2**28 with MPICH's
    ``MPI_TAG_UB``, 16383 with the least MPI allows.
    """
    half = (tag_ub - FIRST_TAG + 1) // 2
    return FIRST_TAG + (half if persistent else 0) + seq % half


def shape_of(ctx, total, counts, displs, itemsize, in_place, commutative=True,
             accumulate=None, segment_window=None, staged=False) -> Shape:
    """The :class:`Shape` of a call on ``ctx`` (segment and window from its options, or
    ``segment_window``: (segment bytes, window), see Context.segment_window; ``staged``:
    every message through a host copy, see Shape)."""
    seg_bytes, window = segment_window or (ctx.segment_bytes, ctx.window)
    seg = max(1, seg_bytes // max(itemsize, 1))
    return Shape(ctx.size, ctx.rank, tuple(ctx.ring), ctx.ring_pos, total, tuple(counts),
                 tuple(displs), seg, window, bool(in_place), commutative, ctx.nodes,
                 accumulate, bool(staged))


# --- progress ----------------------------------------------------------------------------

def progress_others(me=None) -> bool:
    """Advance every operation in flight except ``me`` without blocking; True if any moved
    to completion (or failed).  An operation another thread is advancing is skipped."""
    moved = False
    for other in tuple(IN_FLIGHT):
        if other is me or not other._lock.acquire(False):
            continue
        try:
            if other._active:
                try:
                    other._advance(False)
                except BaseException:  # kept by the operation, raised to its own caller
                    pass
                moved = moved or not other._active
        finally:
            other._lock.release()
    return moved


def others_in_flight(me=None) -> bool:
    """Whether some operation other than ``me`` is in flight (a wait must then poll)."""
    n = len(IN_FLIGHT)
    return n > 1 or (n == 1 and IN_FLIGHT[0] is not me)


def wait_for(test, me=None, timeout=None) -> bool:
    """Poll ``test()`` until True, advancing every other operation in flight meanwhile.

    Returns True once ``test()`` is; False when nothing else is in flight (the
    caller then blocks in MPI itself) or, under ``timeout``, once nothing at
    all moved for that long (the caller's timed wait then decides).  Spins
    for ``_timeout.SPIN_S`` after the last progress, then sleeps between polls,
    doubling the pause up to ``_timeout.MAX_SLEEP_S``, so a rank waiting for
    a late peer leaves the core to others.
    """
    quiet_since = perf_counter()
    pause = 0.0
    while not test():
        if not others_in_flight(me):
            return False
        if progress_others(me):
            quiet_since = perf_counter()
            pause = 0.0
            continue
        idle = perf_counter() - quiet_since
        if timeout is not None and idle > timeout:
            return False
        if idle > _timeout.SPIN_S:
            pause = min(max(2 * pause, _timeout.MIN_SLEEP_S), _timeout.MAX_SLEEP_S)
            time.sleep(pause)
    return True


# --- binding -----------------------------------------------------------------------------

def _wire(arr):
    """What messages of ``arr`` move: the array, or the unsigned words of an ml_dtypes
    array (those have no buffer protocol for MPI to read; reductions and copies read the
    array itself)."""
    return arr.view(_types.view_dtype(arr.dtype)) if _types.is_ml_type(arr.dtype) else arr


def bind(schedule, views: dict) -> tuple:
    """The schedule's ops as steps, every region an array view of ``views`` (name -> 1-D).

    Steps: ``(SEND|RECV, array, peer, index, chunk)``, ``(WAIT, handles, None)``,
    ``(REDUCE, a, b, out)``, ``(COPY, dst, src)``; ``index`` is the op's index in the
    schedule, where its request is kept while it is posted."""
    out = []
    wire = {name: _wire(arr) for name, arr in views.items()}
    for i, op in enumerate(schedule.ops):
        t = type(op)
        if t is Send:
            r = op.region
            out.append((SEND, wire[r.buf][r.start:r.stop], op.peer, i, op.chunk))
        elif t is Recv:
            r = op.region
            out.append((RECV, wire[r.buf][r.start:r.stop], op.peer, i, op.chunk))
        elif t is Wait:
            out.append((WAIT, op.handles, None))
        elif t is Reduce:
            a, b, o = op.a, op.b, op.out
            out.append((REDUCE, views[a.buf][a.start:a.stop], views[b.buf][b.start:b.stop],
                        views[o.buf][o.start:o.stop]))
        elif t is Copy:
            d, s = op.dst, op.src
            out.append((COPY, views[d.buf][d.start:d.stop], views[s.buf][s.start:s.stop]))
        elif t is Fold:  # (the reducer's fold: one pass over every operand)
            out.append((FOLD, tuple(views[r.buf][r.start:r.stop] for r in op.xs),
                        tuple(views[r.buf][r.start:r.stop] for r in op.outs)))
        else:  # pragma: no cover - the schedule module defines no other op
            raise TypeError(f"schedule op {op!r} unknown")
    return tuple(out)


def work_views(schedule, lease, dtype) -> dict:
    """Views of the schedule's work buffers, taken from ``lease`` (one region per purpose),
    of the call's ``dtype`` unless the schedule declares a buffer of another."""
    types = schedule.types
    return {purpose: lease.take(types.get(purpose, dtype), n, purpose)
            for purpose, n in schedule.work.items()}


_ALL = Ellipsis  # dst[...] = src: NumPy's cheapest whole-array assignment
# ufuncs whose output NumPy (2.4) no longer takes as a positional argument
_OUT_BY_KEYWORD = frozenset({np.maximum, np.minimum})


def on_requests(steps, ch, red, be) -> tuple:
    """(the program: ``steps`` on persistent requests, those requests); (None, ()) when some
    message cannot be one.

    Every message of at most one piece on the plain host channel becomes a
    persistent request made here, once (``Recv_init``/``Send_init`` on the
    channel's communicator with its tag); the requests of consecutive posts
    start together (one ``Startall``), a wait waits for its requests; each
    reduction and copy becomes a ready call with its operands bound (one array
    object per memory region, so NumPy's overlap check is cheap).  A message
    over one piece, or a channel that is not the plain host one (staging, node
    memory of device arrays), leaves the operation without a program.  The
    requests are inactive after a run to the end; the operation frees them
    (:meth:`Operation.release`).
    """
    if type(ch) is not Channel:
        return None, ()
    out, requests, posted, starting = [], [], {}, []
    ufunc = getattr(red, "ufunc", None)
    one = _Views()

    def flush():
        if starting:
            out.append((CALL, functools.partial(_Startall, list(starting))))
            starting.clear()

    for step in steps:
        k = step[0]
        if k == SEND or k == RECV:
            arr = step[1]
            if len(arr) > ch.piece_for(step[2]):
                free_requests(requests)
                return None, ()
            init = ch.comm.Send_init if k == SEND else ch.comm.Recv_init
            req = init([arr, ch.mpitype], step[2], ch.tag + step[4])
            requests.append(req)
            posted[step[3]] = req
            starting.append(req)
            continue
        flush()
        if k == WAIT:
            out.append((WAIT, step[1], [posted[h] for h in step[1]]))
        elif k == REDUCE:
            a, b, o = one(step[1]), one(step[2]), one(step[3])
            if ufunc is None:
                out.append((CALL, functools.partial(red, a, b, o)))
            elif ufunc in _OUT_BY_KEYWORD:
                out.append((CALL, functools.partial(ufunc, a, b, out=o)))
            else:
                out.append((CALL, functools.partial(ufunc, a, b, o)))
        elif k == COPY:
            dst, src = one(step[1]), one(step[2])
            if be.copy is NUMPY.copy and type(dst) is np.ndarray and type(src) is np.ndarray \
                    and dst.shape == src.shape and dst.dtype == src.dtype:
                out.append((CALL, functools.partial(setitem, dst, _ALL, src)))
            else:
                out.append((CALL, functools.partial(be.copy, dst, src)))
        else:
            out.append(step)
    flush()
    return tuple(out), tuple(requests)


class _Views:
    """One array object per memory region: the first view seen of the same bytes."""

    def __init__(self):
        self.seen: dict = {}

    def __call__(self, arr):
        if type(arr) is not np.ndarray:
            return arr
        key = (arr.__array_interface__["data"][0], arr.shape, arr.strides, arr.dtype.str)
        return self.seen.setdefault(key, arr)


def free_requests(requests) -> None:
    """Free persistent requests: inactive after a run to the end; active only after an
    interrupted run, which MPI then completes on its own."""
    if requests and not MPI.Is_finalized():
        for req in requests:
            if req != MPI.REQUEST_NULL:  # (freed already: at exit, before its owner)
                req.Free()


def testall(ch, reqs) -> bool:
    """Advance ``reqs`` of channel ``ch`` without blocking; True when all are complete."""
    test = getattr(ch, "testall", None)
    if test is not None:
        return test(reqs)
    test = getattr(ch, "test", None)  # staging channels: one request at a time
    if test is not None:
        return all([test(r) for r in reqs])
    return _channel.testall(mpi_requests(reqs))


# --- operations --------------------------------------------------------------------------

class Operation:
    """One collective on one rank: bound once (steps, program, transport), started any
    number of times.

    ``bound``: what engine.run made of the call (engine.run.Bound: the call without its
    arrays, the schedule, the transport, the lease of work memory, the steps);
    ``None`` for an internal exchange (:func:`run_to_end`).  ``ch``, ``red``,
    ``be``: the channel, reducer and backend the steps run with.

    Attributes:
        algorithm: the algorithm chosen.
        done: True once complete (also while a persistent operation is inactive).
        error: the exception it failed with (raised again by every test/wait), or None.
        persistent: started again by its owner (a persistent request or the cache).
    """

    __slots__ = ("bound", "schedule", "ctx", "algorithm", "done", "error", "persistent",
                 "blocking", "steps", "program", "requests", "ch", "red", "be", "parts",
                 "depth", "timeout", "expire", "call", "tag", "progress", "owner", "seq",
                 "_epoch", "_plain", "_observes", "_run_steps", "_run_ch", "_next", "_i",
                 "_unmade",
                 "_cur", "_reqs",
                 "_active", "_lock", "_since", "__weakref__")

    def __init__(self, steps, ch, red, be, *, bound=None, ctx=None, algorithm=None,
                 timeout=None, tag=None, persistent=False, schedule=None, expire=None):
        self.bound = bound
        self.schedule = bound.schedule if bound is not None else schedule
        self.blocking = True
        self.expire = expire  # (an internal exchange's timeout error: run_on)
        self.ctx = ctx
        self.algorithm = algorithm
        self.done = True
        self.error = None
        self.persistent = persistent
        self.steps, self.ch, self.red, self.be = steps, ch, red, be
        self.program = None
        self.requests = ()
        # 1: its program is wanted (engine.run binds it so), 2: and it started once; made at
        # the next start (:meth:`_make_program`), so a call started once makes no request
        self._unmade = 0
        # a pipeline's chunks (Schedule.parts, Schedule.depth): () for steps run in order
        self.parts, self.depth = (), 0
        self.timeout = timeout
        self.call = None  # the observation of the start in progress (observe.calls), if any
        self.tag = tag  # None: the channel's own; else "call number" or a fixed tag
        self.progress = False  # handed to the progress thread (api.requests)
        # non-blocking: the request or handle whose caller has not seen it complete yet
        # (api.requests); the cache restarts an operation only without one
        self.owner = None
        self.seq = 0
        self._epoch = -1  # (the options epoch the run form below was decided for)
        self._plain = False
        self._observes = False
        self._run_steps = steps
        self._run_ch = ch
        self._next = None  # (steps the start goes on with after these: proceed())
        self._i = 0
        self._cur = None  # (parts: the next step of each chunk)
        self._reqs = None
        self._active = False
        self._lock = threading.Lock()
        self._since = 0.0  # when it last moved (deadlines)

    # -- the interface --------------------------------------------------------
    def run(self) -> None:
        """One start run to the end here (a blocking call)."""
        self._begin()
        if self.parts or self._next is not None or self.timeout is not None:
            self._go(True)
        else:  # (what _go and _advance do, for the steps in order to the end, in one)
            steps = self._run_steps
            n = len(steps)
            self.done = False
            self._reqs = _NO_REQUESTS if self._plain else [None] * n
            self._active = True
            try:
                self._run(0, n, True)
            except BaseException as exc:
                if isinstance(exc, MPI.Exception) and not isinstance(exc, MpicollError):
                    exc = failure(self, steps[self._i], exc)
                self._end(exc)
                raise exc from None
            if self.bound.ends or self.call is not None:
                self._end(None)
            else:  # (what _end does for a kept operation's start that ended well)
                self._active = False
                self.done = True
        ctx = self.ctx
        if ctx is not None and ctx.notes:
            ctx.flush_notes()

    def start(self) -> None:
        """One start, in flight: it advances in every wait (the progress rule), and in the
        progress thread when the ``progress`` option is on (api.requests)."""
        self._begin()
        with _MEMBERS:
            IN_FLIGHT.append(self)
        ctx = self.ctx
        if ctx is not None:
            ctx.active += 1
        with self._lock:
            self._go(False)

    def test(self) -> bool:
        """Advance without blocking; True once complete.  Raises what the operation failed
        with (every time), including CollectiveTimeout once its deadline passed."""
        if self._active and self._lock.acquire(False):
            try:
                if self._active:
                    self._advance(False)
                    if self._active:
                        self._check_idle()
            finally:
                self._lock.release()
        if self.error is not None:
            raise self.error
        if self._active:
            return False
        self._said()
        return True

    def wait(self) -> None:
        """Block until complete, advancing every other operation in flight meanwhile."""
        while self._active:
            with self._lock:
                if self._active:
                    self._advance(True)
        if self.error is not None:
            raise self.error
        self._said()

    def _said(self) -> None:
        """Complete: what its context's set-up had to say is said now (engine.context)."""
        ctx = self.ctx
        if ctx is not None and ctx.notes:
            ctx.flush_notes()

    def release(self) -> None:
        """Never started again: its persistent requests and work memory go back (an active
        operation completes first).  Idempotent."""
        if self._active:
            try:
                self.wait()
            except BaseException:  # (its error stays its own; the requests are MPI's now)
                pass
        self.program = None
        self._unmade = 0
        self._epoch = -1
        free_requests(self.requests)
        self.requests = ()
        unhold(self)
        if self.bound is not None:
            self.bound.release()

    # -- one start ------------------------------------------------------------
    def _begin(self) -> None:
        """Set up one start: the call number, its tag, its observation, what it runs."""
        if self.error is not None:
            raise MpicollError(f"this operation failed earlier and cannot start again: "
                               f"{self.error}")
        ctx = self.ctx
        bound = self.bound
        if ctx is not None:  # (None: MPI's own collective on the user's, api.delegate)
            if ctx.mpicoll_unusable is not None:  # (a timeout left messages in flight)
                _observe.check_usable(ctx)
            if bound.claims:
                bound.claim(self)
            ctx.seq += 1
            self.seq = ctx.seq
        if self._unmade:
            if self._unmade == 2:
                self._make_program()
            else:
                self._unmade = 2
        if self._epoch != EPOCH[0]:
            self._decide()
        if self._plain:
            self._run_steps, self._run_ch = self.program, self.ch
            return
        self._run_steps = self.steps
        if bound.schedule is None:  # (first steps before its own: observed once bound)
            self._run_ch = None
            return
        try:
            self.call = bound.observe(self) if self._observes else None
            if self.ch is not None:
                self.use_channel(self.ch)
            if bound.enters:
                bound.enter(self)
        except BaseException as exc:
            self._end(exc)
            raise

    def _make_program(self) -> None:
        """Bind its steps to persistent requests (:func:`on_requests`), at its second start:
        their creation costs more than a start of the steps they replace."""
        self._unmade = 0
        t = self.bound.transport
        if isinstance(self.tag, int):
            set_tag(self.ch, self.tag)
        self.program, self.requests = on_requests(self.steps, self.ch, t.reducer, t.backend)
        hold(self, self.requests)
        self._epoch = -1  # (its starts run the program from now on: _decide)

    def use_channel(self, ch, be=None, red=None) -> None:
        """Run this start on transport channel ``ch`` (with backend ``be`` and reducer ``red``,
        default the transport's): the tag of its call number (a non-blocking start) or its
        own, observed if something observes it."""
        if self.tag == "call":
            set_tag(ch, tag_of(self.seq, self.ctx.tag_ub))
        elif self.tag is not None:
            set_tag(ch, self.tag)
        t = self.bound.transport
        be = t.backend if be is None else be
        red = t.reducer if red is None else red
        if self.call is not None:
            ch, be, red = self.call.wrap(ch, be, red)
        self._run_ch, self.be, self.red = ch, be, red

    def _decide(self) -> None:
        """What starts run under the options now in force: the program where nothing
        observes them (a trace, a traffic counter, the fingerprint check), the deadline
        (bound.observed sets ``timeout``), the progress thread (api.requests)."""
        observed = self.bound.observed(self)
        self._plain = not observed and self.program is not None
        self._observes = observed or self.timeout is not None
        self.progress = _config.get("progress")
        self._epoch = EPOCH[0]

    def _go(self, block: bool) -> None:
        self.done = False
        self._i = 0
        if self.parts:
            self._cur = [first for first, _ in self.parts]
        # (the program waits on its own requests: nothing to keep per start)
        self._reqs = _NO_REQUESTS if self._plain else [None] * len(self._run_steps)
        self._active = True
        if self.timeout is not None:
            self._since = perf_counter()
        self._advance(block)

    # -- the loop -------------------------------------------------------------
    def proceed(self, steps) -> None:
        """The start in progress goes on with ``steps`` once the current ones have run (the
        call's own steps after a node memory's set-up: engine.intranode.prelude)."""
        self._next = steps

    def _advance(self, block: bool) -> None:
        """Run steps until one must wait (``block``: wait there), or to the end."""
        try:
            while True:
                if self.parts and self._run_steps is self.steps:
                    if not self._advance_parts(block):
                        return
                else:
                    n = len(self._run_steps)
                    i = self._i = self._run(self._i, n, block)
                    if i < n:
                        return
                if self._next is None:
                    break
                steps, self._next = self._next, None
                self._run_steps, self._i = steps, 0
                self._reqs = [None] * len(steps)
                if self.parts:
                    self._cur = [first for first, _ in self.parts]
        except BaseException as exc:
            if isinstance(exc, MPI.Exception) and not isinstance(exc, MpicollError):
                exc = failure(self, self._run_steps[self._i], exc)
            self._end(exc)
            raise exc from None
        self._end(None)

    def _advance_parts(self, block: bool) -> bool:
        """:meth:`_advance` of a pipeline (Schedule.parts): every open chunk runs until it
        must wait; when none can move, block (``block``) on the oldest chunk's wait; the
        steps after the last chunk once all ended.  True when the operation is complete.
        Blocking only on the oldest unfinished chunk, after every other moved as far as
        it could, cannot hang: a peer either finished that chunk (its messages are
        posted) or is blocked on it too, and one chunk alone is deadlock-free."""
        parts, depth, cur, steps = self.parts, self.depth, self._cur, self._run_steps
        while True:
            oldest, moved = None, False
            for c, (_, end) in enumerate(parts):
                i = cur[c]
                if i >= end:
                    continue
                if c >= depth and cur[c - depth] < parts[c - depth][1]:
                    break  # (opens once chunk c - depth has ended; later ones after it)
                if oldest is None:
                    oldest = c
                self._i = i
                cur[c] = self._run(i, end, False)
                moved = moved or cur[c] != i
            if oldest is None:
                n = len(steps)
                self._i = self._run(max(self._i, parts[-1][1]), n, block)
                return self._i >= n
            if moved:
                continue
            self._i = cur[oldest]
            if not block:
                return False
            self._waited(steps[self._i], True)
            cur[oldest] += 1

    def _run(self, i: int, n: int, block: bool) -> int:
        """Run steps ``i`` up to ``n`` until one must wait (``block``: wait there); the index
        it stopped at.  The only loop over steps."""
        steps, reqs, ch = self._run_steps, self._reqs, self._run_ch
        try:
            while i < n:
                step = steps[i]
                k = step[0]
                if k == CALL:
                    try:
                        step[1]()
                    except FP_CONDITIONS:  # (written: IEEE, as MPI's; backends.host)
                        pass
                elif k == WAIT:
                    if not self._waited(step, block):
                        return i
                elif k == AFTER:
                    if not self._after(step[1], block):
                        return i
                elif k == SEND:
                    reqs[step[3]] = ch.isend(step[1], step[2], step[4])
                elif k == RECV:
                    reqs[step[3]] = ch.irecv(step[1], step[2], step[4])
                elif k == REDUCE:
                    try:
                        self.red(step[1], step[2], step[3])
                    except FP_CONDITIONS:
                        pass
                elif k == COPY:
                    try:
                        self.be.copy(step[1], step[2])
                    except FP_CONDITIONS:
                        pass
                else:  # FOLD: the reducer's one pass over every operand
                    try:
                        self.red.fold(step[1], step[2])
                    except FP_CONDITIONS:
                        pass
                i += 1
        except BaseException:
            self._i = i  # (the step that failed: failure() names it)
            raise
        return i

    def _waited(self, step, block: bool) -> bool:
        """Complete the requests of a Wait step; False if not complete and not ``block``."""
        preqs = step[2]
        if preqs is not None:  # the program's persistent requests
            if not block:
                return _channel.testall(preqs)
            if self.timeout is not None:
                self._timed_wait(step)
                self._since = perf_counter()
                return True
            if IN_FLIGHT and others_in_flight(self):
                wait_for(lambda: _Testall(preqs), self)
            try:
                _Waitall(preqs)
            except MPI.Exception:
                _channel.waitall(preqs)  # (the failed request's own error)
            return True
        ch, reqs = self._run_ch, self._reqs
        rs = [reqs[j] for j in step[1]]
        if not block:
            if type(ch) is Channel:  # (a host channel's Testall finished them: nothing to count)
                if not ch.testall(rs):
                    return False
                return self._finished(step)
            if not testall(ch, rs):
                return False
        elif self.timeout is not None:
            self._timed_wait(step)
        elif others_in_flight(self):
            wait_for(lambda: testall(ch, rs), self)
        # complete (or never polled): the channel finishes and counts them
        ch.waitall(rs)
        return self._finished(step)

    def _finished(self, step) -> bool:
        """The requests of Wait step ``step`` completed (the deadline counts from now)."""
        reqs = self._reqs
        for j in step[1]:
            reqs[j] = None
        if self.timeout is not None:
            self._since = perf_counter()
        return True

    def _after(self, holder, block: bool) -> bool:
        """An AFTER step: the operation ``holder.op`` (that held this start's region of node
        memory, engine.intranode) must have ended first; False if not and not ``block``.
        Advancing it here is the progress rule's; its error stays its own."""
        prev = holder.op
        if prev is not None and prev._active:
            if not block:
                if prev._lock.acquire(False):
                    try:
                        if prev._active:
                            prev._advance(False)
                    except BaseException:  # (raised again to its own caller)
                        pass
                    finally:
                        prev._lock.release()
                if prev._active:
                    return False
            else:
                wait_for(lambda: not prev._active, self)
        holder.op = None
        return True

    def _timed_wait(self, step) -> None:
        """Wait for a Wait step's requests under the operation's deadline: poll, advancing
        every operation in flight, and raise CollectiveTimeout after ``timeout`` seconds
        without a completion (a piece of a message counts)."""
        if len(step) > 3:  # (a node memory's set-up: its own messages and words)
            setup = step[3]
            try:
                _timeout.wait(setup.messages, self.timeout, setup.expired,
                              _timeout.tester(setup.messages))
            except BaseException:
                setup.abandon()
                raise
            return
        pending = self._pending(step)
        if not pending:
            return
        ch = self._run_ch
        if type(ch) is _observe.ObservedChannel:  # (its requests' own channel polls them)
            ch = ch.inner
        base = _timeout.tester(pending, getattr(ch, "test", None),
                               getattr(self.call, "windowed", None))
        if base is None:  # (requests no poll reaches: the channel's own wait)
            return

        def test(left):
            done, progress = base(left)
            return done, bool(IN_FLIGHT and progress_others(self)) or progress

        def expire(left, idle):
            return self._expired(left, idle)

        _timeout.wait(pending, self.timeout, expire, test)

    def _pending(self, step) -> list:
        """The requests of a Wait step not complete yet, as a polling wait sees them."""
        preqs = step[2]
        out = []
        for pos, j in enumerate(step[1]):
            r = preqs[pos] if preqs is not None else self._reqs[j]
            if r is None or (type(r) is MPI.Prequest and r == MPI.REQUEST_NULL):
                continue
            if getattr(r, "done", None) is not None:
                continue
            out.append(_Pending(r, j, self))
        return out

    def _check_idle(self) -> None:
        """Under a deadline: CollectiveTimeout once nothing moved for that long (test())."""
        timeout = self.timeout
        if timeout is None:
            return
        since = max(self._since, getattr(self.call, "last_progress", 0.0))
        idle = perf_counter() - since
        if idle <= timeout:
            return
        step = self._run_steps[self._i]
        if step[0] == WAIT and len(step) > 3:  # (a node memory's set-up)
            left = [m for m in step[3].messages if not m.req.Test()]
            if not left:
                return
            _timeout.cancel(left)
            exc = step[3].expired(left, idle)
            step[3].abandon()
        else:
            left = self._pending(step) if step[0] == WAIT else []
            if not left:
                return
            _timeout.cancel(left)
            exc = self._expired(left, idle)
        self._end(exc)
        raise exc

    def _expired(self, left, idle) -> BaseException:
        """The CollectiveTimeout of this start after ``idle`` seconds without progress, naming
        the first message of ``left`` it waited for; the communicator becomes unusable."""
        messages = [m for m in (_message(self, p.index) for p in left) if m is not None]
        if self.expire is not None:
            return self.expire(messages, idle)
        b = self.bound
        return _observe.timeout_error(self.ctx, b.label, self.seq, self.algorithm, b.what,
                                      messages, self.schedule.nsteps, idle, self.timeout)

    def _end(self, exc) -> None:
        """No longer active: complete (``exc`` None) or failed with ``exc``."""
        self._active = False
        self._reqs = None
        if IN_FLIGHT and self in IN_FLIGHT:
            with _MEMBERS:
                listed = self in IN_FLIGHT
                if listed:
                    IN_FLIGHT.remove(self)
            if listed and self.ctx is not None:
                self.ctx.operation_ended()
        if exc is None:
            self.done = True
        else:
            self.error = exc
            self.program = None  # (its requests may still be active: never again)
            self._unmade = 0
            self._epoch = -1
        bound = self.bound
        if bound is not None and (bound.ends or self.call is not None):
            bound.ended(self, exc)


class _Pending:
    """A request of a Wait step as transport.timeout.wait polls it."""

    __slots__ = ("req", "kind", "index", "done")

    def __init__(self, req, index, op):
        self.req = req.req if type(req) is _observe.Req else req  # (what an observed wraps)
        self.index = index
        sched = op.schedule
        sop = sched.ops[index] if sched is not None and index < len(sched.ops) else None
        self.kind = "send" if type(sop) is Send else "recv"
        self.done = None


def set_tag(ch, tag) -> None:
    """Give the host channel under ``ch`` (device channels wrap one as ``inner``) the tag."""
    while ch is not None:
        if isinstance(ch, Channel):
            ch.tag = tag
            return
        ch = getattr(ch, "inner", None)


# --- failures ------------------------------------------------------------------------

CHECK_HINT = ("Ranks that call differently (another count, datatype, op or collective) make "
              "MPI fail this way; MPICOLL_CHECK=1 compares every call's arguments across ranks "
              "before any message and names the difference (docs/reliability.md)")


def _message(op, index):
    """(kind, peer, bytes, label) of the message at schedule index ``index`` of ``op``."""
    sched = op.schedule
    sop = sched.ops[index] if sched is not None and index is not None \
        and index < len(sched.ops) else None
    if type(sop) not in (Send, Recv):
        return None
    wire = op.bound.wire if op.bound is not None else op.ch.mpitype.Get_size()
    return ("send" if type(sop) is Send else "recv", sop.peer, sop.region.count * wire,
            sop.label)


def _where(lab, nsteps) -> str:
    if lab is None:
        return ""
    where = f"step {lab.step} of {nsteps} ({lab.phase}"
    if lab.block is not None:
        where += f", block {lab.block} segment {lab.segment}"
    return where + ")"


def failure(op, step, exc) -> BaseException:
    """The :class:`~mpicoll.MessageError` of MPI error ``exc`` met running ``step`` of
    ``op``: MPI's own text for the failed request, and which message of which step of
    which call it was (``exc`` itself for an internal exchange)."""
    b = op.bound
    if b is None or b.schedule is None:  # (an internal exchange, a node memory's set-up)
        return exc
    ctx = op.ctx
    index = _failed_message(op, step, getattr(exc, "request", None))
    about = _message(op, index)
    if about is None:
        doing, peer, kind, lab = "a message", None, None, None
    else:
        kind, peer, nbytes, lab = about
        name = _observe.peer_name(ctx, peer)
        doing = f"receiving {nbytes} bytes from {name}" if kind == "recv" else \
            f"sending {nbytes} bytes to {name}"
    where = _where(lab, b.schedule.nsteps)
    text = (f"{b.label} #{op.seq} ({op.algorithm}, {b.what}) on rank {ctx.rank}: {doing}"
            f"{' (' + where + ')' if where else ''} failed: {exc.Get_error_string()}. "
            f"{CHECK_HINT}")
    return MessageError(text, exc.Get_error_code(), collective=b.label, seq=op.seq,
                        algorithm=op.algorithm, rank=ctx.rank, peer=peer,
                        step=None if lab is None else lab.step, phase=kind)


def _failed_message(op, step, failed):
    """The schedule index of the message whose request ``failed`` (an MPI request, or None:
    the only message of the step), among those ``step`` posts or waits for."""
    k = step[0]
    if k == SEND or k == RECV:
        return step[3]
    if k != WAIT:
        return None
    handles, preqs = step[1], step[2]
    if handles is None:  # (a node memory's set-up: no message of the schedule)
        return None
    reqs = op._reqs
    for pos, j in enumerate(handles):
        r = preqs[pos] if preqs is not None else (reqs[j] if reqs else None)
        if failed is not None and r is not None and _holds(r, failed):
            return j
    return handles[0] if len(handles) == 1 else None


def _holds(r, failed) -> bool:
    """Whether channel request ``r`` is, or is made of, the MPI request ``failed``."""
    for _ in range(4):  # (an observed request over a staged one over MPI's: a few layers)
        if r is failed:
            return True
        parts = getattr(r, "parts", None)
        if parts is None:
            parts = getattr(r, "posted", None)
        if parts is not None:
            return any(p is failed for p in parts)
        r = getattr(r, "req", None)
        if r is None:
            return False
    return False


def run_on(schedule, ctx, ch, be, red, src, dst, timeout=None, expire=None) -> None:
    """Run ``schedule`` to the end on ``ch`` with work memory from a scope of ``ctx``,
    advancing every operation in flight while it waits (an internal exchange: the
    fingerprint check's; tests drive algorithms on simulated channels with it).

    ``src`` None: nothing but ``dst``.  ``timeout``: its deadline, ``expire(messages,
    idle)`` the exception it raises then (messages: (kind, peer, bytes, label)).
    """
    with ctx.work.scope(be) as scope:
        views = work_views(schedule, scope, dst.dtype)
        views[DST] = dst
        views[SRC] = dst if src is None else src
        op = Operation(bind(schedule, views), ch, red, be, ctx=ctx, schedule=schedule,
                       timeout=timeout, expire=expire)
        op._run_steps, op._run_ch = op.steps, ch
        op._go(True)


# persistent requests that must be freed before MPI_Finalize: owner -> requests
_HOLDING: dict = {}


def hold(owner, requests) -> None:
    """``owner`` keeps persistent ``requests`` (freed at exit unless released first)."""
    if requests:
        _HOLDING[owner] = requests


def unhold(owner) -> None:
    _HOLDING.pop(owner, None)


EXIT_WAIT_S = 2.0  # how long the exit handler advances operations never waited for


@atexit.register
def _free_at_exit() -> None:
    # mpi4py finalizes MPI after the interpreter's atexit handlers have run, and the
    # interpreter frees the arrays of an operation started and never waited for before
    # that: MPI_Finalize's progress then moved a pending message from freed memory (a
    # segfault in 7 of 8 runs, Open MPI, 3 ranks).  Such operations are advanced here for
    # a moment (every rank exiting without waiting completes them together); one still
    # active after that (a peer that never joined) is kept alive for good.
    end = perf_counter() + EXIT_WAIT_S
    pause = 0.0
    while IN_FLIGHT and perf_counter() < end:
        left = len(IN_FLIGHT)
        for op in list(IN_FLIGHT):
            try:
                op.test()
            except BaseException:  # (its error belongs to a caller that is gone)
                pass
        if len(IN_FLIGHT) < left:
            pause = 0.0
        else:  # nothing ended: leave the core to the peers it waits for (oversubscribed)
            pause = min(max(2 * pause, _timeout.MIN_SLEEP_S), _timeout.MAX_SLEEP_S)
            time.sleep(pause)
    if IN_FLIGHT:
        import ctypes  # (only here: a reference the interpreter's teardown never drops)
        for op in list(IN_FLIGHT):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(op))
    # Persistent requests must be freed before MPI_Finalize (MPICH warns of each one left).
    while _HOLDING:
        owner, requests = _HOLDING.popitem()
        if getattr(owner, "_active", False):
            continue  # (still moving a message: left to MPI)
        free_requests(requests)


__all__ = ["IN_FLIGHT", "Operation", "progress_others", "wait_for", "bind", "on_requests",
           "run_on", "shape_of", "tag_of", "testall", "TAG", "Channel"]
