"""The progress engine: one operation type, one loop that advances it, one rule for waiting.

An algorithm is a :class:`~mpicoll.algorithms.schedule.Schedule` (no MPI, no
arrays).  Running it takes two stages:

Binding
    :func:`bind` turns every region into an array view (``SRC`` and ``DST``
    are the call's arrays, work buffers come from a lease of the context's
    arena, engine.context): a tuple of *steps*, one per schedule op.  A
    cached call (engine.cache) binds once more, with :func:`compile_bound`:
    each message of up to one piece becomes a persistent point-to-point
    request made once, and its steps start that request instead of posting
    a new one.  Both are the same steps; only how a message is posted differs.

Advancing (:class:`Operation`)
    An operation holds its steps, the index of the next one and the
    outstanding requests.  :meth:`Operation._advance` is the only loop over
    steps: it runs steps until a ``Wait`` whose requests are not complete,
    then returns (``test``) or waits (``wait``).  A blocking call is an
    operation started and waited for; a non-blocking one is started and
    handed to the caller; a persistent one is started again and again.

The progress rule (MPI's)
    Operations started and not complete are listed in :data:`IN_FLIGHT`.
    Every wait -- a blocking call's, ``Wait``/``wait()``, the fingerprint
    check's, the context set-up's (:func:`wait_for`) -- advances every
    operation in flight while its own requests are incomplete, so no order
    in which ranks complete operations can hang: a rank waiting for one
    operation still sends the messages of the others its peers wait for.
    Only when nothing else is in flight does a wait block inside MPI.

Locking
    No lock is held across an MPI wait.  Each operation has a lock of its
    own, held while one thread advances it (the caller, another caller's
    wait, or the progress thread; the others skip it: ``acquire(False)``).
    :data:`_MEMBERS` guards only the membership of :data:`IN_FLIGHT`.  So two
    threads on two communicators never wait for each other, and the progress
    thread can always advance what no one else is advancing.

Failure
    An operation that fails (a timeout, an MPI error, an interrupt) keeps its
    exception: every later ``test``/``wait`` raises it again.  A failure met
    while advancing *another* operation belongs to that operation and is
    raised to its own caller, not to the one whose wait happened to advance it.

Tags
    Blocking calls use the channel's default tag: they never overlap on a
    communicator (MPI's rule for collectives), and MPI's non-overtaking rule
    keeps their messages in order.  A non-blocking operation gets a tag of
    its own, derived from the context's call counter, and a persistent one
    from the count of persistent operations made, in a separate range (every
    rank starts collectives and makes persistent operations in the same
    order, so every rank derives the same tag); see :func:`tag_of`.
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
from ..core import types as _types
from ..core.errors import MessageError, MpicollError
from ..observe import calls as _observe
from ..transport import channel as _channel
from ..transport import timeout as _timeout
from ..transport.channel import CHUNKS, TAG, Channel, mpi_requests

# operations started and not yet complete (non-blocking and persistent), oldest first
IN_FLIGHT: list = []
_MEMBERS = threading.Lock()  # guards IN_FLIGHT's membership; never held across MPI

# step kinds (the first item of each step tuple)
SEND, RECV, WAIT, REDUCE, COPY, START, CALL, FOLD = range(8)

# Tags 0..CHUNKS-1 are the blocking calls' (transport.channel.TAG, and the chunks of a
# pipeline), CHUNKS the fingerprint check's (observe.check.TAG); non-blocking and
# persistent operations take tags from CHUNKS + 1 up.
FIRST_TAG = CHUNKS + 1


def tag_of(seq: int, tag_ub: int, persistent: bool = False) -> int:
    """The tag of the non-blocking operation started as call ``seq`` of a context, or
    (``persistent``) of the ``seq``-th persistent operation made on it.

    Non-blocking operations take the lower half of ``FIRST_TAG..tag_ub``,
    persistent ones the upper half: a persistent operation keeps its tag for
    its whole life, so however many calls later a non-blocking one starts, it
    cannot get that tag.  Within a half a tag repeats only after half as many
    starts (non-blocking) or creations (persistent) as there are tags, so two
    operations in flight together share one only if that many start (are
    made) on the communicator during the older one's life: 2**28 with
    MPICH's ``MPI_TAG_UB``, 16383 with the least MPI allows.
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
    """The schedule's ops as steps, every region an array view of ``views`` (name -> 1-D)."""
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


_ALL = Ellipsis  # dst[...] = src: NumPy's cheapest whole-array assignment (docs/performance.md)
# ufuncs whose output NumPy (2.4) no longer takes as a positional argument
_OUT_BY_KEYWORD = frozenset({np.maximum, np.minimum})


def compile_bound(steps, ch, red, be, timed=None) -> tuple:
    """(the same steps on persistent requests, those requests); (None, ()) when some message
    cannot be one.

    Every message of at most one piece on the plain host channel becomes a
    persistent request made here, once (``Recv_init``/``Send_init`` on the
    channel's communicator with its tag), started where the steps post it
    and waited for where they wait; each reduction and copy becomes a ready
    call with its operands bound (one array object per memory region, so
    NumPy's overlap check is cheap).  A message over one piece, or a channel
    that is not the plain host one (staging, observation), makes the steps
    uncompilable.  The requests are inactive after a run to the end; whoever
    holds them frees them (:func:`free_requests`).

    ``timed``: (timeout, expired) of a call under a timeout: each wait polls
    its requests (:func:`timed_waitall`) and ``expired(pending, idle)`` makes
    the exception to raise, ``pending`` the (request, (kind, peer, nbytes,
    k)) still incomplete, ``k`` its index among the call's sends (receives).
    """
    if type(ch) is not Channel:
        return None, ()
    out, requests, posted = [], [], {}
    about = messages(steps, ch)
    ufunc = getattr(red, "ufunc", None)
    one = _Views()
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
            out.append((START, req))
        elif k == WAIT:
            preqs = [posted[h] for h in step[1]]
            if timed is None:
                out.append((WAIT, step[1], preqs))
            else:
                # (a ready call: a timed entry runs only blocking, so its waits may poll)
                out.append((CALL, functools.partial(
                    timed_waitall, preqs, [about[h] for h in step[1]], *timed)))
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
    return tuple(out), tuple(requests)


def messages(steps, ch) -> dict:
    """Per message of bound ``steps`` (its index, ``step[3]``): (kind, peer, nbytes, k),
    ``k`` its index among the sends (receives): what a timed wait says of it."""
    about, counted = {}, {SEND: 0, RECV: 0}
    wire = ch.mpitype.Get_size()
    for step in steps:
        k = step[0]
        if k == SEND or k == RECV:
            about[step[3]] = ("send" if k == SEND else "recv", step[2], len(step[1]) * wire,
                              counted[k])
            counted[k] += 1
    return about


def one_piece(steps, ch) -> bool:
    """Whether every message of bound ``steps`` is at most one piece of channel ``ch``
    (a single MPI request: what a timed wait on the plain channel can poll)."""
    return all(len(step[1]) <= ch.piece_for(step[2]) for step in steps
               if step[0] == SEND or step[0] == RECV)


class Timed:
    """The timeout of an operation on the plain host channel (a non-blocking call
    remembered with its timeout, engine.cache), in the place of an observed call's
    (:attr:`Operation.call`): its waits
    poll (:func:`timed_waitall`) and :meth:`Operation.test` gives up after ``timeout``
    seconds without progress, raising what ``expire(pending, idle)`` makes.

    ``about``: :func:`messages` of its steps, each message one MPI request
    (:func:`one_piece`)."""

    __slots__ = ("timeout", "expire", "about")

    last_progress = 0.0  # (an observed call's: a piece seen; here a Wait step completing)

    def __init__(self, timeout, expire, about):
        self.timeout, self.expire, self.about = timeout, expire, about

    def pending(self, reqs, handles) -> list:
        """The requests of messages ``handles`` not complete, as timed waits poll them."""
        about = self.about
        return [_Pending(reqs[j], about[j]) for j in handles
                if reqs[j] is not None and reqs[j] != MPI.REQUEST_NULL]

    def expired(self, left, idle, phase=None):
        return self.expire(left, idle)


def timed_waitall(requests, about, timeout, expired) -> None:
    """Complete ``requests`` (MPI requests, persistent or not) by polling; raise
    ``expired(left, idle)`` once nothing moved for ``timeout`` seconds (a remembered call's wait
    under a timeout, engine.cache).

    ``about[i]``: (kind, peer, nbytes, k) of ``requests[i]``, which the entries
    of ``left`` carry as ``what``.  First a spin on ``Testall`` (MPI_Testall
    changes no request until all are complete, so this is the cheapest poll;
    docs/performance.md); past ``SPIN_S`` the wait every timed channel uses
    (transport.timeout.wait: the deadline restarts at each completion, one last
    poll after it, a doubling sleep), where a step another operation in flight
    takes counts as progress too (the progress rule).
    """
    testall = _channel.testall
    start = perf_counter()
    while not testall(requests):
        if IN_FLIGHT:
            progress_others()
        if perf_counter() - start > _timeout.SPIN_S:
            break
    else:
        return
    pending = [_Pending(req, what) for req, what in zip(requests, about)]
    base = _timeout.tester(pending)  # (MPI requests: Testsome)

    def test(left):
        done, progress = base(left)
        return done, bool(IN_FLIGHT and progress_others()) or progress

    _timeout.wait(pending, timeout, expired, test)


class _Pending:
    """A request of :func:`timed_waitall` as transport.timeout.wait polls it."""

    __slots__ = ("req", "kind", "what", "done")

    def __init__(self, req, what):
        self.req, self.kind, self.what, self.done = req, what[0], what, None


def free_requests(requests) -> None:
    """Free persistent requests: inactive after a run to the end; active only after an
    interrupted run, which MPI then completes on its own."""
    if requests and not MPI.Is_finalized():
        for req in requests:
            req.Free()


class _Views:
    """One array object per memory region: the first view seen of the same bytes."""

    def __init__(self):
        self.seen: dict = {}

    def __call__(self, arr):
        if type(arr) is not np.ndarray:
            return arr
        key = (arr.__array_interface__["data"][0], arr.shape, arr.strides, arr.dtype.str)
        return self.seen.setdefault(key, arr)


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
    """One collective on one rank: steps, where it is in them, its requests, its fate.

    ``steps``: from :func:`bind` (or :func:`compile_bound`); ``ch``, ``red``,
    ``be``: the channel, reducer and backend they run with; ``run``: what
    started it (engine.run; None for an internal exchange); ``call``:
    its observation (observe.calls), whose timeout :meth:`test` enforces.

    Attributes:
        algorithm: the algorithm chosen.
        done: True once complete (also while a persistent operation is inactive).
        error: the exception it failed with (raised again by every test/wait), or None.
    """

    __slots__ = ("algorithm", "done", "error", "persistent", "run", "steps", "ch", "red", "be",
                 "call", "ctx", "progress", "parts", "depth", "_i", "_cur", "_reqs", "_active",
                 "_lock", "_since", "owner", "__weakref__")

    def __init__(self, steps, ch, red, be, *, run=None, ctx=None, persistent=False,
                 algorithm=None):
        self.algorithm = algorithm
        self.done = True
        self.error = None
        self.persistent = persistent
        self.run = run
        self.ctx = ctx
        self.steps, self.ch, self.red, self.be = steps, ch, red, be
        self.call = None
        self.progress = False  # handed to the progress thread (api.requests)
        # a pipeline's chunks (Schedule.parts, Schedule.depth): () for steps run in order
        self.parts, self.depth = (), 0
        self._i = 0
        self._cur = None  # (parts: the next step of each chunk)
        self._reqs = None
        self._active = False
        self._lock = threading.Lock()
        self._since = 0.0  # when it last moved (timeouts under test())
        # non-blocking: the request or handle whose caller has not seen it complete yet
        # (api.requests); a cached operation restarts only without one (engine.cache)
        self.owner = None

    # -- the interface --------------------------------------------------------
    def go(self, block: bool) -> None:
        """Start from the first step: in flight unless ``block`` (a blocking call, which
        then runs to the end here)."""
        self.done = False
        self.error = None
        self._i = 0
        self._cur = [first for first, _ in self.parts] if self.parts else None
        self._reqs = [None] * len(self.steps)
        self._active = True
        if self.call is not None:
            self._since = perf_counter()
        if block:
            # (no lock: an operation run to the end here is in no list another thread reads)
            self._advance(True)
            return
        with _MEMBERS:
            IN_FLIGHT.append(self)
        if self.ctx is not None:
            self.ctx.active += 1
        with self._lock:
            self._advance(False)

    def test(self) -> bool:
        """Advance without blocking; True once complete.  Raises what the operation failed
        with (every time), including CollectiveTimeout once its timeout passed."""
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
        return not self._active

    def wait(self) -> None:
        """Block until complete, advancing every other operation in flight meanwhile."""
        while self._active:
            with self._lock:
                if self._active:
                    self._advance(True)
        if self.error is not None:
            raise self.error

    # -- the loop -------------------------------------------------------------
    def _advance(self, block: bool) -> None:
        """Run steps until one must wait (``block``: wait there), or to the end."""
        try:
            if self.parts:
                if not self._advance_parts(block):
                    return
            else:
                n = len(self.steps)
                self._i = self._run(self._i, n, block)
                if self._i < n:
                    return
        except BaseException as exc:
            if isinstance(exc, MPI.Exception) and not isinstance(exc, MpicollError):
                exc = failure(self, self.steps[self._i], exc)
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
        parts, depth, cur, steps = self.parts, self.depth, self._cur, self.steps
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
            if self.call is not None:
                self._since = perf_counter()
            cur[oldest] += 1

    def _run(self, i: int, n: int, block: bool) -> int:
        """Run steps ``i`` up to ``n`` until one must wait (``block``: wait there); the index
        it stopped at.  The only loop over steps."""
        steps, reqs, ch = self.steps, self._reqs, self.ch
        try:
            while i < n:
                step = steps[i]
                k = step[0]
                if k == SEND:
                    reqs[step[3]] = ch.isend(step[1], step[2], step[4])
                elif k == RECV:
                    reqs[step[3]] = ch.irecv(step[1], step[2], step[4])
                elif k == START:
                    step[1].Start()
                elif k == WAIT:
                    if not self._waited(step, block):
                        return i
                    if self.call is not None:
                        self._since = perf_counter()
                elif k == REDUCE:
                    try:
                        self.red(step[1], step[2], step[3])
                    except FP_CONDITIONS:  # (written: IEEE, as MPI's; backends.host)
                        pass
                elif k == COPY:
                    try:
                        self.be.copy(step[1], step[2])
                    except FP_CONDITIONS:
                        pass
                elif k == FOLD:
                    try:
                        self.red.fold(step[1], step[2])
                    except FP_CONDITIONS:
                        pass
                else:
                    try:
                        step[1]()
                    except FP_CONDITIONS:
                        pass
                i += 1
        except BaseException:
            self._i = i  # (the step that failed: executor.failure names it)
            raise
        return i

    def _waited(self, step, block: bool) -> bool:
        """Complete the requests of a Wait step; False if not complete and not ``block``."""
        preqs = step[2]
        if preqs is not None:  # persistent requests (compile_bound)
            if block:
                if others_in_flight(self):
                    wait_for(lambda: _channel.testall(preqs), self)
                _channel.waitall(preqs)
                return True
            return _channel.testall(preqs)
        ch, reqs, call = self.ch, self._reqs, self.call
        rs = [reqs[j] for j in step[1]]
        if not block:
            if not testall(ch, rs):
                return False
        elif others_in_flight(self):
            wait_for(lambda: testall(ch, rs), self, None if call is None else call.timeout)
        if block and type(call) is Timed:
            # (the plain channel's waitall would block in MPI: poll under the timeout)
            timed_waitall(rs, [call.about[j] for j in step[1]], call.timeout, call.expire)
        else:
            # complete (or, after wait_for gave up under a timeout, the channel's timed
            # wait): returns at once, but does the books
            ch.waitall(rs)
        for j in step[1]:
            reqs[j] = None
        return True

    def _check_idle(self) -> None:
        """Under a timeout: CollectiveTimeout once nothing moved for that long (test())."""
        call = self.call
        if call is None or call.timeout is None:
            return
        since = max(self._since, getattr(call, "last_progress", 0.0))
        idle = perf_counter() - since
        if idle <= call.timeout:
            return
        step = self.steps[self._i]
        if type(call) is Timed:
            left = call.pending(self._reqs, step[1])
        else:
            left = [r for r in (self._reqs[j] for j in step[1]) if r is not None
                    and getattr(r, "done", None) is None]
        if not left:
            return
        _timeout.cancel(left)
        exc = call.expired(left, idle, getattr(self.ch, "phase", None))
        self._end(exc)
        raise exc

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
        self.error = exc
        self.done = exc is None
        if self.run is not None:
            self.run.ended(self, exc)


# --- failures ------------------------------------------------------------------------

CHECK_HINT = ("Ranks that call differently (another count, datatype, op or collective) make "
              "MPI fail this way; MPICOLL_CHECK=1 compares every call's arguments across ranks "
              "before any message and names the difference (docs/reliability.md)")


def failure(op, step, exc) -> BaseException:
    """The :class:`~mpicoll.MessageError` of MPI error ``exc`` met running ``step`` of
    ``op``: MPI's own text for the failed request, and which message of which step of
    which call it was (``op.run.about()``; ``exc`` itself for an internal exchange)."""
    about = getattr(op.run, "about", None)
    info = None if about is None else about()
    if info is None:
        return exc
    label, seq, algorithm, what, ctx, schedule, wire = info
    index = _failed_message(op, step, getattr(exc, "request", None))
    peer = kind = lab = None
    if index is not None and index < len(schedule.ops):
        sop = schedule.ops[index]
        if type(sop) in (Send, Recv):
            peer, lab = sop.peer, sop.label
            kind = "send" if type(sop) is Send else "recv"
            nbytes = sop.region.count * wire
    if kind is None:
        doing = "a message"
    elif kind == "recv":
        doing = f"receiving {nbytes} bytes from {_observe.peer_name(ctx, peer)}"
    else:
        doing = f"sending {nbytes} bytes to {_observe.peer_name(ctx, peer)}"
    where = ""
    if lab is not None:
        where = f" (step {lab.step} of {schedule.nsteps}, {lab.phase}"
        if lab.block is not None:
            where += f", block {lab.block} segment {lab.segment}"
        where += ")"
    text = (f"{label} #{seq} ({algorithm}, {what}) on rank {ctx.rank}: {doing}{where} failed: "
            f"{exc.Get_error_string()}. {CHECK_HINT}")
    return MessageError(text, exc.Get_error_code(), collective=label, seq=seq,
                        algorithm=algorithm, rank=ctx.rank, peer=peer,
                        step=None if lab is None else lab.step, phase=kind)


def _failed_message(op, step, failed):
    """The schedule index of the message whose request ``failed`` (an MPI request, or None:
    the only message of the step), among those ``step`` posts, starts or waits for."""
    k = step[0]
    if k == SEND or k == RECV:
        return step[3]
    if k == START:
        return None
    if k != WAIT:
        return None
    handles, preqs = step[1], step[2]
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


def run_to_end(steps, ch, red, be) -> None:
    """Run bound steps to the end (an internal exchange: the fingerprint check's), advancing
    every operation in flight while it waits."""
    Operation(steps, ch, red, be).go(True)


def run_on(schedule, ctx, ch, be, red, src, dst) -> None:
    """Run ``schedule`` to the end on ``ch`` with work memory from a scope of ``ctx``.

    ``src`` None: nothing but ``dst``.  (The fingerprint check runs its
    exchanges this way; tests drive algorithms on simulated channels with it.)
    """
    with ctx.work.scope(be) as scope:
        views = work_views(schedule, scope, dst.dtype)
        views[DST] = dst
        views[SRC] = dst if src is None else src
        run_to_end(bind(schedule, views), ch, red, be)


# persistent requests that must be freed before MPI_Finalize: owner -> requests
_HOLDING: dict = {}


def hold(owner, requests) -> None:
    """``owner`` keeps persistent ``requests`` (freed at exit unless released first)."""
    if requests:
        _HOLDING[owner] = requests


def unhold(owner) -> None:
    free_requests(_HOLDING.pop(owner, ()))


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
        free_requests(_HOLDING.popitem()[1])


__all__ = ["IN_FLIGHT", "Operation", "progress_others", "wait_for", "bind", "compile_bound",
           "run_on", "shape_of", "tag_of", "testall", "TAG", "Channel"]
