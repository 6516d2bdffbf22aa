"""pytest set-up for mpicoll's tests: header, shared communicators, launch tests, summary.

Run the MPI tests under a launcher at any rank count::

    mpirun -n 4 python -m pytest tests/

or the whole suite (1-5 ranks, launch tests, verify) with ``bash tests/run_tests.sh``.

* The header names the MPI library, mpi4py/NumPy, the rank count and the
  array backends.
* ``tests/test_launch_*.py`` start ``mpirun`` themselves: they are not
  collected under an MPI launcher, only by a plain ``pytest`` run.
* The ``comms`` fixture holds the communicators of :data:`_util.COMM_KINDS`
  (created once, freed at the end of the session).
* With ``MPICOLL_TEST_SUMMARY=PREFIX`` each rank writes its outcome counts
  to ``PREFIX.<rank>`` (``tests/run_tests.sh`` adds them up).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import _util
import numpy as np
import pytest
from mpi4py import MPI


def _cupy_status() -> str:
    """CuPy installed or not, without importing it (no GPU initialisation at collection)."""
    if importlib.util.find_spec("cupy") is None:
        return "cupy no"
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("cupy"):
            return f"cupy yes ({name} {dist.version})"
    return "cupy yes"


def pytest_report_header(config):
    import mpi4py

    lib = MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip()
    major, minor = MPI.Get_version()
    return [
        f"MPI: {lib} (MPI standard {major}.{minor})",
        f"mpi4py {mpi4py.__version__}, numpy {np.__version__}, "
        f"ranks {MPI.COMM_WORLD.Get_size()} (this is rank {MPI.COMM_WORLD.Get_rank()})"
        + (", under an MPI launcher" if _util.under_launcher() else ", no MPI launcher"),
        f"array backends: numpy yes, {_cupy_status()}",
    ]


def pytest_ignore_collect(collection_path: Path, config):
    """Leave tests/test_launch_*.py to the plain pytest run (they start mpirun themselves)."""
    if collection_path.name.startswith("test_launch_") and _util.under_launcher():
        return True
    return None


@pytest.fixture(scope="session")
def comms():
    """Communicators by kind (see :func:`_util.make_comms`); collective on first use."""
    made = _util.make_comms(MPI.COMM_WORLD)
    yield made
    _util.free_comms(made)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    prefix = os.environ.get("MPICOLL_TEST_SUMMARY")
    if not prefix:
        return
    stats = terminalreporter.stats
    counts = {k: len(stats.get(k, []))
              for k in ("passed", "failed", "error", "skipped", "xfailed", "xpassed")}
    rank = MPI.COMM_WORLD.Get_rank()
    with open(f"{prefix}.{rank}", "w") as f:
        f.write(" ".join(f"{k}={v}" for k, v in counts.items()) + f" exit={int(exitstatus)}\n")
