"""Tensors whose elements share memory: ``expand()``, ``unfold()``, overlapping ``as_strided``.

In place (all_reduce, its coalesced form, broadcast, reduce's root) each
memory location gets the result for the first element that refers to it,
which, when every rank passes the same view, is the reduction of that
location's values on every rank (gloo's ``[3, 3, 3, 3]`` for
``tensor([rank + 1.0]).expand(4)`` at 2 ranks); locations the view does
not cover stay as they were.  As inputs such views are read element by
element.  Outputs that must hold a value per element are refused before any
message, on the module's default group (abort mode), which goes on.
"""

from __future__ import annotations

import pytest

dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402

from mpicoll.torch import tensors as _tensors  # noqa: E402

R = dist.ReduceOp
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def expanded(rank):
    return torch.tensor([rank + 1.0]).expand(4)


def unfolded(rank):
    """4 windows of 3 over 6 values: every location but the ends in several windows."""
    return (torch.arange(6.0) * (rank + 1)).unfold(0, 3, 1)


def strided_with_holes(rank):
    """(3, 2) over offsets 0, 2 | 2, 4 | 4, 6 of 10 values: shared 2 and 4, holes at odd ones."""
    return (torch.arange(10.0) + 10 * rank).as_strided((3, 2), (2, 2))


VIEWS = {"expanded": expanded, "unfolded": unfolded, "strided_with_holes": strided_with_holes}


def storage(t):
    """Every value of ``t``'s memory (its base tensor)."""
    return t._base.clone() if t._base is not None else t.clone()


def per_location(view_of, size, reduce):
    """The expected memory after an in-place collective: each location the view covers takes
    ``reduce`` of that location over the ranks' memories; the rest stays rank-local."""
    mems = [storage(view_of(r)) for r in range(size)]
    covered = torch.zeros(mems[0].numel(), dtype=torch.bool)
    covered[_tensors._offsets(view_of(0)) - view_of(0).storage_offset()] = True
    return lambda rank: torch.where(covered, reduce(torch.stack(mems)), mems[rank])


def test_shares_memory_and_offsets():
    base = torch.arange(12.0)
    assert not _tensors.shares_memory(base.reshape(3, 4).t())  # transposed: no
    assert not _tensors.shares_memory(base[::3])
    assert not _tensors.shares_memory(base.as_strided((3, 2), (2, 3)))  # interleaved, disjoint
    assert _tensors.shares_memory(base[:1].expand(4))
    assert _tensors.shares_memory(base.unfold(0, 3, 1))
    assert _tensors.shares_memory(base.as_strided((3, 2), (2, 2)))
    assert _tensors._offsets(base[2:].as_strided((2, 2), (1, 1), 3)).tolist() == [3, 4, 4, 5]


def test_write_shared_takes_the_first_element():
    base = torch.zeros(6)
    view = base.as_strided((2, 3), (1, 1))  # offsets 0 1 2 | 1 2 3
    _tensors.write_shared(view, torch.tensor([1.0, 2, 3, 4, 5, 6]))
    assert base.tolist() == [1, 2, 3, 6, 0, 0]


@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("view", list(VIEWS))
@pytest.mark.parametrize("op", ["SUM", "MAX", "AVG", "PREMUL_SUM"])
def test_all_reduce_in_place(groups, view, op, async_op):
    g = groups
    t = VIEWS[view](g.rank)
    red = {"SUM": lambda s: s.sum(0), "MAX": lambda s: s.max(0).values,
           "AVG": lambda s: s.sum(0) / g.size, "PREMUL_SUM": lambda s: (s * 2).sum(0)}[op]
    want = per_location(VIEWS[view], g.size, red)(g.rank)
    torch_op = dist._make_nccl_premul_sum(2.0) if op == "PREMUL_SUM" else getattr(R, op)
    work = dist.all_reduce(t, op=torch_op, group=g.mpicoll, async_op=async_op)
    if async_op:
        work.wait()
    assert torch.equal(storage(t), want), (storage(t), want)


def test_the_issue_example(groups):
    g = groups
    t = torch.tensor([g.rank + 1.0]).expand(4)
    dist.all_reduce(t, group=g.mpicoll)
    assert t.tolist() == [float(g.size * (g.size + 1) // 2)] * 4


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.float16, torch.bool],
                         ids=str)
def test_all_reduce_dtypes(groups, dtype):
    """Integer AVG (truncated on the staged copy), bfloat16 (both paths share the write-back),
    float16, bool."""
    g = groups
    op = R.MAX if dtype is torch.bool else R.AVG if dtype is torch.int32 else R.SUM
    base = torch.tensor([g.rank % 2 == 1]) if dtype is torch.bool else \
        torch.tensor([2 * g.rank + 1]).to(dtype)
    t = base.expand(3)
    dist.all_reduce(t, op=op, group=g.mpicoll)
    if dtype is torch.bool:
        want = torch.tensor([g.size > 1])
    elif dtype is torch.int32:
        want = torch.tensor([g.size * g.size // g.size], dtype=dtype)  # sum of 2r+1 is n^2
    else:
        want = torch.tensor([g.size * g.size]).to(dtype)
    assert torch.equal(base, want), (base, want)


def test_all_reduce_coalesced_with_a_shared_view(groups):
    g = groups
    a, b = torch.arange(3.0) + g.rank, expanded(g.rank)
    g.mpicoll.allreduce_coalesced([a, b], dist.AllreduceCoalescedOptions()).wait()
    s = g.size * (g.size + 1) // 2
    assert torch.equal(a, torch.arange(3.0) * g.size + s - g.size)
    assert b.tolist() == [float(s)] * 4


def test_ranks_with_different_views(groups):
    """Rank 0 passes an expanded view, the others plain tensors: the message is every element
    on every rank; rank 0's one location takes the first element's sum."""
    g = groups
    t = expanded(0) if g.rank == 0 else torch.arange(4.0) + g.rank
    dist.all_reduce(t, group=g.mpicoll)
    sums = torch.ones(4) + sum(torch.arange(4.0) + r for r in range(1, g.size))
    assert torch.equal(t, sums[:1].expand(4) if g.rank == 0 else sums), t


@pytest.mark.parametrize("view", list(VIEWS))
def test_broadcast_and_reduce_in_place(groups, view):
    g = groups
    root = g.size - 1
    t = VIEWS[view](g.rank)
    dist.broadcast(t, src=root, group=g.mpicoll)
    covered = per_location(VIEWS[view], g.size, lambda s: s[root])(g.rank)
    assert torch.equal(storage(t), covered)
    t = VIEWS[view](g.rank)
    dist.reduce(t, dst=0, group=g.mpicoll)
    want = per_location(VIEWS[view], g.size, lambda s: s.sum(0))(g.rank) if g.rank == 0 \
        else storage(VIEWS[view](g.rank))
    assert torch.equal(storage(t), want)


@pytest.mark.parametrize("view", list(VIEWS))
def test_shared_views_as_inputs(groups, view):
    """Read element by element: the same as the view's contiguous copy, left as they were."""
    g = groups
    make = VIEWS[view]
    x = make(g.rank)
    before = storage(x)
    flat = [make(r).contiguous().reshape(-1) for r in range(g.size)]
    out = torch.empty(g.size * x.numel())
    dist.all_gather_into_tensor(out, x, group=g.mpicoll)
    assert torch.equal(out, torch.cat(flat))
    outs = [torch.empty(x.shape) for _ in range(g.size)]
    dist.all_gather(outs, x, group=g.mpicoll)
    assert torch.equal(torch.cat([o.reshape(-1) for o in outs]), torch.cat(flat))
    big = make(g.rank).reshape(-1).expand(g.size, -1).reshape(-1) if view == "expanded" else \
        torch.cat([make(g.rank).reshape(-1)] * g.size)
    rs = torch.empty(x.numel())
    dist.reduce_scatter_tensor(rs, big, group=g.mpicoll)
    assert torch.equal(rs, sum(flat))
    assert torch.equal(storage(x), before)


def _refuse():
    """(gather: only the root has outputs; the others refuse the same way for the test)"""
    raise ValueError("no output here to share memory")


@pytest.mark.parametrize("form", ["all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
                                  "reduce_scatter", "scatter", "gather", "all_to_all_single",
                                  "all_to_all", "recv"])
def test_a_shared_output_is_refused(groups, form):
    g = groups
    shared = torch.zeros(1).expand(2 * g.size)
    calls = {
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(shared, torch.ones(2),
                                                                      group=g.mpicoll),
        "all_gather": lambda: dist.all_gather([shared[:2]] * g.size, torch.ones(2),
                                              group=g.mpicoll),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            shared[:2], torch.ones(2 * g.size), group=g.mpicoll),
        "reduce_scatter": lambda: dist.reduce_scatter(shared[:2], [torch.ones(2)] * g.size,
                                                      group=g.mpicoll),
        "gather": lambda: dist.gather(torch.ones(2), [shared[:2]] * g.size, dst=0,
                                      group=g.mpicoll) if g.rank == 0 else _refuse(),
        "all_to_all": lambda: dist.all_to_all([shared[:2]] * g.size, [torch.ones(2)] * g.size,
                                              group=g.mpicoll),
        "scatter": lambda: dist.scatter(shared[:2], [torch.ones(2)] * g.size if g.rank == 0
                                        else None, src=0, group=g.mpicoll),
        "all_to_all_single": lambda: dist.all_to_all_single(shared, torch.ones(2 * g.size),
                                                            group=g.mpicoll),
        "recv": lambda: dist.irecv(shared, group=g.mpicoll),
    }
    with pytest.raises(ValueError, match="share memory"):
        calls[form]()
    t = torch.ones(2)
    dist.all_reduce(t, group=g.mpicoll)  # nothing was started: the group goes on
    assert t.tolist() == [float(g.size)] * 2
