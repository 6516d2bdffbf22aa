"""What the backend does when a call goes wrong: refusals are raised, failures end the job.

Two kinds, told apart by where they happen (backend._collective, backend._work), and a
third that some calls find in what the ranks exchanged:

- a **refusal**: the call's arguments were checked and refused before this
  rank sent or posted anything for it (TypeError/ValueError).  It is raised
  to the caller in every mode: nothing of the call is in flight here, the
  group stays usable, and if every rank made the same mistake (the usual
  case: the same code on every rank) no rank waits for anything.
- a **failure**: an error once the call's messages started (a timeout, an
  MPI error), where the other ranks may wait in the call.  With
  ``MPICOLL_TORCH_ON_ERROR=abort`` (the default) the rank ends the job
  (:func:`end_job`); with ``raise`` it raises.
- an **agreed** error: a mismatch that every rank finds alike in what the
  ranks exchanged (sparse all_reduce's gathered sizes, mpicoll.torch.sparse),
  before any data moved.  Every rank raises it from the call's Work in
  every mode: no rank waits for another, so it ends no job (:func:`agreed`).

A refusal on some ranks only leaves the others waiting in the call.  If
the refused rank then ends with the error uncaught, its MPI cannot finalize
while they wait: in ``abort`` mode an exit hook (:func:`note_refusal`
installs it) ends the job at once instead, as before the refusal was
raised.  A refusal the caller catches is the caller's to handle, as on gloo.
"""

from __future__ import annotations

import atexit
import sys
import time
import traceback

from mpi4py import MPI

from .. import abort

_FORWARD_S = 0.5  # time for the launcher to forward a failing rank's message before its abort
_MARK = "_mpicoll_refused"  # on a refusal raised in abort mode: (what, group rank, group size)
_AGREED = "_mpicoll_agreed"  # on an error every rank of the group raises alike
_hooked: list = []


def end_job(what: str, exc: BaseException, rank: int, size: int) -> None:
    """Abort the job: ``exc`` made this rank's ``what`` fail after its messages started, so
    the other ranks of the group (``rank`` of ``size`` here) would wait in it."""
    _abort_with("".join(traceback.format_exception(exc)) +
         f"mpicoll: rank {MPI.COMM_WORLD.Get_rank()}: torch backend: {what} failed on rank "
         f"{rank} of the group of {size} ({type(exc).__name__}: {exc}); ending the job, as the "
         f"other ranks of the group would wait for this rank (MPICOLL_TORCH_ON_ERROR=raise "
         f"raises the error instead)\n")


def agreed(exc: BaseException) -> BaseException:
    """Mark ``exc`` (returned) as an error every rank of the group raises alike, from data they
    all exchanged: a Work raises it without ending the job (:func:`is_agreed`)."""
    setattr(exc, _AGREED, True)
    return exc


def is_agreed(exc: BaseException) -> bool:
    """Whether ``exc`` was marked by :func:`agreed`."""
    return getattr(exc, _AGREED, False)


def note_refusal(exc: BaseException, what: str, rank: int, size: int) -> None:
    """Mark ``exc``, a refusal raised in abort mode, for the exit hook (installed once)."""
    try:
        setattr(exc, _MARK, (what, rank, size))
    except AttributeError:  # (an exception type without attributes: no hook for it)
        return
    if not _hooked:
        _hooked.append(True)
        # registered after mpicoll's own exit handlers (at import), so it runs before them
        atexit.register(_uncaught_refusal)


def _uncaught_refusal() -> None:
    """At exit: if the process ends with a refusal uncaught, end the job (others may wait)."""
    exc = getattr(sys, "last_value", None)  # set by the interpreter for an uncaught exception
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        mark = getattr(exc, _MARK, None)
        if mark is not None:
            what, rank, size = mark
            _abort_with(f"mpicoll: rank {MPI.COMM_WORLD.Get_rank()}: torch backend: {what} was refused "
                 f"on rank {rank} of the group of {size} ({type(exc).__name__}: {exc}) and the "
                 f"process is ending with that error uncaught; ending the job, as the other "
                 f"ranks of the group may wait in {what} (catch the error to go on; "
                 f"MPICOLL_TORCH_ON_ERROR=raise leaves them to their timeout)\n")
            return
        exc = exc.__cause__ or exc.__context__


def _abort_with(text: str) -> None:
    """Write ``text`` to stderr and abort the job."""
    sys.stderr.write(text)
    sys.stderr.flush()
    # the launcher forwards the ranks' output through its daemons, which MPI_Abort kills:
    # seen with MPICH on a loaded machine, the message written just before was lost
    time.sleep(_FORWARD_S)
    abort()
