"""torch's own distributed tests (``DistributedTest``, shipped in the wheel) on mpicoll, under mpirun.

    mpirun -n 2 python tests/torch/torch_suite.py                 # the mpicoll backend
    mpirun -n 2 python tests/torch/torch_suite.py --backend gloo  # the same tests on gloo
    mpirun -n 3 python tests/torch/torch_suite.py -k monitored_barrier
    mpirun -n 2 python tests/torch/torch_suite.py --as mpicoll        # under its own name

torch runs ``DistributedTest._DistTestBase`` in processes it spawns itself;
here each MPI rank is one of its processes: rank 0 makes the temporary
folders and each test's ``file://`` rendezvous file and sends their names
to the others; each rank then does what torch's ``TestDistBackend._run``
does (init_process_group, torch's file barrier, the test, the barrier,
destroy_process_group).  ``--backend mpicoll`` runs the tests with the
mpicoll backend swapped in for gloo (``dist.Backend.GLOO``'s creator is
mpicoll's), so gloo's own tests (``test_monitored_barrier_gloo``,
``test_batch_isend_irecv_gloo``, ...) run on mpicoll; torch then also looks
for gloo's C++ profiling events, which a Python backend does not record
(the ``*_profiler`` variants).  ``--as mpicoll`` runs them under the
backend's own name instead (torch skips its gloo-only tests).  ``-k`` selects tests by regular expression (default: the tests of
any-source receive, batch_isend_irecv and monitored_barrier).  Rank 0
prints one line per test and the counts; exit status 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import traceback
import unittest

from mpi4py import MPI

DEFAULT = r"send_recv_any_source|batch_isend_irecv|monitored_barrier"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["mpicoll", "gloo"], default="mpicoll")
    p.add_argument("-k", default=DEFAULT, help=f"regular expression of test names ({DEFAULT})")
    p.add_argument("--as", dest="name", choices=["gloo", "mpicoll"], default="gloo",
                   help="the backend name the tests see (default gloo: mpicoll swapped in)")
    p.add_argument("--timeout", type=float, default=60.0, help="each test's group timeout (s)")
    args = p.parse_args(argv)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    temp = tempfile.mkdtemp(prefix="torch-suite-") if rank == 0 else None
    temp = world.bcast(temp, root=0)
    if rank == 0:
        for sub in ("barrier", "test_dir", "init_dir"):
            os.mkdir(os.path.join(temp, sub))
    world.Barrier()
    if args.name == "mpicoll" and args.backend != "mpicoll":
        p.error("--as mpicoll runs the mpicoll backend")
    os.environ.update(BACKEND=args.name, WORLD_SIZE=str(size), TEMP_DIR=temp,
                      INIT_METHOD="file://" + os.path.join(temp, "init_dir", "shared_init_file"))

    from datetime import timedelta

    import torch.distributed as dist
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed import distributed_test as dt

    if args.backend == "mpicoll":
        import mpicoll.torch
        from mpicoll.torch.group import create

        if args.name == "gloo":
            dist.Backend._plugins["GLOO"] = dist.Backend._BackendPlugin(create, True)
        mpicoll.torch.register()
    skips = {s.exit_code: s.message for s in common_distributed.TEST_SKIPS.values()}

    from torch.testing._internal.common_utils import TestCase  # (its assertEqual: tensors)

    class Case(dt.DistributedTest._DistTestBase, TestCase):
        world_size = property(lambda self: str(size))

    names = sorted(n for n in dir(Case) if n.startswith("test_") and re.search(args.k, n))
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for i, name in enumerate(names):
        store = os.path.join(temp, f"store-{i}")
        world.Barrier()
        if rank == 0:  # (torch runs each test in new processes: a new file barrier)
            dt.Barrier.init()
        dt.Barrier.barrier_id = 0
        world.Barrier()
        case = Case(name)
        case.rank, case.file_name = rank, store
        case.setUp()  # (torch's TestCase: the random seed, ...)
        start = time.perf_counter()
        outcome, why = "passed", ""
        try:
            method = getattr(Case, name)
            if getattr(method, "__unittest_skip__", False):  # (unittest's skip decorators)
                raise unittest.SkipTest(getattr(method, "__unittest_skip_why__", ""))
            dist.init_process_group(init_method="file://" + store, backend=args.name, rank=rank,
                                    world_size=size, timeout=timedelta(seconds=args.timeout))
            case._barrier()
            getattr(case, name)()
            case._barrier()
        except unittest.SkipTest as exc:
            outcome, why = "skipped", str(exc)
        except SystemExit as exc:  # torch's skip decorators exit the test's process
            code = exc.code if isinstance(exc.code, int) else 1
            outcome, why = ("skipped", skips[code]) if code in skips else ("failed", f"exit {code}")
        except BaseException as exc:
            outcome, why = "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            if os.environ.get("TORCH_SUITE_TRACEBACK"):
                traceback.print_exc()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        # a test passes only if it passed on every rank
        outcomes = world.allgather(outcome)
        final = "failed" if "failed" in outcomes else outcome if len(set(outcomes)) == 1 \
            else "passed" if set(outcomes) <= {"passed", "skipped"} else "failed"
        whys = world.gather(why, root=0)
        counts[final] += 1
        if rank == 0:
            detail = "; ".join(f"rank {r}: {w}" for r, w in enumerate(whys) if w)
            print(f"{final.upper():7} {name} ({time.perf_counter() - start:.1f} s)"
                  + (f"  {detail}" if detail else ""), flush=True)
    if rank == 0:
        print(f"{args.backend} (as {args.name}), {size} ranks: {counts['passed']} passed, "
              f"{counts['failed']} failed, {counts['skipped']} skipped", flush=True)
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
