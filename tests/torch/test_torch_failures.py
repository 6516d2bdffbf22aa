"""A collective that fails on one rank ends the whole job at once (the default, ``abort``).

Each case starts a job of its own (``mpirun`` of the MPI this Python runs on, as
many ranks as the torch group's run, 2 or 3: CI runs the group at 3 with Open MPI
and at 2 with MPICH, so both counts and both MPIs are covered, one nested job per case) whose ranks train nothing: they make the default group with
``init_process_group(backend="mpicoll", timeout=...)``, run one healthy
all_reduce, print a READY stamp, then:

bad_input      rank 1 passes a uint32 tensor (TypeError there, before any message,
               raised to the script, which does not catch it); the others are in
               the all_reduce; the group's timeout is long
timeout        rank 1 sleeps instead of the all_reduce the others are in; the
               others' wait() times out after the group's short timeout
timeout_async  the same, but the others start the all_reduce with
               ``async_op=True`` and then sleep too, never waiting: mpicoll's
               completion thread meets the timeout

Every rank must be gone within a margin of the READY stamp (bad_input) or of
the group's timeout (the timeouts), far sooner than the sleepers would wake
or the long timeout would pass, and stderr must name the failing rank and
the error (for the timeouts: torch's ``timeout=``, as mpicoll's).

Under the launcher of the torch group only rank 0 starts the job (its
launcher's variables removed, so the nested launcher makes a job of its
own); every rank passes or fails with it.
"""

from __future__ import annotations

import os
import re
import time

import pytest

dist = pytest.importorskip("torch.distributed")
from mpi4py import MPI  # noqa: E402
from support import util  # noqa: E402

SHORT = 3.0     # the group's timeout in the timeout cases (seconds)
LONG = 120.0    # the group's timeout in bad_input: nothing may wait for it
SLEEP = 600     # what the sleepers do instead of the collective
MARGIN = 20.0   # job teardown on a loaded machine
LIMIT = 150     # kill the job (a test failure) after this many seconds

SCRIPT = r'''
import sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import mpicoll.torch  # noqa: F401

case, seconds = sys.argv[1], float(sys.argv[2])
dist.init_process_group(backend="mpicoll", timeout=timedelta(seconds=seconds))
rank = dist.get_rank()
t = torch.arange(1000.0) + rank
dist.all_reduce(t)                                   # everybody, healthy
dist.barrier()
print(f"READY {time.time():.6f}", flush=True)
if case == "bad_input" and rank == 1:
    dist.all_reduce(torch.ones(4, dtype=torch.uint32))
elif rank == 1:
    time.sleep({sleep})                              # never joins the all_reduce
elif case == "timeout_async":
    work = dist.all_reduce(t, async_op=True)
    time.sleep({sleep})                              # never waits for it
else:
    dist.all_reduce(t)
print("NOT REACHED", flush=True)
'''

# prefixes of the variables a launcher gives its processes: without them the nested
# launcher makes a job of its own instead of joining (or refusing) the outer one
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PRTE_", "PMI_", "HYDRA_", "MPI_LOCALNRANKS",
                      "MPI_LOCALRANKID")


def _run(tmp_path, case, n):
    script = tmp_path / f"fail_{case}.py"
    script.write_text(SCRIPT.replace("{sleep}", str(SLEEP)))
    seconds = LONG if case == "bad_input" else SHORT
    cmd, env = util.mpirun_cmd(n, [script, case, seconds])
    for name in list(env):
        if name.startswith(_LAUNCHER_PREFIXES) and not name.startswith("OMPI_ALLOW_RUN_AS_ROOT"):
            del env[name]
    env.pop("MPICOLL_TORCH_ON_ERROR", None)  # the default
    env.pop("MPICOLL_TIMEOUT", None)
    env["PYTHONPATH"] = os.pathsep.join([str(util.ROOT), env.get("PYTHONPATH", "")])
    res = util.run_job(cmd, env, LIMIT)
    return res, time.time(), seconds


def _problems(res, ended, case, n, seconds) -> str:
    out, err = res.stdout, res.stderr
    report = f"exit {res.returncode}\n--- stdout\n{out}\n--- stderr\n{err}"
    ready = [float(s) for s in re.findall(r"READY (\d+\.\d{6})", out)]
    if len(ready) != n:
        return f"{len(ready)} READY stamps, expected {n}\n{report}"
    if res.returncode == 0 or "NOT REACHED" in out:
        return f"the job did not fail\n{report}"
    if case == "bad_input":  # refused (raised), uncaught: the exit hook ends the job
        wanted = [r"mpicoll: rank 1: torch backend: allreduce was refused on rank 1 of the group "
                  rf"of {n} \(TypeError: .*uint32.*uncaught", r"MPICOLL_TORCH_ON_ERROR=raise"]
        latest = max(ready)
    else:  # a waiting rank (not 1) reports its timeout: torch's timeout= is mpicoll's
        wanted = [r"mpicoll: rank [02]: torch backend: allreduce failed on rank [02] of the group "
                  rf"of {n} \(CollectiveTimeout: ", rf"\(timeout {seconds:g} s\)"]
        latest = max(ready) + seconds
    missing = [w for w in wanted if not re.search(w, err)]
    if missing:
        return f"stderr lacks {missing}\n{report}"
    if ended - latest > MARGIN:
        return f"the job ended {ended - latest:.1f} s after it should have\n{report}"
    return ""


@pytest.mark.timeout(LIMIT + 60)
@pytest.mark.parametrize("case", ["bad_input", "timeout", "timeout_async"])
def test_a_failure_on_one_rank_ends_every_rank(tmp_path, case):
    world = MPI.COMM_WORLD
    n = min(max(world.Get_size(), 2), 3)
    problem = ""
    if world.Get_rank() == 0:
        res, ended, seconds = _run(tmp_path, case, n)
        problem = _problems(res, ended, case, n, seconds)
    # the other ranks wait without spinning (the nested job needs the cores)
    req = world.Ibarrier()
    while not req.Test():
        time.sleep(0.05)
    problem = world.bcast(problem, root=0)
    assert not problem, problem
