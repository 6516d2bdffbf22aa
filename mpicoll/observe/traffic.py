"""Traffic accounting: messages, bytes and steps each rank's collectives move.

``with mpicoll.traffic() as t:`` counts, on this rank, every point-to-point
message the collectives inside the block complete (the payload only: the
``MPICOLL_CHECK`` fingerprint exchange is not counted).  Bytes are elements
times the size of the MPI datatype on the wire.  Steps are the algorithm steps
(the ``step`` of each message's label in its schedule, see
:mod:`mpicoll.algorithms.schedule`) in which the rank sent (received) at least one
message; a step may carry several messages when a block is cut into segments.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.config import bump

ACTIVE: list = []   # Traffic objects inside their ``with`` block (read by observe.calls)


class CallTraffic(NamedTuple):
    """What one collective call moved on this rank."""

    collective: str
    seq: int
    algorithm: str
    messages_sent: int
    bytes_sent: int
    messages_received: int
    bytes_received: int
    send_steps: int | None  # None: algorithm without a known schedule
    recv_steps: int | None


class Counts(NamedTuple):
    """Totals over several calls."""

    calls: int = 0
    messages_sent: int = 0
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0
    send_steps: int | None = 0
    recv_steps: int | None = 0

    def add(self, c: CallTraffic) -> Counts:
        def steps(a, b):
            return None if a is None or b is None else a + b

        return Counts(self.calls + 1, self.messages_sent + c.messages_sent,
                      self.bytes_sent + c.bytes_sent, self.messages_received + c.messages_received,
                      self.bytes_received + c.bytes_received, steps(self.send_steps, c.send_steps),
                      steps(self.recv_steps, c.recv_steps))


class Traffic:
    """Counters of this rank's collective traffic; see :func:`traffic`."""

    def __init__(self):
        self.calls: list[CallTraffic] = []

    def __enter__(self) -> Traffic:
        ACTIVE.append(self)
        bump()  # bound calls (engine.cache) must now take the observed path
        return self

    def __exit__(self, *exc) -> None:
        ACTIVE.remove(self)
        bump()

    def _add(self, record: CallTraffic) -> None:
        self.calls.append(record)

    def total(self, collective: str | None = None) -> Counts:
        """Totals over every call (or only calls of ``collective``)."""
        out = Counts()
        for c in self.calls:
            if collective is None or c.collective == collective:
                out = out.add(c)
        return out

    def by_collective(self) -> dict[str, Counts]:
        """{collective: totals} in order of first call."""
        out: dict[str, Counts] = {}
        for c in self.calls:
            out[c.collective] = out.get(c.collective, Counts()).add(c)
        return out

    @property
    def messages_sent(self) -> int:
        return self.total().messages_sent

    @property
    def bytes_sent(self) -> int:
        return self.total().bytes_sent

    @property
    def messages_received(self) -> int:
        return self.total().messages_received

    @property
    def bytes_received(self) -> int:
        return self.total().bytes_received

    def gather(self, comm=None, root: int = 0) -> list[dict[str, Counts]] | None:
        """Every rank's :meth:`by_collective` at ``root`` (collective; others get None)."""
        from mpi4py import MPI

        comm = MPI.COMM_WORLD if comm is None else comm
        return comm.gather(self.by_collective(), root=root)


def traffic() -> Traffic:
    """Count the messages, bytes and steps of this rank's collectives inside a ``with`` block.

    Returns:
        A :class:`Traffic`: ``.calls`` lists one :class:`CallTraffic` per
        collective call; ``.total()``, ``.by_collective()`` and ``.gather()``
        sum them.

    Example (4 ranks, ring AllReduce of 1000 float64)::

        with mpicoll.traffic() as t:
            mpicoll.allreduce(np.ones(1000), algorithm="ring")
        t.bytes_sent                          # every rank: 12000 = 2 * (3/4) * 8000
    """
    return Traffic()
