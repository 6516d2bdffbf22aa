"""Timeouts instead of hangs: wait for requests by polling, and ``abort``.

With a timeout set (``MPICOLL_TIMEOUT``, ``configure(timeout=...)`` or a
per-call ``timeout=``), the channel of a collective does not block in
``MPI_Wait``: it polls its requests with ``Test``/``Testsome`` and raises
:class:`~mpicoll.CollectiveTimeout` when none of them completes for that many
seconds.  The deadline restarts at every completed request, so a long but
progressing collective never times out.

Polling spins for :data:`SPIN_S` after each completion (as ``MPI_Wait``
itself would) and then sleeps between polls, doubling the pause up to
:data:`MAX_SLEEP_S`, so a rank that waits a long time for a late peer leaves
the core to others.
"""

from __future__ import annotations

import sys
import time
from typing import NoReturn

from mpi4py import MPI

SPIN_S = 2e-3        # poll without pausing this long after the last progress
MIN_SLEEP_S = 20e-6
MAX_SLEEP_S = 1e-3
CANCEL_WAIT_S = 0.1  # how long to wait for a cancelled receive to complete


def _test_all_mpi(left):
    """Indices of completed requests among ``left`` (all MPI.Request)."""
    reqs = [r.req for r in left]
    done = MPI.Request.Testsome(reqs)
    return range(len(left)) if done is None else done


def tester(pending, channel_test=None):
    """How to poll ``pending``: a function left -> indices of completed entries, or None.

    ``channel_test(req) -> bool`` is the inner channel's own non-blocking test
    (a channel whose requests are not MPI requests, e.g. host staging of device
    buffers, provides one to make progress); otherwise requests are tested with
    ``Testsome`` or their ``Test()`` method.  None: the requests cannot be polled.
    """
    if channel_test is not None:
        return lambda left: [i for i, r in enumerate(left) if channel_test(r.req)]
    if all(isinstance(r.req, MPI.Request) for r in pending):
        return _test_all_mpi
    if all(hasattr(r.req, "Test") for r in pending):
        return lambda left: [i for i, r in enumerate(left) if r.req.Test()]
    return None


def wait(pending, timeout: float, expired, test, clock=time.perf_counter) -> None:
    """Poll until every request of ``pending`` has completed.

    Args:
        pending: objects with ``.req``, ``.kind`` ("send"/"recv") and ``.done``
            (None until complete; set here to the time the completion was seen).
        timeout: seconds without any completion before giving up.
        expired: ``expired(left, idle)`` returns the exception to raise for the
            requests still pending after ``idle`` seconds without progress.
        test: from :func:`tester`.
    """
    left = [r for r in pending if r.done is None]
    if not left:
        return
    last = clock()
    pause = 0.0
    while True:
        done = test(left)
        now = clock()
        if done:
            for i in done:
                left[i].done = now
            left = [r for r in left if r.done is None]
            if not left:
                return
            last = now
            pause = 0.0
            continue
        idle = now - last
        if idle >= timeout:
            _cancel(left)
            raise expired(left, idle)
        if idle > SPIN_S:
            pause = min(max(2 * pause, MIN_SLEEP_S), MAX_SLEEP_S, timeout - idle)
            time.sleep(pause)


def _cancel(left) -> None:
    """Cancel pending receives (MPI-4 deprecates cancelling sends: they are left)."""
    recvs = [r.req for r in left if r.kind == "recv" and isinstance(r.req, MPI.Request)]
    for req in recvs:
        try:
            req.Cancel()
        except MPI.Exception:
            pass
    end = time.perf_counter() + CANCEL_WAIT_S
    while recvs and time.perf_counter() < end:
        recvs = [req for req in recvs if not req.Test()]


def abort(comm=None, errorcode: int = 1, message: str | None = None) -> NoReturn:
    """Print ``message`` to stderr and end the whole job with ``MPI_Abort``.

    Use it after a :class:`~mpicoll.CollectiveTimeout` (or any error that left
    ranks waiting) so a batch job ends instead of holding its allocation until
    the wall-clock limit.

    Args:
        comm: communicator whose processes are aborted (default ``MPI.COMM_WORLD``;
            most MPI implementations end the whole job whatever it is).
        errorcode: exit status reported to ``mpirun``/``srun``.
        message: printed to stderr as ``mpicoll: rank R: message`` before aborting.

    Example::

        try:
            mpicoll.allreduce(x)
        except mpicoll.CollectiveTimeout as exc:
            mpicoll.abort(message=str(exc))
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm: expected an mpi4py.MPI.Comm, got {type(comm).__name__}")
    if isinstance(errorcode, bool) or not isinstance(errorcode, int):
        raise TypeError(f"errorcode: expected an int, got {type(errorcode).__name__}")
    sys.stdout.flush()
    if message:
        rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() and not MPI.Is_finalized() else "?"
        sys.stderr.write(f"mpicoll: rank {rank}: {message}\n")
    sys.stderr.flush()
    comm.Abort(errorcode)
    raise SystemExit(errorcode)  # not reached: MPI_Abort does not return
