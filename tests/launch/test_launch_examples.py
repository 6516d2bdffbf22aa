"""Run every example in examples/ under the MPI launcher at 1 and 3 ranks (allreduce also at 8).

This file starts ``mpirun``/``mpiexec`` itself, so it runs under plain pytest
(once); under an MPI launcher tests/conftest.py does not collect it, and
named explicitly it skips itself.  Each example checks its own result and
exits non-zero when it is wrong; this test also checks what it prints.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from support import util

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("allreduce", "allgather", "reduce_scatter", "data_parallel", "zero_sharding",
            "batchnorm_stats", "traffic")
# 1 rank: the trivial path; 3: several ranks, not a power of two, uneven blocks
# (powers of two: the library's own tests at 2 and 4 ranks, CI's README run of
# allreduce.py at 4, test_allreduce_8_ranks)
RANKS = (1, 3)
# Smaller problems than the examples' defaults where those dominate the run
# time on oversubscribed ranks; every code path is still taken.
QUICK_ARGS = {"data_parallel": ("--steps", "100"), "zero_sharding": ("--params", "200003")}
RUN_TIMEOUT = 120  # seconds per mpirun; a healthy run takes a few seconds

pytestmark = pytest.mark.skipif(
    util.under_launcher(),
    reason="starts mpirun itself: run this file with plain pytest, not under an MPI launcher",
)


@pytest.fixture(scope="module")
def launcher():
    return util.launcher()


def run_example(launcher, name: str, nranks: int, *args: str) -> subprocess.CompletedProcess:
    """Run examples/<name>.py on ``nranks`` ranks; kill the whole job on timeout."""
    cmd, env = util.mpirun_cmd(nranks, [ROOT / "examples" / f"{name}.py", *args], launch=launcher)
    return util.run_job(cmd, env, RUN_TIMEOUT)


def _describe(res) -> str:
    return (f"{' '.join(res.args)} exited with {res.returncode}\n"
            f"--- stdout\n{res.stdout}\n--- stderr\n{res.stderr}")


def _check_common(res, nranks: int):
    assert res.returncode == 0, _describe(res)
    assert re.search(r"^OK: ", res.stdout, re.M), _describe(res)
    assert "FAILED" not in res.stdout + res.stderr, _describe(res)


@pytest.mark.parametrize("nranks", RANKS)
@pytest.mark.parametrize("name", EXAMPLES)
def test_example(launcher, name, nranks):
    res = run_example(launcher, name, nranks, "--device", "cpu", *QUICK_ARGS.get(name, ()))
    _check_common(res, nranks)
    out = res.stdout
    if name == "allreduce":
        total = nranks * (nranks + 1) / 2
        lines = re.findall(r"^rank \d+: .*$", out, re.M)
        assert lines == [f"rank {r}: {total}" for r in range(nranks)], _describe(res)
    if name in ("allgather", "reduce_scatter"):
        # every per-rank listing is printed whole and in rank order
        listed = [int(r) for r in re.findall(r"^  rank (\d+): ", out, re.M)]
        assert listed and listed == list(range(nranks)) * (len(listed) // nranks), _describe(res)
    if name == "data_parallel":
        assert f"weights bitwise identical on all {nranks} rank(s): True" in out, _describe(res)
    if name == "zero_sharding":
        assert "equal the unsharded ones bitwise: True" in out, _describe(res)


@pytest.mark.parametrize("nranks", (2, 3))
def test_data_parallel_overlap(launcher, nranks):
    """--overlap: gradient buckets reduced with iallreduce during the backward pass."""
    res = run_example(launcher, "data_parallel", nranks, "--device", "cpu", "--overlap",
                      "--steps", "50")
    _check_common(res, nranks)
    assert f"weights bitwise identical on all {nranks} rank(s): True" in res.stdout, _describe(res)
    assert "bitwise equal to blocking bucket reductions: True" in res.stdout, _describe(res)


def test_allreduce_8_ranks(launcher):
    """The README's bigger run: 8 ranks print 36.0."""
    res = run_example(launcher, "allreduce", 8, "--device", "cpu", "--count", "100003")
    _check_common(res, 8)
    lines = re.findall(r"^rank \d+: .*$", res.stdout, re.M)
    assert lines == [f"rank {r}: 36.0" for r in range(8)], _describe(res)


@pytest.fixture(scope="module")
def common():
    """examples/_common.py, the helpers with which every example checks itself."""
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import _common
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return _common


class _OneRank:
    """Just enough of a communicator for _common.finish on one rank."""

    rank = 0

    def allgather(self, obj):
        return [obj]


def test_checks_can_fail(common, capsys):
    """The helpers the examples' verdicts rest on report a difference and exit 1."""
    import numpy as np

    a = np.array([1.0, 2.0, 3.0])
    assert common.mismatch(a, a.copy()) is None
    assert common.mismatch(a, a + 1e-12, tol=1e-9) is None
    msg = common.mismatch(a, a + np.array([0.0, 1e-6, 0.0]), tol=1e-9, name="x", reference="ref")
    assert msg is not None and "1 of 3 elements" in msg and "index (1,)" in msg
    assert common.mismatch(a, a[:2]) is not None
    assert common.mismatch(np.arange(3), np.array([0, 1, 5])) is not None
    with pytest.raises(SystemExit) as exc:
        common.finish(False, "the thing", comm=_OneRank())
    assert exc.value.code == 1
    assert "FAILED: the thing" in capsys.readouterr().out
    common.finish(True, "the thing", comm=_OneRank())
    assert capsys.readouterr().out.startswith("OK: the thing")


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_gpu(launcher, name):
    """Each example with CuPy arrays, 2 ranks (skipped without CuPy and a GPU)."""
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no GPU")
    except Exception as exc:  # ImportError, CUDA driver errors, no device
        pytest.skip(f"CuPy with a GPU is not usable here: {exc}")
    res = run_example(launcher, name, 2, "--device", "gpu", *QUICK_ARGS.get(name, ()))
    _check_common(res, 2)
    assert " on gpu" in res.stdout, _describe(res)
