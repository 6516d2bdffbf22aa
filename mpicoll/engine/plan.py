"""Plans: what a call signature decides once, and the repeated call that only moves data.

The general path of a blocking call (engine.collectives) validates, chooses
the algorithm, finds the schedule (cached per call shape on the context,
:meth:`Context.schedule`), binds it to the call's arrays and runs it.  When
the call was plain -- host (NumPy) arrays the algorithm runs on directly,
nothing observing it (no check, timeout, trace or traffic counter, no
``MPICOLL_ALGORITHM``) -- it leaves a :class:`Plan` on the context, under
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
"""

from __future__ import annotations

from mpi4py import MPI

from ..observe import calls as _observe
from . import context as _context
from .executor import run_blocking


class Plan:
    """A bound blocking call, run again by :func:`repeat`."""

    __slots__ = ("args", "algorithm", "bound", "nops", "ch", "red", "be", "lease", "fn",
                 "fnargs")

    def run(self, ctx) -> None:
        ctx.seq += 1
        if self.fn is not None:
            self.fn(*self.fnargs)
        else:
            run_blocking(self.bound, self.nops, self.ch, self.red, self.be)

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def repeat(comm, name: str, args: tuple) -> bool:
    """Run ``comm``'s plan for ``name`` again if ``args`` are its objects; False if not done.

    ``args``: the public function's arguments that decide the call (buffers,
    op, algorithm), compared by identity.
    """
    try:
        ctx = comm.Get_attr(_context.keyval())
    except (AttributeError, TypeError, MPI.Exception):
        return False
    if ctx is None:
        return False
    plans = getattr(ctx, "plans", None)
    if not plans:
        return False
    plan = plans.get(name)
    if plan is None:
        return False
    mine = plan.args
    same = len(mine) == len(args)
    if same:
        for a, b in zip(mine, args):
            if a is not b:
                same = False
                break
    if not same:
        # another call of this function: its work memory goes back before that
        # call takes its own (it keeps a new plan if it is plain)
        del plans[name]
        plan.release()
        return False
    if not _observe.quiet() or _observe.broken(ctx):
        return False
    plan.run(ctx)
    return True


def keep(ctx, name: str, args: tuple, run) -> None:
    """Make the finished blocking ``run`` (engine.collectives) the plan of ``name`` on ``ctx``."""
    plans = ctx.plans
    old = plans.pop(name, None)
    if old is not None:
        old.release()
    plan = Plan()
    plan.args = args
    plan.algorithm = run.name
    plan.bound, plan.nops, plan.ch, plan.red, plan.be = run.bound, run.nops, run.ch, run.red, run.be
    plan.lease = run.lease
    run.lease = None  # the plan holds the work memory now
    if run.fn is not None:
        plan.fn = run.fn
        plan.fnargs = run.fnargs()
    else:
        plan.fn = plan.fnargs = None
    plans[name] = plan
