"""Set-up of the torch group: one default group on the mpicoll backend, and a gloo group beside it.

Every file here imports torch through ``pytest.importorskip`` (the group is
skipped without torch).  The default group is made once per test module (and destroyed after it)
with ``init_process_group(backend="mpicoll")`` and nothing else set (rank and
world size from MPI), as a user under ``mpirun`` would; the gloo group, on the
same ranks and the store of that rendezvous, is the reference backend that
every collective is compared with on the same input.

The default group has the backend's default failure handling: a failed
collective aborts the whole job (``MPICOLL_TORCH_ON_ERROR=abort``), so any
error in the training tests ends the run loudly.  Tests that make a
collective fail on purpose do it on a group of :func:`raising_group`, on
which the error is raised instead; test_launch_torch_failures.py checks the
abort itself in jobs of its own.
"""

from __future__ import annotations

import types
from datetime import timedelta

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


@pytest.fixture
def raising_group(groups, monkeypatch):
    """``make(seconds=None)``: a new group of every rank on which a failed collective raises
    (``MPICOLL_TORCH_ON_ERROR=raise``), with that timeout (None: torch's default)."""
    def make(seconds=None):
        # read when the group's communicator is set up (core.config), undone after the test
        monkeypatch.setenv("MPICOLL_TORCH_ON_ERROR", "raise")
        kwargs = {} if seconds is None else {"timeout": timedelta(seconds=seconds)}
        return groups.dist.new_group(list(range(groups.size)), **kwargs)

    return make
