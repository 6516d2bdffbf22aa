"""Plans: what a call signature decides once, and the repeated call that only moves data.

The general path of a blocking call (engine.collectives) validates, chooses
the algorithm, finds the schedule (cached per call shape on the context,
:meth:`Context.schedule`), binds it to the call's arrays and runs it.  When
the call was plain -- host (NumPy) arrays the algorithm runs on directly,
nothing observing it (no check, timeout, trace or traffic counter, no
``MPICOLL_ALGORITHM``, no API option set but ``check=False``; see
:func:`mpicoll.observe.calls.quiet`) -- it leaves a :class:`Plan` on the
context, under
the public function's name: the argument objects it was called with and
everything decided from them (the algorithm, the bound operations, the
channel, the reducer, the work memory, held by a lease of the arena).

:func:`repeat` is what the public functions try first: when the arguments
are the *same objects* as that call's (the training loop: the same buffers
every step) and still nothing observes, it runs the bound operations again
-- no validation, no choice, no binding, no allocation.  The plan keeps its
argument objects referenced, so they cannot be freed and their ids reused,
nor resized (NumPy refuses to resize an array something else refers to);
only NumPy arrays and ``MPI.IN_PLACE`` qualify as such objects (a list spec
could be changed between calls).  One plan is kept per public function and
communicator; a call with other arguments drops it (releasing its work
memory before taking its own) and may leave its own.

Cost of a hit
    The last plan of each function is also kept in a module-level table by
    the communicator *object* it was called with, so a hit needs no MPI
    attribute lookup; the context's table (``ctx.plans``, found through the
    communicator's attribute) serves other objects of the same communicator.
    A plan whose messages are each at most one piece (every latency-bound
    schedule: recursive doubling, halving, Bruck, and the ring on small
    arrays) is compiled (``executor.compile_bound``, which persistent
    operations share) into a tuple of ready calls, run one after the
    other: the reduction's ufunc with its operands, copies, one array object
    per memory region, and each message a persistent request made once per
    plan (``Recv_init``/``Send_init`` on the context's duplicate
    communicator), started where the schedule posts it and waited for where
    it waits (an exchange: ``recv.Start, send.Start, send.Wait, recv.Wait``).
    On the plan's fixed buffers this is the cheapest
    exchange mpi4py offers (``python -m mpicoll.tools.latency``, columns
    ``sendrecv`` and ``persist``, docs/performance.md).  The plan frees its
    requests when it is dropped (another call of the function, the
    communicator freed or unusable) and at interpreter exit, before MPI is
    finalized.  The hit itself -- one dictionary lookup, the identity of the
    communicator and up to four arguments, :func:`mpicoll.observe.calls.quiet`
    written out inline for its common case, the call counter -- costs
    0.22-0.26 us at one rank (docs/performance.md has the measurement).

The end of this module keeps the operations of plain non-blocking calls for
their repeats (:func:`restart`).
"""

from __future__ import annotations

import atexit

from mpi4py import MPI

from ..observe import calls as _observe
from . import context as _context
from .executor import IN_FLIGHT, START, WAIT, compile_bound, free_requests, run_blocking

_quiet = _observe.quiet
_ACTIVE, _RECORDING, _LOUD, _ENV, (_K1, _K2, _K3) = _observe.COMMON_QUIET

# function name -> the Plan of its last plain call (any communicator); see "Cost of a hit"
_LAST: dict = {}
# the plans holding persistent requests: freed at exit, before MPI_Finalize (see release)
_HOLDING: set = set()


class Plan:
    """A bound blocking call, run again by :func:`repeat` (its ``steps``, else its ``bound`` ops)."""

    __slots__ = ("comm", "ctx", "a", "b", "c", "d", "algorithm", "steps", "requests",
                 "bound", "nops", "ch", "red", "be", "lease")

    @property
    def live(self) -> bool:
        """False once dropped (it never runs again)."""
        return self.comm is not None

    def release(self) -> None:
        """The plan is dropped: it never runs again; its requests and work memory go back."""
        self.comm = None  # dropped (a hit compares the communicator first)
        free_requests(self.requests)
        self.requests = ()
        _HOLDING.discard(self)
        if self.lease is not None:
            self.lease.release()
            self.lease = None


@atexit.register
def _release_at_exit() -> None:
    # Persistent requests must be freed before MPI_Finalize (MPICH warns of each one
    # left); mpi4py finalizes MPI after the interpreter's atexit handlers have run.
    for plan in tuple(_HOLDING):
        plan.release()


def key(a, b, c=None, d=None) -> tuple:
    """The arguments :func:`repeat` compares, as :func:`keep` takes them."""
    return (a, b, c, d)


def repeat(comm, name: str, a, b, c=None, d=None) -> bool:
    """Run ``comm``'s plan for ``name`` again if ``a, b, c, d`` are its objects; False if not done.

    ``a``-``d``: the public function's arguments that decide the call
    (buffers, op, algorithm; :func:`key` of the same), compared by identity.
    """
    plan = _LAST.get(name)
    # (the test of _from_context, written out: this is the hot path)
    if plan is None or plan.comm is not comm or plan.a is not a or plan.b is not b \
            or plan.c is not c or plan.d is not d:
        plan = _from_context(comm, name, a, b, c, d)
        if plan is None:
            return False
    # (quiet() written out for its common case: nothing on, no setting but check=False)
    if IN_FLIGHT or _ACTIVE or _RECORDING or _LOUD or _K1 in _ENV or _K2 in _ENV \
            or _K3 in _ENV:
        if IN_FLIGHT or not _quiet():
            return False  # (a blocking wait must advance the operations in flight: executor)
    plan.ctx.seq += 1
    steps = plan.steps
    try:
        if steps is not None:
            for step in steps:
                step()
        else:
            run_blocking(plan.bound, plan.nops, plan.ch, plan.red, plan.be)
    except BaseException:
        # interrupted (KeyboardInterrupt, an MPI error): its requests may still be
        # active, so the plan never runs again; they are freed (MPI completes them)
        _drop(plan, name)
        raise
    return True


def _drop(plan, name: str) -> None:
    plans = plan.ctx.plans
    if plans.get(name) is plan:
        del plans[name]
    if _LAST.get(name) is plan:
        del _LAST[name]
    plan.release()


def _from_context(comm, name, a, b, c, d):
    """The plan of ``name`` on ``comm``'s context if ``a``-``d`` are its objects, else None."""
    try:
        ctx = comm.Get_attr(_context.keyval())
    except (AttributeError, TypeError, MPI.Exception):
        return None
    plans = getattr(ctx, "plans", None)
    if not plans:
        return None
    plan = plans.get(name)
    if plan is None:
        return None
    if not plan.live or plan.a is not a or plan.b is not b or plan.c is not c or plan.d is not d:
        # another call of this function: its work memory goes back before that
        # call takes its own (it keeps a new plan if it is plain)
        del plans[name]
        plan.release()
        return None
    _LAST[name] = plan
    return plan


def drop_all(ctx) -> None:
    """Drop every plan and kept operation of ``ctx`` (its communicator is freed or unusable)."""
    plans = getattr(ctx, "plans", None)
    if plans:
        for plan in plans.values():
            plan.release()
        plans.clear()
    kept = getattr(ctx, "kept", None)
    if kept:
        for entry in kept.values():
            entry.release()
        kept.clear()


def keep(ctx, comm, name: str, args: tuple, run) -> None:
    """Make the finished blocking ``run`` (engine.collectives) the plan of ``name`` on ``ctx``."""
    plans = ctx.plans
    old = plans.pop(name, None)
    if old is not None:
        old.release()
    if run.bound is None:  # an algorithm that runs as a function: no bound ops to run again
        run.release()
        return
    plan = Plan()
    plan.comm, plan.ctx, plan.algorithm = comm, ctx, run.name
    plan.a, plan.b, plan.c, plan.d = args  # (plan.key's four)
    plan.bound, plan.nops, plan.ch, plan.red, plan.be = run.bound, run.nops, run.ch, run.red, run.be
    plan.lease = run.lease
    run.lease = None  # the plan holds the work memory now
    plan.steps, plan.requests = _compile(run.bound, run.ch, run.red, run.be)
    if plan.requests:
        _HOLDING.add(plan)
    plans[name] = plan
    _LAST[name] = plan


def _compile(bound, ch, red, be):
    """(the bound ops as a tuple of ready calls, their persistent requests); (None, ()) when
    some op cannot be (executor.compile_bound)."""
    prog, requests = compile_bound(bound, ch, red, be)
    if prog is None:
        return None, ()
    steps = []
    for kind, x in prog:
        if kind == START:
            steps.append(x.Start)
        elif kind == WAIT:
            steps += [req.Wait for req in x]
        else:
            steps.append(x)
    return tuple(steps), requests


# --- repeated non-blocking calls -------------------------------------------------------
# A plain non-blocking call (engine.collectives._kept) leaves its operation on the
# context, keyed by the public function's name and the ids of the communicator object
# and the argument objects (which the entry keeps referenced, so the ids cannot be
# reused).  The same call again -- the same objects, the operation complete and seen
# complete by its request or handle, nothing observing -- restarts that operation
# with the tag of the call it now is: no validation, no choice, no binding, no
# allocation.  The messages keep the general path's isend/irecv, because a
# non-blocking operation's tag comes from the call counter and a restart is a
# per-rank decision (persistent requests would fix the tag).  As for the plans, a
# module-level table finds an entry without an MPI attribute lookup; the context's
# table bounds them and drops them with the communicator.
KEPT = 16  # kept operations per context (least recently started dropped first)
_KEPT: dict = {}  # key -> Kept, over every context


class Kept:
    """A kept non-blocking operation, the context and the objects it was started with."""

    __slots__ = ("key", "refs", "ctx", "op")

    def __init__(self, key, refs, ctx, op):
        self.key, self.refs, self.ctx, self.op = key, refs, ctx, op

    def release(self) -> None:
        """Never restarted again: its work memory goes back (now, or when it ends)."""
        if _KEPT.get(self.key) is self:
            del _KEPT[self.key]
        op = self.op
        op._run.plannable = False
        if not op._active:
            op._run.release()


def keep_started(ctx, comm, name: str, args: tuple, op) -> None:
    """Keep the started non-blocking ``op`` of ``name`` on ``comm`` with argument objects
    ``args`` (:func:`key`'s four)."""
    kept = ctx.kept
    key = (name, id(comm)) + tuple(map(id, args))
    old = kept.pop(key, None)
    if old is not None:
        old.release()
    kept[key] = _KEPT[key] = Kept(key, (comm,) + tuple(args), ctx, op)
    while len(kept) > KEPT:
        kept.popitem(last=False)[1].release()


def restart(comm, name: str, a, b, c=None, d=None):
    """``comm``'s kept operation of ``name`` for the objects ``a``-``d``, started again; None
    when there is none, or it is not complete, or its caller has not seen it complete, or
    something observes calls (then the general path runs)."""
    key = (name, id(comm), id(a), id(b), id(c), id(d))
    entry = _KEPT.get(key)
    if entry is None:
        return None
    op = entry.op
    if op._active or op.owner is not None:
        return None
    # (quiet() written out for its common case, as in repeat)
    if _ACTIVE or _RECORDING or _LOUD or _K1 in _ENV or _K2 in _ENV or _K3 in _ENV:
        if not _quiet():
            return None
    entry.ctx.kept.move_to_end(key)
    op.restart()
    return op
