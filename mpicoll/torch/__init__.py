"""mpicoll as a torch.distributed backend: ``import mpicoll.torch``, then ``backend="mpicoll"``.

Importing this package registers the backend ``"mpicoll"`` for CPU and CUDA
tensors (``torch.distributed.Backend.register_backend`` with the extended API,
so new groups know their global ranks; each group has one
:class:`MpicollBackend` for both devices) and lets ``init_process_group`` run
with nothing set under ``mpirun``/``srun`` (rank and world size from MPI)::

    import torch, torch.distributed as dist
    import mpicoll.torch  # noqa: F401  (registers "mpicoll")

    dist.init_process_group(backend="mpicoll")
    t = torch.tensor([dist.get_rank() + 1.0])   # rank r: [r + 1]
    dist.all_reduce(t)                          # every rank: [n(n+1)/2]

AllReduce, AllGather and ReduceScatter run mpicoll's algorithms; the other
collectives MPI's built-ins (docs/torch.md has the table).  mpicoll itself
never imports torch: only this package does.
"""

from __future__ import annotations

import torch.distributed as dist

from .backend import MpicollBackend
from .group import ProcessGroupMpicoll, create
from .rendezvous import install as _install_rendezvous
from .work import Work

BACKEND = "mpicoll"

__all__ = ["BACKEND", "MpicollBackend", "ProcessGroupMpicoll", "Work", "register"]


def register() -> None:
    """Register the ``"mpicoll"`` backend with torch.distributed (import does it; once is enough)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["cpu", "cuda"])
    _install_rendezvous()


register()
