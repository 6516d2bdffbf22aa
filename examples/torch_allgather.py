"""torch.distributed's all_gather on the mpicoll backend: the tutorial's snippet, as intended.

    mpirun -n 4 python examples/torch_allgather.py               # every rank: [0, 1, ..., 7]
    mpirun -n 3 python examples/torch_allgather.py --device gpu

Rank r contributes ``[2r, 2r + 1]``; every rank gets every rank's pair, in
rank order.  The tutorial's snippet gathers its int64 tensor
(``torch.arange(2) + 2 * rank``) into ``torch.zeros(2)`` outputs, which are
float32: torch's backends (this one, gloo, NCCL) refuse the dtype mismatch,
so the outputs here are int64 like the input.  The second form,
``all_gather_into_tensor``, gathers into one flat tensor, and a third gathers
in place into a tensor that already holds this rank's block (FSDP's form).
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
    expected = torch.arange(2 * size)  # [0, 1, 2, 3, ...]: rank r's pair at 2r, 2r + 1

    tensor = torch.tensor([2 * rank, 2 * rank + 1], device=device)                  # int64
    gathered = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(size)]  # not float32
    dist.all_gather(gathered, tensor)
    got = torch.cat(gathered).cpu()
    ex.print0(f"{size} rank(s) on {device.type}; rank r contributes [2r, 2r+1]; all_gather gives:")
    ex.print_ordered(f"  rank {rank}: {got.tolist()}")
    ok = ex.check(torch.equal(got, expected), f"all_gather gave {got.tolist()}")

    flat = torch.empty(2 * size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(flat, tensor)
    ok &= ex.check(torch.equal(flat.cpu(), expected), f"all_gather_into_tensor gave {flat.tolist()}")

    own = torch.full((2 * size,), -1, dtype=torch.int64, device=device)
    own[2 * rank:2 * rank + 2] = tensor
    dist.all_gather_into_tensor(own, own[2 * rank:2 * rank + 2])  # in place: FSDP's form
    ok &= ex.check(torch.equal(own.cpu(), expected), f"in-place all_gather gave {own.tolist()}")
    dist.destroy_process_group()
    ex.finish(ok, f"torch all_gather on the mpicoll backend, {size} rank(s), {device.type}")


if __name__ == "__main__":
    main()
