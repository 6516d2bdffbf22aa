"""init_process_group(backend="mpicoll") with nothing set, and with the arguments torch users pass.

Each test makes the default group itself and destroys it (no ``groups``
fixture here); the checks after each init are the same: the group has torch's
rank and size, its communicator puts the MPI processes in torch-rank order,
an all_reduce and a new_group of some ranks work.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

# torch.distributed first: without torch, "torch" alone would import this folder (tests/
# is on sys.path) as a namespace package
dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpicoll.torch  # noqa: E402, F401 -- registers the backend

WORLD = MPI.COMM_WORLD


def check_group(rank, size):
    assert dist.get_rank() == rank and dist.get_world_size() == size
    assert dist.get_backend() == "mpicoll"
    pg = dist.group.WORLD
    # the group's MPI communicator is in torch-rank order
    assert pg.comm.allgather(WORLD.Get_rank()) == WORLD.allgather(rank) and pg.comm.Get_rank() == rank
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    assert t.item() == size * (size + 1) / 2
    members = list(range(0, size, 2))  # every other rank: a sub-communicator
    sub = dist.new_group(members)
    if rank in members:
        s = torch.tensor([float(rank)])
        dist.all_reduce(s, group=sub)
        assert s.item() == sum(members)
        assert sub.size() == len(members) and sub.rank() == members.index(rank)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_nothing_set():
    dist.init_process_group(backend="mpicoll")
    check_group(WORLD.Get_rank(), WORLD.Get_size())


def test_rank_and_world_size_reordered():
    """rank= and world_size= without a store: MPI supplies the rest; torch ranks reversed."""
    rank = WORLD.Get_size() - 1 - WORLD.Get_rank()
    dist.init_process_group(backend="mpicoll", rank=rank, world_size=WORLD.Get_size())
    check_group(rank, WORLD.Get_size())


def test_tcp_init_method_and_timeout():
    port = WORLD.bcast(free_port() if WORLD.Get_rank() == 0 else None, root=0)
    dist.init_process_group(backend="mpicoll", init_method=f"tcp://127.0.0.1:{port}",
                            rank=WORLD.Get_rank(), world_size=WORLD.Get_size(),
                            timeout=timedelta(seconds=42))
    assert dist.group.WORLD.timeout == 42.0  # torch's timeout is mpicoll's timeout
    check_group(WORLD.Get_rank(), WORLD.Get_size())


def test_store():
    port = WORLD.bcast(free_port() if WORLD.Get_rank() == 0 else None, root=0)
    store = dist.TCPStore("127.0.0.1", port, WORLD.Get_size(), WORLD.Get_rank() == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group(backend="mpicoll", store=store, rank=WORLD.Get_rank(),
                            world_size=WORLD.Get_size())
    check_group(WORLD.Get_rank(), WORLD.Get_size())


def test_world_size_other_than_mpi_is_refused():
    with pytest.raises(ValueError, match="world_size"):
        dist.init_process_group(backend="mpicoll", rank=0, world_size=WORLD.Get_size() + 1)
    assert not dist.is_initialized()
