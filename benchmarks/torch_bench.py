"""``python benchmarks/torch_bench.py``: the mpicoll backend against gloo, and against mpicoll itself.

    mpirun -n 2 python benchmarks/torch_bench.py                  # float32 SUM, 16 B .. 64 MiB, DDP
    mpirun -n 2 python benchmarks/torch_bench.py --sizes 4K,1M --ddp-steps 0
    mpirun -n 2 python benchmarks/torch_bench.py --timeout 0      # the group without a timeout
    mpirun -n 2 python benchmarks/torch_bench.py --device cuda --json out.json

For each size, the same float32 tensor is all-reduced (SUM, in place) three ways
in one run: ``dist.all_reduce`` on the mpicoll backend, ``dist.all_reduce`` on a
gloo group of the same ranks, and ``mpicoll.allreduce`` on the tensor's memory
with the group's timeout (the backend's own cost is the first against the third;
``--timeout`` sets the group's, torch's 30 minutes by default, 0: none).
``mpicoll.allreduce`` gets the very array the backend passes
(``tensors.memory_view``): two arrays over the same memory would be two remembered calls,
and calls alternating between them are not the function's last remembered call, the one
a repeat finds first (engine.cache). The backend and ``mpicoll.allreduce`` are timed in turn,
iteration by iteration (a burst of load falls on both), gloo in a loop of its
own, by :mod:`mpicoll.tools.harness`: each call after an MPI barrier; its time
is the slowest rank's, and the table shows the median over the iterations. The
"torch" column is torch's own share, the floor of any backend:
``dist.all_reduce`` on a group whose ``allreduce`` returns a finished work at
once (no message); "own" is the backend's time less that floor, against
``mpicoll.allreduce``. Then a DDP training step (forward, backward with the
gradient AllReduce, SGD step) of a 10.5 M-parameter MLP on each backend, median
over ``--ddp-steps`` steps. Rank 0 prints.

``--device cuda`` runs it all on CUDA tensors (each rank on the GPU of its node-local
rank, modulo the GPUs it sees): the backend hands them to mpicoll as device arrays,
gloo copies them through host memory, and every timed call ends with
``torch.cuda.synchronize()`` so a time includes the device work it queued.
``--json FILE`` writes one record per size (rank 0): the times in microseconds, the
backend's bus bandwidth and ``gloo_ratio``, the backend's time over gloo's, and
``selected``, the algorithm the backend's call ran (on one node, CUDA tensors take
the node path: ``shared_oneshot``, ``shared_twoshot``).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import mpicoll
import mpicoll.torch  # registers the backend "mpicoll" with torch.distributed
from mpicoll.tools.harness import cli as _cli
from mpicoll.tools.harness import records as _records
from mpicoll.tools.harness.timing import Variant, time_variants
from mpicoll.tools.harness.workload import BUSBW_FACTOR
from mpicoll.torch.devices import layer_of
from mpicoll.torch.tensors import memory_view
from mpicoll.torch.work import Finished


def _sizes(text):
    """argparse type: comma-separated sizes in bytes (16,4K,1M), multiples of 4 (float32)."""
    out = [_cli.size_arg(item) for item in text.split(",")]
    bad = [v for v in out if v % 4]
    if bad:
        raise argparse.ArgumentTypeError(f"expected multiples of 4 bytes (float32), got {bad[0]}")
    return out


def build_parser():
    p = _cli.Parser(prog="python benchmarks/torch_bench.py", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=_sizes, default=_sizes("16,4K,64K,1M,16M,64M"),
                   help="message sizes in bytes per rank (default 16,4K,64K,1M,16M,64M)")
    p.add_argument("-n", "--iters", type=_cli.positive_int, default=50,
                   help="timed iterations per size (fewer above 1 MiB: at least 8; default 50)")
    p.add_argument("-w", "--warmup", type=_cli.nonnegative_int, default=5,
                   help="untimed iterations first (default 5)")
    p.add_argument("--timeout", type=_cli.seconds_or_zero_arg, default=None,
                   help="the mpicoll group's timeout in seconds, also passed to "
                        "mpicoll.allreduce (0: none; default: torch's, 30 min)")
    p.add_argument("--ddp-steps", type=_cli.nonnegative_int, default=10,
                   help="timed DDP steps per backend (0: none; default 10)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the tensors live (default cpu)")
    p.add_output("--json", metavar="FILE", default=None,
                 help="write one JSON record per size to FILE (rank 0), rewritten as each "
                      "size ends")
    return p


def _synchronized(fn):
    """``fn`` then ``torch.cuda.synchronize()``: a call's time includes the device work it queued."""
    def call():
        fn()
        torch.cuda.synchronize()
    return call


def _time(fns, iters, warmup, comm):
    """The median time of each of ``fns``, interleaved (the harness: every iteration times
    each one in turn, each after a barrier, as the slowest rank saw it)."""
    t = time_variants(comm, {i: Variant(fn) for i, fn in enumerate(fns)},
                      warmup=warmup, samples=iters)
    return [t[i] for i in range(len(fns))]


class _Floor(dist.ProcessGroup):
    """A group whose ``allreduce`` does nothing: ``dist.all_reduce`` on it is torch's own cost."""

    def __init__(self, rank, size):
        super().__init__(rank, size)
        self._done = Finished(None)

    def allreduce(self, tensors, opts=None):
        return self._done

    def getBackendName(self) -> str:
        return "floor"


def _fmt(seconds):
    if seconds < 1e-3:
        return f"{seconds * 1e6:8.1f} us"
    return f"{seconds * 1e3:8.2f} ms"


def _ddp_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024), nn.ReLU(),
                         nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))


@_cli.tool("benchmarks/torch_bench.py")
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    comm = MPI.COMM_WORLD
    cuda = args.device == "cuda"
    if cuda:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/torch_bench.py: --device cuda: torch sees no CUDA device")
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        torch.cuda.set_device(local.Get_rank() % torch.cuda.device_count())
        local.Free()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = _synchronized if cuda else (lambda fn: fn)
    dist.init_process_group(backend="mpicoll")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    world = dist.group.WORLD
    if args.timeout is not None:
        world.set_timeout(timedelta(seconds=args.timeout))
    timeout = world.timeout  # what the backend passes to mpicoll (None: no timeout)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# mpicoll torch backend vs gloo: {size} ranks, float32 SUM in place on {device.type}, "
        f"median of the slowest rank's time; timeout {timeout}; torch {torch.__version__}, "
        f"{_records.mpi_library()}")
    say(f"# {'size':>8} {'gloo':>11} {'mpicoll bk':>11} {'mpicoll':>11} {'torch':>11} "
        f"{'bk/gloo':>8} {'bk/mpicoll':>10} {'own/mpicoll':>11}")
    floor = _Floor(rank, size)
    records = []
    for nbytes in args.sizes:
        iters = args.iters if nbytes <= (1 << 20) else max(8, args.iters // 5)
        t = torch.zeros(nbytes // 4, device=device)  # zeros: repeated in-place sums stay finite
        # the backend's array (see above)
        arr = layer_of(device).array(t) if cuda else memory_view(t)
        # (gloo apart: its threads stay on the cores after its calls and slow the next
        # call of any backend)
        g, = _time([sync(functools.partial(dist.all_reduce, t, group=gloo))],
                   iters, args.warmup, comm)
        b, m, f = _time([sync(functools.partial(dist.all_reduce, t, group=world)),
                         sync(functools.partial(mpicoll.allreduce, arr, comm=world.comm, out=arr,
                                                timeout=timeout)),
                         sync(functools.partial(dist.all_reduce, t, group=floor))],
                        iters, args.warmup, comm)
        with mpicoll.traffic() as seen:  # what the backend's call ran (the node path, ...)
            dist.all_reduce(t, group=world)
        # (ratios to 3 significant digits: a fast call against a slow gloo call is not 0.00)
        say(f"  {_cli.human(nbytes):>8} {_fmt(g)} {_fmt(b)} {_fmt(m)} {_fmt(f)} {b / g:8.3g} "
            f"{b / m:10.3g} {(b - f) / m:11.3g}")
        records.append({"collective": "allreduce", "nranks": size, "dtype": "float32",
                        "bytes": nbytes, "device": device.type,
                        "selected": seen.calls[-1].algorithm, "time_us": b * 1e6,
                        "busbw_gbps": BUSBW_FACTOR["allreduce"](size) * nbytes / b / 1e9,
                        "gloo_time_us": g * 1e6, "mpicoll_time_us": m * 1e6,
                        "torch_time_us": f * 1e6, "gloo_ratio": b / g})
        if args.json and rank == 0:  # (a run stopped by a time limit keeps its sizes)
            _records.keep_json(args.json, records)
    if args.json and rank == 0:
        with open(args.json, "w") as out:
            json.dump(records, out, indent=1)
    if args.ddp_steps > 0:
        from torch.nn.parallel import DistributedDataParallel as DDP

        nparams = sum(p.numel() for p in _ddp_model().parameters())
        x = torch.randn(8, 1024, device=device)
        steps = {}
        for name, group in (("gloo", gloo), ("mpicoll", world)):
            model = DDP(_ddp_model().to(device), process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)

            def step(model=model, opt=opt):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()

            steps[name] = sync(step)
        results = dict(zip(steps, _time(list(steps.values()), args.ddp_steps, 2, comm)))
        say(f"# DDP step, {nparams / 1e6:.1f} M parameters (float32, 25 MiB buckets), batch 8: "
            f"gloo {_fmt(results['gloo']).strip()}, mpicoll {_fmt(results['mpicoll']).strip()}, "
            f"ratio {results['mpicoll'] / results['gloo']:.2f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
