"""Works: what the backend's collectives return, the thread that completes them, and where
their futures' callbacks run.

A :class:`Work` holds the pieces of one collective in flight (mpicoll handles,
mpi4py requests) and what to do once they are complete (copy staged tensors
back, divide for AVG).  ``wait()`` completes it on the caller's thread and
re-raises what failed; ``get_future()`` returns a future that completes by
itself: every asynchronous work (``async_op=True``, and any work whose
future is asked for) not complete when it is made is handed to mpicoll's one
progress thread (api.requests.watch), which calls ``test()`` on it (a short
sleep between sweeps, none at all while nothing is in flight) until its
pieces are done.
A future's ``then`` callbacks run where the future is completed: on the
thread that waits (``wait()``, ``is_completed()``, or ``get_future()`` of a
work already complete), or, for a work the progress thread completed, on a
delivery thread (:func:`deliver`), never on the progress thread itself, so
a callback may start collectives and wait for them (PowerSGD's hook does).
One lock per work keeps the thread and a caller's ``wait()`` from finishing the
same work twice (futures are completed outside it); the engine advances every
operation in flight during any wait, so works complete in any order.
"""
from __future__ import annotations

import collections
import threading
import time
import traceback

import torch
import torch.distributed as dist

from ..api import requests as _requests
from ..core.errors import CollectiveTimeout, MpicollError
from . import failures

_SPIN_S = 20e-6  # a caller's pause between tests of an MPI built-in's request
# A blocking wait first tests for this long without sleeping: a timed mpicoll wait
# (the group always has a timeout) sleeps between polls, and one sleep costs more
# than a whole small collective (measured: 2 ranks, 16 B, 94 -> see docs/torch.md)
_EAGER_S = 200e-6


class MpiPiece:
    """An mpi4py request of an MPI built-in, with the timeout mpicoll's own calls have;
    ``status``: an ``MPI.Status`` the completion fills (a receive's sender)."""

    __slots__ = ("request", "what", "deadline", "timeout", "status")

    def __init__(self, request, what: str, timeout, status=None):
        self.request = request
        self.what = what
        self.timeout = timeout
        self.status = status
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def test(self) -> bool:
        if self.request.Test(self.status):
            return True
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise CollectiveTimeout(
                f"{self.what}: not complete after {self.timeout:g} s (the group's timeout); "
                f"another rank of the group has not joined it, or failed before it",
                collective=self.what)
        return False

    def wait(self) -> None:
        while not self.test():
            time.sleep(_SPIN_S)


class _Deliveries:
    """The threads that complete futures for the progress thread, so that their callbacks never
    run on it.

    A future's ``then`` callbacks run inside ``set_result``.  One that waits for
    another collective's future (PowerSGD's hook does, several layers deep)
    would wait forever on the thread that completes operations.  Here each
    delivery runs on an idle delivery thread, and a new thread starts whenever
    none is idle, so a callback blocked in a wait never holds up the delivery
    it waits for.  Threads stay (idle) once started: as many as deliveries
    were ever blocked at once, plus one.
    """

    def __init__(self):
        self.cond = threading.Condition()
        self.queue: collections.deque = collections.deque()
        self.idle = 0
        self.threads = 0

    def put(self, fn, *args) -> None:
        with self.cond:
            self.queue.append((fn, args))
            if self.idle > len(self.queue) - 1:
                self.cond.notify()
                return
            self.threads += 1
        threading.Thread(target=self._run, name=f"mpicoll-futures-{self.threads}",
                         daemon=True).start()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.queue:
                    self.idle += 1
                    self.cond.wait()
                    self.idle -= 1
                fn, args = self.queue.popleft()
            try:
                fn(*args)  # (a callback's error goes to the future then() returned, not here)
            except Exception:  # (never expected: keep the thread, and say what happened)
                traceback.print_exc()


_deliveries = _Deliveries()


def deliver(fn, *args) -> None:
    """Run ``fn(*args)`` (completing a future: its callbacks run inside) on a delivery thread."""
    _deliveries.put(fn, *args)


def _eager_wait(piece) -> None:
    """``piece.wait()``, after testing it without a pause for up to ``_EAGER_S``."""
    end = time.perf_counter() + _EAGER_S
    while not piece.test():
        if time.perf_counter() > end:
            piece.wait()
            return


def _seen_done(work) -> bool:
    """Whether the device work of ``work`` (a done Finished or Work) is complete: its event's
    query, once; complete, the event is dropped, as the device layer records a complete
    event again for a later call (mpicoll.torch.devices._Events), so a work once complete
    stays complete and waits for nothing later."""
    event = work._event
    if event is None:
        return True
    if not work._scope.done(event):
        return False
    work._event = None
    return True


class Finished(dist._Work):
    """The Work of a collective that completed before its call returned, without error (a
    blocking call's): nothing to advance, lock or finish, so it costs a fraction of a
    :class:`Work` (docs/torch.md).  ``scope``: a call on device tensors (mpicoll.torch.
    devices), whose result is queued on its stream."""

    __slots__ = ("_result", "_scope", "_event")

    def __init__(self, result, scope=None):
        super().__init__()
        self._result = result
        self._scope = scope
        self._event = None if scope is None else scope.record()

    def wait(self, timeout=None) -> bool:
        event = self._event  # (None once seen complete: is_completed)
        if event is not None:
            self._scope.after(event)
        return True

    def get_future(self):
        scope = self._scope
        if scope is None:
            future = torch.futures.Future()
            future.set_result(self._result)
        else:
            future = scope.future()
            with scope:
                future.set_result(self._result)
        return future

    def is_completed(self) -> bool:
        return _seen_done(self)

    def test(self) -> bool:  # (as Work.test: complete on the host)
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def __repr__(self) -> str:
        return "<mpicoll.torch.Work: complete>"


class Work(dist._Work):
    """One collective of the mpicoll backend: ``wait()``, ``get_future()``, ``is_completed()``.

    ``wait()`` blocks until complete and re-raises the error the collective met
    (on every call); ``get_future()``'s future completes without the caller
    waiting, with the output tensors or the error.
    """

    def __init__(self, pieces, finish, result, what: str, opts=None, fail=None, keep=None,
                 scope=None):
        super().__init__()
        # a call on device tensors (mpicoll.torch.devices.Scope): its stream is current while
        # it advances and finishes; an event on it marks the end of its device work
        self._scope = scope
        self._event = None
        self._fail = fail  # fail(what, error): told of an error before wait() raises it
        self._pieces = pieces
        self._finish = finish
        self._result = result
        # what must outlive the pieces: tensors whose memory they move (tensors.memory_view's
        # arrays hold no reference), such as an input nobody else holds
        self._keep = keep
        self._what = what
        self._lock = threading.RLock()  # a future callback may wait() on its own work
        self._error = None
        self._done = False
        self._future = None  # made by get_future(): most blocking calls never ask for one
        self._queued = False
        self.source = None  # a receive's sender: its group rank, or the MPI.Status that learns it
        # a blocking call (torch sets opts.asyncOp False) is waited for at once on the
        # caller's thread: neither a test now nor the completion thread would help it,
        # unless nothing is left to wait for (the group ran it already): finish it now
        if not pieces:
            self._advance(False, lock=False)  # nobody else sees this work yet
        elif getattr(opts, "asyncOp", True) and not self._advance(False):
            self._queue()

    def _queue(self) -> None:
        if not self._queued:
            self._queued = True
            _requests.watch(self)  # mpicoll's one progress thread completes it

    def test(self) -> bool:
        """Advance without blocking; True once complete (what the progress thread calls: the
        future it completes is handed to the delivery threads, :func:`deliver`)."""
        return self._done or self._advance(False, later=True)

    def _advance(self, block: bool, lock=True, later=False) -> bool:
        """Test (``block``: wait for) the pieces; finish and complete the future once all are
        done: here, after the lock is released, or (``later``) on a delivery thread."""
        if lock:
            if block:
                self._lock.acquire()
            elif not self._lock.acquire(blocking=False):
                return False  # a caller is advancing it
        future = None
        try:
            if self._done:
                return True
            scope = self._scope
            if scope is None:
                if not self._step(block):
                    return False
            else:
                with scope:
                    if not self._step(block):
                        return False
                    self._event = scope.record()
            self._done = True
            self._finish = self._keep = None
            future = self._future  # (get_future() completes one made after this, itself)
            return True
        finally:
            if lock:
                self._lock.release()
            if future is not None:  # its callbacks run outside the lock
                if later:
                    deliver(self._complete, future)
                else:
                    self._complete(future)

    def _step(self, block: bool) -> bool:
        """Test (wait for) the pieces, then finish; False while a piece is incomplete."""
        try:
            while self._pieces:
                piece = self._pieces[0]
                if block:
                    _eager_wait(piece)
                elif not piece.test():
                    return False
                self._pieces.pop(0)
            if self._finish is not None:
                self._finish()
        except BaseException as exc:  # kept for wait() and the future, never lost
            self._error = exc if isinstance(exc, Exception) else MpicollError(repr(exc))
            self._pieces.clear()
            # the group aborts the job (failures.end_job), unless every rank raises this alike
            if self._fail is not None and not failures.is_agreed(self._error):
                self._fail(self._what, self._error)
        return True

    def wait(self, timeout=None) -> bool:
        """Block until complete and re-raise what failed; ``timeout`` (a timedelta, torch's
        argument; 0 or None: none): raise CollectiveTimeout if not complete by then, the
        collective staying in flight (its future still completes).  On device tensors the
        current stream is then made to wait for the call's (its result is queued there)."""
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        if seconds > 0 and not self._done:
            end = time.monotonic() + seconds
            while not self._advance(False):
                if time.monotonic() > end:
                    raise CollectiveTimeout(
                        f"{self._what}: not complete within wait()'s timeout of {seconds:g} s; "
                        f"it is still in flight", collective=self._what)
                time.sleep(_SPIN_S)
        elif not self._done:
            self._advance(True)
        if self._error is not None:
            raise self._error
        event = self._event  # (None once seen complete: is_completed)
        if event is not None:
            self._scope.after(event)
        return True

    def _complete(self, future) -> None:
        if self._scope is None:
            self._set(future)
        else:  # (a CUDA future records its event on the current stream: the call's)
            with self._scope:
                self._set(future)

    def _set(self, future) -> None:
        if self._error is None:
            future.set_result(self._result)
        else:
            future.set_exception(self._error)

    def get_future(self):
        complete = False
        with self._lock:  # a future made before the work is done is completed by _advance
            if self._future is None:
                self._future = (torch.futures.Future() if self._scope is None
                                else self._scope.future())
                complete = self._done
            if not self._done:
                self._queue()  # the future completes by itself from now on
        if complete:
            self._complete(self._future)
        return self._future

    def is_completed(self) -> bool:
        """Complete, and on device tensors its work on the call's stream done too."""
        if not (self._done or self._advance(False)):
            return False
        return _seen_done(self)

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def _source_rank(self) -> int:
        """A receive's sender (group rank): what ``dist.recv`` without ``src`` returns."""
        source = self.source
        if source is None:  # torch's words for a work that is not a receive
            raise RuntimeError("sourceRank() may only be called on work objects that correspond "
                               "to a recv or recv-from-any call.")
        if isinstance(source, int):
            return source
        if not self.is_completed():
            raise RuntimeError(f"{self._what}: the sender is known once the receive is "
                               f"complete (wait() first)")
        return source.Get_source()

    source_rank = _source_rank

    def __repr__(self) -> str:
        state = "failed" if self._error is not None else "complete" if self._done else "in flight"
        return f"<mpicoll.torch.Work {self._what}: {state}>"
