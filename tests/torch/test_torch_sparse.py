"""Sparse COO all_reduce (every rank's indices and values gathered, summed, coalesced) and DDP
with a sparse embedding, against gloo.

Each rank's sparse tensor is a function of its rank (different nonzero counts,
indices shared with other ranks and indices of its own, none at all on some
ranks, duplicates and unsorted indices on input), so the expected sum is known
on every rank: its dense form is the sum of every rank's dense tensor, and the
sparse result must be identical to gloo's (same indices, values, dtype and
size, coalesced).  Bad sparse input is refused alike on every rank, and the
group goes on.
"""

from __future__ import annotations

import pytest

# torch.distributed first: without torch, "torch" alone would import this folder (tests/
# is on sys.path) as a namespace package
dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402
from torch import nn  # noqa: E402

R = dist.ReduceOp
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

DTYPES = [torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.int32, torch.int16,
          torch.int8, torch.uint8]
SHAPES = {  # name -> (size, sparse dims)
    "1d": ((13,), 1),
    "rows": ((9, 2, 3), 1),      # an embedding's gradient: sparse rows, dense trailing dims
    "2d": ((6, 5), 2),
    "2d_dense": ((4, 5, 3), 2),
}
LAYOUTS = ["overlapping", "disjoint", "empty_on_odd_ranks", "empty_everywhere",
           "uncoalesced"]


def sparse(rank, size, layout, shape, sparse_dims, dtype):
    """Rank ``rank``'s input (of a group of ``size``), a function of its rank alone."""
    rows = shape[0]
    gen = torch.Generator().manual_seed(1000 * rank + 7)
    if layout == "overlapping":  # 2 + rank nonzeros, row 0 on every rank
        first = [0] + [(3 * rank + k) % rows for k in range(1, 2 + rank)]
    elif layout == "disjoint":  # rows of this rank alone (where the size has enough)
        first = [(rank * 2 + k) % rows for k in range(2)]
    elif layout == "empty_on_odd_ranks":
        first = [] if rank % 2 else [rank % rows, (rank + 4) % rows, (rank + 1) % rows]
    elif layout == "empty_everywhere":
        first = []
    else:  # duplicates, unsorted: coalescing sums them first
        first = [(rank + 3) % rows, 1, (rank + 3) % rows, 0, 1]
    nnz = len(first)
    index = [first]
    for d in range(1, sparse_dims):  # further sparse dims: a function of the rank and position
        index.append([(rank + 2 * k + d) % shape[d] for k in range(nnz)])
    index = torch.tensor(index, dtype=torch.int64).reshape(sparse_dims, nnz)
    dense = (nnz,) + tuple(shape[sparse_dims:])
    if dtype.is_floating_point:
        values = (torch.randn(dense, generator=gen, dtype=torch.float64) * (rank + 1)).to(dtype)
    else:
        low = 0 if dtype == torch.uint8 else -9
        values = torch.randint(low, 10, dense, generator=gen, dtype=torch.int64).to(dtype)
    return torch.sparse_coo_tensor(index, values, shape, check_invariants=True)


def dense_sum(size, *args):
    total = sum(sparse(r, size, *args).to(torch.float64).to_dense() for r in range(size))
    return total


def check_result(got, args, g, gloo=None):
    """``got`` is the sum (dense form), coalesced, and identical to gloo's result ``gloo``."""
    layout, shape, sparse_dims, dtype = args
    assert got.layout == torch.sparse_coo and got.is_coalesced()
    assert got.dtype == dtype and tuple(got.shape) == shape and got.sparse_dim() == sparse_dims
    want = dense_sum(g.size, *args)
    if dtype.is_floating_point:
        tol = {torch.bfloat16: 2e-2}.get(dtype, 1e-6)
        torch.testing.assert_close(got.to(torch.float64).to_dense(), want, rtol=tol, atol=tol)
    else:  # exact, in the dtype's own wrap-around
        assert torch.equal(got.to_dense(), want.to(torch.int64).to(dtype))
    if gloo is not None:
        assert torch.equal(got.indices(), gloo.indices()), (got, gloo)
        assert torch.equal(got.values(), gloo.values()), (got, gloo)


def unchanged(x, before):
    assert torch.equal(x._indices(), before._indices())
    assert torch.equal(x._values(), before._values())


def gloo_result(x, g):
    """gloo's all_reduce of ``x``, or None where gloo has no sparse sum for its dtype."""
    x = x.clone()
    try:
        dist.all_reduce(x, group=g.gloo)
    except RuntimeError:  # (int16: "Invalid scalar type")
        return None
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_reduce_sparse(groups, layout, shape, dtype):
    g = groups
    size, sparse_dims = SHAPES[shape]
    args = (layout, size, sparse_dims, dtype)
    x = sparse(g.rank, g.size, *args)
    got = x.clone()
    dist.all_reduce(got, group=g.mpicoll)
    check_result(got, args, g, gloo_result(x, g))


@pytest.mark.parametrize("form", ["wait", "future", "blocking_requires_grad", "allreduce_sparse",
                                  "cpp_dispatch"])
def test_forms(groups, form):
    """async_op=True waited for, its future alone (completed by the backend's thread),
    a tensor that requires grad (updated in place, as on gloo without grad), the
    backend's ``allreduce_sparse`` (gloo's: the same as all_reduce), and the group's
    allreduce through torch's C++ dispatch (to the cpu backend)."""
    g = groups
    args = ("overlapping", (9, 2, 3), 1, torch.float32)
    x = sparse(g.rank, g.size, *args)
    want = gloo_result(x, g)
    got = x.clone()
    if form == "wait":
        work = dist.all_reduce(got, group=g.mpicoll, async_op=True)
        assert work.wait()
        assert work.is_completed() and work.is_success()
    elif form == "future":
        fut = dist.all_reduce(got, group=g.mpicoll, async_op=True).get_future()
        (value,) = fut.wait()
        assert value is got
    elif form == "blocking_requires_grad":
        got.requires_grad_(True)
        dist.all_reduce(got, group=g.mpicoll)
        assert got.requires_grad
        got = got.detach()
    elif form == "allreduce_sparse":
        g.mpicoll.allreduce_sparse([got], dist.AllreduceOptions()).wait()
    else:
        dist.ProcessGroup.allreduce(g.mpicoll, [got], dist.AllreduceOptions()).wait()
    check_result(got, args, g, want)


def test_in_flight_with_dense_calls_any_order(groups):
    """Sparse and dense all_reduces in flight together, waited for in reverse order (odd
    ranks: in call order); each sparse one's data start in call order on every rank."""
    g = groups
    cases = [("uncoalesced", (13,), 1, torch.float64), ("overlapping", (4, 5, 3), 2, torch.int64),
             ("empty_on_odd_ranks", (6, 5), 2, torch.float32), ("disjoint", (9, 2, 3), 1,
                                                                 torch.int32)]
    inputs = [sparse(g.rank, g.size, *args) for args in cases]
    wants = [gloo_result(x, g) for x in inputs]
    works, sparse_got, dense = [], [], []
    for i, x in enumerate(inputs):
        got = x.clone()
        sparse_got.append(got)
        works.append(dist.all_reduce(got, group=g.mpicoll, async_op=True))
        d = torch.full((5 + i,), float(g.rank + i))
        dense.append(d)
        works.append(dist.all_reduce(d, group=g.mpicoll, async_op=True))
    for w in (works if g.rank % 2 else works[::-1]):
        w.wait()
    for got, args, want in zip(sparse_got, cases, wants):
        check_result(got, args, g, want)
    for i, d in enumerate(dense):
        assert torch.equal(d, torch.full((5 + i,), float(sum(r + i for r in range(g.size)))))


def test_refusals_raise_on_every_rank_and_the_group_goes_on(groups):
    """Before any message (each rank alone): an op other than SUM, a dtype without a sparse
    sum, a sparse layout other than COO, a list mixing layouts."""
    g = groups
    x = sparse(g.rank, g.size, "overlapping", (13,), 1, torch.float32)
    before = x.clone()
    with pytest.raises(ValueError, match="op: .*SUM.*got ReduceOp.MAX"):
        dist.all_reduce(x, op=R.MAX, group=g.mpicoll)
    with pytest.raises(ValueError, match="AVG"):
        dist.all_reduce(x, op=R.AVG, group=g.mpicoll, async_op=True)
    with pytest.raises(TypeError, match="dtype float16 .*sparse"):
        dist.all_reduce(x.to(torch.float16), group=g.mpicoll)
    with pytest.raises(TypeError, match="expected a dense \\(strided\\) or sparse COO tensor, "
                                        "got layout torch.sparse_csr"):
        dist.all_reduce(torch.eye(3).to_sparse_csr(), group=g.mpicoll)
    with pytest.raises(TypeError, match="tensors\\[1\\]: expected layout torch.sparse_coo"):
        g.mpicoll.allreduce([x, torch.ones(2)], dist.AllreduceOptions())
    with pytest.raises(TypeError, match="layout torch.sparse_coo"):
        dist.all_reduce_coalesced([x], group=g.mpicoll)
    unchanged(x, before)
    got = x.clone()
    dist.all_reduce(got, group=g.mpicoll)
    check_result(got, ("overlapping", (13,), 1, torch.float32), g, gloo_result(x, g))


@pytest.mark.parametrize("mismatch", ["size", "dense_size", "sparse_dims", "dtype", "dims"])
def test_ranks_that_disagree_all_raise_and_the_group_goes_on(groups, mismatch):
    """Tensors whose size, sparse dims or dtype differ across ranks: found in the gathered
    sizes, before any data move, and raised alike on every rank (on the default group, whose
    failures would end the job), which then goes on."""
    g = groups
    last = g.rank == g.size - 1 and g.size > 1
    shape, sparse_dims, dtype = (6, 2), 1, torch.float32
    if last and mismatch == "size":
        shape = (7, 2)
    elif last and mismatch == "dense_size":
        shape = (6, 3)
    elif last and mismatch == "sparse_dims":
        sparse_dims = 2
    elif last and mismatch == "dtype":
        dtype = torch.float64
    elif last and mismatch == "dims":
        shape = (6, 2, 1)
    x = sparse(g.rank, g.size, "overlapping", shape, sparse_dims, dtype)
    before = x.clone()
    if g.size == 1:
        dist.all_reduce(x, group=g.mpicoll)
        return
    exc = TypeError if mismatch == "dtype" else ValueError
    with pytest.raises(exc, match="on every rank") as info:
        dist.all_reduce(x, group=g.mpicoll)
    messages = [None] * g.size
    dist.all_gather_object(messages, str(info.value), group=g.gloo)
    assert len(set(messages)) == 1, messages  # the same error on every rank
    assert f"rank {g.size - 1}" in messages[0], messages[0]
    unchanged(x, before)
    y = sparse(g.rank, g.size, "overlapping", (6, 2), 1, torch.float32)
    dist.all_reduce(y, group=g.mpicoll)
    check_result(y, ("overlapping", (6, 2), 1, torch.float32), g)


class Bag(nn.Module):
    """A sparse embedding (its gradient a sparse COO tensor) under a dense layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(20, 4, sparse=True)
        self.linear = nn.Linear(4, 2)

    def forward(self, tokens):
        return self.linear(self.embedding(tokens).sum(1))


def train_ddp(group, rank, steps=4):
    from torch.nn.parallel import DistributedDataParallel as DDP

    net = DDP(Bag(), process_group=group)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        # every rank's batch of token rows: each its own tokens, row counts 2 + rank
        tokens = torch.randint(0, 20, (8, 3), generator=gen)
        target = torch.randn(8, 2, generator=gen)
        mine = slice(rank, rank + 2 + rank)
        opt.zero_grad()
        ((net(tokens[mine]) - target[mine]) ** 2).sum().backward()
        assert net.module.embedding.weight.grad.layout == torch.sparse_coo
        opt.step()
    return net.module


def test_ddp_sparse_embedding_equals_gloo(groups):
    """DDP reduces the embedding's sparse gradient through all_reduce: the parameters after
    a few steps equal gloo's run on the same data (the dense layer's sums may round
    differently from gloo's: float32 rounding)."""
    g = groups
    ours = train_ddp(g.mpicoll, g.rank)
    ref = train_ddp(g.gloo, g.rank)
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
