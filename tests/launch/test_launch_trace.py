"""MPICOLL_TRACE=path.json traces a whole job and rank 0 writes the merged file at exit.

Starts its own ``mpirun`` (plain pytest only).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from support import util

SCRIPT = r'''
import numpy as np
import mpicoll
from mpi4py import MPI

comm = MPI.COMM_WORLD
x = np.arange(5000, dtype=np.float64) + comm.rank
mpicoll.allreduce(x, algorithm="ring")
mpicoll.allgather(x[:10], algorithm="ring")
sub = comm.Split(comm.rank % 2, comm.rank)
mpicoll.allreduce(x[:7], comm=sub, algorithm="recursive_doubling")
sub.Free()
print("done", comm.rank, flush=True)
'''


@pytest.mark.timeout(150)
def test_environment_variable_writes_merged_trace(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    out = tmp_path / "job-trace.json"
    cmd, env = util.mpirun_cmd(3, [script])
    env["MPICOLL_TRACE"] = str(out)
    res = subprocess.run(cmd, cwd=util.ROOT, env=env, capture_output=True, text=True, timeout=120)
    report = f"exit {res.returncode}\n--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}"
    assert res.returncode == 0, report
    assert res.stdout.count("done") == 3, report
    doc = json.loads(out.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in xs} == {0, 1, 2}
    for r in range(3):
        calls = sorted(e["name"] for e in xs if e["pid"] == r and e["tid"] // 100 == 1)
        assert calls == ["allgather #2 (ring)", "allreduce #1 (recursive_doubling)",
                         "allreduce #1 (ring)"], calls
        assert any(e["tid"] // 100 == 3 for e in xs if e["pid"] == r)  # sends
    assert not list(tmp_path.glob("job-trace.json.rank*"))  # no per-rank fallback files
