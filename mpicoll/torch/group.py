"""The group of the ``"mpicoll"`` backend: the creator torch calls, and the ``ProcessGroup`` it returns.

:func:`create` makes a group's MPI communicator and its
:class:`~mpicoll.torch.backend.MpicollBackend`, and returns a
:class:`ProcessGroupMpicoll` with that backend registered for ``cpu`` and
``cuda``, so torch finds it as any third-party backend
(``group._get_backend(device)``: ``batch_isend_irecv``, ``monitored_barrier``,
the coalescing manager, any call torch's C++ side dispatches to a device's
backend).

Why a ``ProcessGroup`` subclass around the backend, not torch's own
``ProcessGroup``: torch 2.14 hands a Python backend's works back wrapped in a
C++ holder that forwards only ``wait()`` and ``get_future()``, so through it
``is_completed()`` stays False, ``result()`` and ``_source_rank()`` raise.
torch.distributed's Python functions call the group's methods from Python;
on this subclass they reach the backend's methods directly and return its
:class:`~mpicoll.torch.work.Work` itself, with all of its methods
(``dist.recv`` without ``src`` returns the sender, ``is_completed()``
answers).

Communicators: the default group runs on ``MPI.COMM_WORLD`` ordered by torch
rank; a group of ``new_group(ranks)`` or a ``DeviceMesh`` dimension on the
MPI communicator of exactly those global ranks, in group-rank order
(``MPI_Comm_create_group``, which only the members call, as torch only
creates the backend on members).
"""

from __future__ import annotations

import zlib

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import allreduce
from ..core import config as _config
from .backend import MpicollBackend, _seconds

DEVICES = ("cpu", "cuda")
_CUSTOM = dist.ProcessGroup.BackendType.CUSTOM
_world: list = [None]  # the default group's communicator (COMM_WORLD in torch-rank order)

# the group's method -> the backend's: every name torch 2.14's Python functions call on a
# group, the older names included
_FORWARDED = {name: name for name in (
    "allreduce", "allreduce_coalesced", "allreduce_sparse", "allgather", "allgather_coalesced",
    "all_gather_single", "all_gather_single_coalesced", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "broadcast", "barrier", "reduce", "gather", "scatter",
    "all_to_all_single", "alltoall", "send", "recv", "recv_anysource")}
_FORWARDED.update({
    "_allgather_base": "all_gather_single",
    "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "_reduce_scatter_base": "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
    "alltoall_base": "all_to_all_single",
})


def create(dist_opts, backend_opts=None):
    """The backend's creator for ``register_backend(..., extended_api=True)``."""
    ranks = list(dist_opts.global_ranks_in_group)
    rank, size = dist_opts.group_rank, dist_opts.group_size
    if not ranks:
        world = MPI.COMM_WORLD
        if size != world.Get_size():
            raise ValueError(
                f"world_size: the mpicoll backend runs on the MPI processes of one job: expected "
                f"{world.Get_size()} (MPI.COMM_WORLD's size), got {size}; launch with "
                f"mpirun -n {size} (or srun)")
        comm = world.Split(0, rank)
        _world[0] = comm
    else:
        parent = _world[0]
        if parent is None:
            raise RuntimeError("new_group: the default group is not an mpicoll group")
        group = parent.Get_group().Incl(ranks)
        # one tag per member set: only members call Create_group, in torch's order
        comm = parent.Create_group(group, tag=zlib.crc32(repr(ranks).encode()) % 32768)
        group.Free()
    if comm.Get_rank() != rank or comm.Get_size() != size:
        raise RuntimeError(f"mpicoll backend: MPI placed this process at rank {comm.Get_rank()} "
                           f"of {comm.Get_size()}, torch at rank {rank} of {size}")
    # mpicoll sets itself up on a communicator (a private duplicate) at its first
    # collective: do it now, while every member is creating the group, so that a
    # rank that later skips a collective makes the others time out in that
    # collective's work, not in a set-up inside the call
    allreduce(np.zeros(1), comm=comm, timeout=_seconds(dist_opts.timeout))
    # sparse all_reduce's data run on a duplicate of their own (mpicoll.torch.sparse), made
    # and set up by mpicoll now for the same reason
    sparse_comm = comm.Dup()
    allreduce(np.zeros(1), comm=sparse_comm, timeout=_seconds(dist_opts.timeout))
    # that first call read mpicoll's options for the communicator (core.config)
    backend = MpicollBackend(comm, rank, size, dist_opts.timeout,
                             on_error=_config.get("torch_on_error"), sparse_comm=sparse_comm)
    return ProcessGroupMpicoll(backend)


class ProcessGroupMpicoll(dist.ProcessGroup):
    """A group of the ``"mpicoll"`` backend: its :class:`MpicollBackend`, for ``cpu`` and ``cuda``.

    Every collective is the backend's method of that name (the older names
    too); ``backend``, ``comm``, ``timeout`` and ``on_error`` are the backend's.
    """

    def __init__(self, backend: MpicollBackend):
        super().__init__(backend.rank(), backend.size())
        self.backend = backend
        self._group_name = ""
        self._group_desc = ""
        self._set_default_backend(_CUSTOM)
        for device in DEVICES:
            self._register_backend(torch.device(device), _CUSTOM, backend)

    # -- identity (DeviceMesh and FSDP2 name groups through these) -------------------------
    def getBackendName(self) -> str:
        return "mpicoll"

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def set_timeout(self, timeout) -> None:
        self.backend.set_timeout(timeout)

    @property
    def timeout(self):
        """The seconds every collective of the group may go without progress (None: no limit)."""
        return self.backend.timeout

    @property
    def comm(self):
        """The MPI communicator of this group (its ranks in group-rank order)."""
        return self.backend.comm

    @property
    def on_error(self) -> str:
        """``"abort"`` or ``"raise"``: what a failed collective does (MPICOLL_TORCH_ON_ERROR)."""
        return self.backend.on_error

    def __repr__(self) -> str:
        return f"<ProcessGroupMpicoll rank {self.rank()} of {self.size()}>"


def _forward(name: str, to: str):
    def method(self, *args, **kwargs):
        return getattr(self.backend, to)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The backend's ``{to}``."
    return method


for _name, _to in _FORWARDED.items():
    setattr(ProcessGroupMpicoll, _name, _forward(_name, _to))
