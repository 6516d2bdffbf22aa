"""mpicoll: collective communication built by hand on MPI point-to-point messages.

Ring ReduceScatter, ring AllGather and ring AllReduce (their composition),
plus latency-optimal algorithms for small messages, on NumPy arrays and
(with CuPy) GPU arrays, checked against MPI's built-in collectives.
"""

from . import _before_mpi  # noqa: F401  (first: see there)
from .api.arrays import allgather, allreduce, iallgather, iallreduce, ireduce_scatter, reduce_scatter
from .api.comm import Comm
from .api.requests import Handle, Request, testall, waitall
from .backends.cuda import cuda_aware_mpi
from .backends.devices import bind_device
from .core.config import configure, options
from .core.errors import CollectiveTimeout, MessageError, MismatchError, MpicollError
from .observe.trace import trace
from .observe.traffic import traffic
from .transport.timeout import abort

__version__ = "0.1.0"

__all__ = [
    "Comm",
    "allreduce",
    "allgather",
    "reduce_scatter",
    "iallreduce",
    "iallgather",
    "ireduce_scatter",
    "Request",
    "Handle",
    "waitall",
    "testall",
    "configure",
    "options",
    "MpicollError",
    "MismatchError",
    "MessageError",
    "CollectiveTimeout",
    "bind_device",
    "cuda_aware_mpi",
    "abort",
    "traffic",
    "trace",
    "__version__",
]
