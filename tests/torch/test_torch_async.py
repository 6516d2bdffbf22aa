"""async_op=True: works in flight together, completed in any order; futures that complete by
themselves; failures that reach every rank (an error, a timeout)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

# torch.distributed first: without torch, "torch" alone would import this folder (tests/
# is on sys.path) as a namespace package
dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402

import mpicoll  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def start_mixed(g, n=48):
    """Start several collectives of every kind; (works, checks)."""
    works, checks = [], []
    for i in range(3):
        t = torch.full((n + i,), float(g.rank + i))
        works.append(dist.all_reduce(t, async_op=True, group=g.mpicoll))
        checks.append(lambda t=t, i=i: torch.equal(
            t, torch.full((n + i,), float(sum(r + i for r in range(g.size))))))
    out = torch.empty(g.size * 5, dtype=torch.int64)
    works.append(dist.all_gather_into_tensor(out, torch.full((5,), g.rank), async_op=True,
                                             group=g.mpicoll))
    checks.append(lambda: torch.equal(out, torch.arange(g.size).repeat_interleave(5)))
    rs = torch.empty(4)
    works.append(dist.reduce_scatter_tensor(rs, torch.arange(4.0 * g.size), async_op=True,
                                            group=g.mpicoll))
    checks.append(lambda: torch.equal(rs, (torch.arange(4.0) + 4 * g.rank) * g.size))
    b = torch.full((3,), g.rank)
    works.append(dist.broadcast(b, src=g.size - 1, async_op=True, group=g.mpicoll))
    checks.append(lambda: torch.equal(b, torch.full((3,), g.size - 1)))
    return works, checks


@pytest.mark.parametrize("order", ["forward", "reverse", "by_rank"])
def test_works_in_flight_complete_in_any_order(groups, order):
    g = groups
    works, checks = start_mixed(g)
    idx = list(range(len(works)))
    if order == "reverse" or (order == "by_rank" and g.rank % 2):
        idx.reverse()
    for i in idx:
        assert works[i].wait()
    assert [c() for c in checks] == [True] * len(checks)
    assert all(w.is_completed() and w.is_success() for w in works)


def test_futures_complete_without_waiting(groups):
    g = groups
    works, checks = start_mixed(g)
    futs = [w.get_future() for w in works]
    deadline = time.monotonic() + 30
    while not all(f.done() for f in futs):  # nobody calls wait(): the completion thread does it
        assert time.monotonic() < deadline, "futures did not complete without a wait()"
        time.sleep(0.001)
    assert [c() for c in checks] == [True] * len(checks)
    assert torch.equal(futs[0].value()[0], torch.full((48,), float(sum(range(g.size)))))
    chained = dist.all_reduce(torch.ones(2), async_op=True, group=g.mpicoll).get_future().then(
        lambda f: f.value()[0] * 2)
    assert torch.equal(chained.wait(), torch.full((2,), 2.0 * g.size))


def test_an_error_on_one_rank_reaches_all(groups, raising_group):
    """On a group that raises (not aborts): rank 0 passes a bad tensor (TypeError there,
    before any message); the others' call times out after the group's timeout: every rank
    raises, none hangs.  (A fresh group: a failed collective leaves it unusable.)"""
    g = groups
    if g.size < 2:
        pytest.skip("needs a peer")
    bad = raising_group(1.5)
    if g.rank == 0:
        with pytest.raises(TypeError):
            dist.all_reduce(torch.ones(4, dtype=torch.uint32), group=bad)
    else:
        with pytest.raises(mpicoll.CollectiveTimeout):
            dist.all_reduce(torch.ones(4), group=bad)
    dist.barrier(group=g.gloo)


def test_a_timeout_reaches_all(groups, raising_group):
    """On a group that raises: rank 0 does not join an async all_reduce: every other rank's
    wait() and future raise CollectiveTimeout; rank 0 meanwhile goes on."""
    g = groups
    if g.size < 2:
        pytest.skip("needs a peer")
    late = raising_group(1.5)
    if g.rank != 0:
        work = dist.all_reduce(torch.ones(1000), async_op=True, group=late)
        fut = work.get_future()
        with pytest.raises(mpicoll.CollectiveTimeout, match="wait"):  # wait()'s own timeout first
            work.wait(timedelta(seconds=0.2))
        assert not work.is_completed()
        with pytest.raises(mpicoll.CollectiveTimeout):
            work.wait()
        with pytest.raises(mpicoll.CollectiveTimeout):  # every call re-raises
            work.wait()
        assert work.is_completed() and not work.is_success()
        with pytest.raises(mpicoll.CollectiveTimeout):
            fut.wait()
    dist.barrier(group=g.gloo)
