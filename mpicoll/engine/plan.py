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
    A plan whose schedule is only ``Sendrecv``, reductions and copies (every
    latency-bound schedule: recursive doubling, halving, Bruck) is compiled
    into a tuple of ready calls -- ``comm.Sendrecv`` with its arrays (bare
    when mpi4py infers the same datatype), the reduction's ufunc with its
    operands, one array object per memory region -- run one after the other.
    Point-to-point persistent requests (``Send_init``/``Recv_init``,
    ``Startall``) were measured against ``Sendrecv`` for these fixed buffers
    (``python -m mpicoll.tools.latency``, columns ``sendrecv`` and
    ``persist``, 2 ranks, loaded machine): on Open MPI not faster at 16 B
    (0.1 us slower) and 0.3 us faster at 4 KiB; on MPICH 0.3-0.5 us faster.
    A plan still uses ``Sendrecv``: persistent requests would have to be
    freed before their communicator and before ``MPI_Finalize``, which plans
    do not arrange yet.
"""

from __future__ import annotations

from functools import partial
from operator import is_

import numpy as np
from mpi4py import MPI

from ..core import types as _types
from ..observe import calls as _observe
from . import context as _context
from .executor import COPY, IN_FLIGHT, REDUCE, SENDRECV, run_blocking

_quiet = _observe.quiet

# function name -> the Plan of its last plain call (any communicator); see "Cost of a hit"
_LAST: dict = {}


class Plan:
    """A bound blocking call, run again by :func:`repeat` (its ``steps``, else its ``bound`` ops)."""

    __slots__ = ("comm", "ctx", "args", "algorithm", "steps", "bound", "nops", "ch", "red",
                 "be", "lease", "live")

    def release(self) -> None:
        """The plan is dropped: it never runs again; its work memory goes back."""
        self.live = False
        if self.lease is not None:
            self.lease.release()
            self.lease = None


def _same(mine: tuple, args: tuple) -> bool:
    if len(mine) != len(args):
        return False
    for a, b in zip(mine, args):
        if a is not b:
            return False
    return True


def repeat(comm, name: str, args: tuple) -> bool:
    """Run ``comm``'s plan for ``name`` again if ``args`` are its objects; False if not done.

    ``args``: the public function's arguments that decide the call (buffers,
    op, algorithm), compared by identity.
    """
    plan = _LAST.get(name)
    if plan is None or plan.comm is not comm or not plan.live or not all(map(is_, plan.args, args)):
        plan = _from_context(comm, name, args)
        if plan is None:
            return False
    if IN_FLIGHT or not _quiet():
        return False  # (a blocking wait must advance the operations in flight: executor)
    plan.ctx.seq += 1
    steps = plan.steps
    if steps is not None:
        for step in steps:
            step()
    else:
        run_blocking(plan.bound, plan.nops, plan.ch, plan.red, plan.be)
    return True


def _from_context(comm, name, args):
    """The plan of ``name`` on ``comm``'s context if ``args`` are its objects, else None."""
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
    if not plan.live or not _same(plan.args, args):
        # another call of this function: its work memory goes back before that
        # call takes its own (it keeps a new plan if it is plain)
        del plans[name]
        plan.release()
        return None
    _LAST[name] = plan
    return plan


def drop_all(ctx) -> None:
    """Drop every plan of ``ctx`` (its communicator is freed or unusable)."""
    plans = getattr(ctx, "plans", None)
    if plans:
        for plan in plans.values():
            plan.release()
        plans.clear()


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
    plan.comm, plan.ctx, plan.args, plan.algorithm = comm, ctx, args, run.name
    plan.bound, plan.nops, plan.ch, plan.red, plan.be = run.bound, run.nops, run.ch, run.red, run.be
    plan.lease = run.lease
    run.lease = None  # the plan holds the work memory now
    plan.steps = _compile(run.bound, run.red, run.be)
    plan.live = True
    plans[name] = plan
    _LAST[name] = plan


def _compile(bound, red, be):
    """The bound ops as a tuple of ready calls, or None if some op needs requests kept."""
    steps = []
    ufunc = getattr(red, "ufunc", None)
    one = _Views()
    for op in bound:
        k = op[0]
        if k == SENDRECV:
            fn, sspec, dest, stag, rspec, src, rtag = op[1:]
            steps.append(partial(fn, one(_bare(sspec)), dest, stag, one(_bare(rspec)), src, rtag))
        elif k == REDUCE:
            a, b, out = one(op[1]), one(op[2]), one(op[3])
            if ufunc is not None:
                steps.append(partial(ufunc, a, b, out))  # (positional out: no kwargs dict)
            else:
                steps.append(partial(red, a, b, out))
        elif k == COPY:
            steps.append(partial(be.copy, one(op[1]), one(op[2])))
        else:
            return None
    return tuple(steps)


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


def _bare(spec):
    """The array of a ``[array, datatype]`` spec when mpi4py infers that datatype from it.

    mpi4py reads a bare NumPy array's datatype from its type code
    (:func:`mpicoll.core.types.natural_type`); parsing the two-item list
    costs up to 0.4 us more per ``Sendrecv`` at 16 B (measured at 2 ranks,
    loaded machine, noisy), so a plan passes the array alone
    whenever that is the same message: a C-contiguous NumPy array whose
    natural datatype is the very datatype of the spec.
    """
    if type(spec) is not list or len(spec) != 2:
        return spec
    arr, mpitype = spec
    if type(arr) is not np.ndarray or not arr.flags.c_contiguous:
        return spec
    natural = _types.natural_type(arr.dtype)
    same = natural is not None and natural == mpitype
    return arr if same else spec
