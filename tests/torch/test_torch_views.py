"""The per-call path: one NumPy array per tensor memory, so mpicoll repeats a call without
validating it again; memory reused by another tensor; inputs kept alive while in flight."""

from __future__ import annotations

import gc
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402
from support import util  # noqa: E402

from mpicoll.api import args as _args  # noqa: E402
from mpicoll.api import arrays as _arrays  # noqa: E402
from mpicoll.torch import tensors as _tensors  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's renamed collectives


@pytest.fixture
def untimed(groups):
    """A new group of every rank without a timeout (mpicoll repeats only calls without one)."""
    group = dist.new_group(list(range(groups.size)))
    group.set_timeout(timedelta(0))
    return group


def test_a_repeated_all_reduce_is_validated_once(groups, untimed, monkeypatch):
    g = groups
    t = torch.full((100,), float(g.rank))
    calls = util.spy(monkeypatch, _arrays, ["_istart"], util.spy(monkeypatch, _args, ["allreduce"]))
    for i in range(5):
        t.fill_(g.rank + i)
        dist.all_reduce(t, group=untimed)
        assert torch.equal(t, torch.full((100,), float(sum(range(g.size)) + g.size * i)))
    # the same memory gives mpicoll the same array object: only the first call is validated
    assert calls == ["allreduce"], calls


def test_memory_views_follow_the_tensor(groups):
    """Same address: the same array only for the same element count and dtype; any other
    tensor there gets its own."""
    base = torch.zeros(8, dtype=torch.float32)
    a = _tensors.memory_view(base)
    assert a is _tensors.memory_view(base) and a is _tensors.memory_view(base.view(-1))
    assert a.dtype.name == "float32" and a.size == 8
    as_int = _tensors.memory_view(base.view(torch.int32))
    head = _tensors.memory_view(base[:4])
    assert as_int is not a and as_int.dtype.name == "int32" and head.size == 4
    a[:] = 1.5
    assert torch.equal(base, torch.full((8,), 1.5))  # the tensor's own memory


def test_reused_memory_reduces_the_new_tensor(groups, untimed):
    """Tensors made and dropped in a loop (the allocator hands the same address out again):
    each call reduces the tensor it was given."""
    g = groups
    for i in range(6):
        t = torch.full((64,), float(g.rank * 10 + i), dtype=torch.float64 if i % 2 else torch.float32)
        dist.all_reduce(t, group=untimed)
        want = float(sum(r * 10 + i for r in range(g.size)))
        assert torch.equal(t, torch.full((64,), want, dtype=t.dtype)), (i, t[:4])
        del t


@pytest.mark.parametrize("form", ["all_gather_into_tensor", "reduce_scatter_tensor"])
def test_a_temporary_input_outlives_its_async_call(groups, form):
    """An input nobody else holds, passed with async_op=True: its memory must stay the
    input's until the work is complete, though the caller dropped it and allocates more."""
    g = groups
    n = 4096
    out = torch.empty(g.size * n if form == "all_gather_into_tensor" else n)
    if form == "all_gather_into_tensor":
        work = dist.all_gather_into_tensor(out, torch.full((n,), float(g.rank + 1)),
                                           async_op=True, group=g.mpicoll)
        want = torch.arange(1.0, g.size + 1).repeat_interleave(n)
    else:
        work = dist.reduce_scatter_tensor(out, torch.full((g.size * n,), float(g.rank + 1)),
                                          async_op=True, group=g.mpicoll)
        want = torch.full((n,), float(sum(range(1, g.size + 1))))
    gc.collect()
    scribble = [torch.full((g.size * n,), -7.0) for _ in range(8)]  # reuses freed memory
    work.wait()
    del scribble
    assert torch.equal(out, want)
