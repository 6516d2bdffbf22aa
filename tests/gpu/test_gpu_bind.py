"""mpicoll.bind_device: node-local rank -> GPU, on a fake CUDA runtime (and CuPy where present).

Expected devices follow each rank's node-local rank (its rank among the ranks
of ``comm`` on its node), so the file also holds across nodes (the emulated
cluster, tests/cluster/).
"""

from __future__ import annotations

import pytest
from mpi4py import MPI
from support import fakegpu

import mpicoll
from mpicoll.backends import devices as _devices

WORLD = MPI.COMM_WORLD

LOCAL_VARS = _devices._LOCAL_RANK_VARS


def _local(comm):
    """(node-local rank, ranks on this node) of ``comm``'s calling rank."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.rank, node.size
    finally:
        node.Free()


@pytest.fixture
def no_hints(monkeypatch):
    for var in LOCAL_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("devices", [1, 2, 3, 8])
def test_round_robin_over_visible_devices(no_hints, devices):
    rt = fakegpu.FakeRuntime(devices=devices)
    local, _ = _local(WORLD)
    dev = _devices._bind(WORLD, lambda: rt)
    assert dev == local % devices
    assert rt.current_device() == dev


def test_launcher_hint_used_when_consistent(no_hints):
    """A launcher numbering the node's ranks 0..n-1 differently from rank order is followed."""
    local, on_node = _local(WORLD)
    no_hints.setenv("SLURM_LOCALID", str(on_node - 1 - local))
    rt = fakegpu.FakeRuntime(devices=on_node + 1)
    assert _devices._bind(WORLD, lambda: rt) == on_node - 1 - local


def test_launcher_hint_ignored_when_inconsistent(no_hints):
    no_hints.setenv("SLURM_LOCALID", "0")  # every rank claims local rank 0
    rt = fakegpu.FakeRuntime(devices=WORLD.size + 1)
    assert _devices._bind(WORLD, lambda: rt) == _local(WORLD)[0]


def test_sub_communicator_reversed(no_hints):
    comm = WORLD.Split(0, WORLD.size - WORLD.rank)  # reversed rank order
    try:
        rt = fakegpu.FakeRuntime(devices=64)
        assert _devices._bind(comm, lambda: rt) == _local(comm)[0]
    finally:
        comm.Free()


def test_no_gpu_raises_on_every_rank(no_hints):
    rt = fakegpu.FakeRuntime(devices=0)
    with pytest.raises(mpicoll.MpicollError, match="no GPU visible"):
        _devices._bind(WORLD, lambda: rt)


def test_one_rank_without_gpu_fails_all(no_hints):
    """No rank is left to hang in a later collective when another could not bind."""
    rt = fakegpu.FakeRuntime(devices=0 if WORLD.rank == 0 else 1)
    expected = "no GPU visible" if WORLD.rank == 0 else "failed on rank 0"
    with pytest.raises(mpicoll.MpicollError, match=expected):
        _devices._bind(WORLD, lambda: rt)


def test_bad_comm():
    with pytest.raises(TypeError, match="comm: expected an mpi4py.MPI.Intracomm"):
        mpicoll.bind_device("world")


def test_real_bind_device():
    """With CuPy: binds to rank % GPUs; without: a clear error naming CuPy, on every rank."""
    try:
        import cupy
    except ImportError:
        with pytest.raises(mpicoll.MpicollError, match="CuPy is not installed"):
            mpicoll.bind_device()
        return
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count == 0:
        with pytest.raises(mpicoll.MpicollError):
            mpicoll.bind_device()
        return
    dev = mpicoll.bind_device()
    assert 0 <= dev < count and cupy.cuda.runtime.getDevice() == dev


def test_context_failure_on_one_rank_fails_all(no_hints):
    """A CUDA context that cannot be created on one rank (exclusive mode, MIG, memory) fails all.

    Before the fix the context was created after the ranks agreed, so only
    that rank raised and the others returned, to wait for it in their next
    collective.
    """
    error = "cudaErrorDevicesUnavailable: all CUDA-capable devices are busy or unavailable"
    rt = fakegpu.FakeRuntime(devices=1, context_error=error if WORLD.rank == WORLD.size - 1 else None)
    last = WORLD.size - 1
    expected = "cannot create a CUDA context on device 0" if WORLD.rank == last else f"failed on rank {last}"
    outcome = "returned"
    try:
        _devices._bind(WORLD, lambda: rt)
    except Exception as exc:  # caught on every rank, so the check below is collective
        outcome = f"{type(exc).__name__}: {exc}"
    outcomes = WORLD.allgather(outcome)
    assert all(o.startswith("MpicollError: ") for o in outcomes), outcomes
    assert expected in outcome and "devices are busy" in outcomes[last]
