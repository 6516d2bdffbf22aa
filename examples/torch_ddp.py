"""DistributedDataParallel on the mpicoll backend equals single-process training.

    mpirun -n 3 python examples/torch_ddp.py                 # OK: ... equal to one process
    mpirun -n 2 python examples/torch_ddp.py --device gpu --steps 50

A 2-layer MLP is trained with DDP (``backend="mpicoll"``, nothing else set)
on uneven shards of each global batch: rank r holds 3 + 2r samples of it.
DDP averages the gradients over the ranks, so each rank's loss is its sum of
squared errors scaled by ``world_size / global batch``: the average is then
exactly the gradient of the global batch's mean loss.  Every rank also trains
the same model alone on the whole batch (no communication); after the last
step the two models must agree to float32 rounding, and all ranks' DDP models
must be bitwise identical.
"""

import _common as ex
import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mpicoll.torch  # noqa: F401 -- registers the "mpicoll" backend
from mpicoll.torch.devices import describe


def make_model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1)).to(device)


def main():
    p = ex.parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=ex.count, default=20, help="training steps (default 20)")
    args = p.parse_args()
    device = ex.torch_device(args.device)
    dist.init_process_group(backend="mpicoll")
    ex.print0(describe(device))  # how the backend moves these tensors
    rank, size = dist.get_rank(), dist.get_world_size()

    counts = [3 + 2 * r for r in range(size)]  # uneven shards
    total, start = sum(counts), sum(counts[:rank])
    gen = torch.Generator().manual_seed(7)
    true_w = torch.randn(10, 1, generator=gen)

    ddp = DDP(make_model(device))
    alone = make_model(device)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.05)
    opt_alone = torch.optim.SGD(alone.parameters(), lr=0.05)
    for _ in range(args.steps):
        x = torch.randn(total, 10, generator=gen)
        y = x @ true_w + 0.1 * torch.randn(total, 1, generator=gen)
        x, y = x.to(device), y.to(device)
        xs, ys = x[start:start + counts[rank]], y[start:start + counts[rank]]
        opt_ddp.zero_grad()
        (((ddp(xs) - ys) ** 2).sum() * (size / total)).backward()   # DDP averages over ranks
        opt_ddp.step()
        opt_alone.zero_grad()
        (((alone(x) - y) ** 2).sum() / total).backward()
        opt_alone.step()

    ok = True
    for (name, a), b in zip(ddp.module.named_parameters(), alone.parameters()):
        a, b = a.detach().cpu().double().numpy(), b.detach().cpu().double().numpy()
        tol = 1e-5 * np.abs(b) + 1e-6  # float32: the two sum the batch in a different order
        ok &= ex.report(ex.mismatch(a, b, tol, name=name, reference="single-process training"))
    flat = torch.cat([p.detach().cpu().reshape(-1) for p in ddp.parameters()]).numpy()
    same = ex.same_on_all_ranks(flat)
    ex.print0(f"{size} rank(s) on {device.type}, shards of {counts} samples, {args.steps} steps; "
              f"DDP weights bitwise identical on all ranks: {same}")
    ok &= same
    dist.destroy_process_group()
    ex.finish(ok, f"DDP on the mpicoll backend equal to one process, {size} rank(s), {device.type}")


if __name__ == "__main__":
    main()
