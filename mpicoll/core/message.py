"""The message descriptor every layer passes around: one buffer's elements and their type.

The public API (api.buffers) builds one per buffer argument after checking it;
the engine, the observers and the backends read its fields.
"""

from __future__ import annotations


class Msg:
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
