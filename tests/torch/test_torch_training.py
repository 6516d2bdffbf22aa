"""Training on the mpicoll backend equals single-process training: DDP (its variants and
compress hooks, PowerSGD), FSDP2 fully_shard, FSDP1 on CPU, ZeroRedundancyOptimizer, DTensor, and
torch.compile of a functional all_reduce.

Every rank trains on its own slice of one global batch (uneven slices: rank r
holds 2 + r samples); the loss is the sum over the slice divided by the global
batch size times the world size, so DDP's averaged gradient is exactly the
gradient of the global batch's mean loss, which the reference computes in one
process (on every rank, with no communication).  After 5 steps the parameters
must match the reference to float32 rounding.
"""

from __future__ import annotations

import time

import pytest

# torch.distributed first: without torch, "torch" alone would import this folder (tests/
# is on sys.path) as a namespace package
dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402
from torch import nn  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

STEPS = 5
TOL = {"rtol": 1e-5, "atol": 1e-6}


class WithUnused(nn.Sequential):
    """The model with one more layer that forward never uses (find_unused_parameters)."""

    def __init__(self, *layers):
        super().__init__(*layers)
        self.extra = nn.Linear(6, 3)

    def forward(self, x):
        return self[2](self[1](self[0](x)))


def model(unused=False):
    torch.manual_seed(0)
    layers = (nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return WithUnused(*layers) if unused else nn.Sequential(*layers)


def batches(size):
    """STEPS global batches of sum(2 + r) samples, and each rank's slice bounds."""
    gen = torch.Generator().manual_seed(42)
    counts = [2 + r for r in range(size)]
    total = sum(counts)
    out = [(torch.randn(total, 6, generator=gen), torch.randn(total, 3, generator=gen))
           for _ in range(STEPS)]
    starts = [sum(counts[:r]) for r in range(size)]
    return out, counts, starts, total


def train(net, opt, g, *, accumulate=None):
    """STEPS steps on this rank's slices; ``accumulate(net, x, y, scale)`` replaces the backward."""
    data, counts, starts, total = batches(g.size)
    for x, y in data:
        lo, n = starts[g.rank], counts[g.rank]
        x, y = x[lo:lo + n], y[lo:lo + n]
        scale = g.size / total
        opt.zero_grad()
        if accumulate is not None:
            accumulate(net, x, y, scale)
        else:
            (((net(x) - y) ** 2).sum() * scale).backward()
        opt.step()
    return net


def reference(unused=False):
    """The same steps in this process alone, on the whole global batch (no communication)."""
    net = model(unused)
    data, _, _, total = batches(dist.get_world_size())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        (((net(x) - y) ** 2).sum() / total).backward()
        opt.step()
    return net


def assert_equal_to_reference(params, unused=False):
    ref = dict(reference(unused).named_parameters())
    for name, p in params:
        name = name.replace("module.", "").replace("_fsdp_wrapped_module.", "")
        torch.testing.assert_close(p.detach(), ref[name].detach(), **TOL)


@pytest.mark.parametrize("variant", ["plain", "find_unused_tiny_buckets", "bucket_view",
                                     "static_graph", "no_sync"])
def test_ddp(groups, variant):
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = groups
    kwargs = {
        "plain": {},
        "find_unused_tiny_buckets": {"find_unused_parameters": True, "bucket_cap_mb": 0.0002},
        "bucket_view": {"gradient_as_bucket_view": True},
        "static_graph": {"static_graph": True},
        "no_sync": {},
    }[variant]
    unused = variant == "find_unused_tiny_buckets"
    net = DDP(model(unused), process_group=g.mpicoll, **kwargs)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    accumulate = None
    if variant == "no_sync":
        def accumulate(net, x, y, scale):  # two micro-batches, the first without a sync
            half = len(x) // 2
            with net.no_sync():
                (((net(x[:half]) - y[:half]) ** 2).sum() * scale).backward()
            (((net(x[half:]) - y[half:]) ** 2).sum() * scale).backward()
    train(net, opt, g, accumulate=accumulate)
    assert_equal_to_reference(net.named_parameters(), unused)


@pytest.mark.parametrize("hook", ["bf16_compress_hook", "fp16_compress_hook"])
def test_ddp_compress_hooks(groups, hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = groups
    net = DDP(model(), process_group=g.mpicoll)
    net.register_comm_hook(g.mpicoll, getattr(default_hooks, hook))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    train(net, opt, g)
    ref = dict(reference().named_parameters())
    for name, p in net.named_parameters():  # gradients rounded to 8 (11) bits on the way
        torch.testing.assert_close(p.detach(), ref[name.replace("module.", "")].detach(),
                                   rtol=2e-2, atol=2e-3)


def late_rank_0(net, x, y, scale):
    """The backward, rank 0 starting it late: the others' bucket all-reduce cannot complete
    when it starts, so its future completes later, with the hook's callbacks in it."""
    if dist.get_rank() == 0:
        time.sleep(0.2)
    (((net(x) - y) ** 2).sum() * scale).backward()


@pytest.mark.timeout(120)
def test_ddp_powersgd_hook(groups):
    """torch's PowerSGD hook (start_powerSGD_iter=2: two plain steps, then compressed ones,
    whose future callbacks start collectives and wait for them): the weights are identical on
    every rank and close to the same training on gloo (the sums differ in rounding only)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = groups
    trained = {}
    for name, group in (("mpicoll", g.mpicoll), ("gloo", g.gloo)):
        net = DDP(model(), process_group=group)
        # min_compression_rate 2: the biases go uncompressed, so the hook's first all-reduce
        # is not empty (one of no elements completes at once, and with it every callback
        # would run on this thread)
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1,
                                       start_powerSGD_iter=2, min_compression_rate=2)
        net.register_comm_hook(state, powersgd.powerSGD_hook)
        train(net, torch.optim.SGD(net.parameters(), lr=0.1), g, accumulate=late_rank_0)
        trained[name] = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    every = [torch.empty_like(trained["mpicoll"]) for _ in range(g.size)]
    dist.all_gather(every, trained["mpicoll"], group=g.gloo)
    assert all(torch.equal(w, every[0]) for w in every), "ranks trained to different weights"
    torch.testing.assert_close(trained["mpicoll"], trained["gloo"], rtol=1e-4, atol=1e-5)


def test_fsdp2_fully_shard(groups):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    g = groups
    mesh = init_device_mesh("cpu", (g.size,))
    net = model()
    for layer in (net[0], net[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    train(net, opt, g)
    ref = dict(reference().named_parameters())
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.full_tensor().detach(), ref[name].detach(), **TOL)


def test_fsdp1_on_cpu(groups):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    g = groups
    net = FSDP(model(), process_group=g.mpicoll, use_orig_params=True,
               device_id=torch.device("cpu"))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    train(net, opt, g)
    with FSDP.summon_full_params(net):
        assert_equal_to_reference(net.named_parameters())


def test_zero_redundancy_optimizer(groups):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = groups
    net = DDP(model(), process_group=g.mpicoll)
    opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.SGD,
                                  process_group=g.mpicoll, lr=0.1)
    train(net, opt, g)
    assert_equal_to_reference(net.named_parameters())


def test_dtensor(groups):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = groups
    mesh = init_device_mesh("cpu", (g.size,))
    torch.manual_seed(3)
    full = torch.randn(2 * g.size + 1, 4)  # uneven shards
    d = distribute_tensor(full, mesh, [Shard(0)])
    torch.testing.assert_close(d.full_tensor(), full, rtol=0, atol=0)
    torch.testing.assert_close(d.redistribute(mesh, [Replicate()]).to_local(), full, rtol=0, atol=0)
    s = (d * 2).sum()  # a partial sum reduced across the mesh
    torch.testing.assert_close(s.full_tensor(), (full * 2).sum(), **TOL)
    w = distribute_tensor(torch.randn(4, 3), mesh, [Replicate()])
    torch.testing.assert_close((d @ w).full_tensor(), full @ w.to_local(), **TOL)


def test_compiled_functional_all_reduce(groups):
    import torch.distributed._functional_collectives as funcol

    g = groups

    def f(x):
        return funcol.all_reduce(x * 2, "sum", g.mpicoll) + 1

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    x = torch.arange(5.0) + g.rank
    got = compiled(x)
    torch.testing.assert_close(got, sum((torch.arange(5.0) + r) * 2 for r in range(g.size)) + 1,
                               rtol=0, atol=0)
