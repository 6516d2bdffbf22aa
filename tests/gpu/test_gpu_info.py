"""python -m mpicoll.info, and CuPy staying unimported on CPU-only work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.tools import info

# python -m mpicoll.info: 1 rank, and 2 (a rank that differs is named)
pytestmark = pytest.mark.ranks(1, 2)

WORLD = MPI.COMM_WORLD
ROOT = Path(__file__).resolve().parents[2]

_LAUNCHED = any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK",
                                          "MPI_LOCALNRANKS", "PMI_RANK"))
_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
         "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


@pytest.fixture(autouse=True)
def forced_yes_accepted(monkeypatch):
    """A forced yes stands for the UCX this process loaded (its refusal: test_forced_yes_refused)."""
    from mpicoll.backends import cuda as _cuda
    monkeypatch.setattr(_cuda, "_ucx_without_cuda", lambda: None)


def _cupy_state():
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "not installed"
    return None


def test_report_lines(capsys, monkeypatch):
    monkeypatch.delenv("MPICOLL_CUDA_AWARE", raising=False)
    with mpicoll.options(cuda_aware=None):
        assert info.main([]) == 0
    out = capsys.readouterr().out
    if WORLD.rank != 0:
        assert out == ""
        return
    lines = out.splitlines()
    labels = [line.split()[0] for line in lines if line.strip() and not line.startswith(" ")]
    for label in ("ranks", "mpicoll", "MPI", "mpi4py", "NumPy", "CuPy", "GPUs", "cuda-aware:"):
        assert label in labels, out
    assert "ranks" in lines[0] and str(WORLD.size) in lines[0]
    mpi_line = next(line for line in lines if line.startswith("MPI "))
    assert " ".join(MPI.Get_library_version().replace("\x00", "").splitlines()[0].split()) in mpi_line
    assert "\x00" not in out  # text, not "binary" to grep
    aware = next(line for line in lines if line.startswith("cuda-aware: "))
    assert aware.startswith(("cuda-aware: yes (", "cuda-aware: no ("))
    if _cupy_state() == "not installed":
        assert "CuPy          not installed" in out or "not installed" in next(
            line for line in lines if line.startswith("CuPy"))
        assert "cuda-aware: no (" in aware and "staging" in aware
        gpus = next(line for line in lines if line.startswith("GPUs"))
        assert "none" in gpus


def test_forced_yes(capsys, monkeypatch):
    monkeypatch.setenv("MPICOLL_CUDA_AWARE", "1")
    with mpicoll.options(cuda_aware=None):
        info.main([])
    out = capsys.readouterr().out
    if WORLD.rank == 0:
        assert "cuda-aware: yes (forced by MPICOLL_CUDA_AWARE=1)" in out


def test_forced_no_by_configure(capsys):
    with mpicoll.options(cuda_aware=False):
        info.main([])
    out = capsys.readouterr().out
    if WORLD.rank == 0:
        assert "cuda-aware: no (forced by mpicoll.configure(cuda_aware=False))" in out


def test_ranks_that_differ_are_named(capsys):
    with mpicoll.options(cuda_aware=WORLD.rank % 2 == 1):
        info.main([])
    out = capsys.readouterr().out
    if WORLD.rank == 0 and WORLD.size > 1:
        assert "rank 1 differs: cuda-aware yes (forced by mpicoll.configure(cuda_aware=True))" in out


def _singleton(args, extra_path=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k in _KEEP}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, str(ROOT)) if p)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.local
@pytest.mark.skipif(_LAUNCHED, reason="starts a singleton MPI process: run with plain pytest")
def test_module_runs_without_mpirun():
    proc = _singleton(["-m", "mpicoll.info"])
    assert proc.returncode == 0, proc.stderr
    assert "cuda-aware: " in proc.stdout and "ranks         1" in proc.stdout


@pytest.mark.local
@pytest.mark.skipif(_LAUNCHED, reason="starts a singleton MPI process: run with plain pytest")
def test_cpu_work_never_imports_cupy(tmp_path):
    """import mpicoll and host collectives do not import CuPy, even where it is installed."""
    trap = tmp_path / "cupy"
    trap.mkdir()
    (trap / "__init__.py").write_text("raise RuntimeError('mpicoll imported cupy')\n")
    code = ("import numpy as np, mpicoll, sys\n"
            "x = mpicoll.allreduce(np.arange(10.0))\n"
            "mpicoll.allgather(np.arange(3)); mpicoll.reduce_scatter(np.arange(4))\n"
            "assert 'cupy' not in sys.modules\n"
            "print('ok', x.sum())\n")
    proc = _singleton(["-c", code], extra_path=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok")


def test_malformed_setting_is_reported(capsys, monkeypatch):
    monkeypatch.setenv("MPICOLL_CUDA_AWARE", "maybe")
    with mpicoll.options(cuda_aware=None):
        rc = info.main([])
    out = capsys.readouterr().out
    if WORLD.rank == 0:
        assert rc == 1
        assert "cuda-aware: unknown (MPICOLL_CUDA_AWARE: expected 1/0" in out


def test_probe_contradicting_yes_fails(capsys, monkeypatch):
    """--probe: one device Sendrecv in a child; a failure under "yes" is reported, exit 1."""
    from mpicoll.backends import cuda as _cuda
    monkeypatch.setattr(_cuda, "probe_transfer", lambda: (False, "the device Sendrecv probe crashed (SIGSEGV)"))
    monkeypatch.setenv("MPICOLL_CUDA_AWARE", "1")
    with mpicoll.options(cuda_aware=None):
        rc = info.main(["--probe"])
    out = capsys.readouterr().out
    if WORLD.rank == 0:
        assert rc == 1
        assert "probe: failed (the device Sendrecv probe crashed (SIGSEGV))" in out
        assert "contradicts cuda-aware: yes" in out
    else:
        assert rc == 0 and out == ""


def test_probe_inside_a_started_mpi_is_not_run(capsys, monkeypatch):
    """main() in a process that initialised MPI (this one): no child job, and the line says
    why (``python -m mpicoll.info --probe`` runs it before MPI_Init: tests/launch)."""
    import subprocess

    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a) or 1 / 0)
    monkeypatch.delenv("MPICOLL_CUDA_AWARE", raising=False)
    with mpicoll.options(cuda_aware=False):
        rc = info.main(["--probe"])
    out = capsys.readouterr().out
    assert not started
    if WORLD.rank != 0:
        return
    assert rc == 0
    line = next(line for line in out.splitlines() if line.startswith("probe: "))
    assert line.startswith("probe: not run (MPI is initialised in this process"), line


def test_forced_yes_refused(capsys, monkeypatch):
    """MPICOLL_CUDA_AWARE=1 where the UCX transport has no CUDA transport: the report says the
    setting is refused and why, exit 1."""
    from mpicoll.backends import cuda as _cuda
    monkeypatch.setattr(_cuda, "_ucx_without_cuda", lambda: "the UCX transport loaded no CUDA "
                        "transport (no libuct_cuda in this process)")
    monkeypatch.setenv("MPICOLL_CUDA_AWARE", "1")
    with mpicoll.options(cuda_aware=None):
        rc = info.main([])
    out = capsys.readouterr().out
    if WORLD.rank == 0:
        assert rc == 1
        assert ("cuda-aware: unknown (MPICOLL_CUDA_AWARE=1: expected an MPI that can read device "
                "memory, but the UCX transport loaded no CUDA transport") in out, out


def test_ucx_line(capsys, monkeypatch):
    """The UCX line: what the MPI's transport is, and whether it can carry device memory."""
    monkeypatch.delenv("MPICOLL_CUDA_AWARE", raising=False)
    with mpicoll.options(cuda_aware=None):
        info.main([])
    out = capsys.readouterr().out
    if WORLD.rank != 0:
        return
    line = next(line for line in out.splitlines() if line.startswith("UCX "))
    from mpicoll.backends import cuda as _cuda
    mapped = _cuda._mapped_paths()
    if any(os.path.basename(p).startswith("libucp") for p in mapped):
        assert "libucp" in line and ("CUDA transports loaded" in line or "CUDA transport" in line)
    else:
        assert line.endswith("not loaded in this process")


@pytest.mark.parametrize("forced, probe_ok, expected", [
    ("1", True, 0), ("1", False, 1), ("0", True, 1), ("0", False, 1),
])
def test_require_cuda_aware(capsys, monkeypatch, forced, probe_ok, expected):
    """--require-cuda-aware: exit 0 only with cuda-aware: yes and a passing probe."""
    from mpicoll.backends import cuda as _cuda
    monkeypatch.setattr(_cuda, "probe_transfer", lambda: (probe_ok, "the device Sendrecv probe said so"))
    monkeypatch.setenv("MPICOLL_CUDA_AWARE", forced)
    with mpicoll.options(cuda_aware=None):
        rc = info.main(["--probe", "--require-cuda-aware"])
    out = capsys.readouterr().out
    if WORLD.rank == 0:
        assert rc == expected, out
        assert ("required: cuda-aware: yes" in out) is (forced == "0")
    else:
        assert rc == 0


def test_probe_passing_under_a_no_names_the_switch(capsys, monkeypatch):
    """A passing probe beside a "no" that was not forced says how to use the direct path."""
    from mpicoll.backends import cuda as _cuda
    monkeypatch.setattr(_cuda, "probe_transfer", lambda: (True, "the device Sendrecv probe passed"))
    monkeypatch.setattr(_cuda, "cuda_aware_mpi", lambda: _cuda.Decision(False, "X reports no CUDA support"))
    rc = info.main(["--probe"])
    out = capsys.readouterr().out
    if WORLD.rank == 0:
        assert rc == 0
        assert "probe: passed (the device Sendrecv probe passed)" in out
        assert "MPICOLL_CUDA_AWARE=1 uses the direct path" in out
        assert "passed between two processes" in out
