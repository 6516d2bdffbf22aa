"""What a collective call is made of: its buffers as messages, and the call itself.

The public API (api.args, api.buffers) checks its arguments and builds one
:class:`Call`; the engine, the observers and the backends read its fields and
never change them.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Msg:
    """One buffer's elements and their type: a 1-D view and how MPI carries it."""

    __slots__ = ("array", "dtype", "category", "mpitype", "typename", "backend",
                 "counts", "displs", "optype")

    def __init__(self, array, dtype, category, mpitype, typename, backend,
                 counts=None, displs=None, optype=None):
        self.array = array        # 1-D view, exactly the message's elements
        self.dtype = dtype
        self.category = category
        self.mpitype = mpitype    # datatype used on the wire
        # datatype handed to user-defined ops: the one mpi4py would pass for this spec
        self.optype = optype or mpitype
        self.typename = typename  # for messages: "float64", "MPI.INT", ...
        self.backend = backend
        self.counts = counts      # vector specs only
        self.displs = displs

    @property
    def count(self) -> int:
        return len(self.array)


class Call(NamedTuple):
    """One collective call, validated: everything the engine reads of it, and nothing else.

    ``recv`` is the output message (the whole buffer; in place also the
    input); ``send`` the input, None in place.  ``counts``/``displs``: each
    rank's block of a ReduceScatter's input or an AllGather's output, in
    elements (None for AllReduce).  ``timeout`` and the dtype policy
    (``deterministic``, ``accumulate``, engine.numerics) are the arguments as
    given: None means the communicator's option.  ``label`` names the call in
    messages where it is not ``collective`` (an internal exchange).
    """

    collective: str
    comm: Any
    send: Msg | None
    recv: Msg
    counts: tuple | None = None
    displs: tuple | None = None
    op: Any = None
    algorithm: str = "auto"
    timeout: float | None = None
    deterministic: bool | None = None
    accumulate: bool | None = None
    label: str | None = None

    @property
    def total(self) -> int:
        """The elements "auto" selects by: the array reduced (AllReduce), the whole input
        (ReduceScatter) or the whole output (AllGather)."""
        return self.recv.count if self.counts is None else sum(self.counts)

    def arrays(self, rank: int) -> tuple:
        """(source, destination) 1-D arrays on ``rank``: an in-place ReduceScatter reads all
        of ``recv`` and writes its start; an in-place AllGather has no source (None)."""
        dst = self.recv.array
        if self.send is not None:
            return self.send.array, dst
        if self.collective == "reduce_scatter":
            return dst, dst[: self.counts[rank]]
        if self.collective == "allgather":
            return None, dst
        return dst, dst
