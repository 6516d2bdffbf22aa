"""MPI's own collective for the calls of ``mpicoll.Comm`` that mpicoll does not run.

Validation (api.args, api.derived) raises :class:`~mpicoll.api.derived.Delegate`
for a call whose datatype mpicoll does not run (mixed element types, a
user-defined op on a non-contiguous derived type, ...); ``mpicoll.Comm`` then
hands the user's arguments, unchanged, to ``MPI.Intracomm``'s method on the
same communicator, as mpi4py would run them.

Every form runs MPI's non-blocking collective (``Iallreduce`` for
``Allreduce``, ``Allreduce_init`` and ``Iallreduce``) inside an engine
:class:`~mpicoll.engine.executor.Operation` of two steps, post and wait (the
wait on MPI's request, as on a persistent request of mpicoll's own): a
blocking call is started and waited for, a persistent one posts again at each
``Start``.  So waiting for a delegated call advances every mpicoll operation in
flight, and waiting for those advances it (the progress rule,
engine.executor): a rank inside MPI's blocking collective would advance
nothing, and a peer waiting for mpicoll's messages from it would wait for ever.

Counters and traces (observe.calls.Delegated) show the call with the algorithm
``"delegated"`` and no message of mpicoll's; a request's ``algorithm`` is
``"delegated"`` too.
"""

from __future__ import annotations

from mpi4py import MPI

from ..engine import executor as _executor
from ..observe import calls as _observe
from . import args as _args
from . import requests as _requests

# method of mpicoll.Comm -> (MPI.Intracomm's non-blocking method, the collective's label)
_FORMS = {
    "Allreduce": (MPI.Intracomm.Iallreduce, "allreduce"),
    "Allgather": (MPI.Intracomm.Iallgather, "allgather"),
    "Allgatherv": (MPI.Intracomm.Iallgatherv, "allgather"),
    "Reduce_scatter_block": (MPI.Intracomm.Ireduce_scatter_block, "reduce_scatter"),
    "Reduce_scatter": (MPI.Intracomm.Ireduce_scatter, "reduce_scatter"),
}


class _Bound:
    """What an engine operation of MPI's own collective is bound to (as engine.run.Bound for
    mpicoll's): it posts MPI's non-blocking collective (its first step), and hands the
    call to the counters and traces when it ends.  No context of mpicoll's: it runs on
    the user's communicator, with MPI's own matching."""

    __slots__ = ("comm", "post_args", "form", "label", "reqs", "seen")

    claims = enters = False
    ends = True
    kept = True  # (its requests are MPI's, freed as they complete: nothing to give back)
    schedule = None

    def __init__(self, comm, method, args):
        self.form, self.label = _FORMS[method]
        self.comm, self.post_args = comm, args
        self.reqs = [MPI.REQUEST_NULL]  # (the wait step's requests: this list, reposted)
        self.seen = None

    def post(self) -> None:
        self.seen = _observe.Delegated(self.label)
        self.reqs[0] = self.form(self.comm, *self.post_args)

    def observed(self, operation) -> bool:
        return False  # (the deadline and the check are not applied: docs/api.md)

    def ended(self, operation, exc) -> None:
        seen, self.seen = self.seen, None
        if seen is not None:
            seen.end(exc is not None)

    def release(self) -> None:
        pass


def operation(comm, method, args, persistent=False):
    """An engine operation running ``comm``'s ``method`` (a name of :data:`_FORMS`) on ``args``
    as MPI's own, not started."""
    if method == "Reduce_scatter" and args[2] is None and not _args.is_in_place(args[0]):
        # mpi4py would exchange the receive counts in MPI's blocking Allgather: exchanged
        # here on mpicoll's channel instead, whose wait advances the operations in flight
        table = _args.exchange(comm, (_args.count_of(args[1], "recvbuf"),),
                                "reduce_scatter.recvcounts")
        args = (args[0], args[1], [c for c, in table], args[3])
    bound = _Bound(comm, method, args)
    steps = ((_executor.CALL, bound.post), (_executor.WAIT, (), bound.reqs))
    op = _executor.Operation(steps, None, None, None, bound=bound, persistent=persistent,
                             algorithm="delegated")
    op.program = steps  # (its steps wait on MPI's request, as a program on its own)
    return op


def run(comm, method, args) -> None:
    """Run ``comm.method(*args)`` as MPI's own collective, to the end."""
    operation(comm, method, args).run()


def start(comm, method, args, persistent=False) -> _requests.Request:
    """The request of ``comm.Imethod(*args)`` (``persistent``: ``method_init``) run as MPI's own
    collective: started, or (persistent) inactive until ``Start()``."""
    op = operation(comm, method, args, persistent)
    if not persistent:
        op.start()
    return _requests.Request(op, args[:2], persistent, via=_VIA)


class _Via:
    """How api.requests.Request starts, completes and frees a delegated operation."""

    @staticmethod
    def start(op) -> None:
        op.start()

    @staticmethod
    def complete(op) -> None:
        pass

    @staticmethod
    def free(op) -> None:
        if not op.done and op.error is None:  # (active: it completes first)
            op.wait()


_VIA = _Via()
