"""Rendezvous from MPI: ``init_process_group`` with nothing set under ``mpirun``/``srun``.

torch's default ``env://`` rendezvous needs ``MASTER_ADDR``, ``MASTER_PORT``,
``RANK`` and ``WORLD_SIZE``.  Under an MPI launcher the processes already know
each other: when ``env://`` finds a variable missing, this handler takes the
rank and world size from ``MPI.COMM_WORLD`` (or from ``rank=``/``world_size=``
where given), starts torch's ``TCPStore`` on torch rank 0 on a free port and
hands its address to the other ranks with one MPI broadcast.  Every
variable that is set is used as torch would use it: the fallback only
replaces the error torch would raise.  The store serves torch's own helpers
(and a gloo group beside the mpicoll one); the mpicoll backend itself sends
nothing through it.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from urllib.parse import parse_qs, urlparse

from mpi4py import MPI

_MISSING = "expected, but not set"  # the words of torch's env:// error for an unset variable
_installed = False


def install() -> None:
    """Wrap torch's ``env://`` handler with the MPI fallback (once per process)."""
    global _installed
    if _installed:
        return
    import importlib

    # the module (torch.distributed also exports a function of that name)
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    # torch has no public way to extend a registered scheme: its own dict of
    # handlers is the one place init_process_group looks up "env"
    original = rdzv._rendezvous_handlers["env"]

    def env_or_mpi(url, timeout=timedelta(minutes=30), **kwargs):
        try:
            yield from original(url, timeout=timeout, **kwargs)
        except ValueError as exc:
            if _MISSING not in str(exc):
                raise
            yield from mpi_rendezvous(url, timeout)

    rdzv._rendezvous_handlers["env"] = env_or_mpi
    _installed = True


def mpi_rendezvous(url: str, timeout):
    """Yield (store, rank, world size) from MPI.COMM_WORLD, once (as torch's handlers do)."""
    from torch.distributed import TCPStore

    query = parse_qs(urlparse(url).query)
    world = MPI.COMM_WORLD
    rank = int(query["rank"][0]) if "rank" in query else world.Get_rank()
    size = int(query["world_size"][0]) if "world_size" in query else world.Get_size()
    if size != world.Get_size():
        raise ValueError(f"world_size: expected the {world.Get_size()} processes of MPI.COMM_WORLD "
                         f"(the mpicoll rendezvous runs on MPI), got {size}")
    ranks = world.allgather(rank)
    if sorted(ranks) != list(range(size)):
        raise ValueError(f"rank: expected each of 0..{size - 1} once over the MPI processes, "
                         f"got {ranks}")
    root = ranks.index(0)
    hosts = world.allgather(socket.gethostname())
    host = "127.0.0.1" if len(set(hosts)) == 1 else hosts[root]
    if rank == 0:
        store = TCPStore(host, 0, size, True, timeout=timeout, wait_for_workers=False)
        port = world.bcast(store.port, root=root)
    else:
        port = world.bcast(None, root=root)
        store = TCPStore(host, port, size, False, timeout=timeout)
    yield store, rank, size
    raise RuntimeError("the mpicoll (MPI) rendezvous cannot run again in one process")
