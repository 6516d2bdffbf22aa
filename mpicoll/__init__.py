"""mpicoll: collective communication built by hand on MPI point-to-point messages.

Ring ReduceScatter, ring AllGather and ring AllReduce (their composition),
plus latency-optimal algorithms for small messages, on NumPy arrays and
(with CuPy) GPU arrays, checked against MPI's built-in collectives.
"""

from ._api import allgather, allreduce, reduce_scatter
from ._comm import Comm
from ._config import configure, options
from ._cuda import cuda_aware_mpi
from ._devices import bind_device
from ._errors import CollectiveTimeout, MismatchError, MpicollError
from ._timeout import abort
from ._trace import trace
from ._traffic import traffic

__version__ = "0.1.0"

__all__ = [
    "Comm",
    "allreduce",
    "allgather",
    "reduce_scatter",
    "configure",
    "options",
    "MpicollError",
    "MismatchError",
    "CollectiveTimeout",
    "bind_device",
    "cuda_aware_mpi",
    "abort",
    "traffic",
    "trace",
    "__version__",
]
