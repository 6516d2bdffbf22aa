"""Exception types raised by mpicoll beyond the standard TypeError/ValueError."""

from __future__ import annotations

from mpi4py import MPI


class MpicollError(RuntimeError):
    """Base class of the errors that come from a collective running, not from bad arguments."""


class MismatchError(MpicollError):
    """Ranks called a collective with arguments that do not agree (``MPICOLL_CHECK=1``).

    Every rank raises it with the same message.  Attributes:

    ``collective``  what this rank called ("allreduce", ...)
    ``seq``         the call number on the communicator (1 = first collective)
    ``field``       the first field that differs ("collective", "dtype", "count", ...)
    ``values``      {rank: value that rank passed for ``field``}, for every rank
    """

    def __init__(self, message: str, *, collective=None, seq=None, field=None, values=None):
        super().__init__(message)
        self.collective = collective
        self.seq = seq
        self.field = field
        self.values = dict(values or {})


class CollectiveTimeout(MpicollError, TimeoutError):
    """A collective made no progress for longer than the configured timeout.

    Attributes: ``collective``, ``seq`` (call number), ``algorithm``, ``rank``
    (this rank), ``peer`` (the rank waited on, None if unknown), ``phase``
    ("send", "recv", "check", or "setup": creating mpicoll's state for the
    communicator on its first call), ``step`` (algorithm step, None if
    unknown), ``timeout`` (seconds).  The communicator is unusable afterwards.
    """

    def __init__(self, message: str, *, collective=None, seq=None, algorithm=None, rank=None,
                 peer=None, phase=None, step=None, timeout=None):
        super().__init__(message)
        self.collective = collective
        self.seq = seq
        self.algorithm = algorithm
        self.rank = rank
        self.peer = peer
        self.phase = phase
        self.step = step
        self.timeout = timeout


class MessageError(MpicollError, MPI.Exception):
    """A message of a collective failed in MPI (truncated, an error on the link, ...).

    The text is MPI's own for the failed request, with the call, the step and
    the peer; when the cause may be ranks that called differently, it says
    that ``MPICOLL_CHECK=1`` diagnoses it.  Also an ``MPI.Exception``:
    ``Get_error_code()`` is MPI's code for the request.  Attributes:
    ``collective``, ``seq``, ``algorithm``, ``rank``, ``peer`` (None if unknown),
    ``step`` (None if unknown), ``phase`` ("send" or "recv", None if unknown).
    """

    def __init__(self, message: str, code: int, *, collective=None, seq=None, algorithm=None,
                 rank=None, peer=None, step=None, phase=None):
        MPI.Exception.__init__(self, code)
        self.message = message
        self.collective = collective
        self.seq = seq
        self.algorithm = algorithm
        self.rank = rank
        self.peer = peer
        self.step = step
        self.phase = phase

    def __str__(self) -> str:
        return self.message
