"""pytest set-up for mpicoll's tests: header, groups, shared communicators, launch tests, summary.

Run the MPI tests under a launcher at any rank count::

    mpirun -n 4 python -m pytest tests/

or the whole suite, each group where it means something, with ``bash tests/run_tests.sh``
(``tests/matrix.sh`` says which groups it runs, under which MPI, at which rank counts).

Groups (what a test needs; ``--group`` selects them, ``tests/README.md`` has the table):

``local``
    No peer: argument parsing, tables, probes, simulators, fake-GPU logic.
    Mark with ``pytest.mark.local`` (a test, or ``pytestmark`` for a file).
    run_tests.sh runs them once per MPI with plain pytest (one singleton rank).
``mpi``
    Everything else outside ``tests/launch/`` and ``tests/torch/``: run under
    the launcher at the rank counts of its ``pytest.mark.ranks(...)`` marker,
    default :data:`ALL_RANKS` (1-5).  Give a test fewer counts only where its
    outcome cannot change between the counts left out (say why beside
    the marker): 1 is the trivial path, 2 and 4 powers of two, 3 and 5 not.
``launch``
    ``tests/launch/``: they start ``mpirun`` themselves, so they run
    under plain pytest only (left out under a launcher).
``torch``
    ``tests/torch/``: the torch.distributed backend, under the launcher in a
    venv with torch (``.ci/run``'s torch section); skipped without torch,
    left out of the other groups.

The group follows from the folder (launch, torch) and the ``local`` marker,
whichever folder of ``tests/`` the file is in.  Without ``--group`` (a run by
hand) every test collected runs, at any rank count: the markers only select in
``--group`` runs.  Where a new test file goes: ``tests/README.md``.

* The header names the MPI library, mpi4py/NumPy, the rank count and the
  array backends.
* The ``comms`` fixture holds the communicators of :data:`util.COMM_KINDS`
  (created once, freed at the end of the session).
* With ``MPICOLL_TEST_SUMMARY=PREFIX`` each rank writes its outcome counts
  to ``PREFIX.<rank>`` (``tests/run_tests.sh`` adds them up); with
  ``MPICOLL_TEST_IDS=FILE`` rank 0 writes the IDs of the tests the run keeps
  to ``FILE``, one a line (``run_tests.sh --collect``); with
  ``MPICOLL_TEST_PROGRESS=PREFIX`` each rank keeps ``PREFIX.<rank>`` saying
  which test it runs (``support/progress.py``: ``run_tests.sh``'s watchdog
  reads them).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI
from support import util

pytest_plugins = ["support.progress"]  # each rank's current test, for run_tests.sh's watchdog


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
        + (", under an MPI launcher" if util.under_launcher() else ", no MPI launcher"),
        f"array backends: numpy yes, {_cupy_status()}",
    ]


ALL_RANKS = (1, 2, 3, 4, 5)
GROUPS = ("local", "mpi", "launch", "torch")
TESTS_DIR = Path(__file__).resolve().parent
TORCH_DIR = TESTS_DIR / "torch"
LAUNCH_DIR = TESTS_DIR / "launch"


def _in(folder: Path, path: Path) -> bool:
    """Whether ``path`` is ``folder`` or inside it."""
    path = path.resolve()
    return path == folder or folder in path.parents


def pytest_addoption(parser):
    parser.addoption(
        "--group", default="", metavar="GROUP[,GROUP]",
        help="run only these test groups (local, mpi, launch, torch; see conftest.py): "
             "mpi tests only at the rank counts of their ranks marker")


def pytest_configure(config):
    config.addinivalue_line("markers", "local: needs no peer; runs in the plain-pytest group")
    config.addinivalue_line(
        "markers", "ranks(*counts): the rank counts at which the mpi group runs this test")
    wanted = [g for g in config.getoption("--group").split(",") if g]
    bad = [g for g in wanted if g not in GROUPS]
    if bad:
        raise pytest.UsageError(f"--group: expected some of {', '.join(GROUPS)}, got {bad[0]!r}")


def group_of(item) -> str:
    """The group of a collected test: launch, local, mpi or torch."""
    if _in(TORCH_DIR, item.path):
        return "torch"
    if _in(LAUNCH_DIR, item.path):
        return "launch"
    return "local" if item.get_closest_marker("local") else "mpi"


def rank_counts(item) -> tuple:
    """The rank counts at which the mpi group runs ``item``."""
    mark = item.get_closest_marker("ranks")
    return tuple(mark.args) if mark else ALL_RANKS


def pytest_collection_modifyitems(config, items):
    """With ``--group``: keep the tests of those groups, mpi ones at their rank counts only."""
    wanted = [g for g in config.getoption("--group").split(",") if g]
    if not wanted:
        return
    size = MPI.COMM_WORLD.Get_size()
    keep, drop = [], []
    for item in items:
        group = group_of(item)
        ok = group in wanted and (group != "mpi" or size in rank_counts(item))
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


_MODULE_RANKS = re.compile(r"^pytestmark = .*\bmark\.ranks\(([0-9, ]+)\)", re.M)


def _nothing_selected(path: Path, wanted, size: int) -> bool:
    """Whether a ``--group`` run would deselect every test of a file (read as text, not imported).

    Conservative: true only when the file cannot hold a test of the wanted
    groups (no ``mark.local`` for local; its file-wide ``ranks`` excludes
    this rank count and no test has a ``ranks`` of its own, for mpi), so
    the run does not import and collect it for nothing.
    """
    if _in(TORCH_DIR, path):
        return "torch" not in wanted
    if wanted == ["torch"]:
        return True
    if _in(LAUNCH_DIR, path):
        return "launch" not in wanted
    text = path.read_text(encoding="utf-8", errors="replace")
    if "mpi" not in wanted:
        return "local" not in wanted or "mark.local" not in text
    found = _MODULE_RANKS.search(text)
    if found is None or text.count("mark.ranks(") > 1 or "local" in wanted:
        return False
    return size not in {int(n) for n in found.group(1).replace(",", " ").split()}


def pytest_ignore_collect(collection_path: Path, config):
    """Leave tests/launch/ to the plain pytest run (its tests start mpirun themselves);
    with ``--group``, skip files none of whose tests the run would keep."""
    if _in(LAUNCH_DIR, collection_path):
        if util.under_launcher():
            return True
    elif collection_path.name.startswith("test_launch_"):
        # its tests would run in the mpi group, starting mpirun under mpirun
        raise pytest.UsageError(f"{collection_path}: a test file that starts mpirun goes in "
                                f"{LAUNCH_DIR}")
    wanted = [g for g in config.getoption("--group").split(",") if g]
    if wanted and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        if _nothing_selected(collection_path, wanted, MPI.COMM_WORLD.Get_size()):
            return True
    return None


def pytest_collection_finish(session):
    """With ``MPICOLL_TEST_IDS=FILE``: rank 0 writes the IDs of the tests this run keeps."""
    path = os.environ.get("MPICOLL_TEST_IDS")
    if path and MPI.COMM_WORLD.Get_rank() == 0:
        with open(path, "w") as f:
            f.writelines(f"{item.nodeid}\n" for item in session.items)


@pytest.fixture(scope="session")
def comms():
    """Communicators by kind (see :func:`util.make_comms`); collective on first use."""
    made = util.make_comms(MPI.COMM_WORLD)
    yield made
    util.free_comms(made)


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


@pytest.fixture(autouse=True)
def _environment_read_again():
    """After each test, mpicoll's process-wide options are read from the environment again.

    mpicoll reads ``MPICOLL_*`` when it sets a communicator up and keeps the latest read
    for its process-wide options; a test that set a variable (monkeypatch undoes it
    afterwards) must not leave its value to the tests after it.
    """
    yield
    from mpicoll.core import config
    try:
        config.read_environment()
    except ValueError:  # a variable the job itself set badly: the next set-up raises
        pass
