"""Exception types raised by mpicoll beyond the standard TypeError/ValueError."""

from __future__ import annotations


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
