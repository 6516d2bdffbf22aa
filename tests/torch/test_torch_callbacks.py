"""Future callbacks that issue collectives and wait for them (PowerSGD's hook does).

A future's ``then`` callbacks run inside ``set_result``; the backend
completes futures on delivery threads, never on the thread that completes
operations, so a callback may start a collective and wait for its future,
several layers deep.  Each test polls its futures against a deadline, so a
deadlock fails the test instead of hanging the run.
"""

from __future__ import annotations

import threading
import time

import pytest

dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

DEADLINE_S = 30.0


def settled(fut):
    """``fut``'s value, polling: AssertionError if not complete within DEADLINE_S."""
    end = time.monotonic() + DEADLINE_S
    while not fut.done():
        assert time.monotonic() < end, "the future did not complete: a callback deadlocked"
        time.sleep(0.001)
    return fut.wait()


def late(g):
    """Rank 0 comes late (the others' collectives cannot complete when they start them)."""
    if g.rank == 0:
        time.sleep(0.2)


def test_a_callback_waits_for_another_collective(groups):
    """The minimal form: fut.then(lambda f: all_reduce(b, async_op=True).get_future().wait())."""
    g = groups
    a, b = torch.full((3,), float(g.rank)), torch.full((2,), float(g.rank + 1))
    late(g)
    fut = dist.all_reduce(a, async_op=True, group=g.mpicoll).get_future()

    def callback(f):
        late(g)
        return dist.all_reduce(b, async_op=True, group=g.mpicoll).get_future().wait()

    chained = fut.then(callback)
    got = settled(chained)
    total = float(sum(range(g.size)))
    assert torch.equal(a, torch.full((3,), total))
    assert torch.equal(got[0], torch.full((2,), total + g.size)) and got[0] is b


def test_layers_of_callbacks_issue_collectives(groups):
    """Three layers of then(), each waiting for a new all_reduce (one started inside the
    previous callback), then a callback inside a callback: every value as computed."""
    g = groups
    size, total = g.size, float(sum(range(g.size)))

    def step(f):
        t = f.value()[0] * 2
        late(g)
        return dist.all_reduce(t, async_op=True, group=g.mpicoll).get_future().wait()

    t0 = torch.full((4,), float(g.rank))
    fut = dist.all_reduce(t0, async_op=True, group=g.mpicoll).get_future()
    got = settled(fut.then(step).then(step).then(step))
    assert torch.equal(got[0], torch.full((4,), total * (2 * size) ** 3))

    def outer(f):
        inner = dist.all_reduce(torch.ones(2), async_op=True, group=g.mpicoll).get_future()
        return settled(inner.then(step))[0] + f.value()[0]

    fut = dist.all_reduce(torch.ones(2), async_op=True, group=g.mpicoll).get_future()
    assert torch.equal(settled(fut.then(outer)), torch.full((2,), 2.0 * size * size + size))


def test_callbacks_do_not_run_on_the_progress_thread(groups):
    g = groups
    names = []
    fut = dist.all_reduce(torch.ones(1), async_op=True, group=g.mpicoll).get_future()
    settled(fut.then(lambda f: names.append(threading.current_thread().name)))
    assert names and names[0] != "mpicoll-progress", names
