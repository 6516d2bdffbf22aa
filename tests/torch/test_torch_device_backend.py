"""The group's per-device backend: what torch finds with ``group._get_backend(device)``.

torch's calls that ask a group for a device's backend, or dispatch to it from
C++: ``recv``/``irecv`` without a source (the sender's rank returned),
``batch_isend_irecv``, ``monitored_barrier`` (passing, and naming the ranks
that did not arrive, in gloo's words), the coalescing manager with and
without a device; each against gloo's result where gloo has the call.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402
from torch.distributed.distributed_c10d import _coalescing_manager  # noqa: E402

import mpicoll  # noqa: E402
from mpicoll.torch import MpicollBackend  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

CPU = torch.device("cpu")


def needs_peers(g):
    if g.size < 2:
        pytest.skip("needs a peer")


def test_a_backend_for_cpu_and_cuda(groups):
    g = groups
    pg = g.mpicoll
    assert set(d.type for d in pg._device_types) == {"cpu", "cuda"}
    backend = pg._get_backend(CPU)
    assert isinstance(backend, MpicollBackend) and backend is pg.backend
    assert pg._get_backend(torch.device("cuda")) is backend
    assert backend.rank() == g.rank and backend.size() == g.size
    # a new group has its own
    sub = dist.new_group(list(range(g.size)))
    assert sub._get_backend(CPU) is not backend and sub._get_backend(CPU).size() == g.size


def test_cpp_dispatch_reaches_the_backend(groups):
    """ProcessGroup.reduce from C++ (not overridden by the Python group): torch's dispatcher
    finds the cpu backend and runs its reduce."""
    g = groups
    t = torch.full((3,), float(g.rank + 1))
    opts = dist.ReduceOptions()
    opts.rootRank = 0
    opts.reduceOp = dist.ReduceOp.SUM
    dist.ProcessGroup.reduce(g.mpicoll, [t], opts).wait()
    want = float(g.size * (g.size + 1) // 2) if g.rank == 0 else float(g.rank + 1)
    assert torch.equal(t, torch.full((3,), want))


@pytest.mark.parametrize("form", ["recv", "irecv"])
def test_receive_from_any_source(groups, form):
    """Each rank in turn receives one message from every other rank, not saying from whom:
    the sender returned (``recv``) or reported by the work (``irecv``) is the one whose data
    arrived, and every sender is seen once (torch's test_send_recv_any_source)."""
    g = groups
    needs_peers(g)
    senders = []
    for receiver in range(g.size):
        if g.rank == receiver:
            for _ in range(g.size - 1):
                got = torch.full((10,), -1.0)
                if form == "recv":
                    sender = dist.recv(got, group=g.mpicoll)
                else:
                    work = dist.irecv(got, group=g.mpicoll)
                    work.wait()
                    sender = work._source_rank()
                    assert work.source_rank() == sender
                assert torch.equal(got, torch.full((10,), float(sender))), (sender, got)
                senders.append(sender)
        else:
            dist.send(torch.full((10,), float(g.rank)), receiver, group=g.mpicoll)
    assert sorted(senders) == [r for r in range(g.size) if r != g.rank]
    dist.barrier(group=g.gloo)


def test_receive_from_any_source_on_a_subgroup(groups):
    """On a group of some ranks (reversed): the sender is returned as a global rank."""
    g = groups
    needs_peers(g)
    members = list(range(g.size))[::-1][:2]  # the last two ranks, in reverse order
    sub = dist.new_group(members)
    if g.rank == members[0]:
        got = torch.zeros(2, dtype=torch.int64)
        assert dist.recv(got, group=sub) == members[1]
        assert torch.equal(got, torch.full((2,), members[1]))
    elif g.rank == members[1]:
        dist.send(torch.full((2,), g.rank), members[0], group=sub)
    dist.barrier(group=g.gloo)


def test_source_rank_of_other_works(groups):
    g = groups
    work = dist.all_reduce(torch.ones(1), async_op=True, group=g.mpicoll)
    work.wait()
    with pytest.raises(RuntimeError, match="sourceRank"):
        work._source_rank()


@pytest.mark.parametrize("tags", [False, True])
def test_batch_isend_irecv(groups, tags):
    """Every pair exchanges a tensor whose size and values depend on both ranks (the list
    ordered receive-first, as torch's test); the same with gloo."""
    g = groups
    needs_peers(g)
    for group in (g.mpicoll, g.gloo):
        ops, got = [], {}
        for peer in range(g.size):
            if peer == g.rank:
                continue
            got[peer] = torch.full((peer + 1,), -1.0)
            kw = {"tag": peer} if tags else {}
            ops.append(dist.P2POp(dist.irecv, got[peer], peer, group=group, **kw))
            kw = {"tag": g.rank} if tags else {}
            ops.append(dist.P2POp(dist.isend, torch.full((g.rank + 1,), float(g.rank * 10 + peer)),
                                  peer, group=group, **kw))
        works = dist.batch_isend_irecv(ops)
        assert len(works) == len(ops)
        for w in works:
            w.wait()
        for peer, t in got.items():
            assert torch.equal(t, torch.full((peer + 1,), float(peer * 10 + g.rank))), (peer, t)


def test_batch_isend_irecv_ring(groups):
    g = groups
    needs_peers(g)
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    got = torch.empty(3, dtype=torch.int32)
    works = dist.batch_isend_irecv([
        dist.P2POp(dist.isend, torch.arange(3, dtype=torch.int32) + g.rank, nxt, group=g.mpicoll),
        dist.P2POp(dist.irecv, got, prv, group=g.mpicoll)])
    for w in works:
        w.wait()
    assert torch.equal(got, torch.arange(3, dtype=torch.int32) + prv)


def test_tags_reserved_by_the_backend_are_refused(groups, raising_group):
    g = groups
    group = raising_group()
    first = group.backend._control.first
    with pytest.raises(ValueError, match="tag"):
        dist.isend(torch.ones(1), (g.rank + 1) % g.size, group=group, tag=first)
    with pytest.raises(ValueError, match="tag"):
        dist.irecv(torch.ones(1), group=group, tag=first + 1)
    t = torch.ones(2)
    dist.all_reduce(t, group=group)  # nothing was started
    assert torch.equal(t, torch.full((2,), float(g.size)))


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_monitored_barrier_passes(groups, wait_all_ranks):
    g = groups
    for _ in range(3):
        dist.monitored_barrier(group=g.mpicoll, timeout=timedelta(seconds=30),
                               wait_all_ranks=wait_all_ranks)
    t = torch.ones(1)
    dist.all_reduce(t, group=g.mpicoll)  # the group goes on
    assert t.item() == g.size


@pytest.mark.parametrize("wait_all_ranks", [False, True])
def test_monitored_barrier_names_the_missing_ranks(groups, wait_all_ranks):
    """Rank 1 does not call (nor, with wait_all_ranks, any rank from 2 on): rank 0 raises
    naming it (them) after the barrier's timeout, and tells the ranks that arrived, which
    raise at once (not after the group's timeout of 30 s); a later barrier of every rank
    passes (its tags are new)."""
    g = groups
    needs_peers(g)
    group = dist.new_group(list(range(g.size)), timeout=timedelta(seconds=30))
    missing = [1] if not wait_all_ranks else list(range(1, g.size))
    if g.rank == 0:
        ranks = ", ".join(map(str, missing))
        want = (f"\\[Rank 0\\]: Ranks {ranks} failed to pass monitoredBarrier in 500 ms"
                if wait_all_ranks else "\\[Rank 0\\]: Rank 1 failed to pass monitoredBarrier in 500 ms")
        with pytest.raises(mpicoll.CollectiveTimeout, match=want):
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=0.5),
                                   wait_all_ranks=wait_all_ranks)
    elif g.rank not in missing:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=f"Rank {g.rank} successfully reached "
                                               f"monitoredBarrier, but received errors"):
            dist.monitored_barrier(group=group, timeout=timedelta(seconds=0.5),
                                   wait_all_ranks=wait_all_ranks)
        assert time.monotonic() - start < 15, "waited for the group's timeout"
    dist.barrier(group=g.gloo)
    group.set_timeout(timedelta(seconds=60))
    if g.rank in missing:  # catch up with the failed call's tags
        group.backend._control.calls += 1
    dist.monitored_barrier(group=group, timeout=timedelta(seconds=30))


def test_monitored_barrier_out_of_time_on_rank_0(groups):
    """A timeout of 0: rank 0 has no time left before the first rank (gloo's message)."""
    g = groups
    needs_peers(g)
    group = dist.new_group(list(range(g.size)))
    if g.rank == 0:
        with pytest.raises(RuntimeError, match="Rank 0 timed out in monitoredBarrier after 0 ms"):
            group.monitored_barrier(timedelta(seconds=0))
    dist.barrier(group=g.gloo)


def test_coalescing_manager_with_a_device(groups):
    """_coalescing_manager(group, device): the backend's start/end_coalescing; the works
    started inside complete with the one work it returns."""
    g = groups
    needs_peers(g)
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    got = torch.zeros(4)
    with _coalescing_manager(g.mpicoll, CPU, async_ops=True) as cm:
        dist.isend(torch.full((4,), float(g.rank)), nxt, group=g.mpicoll)
        dist.irecv(got, prv, group=g.mpicoll)
    assert len(cm.works) == 1
    cm.wait()
    assert torch.equal(got, torch.full((4,), float(prv)))


@pytest.mark.parametrize("device", [None, CPU])
def test_coalescing_manager_all_reduces(groups, device):
    """all_reduce inside the manager runs as one allreduce_coalesced (with or without a
    device), equal to gloo's."""
    g = groups
    outs = {}
    for name, group in (("mpicoll", g.mpicoll), ("gloo", g.gloo)):
        ts = [torch.arange(float(n)) + g.rank for n in (1, 5, 0, 3)]
        with _coalescing_manager(group, device if name == "mpicoll" else None):
            for t in ts:
                dist.all_reduce(t, group=group)
        outs[name] = ts
    for a, b in zip(outs["mpicoll"], outs["gloo"]):
        assert torch.equal(a, b)
    assert torch.equal(outs["mpicoll"][1], torch.arange(5.0) * g.size + sum(range(g.size)))
