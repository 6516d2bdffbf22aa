"""Node memory (the shared-memory algorithms' host buffers) in whole jobs that end badly.

Starts its own ``mpirun`` (plain pytest only), 2 ranks on this machine.

aborted     rank 0 is inside ``allreduce(x, algorithm="shared_oneshot")``, its node
            memory made, when rank 1 calls ``MPI_Abort``: the launcher kills rank 0
            mid set-up.  Node memory has no name anywhere: none appears under
            ``/dev/shm`` while the job runs, none is left after it.
small shm   ``/dev/shm`` a 3 MiB tmpfs (a private mount namespace, root only): a
            2 MiB AllReduce on node memory runs and is right on every rank (node
            memory is not under ``/dev/shm``; what it needs is reserved when it is
            set up, so memory that runs short is an error there, never SIGBUS).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess

import pytest
from support import util

LIMIT = 120  # seconds: a hang fails the test here

ABORT_SCRIPT = r'''
import glob, json, os, sys, time
import numpy as np
import mpicoll
from mpi4py import MPI

comm = MPI.COMM_WORLD
pids = comm.allgather(os.getpid())
pid0 = pids[0]
if comm.rank == 0:
    print("PIDS", json.dumps(pids), flush=True)
mpicoll.allreduce(np.ones(4), algorithm="ring")  # everybody: the communicator is set up


def node_memory(pid):
    """rank 0's node memory as another process sees it: names under /dev/shm, and its
    descriptors of node memory (/proc/<pid>/fd)."""
    named = glob.glob(f"/dev/shm/mpicoll-{pid}-*")
    fds = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "mpicoll" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                fds.append(fd)
        except OSError:
            pass
    return named, fds


if comm.rank == 0:
    mpicoll.allreduce(np.ones(1000), algorithm="shared_oneshot")  # rank 1 never joins
    print("NOT REACHED", flush=True)
else:
    deadline = time.time() + 60
    named, fds = node_memory(pid0)
    while not (named or fds) and time.time() < deadline:  # until rank 0 made its memory
        time.sleep(0.01)
        named, fds = node_memory(pid0)
    print("SEEN", json.dumps({"named": named, "fds": fds}), flush=True)
    comm.Abort(3)
'''


@pytest.mark.timeout(LIMIT + 30)
def test_an_aborted_job_leaves_no_name(tmp_path):
    script = tmp_path / "abort.py"
    script.write_text(ABORT_SCRIPT)
    cmd, env = util.mpirun_cmd(2, [script])
    for var in ("MPICOLL_TIMEOUT", "MPICOLL_INTRANODE", "MPICOLL_FAKE_NODES"):
        env.pop(var, None)
    res = util.run_job(cmd, env, LIMIT)
    report = f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
    lines = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in res.stdout.splitlines()
             if line.startswith(("PIDS ", "SEEN "))}
    assert res.returncode != 0 and "NOT REACHED" not in res.stdout, report
    assert "PIDS" in lines and "SEEN" in lines, report
    seen = json.loads(lines["SEEN"])
    assert seen["named"] or seen["fds"], "rank 0 made no node memory in time\n" + report
    assert not seen["named"], "node memory had a name while the job ran\n" + report
    left = [p for pid in json.loads(lines["PIDS"]) for p in glob.glob(f"/dev/shm/mpicoll-{pid}-*")]
    assert not left, f"left behind: {left}\n{report}"


SMALL_SCRIPT = r'''
import json
import numpy as np
import mpicoll
from mpi4py import MPI

comm = MPI.COMM_WORLD
mpicoll.configure(intranode="shared")
x = np.arange(1 << 18, dtype=np.float64) * (comm.rank + 1)  # 2 MiB
with mpicoll.traffic() as t:
    y = mpicoll.allreduce(x)
want = np.empty_like(x)
comm.Allreduce(x, want)
rows = comm.gather([comm.rank, t.calls[0].algorithm, bool(np.array_equal(y, want))])
if comm.rank == 0:
    print("ROWS", json.dumps(rows), flush=True)
'''


def _private_mounts() -> bool:
    """Whether this process may make a mount namespace of its own and mount a tmpfs there."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                            "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.timeout(LIMIT + 30)
def test_a_small_dev_shm(tmp_path):
    if not _private_mounts():
        pytest.skip("needs root and unshare -m (a private /dev/shm)")
    script = tmp_path / "small.py"
    script.write_text(SMALL_SCRIPT)
    cmd, env = util.mpirun_cmd(2, [script])
    for var in ("MPICOLL_TIMEOUT", "MPICOLL_INTRANODE", "MPICOLL_FAKE_NODES"):
        env.pop(var, None)
    cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
           'mount -t tmpfs -o size=3m tmpfs /dev/shm && exec "$@"', "sh", *cmd]
    res = util.run_job(cmd, env, LIMIT)
    report = f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
    rows = [json.loads(line[5:]) for line in res.stdout.splitlines() if line.startswith("ROWS ")]
    assert res.returncode == 0, report
    assert rows == [[[0, "shared_twoshot", True], [1, "shared_twoshot", True]]], report
