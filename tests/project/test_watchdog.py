"""run_tests.sh's watchdog (tests/watchdog.sh): a slow healthy run passes, a stuck one is stopped
with a line naming the test each rank was running.

Each case runs ``watch_run`` on a tiny suite of its own (plain pytest with the suite's
progress plugin, support/progress.py), with limits of a few seconds.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 4  # seconds without a test starting or finishing

SUITE = '''
import os
import time

import pytest

STEP = float(os.environ["FAKE_STEP"])


@pytest.mark.parametrize("k", range(int(os.environ["FAKE_TESTS"])))
def test_slow(k):
    time.sleep(STEP)


def test_stuck():
    if os.environ.get("FAKE_STUCK"):
        time.sleep(120)  # (no pytest-timeout here: the watchdog is what ends it)
'''


def watch(tmp_path, limit=LIMIT, **env):
    """``watch_run fake limit`` on the tiny suite: (exit status, output, seconds, stop file)."""
    (tmp_path / "test_fake.py").write_text(SUITE)
    marks = tmp_path / "run.now"
    script = ('source tests/watchdog.sh && watch_run fake "$1" "$2.*" -- env '
              'MPICOLL_TEST_PROGRESS="$2" "$3" -m pytest -q -p no:cacheprovider '
              '-p support.progress "$4"')
    full = dict(os.environ, PYTHONPATH=str(ROOT / "tests"), WATCH_DIR=str(tmp_path), **env)
    t0 = time.monotonic()
    res = subprocess.run(["bash", "-c", script, "bash", str(limit), str(marks), sys.executable,
                          str(tmp_path / "test_fake.py")], cwd=ROOT, env=full,
                         capture_output=True, text=True, timeout=90)
    stopped = tmp_path / "fake.stopped"
    return (res.returncode, res.stdout + res.stderr, time.monotonic() - t0,
            stopped.read_text() if stopped.exists() else None)


@pytest.mark.timeout(120)
def test_a_slow_run_that_keeps_finishing_tests_passes(tmp_path):
    """Thirty tests of 0.6 s: the run takes well over the limit, but never goes the limit
    without a test finishing, so nothing stops it.  (A limit of its own, above what pytest's
    start and end take on a busy machine: at 4 s a loaded CI stopped this run after its
    last test.)"""
    limit = 10
    rc, out, secs, stopped = watch(tmp_path, limit, FAKE_STEP="0.6", FAKE_TESTS="30")
    assert rc == 0 and stopped is None and "31 passed" in out, out
    assert secs > 1.5 * limit, f"the run took {secs:.1f} s: not longer than a cap of {limit} s"


@pytest.mark.timeout(120)
def test_a_stuck_test_is_stopped_and_named(tmp_path):
    """A test that stops making progress: the run is stopped about the limit after it
    started, exit status 124, with why and the test the rank was running."""
    rc, out, secs, stopped = watch(tmp_path, FAKE_STEP="0", FAKE_TESTS="2", FAKE_STUCK="1")
    assert rc == 124, out
    assert secs < LIMIT + 30, f"stopped after {secs:.1f} s"
    assert re.search(rf"^!!! fake: stopped: no test started or finished for \d+ s "
                     rf"\(MPICOLL_RUN_TIMEOUT={LIMIT}\)$", out, re.M), out
    assert re.search(r"^  rank 0: running .*test_fake\.py::test_stuck for \d+ s$", out, re.M), out
    assert stopped is not None and "test_fake.py::test_stuck" in stopped, stopped


def test_no_run_has_a_wall_clock_cap():
    """Every run of run_tests.sh is under the watchdog, none under `timeout`'s wall clock,
    and the default no-progress limit is longer than any test's own limit."""
    text = (ROOT / "tests" / "run_tests.sh").read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\btimeout -k\b|\btimeout \"?\$", code), "a run under `timeout`"
    assert code.count("watch_run ") >= 4, "pytest (plain and launched), verify, collect"
    default = int(re.search(r"RUN_TIMEOUT=\$\{MPICOLL_RUN_TIMEOUT:-(\d+)\}", code).group(1))
    limits = [int(n) for f in (ROOT / "tests").rglob("test_*.py")
              for n in re.findall(r"mark\.timeout\((\d+)\)", f.read_text())]
    assert max(limits) < default, f"a test's own limit {max(limits)} s >= the watchdog's {default} s"
