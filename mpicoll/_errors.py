"""Exception types raised by mpicoll beyond the standard TypeError/ValueError."""


class MpicollError(RuntimeError):
    """Base class of the errors that come from a collective running, not from bad arguments."""


class MismatchError(MpicollError):
    """Ranks called a collective with arguments that do not agree (``MPICOLL_CHECK=1``)."""


class CollectiveTimeout(MpicollError, TimeoutError):
    """A collective made no progress for longer than the configured timeout."""
