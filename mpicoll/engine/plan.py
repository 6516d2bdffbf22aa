"""The one cache of repeated calls: a hit is proven valid, and it holds no user memory.

The general path of a call (engine.collectives) validates, chooses the
algorithm, builds the schedule (cached per call shape on the context), binds
it and runs it.  A *plain* call -- host (NumPy) arrays the algorithm runs on
directly, nothing observing it (no check, timeout, trace or traffic counter)
-- leaves a :class:`Plan` on its context: its operation bound once more, for
repeats, and the *signature* of its arguments.  So does a call observed
for a timeout alone whose messages are each one piece: its plan's waits poll
under the same timeout (a *timed plan*, see "Blocking and non-blocking
repeats").

A hit is valid by construction
    The signature is everything validation read from the arguments: the
    communicator object, each array object (by weak reference) with its
    shape, strides and dtype, ``out``'s writeability, the op object (a
    predefined op: they are never freed), the algorithm argument, and the
    options epoch (core.config.EPOCH, bumped by ``configure()``/``options()``
    and by traffic counters and traces switching on or off).  An array's data
    address needs no check: NumPy refuses to resize an array that has a weak
    reference, and nothing else moves its data; any other change in place
    (``x.dtype = ...``, ``x.shape = ...``, ``x.strides = ...``,
    ``out.flags.writeable = False``) changes the signature.  A call whose
    signature differs is a miss: it is validated as if new, which either
    raises (before any message) or makes a new plan.  Each array is matched
    by object in its own place (an out passed as the input too is another
    call).  ``mpicoll.Comm``'s forms take a C-contiguous buffer as its flat
    memory, whatever its shape: for them the signature is the dtype, C
    contiguity and writeability, which is what their validation reads (and
    the cheapest to compare, see docs/performance.md).  They pass a spec
    ``[array, T]`` whose T is the datatype the array has anyway as the bare
    array (the same message; a spec is a new list at every call, so it could
    never be a plan's object), and any other spec takes the general path.

It holds no user memory
    A plan's steps see the user's arrays through views made from their
    addresses (``MPI.buffer.fromaddress``), which keep nothing alive, and the
    plan refers to the arrays only weakly: when one is collected, its plan is
    dropped (and its persistent requests freed) before the memory can be
    reused.  A non-blocking call's handle keeps its arrays alive while the
    operation is in flight, as mpi4py's requests do.

Blocking and non-blocking repeats
    A blocking plan whose messages are each at most one piece (every
    latency-bound schedule) runs on persistent point-to-point requests made
    once (``executor.compile_bound``), with the blocking calls' tag; other
    blocking plans post their messages as the general path does.  A
    non-blocking plan keeps the general path's ``Isend``/``Irecv``: its tag
    comes from the call counter, and a persistent request would fix it.  It
    restarts only once the previous request or handle has seen completion.
    Either way the repeat is ``Operation.go``, the same loop as every call,
    so a repeat among operations in flight advances them while it waits.
    A timed plan's waits are ready calls of ``executor.timed_waitall`` on
    those requests, with the timeout the call had (the argument, or the
    option: part of the signature); when one gives up it raises the
    CollectiveTimeout the observed channel raises (:class:`_Expiry`).  A
    timed non-blocking plan's operation carries the same timeout as an
    ``executor.Timed`` in the place of an observed call: its blocking waits
    poll with ``timed_waitall`` and ``test()`` gives up after that long
    without progress.  (Under a timeout, which every torch group has, a
    non-blocking call used to be bound afresh and run on the observed channel
    every time: 87 against 10 us at 16 B, 1.33-1.39x the blocking call's time
    against 1.08-1.10x at 25 MiB; docs/performance.md.)

The compiled hit
    Where engine.native builds it (the ``native`` option, on by default), a
    blocking plan's hit also exists in C (``engine/_hit.c``): :data:`repeat`
    is then the C function, which proves the hit of the function's last plan
    by object identity (a stricter copy of :meth:`Plan.matches`) and runs the
    same steps on the same persistent requests (``plan.hit``); anything it
    cannot prove goes to the Python repeat (:func:`_repeat`), which decides
    as without it and runs a hit it proves through ``plan.hit.go()``.

Where plans live
    On the context (``ctx.plans``: up to :data:`PLANS` blocking ones, keyed
    by function and argument objects, holding at most :data:`PLAN_WORK_BYTES`
    of work memory together; ``ctx.kept``: up to :data:`KEPT` non-blocking
    ones), dropped with it.  The last plan of each
    function is also found through a module table keyed by the function's
    name, so a hit needs no MPI attribute lookup; a plan found there must
    match the communicator object like every other field.
"""

from __future__ import annotations

import weakref

import numpy as np
from mpi4py import MPI

from ..algorithms.schedule import DST, SRC
from ..core.config import EPOCH, resolve
from ..core.message import Msg
from ..observe import calls as _observe
from . import context as _context
from . import intranode as _intranode
from . import native as _native
from .executor import (
    CALL,
    IN_FLIGHT,
    START,
    WAIT,
    Channel,
    Operation,
    Timed,
    bind,
    compile_bound,
    hold,
    messages,
    one_piece,
    tag_of,
    timed_waitall,
    unhold,
    work_views,
)

_IN_PLACE = MPI.IN_PLACE
_ndarray = np.ndarray
# function name -> the Plan of its last plain call (any communicator); see "Where plans live"
_LAST: dict = {}
KEPT = 16  # non-blocking plans per context (least recently started dropped first)
PLANS = 16  # blocking plans per context (least recently run dropped first)
# work memory the blocking plans of a context may hold together (beyond it the least
# recently run plans that hold some go, however few plans there are): enough for the
# latency-bound calls whose repeat a plan is for, little beside a large call's own arrays
PLAN_WORK_BYTES = 1 << 20
TIMED = "timed"  # a hit step: a timed plan's wait (executor.timed_waitall), see _hit_steps


class Plan:
    """A plain call's operation bound for repeats, and the signature that proves a hit."""

    __slots__ = ("name", "comm", "ctx", "ra", "rb", "sa", "ta", "da", "sb", "tb", "db",
                 "c", "d", "t", "timeout", "epoch", "forced", "operation", "calls", "lease",
                 "work", "live", "flat", "hit", "__weakref__")

    def matches(self, comm, a, b, c, d, t) -> bool:
        """Whether a call with these arguments is this plan's call, unchanged."""
        if not (self.comm is comm and self.rb() is b and self.live
                and (self.c is c or self.c == c) and (self.d is d or self.d == d)
                and b.dtype is self.db
                and (self.t is t or (type(t) is type(self.t) and self.t == t))):
            return False
        flat = self.flat
        if flat:
            f = b.flags
            if not (f.c_contiguous and f.writeable):
                return False
        elif not (b.strides == self.tb and b.shape == self.sb and b.flags.writeable):
            return False
        ra = self.ra
        if ra is None:
            if a is not _IN_PLACE:
                return False
        elif ra() is not a:
            return False
        elif a is not b:  # (a is b: the plan's call was in place too, and b is checked)
            if a.dtype is not self.da:
                return False
            if flat:
                if not a.flags.c_contiguous:
                    return False
            elif a.strides != self.ta or a.shape != self.sa:
                return False
        return self.epoch == EPOCH[0] or self._still_plain()

    def _still_plain(self) -> bool:
        """After a change of options: whether a call now still runs as this plan's did
        (unobserved, the same forced algorithm); then the plan holds for the new epoch."""
        opts = resolve(self.ctx.env)
        if opts["check"] or opts["algorithm"] != self.forced or opts["deterministic"] \
                or _observe.observing() or (self.t is None and opts["timeout"] != self.timeout) \
                or (self.hit is not None) != (self.calls is not None and _compiled(opts)
                                              is not None):
            return False
        self.epoch = EPOCH[0]
        if self.hit is not None:
            self.hit.epoch = self.epoch
        return True

    def release(self) -> None:
        """Never runs again: its requests and work memory go back (now, or when it ends)."""
        if not self.live:
            return
        self.live = False
        if self.hit is not None:
            self.hit.live = 0
        if _LAST.get(self.name) is self:
            del _LAST[self.name]
        op = self.operation
        if not op._active:
            self._free()

    def _free(self) -> None:
        unhold(self)
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def _raw(arr):
    """A view of ``arr``'s memory (C-contiguous, 1-D) that keeps nothing alive."""
    addr = arr.__array_interface__["data"][0] if arr.size else 0
    return np.frombuffer(MPI.buffer.fromaddress(addr, arr.nbytes), dtype=arr.dtype)


def _new(ctx, comm, memo, run, blocking):
    """A Plan of the finished plain ``run`` (engine.collectives) of the call ``memo``:
    (function name, its arguments, flat: whether validation read the buffers as flat
    memory); None for a timed call that cannot run on persistent requests."""
    name, args, flat = memo
    a, b, c, d, t = args
    plan = Plan()
    plan.name, plan.comm, plan.ctx, plan.c, plan.d, plan.t = name, comm, ctx, c, d, t
    plan.timeout = run.timeout if run.timed else None
    plan.epoch = EPOCH[0]
    plan.forced = resolve(ctx.env)["algorithm"]
    plan.live = True
    drop = _dropper(weakref.ref(plan))
    if a is _IN_PLACE:
        plan.ra = None
    else:
        plan.ra = weakref.ref(a, drop)
        plan.sa, plan.ta, plan.da = a.shape, a.strides, a.dtype
    plan.rb = weakref.ref(b, drop)
    plan.sb, plan.tb, plan.db = b.shape, b.strides, b.dtype
    # a C-contiguous buffer read as its flat memory: validation read only the dtype, the
    # contiguity and out's writeability
    plan.flat = flat and b.flags.c_contiguous and (a is _IN_PLACE or a.flags.c_contiguous)
    # a timed call ran on an observed channel: the plan runs on the plain one under it
    base = run.ch.inner if run.timed else run.ch
    # the same schedule bound again, to raw views of the call's arrays and a lease of its own
    sched = run.schedule
    plan.lease = ctx.work.lease(run.be) if sched.work else None
    views = work_views(sched, plan.lease, run.dst.dtype) if sched.work else {}
    plan.work = sum(int(v.nbytes) for v in views.values())
    if run.region is not None:  # node memory (transport.shared): region 0, blocking calls'
        views.update(_intranode.views(ctx, run.be, run.region, sched, run.dst.dtype))
    dst = _raw(run.dst)
    views[DST] = dst
    views[SRC] = dst if run.src is None or run.src is run.dst else _raw(run.src)
    steps = bind(sched, views)
    requests = ()
    plan.calls = plan.hit = None
    # a channel of its own: a non-blocking plan's restart gives it the tag of its call
    ch = Channel(base.comm, base.mpitype, base.tag, base.local, base.node_bytes)
    watch = None
    if blocking:
        timed = None if plan.timeout is None else (plan.timeout, _Expiry(run))
        program, requests = compile_bound(steps, ch, run.red, run.be, timed)
        if program is not None:
            steps = program
            _bind_hit(plan, _hit_steps(program))
        elif timed is not None:  # (only persistent requests' waits are timed here)
            return _unkept(plan)
    elif plan.timeout is not None:
        # its waits and test() poll each message's one request (a message in pieces is
        # windowed under the observed channel, so that progress shows piece by piece)
        if not one_piece(steps, ch):
            return _unkept(plan)
        watch = Timed(plan.timeout, _Expiry(run), messages(steps, ch))
    op = Operation(steps, ch, run.red, run.be, ctx=ctx, algorithm=run.name)
    op.call = watch
    op.run = _Ended(plan)
    plan.operation = op
    hold(plan, requests)
    return plan


def _unkept(plan) -> None:
    """None: a timed call that cannot keep ``plan`` after all; its work memory goes back."""
    if plan.lease is not None:
        plan.lease.release()
    return None


class _Expiry:
    """The CollectiveTimeout of a timed plan's call, as the observed channel words it
    (observe.calls.Call.expired); made only when a wait gives up.  It keeps no user memory
    (the message's type, not its array)."""

    __slots__ = ("ctx", "label", "collective", "algorithm", "msg", "total", "counts", "displs",
                 "op", "timeout", "schedule")

    def __init__(self, run):
        m = run.msg
        self.msg = Msg(None, m.dtype, m.category, m.mpitype, m.typename, m.backend)
        self.ctx, self.label, self.collective, self.algorithm = (
            run.ctx, run.label, run.collective, run.name)
        self.total, self.counts, self.displs, self.op = run.total, run.counts, run.displs, run.op
        self.timeout, self.schedule = run.timeout, run.schedule

    def __call__(self, left, idle):
        # (left: executor.timed_waitall's pending requests, their receives already
        # cancelled by transport.timeout.wait)
        left = [_observe.Req(r.req, kind, peer, nbytes, k, 0.0)
                for r in left for kind, peer, nbytes, k in (r.what,)]
        call = _observe.Call(self.ctx, self.label, self.collective, self.algorithm, self.msg,
                             self.total, self.counts, self.displs, self.op, self.timeout, (), ())
        call.use_schedule(self.schedule)
        return call.expired(left, idle, None)


def _hit_steps(program) -> list:
    """The program's steps as a hit runs them when no other operation is in flight, in
    order: (START, request), (WAIT, request) for each request waited for, (CALL, a ready
    reduction or copy), and a timed plan's waits as (TIMED, the ready wait).  Its waits
    then block in MPI without holding back anything else (the progress rule has nothing
    to advance)."""
    out = []
    for step in program:
        if step[0] == WAIT:
            out += [(WAIT, req) for req in step[2]]
        elif step[0] == CALL and getattr(step[1], "func", None) is timed_waitall:
            out.append((TIMED, step[1]))
        else:
            out.append(step[:2])
    return out


def _bind_hit(plan, steps) -> None:
    """Bind ``steps`` (:func:`_hit_steps`) as the plan's hit: ``plan.calls``, one ready
    call per step for the Python repeat, and ``plan.hit``, the same steps compiled
    (engine.native) where the context's ``native`` option is on and the module loads."""
    plan.calls = tuple(obj.Start if k == START else obj.Wait if k == WAIT else obj
                       for k, obj in steps)  # (a TIMED step's object is its ready wait)
    plan.hit = None
    mod = _compiled(resolve(plan.ctx.env))
    if mod is None:
        return
    kinds = {START: mod.START, WAIT: mod.WAIT, CALL: mod.CALL, TIMED: mod.TIMED}
    layout = (None, None) if plan.flat else (plan.sb, plan.tb)
    layout_a = (None, None) if plan.flat or plan.ra is None or plan.ra() is plan.rb() \
        else (plan.sa, plan.ta)
    da = None if plan.ra is None else plan.da
    plan.hit = mod.Hit(plan.comm, plan.rb, plan.ra, plan.c, plan.d, plan.t, plan.db, da,
                       *layout, *layout_a, plan.flat, plan.epoch, plan.ctx,
                       [(kinds[k], (obj.args[0], obj) if k == TIMED else obj)
                        for k, obj in steps])


def _dropper(ref):
    def drop(_):  # an argument array is being collected: the plan goes first
        plan = ref()
        if plan is not None:
            forget(plan)
    return drop


class _Ended:
    """What a plan's operation reports its end to: a dropped plan frees itself then."""

    __slots__ = ("plan",)

    def __init__(self, plan):
        self.plan = weakref.ref(plan)

    def ended(self, op, exc) -> None:
        plan = self.plan()
        if plan is None:
            return
        if exc is not None:  # interrupted: its requests may still be active; never again
            forget(plan)
        if not plan.live:
            plan._free()


def forget(plan) -> None:
    """Drop ``plan`` from its context and release it."""
    ctx = plan.ctx
    for table in (ctx.plans, ctx.kept):
        for key, kept in list(table.items()):
            if kept is plan:
                del table[key]
    plan.release()


def latest(ctx, name: str):
    """The blocking plan of ``name`` on ``ctx`` run (or made) last, or None."""
    for plan in reversed(ctx.plans.values()):
        if plan.name == name:
            return plan
    return None


def _slot(name, comm, a, b, c, d) -> tuple:
    """Where the plan of ``name`` called on ``comm`` with ``a``, ``b``, ``c``, ``d`` is kept
    in its context's tables: the communicator and arrays by object identity, which the
    plan's weak references prove on a hit (an object's id is not reused while the plan that
    refers to it lives), the op and the algorithm by value.  So calls that alternate ops or
    algorithms on the same arrays each repeat their own plan (one slot for all of them
    forgot and validated again at every call: 211 against 66 us for a 1 MiB AllGather
    alternating ``algorithm="ring"`` and ``"auto"``); :meth:`Plan.matches` still proves
    every field."""
    return (name, id(comm), id(a), id(b), _value(c), _value(d))


def _value(v):
    """A hashable value of an op or algorithm argument (an MPI.Op is not hashable)."""
    if v is None or type(v) is str:
        return v
    if type(v) is MPI.Op:
        return ("op", v.py2f())
    return ("id", id(v))


def key(a, b, c=None, d=None, t=None) -> tuple:
    """The arguments :func:`repeat` compares, as :func:`keep` takes them (``t``: the call's
    ``timeout=`` argument)."""
    return (a, b, c, d, t)


def _repeat(comm, name: str, a, b, c=None, d=None, t=None) -> bool:
    """Run the blocking plan of ``name`` again if ``a, b, c, d, t`` are its call's
    arguments, unchanged; False if there is none (the caller takes the general path).
    :data:`repeat` once the compiled hit is loaded: that one takes the hits it can prove
    (engine/_hit.c) and hands everything else to this one."""
    plan = _LAST.get(name)
    if plan is None or not plan.matches(comm, a, b, c, d, t):
        plans = _plans_of(comm)
        if not plans:
            return False
        key = _slot(name, comm, a, b, c, d)
        plan = plans.get(key)
        if plan is None:
            return False
        if not plan.matches(comm, a, b, c, d, t):
            # these arrays changed in place (or the options did): validated as a new call,
            # which keeps a new plan if it is plain
            forget(plan)
            return False
        plans.move_to_end(key)
        _LAST[name] = plan
    plan.ctx.seq += 1
    calls = plan.calls
    if calls is None or IN_FLIGHT:
        plan.operation.go(True)  # (the loop: it advances the operations in flight meanwhile)
        return True
    try:
        if plan.hit is not None:
            plan.hit.go()  # (the same calls, compiled)
        else:
            for call in calls:
                call()
    except BaseException:
        # interrupted (an MPI error, Ctrl-C): its requests may still be active, so the
        # plan never runs again; they are freed (MPI completes them)
        forget(plan)
        raise
    return True


repeat = _repeat  # (the compiled hit's repeat once it is loaded: _compiled)


def _compiled(opts):
    """The compiled hit module (engine.native) under options ``opts``, or None (the
    ``native`` option off, or no module: engine.native.status says why).  Once it loads,
    calls take its repeat."""
    global repeat
    if not opts["native"]:
        return None
    mod = _native.load(opts["mpicc"], opts["cache_dir"])
    if mod is not None and repeat is _repeat:
        mod.setup(_LAST, _repeat, forget, IN_FLIGHT, EPOCH, _IN_PLACE, _ndarray, MPI.Exception)
        repeat = mod.repeat
    return mod


def _plans_of(comm):
    """The blocking plans of ``comm``'s context (None without one)."""
    try:
        ctx = comm.Get_attr(_context.keyval())
    except (AttributeError, TypeError, MPI.Exception):
        return None
    return getattr(ctx, "plans", None)


def keep(ctx, comm, memo: tuple, run) -> None:
    """Keep the finished plain blocking ``run`` of the call ``memo`` (see :func:`_new`) as a
    plan on ``ctx``, keyed by its function and argument objects (the plan's weak references
    prove a hit): calls alternating between arrays (gradient buckets) each repeat theirs."""
    name, args = memo[0], memo[1]
    key = _slot(name, comm, *args[:4])
    plans = ctx.plans
    old = plans.pop(key, None)
    if old is not None:
        old.release()
    plan = _new(ctx, comm, memo, run, True)
    if plan is None:
        return
    plans[key] = plan
    _LAST[name] = plan
    while len(plans) > PLANS:
        plans.popitem(last=False)[1].release()
    held = sum(p.work for p in plans.values())
    if held > PLAN_WORK_BYTES:
        for k, p in list(plans.items())[:-1]:  # (oldest first; the new plan stays)
            if p.work:
                del plans[k]
                p.release()
                held -= p.work
                if held <= PLAN_WORK_BYTES:
                    break


def keep_started(ctx, comm, memo: tuple, run) -> None:
    """Keep the plain non-blocking call ``memo`` (started from ``run``) for its repeat."""
    name, args = memo[0], memo[1]
    key = _slot(name, comm, *args[:4])
    old = ctx.kept.pop(key, None)
    if old is not None:
        old.release()
    plan = _new(ctx, comm, memo, run, False)
    if plan is None:
        return
    ctx.kept[key] = plan
    while len(ctx.kept) > KEPT:
        ctx.kept.popitem(last=False)[1].release()


def restart(comm, name: str, a, b, c=None, d=None, t=None):
    """The kept non-blocking operation of ``name`` for these arguments (``t``: the call's
    ``timeout=``), started again; None when there is none, it is still active or its
    caller has not seen it complete."""
    try:
        ctx = comm.Get_attr(_context.keyval())
    except (AttributeError, TypeError, MPI.Exception):
        return None
    kept = getattr(ctx, "kept", None)
    if not kept:
        return None
    key = _slot(name, comm, a, b, c, d)
    plan = kept.get(key)
    if plan is None or not plan.matches(comm, a, b, c, d, t):
        return None
    op = plan.operation
    if op._active or op.owner is not None:
        return None
    kept.move_to_end(key)
    ctx.seq += 1  # every start is a call
    op.ch.tag = tag_of(ctx.seq, ctx.tag_ub)
    op.go(False)
    return op


def drop_all(ctx) -> None:
    """Drop every plan of ``ctx`` (its communicator is freed or unusable)."""
    for table in (getattr(ctx, "plans", None), getattr(ctx, "kept", None)):
        if table:
            for plan in list(table.values()):
                plan.release()
            table.clear()


__all__ = ["Plan", "repeat", "keep", "keep_started", "restart", "drop_all"]
