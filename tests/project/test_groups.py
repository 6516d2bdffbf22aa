"""conftest.py's --group selection, the matrix and the outcome files: each group keeps exactly
its tests, says no to a bad name, the matrix (tests/matrix.sh) names only paths and tests that
exist, and a run's per-rank outcome lines add up (tests/outcome.sh).

Local tests: each starts one plain ``pytest`` (``--collect-only``, but for the outcome test), a
singleton rank.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.local

TESTS = Path(__file__).resolve().parents[1]


def collect(*args) -> tuple[int, set, str]:
    """(exit status, collected test ids, output) of a plain ``pytest --collect-only -q``."""
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                          "--collect-only", "-q", *args], cwd=TESTS.parent,
                         capture_output=True, text=True, timeout=120)
    ids = {line.strip() for line in res.stdout.splitlines() if "::" in line}
    return res.returncode, ids, res.stdout + res.stderr


def test_each_group_keeps_its_own_tests():
    files = ["tests/transport/test_topology.py", "tests/gpu/test_cuda_detect.py", "tests/api/test_bad_input.py",
             "tests/launch/test_launch_trace.py"]
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
    assert "tests/transport/test_topology.py::test_parse_fake_nodes" in local
    assert launch and all(t.startswith("tests/launch/") for t in launch)
    # mpi at this singleton's 1 rank: the unmarked topology tests and the catalogue (ranks 1, 2)
    assert "tests/transport/test_topology.py::test_real_nodes" in mpi
    assert any("test_bad_input.py" in t for t in mpi)
    assert not (mpi & local) and not (mpi & launch)
    assert local | launch | mpi == everything


def test_a_file_none_of_whose_tests_run_is_not_collected():
    """In a directory run, a file without a local test is skipped, not collected and deselected."""
    rc, catalogue, out = collect("tests/api/test_bad_input.py")
    assert rc == 0 and catalogue, out
    rc, local, out = collect("--group", "local", "tests")
    assert rc == 0 and local, out
    found = re.search(r"\((\d+) deselected\)", out)
    deselected = int(found.group(1)) if found else 0
    assert deselected < len(catalogue), out
    assert not any("test_bad_input.py" in t for t in local), out


def test_unknown_group_is_refused():
    rc, _, out = collect("--group", "local,everything", "tests/gpu/test_cuda_detect.py")
    assert rc != 0
    assert "--group: expected some of local, mpi, launch, torch, got 'everything'" in out


def outcome(prefix: Path, nranks: int, rc: int = 0) -> list[str]:
    """tests/outcome.sh's ``pytest_outcome PREFIX NRANKS RC``, split: passed failed skipped problem."""
    res = subprocess.run(["bash", "-c", 'source tests/outcome.sh && pytest_outcome "$@"', "bash",
                          str(prefix), str(nranks), str(rc)],
                         cwd=TESTS.parent, capture_output=True, text=True, timeout=60, check=True)
    parts = res.stdout.rstrip("\n").split(" ", 3)
    return parts + [""] * (4 - len(parts))


def test_each_ranks_outcome_file_counts_not_the_shared_log(tmp_path):
    """The counts of an MPI pytest run come from conftest.py's per-rank files.

    Under a launcher both ranks' summary lines go to one output and once landed on one line
    ("686 passed in 25.70s686 passed in 25.69s"): .ci/run read two numbers there and dropped
    the run's 686 from its total.  The files cannot interleave.
    """
    prefix = tmp_path / "run"
    env = dict(os.environ, MPICOLL_TEST_SUMMARY=str(prefix))
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--group", "local", "tests/transport/test_topology.py"],
                         cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    ran = int(re.search(r"(\d+) passed", res.stdout).group(1))
    assert ran > 0
    assert outcome(prefix, 1) == [str(ran), "0", "0", ""]

    # a second rank: rank 0's passed count, the most failures any rank saw
    line = (prefix.with_name("run.0")).read_text()
    (tmp_path / "run.1").write_text(line.replace(" failed=0 ", " failed=2 ").replace("exit=0", "exit=1"))
    assert outcome(prefix, 2) == [str(ran), "2", "0", ""]
    # a rank that wrote nothing, or a line that is not one (two interleaved), did not finish
    (tmp_path / "run.1").unlink()
    assert outcome(prefix, 2, 137) == [str(ran), "0", "0", "rank 1 did not finish (exit status 137)"]
    (tmp_path / "run.1").write_text(line.rstrip("\n") + line)
    assert outcome(prefix, 2)[3] == "rank 1 did not finish (exit status 0)"
    # every rank finished clean, but the launcher failed: the run fails
    (tmp_path / "run.1").write_text(line)
    assert outcome(prefix, 2, 1) == [str(ran), "0", "0", "launcher exit status 1"]


def matrix() -> list[tuple[str, str, str, list[str]]]:
    """(matrix, group, ranks, arguments) of every row of tests/matrix.sh, read by its own reader."""
    script = ('source tests/matrix.sh; for m in $(matrix_names); do for g in launch local mpi '
              'verify torch; do matrix_rows "$m" "$g" | sed "s/^/$m $g|/"; done; done')
    res = subprocess.run(["bash", "-c", script], cwd=TESTS.parent, capture_output=True, text=True,
                         timeout=60, check=True)
    rows = []
    for line in res.stdout.splitlines():
        head, ranks, args = line.split("|", 2)
        name, group = head.split()
        rows.append((name, group, ranks, args.split()))
    return rows


def test_the_matrix_names_only_paths_and_tests_that_exist():
    """pytest ignores an --ignore or --deselect of a path that is not there: a file moved or a
    test renamed would silently run where the matrix says it does not."""
    rows = matrix()
    assert {name for name, *_ in rows} >= {"openmpi", "mpich"}
    for name, group, ranks, args in rows:
        assert ranks == "-" if group in ("launch", "local") else ranks.replace(" ", "").isdigit(), \
            (name, group, ranks)
        if group == "verify":
            continue
        assert args and not args[0].startswith("-"), (name, group, args)  # the paths come first
        for arg in args:
            path = arg.split("=", 1)[1] if arg.startswith(("--ignore=", "--deselect=")) else arg
            assert not path.startswith("-"), (name, group, arg)
            file, _, test = path.partition("::")
            assert (TESTS.parent / file).exists(), (name, group, arg)
            if test:
                assert f"def {test}(" in (TESTS.parent / file).read_text(), (name, group, arg)


def test_the_readme_shows_the_matrix():
    """tests/README.md's copy of the table is the table."""
    res = subprocess.run(["bash", "-c", 'source tests/matrix.sh && printf "%s" "$MATRIX"'],
                         cwd=TESTS.parent, capture_output=True, text=True, timeout=60, check=True)
    readme = (TESTS / "README.md").read_text()
    shown = readme.split("## The matrix", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    assert shown.strip("\n") == res.stdout.strip("\n")



def test_check_ids_maps_renames_and_finds_a_lost_test(tmp_path):
    """tests/check_ids.py: an ID moved by a renames line (``OLD NEW``, or ``OLD => NEW``
    for an ID with spaces) is not lost; an ID that went nowhere is, and fails the check."""
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    (before / "np2.txt").write_text("tests/a.py::test_x\ntests/a.py::test_y[a b]\n"
                                    "tests/a.py::test_z\n")
    renames = tmp_path / "renames.txt"
    renames.write_text("# a comment => not a rename\ntests/a.py::test_x  tests/b.py::test_x\n"
                       "tests/a.py::test_y[a b] => tests/b.py::test_y[c d]\n")
    (after / "np2.txt").write_text("tests/b.py::test_x\ntests/b.py::test_y[c d]\ntests/a.py::test_z\n")

    def check():
        return subprocess.run([sys.executable, str(TESTS / "check_ids.py"), str(before), str(after),
                               "--renames", str(renames)], capture_output=True, text=True,
                              timeout=60)
    run = check()
    assert run.returncode == 0 and "no test lost" in run.stdout, run.stdout
    (after / "np2.txt").write_text("tests/b.py::test_x\ntests/b.py::test_y[c d]\n")
    run = check()
    assert run.returncode == 1 and "lost: tests/a.py::test_z" in run.stdout, run.stdout


def test_check_ids_follows_later_renames_and_counts_removed_tests(tmp_path):
    """tests/check_ids.py: an ID is followed through every line that applies (a file moved,
    then one of its tests renamed, its parameter dropped; a test given a parameter is not
    renamed again by its own line), and a test removed (NEW ``-``) is counted, not lost."""
    before, after = tmp_path / "before", tmp_path / "after"
    before.mkdir()
    after.mkdir()
    (before / "np2.txt").write_text("tests/old.py::test_x[compiled]\ntests/old.py::test_x[python]\n"
                                    "tests/old.py::test_gone\ntests/old.py::test_kept\n"
                                    "tests/old.py::test_p\n")
    renames = tmp_path / "renames.txt"
    renames.write_text("tests/old.py  tests/b/old.py\n"
                       "tests/b/old.py::test_x[compiled]  tests/b/new.py::test_y\n"
                       "tests/b/old.py::test_x[python]  tests/b/new.py::test_y\n"
                       "tests/b/old.py::test_gone  -  # what it checked went with the code\n"
                       "tests/b/new.py::test_p  tests/b/new.py::test_p[a]\n"
                       "tests/b/old.py  tests/b/new.py\n")
    (after / "np2.txt").write_text("tests/b/new.py::test_y\ntests/b/new.py::test_kept\n"
                                   "tests/b/new.py::test_p[a]\n")
    run = subprocess.run([sys.executable, str(TESTS / "check_ids.py"), str(before), str(after),
                          "--renames", str(renames)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "no test lost" in run.stdout, run.stdout
    assert run.stdout.split("\n")[1].split() == ["np2", "3", "3", "0", "1", "0"], run.stdout
