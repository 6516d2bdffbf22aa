"""Every collective of the mpicoll backend x op x dtype, against gloo and an exact reference.

Inputs are small integers that depend on the rank, so every SUM, PRODUCT
and AVG here is exact in every dtype (bfloat16 and float16 included): results
must be identical to gloo's (where gloo has the op) and to the reference
computed from every rank's input, which is a function of rank and size.
Floating-point sums of arbitrary data are judged by mpicoll.tools.results in
test_float_sums_within_the_rule.
"""

from __future__ import annotations

import functools

import pytest

# torch.distributed first: without torch, "torch" alone would import this folder (tests/
# is on sys.path) as a namespace package
dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpicoll.tools import results  # noqa: E402

R = dist.ReduceOp
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.uint8, torch.bool]
ARITH = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]
BITWISE = ["BAND", "BOR", "BXOR"]
COUNTS = [0, 1, 2, 7]
# the deprecated names (all_gather_into_tensor, reduce_scatter_tensor) are what users call
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")  # 2 < 3 ranks: some blocks empty; 7: uneven


def ops_of(dtype):
    if dtype is torch.bool:
        return ["MIN", "MAX", "SUM", "PRODUCT"] + BITWISE
    if dtype.is_floating_point:
        return ARITH
    return [o for o in ARITH if o != "PREMUL_SUM"] + BITWISE


CASES = [(d, o) for d in DTYPES for o in ops_of(d)]


def ids(case):
    return f"{str(case[0]).replace('torch.', '')}-{case[1]}"


def make_op(name):
    return dist._make_nccl_premul_sum(2.0) if name == "PREMUL_SUM" else getattr(R, name)


def data(rank, n, dtype, salt=0):
    """Rank ``rank``'s input: small values, different on every rank (exact sums and products)."""
    i = torch.arange(n, dtype=torch.int64)
    if dtype is torch.bool:
        return ((i + rank + salt) % 3 == 0)
    v = (i * 7 + rank * 5 + salt) % 5 + (1 if dtype is torch.uint8 else -1)  # -1..3 (uint8: 1..5)
    if dtype is torch.int8 or not dtype.is_floating_point:
        return v.to(dtype)
    return v.to(dtype)


def reference(name, tensors, size):
    """The exact reduction of every rank's tensor (in float64 / int64), as torch defines the op."""
    dtype = tensors[0].dtype
    if dtype is torch.bool:
        stack = torch.stack(tensors)
        if name in ("MIN", "PRODUCT", "BAND"):
            return stack.all(0)
        if name in ("MAX", "SUM", "BOR"):
            return stack.any(0)
        return functools.reduce(torch.logical_xor, tensors)
    wide = torch.float64 if dtype.is_floating_point else torch.int64
    stack = torch.stack([t.to(wide) for t in tensors])
    if name in BITWISE:
        f = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[name]
        return functools.reduce(f, [t.to(dtype) for t in tensors])
    if name == "SUM":
        out = stack.sum(0)
    elif name == "PREMUL_SUM":
        out = (stack * 2.0).sum(0)
    elif name == "PRODUCT":
        out = stack.prod(0)
    elif name == "MIN":
        out = stack.min(0).values
    elif name == "MAX":
        out = stack.max(0).values
    else:  # AVG: SUM, then divide (integers: truncated)
        s = stack.sum(0)
        out = s / size if dtype.is_floating_point else torch.div(s, size, rounding_mode="trunc")
    return out.to(dtype)


def gloo_or_none(fn):
    """gloo's result, or None for an op/dtype gloo does not have (then the reference alone)."""
    try:
        return fn()
    except (RuntimeError, ValueError, TypeError):
        return None


def same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    assert torch.equal(got, want), f"got {got}, expected {want}"


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_all_reduce(groups, case, count):
    dtype, name = case
    g = groups
    x = data(g.rank, count, dtype)
    want = reference(name, [data(r, count, dtype) for r in range(g.size)], g.size)
    got = x.clone()
    dist.all_reduce(got, op=make_op(name), group=g.mpicoll)
    same(got, want)
    ref = gloo_or_none(lambda: _gloo_all_reduce(x.clone(), name, g))
    if ref is not None:
        same(got, ref)


def _gloo_all_reduce(x, name, g):
    if name in ("AVG", "PREMUL_SUM"):
        raise RuntimeError("gloo has no " + name)
    dist.all_reduce(x, op=getattr(R, name), group=g.gloo)
    return x


@pytest.mark.parametrize("count", [0, 1, 3])
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_reduce_scatter_tensor(groups, case, count):
    dtype, name = case
    g = groups
    x = data(g.rank, count * g.size, dtype)
    full = reference(name, [data(r, count * g.size, dtype) for r in range(g.size)], g.size)
    out = torch.empty(count, dtype=dtype)
    before = x.clone()
    dist.reduce_scatter_tensor(out, x, op=make_op(name), group=g.mpicoll)
    same(out, full[g.rank * count:(g.rank + 1) * count])
    same(x, before)  # the input is left as it was
    if name not in ("AVG", "PREMUL_SUM"):
        ref = torch.empty(count, dtype=dtype)
        if gloo_or_none(lambda: dist.reduce_scatter_tensor(ref, x.clone(), op=getattr(R, name),
                                                            group=g.gloo)) is not None:
            same(out, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter_list_uneven(groups, dtype):
    g = groups
    counts = [(r * 3 + 1) % 4 for r in range(g.size)]  # 1, 0, 3 ... : uneven, some empty
    ins = [data(g.rank, c, dtype, salt=r) for r, c in enumerate(counts)]
    out = torch.empty(counts[g.rank], dtype=dtype)
    dist.reduce_scatter(out, ins, op=R.MAX, group=g.mpicoll)
    want = reference("MAX", [data(r, counts[g.rank], dtype, salt=g.rank) for r in range(g.size)],
                     g.size)
    same(out, want)


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather_forms(groups, dtype, count):
    g = groups
    x = data(g.rank, count, dtype)
    want = torch.cat([data(r, count, dtype) for r in range(g.size)])
    outs = [torch.empty(count, dtype=dtype) for _ in range(g.size)]
    dist.all_gather(outs, x, group=g.mpicoll)
    same(torch.cat(outs), want)
    flat = torch.empty(count * g.size, dtype=dtype)
    dist.all_gather_into_tensor(flat, x, group=g.mpicoll)
    same(flat, want)
    ref = torch.empty(count * g.size, dtype=dtype)
    if gloo_or_none(lambda: dist.all_gather_into_tensor(ref, x, group=g.gloo)) is not None:
        same(flat, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_all_gather_in_place_own_block(groups, dtype):
    """FSDP2's form: the input is this rank's block of the output."""
    g = groups
    out = torch.full((g.size * 5,), -9, dtype=dtype) if dtype is not torch.bool else None
    block = out[g.rank * 5:(g.rank + 1) * 5]
    block.copy_(data(g.rank, 5, dtype))
    dist.all_gather_into_tensor(out, block, group=g.mpicoll)
    same(out, torch.cat([data(r, 5, dtype) for r in range(g.size)]))


def test_all_gather_into_tensor_partial_overlap(groups):
    """An input overlapping the output elsewhere than its own block still gathers the input."""
    g = groups
    out = torch.zeros(g.size * 2 + 1)
    src = out[1:3]
    src.copy_(torch.tensor([g.rank + 1.0, g.rank + 2.0]))
    expect = torch.cat([torch.tensor([r + 1.0, r + 2.0]) for r in range(g.size)])
    dist.all_gather_into_tensor(out[: g.size * 2], src, group=g.mpicoll)
    same(out[: g.size * 2], expect)


def test_non_contiguous_and_requires_grad(groups):
    g = groups
    base = torch.arange(12.0).reshape(3, 4) + g.rank
    view = base.t()  # strided
    dist.all_reduce(view, group=g.mpicoll)
    want = sum(torch.arange(12.0).reshape(3, 4) + r for r in range(g.size))
    same(base, want)
    p = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        dist.all_reduce(p, group=g.mpicoll)
    same(p.detach(), torch.full((3,), float(g.size)))
    out = torch.empty(3 * g.size)
    dist.all_gather_into_tensor(out, torch.ones(3, requires_grad=True) * g.rank, group=g.mpicoll)
    same(out, torch.cat([torch.full((3,), float(r)) for r in range(g.size)]))


def test_short_path_only_for_the_call_it_fits(groups, monkeypatch):
    """dist.all_reduce of one contiguous CPU tensor, SUM, blocking, skips the general path
    (group.allreduce's short path); each other form (bool, bfloat16, another op, a strided
    view, requires_grad, async) takes the general one.  Every result exact."""
    from mpicoll.torch import backend as B
    g = groups
    general = []
    real = B.MpicollBackend._allreduce
    monkeypatch.setattr(B.MpicollBackend, "_allreduce",
                        lambda self, *a: general.append(a[-1]) or real(self, *a))
    f32 = torch.float32
    cases = {  # name: (the input of rank r, op, async_op, takes the short path)
        "float32": (lambda r: data(r, 5, f32), "SUM", False, True),
        "int64": (lambda r: data(r, 5, torch.int64), "SUM", False, True),
        "empty": (lambda r: data(r, 0, f32), "SUM", False, True),
        "bool": (lambda r: data(r, 5, torch.bool), "SUM", False, False),
        "bfloat16": (lambda r: data(r, 5, torch.bfloat16), "SUM", False, False),
        "max": (lambda r: data(r, 5, f32), "MAX", False, False),
        "strided": (lambda r: data(r, 10, f32)[::2], "SUM", False, False),
        "grad": (lambda r: data(r, 5, f32).requires_grad_(), "SUM", False, False),
        "async": (lambda r: data(r, 5, f32), "SUM", True, False),
    }
    for name, (make, op, async_op, short) in cases.items():
        t = make(g.rank)
        want = reference(op, [make(r).detach() for r in range(g.size)], g.size)
        before = len(general)
        with torch.no_grad():
            work = dist.all_reduce(t, op=getattr(R, op), group=g.mpicoll, async_op=async_op)
        if async_op:
            work.wait()
        assert (len(general) == before) == short, name
        same(t.detach(), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_coalesced_forms(groups, dtype):
    g = groups
    xs = [data(g.rank, n, dtype, salt=n) for n in (1, 4, 0)]
    ys = [x.clone() for x in xs]
    dist.all_reduce_coalesced(ys, op=R.MAX, group=g.mpicoll)
    for n, y in zip((1, 4, 0), ys):
        same(y, reference("MAX", [data(r, n, dtype, salt=n) for r in range(g.size)], g.size))
    pg = g.mpicoll
    outs = [torch.empty(n * g.size, dtype=dtype) for n in (1, 4, 0)]
    pg.all_gather_single_coalesced(outs, xs, None).wait()
    for n, o in zip((1, 4, 0), outs):
        same(o, torch.cat([data(r, n, dtype, salt=n) for r in range(g.size)]))
    big = [data(g.rank, n * g.size, dtype, salt=n) for n in (1, 4, 0)]
    rs = [torch.empty(n, dtype=dtype) for n in (1, 4, 0)]
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = R.MAX
    pg.reduce_scatter_single_coalesced(rs, big, opts).wait()
    for n, o in zip((1, 4, 0), rs):
        full = reference("MAX", [data(r, n * g.size, dtype, salt=n) for r in range(g.size)], g.size)
        same(o, full[g.rank * n:(g.rank + 1) * n])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_builtins(groups, dtype):
    """broadcast, reduce, gather, scatter, all_to_all_single (uneven), barrier: equal to gloo."""
    g = groups
    root = g.size - 1
    b = data(g.rank, 5, dtype)
    dist.broadcast(b, src=root, group=g.mpicoll)
    same(b, data(root, 5, dtype))
    r = data(g.rank, 4, dtype)
    dist.reduce(r, dst=root, op=R.MIN, group=g.mpicoll)
    same(r, reference("MIN", [data(k, 4, dtype) for k in range(g.size)], g.size)
         if g.rank == root else data(g.rank, 4, dtype))
    outs = [torch.empty(3, dtype=dtype) for _ in range(g.size)] if g.rank == 0 else None
    dist.gather(data(g.rank, 3, dtype), outs, dst=0, group=g.mpicoll)
    if g.rank == 0:
        same(torch.cat(outs), torch.cat([data(k, 3, dtype) for k in range(g.size)]))
    out = torch.empty(2, dtype=dtype)
    dist.scatter(out, [data(k, 2, dtype, salt=7) for k in range(g.size)] if g.rank == 0 else None,
                 src=0, group=g.mpicoll)
    same(out, data(g.rank, 2, dtype, salt=7))
    # all_to_all_single with uneven splits: rank r sends (r + k) % 3 rows to rank k
    send = [(g.rank + k) % 3 for k in range(g.size)]
    recv = [(k + g.rank) % 3 for k in range(g.size)]
    x = data(g.rank, sum(send) * 2, dtype).reshape(-1, 2)
    y = torch.empty(sum(recv), 2, dtype=dtype)
    dist.all_to_all_single(y, x, recv, send, group=g.mpicoll)
    same(y, torch.cat([data(k, sum((k + j) % 3 for j in range(g.size)) * 2, dtype).reshape(-1, 2)
                       [sum((k + j) % 3 for j in range(g.rank)):][:recv[k]] for k in range(g.size)]))
    ref = torch.empty(sum(recv), 2, dtype=dtype)
    if gloo_or_none(lambda: dist.all_to_all_single(ref, x, recv, send, group=g.gloo)) is not None:
        same(y, ref)
    dist.barrier(group=g.mpicoll)


def test_objects(groups):
    g = groups
    objs = [None] * g.size
    dist.all_gather_object(objs, {"rank": g.rank, "name": "x" * g.rank}, group=g.mpicoll)
    assert objs == [{"rank": r, "name": "x" * r} for r in range(g.size)]
    lst = [g.rank * 10] if g.rank == 0 else [None]
    dist.broadcast_object_list(lst, src=0, group=g.mpicoll)
    assert lst == [0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_float_sums_within_the_rule(groups, dtype):
    """Random data: the SUM is within mpicoll.tools.results' bound of the exact sum."""
    g = groups
    gen = torch.Generator().manual_seed(1234 + g.rank)
    x = torch.randn(1000 + 3 * g.rank % 1, generator=gen, dtype=torch.float64).to(dtype)
    got = x.clone()
    dist.all_reduce(got, group=g.mpicoll)
    ref = results.reference_allreduce(MPI.COMM_WORLD, x.numpy(), MPI.SUM)
    cmp = results.compare(got.numpy(), ref, "SUM", g.size)
    assert cmp.ok, cmp


@pytest.mark.parametrize("path", ["ml_dtypes", "float32-stand-in"])
def test_bfloat16_sums_accumulate_in_float32(groups, monkeypatch, path):
    """bfloat16 SUM/AVG: float32 accumulation, one rounding, on both paths (tensors.bfloat16).

    Values k/16 with |k| <= 255 are exact in bfloat16 and their sums over 5
    ranks exact in float32, but not in bfloat16: rounding each partial sum
    (bfloat16 hops) would differ from the exact sum rounded once.
    """
    from mpicoll.torch import tensors

    g = groups
    if path == "ml_dtypes" and tensors.bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    if path != "ml_dtypes":
        monkeypatch.setattr(tensors, "_ML_BF16", [None])
    gen = torch.Generator().manual_seed(99 + g.rank)
    every = [torch.randint(-255, 256, (257,), generator=torch.Generator().manual_seed(99 + r))
             .to(torch.float64) / 16 for r in range(g.size)]
    x = torch.randint(-255, 256, (257,), generator=gen).to(torch.float64).div(16).to(torch.bfloat16)
    assert torch.equal(x.double(), every[g.rank])
    total = torch.stack(every).sum(0)
    assert tensors.Staged(x).direct == (path == "ml_dtypes")  # ml_dtypes: the tensor's own memory
    for op, want in ((R.SUM, total), (R.AVG, total / g.size)):
        got = x.clone()
        dist.all_reduce(got, op=op, group=g.mpicoll)
        if op == R.AVG and path == "ml_dtypes":
            want = total.to(torch.bfloat16).double() / g.size  # the sum rounded, then divided
        same(got, want.to(torch.bfloat16))
    out = torch.empty(1, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out, x[:g.size].clone(), group=g.mpicoll)
    same(out, total[g.rank:g.rank + 1].to(torch.bfloat16))


@pytest.mark.parametrize("path", ["ml_dtypes", "float32-stand-in"])
@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX"])
def test_strided_bfloat16_reduces_as_bfloat16(groups, monkeypatch, path, op):
    """A bfloat16 view that is not contiguous goes through a staging copy: reduced as bfloat16
    (its bits as ml_dtypes' bfloat16, or the float32 stand-in), not as the int16 it is moved
    as; the elements between the view's stay as they were."""
    from mpicoll.torch import tensors

    g = groups
    if path == "ml_dtypes" and tensors.bfloat16() is None:
        pytest.skip("ml_dtypes is not installed")
    if path != "ml_dtypes":
        monkeypatch.setattr(tensors, "_ML_BF16", [None])
    base = data(g.rank, 14, torch.bfloat16)
    got = base.clone()
    dist.all_reduce(got[::2], op=getattr(R, op), group=g.mpicoll)
    want = base.clone()
    want[::2] = reference(op, [data(r, 14, torch.bfloat16)[::2] for r in range(g.size)], g.size)
    same(got, want)
    out = torch.zeros(4, dtype=torch.bfloat16)
    dist.reduce_scatter_tensor(out[::2], data(g.rank, 2 * g.size, torch.bfloat16) * 2,
                               group=g.mpicoll)
    full = reference("SUM", [data(r, 2 * g.size, torch.bfloat16) * 2 for r in range(g.size)],
                     g.size)
    same(out[::2], full[2 * g.rank:2 * g.rank + 2])
    same(out[1::2], torch.zeros(2, dtype=torch.bfloat16))


def test_bad_input_raises_before_any_message(groups, raising_group):
    """The same mistake on every rank, on a group that raises: each rank raises, and the group
    goes on (nothing was sent)."""
    g = groups
    group = raising_group()
    with pytest.raises(TypeError, match="uint32"):
        dist.all_reduce(torch.zeros(2, dtype=torch.uint32), group=group)
    with pytest.raises(ValueError, match="elements"):
        dist.all_gather_into_tensor(torch.empty(g.size * 2 + 1), torch.ones(2), group=group)
    with pytest.raises(ValueError, match="BAND"):
        dist.all_reduce(torch.ones(2), op=R.BAND, group=group)
    with pytest.raises(TypeError, match="dtype"):
        dist.all_gather_into_tensor(torch.empty(g.size * 2), torch.ones(2, dtype=torch.int32),
                                    group=group)
    t = torch.ones(3)
    dist.all_reduce(t, group=group)  # nothing was left in flight
    assert torch.equal(t, torch.full((3,), float(g.size)))


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_reduce(groups, case):
    dtype, name = case
    g = groups
    root = g.size // 2
    x = data(g.rank, 3, dtype)
    got = x.clone()
    dist.reduce(got, dst=root, op=make_op(name), group=g.mpicoll)
    if g.rank == root:
        same(got, reference(name, [data(r, 3, dtype) for r in range(g.size)], g.size))
    else:
        same(got, x)  # only dst receives the result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32, torch.bool], ids=str)
def test_all_to_all_list_send_recv_uneven_all_gather(groups, dtype):
    g = groups
    ins = [data(g.rank, k + 1, dtype, salt=k) for k in range(g.size)]  # k + 1 elements to rank k
    outs = [torch.empty(g.rank + 1, dtype=dtype) for _ in range(g.size)]
    dist.all_to_all(outs, ins, group=g.mpicoll)
    for k, o in enumerate(outs):
        same(o, data(k, g.rank + 1, dtype, salt=g.rank))
    # a ring of send/recv: rank r sends to r + 1
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    got = torch.empty(4, dtype=dtype)
    reqs = [dist.isend(data(g.rank, 4, dtype), nxt, group=g.mpicoll),
            dist.irecv(got, prv, group=g.mpicoll)]
    for r in reqs:
        r.wait()
    same(got, data(prv, 4, dtype))
    # all_gather into outputs of different sizes (MPI's Allgatherv)
    outs = [torch.empty(r % 3, dtype=dtype) for r in range(g.size)]
    dist.all_gather(outs, data(g.rank, g.rank % 3, dtype), group=g.mpicoll)
    for r, o in enumerate(outs):
        same(o, data(r, r % 3, dtype))
