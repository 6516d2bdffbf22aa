"""Requests for non-blocking and persistent collectives, and the optional progress thread.

:class:`Request` is what ``mpicoll.Comm.Iallreduce`` (etc.) and the
persistent ``Allreduce_init`` (etc.) return: mpi4py's ``Test``/``Wait``/
``Start``/``Free`` and the class methods ``Waitall``/``Testall``.
:class:`Handle` is what :func:`mpicoll.iallreduce` (etc.) return: ``test()``
and ``wait()``, which returns the result array.  Both drive an engine
``Operation`` (``test()`` advances it without blocking, ``wait()`` blocks).

Progress happens inside ``Test``/``Wait``, and, with the ``progress``
option (``mpicoll.configure(progress=True)`` or ``MPICOLL_PROGRESS=1``), in a
background thread that advances every operation started while the option is
on.  One lock per operation keeps the thread and the caller from advancing
the same operation at once; the thread sleeps while nothing is in flight and
is stopped (and joined) at interpreter exit, before mpi4py finalizes MPI.
"""

from __future__ import annotations

import atexit
import threading
import time

from mpi4py import MPI

from ..core import config as _config
from ..core.errors import MpicollError
from ..engine.run import free_persistent, start_persistent

__all__ = ["Request", "Handle", "waitall", "testall", "check_progress", "watch"]


def check_progress() -> None:
    """Raise before anything starts if the ``progress`` option is on and MPI cannot host the
    thread (or a bad MPICOLL_PROGRESS was read).  Called by the API before a start."""
    if _config.get("progress") and _thread is None:
        _check_threads()


def _progress(op) -> None:
    """Hand a started operation to the progress thread when the ``progress`` option is on
    (the thread starts with the first such operation, even one complete at once)."""
    if op.progress:
        thread = _progress_thread()
        if op._active:
            thread.add(op)


def _check_threads() -> None:
    provided = MPI.Query_thread()
    if provided != MPI.THREAD_MULTIPLE:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED"}
        raise MpicollError(
            f"progress: the progress thread needs MPI_THREAD_MULTIPLE, but MPI was initialised "
            f"with {names.get(provided, provided)}; initialise MPI with MPI_THREAD_MULTIPLE "
            f"(mpi4py's default: mpi4py.rc.thread_level = 'multiple') or turn the progress "
            f"option off"
        )


# ---------------------------------------------------------------------------
# Communicator API: mpi4py-style requests
# ---------------------------------------------------------------------------


def _empty_status(status):
    """Fill ``status`` as MPI does for a completed collective (an empty status)."""
    if status is not None:
        status.Set_source(MPI.ANY_SOURCE)
        status.Set_tag(MPI.ANY_TAG)
        status.Set_error(MPI.SUCCESS)
        status.Set_elements(MPI.BYTE, 0)


class Request:
    """A non-blocking or persistent mpicoll collective (``Comm.Iallreduce``, ``Comm.Allreduce_init``...).

    As for mpi4py's requests, the buffers belong to the collective until it
    is complete: do not read the receive buffer or write either buffer before
    ``Wait`` (or a ``Test`` returning True).  A persistent request is
    inactive until ``Start()``, may be started again once complete, and is
    released by ``Free()``.  A collective that failed (a timeout, an MPI
    error) raises its exception from every later ``Test`` and ``Wait``.

    Attributes:
        algorithm: the algorithm the collective runs.
    """

    __slots__ = ("_op", "_buffers", "persistent", "_algorithm", "_started", "_via",
                 "__weakref__")

    def __init__(self, op, buffers=(), persistent=False, via=None):
        self._op = op
        # how the operation starts again, completes and is released where that is not the
        # engine's alone: ``start(op)``, ``complete(op)``, ``free(op)`` (a derived datatype's
        # packing, api.derived.Packing; MPI's own collective, api.delegate); None: the engine's
        self._via = via
        self._algorithm = op.algorithm
        # started and its completion not yet seen by Test/Wait: MPI's "active" (a
        # persistent request may not be started again before that)
        self._started = False
        self._buffers = buffers  # kept alive until the request is released, as mpi4py does
        self.persistent = persistent
        if not persistent:
            op.owner = self  # until this request has seen it complete (engine.cache.restart)
            _progress(op)

    @property
    def algorithm(self) -> str:
        return self._algorithm

    @property
    def done(self) -> bool:
        """Whether the collective is known complete (or inactive), without advancing it."""
        return self._op is None or self._op.done

    def Test(self, status=None) -> bool:
        """Advance without blocking; True (and ``status`` filled) once complete."""
        if self._op is None:  # a null request is complete, as in MPI
            _empty_status(status)
            return True
        done = self._op.test()
        if done:
            if self._via is not None:
                self._via.complete(self._op)
            self._seen_complete()
            self._started = False
            _empty_status(status)
        return done

    def Wait(self, status=None) -> bool:
        """Block until complete; returns True (mpi4py's ``Literal[True]``)."""
        if self._op is not None:
            self._op.wait()
            if self._via is not None:
                self._via.complete(self._op)
            self._seen_complete()
        self._started = False
        _empty_status(status)
        return True

    def _seen_complete(self) -> None:
        """A non-blocking request, complete: it lets go of its operation (MPI: the request
        is now null), which a repeat of the call may restart (engine.cache.restart)."""
        if not self.persistent:
            op, self._op = self._op, None
            if op.owner is self:
                op.owner = None
            self._buffers = ()

    def Start(self) -> None:
        """Persistent requests: run the collective again on the buffers' current contents."""
        # misuse of a request's state is a ValueError wherever it is met (docs/reliability.md)
        if not self.persistent:
            raise ValueError("Start: expected a persistent request (Allreduce_init...), "
                             "got a non-blocking one")
        if self._op is None:
            raise ValueError("Start: expected a request not freed, got a freed one "
                             "(MPI.REQUEST_NULL)")
        if self._started:
            raise ValueError("Start: expected an inactive request (completed by Wait or a Test "
                             "returning True), got an active one")
        if self._via is None:
            start_persistent(self._op)
        else:
            self._via.start(self._op)
        self._started = True
        _progress(self._op)

    def Free(self) -> None:
        """Release the request; an active one completes first.  Freeing twice is harmless."""
        op, self._op = self._op, None
        if op is not None:
            try:
                if self.persistent and self._via is not None:
                    self._via.free(op)
                elif self.persistent:
                    free_persistent(op)
                else:
                    op.wait()
                    if self._via is not None:
                        self._via.complete(op)
            finally:
                if op.owner is self:
                    op.owner = None
        self._buffers = ()

    @classmethod
    def Waitall(cls, requests, statuses=None) -> bool:
        """Wait for every request (any mix of mpicoll's and mpi4py's); returns True.

        Each wait advances every operation in flight, so the order does not matter."""
        requests = _items(requests, "requests", _REQUESTS, _REQUESTS_EXPECTED)
        for i, req in enumerate(requests):
            req.Wait(None if statuses is None else statuses[i])
        return True

    @classmethod
    def Testall(cls, requests, statuses=None) -> bool:
        """Advance every request once; True when all are complete."""
        requests = _items(requests, "requests", _REQUESTS, _REQUESTS_EXPECTED)
        done = True
        for req in requests:
            done &= req.Test()
        if done and statuses is not None:
            for status in statuses[: len(requests)]:
                _empty_status(status)
        return done


# ---------------------------------------------------------------------------
# Array API: handles
# ---------------------------------------------------------------------------


class Handle:
    """A non-blocking array collective (``mpicoll.iallreduce``...): ``test()`` and ``wait()``.

    Neither ``x`` nor ``out`` may be touched until ``wait()`` has returned (or
    ``test()`` returned True); ``wait()`` returns the result, as the blocking
    function does.  The handle keeps them alive until then.  A collective that
    failed raises its exception from every later ``test()`` and ``wait()``.
    """

    __slots__ = ("_op", "_finish", "_result", "_keep", "algorithm", "__weakref__")

    def __init__(self, op, finish, keep=()):
        self._op = op
        self._finish = finish
        self._result = None
        self._keep = keep
        self.algorithm = op.algorithm
        op.owner = self  # until this handle has seen it complete (engine.cache.restart)
        _progress(op)

    @property
    def done(self) -> bool:
        """Whether the collective is known complete, without advancing it."""
        return self._finish is None or self._op.done

    def test(self) -> bool:
        """Advance without blocking; True once complete (then ``wait()`` returns at once)."""
        if self._finish is None:
            return True
        if self._op.test():
            self._complete()
            return True
        return False

    def wait(self):
        """Block until complete; returns the result array."""
        if self._finish is not None:
            self._op.wait()
            self._complete()
        return self._result

    def _complete(self):
        finish, self._finish = self._finish, None
        op, self._op = self._op, _Done
        if op.owner is self:
            op.owner = None
        self._keep = ()
        self._result = finish()


class _DoneOp:
    """What a handle holds once it has seen its operation complete."""

    done = True


_Done = _DoneOp()


_REQUESTS = (Request, MPI.Request)
_REQUESTS_EXPECTED = "an mpicoll.Request or mpi4py.MPI.Request"
_HANDLES = (Handle, Request, MPI.Request)
_HANDLES_EXPECTED = "an mpicoll.Handle, mpicoll.Request or mpi4py.MPI.Request"


def _items(items, argname: str, kinds: tuple, expected: str) -> list:
    """``items`` as a list, every one an instance of ``kinds``: TypeError naming the first
    that is not, before any of them is waited for or advanced."""
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"{argname}: expected a sequence of {argname}, "
                        f"got {type(items).__name__}") from None
    for i, item in enumerate(items):
        if not isinstance(item, kinds):
            raise TypeError(f"{argname}[{i}]: expected {expected}, got {type(item).__name__}")
    return items


def waitall(handles) -> list:
    """Wait for every handle or request; the results (arrays for handles, True for requests)."""
    handles = _items(handles, "handles", _HANDLES, _HANDLES_EXPECTED)
    return [h.wait() if isinstance(h, Handle) else h.Wait() for h in handles]


def testall(handles) -> bool:
    """Advance every handle or request once; True when all are complete."""
    handles = _items(handles, "handles", _HANDLES, _HANDLES_EXPECTED)
    done = True
    for h in handles:
        done &= h.test() if isinstance(h, Handle) else h.Test()
    return done


# ---------------------------------------------------------------------------
# The progress thread
# ---------------------------------------------------------------------------

_POLL_S = 50e-6  # pause between sweeps over the in-flight operations


class _Progress:
    """A daemon thread that advances everything handed to it until it completes.

    What it advances has ``test() -> bool`` (True once complete, never
    blocking): engine operations, and whatever completes through them (the
    torch backend's works, :func:`watch`).  An operation takes its own lock
    without waiting (one the caller is advancing is skipped this sweep), so
    the thread never holds anything across an MPI wait; an operation that
    fails here keeps its exception, which the caller's next test/wait raises.
    Timeouts are enforced here as in test().
    """

    def __init__(self):
        self.cond = threading.Condition()
        self.ops: list = []
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="mpicoll-progress", daemon=True)
        self.thread.start()

    def add(self, op) -> None:
        with self.cond:
            self.ops.append(op)
            self.cond.notify()

    def _run(self):
        while True:
            with self.cond:
                while not self.ops and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return
                batch = list(self.ops)
            if MPI.Is_finalized():
                return
            finished = []
            for op in batch:
                try:
                    if op.test():
                        finished.append(op)
                except BaseException:  # kept by the operation: the caller's test/wait raises it
                    finished.append(op)
            with self.cond:
                for op in finished:
                    self.ops.remove(op)
            time.sleep(_POLL_S)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify()
        self.thread.join(timeout=10.0)


_thread: _Progress | None = None
_thread_lock = threading.Lock()


def _progress_thread() -> _Progress:
    global _thread
    if _thread is None:
        with _thread_lock:
            if _thread is None:
                _check_threads()
                _thread = _Progress()
    return _thread


def watch(item) -> None:
    """Hand ``item`` (``test() -> bool``, never blocking; an exception ends it) to the one
    progress thread, which calls ``item.test()`` until it returns True.  Needs
    MPI_THREAD_MULTIPLE (MpicollError otherwise)."""
    _progress_thread().add(item)


def stop_progress() -> None:
    """Stop the progress thread if it runs (at exit; a later operation starts a new one)."""
    global _thread
    with _thread_lock:
        thread, _thread = _thread, None
    if thread is not None:
        thread.stop()


# Registered after mpi4py's own exit hook (mpi4py is imported above), so it
# runs first: the thread is gone before MPI is finalized.
atexit.register(stop_progress)
