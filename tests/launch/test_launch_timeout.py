"""A rank that never joins a collective: with a timeout the whole job ends, with a message.

Starts its own ``mpirun`` (plain pytest only; conftest.py leaves this file out
under a launcher).  Rank 1 sleeps instead of calling an AllReduce the others
call.  With ``MPICOLL_TIMEOUT`` (or ``timeout=``) the waiting ranks raise
CollectiveTimeout after the timeout; under ``python -m mpi4py`` the uncaught
exception aborts the job, and ``mpicoll.abort`` does the same from a handler.
The job must end within the timeout plus a margin (far sooner than the
sleeping rank would wake) and print the error on stderr.
"""

from __future__ import annotations

import re
import time

import pytest
from support import util

TIMEOUT = 2.0      # MPICOLL_TIMEOUT for the job
MARGIN = 15.0      # job teardown on a loaded machine; the skipper sleeps far longer
SLEEP = 300        # what rank 1 does instead of the collective
LIMIT = 120        # kill the job (test failure) after this many seconds

SCRIPT = r'''
import sys, time
import numpy as np
import mpicoll
from mpi4py import MPI

mode = sys.argv[1]
comm = MPI.COMM_WORLD
x = np.arange(50000, dtype=np.float64) + comm.rank
mpicoll.allreduce(x)                       # call #1: everybody
comm.Barrier()
print(f"READY {time.time():.6f}", flush=True)
if comm.rank == 1:
    time.sleep({sleep})                    # "stuck elsewhere": never calls #2
elif mode == "uncaught":
    mpicoll.allreduce(x)                   # MPICOLL_TIMEOUT from the environment
else:
    try:
        mpicoll.allreduce(x, timeout={timeout})
    except mpicoll.CollectiveTimeout as exc:
        mpicoll.abort(message=str(exc))
print("NOT REACHED", flush=True)
'''


def _run(tmp_path, mode):
    script = tmp_path / "skip_one.py"
    script.write_text(SCRIPT.replace("{sleep}", str(SLEEP)).replace("{timeout}", str(TIMEOUT)))
    args = (["-m", "mpi4py"] if mode == "uncaught" else []) + [script, mode]
    cmd, env = util.mpirun_cmd(3, args)
    if mode == "uncaught":
        env["MPICOLL_TIMEOUT"] = str(TIMEOUT)
    else:
        env.pop("MPICOLL_TIMEOUT", None)
    res = util.run_job(cmd, env, LIMIT)
    ended = time.time()
    return res.returncode, res.stdout, res.stderr, ended


@pytest.mark.timeout(LIMIT + 30)
@pytest.mark.parametrize("mode", ["uncaught", "abort"])
def test_missing_rank_ends_job_within_timeout(tmp_path, mode):
    rc, out, err, ended = _run(tmp_path, mode)
    report = f"exit {rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    # (a launcher may glue the ranks' lines together: find the stamps anywhere)
    ready = [float(t) for t in re.findall(r"READY (\d+\.\d{6})", out)]
    assert len(ready) == 3, report
    assert rc != 0, report
    assert "NOT REACHED" not in out, report
    # the error names the call, the timeout and a peer
    assert "allreduce #2 (" in err and "no progress for " in err, report
    assert f"(timeout {TIMEOUT:g} s)" in err, report
    assert re.search(r"waiting (to receive \d+ bytes from|for) rank \d", err), report
    if mode == "uncaught":
        assert "CollectiveTimeout" in err, report
    else:
        assert "mpicoll: rank " in err, report
    # the waiting ranks' deadline runs from when they start waiting, which the skipping
    # rank's own stamp may follow by milliseconds (CI: ended 1.9993 s after the latest stamp)
    earliest, latest = ended - min(ready), ended - max(ready)
    assert earliest >= TIMEOUT and latest <= TIMEOUT + MARGIN, \
        f"job ended {earliest:.4f}-{latest:.4f} s after the stamps\n{report}"


# -- a rank missing from the FIRST call on a communicator (mpicoll's set-up) -------------------
# The first collective on a communicator creates mpicoll's state for it (Idup, the ring
# order exchange).  Rank 1 either never calls ("never") or calls its first collective on a
# different fresh communicator ("other"); the READY stamp is printed before the first call.
FIRST_SCRIPT = r'''
import sys, time
import numpy as np
import mpicoll
from mpi4py import MPI

mode = sys.argv[1]
world = MPI.COMM_WORLD
other = world.Dup()                        # fresh: no mpicoll call on it yet
x = np.arange(50000, dtype=np.float64) + world.rank
world.Barrier()
print(f"READY {time.time():.6f}", flush=True)
if world.rank == 1 and mode == "never":
    time.sleep({sleep})                    # never reaches its first collective
elif world.rank == 1:
    mpicoll.allreduce(x, comm=other)       # first call on another fresh communicator
else:
    mpicoll.allreduce(x)                   # first mpicoll call on COMM_WORLD
print("NOT REACHED", flush=True)
'''


@pytest.mark.timeout(LIMIT + 30)
@pytest.mark.parametrize("mode", ["never", "other"])
def test_missing_rank_at_first_call_ends_job_within_timeout(tmp_path, mode):
    script = tmp_path / "first_call.py"
    script.write_text(FIRST_SCRIPT.replace("{sleep}", str(SLEEP)))
    cmd, env = util.mpirun_cmd(3, ["-m", "mpi4py", script, mode])
    env["MPICOLL_TIMEOUT"] = str(TIMEOUT)
    res = util.run_job(cmd, env, LIMIT)
    waited = time.time() - max([float(t) for t in re.findall(r"READY (\d+\.\d{6})", res.stdout)]
                               or [0.0])
    report = f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
    assert len(re.findall(r"READY \d", res.stdout)) == 3, report
    assert res.returncode != 0 and "NOT REACHED" not in res.stdout, report
    err = res.stderr
    assert "CollectiveTimeout" in err and "allreduce #1 (" in err, report
    assert "while setting up mpicoll on this communicator" in err, report
    assert f"(timeout {TIMEOUT:g} s)" in err, report
    assert TIMEOUT <= waited <= TIMEOUT + MARGIN, f"job ended {waited:.1f} s after READY\n{report}"
