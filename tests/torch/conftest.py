"""Set-up of the torch group: one default group on the mpicoll backend, and a gloo group beside it.

Every file here imports torch through ``pytest.importorskip`` (the group is
skipped without torch).  The default group is made once per test module (and destroyed after it)
with ``init_process_group(backend="mpicoll")`` and nothing else set (rank and
world size from MPI), as a user under ``mpirun`` would; the gloo group, on the
same ranks and the store of that rendezvous, is the reference backend that
every collective is compared with on the same input.
"""

from __future__ import annotations

import types

import pytest


@pytest.fixture(scope="module")
def groups():
    dist = pytest.importorskip("torch.distributed")
    import torch

    import mpicoll.torch  # noqa: F401 -- registers the backend

    if not dist.is_initialized():
        dist.init_process_group(backend="mpicoll")
    gloo = dist.new_group(backend="gloo")
    yield types.SimpleNamespace(mpicoll=dist.group.WORLD, gloo=gloo, rank=dist.get_rank(),
                                size=dist.get_world_size(), torch=torch, dist=dist)
    dist.destroy_process_group()
