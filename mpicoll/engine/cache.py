"""The cache of bound calls: a repeat proven to be the same call runs without the run path.

The run path (engine.run) validates, selects, schedules and binds every
call.  A *plain* call -- host (NumPy) arrays the algorithm runs on directly,
nothing observing it but, at most, a timeout -- is then remembered in its
context's cache as an :class:`Entry`: its schedule bound once more, to views
of the call's memory, and the *signature* of its arguments.  A later call
whose signature matches runs the entry's steps again: no validation, no
choice, no binding.  One interface serves every form:

* blocking calls: :func:`repeat` (the array functions and ``mpicoll.Comm``);
* non-blocking calls: :func:`restart`, once the previous start has been
  seen complete by its request or handle;
* persistent operations: :func:`bind_once` compiles a persistent
  collective's steps after its first plain start (the binding is the
  operation's own: its buffers are fixed);
* :func:`remember` keeps a call, :meth:`Cache.drop` forgets everything (the
  communicator is freed or unusable, engine.context's hook), and a change
  of options (core.config.EPOCH) makes every entry prove itself again.

A hit is proven, never trusted
    The signature is everything validation read from the arguments: the
    communicator object, each array object (by weak reference) with its
    data address, shape, strides and dtype, ``out``'s writeability, the op
    object (a predefined op: they are never freed), the algorithm argument,
    the ``timeout=`` argument, and the options epoch.  Anything can change
    an array in place -- its dtype, shape, strides or writeable flag, and
    its data buffer too (``ndarray.__setstate__``, NumPy's pickle protocol,
    gives an array new memory of the same shape) -- so each is compared at
    every call: a call whose signature differs is a miss, validated as if
    new, which raises (before any message) or remembers a new entry.  Each
    array is matched by object in its own place (an ``out`` passed as the
    input too is another call).  ``mpicoll.Comm``'s forms take a C-contiguous
    buffer as its flat memory, whatever its shape: for them the signature is
    the dtype, C contiguity, writeability and address, which is what their
    validation reads.  They pass a spec ``[array, T]`` whose T is the datatype
    the array has anyway as the bare array (the same message; a spec is a
    new list at every call, so it could never be an entry's object); any
    other spec takes the run path.

It holds no user memory
    An entry's steps see the arrays through views made from their addresses
    (``MPI.buffer.fromaddress``), which keep nothing alive, and the entry
    refers to the arrays only weakly: when one is collected, its entry is
    dropped (and its persistent requests freed) before the memory can be
    reused.  A non-blocking call's handle keeps its arrays alive while its
    operation is in flight, as mpi4py's requests do.

How an entry runs
    A blocking entry whose messages are each at most one piece (every
    latency-bound schedule) runs on persistent point-to-point requests made
    once (``executor.compile_bound``), with the blocking calls' tag; other
    blocking entries post their messages as the run path does.  A
    non-blocking entry keeps ``Isend``/``Irecv``: its tag comes from the call
    counter, which a persistent request would fix.  Either way a repeat
    among operations in flight runs ``Operation.go``, the loop of every call,
    so it advances them while it waits.

A deadline is a property of an entry
    A call observed for its timeout alone is remembered with that timeout
    (part of the signature): a blocking entry's waits are ready calls of
    ``executor.timed_waitall`` on its persistent requests; a non-blocking
    entry's operation carries an ``executor.Timed`` where an observed call
    would be, so its waits poll and ``test()`` gives up after that long
    without progress.  Either raises the CollectiveTimeout the observed
    channel raises (:class:`_Expiry`).  A timed call whose messages are over
    one piece is not remembered: its pieces move windowed so that the
    deadline sees progress per piece, which only the observed channel does.

The compiled repeat (optional)
    Where engine.native builds it (the ``native`` option, on by default), a
    blocking entry also exists in C (``engine/_hit.c``) and :data:`repeat` is
    the C function: it proves the hit of the function's last entry field by
    field (object identity, the data addresses and layouts read from NumPy's
    array struct) and runs the same steps on the same persistent requests;
    anything it cannot prove goes to the Python :func:`repeat`, which decides
    as without it.  Its worth: docs/performance.md.

Where entries live
    ``ctx.cache`` (a :class:`Cache`): up to :data:`BLOCKING` blocking entries
    holding at most :data:`WORK_BYTES` of work memory together, up to
    :data:`NON_BLOCKING` non-blocking ones, each keyed by function and
    argument objects, least recently used dropped first; and the persistent
    operations holding compiled steps.  The last blocking entry of each
    function is also found through a module table (:data:`_LAST`), so a hit
    needs no MPI attribute lookup; an entry found there must match the
    communicator object like every other field.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np
from mpi4py import MPI

from ..algorithms.schedule import DST, SRC
from ..backends.host import FP_CONDITIONS
from ..core.config import EPOCH, resolve
from ..core.errors import MpicollError
from ..core.types import Msg
from ..observe import calls as _observe
from ..observe import check as _check
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
    failure,
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
# function name -> its last blocking Entry (any communicator); see "Where entries live"
_LAST: dict = {}
NON_BLOCKING = 16  # non-blocking entries per context
BLOCKING = 16  # blocking entries per context
# work memory the blocking entries of a context may hold together (beyond it the least
# recently run entries that hold some go, however few there are): enough for the
# latency-bound calls whose repeat the cache is for, little beside a large call's arrays
WORK_BYTES = 1 << 20
TIMED = "timed"  # a compiled step: a timed entry's wait (executor.timed_waitall)


def _address(arr) -> int:
    """The address of an array's data (0 when it has no elements)."""
    return arr.__array_interface__["data"][0] if arr.size else 0


class Entry:
    """A plain call bound for repeats, and the signature that proves a hit (see the module
    docstring).  ``out`` is the output argument, ``inp`` the input (None: in place)."""

    __slots__ = ("name", "comm", "ctx", "out_ref", "out_shape", "out_strides", "out_dtype",
                 "out_address", "in_ref", "in_shape", "in_strides", "in_dtype", "in_address",
                 "op", "algorithm", "timeout_arg", "timeout", "epoch", "forced", "flat",
                 "operation", "calls", "hit", "lease", "work", "live", "about_call",
                 "__weakref__")

    def matches(self, comm, a, b, c, d, t) -> bool:
        """Whether a call with these arguments is this entry's call, unchanged."""
        if not (self.comm is comm and self.out_ref() is b and self.live
                and (self.op is c or self.op == c) and (self.algorithm is d or self.algorithm == d)
                and b.dtype is self.out_dtype
                and (self.timeout_arg is t or (type(t) is type(self.timeout_arg)
                                               and self.timeout_arg == t))):
            return False
        flat = self.flat
        if flat:
            f = b.flags
            if not (f.c_contiguous and f.writeable):
                return False
        elif not (b.strides == self.out_strides and b.shape == self.out_shape
                  and b.flags.writeable):
            return False
        if _address(b) != self.out_address:
            return False
        ref = self.in_ref
        if ref is None:
            if a is not _IN_PLACE:
                return False
        elif ref() is not a:
            return False
        elif a is not b:  # (a is b: the entry's call was in place too, and b is checked)
            if a.dtype is not self.in_dtype:
                return False
            if flat:
                if not a.flags.c_contiguous:
                    return False
            elif a.strides != self.in_strides or a.shape != self.in_shape:
                return False
            if _address(a) != self.in_address:
                return False
        return self.epoch == EPOCH[0] or self._still_plain()

    def _still_plain(self) -> bool:
        """After a change of options: whether a call now still runs as this entry's did
        (unobserved, the same forced algorithm); then it holds for the new epoch."""
        opts = resolve(self.ctx.env)
        if opts["check"] or opts["algorithm"] != self.forced or opts["deterministic"] \
                or _observe.observing() or (self.timeout_arg is None
                                            and opts["timeout"] != self.timeout) \
                or (self.hit is not None) != (self.calls is not None and _compiled(opts)
                                              is not None):
            return False
        self.epoch = EPOCH[0]
        if self.hit is not None:
            self.hit.epoch = self.epoch
        return True

    def about(self):
        return self.about_call

    def release(self) -> None:
        """Never runs again: its requests and work memory go back (now, or when it ends)."""
        if not self.live:
            return
        self.live = False
        if self.hit is not None:
            self.hit.live = 0
        if _LAST.get(self.name) is self:
            del _LAST[self.name]
        if not self.operation._active:
            self._free()

    def _free(self) -> None:
        unhold(self)
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class Cache:
    """A context's bound calls (see "Where entries live")."""

    __slots__ = ("blocking", "non_blocking", "programs")

    def __init__(self):
        self.blocking = OrderedDict()      # key -> Entry (least recently run first)
        self.non_blocking = OrderedDict()  # key -> Entry (least recently started first)
        self.programs = weakref.WeakSet()  # bound persistent operations holding requests

    def drop(self) -> None:
        """Forget every entry, and the compiled steps of every inactive persistent operation
        (an active one keeps them until it is freed, or at exit)."""
        for table in (self.blocking, self.non_blocking):
            for entry in list(table.values()):
                entry.release()
            table.clear()
        for b in list(self.programs):
            if b.operation is not None and b.operation._active:
                continue
            b.program = None
            unhold(b)
        self.programs.clear()


def _cache_of(ctx) -> Cache:
    cache = ctx.cache
    if cache is None:
        cache = ctx.cache = Cache()
    return cache


def _raw(arr):
    """A view of ``arr``'s memory (C-contiguous, 1-D) that keeps nothing alive."""
    addr = arr.__array_interface__["data"][0] if arr.size else 0
    return np.frombuffer(MPI.buffer.fromaddress(addr, arr.nbytes), dtype=arr.dtype)


def _entry(ctx, key, b, blocking):
    """An Entry of the finished plain call ``b`` (engine.run.Bound) for the cache key
    ``key`` (function name, its arguments, flat: whether validation read the buffers as
    flat memory); None for a timed call that cannot run on persistent requests."""
    name, args, flat = key
    a, out, c, d, t = args
    e = Entry()
    e.name, e.comm, e.ctx, e.op, e.algorithm, e.timeout_arg = name, b.call.comm, ctx, c, d, t
    e.timeout = b.timeout if b.timed else None
    e.epoch = EPOCH[0]
    e.forced = resolve(ctx.env)["algorithm"]
    e.live = True
    m = b.msg
    e.about_call = (b.label, 0, b.name, f"{b.total} x {_check.dtype_label(m)}", ctx,
                    b.schedule, m.mpitype.Get_size())
    drop = _dropper(weakref.ref(e))
    if a is _IN_PLACE:
        e.in_ref = None
    else:
        e.in_ref = weakref.ref(a, drop)
        e.in_shape, e.in_strides, e.in_dtype, e.in_address = a.shape, a.strides, a.dtype, \
            _address(a)
    e.out_ref = weakref.ref(out, drop)
    e.out_shape, e.out_strides, e.out_dtype, e.out_address = out.shape, out.strides, \
        out.dtype, _address(out)
    # a C-contiguous buffer read as its flat memory: validation read only the dtype, the
    # contiguity and out's writeability
    e.flat = flat and out.flags.c_contiguous and (a is _IN_PLACE or a.flags.c_contiguous)
    # a timed call ran on an observed channel: the entry runs on the plain one under it
    base = b.ch.inner if b.timed else b.ch
    # the same schedule bound again, to raw views of the call's arrays and a lease of its own
    sched = b.schedule
    e.lease = ctx.work.lease(b.be) if sched.work else None
    views = work_views(sched, e.lease, b.dst.dtype) if sched.work else {}
    e.work = sum(int(v.nbytes) for v in views.values())
    if b.region is not None:  # node memory (engine.intranode): region 0, blocking calls'
        views.update(_intranode.views(ctx, b.be, b.region, sched, b.dst.dtype))
    dst = _raw(b.dst)
    views[DST] = dst
    views[SRC] = dst if b.src is None or b.src is b.dst else _raw(b.src)
    steps = bind(sched, views)
    requests = ()
    e.calls = e.hit = None
    # a channel of its own: a non-blocking entry's restart gives it the tag of its call
    ch = Channel(base.comm, base.mpitype, base.tag, base.local, base.node_bytes)
    watch = None
    if blocking and sched.parts:
        # a pipeline keeps its chunks in flight together (Operation.parts): its repeat is
        # the operation's loop, not the steps in order
        if e.timeout is not None:
            if not one_piece(steps, ch):
                return _unkept(e)
            watch = Timed(e.timeout, _Expiry(b), messages(steps, ch))
    elif blocking:
        timed = None if e.timeout is None else (e.timeout, _Expiry(b))
        program, requests = compile_bound(steps, ch, b.red, b.be, timed)
        if program is not None:
            steps = program
            _bind_hit(e, _hit_steps(program))
        elif timed is not None:  # (only persistent requests' waits are timed here)
            return _unkept(e)
    elif e.timeout is not None:
        # its waits and test() poll each message's one request (a message in pieces is
        # windowed under the observed channel, so that progress shows piece by piece)
        if not one_piece(steps, ch):
            return _unkept(e)
        watch = Timed(e.timeout, _Expiry(b), messages(steps, ch))
    op = Operation(steps, ch, b.red, b.be, ctx=ctx, algorithm=b.name)
    op.parts, op.depth = sched.parts, sched.depth
    op.call = watch
    op.run = _Ended(e)
    e.operation = op
    hold(e, requests)
    return e


def _unkept(e) -> None:
    """None: a timed call that cannot be remembered after all; its work memory goes back."""
    if e.lease is not None:
        e.lease.release()
    return None


class _Expiry:
    """The CollectiveTimeout of a timed entry's call, as the observed channel words it
    (observe.calls.Call.expired); made only when a wait gives up.  It keeps no user memory
    (the message's type, not its array)."""

    __slots__ = ("ctx", "label", "collective", "algorithm", "msg", "total", "counts", "displs",
                 "op", "timeout", "schedule")

    def __init__(self, b):
        m = b.msg
        c = b.call
        self.msg = Msg(None, m.dtype, m.category, m.mpitype, m.typename, m.backend)
        self.ctx, self.label, self.collective, self.algorithm = (
            b.ctx, b.label, c.collective, b.name)
        self.total, self.counts, self.displs, self.op = b.total, c.counts, c.displs, c.op
        self.timeout, self.schedule = b.timeout, b.schedule

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
    reduction or copy), and a timed entry's waits as (TIMED, the ready wait).  Its waits
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


def _bind_hit(e, steps) -> None:
    """Bind ``steps`` (:func:`_hit_steps`) as the entry's hit: ``e.calls``, one ready call
    per step for the Python repeat, and ``e.hit``, the same steps compiled (engine.native)
    where the context's ``native`` option is on and the module loads."""
    e.calls = tuple(obj.Start if k == START else obj.Wait if k == WAIT else obj
                    for k, obj in steps)  # (a TIMED step's object is its ready wait)
    e.hit = None
    mod = _compiled(resolve(e.ctx.env))
    if mod is None:
        return
    kinds = {START: mod.START, WAIT: mod.WAIT, CALL: mod.CALL, TIMED: mod.TIMED}
    layout = (None, None) if e.flat else (e.out_shape, e.out_strides)
    a = None if e.in_ref is None else e.in_ref()
    layout_a = (None, None) if e.flat or a is None or a is e.out_ref() \
        else (e.in_shape, e.in_strides)
    in_dtype = None if e.in_ref is None else e.in_dtype
    in_address = 0 if e.in_ref is None else e.in_address
    e.hit = mod.Hit(e.comm, e.out_ref, e.in_ref, e.op, e.algorithm, e.timeout_arg, e.out_dtype,
                    in_dtype, *layout, *layout_a, e.flat, e.out_address, in_address, e.epoch,
                    e.ctx, [(kinds[k], (obj.args[0], obj) if k == TIMED else obj)
                            for k, obj in steps])


def _dropper(ref):
    def drop(_):  # an argument array is being collected: the entry goes first
        e = ref()
        if e is not None:
            forget(e)
    return drop


class _Ended:
    """What an entry's operation reports its end to: a dropped entry frees itself then."""

    __slots__ = ("entry",)

    def __init__(self, e):
        self.entry = weakref.ref(e)

    def ended(self, op, exc) -> None:
        e = self.entry()
        if e is None:
            return
        if exc is not None:  # interrupted: its requests may still be active; never again
            forget(e)
        if not e.live:
            e._free()

    def about(self):
        e = self.entry()
        return None if e is None else _about(e)


def _about(e):
    label, _, name, what, ctx, schedule, wire = e.about_call
    return label, ctx.seq, name, what, ctx, schedule, wire


def forget(e) -> None:
    """Drop entry ``e`` from its context's cache and release it."""
    cache = e.ctx.cache
    if cache is not None:
        for table in (cache.blocking, cache.non_blocking):
            for key, kept in list(table.items()):
                if kept is e:
                    del table[key]
    e.release()


def _failed(e, exc, index=None):
    """The exception a hit of ``e`` that failed raises (``exc``; an MPI error as the
    :class:`~mpicoll.MessageError` naming its message), after forgetting ``e``: its
    requests may still be active, so it never runs again (MPI completes and frees them).
    ``index``: the step of ``e.calls`` that failed, where known."""
    forget(e)
    if isinstance(exc, MPI.Exception) and not isinstance(exc, MpicollError):
        if index is None and e.hit is not None:
            index = e.hit.failed_at
        step = _calls_step(e, index)
        if step is not None:
            return failure(_Failed(e), step, exc)
    return exc


class _Failed:
    """An entry as executor.failure reads a failed operation's ``run``."""

    __slots__ = ("run", "_reqs")

    def __init__(self, e):
        self.run, self._reqs = _Ended(e), None


def _calls_step(e, index):
    """The executor step (WAIT, handles, requests) of ``e.calls[index]``, or None."""
    if index is None or index < 0:
        return None
    k = 0
    for step in e.operation.steps:
        n = len(step[2]) if step[0] == WAIT else 1
        if k <= index < k + n:
            if step[0] == WAIT:
                j = index - k
                return (WAIT, (step[1][j],), (step[2][j],))
            return step
        k += n
    return None


def latest(ctx, name: str):
    """The blocking entry of ``name`` on ``ctx`` run (or made) last, or None."""
    cache = ctx.cache
    if cache is None:
        return None
    for e in reversed(cache.blocking.values()):
        if e.name == name:
            return e
    return None


def _slot(name, comm, a, b, c, d) -> tuple:
    """Where the entry of ``name`` called on ``comm`` with ``a``, ``b``, ``c``, ``d`` is
    kept in its context's cache: the communicator and arrays by object identity, which
    the entry's weak references prove on a hit (an object's id is not reused while the
    entry that refers to it lives), the op and the algorithm by value.  So calls that
    alternate ops or algorithms on the same arrays each repeat their own entry;
    :meth:`Entry.matches` still proves every field."""
    return (name, id(comm), id(a), id(b), _value(c), _value(d))


def _value(v):
    """A hashable value of an op or algorithm argument (an MPI.Op is not hashable)."""
    if v is None or type(v) is str:
        return v
    if type(v) is MPI.Op:
        return ("op", v.py2f())
    return ("id", id(v))


def _blocking_of(comm):
    """The blocking entries of ``comm``'s context (None without one)."""
    try:
        ctx = comm.Get_attr(_context.keyval())
    except (AttributeError, TypeError, MPI.Exception):
        return None
    cache = getattr(ctx, "cache", None)
    return None if cache is None else cache.blocking


def _repeat(comm, name: str, a, b, c=None, d=None, t=None) -> bool:
    """Run the blocking entry of ``name`` again if ``a, b, c, d, t`` are its call's
    arguments, unchanged; False if there is none (the caller takes the run path).
    :data:`repeat` once the compiled repeat is loaded: that one takes the hits it can
    prove (engine/_hit.c) and hands everything else to this one."""
    e = _LAST.get(name)
    if e is None or not e.matches(comm, a, b, c, d, t):
        table = _blocking_of(comm)
        if not table:
            return False
        key = _slot(name, comm, a, b, c, d)
        e = table.get(key)
        if e is None:
            return False
        if not e.matches(comm, a, b, c, d, t):
            # these arrays changed in place (or the options did): validated as a new call,
            # which remembers a new entry if it is plain
            forget(e)
            return False
        table.move_to_end(key)
        _LAST[name] = e
    e.ctx.seq += 1
    calls = e.calls
    if calls is None or IN_FLIGHT:
        e.operation.go(True)  # (the loop: it advances the operations in flight meanwhile)
        return True
    i = -1
    try:
        if e.hit is not None:
            e.hit.go()  # (the same calls, compiled)
        else:
            for call in calls:
                i += 1  # (which call failed, if one does: _failed)
                try:
                    call()
                except FP_CONDITIONS:  # (written: IEEE, as MPI's; backends.host)
                    pass
    except BaseException as exc:
        # interrupted (an MPI error, Ctrl-C): its requests may still be active, so the
        # entry never runs again; they are freed (MPI completes them)
        raise _failed(e, exc, None if e.hit is not None else i) from None
    return True


repeat = _repeat  # (the compiled repeat once it is loaded: _compiled)


def _compiled(opts):
    """The compiled repeat module (engine.native) under options ``opts``, or None (the
    ``native`` option off, or no module: engine.native.status says why).  Once it loads,
    calls take its repeat."""
    global repeat
    if not opts["native"]:
        return None
    mod = _native.load(opts["mpicc"], opts["cache_dir"])
    if mod is not None and repeat is _repeat:
        mod.setup(_LAST, _repeat, _failed, IN_FLIGHT, EPOCH, _IN_PLACE, _ndarray, MPI.Exception)
        repeat = mod.repeat
    return mod


def remember(ctx, key: tuple, b, blocking: bool) -> None:
    """Keep the finished plain call ``b`` (engine.run.Bound) of the public call ``key``
    (function name, its arguments, flat) in ``ctx``'s cache, keyed by its function and
    argument objects: calls alternating between arrays (gradient buckets) each repeat
    theirs."""
    name, args = key[0], key[1]
    slot = _slot(name, b.call.comm, *args[:4])
    cache = _cache_of(ctx)
    table = cache.blocking if blocking else cache.non_blocking
    old = table.pop(slot, None)
    if old is not None:
        old.release()
    e = _entry(ctx, key, b, blocking)
    if e is None:
        return
    table[slot] = e
    if not blocking:
        while len(table) > NON_BLOCKING:
            table.popitem(last=False)[1].release()
        return
    _LAST[name] = e
    while len(table) > BLOCKING:
        table.popitem(last=False)[1].release()
    held = sum(x.work for x in table.values())
    if held > WORK_BYTES:
        for k, x in list(table.items())[:-1]:  # (oldest first; the new entry stays)
            if x.work:
                del table[k]
                x.release()
                held -= x.work
                if held <= WORK_BYTES:
                    break


def restart(comm, name: str, a, b, c=None, d=None, t=None):
    """The remembered non-blocking operation of ``name`` for these arguments (``t``: the
    call's ``timeout=``), started again; None when there is none, it is still active or
    its caller has not seen it complete."""
    try:
        ctx = comm.Get_attr(_context.keyval())
    except (AttributeError, TypeError, MPI.Exception):
        return None
    cache = getattr(ctx, "cache", None)
    if cache is None or not cache.non_blocking:
        return None
    table = cache.non_blocking
    slot = _slot(name, comm, a, b, c, d)
    e = table.get(slot)
    if e is None or not e.matches(comm, a, b, c, d, t):
        return None
    op = e.operation
    if op._active or op.owner is not None:
        return None
    table.move_to_end(slot)
    ctx.seq += 1  # every start is a call
    op.ch.tag = tag_of(ctx.seq, ctx.tag_ub)
    op.go(False)
    return op


def bind_once(b) -> None:
    """A persistent operation's bound call ``b`` (engine.run.Bound), started plain once:
    its later starts run on persistent requests, bound now (its buffers are fixed)."""
    steps, requests = compile_bound(b.steps, b.ch, b.red, b.be)
    if steps is not None:
        b.program = (steps, b.ch, b.red, b.be)
        hold(b, requests)
        _cache_of(b.ctx).programs.add(b)


def unbind(b) -> None:
    """Free what :func:`bind_once` made for ``b``."""
    unhold(b)


__all__ = ["Entry", "Cache", "repeat", "restart", "remember", "bind_once", "unbind", "latest"]
