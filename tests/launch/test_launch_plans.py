"""Remembered calls and persistent collectives free their persistent requests at exit, before
MPI is finalized.

A remembered call (engine.cache) and a persistent collective are operations whose program
holds persistent point-to-point requests (engine.executor.hold); MPI must see them freed before
``MPI_Finalize`` (MPICH warns of each one left).  The job below keeps remembered calls
on COMM_WORLD and on a duplicate it never frees, and a persistent collective
it never frees, and checks
from an ``atexit`` handler registered before mpicoll was imported -- so it
runs after mpicoll's own, and before mpi4py finalizes MPI -- that every
request is already freed.  Starts its own ``mpirun`` (plain pytest only).
"""

from __future__ import annotations

import subprocess

import pytest
from support import util

SCRIPT = r'''
import atexit
from mpi4py import MPI
held = []

@atexit.register
def check():
    left = [r for r in held if r != MPI.REQUEST_NULL]
    print(f"rank {MPI.COMM_WORLD.rank}: {len(held)} requests, {len(left)} left at exit", flush=True)

import numpy as np
import mpicoll
from mpicoll.engine import context, executor

comm = mpicoll.Comm(MPI.COMM_WORLD)
dup = mpicoll.Comm(MPI.COMM_WORLD.Dup())
x = np.arange(8.0) + comm.rank
for c in (comm, dup):
    y, z = np.empty(8), np.empty(8 * c.size)
    for _ in range(2):
        c.Allreduce(x, y)
        c.Allgather(x, z)
    for p in context.context(c).cache.blocking.values():
        held.extend(executor._HOLDING.get(p.op, ()))
# a persistent collective on its program (two requests), never freed
w = np.empty(8)
req = dup.Allreduce_init(x, w)
for _ in range(2):
    req.Start()
    req.Wait()
held.extend(executor._HOLDING.get(req._op, ()))
assert np.array_equal(y, sum(np.arange(8.0) + r for r in range(comm.size)))
assert np.array_equal(w, y)
'''


@pytest.mark.timeout(150)
def test_plan_requests_are_freed_before_finalize(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd, env = util.mpirun_cmd(2, [script])
    res = subprocess.run(cmd, cwd=util.ROOT, env=env, capture_output=True, text=True, timeout=120)
    report = f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
    assert res.returncode == 0, report
    for r in range(2):
        assert f"rank {r}: 10 requests, 0 left at exit" in res.stdout, report
    assert "persistent request" not in res.stderr, report  # MPICH's warning
