"""benchmarks/latency.py at small sizes: its table, every variant checked, a wrong one reported.

No timing is asserted (this machine is shared).
"""

from __future__ import annotations

import pytest
from mpi4py import MPI
from support import util

latency = util.benchmark("latency")


@pytest.mark.timeout(120)
@pytest.mark.ranks(2, 3)  # the floors exist at 2 ranks only; 3: the columns without them
def test_latency_tool_checks_every_variant(capsys, monkeypatch):
    """``benchmarks/latency.py``: a table row per size and collective, every variant judged
    against the built-in (a wrong one makes it fail), requests freed."""
    argv = ["--sizes", "16", "4096", "--reps", "1", "--inner", "2", "--warmup", "1"]
    assert latency.main(argv) == 0
    if MPI.COMM_WORLD.rank == 0:
        rows = [line.split() for line in capsys.readouterr().out.splitlines()
                if line and line[0] == " " and line.split()[0].isdigit()]
        assert [(r[0], r[1]) for r in rows] == [(s, c) for s in ("16", "4096")
                                                for c in latency.COLLECTIVES]
        width = 11 if MPI.COMM_WORLD.size == 2 else 9  # with sendrecv and persist, or "-"
        assert all(len(r) == width for r in rows), rows
    # --timeout T: the array function under a timeout too (remembered with its timeout), one more column
    assert latency.main(argv + ["--collectives", "allreduce", "--timeout", "30"]) == 0
    if MPI.COMM_WORLD.rank == 0:
        out = capsys.readouterr().out
        assert "array+T" in out, out
        rows = [line.split() for line in out.splitlines()
                if line and line[0] == " " and line.split()[0].isdigit()]
        assert len(rows) == 2 and all(len(r) == width + 2 for r in rows), rows
    # the non-blocking and persistent forms: mpicoll's blocking call beside them, and six
    # columns (the built-in's two persistent ones only with an MPI-4 library, which both
    # PyPI MPIs are)
    assert latency.main(argv + ["--forms", "nonblocking"]) == 0
    if MPI.COMM_WORLD.rank == 0:
        out = capsys.readouterr().out
        rows = [line.split() for line in out.splitlines()
                if line and line[0] == " " and line.split()[0].isdigit()]
        assert len(rows) == 6 and all(len(r) == 15 for r in rows), out
        assert all(c in out.split() for c in ("Comm", "I-Comm", "P-Comm")), out
    # a variant that gets it wrong is reported
    real = latency._variants

    def wrong(collective, *args):
        out, held = real(collective, *args)
        fn, y = out["Comm"]
        out["Comm"] = ((lambda: (fn(), y.__setitem__(0, y[0] + 1))), y)
        return out, held

    monkeypatch.setattr(latency, "_variants", wrong)
    assert latency.main(["--sizes", "16", "--collectives", "allreduce", "--reps", "1",
                         "--inner", "1", "--warmup", "0"]) == 1
