"""Each rank's progress, for tests/watchdog.sh: which test it runs, since when.

With ``MPICOLL_TEST_PROGRESS=P`` each rank keeps ``P.<rank>`` at one line,
``<epoch seconds> <state> <test id>``, rewritten (a new file renamed into place)
whenever its state changes: ``collecting``, ``collected``, ``running <id>``,
``finished <id>``, ``done``.  The watchdog of tests/run_tests.sh stops a run only
when none of these files changed for ``MPICOLL_RUN_TIMEOUT`` seconds, and prints
what each says.  A pytest plugin: tests/conftest.py loads it (``pytest_plugins``),
a run of other tests can with ``-p support.progress``.
"""

from __future__ import annotations

import os
import time

ENV = "MPICOLL_TEST_PROGRESS"


def _rank() -> int:
    """This process's rank in the job, as the launcher numbers it (run_tests.sh names the
    ranks' logs alike), without initialising MPI."""
    for var in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _write(state: str, what: str = "") -> None:
    prefix = os.environ.get(ENV)
    if not prefix:
        return
    rank = _rank()
    path = f"{prefix}.{rank}"
    # (a hidden name beside it: the watchdog reads P.* and never sees half a line)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{int(time.time())} {state} {what}".rstrip() + "\n")
    os.replace(tmp, path)


def pytest_configure(config):
    _write("collecting")


def pytest_collection_finish(session):
    _write("collected", f"{len(session.items)} tests")


def pytest_runtest_logstart(nodeid, location):
    _write("running", nodeid)


def pytest_runtest_logfinish(nodeid, location):
    _write("finished", nodeid)


def pytest_sessionfinish(session, exitstatus):
    _write("done")
