"""Bad arguments on every rank: raised to the caller, nothing started, the group goes on.

On the module's default group, which has the backend's default failure
handling (``MPICOLL_TORCH_ON_ERROR=abort``): a call refused before any
message must raise TypeError/ValueError on every rank, as gloo does, and
not end the job (a regression here aborts the whole run).  Calls with
several tensors whose last one is bad must refuse before the first one's
message (a start would be a failure, and abort); every tensor is left as it
was; the next collective is correct.
"""

from __future__ import annotations

import pytest

dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402
import torch.distributed.distributed_c10d as _c10d  # noqa: E402

R = dist.ReduceOp
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


def _cases(g):
    """name -> (call(group), expected exception type, tensors that must stay as they were)."""
    n = g.size
    kept = {}

    def keep(name, *tensors):
        kept[name] = [(t, t.clone()) for t in tensors]
        return tensors

    a, = keep("coalesced_second_bad", torch.arange(4.0) + g.rank)
    p, = keep("premul_coalesced_second_bad", torch.arange(3.0) + g.rank)
    x, = keep("reduce_scatter_coalesced_second_bad", torch.arange(2.0 * n))
    y, = keep("all_gather_list_second_bad", torch.ones(2))
    cases = {
        "band_float32": (lambda grp: dist.all_reduce(torch.ones(4), op=R.BAND, group=grp),
                         ValueError),
        "band_float32_async": (lambda grp: dist.all_reduce(torch.ones(4), op=R.BXOR, group=grp,
                                                           async_op=True), ValueError),
        "uint32": (lambda grp: dist.all_reduce(torch.ones(4, dtype=torch.uint32), group=grp),
                   TypeError),
        "coalesced_second_bad": (lambda grp: grp.allreduce_coalesced(
            [a, torch.ones(2, dtype=torch.int32)], _coalesced_opts(R.SUM)), TypeError),
        "premul_coalesced_second_bad": (lambda grp: grp.allreduce_coalesced(
            [p, torch.ones(2, dtype=torch.uint32)], _coalesced_opts(dist._make_nccl_premul_sum(3.0))),
            TypeError),
        "all_gather_into_tensor_size": (lambda grp: dist.all_gather_into_tensor(
            torch.empty(n * 2 + 1), torch.ones(2), group=grp), ValueError),
        "all_gather_into_tensor_dtype": (lambda grp: dist.all_gather_into_tensor(
            torch.empty(n * 2), torch.ones(2, dtype=torch.int32), group=grp), TypeError),
        "all_gather_list_second_bad": (lambda grp: grp.allgather(
            [[torch.empty(2) for _ in range(n)], [torch.empty(2) for _ in range(n + 1)]],
            [y, torch.ones(2)], _c10d.AllgatherOptions()), ValueError),
        "reduce_scatter_tensor_size": (lambda grp: dist.reduce_scatter_tensor(
            torch.empty(2), torch.ones(2 * n + 1), group=grp), ValueError),
        "reduce_scatter_coalesced_second_bad": (lambda grp: grp.reduce_scatter_tensor_coalesced(
            [torch.empty(2), torch.empty(1)], [x, torch.ones(2 * n)],
            dist.ReduceScatterOptions()), ValueError),
        "reduce_scatter_list_count": (lambda grp: dist.reduce_scatter(
            torch.empty(1), [torch.ones(1)] * (n + 1), group=grp), ValueError),
        "reduce_band_float": (lambda grp: dist.reduce(torch.ones(3), dst=0, op=R.BAND, group=grp),
                              ValueError),
        "all_to_all_single_splits": (lambda grp: dist.all_to_all_single(
            torch.empty(n), torch.ones(n), [1] * n, [2] * n, group=grp), ValueError),
        "broadcast_dtype": (lambda grp: dist.broadcast(torch.ones(2, dtype=torch.uint32), src=0,
                                                       group=grp), TypeError),
        "send_reserved_tag": (lambda grp: dist.isend(torch.ones(1), (g.rank + 1) % n, group=grp,
                                                     tag=grp.backend._control.first), ValueError),
    }
    return cases, kept


def _coalesced_opts(op):
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = op
    return opts


NAMES = ["band_float32", "band_float32_async", "uint32", "coalesced_second_bad",
         "premul_coalesced_second_bad", "all_gather_into_tensor_size",
         "all_gather_into_tensor_dtype", "all_gather_list_second_bad",
         "reduce_scatter_tensor_size", "reduce_scatter_coalesced_second_bad",
         "reduce_scatter_list_count", "reduce_band_float", "all_to_all_single_splits",
         "broadcast_dtype", "send_reserved_tag"]


@pytest.mark.parametrize("name", NAMES)
def test_a_refusal_raises_and_the_group_goes_on(groups, name):
    g = groups
    assert g.mpicoll.on_error == "abort"  # the default: refusals must raise even so
    cases, kept = _cases(g)
    call, exc = cases[name]
    with pytest.raises(exc):
        call(g.mpicoll)
    for t, before in kept.get(name, []):
        assert torch.equal(t, before), (name, t, before)
    t = torch.arange(5.0) + g.rank
    dist.all_reduce(t, group=g.mpicoll)
    assert torch.equal(t, torch.arange(5.0) * g.size + sum(range(g.size)))


def test_names_cover_the_cases(groups):
    assert sorted(NAMES) == sorted(_cases(groups)[0])
