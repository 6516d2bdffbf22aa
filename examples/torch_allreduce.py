"""torch.distributed's all_reduce on the mpicoll backend: the tutorial's snippet, backend changed.

    mpirun -n 4 python examples/torch_allreduce.py               # every rank: 10.0, then OK
    mpirun -n 4 python examples/torch_allreduce.py --device gpu

The snippet of the collectives tutorial, with ``backend="mpicoll"`` instead
of ``"nccl"`` and nothing else set (rank and world size come from MPI)::

    tensor = torch.tensor([rank + 1.0])
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)   # 4 ranks: 10.0 on every rank

With n ranks every rank holds 1 + 2 + ... + n = n(n+1)/2.  A second part
reduces a larger rank-dependent tensor with every op torch has and checks it
against the exact result computed from every rank's input.
"""

import _common as ex
import torch
import torch.distributed as dist

import mpicoll.torch  # noqa: F401 -- registers the "mpicoll" backend
from mpicoll.torch.devices import describe


def main():
    args = ex.parser(__doc__.splitlines()[0]).parse_args()
    device = ex.torch_device(args.device)
    dist.init_process_group(backend="mpicoll")
    ex.print0(describe(device))  # how the backend moves these tensors
    rank, size = dist.get_rank(), dist.get_world_size()

    # the tutorial's snippet
    tensor = torch.tensor([rank + 1.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    ex.print0(f"{size} rank(s) on {device.type}; rank r contributes r + 1, every rank receives the sum:")
    ex.print_ordered(f"rank {rank}: {tensor.item()}")
    expected = size * (size + 1) / 2
    ok = ex.check(tensor.item() == expected, f"all_reduce gave {tensor.item()}, expected {expected}")

    # every op on rank-dependent integers (exact in float32): against the exact result
    def contribution(r):
        return (torch.arange(1001, dtype=torch.int64) * (r + 3)) % 7 - 2

    inputs = torch.stack([contribution(r) for r in range(size)])
    want = {"SUM": inputs.sum(0), "PRODUCT": inputs.prod(0), "MIN": inputs.min(0).values,
            "MAX": inputs.max(0).values, "AVG": inputs.sum(0).double() / size}
    for name, ref in want.items():
        t = contribution(rank).to(torch.float64).to(device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        ok &= ex.report(ex.mismatch(t.cpu().numpy(), ref.to(torch.float64).numpy(),
                                    name=f"all_reduce {name}", reference="the exact result"))
    dist.destroy_process_group()
    ex.finish(ok, f"torch all_reduce on the mpicoll backend, {size} rank(s), {device.type}")


if __name__ == "__main__":
    main()
