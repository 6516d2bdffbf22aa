"""One executor for every schedule: bind, post, wait, reduce, copy; blocking or step by step.

An algorithm is a :class:`~mpicoll.algorithms.schedule.Schedule` (no MPI, no
arrays).  Running it takes two stages:

Binding (:func:`bind`)
    Every region is turned into an array view once: ``SRC`` and ``DST`` are
    the call's arrays, work buffers come from a lease of the context's arena
    (engine.workmem).  The result is a tuple of plain tuples, one per
    operation, cached by the plan (engine.plan) so that a repeated call on
    the same arrays does no binding at all.  For blocking runs on the plain
    host channel, a ``Send``, ``Recv`` and the ``Wait`` for both (a step of
    recursive doubling, halving or Bruck) become one ``MPI_Sendrecv`` with
    its buffer specs built here (one MPI call instead of three: small
    messages are latency-bound).

Running (:class:`Operation`)
    An operation holds the bound ops, the index of the next one and the
    outstanding requests, so it can stop at any ``Wait`` whose requests are
    not complete and resume later: :meth:`Operation.test` advances without
    blocking, :meth:`Operation.wait` blocks (the channel's ``waitall``; an
    observed channel polls there under the call's timeout, see
    observe.calls).  Timeouts, traffic counting and traces see the
    operation's messages through its channel, like any blocking call.

Progress
    Operations started and not yet complete are listed in :data:`IN_FLIGHT`.
    A blocking wait -- of an operation, or inside a blocking call -- while
    another operation is in flight polls instead of blocking, and advances
    every operation in flight as it goes (MPI's progress rule): ranks may
    complete operations in different orders, and a rank waiting for one
    operation must still send the messages of the others that its peers wait
    for.  A wait under a timeout falls back to the channel's timed wait once
    nothing moved for that long, so such a wait still ends.  :data:`LOCK`
    (re-entrant) serialises all of this between the caller and the progress
    thread (api.requests): one thread advances operations at a time.

Persistent operations
    A persistent operation's buffers are fixed, so after its first start that
    ran unobserved on the plain host channel (NumPy arrays, no timeout, check,
    traffic counter or trace) its bound ops are compiled into a *program*
    (:func:`compile_bound`, shared with the blocking plans of engine.plan):
    every message of up to one piece a persistent point-to-point request made
    once with the operation's tag, each reduction and copy a ready call.  A
    later start runs the program when no traffic counter or trace is on
    (timeout and check are fixed when the operation is made), and otherwise
    the general path: ``Start`` then costs what MPI's ``Start`` costs, plus
    the calls.  A program waits as the general path does (without blocking in
    ``Test``, advancing the other operations in flight in a blocking wait).
    Its requests are freed by ``Free``, when the communicator is freed, after
    an interrupted run (the next start takes the general path) and at exit.

Tags
    Blocking calls use the channel's default tag: they never overlap on a
    rank, and MPI's non-overtaking rule keeps their messages in order.  A
    non-blocking operation gets a tag of its own, derived from the context's
    call counter, and a persistent one from the count of persistent
    operations made, in a separate range (every rank starts collectives and
    makes persistent operations in the same order, so every rank derives the
    same tag), so operations in flight together never match each other's
    messages; see :func:`tag_of`.
"""

from __future__ import annotations

import atexit
import functools
import threading
from operator import setitem
from time import perf_counter

import numpy as np
from mpi4py import MPI

from ..algorithms.schedule import DST, SRC, Copy, Recv, Reduce, Send, Shape, Wait
from ..backends.host import NUMPY
from ..observe import calls as _observe
from ..transport.channel import TAG, Channel, mpi_requests

# operations started and not yet complete (non-blocking and persistent), oldest first
IN_FLIGHT: list = []
LOCK = threading.RLock()
# persistent operations holding a compiled program (their requests are freed at exit)
_PROGRAMS: set = set()
# a traffic counter or a trace on: a start must take the observed path (observe.calls)
_ACTIVE, _RECORDING = _observe.COMMON_QUIET[:2]


def progress_others(me=None) -> bool:
    """Advance every operation in flight except ``me`` without blocking; True if any completed."""
    moved = False
    for other in tuple(IN_FLIGHT):
        if other is not me and other._active:
            other._advance(False)
            moved = moved or not other._active
    return moved


# bound op kinds
SEND, RECV, WAIT, REDUCE, COPY, SENDRECV = range(6)

# Tag 0 is the blocking calls' (transport.channel.TAG), 1 the fingerprint check's
# (observe.check.TAG); non-blocking and persistent operations take tags from 2 up.
FIRST_TAG = 2


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


def shape_of(ctx, total, counts, displs, itemsize, in_place, commutative=True) -> Shape:
    """The :class:`Shape` of a call on ``ctx`` (segment and window from its tuning)."""
    seg = max(1, getattr(ctx, "segment_bytes", 1 << 20) // max(itemsize, 1))
    return Shape(ctx.size, ctx.rank, tuple(ctx.ring), ctx.ring_pos, total, tuple(counts),
                 tuple(displs), seg, getattr(ctx, "window", 2), bool(in_place), commutative,
                 tuple(getattr(ctx, "nodes", ())))


def bind(schedule, views: dict, fuse_channel=None) -> tuple:
    """The schedule's ops with every region an array view (see the module docstring).

    ``views`` maps buffer names to 1-D arrays.  ``fuse_channel``: the plain
    host :class:`Channel` of a blocking run, whose Send/Recv/Wait triples of
    messages up to a piece become one ``Sendrecv``; None: no fusion.
    """
    ops = schedule.ops
    out = []
    i, n = 0, len(ops)
    while i < n:
        op = ops[i]
        t = type(op)
        if fuse_channel is not None and i + 2 < n:
            fused = _fuse(ops, i, views, fuse_channel)
            if fused is not None:
                out.append(fused)
                i += 3
                continue
        if t is Send:
            r = op.region
            out.append((SEND, views[r.buf][r.start:r.stop], op.peer, i))
        elif t is Recv:
            r = op.region
            out.append((RECV, views[r.buf][r.start:r.stop], op.peer, i))
        elif t is Wait:
            out.append((WAIT, op.handles))
        elif t is Reduce:
            a, b, o = op.a, op.b, op.out
            out.append((REDUCE, views[a.buf][a.start:a.stop], views[b.buf][b.start:b.stop],
                        views[o.buf][o.start:o.stop]))
        elif t is Copy:
            d, s = op.dst, op.src
            out.append((COPY, views[d.buf][d.start:d.stop], views[s.buf][s.start:s.stop]))
        else:  # pragma: no cover - the schedule module defines no other op
            raise TypeError(f"schedule op {op!r} unknown")
        i += 1
    return tuple(out)


def _fuse(ops, i, views, ch):
    """A SENDRECV op for ops i..i+2 = Send, Recv, Wait(both) (either order), else None."""
    a, b, w = ops[i], ops[i + 1], ops[i + 2]
    if type(w) is not Wait or set(w.handles) != {i, i + 1}:
        return None
    if type(a) is Send and type(b) is Recv:
        s, r = a, b
    elif type(a) is Recv and type(b) is Send:
        s, r = b, a
    else:
        return None
    ns, nr = s.region.count, r.region.count
    if not (0 < ns <= ch.piece and 0 < nr <= ch.piece):
        return None
    T = ch.mpitype
    sv = views[s.region.buf][s.region.start:s.region.stop]
    rv = views[r.region.buf][r.region.start:r.region.stop]
    return (SENDRECV, ch.comm.Sendrecv, [sv, T], s.peer, ch.tag, [rv, T], r.peer, ch.tag)


def work_views(schedule, lease, dtype) -> dict:
    """Views of the schedule's work buffers, taken from ``lease`` (one region per purpose)."""
    return {purpose: lease.take(dtype, n, purpose) for purpose, n in schedule.work.items()}


def run_blocking(bound, nops, ch, red, be) -> None:
    """Run bound ops to the end (blocking)."""
    reqs = [None] * nops if nops else None
    for op in bound:
        k = op[0]
        if k == SENDRECV:
            op[1](op[2], op[3], op[4], op[5], op[6], op[7])
        elif k == REDUCE:
            red(op[1], op[2], op[3])
        elif k == SEND:
            reqs[op[3]] = ch.isend(op[1], op[2])
        elif k == RECV:
            reqs[op[3]] = ch.irecv(op[1], op[2])
        elif k == WAIT:
            h = op[1]
            if len(h) == 1:
                ch.wait(reqs[h[0]])
                reqs[h[0]] = None
            else:
                ch.waitall([reqs[j] for j in h])
                for j in h:
                    reqs[j] = None
        else:
            be.copy(op[1], op[2])


# --- programs: bound ops on persistent point-to-point requests -----------------------
# A program is a tuple of (kind, x): START starts the persistent request x, WAIT waits for
# the list x of them, CALL calls x (a reduction or a copy with its operands bound).
START, CALL = SENDRECV + 1, SENDRECV + 2
_ALL = slice(None)
# ufuncs whose output NumPy (2.4) no longer takes as a positional argument
_OUT_BY_KEYWORD = frozenset({np.maximum, np.minimum})


def compile_bound(bound, ch, red, be) -> tuple:
    """(program, its persistent requests) for ``bound``; (None, ()) when an op cannot be.

    Every message of at most one piece on the plain host channel becomes a
    persistent request made here, once (``Recv_init``/``Send_init`` on the
    channel's communicator with its tag): started where the bound ops post it,
    waited for where they wait.  A fused exchange (SENDRECV) becomes "start
    the receive, start the send, wait for both".  A message over one piece, or
    a channel that is not the plain host one (staging, observation), makes
    the bound ops uncompilable.  The requests are inactive when the program
    has run to the end; whoever holds the program frees them (:func:`free_requests`).
    """
    prog, requests = [], []
    ufunc = getattr(red, "ufunc", None)
    one = _Views()
    posted = {}  # bound op index -> its persistent request (Send/Recv ops)
    plain = type(ch) is Channel

    def persistent(init, arr, peer):
        if not plain or len(arr) > ch.piece:
            return None
        req = init([arr, ch.mpitype], peer, ch.tag)
        requests.append(req)
        return req

    for op in bound:
        k = op[0]
        if k == SENDRECV:
            _, _, sspec, dest, stag, rspec, src, rtag = op
            recv = ch.comm.Recv_init(rspec, src, rtag)
            requests.append(recv)
            send = ch.comm.Send_init(sspec, dest, stag)
            requests.append(send)
            # both started before either is waited for: no order between the peers
            prog += ((START, recv), (START, send), (WAIT, [send, recv]))
        elif k == SEND or k == RECV:
            req = persistent(ch.comm.Send_init if k == SEND else ch.comm.Recv_init,
                             op[1], op[2])
            if req is None:
                break
            posted[op[3]] = req
            prog.append((START, req))
        elif k == WAIT:
            prog.append((WAIT, [posted[h] for h in op[1]]))
        elif k == REDUCE:
            a, b, out = one(op[1]), one(op[2]), one(op[3])
            if ufunc is None:
                prog.append((CALL, functools.partial(red, a, b, out)))
            elif ufunc in _OUT_BY_KEYWORD:
                prog.append((CALL, functools.partial(ufunc, a, b, out=out)))
            else:  # (positional out: 0.12 us less than a keyword at 16 B, measured)
                prog.append((CALL, functools.partial(ufunc, a, b, out)))
        elif k == COPY:
            dst, src = one(op[1]), one(op[2])
            if be.copy is NUMPY.copy and type(dst) is np.ndarray and type(src) is np.ndarray \
                    and dst.shape == src.shape and dst.dtype == src.dtype:
                # dst[:] = src: the same bytes as NUMPY.copy's np.copyto, 40-55 ns less
                # per call (16 B - 4 KiB, measured)
                prog.append((CALL, functools.partial(setitem, dst, _ALL, src)))
            else:
                prog.append((CALL, functools.partial(be.copy, dst, src)))
        else:
            break
    else:
        return tuple(prog), tuple(requests)
    free_requests(requests)
    return None, ()


def free_requests(requests) -> None:
    """Free a program's persistent requests: inactive after a run to the end; active only
    after an interrupted run, which MPI then completes on its own."""
    if requests and not MPI.Is_finalized():
        for req in requests:
            req.Free()


class _Views:
    """One array object per memory region: the first view seen of the same bytes.

    The bound ops take a new view of a region for each use; a reduction whose
    output is a second view of one of its inputs makes NumPy check the two for
    overlap on every call (0.15-0.2 us at 16 B, measured), which the same object skips.
    """

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
    return MPI.Request.Testall(mpi_requests(reqs))


def run_on(schedule, ctx, ch, be, red, src, dst) -> None:
    """Run ``schedule`` to the end on ``ch`` with work memory from a scope of ``ctx``.

    The old algorithm signature's way in (tests drive algorithms through
    simulated channels this way).  ``src`` None: nothing but ``dst``.
    """
    with ctx.work.scope(be) as scope:
        views = work_views(schedule, scope, dst.dtype)
        views[DST] = dst
        views[SRC] = dst if src is None else src
        run_blocking(bind(schedule, views), len(schedule.ops), ch, red, be)


def as_function(collective: str, build):
    """The schedule builder ``build`` as a function of the old algorithm signature.

    ``allreduce``: ``fn(ctx, ch, be, red, src, dst)``, in place when ``src is dst``;
    ``reduce_scatter``: ``fn(ctx, ch, be, red, src, dst, counts, displs)``, in
    place when ``src`` and ``dst`` share memory; ``allgather``:
    ``fn(ctx, ch, be, src, dst, counts, displs)``, in place when ``src`` is None.
    Each call builds the schedule of its shape and runs it to the end with
    :func:`run_on` (tests drive algorithms on simulated channels this way).
    """
    if collective == "allreduce":
        def fn(ctx, ch, be, red, src, dst):
            shape = shape_of(ctx, len(dst), (len(dst),), (0,), dst.dtype.itemsize, src is dst)
            run_on(build(shape), ctx, ch, be, red, src, dst)
    elif collective == "reduce_scatter":
        def fn(ctx, ch, be, red, src, dst, counts, displs):
            shape = shape_of(ctx, sum(counts), tuple(counts), tuple(displs), src.dtype.itemsize,
                             _shares_memory(src, dst))
            run_on(build(shape), ctx, ch, be, red, src, dst)
    elif collective == "allgather":
        def fn(ctx, ch, be, src, dst, counts, displs):
            shape = shape_of(ctx, sum(counts), tuple(counts), tuple(displs), dst.dtype.itemsize,
                             src is None)
            run_on(build(shape), ctx, ch, be, None, src, dst)
    else:
        raise ValueError(f"collective: expected allreduce, reduce_scatter or allgather, "
                         f"got {collective!r}")
    functools.update_wrapper(fn, build)  # its module, name and docstring: the algorithm's
    return fn


def _shares_memory(a, b) -> bool:
    """True if arrays ``a`` and ``b`` (NumPy, or with ``__cuda_array_interface__``) overlap."""
    try:
        import numpy as np
        if isinstance(a, np.ndarray):
            return bool(np.shares_memory(a, b))
        ia = a.__cuda_array_interface__["data"][0]
        ib = b.__cuda_array_interface__["data"][0]
        return ia < ib + b.nbytes and ib < ia + a.nbytes
    except Exception:
        return True


class Operation:
    """One collective in flight (see the module docstring).

    Attributes:
        algorithm: the algorithm chosen.
        done: True once complete (the result is in the receive buffer).
    """

    __slots__ = ("algorithm", "done", "persistent", "_run", "_i", "_reqs", "_active", "_freed",
                 "_prog", "_preqs", "_on_prog", "owner", "__weakref__")

    def __init__(self, run, persistent: bool):
        self.algorithm = run.name
        self.done = True  # an inactive persistent operation counts as complete (MPI)
        self.persistent = persistent
        self._run = run
        self._i = 0
        self._reqs = None
        self._active = False
        self._freed = False
        # persistent: the bound ops compiled on persistent requests after the first plain
        # start (see "Persistent operations"), and whether the current start runs them
        self._prog = None
        self._preqs = ()
        self._on_prog = False
        # non-blocking: the request or handle whose caller has not seen it complete yet
        # (api.requests); a kept operation restarts only without one (engine.plan)
        self.owner = None

    # -- the interface --------------------------------------------------------
    def test(self) -> bool:
        """Advance without blocking; True once complete."""
        if self._active:
            with LOCK:
                if self._active:
                    self._advance(False)
        return not self._active

    def wait(self) -> None:
        """Block until complete (CollectiveTimeout under a timeout); see "Progress"."""
        if self._active:
            with LOCK:
                if self._active:
                    self._advance(True)

    def start(self) -> None:
        """Persistent only: run again on the buffers' current contents."""
        if not self.persistent:
            raise RuntimeError("start: only a persistent operation can be started")
        if self._freed:
            raise RuntimeError("start: the persistent operation was freed")
        if self._active:
            raise RuntimeError("start: the persistent operation is still active; wait for it first")
        with LOCK:
            if self._prog is not None and not (_ACTIVE or _RECORDING):
                self._begin_prog()
            else:
                self._begin(self._run.blocking)

    def restart(self) -> None:
        """Non-blocking, complete and kept (engine.plan): run again on the same buffers,
        with the tag of the call it now is.

        Kept operations ran unobserved on the plain host channel, and a restart
        happens only while nothing observes calls, so what begin() would set up
        again is what the run holds: its channel (given the new tag) and bound ops.
        """
        run = self._run
        ctx = run.ctx
        ctx.seq += 1  # every start is a call, as in begin()
        run.tag = run.ch.tag = tag_of(ctx.seq, ctx.tag_ub)
        with LOCK:
            self.done = False
            self._reqs = [None] * run.nops
            self._go(False)

    def free(self) -> None:
        """Persistent: give back its work memory and requests (idempotent).  An active one
        completes first."""
        if self._active:
            self.wait()
        if not self._freed:
            self._freed = True
            self.drop_program()
            self._run.release()

    def drop_program(self) -> None:
        """Free the compiled program's requests; later starts take the general path."""
        requests, self._preqs, self._prog = self._preqs, (), None
        _PROGRAMS.discard(self)
        free_requests(requests)

    # -- the machinery --------------------------------------------------------
    def _begin(self, block: bool = False) -> None:
        """Start: post what can be posted (``block``: run to the end, a blocking call)."""
        run = self._run
        self.done = False
        try:
            bound = run.begin()
        except BaseException:
            self._end(True)
            raise
        if bound is None:  # an algorithm without a schedule: ran to the end in begin()
            self._end(False)
            return
        self._reqs = [None] * run.nops
        self._go(block)

    def _begin_prog(self) -> None:
        """Start on the compiled program (what begin() decides is known: see start)."""
        self._run.ctx.seq += 1  # every start is a call, as in begin()
        self.done = False
        self._on_prog = True
        self._go(False)

    def _go(self, block: bool) -> None:
        """Active from the first op: in flight unless ``block``, then run as far as it goes
        (every start ends here, once its run is set up)."""
        self._i = 0
        self._active = True
        if not block:
            IN_FLIGHT.append(self)
        self._advance(block)

    def _advance_prog(self, block: bool) -> None:
        prog = self._prog
        i, n = self._i, len(prog)
        try:
            while i < n:
                kind, x = prog[i]
                if kind == START:
                    x.Start()
                elif kind == CALL:
                    x()
                elif not block:
                    if not MPI.Request.Testall(x):
                        self._i = i
                        return
                else:
                    if IN_FLIGHT and (len(IN_FLIGHT) > 1 or IN_FLIGHT[0] is not self):
                        self._i = i
                        while not MPI.Request.Testall(x) and (
                                len(IN_FLIGHT) > 1 or IN_FLIGHT[0] is not self):
                            progress_others(self)
                    MPI.Request.Waitall(x)
                i += 1
        except BaseException:
            # interrupted: requests may still be active, so the program goes (MPI
            # completes them) and the next start takes the general path
            self._i = i
            self.drop_program()
            self._end(True)
            raise
        self._i = i
        self._end(False)

    def _advance(self, block: bool) -> None:
        if self._on_prog:
            self._advance_prog(block)
            return
        run = self._run
        bound, reqs, ch = run.bound, self._reqs, run.ch
        i, n = self._i, len(bound)
        try:
            while i < n:
                op = bound[i]
                k = op[0]
                if k == SEND:
                    reqs[op[3]] = ch.isend(op[1], op[2])
                elif k == RECV:
                    reqs[op[3]] = ch.irecv(op[1], op[2])
                elif k == WAIT:
                    rs = [reqs[j] for j in op[1]]
                    if not block:
                        if not testall(ch, rs):
                            self._i = i
                            return
                    elif IN_FLIGHT and (len(IN_FLIGHT) > 1 or IN_FLIGHT[0] is not self):
                        self._i = i
                        self._poll(ch, rs)
                    # complete (or, after _poll gave up under a timeout, a timed wait):
                    # returns at once, but does the books
                    ch.waitall(rs)
                    for j in op[1]:
                        reqs[j] = None
                elif k == REDUCE:
                    run.red(op[1], op[2], op[3])
                elif k == COPY:
                    run.be.copy(op[1], op[2])
                else:
                    op[1](op[2], op[3], op[4], op[5], op[6], op[7])
                i += 1
        except BaseException:
            self._i = i
            self._end(True)
            raise
        self._i = i
        self._end(False)

    def _poll(self, ch, rs) -> None:
        """Wait for ``rs`` while advancing every other operation in flight (see "Progress").

        Returns when ``rs`` completed, or -- under a timeout -- when nothing
        moved for that long: the caller's timed wait then decides.
        """
        timeout = self._run.timeout
        quiet_since = perf_counter()
        while not testall(ch, rs):
            if progress_others(self):
                quiet_since = perf_counter()
            elif timeout is not None and perf_counter() - quiet_since > timeout:
                return
            if not IN_FLIGHT or (len(IN_FLIGHT) == 1 and IN_FLIGHT[0] is self):
                return  # nothing else to advance: block in the channel's wait

    def _end(self, failed: bool) -> None:
        if self in IN_FLIGHT:
            IN_FLIGHT.remove(self)
        self._active = False
        self._reqs = None
        run = self._run
        if self._on_prog:
            self._on_prog = False
            if failed:
                run.end(True)  # (its bound ops and work memory go too)
            self.done = not failed
            return
        # a blocking call's caller may keep its work memory for a plan (engine.plan)
        run.end(failed, release=failed or not (self.persistent or run.plannable))
        self.done = not failed
        if self.persistent and not failed and self._prog is None and not run.observed \
                and run.bound is not None and not self._freed and run.msg.backend is NUMPY:
            self._prog, self._preqs = compile_bound(run.bound, run.ch, run.red, run.be)
            if self._prog is not None:
                _PROGRAMS.add(self)


def drop_programs(ctx) -> None:
    """Free the programs of the inactive persistent operations on ``ctx`` (its communicator
    is freed or unusable); active ones keep theirs until they end or the interpreter exits."""
    for op in tuple(_PROGRAMS):
        if op._run.ctx is ctx and not op._active:
            op.drop_program()


@atexit.register
def _free_programs_at_exit() -> None:
    # Persistent requests must be freed before MPI_Finalize (MPICH warns of each one
    # left); mpi4py finalizes MPI after the interpreter's atexit handlers have run.
    for op in tuple(_PROGRAMS):
        op.drop_program()


__all__ = ["IN_FLIGHT", "LOCK", "Operation", "progress_others", "bind", "run_blocking", "run_on",
           "shape_of", "tag_of", "testall", "TAG", "Channel"]
