"""torch.distributed's reduce_scatter on the mpicoll backend: the tutorial's snippet, as intended.

    mpirun -n 4 python examples/torch_reduce_scatter.py          # every rank: [10.0, 10.0]
    mpirun -n 3 python examples/torch_reduce_scatter.py --device gpu

Every rank contributes ``2 * n`` copies of ``r + 1`` (n ranks), cut into n
chunks of 2; rank k receives chunk k summed over all ranks: ``[n(n+1)/2] * 2``.
The tutorial's snippet cuts a 4-element input into 2 chunks, which is a
valid ReduceScatter only on 2 ranks (there must be one chunk per rank); the
intended computation, 2 elements per rank, is run here at any rank count, in
the list form (``reduce_scatter``) and the flat one (``reduce_scatter_tensor``).
"""

import warnings

import _common as ex
import torch
import torch.distributed as dist

import mpicoll.torch  # noqa: F401 -- registers the "mpicoll" backend
from mpicoll.torch.devices import describe

# the tutorial's names (all_gather_into_tensor, reduce_scatter_tensor), which torch 2.14 deprecates
warnings.filterwarnings("ignore", r"`torch\.distributed\..*` is deprecated", FutureWarning)


def main():
    args = ex.parser(__doc__.splitlines()[0]).parse_args()
    device = ex.torch_device(args.device)
    dist.init_process_group(backend="mpicoll")
    ex.print0(describe(device))  # how the backend moves these tensors
    rank, size = dist.get_rank(), dist.get_world_size()
    total = size * (size + 1) / 2
    expected = torch.full((2,), total)

    full = torch.full((2 * size,), rank + 1.0, device=device)
    output = torch.empty(2, device=device)
    dist.reduce_scatter(output, list(full.chunk(size)), op=dist.ReduceOp.SUM)
    ex.print0(f"{size} rank(s) on {device.type}; rank r contributes [r + 1] * {2 * size}; "
              f"reduce_scatter gives:")
    ex.print_ordered(f"  rank {rank}: {output.tolist()}")
    ok = ex.check(torch.equal(output.cpu(), expected), f"reduce_scatter gave {output.tolist()}")

    flat_out = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(flat_out, full)
    ok &= ex.check(torch.equal(flat_out.cpu(), expected),
                   f"reduce_scatter_tensor gave {flat_out.tolist()}")
    dist.destroy_process_group()
    ex.finish(ok, f"torch reduce_scatter on the mpicoll backend, {size} rank(s), {device.type}")


if __name__ == "__main__":
    main()
