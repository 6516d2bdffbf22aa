"""conftest.py's --group selection: each group keeps exactly its tests, and says no to a bad name.

Local tests: each starts one plain ``pytest --collect-only`` (a singleton rank).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.local

TESTS = Path(__file__).resolve().parent


def collect(*args) -> tuple[int, set, str]:
    """(exit status, collected test ids, output) of a plain ``pytest --collect-only -q``."""
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                          "--collect-only", "-q", *args], cwd=TESTS.parent,
                         capture_output=True, text=True, timeout=120)
    ids = {line.strip() for line in res.stdout.splitlines() if "::" in line}
    return res.returncode, ids, res.stdout + res.stderr


def test_each_group_keeps_its_own_tests():
    files = ["tests/test_topology.py", "tests/test_cuda_detect.py", "tests/test_bad_input.py",
             "tests/test_launch_trace.py"]
    rc, everything, out = collect(*files)
    assert rc == 0, out
    rc, local, out = collect("--group", "local", *files)
    assert rc == 0, out
    rc, launch, out = collect("--group", "launch", *files)
    assert rc == 0, out
    rc, mpi, out = collect("--group", "mpi", *files)
    assert rc == 0, out
    # local: the marked topology tests and all of test_cuda_detect, nothing else
    assert local and all("test_topology.py" in t or "test_cuda_detect.py" in t for t in local)
    assert {t for t in everything if "test_cuda_detect.py" in t} <= local
    assert "tests/test_topology.py::test_parse_fake_nodes" in local
    assert launch and all("test_launch_" in t for t in launch)
    # mpi at this singleton's 1 rank: the unmarked topology tests and the catalogue (ranks 1, 2)
    assert "tests/test_topology.py::test_real_nodes" in mpi
    assert any("test_bad_input.py" in t for t in mpi)
    assert not (mpi & local) and not (mpi & launch)
    assert local | launch | mpi == everything


def test_a_file_none_of_whose_tests_run_is_not_collected():
    """In a directory run, a file without a local test is skipped, not collected and deselected."""
    rc, catalogue, out = collect("tests/test_bad_input.py")
    assert rc == 0 and catalogue, out
    rc, local, out = collect("--group", "local", "tests")
    assert rc == 0 and local, out
    found = re.search(r"\((\d+) deselected\)", out)
    deselected = int(found.group(1)) if found else 0
    assert deselected < len(catalogue), out
    assert not any("test_bad_input.py" in t for t in local), out


def test_unknown_group_is_refused():
    rc, _, out = collect("--group", "local,everything", "tests/test_cuda_detect.py")
    assert rc != 0
    assert "--group: expected some of local, mpi, launch, torch, got 'everything'" in out
