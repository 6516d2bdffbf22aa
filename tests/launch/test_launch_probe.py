"""The device probe's child job: a device buffer from rank 0 to rank 1 of a two-process job.

``mpicoll.backends.cuda.probe_transfer`` starts ``mpiexec -n 2`` itself, so these
tests run under plain pytest only (conftest.py leaves this folder out under a
launcher).  The ranks' program is the real one on a stand-in CuPy
(``tests/support/fakecupy``: host memory behind the CUDA array interface, or
with ``FAKECUPY_POINTERS=unmapped`` an address MPI cannot read, as a device
pointer is to an MPI that is not CUDA-aware), or a program of the test's own.
The probe refuses to start a process after MPI_Init, which this pytest process
has run: the tests that call it here lift that guard (``_mpi_initialized``);
``python -m mpicoll.info --probe`` runs it as a user does, before MPI_Init.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpicoll.backends import cuda as _cuda

ROOT = Path(__file__).resolve().parents[2]
FAKECUPY = ROOT / "tests" / "support" / "fakecupy"
LIMIT = 120  # seconds for a whole info run (two Python starts, MPI init)


@pytest.fixture
def before_mpi_init(monkeypatch):
    """As in a process that has not initialised MPI (the probe's own guard lifted)."""
    monkeypatch.setattr(_cuda, "_mpi_initialized", lambda: False)
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")


def _info(*args, **env):
    """``python -m mpicoll.info ARGS`` as a user runs it: one process, no launcher."""
    full = {k: v for k, v in os.environ.items() if not _cuda._set_by_launcher(k)}
    full.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **env)
    full.pop("MPICOLL_CUDA_AWARE", None)
    return subprocess.run([sys.executable, "-m", "mpicoll.info", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=LIMIT)


def _probe_line(out):
    return next(line for line in out.splitlines() if line.startswith("probe: "))


def test_info_probe_passes_on_memory_mpi_can_read():
    """The real probe program, its buffers readable by any MPI: the job runs before this
    process initialises MPI (a process after MPI_Init would print "not run"), and passes."""
    proc = _info("--probe", PYTHONPATH=os.pathsep.join([str(FAKECUPY), str(ROOT)]))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = _probe_line(proc.stdout)
    assert line.startswith("probe: passed (the probe job (mpiexec -n 2) passed"), line
    assert "rank 0 to rank 1 intact" in line
    # a no that was not forced, beside a probe that passed: how to use the direct path
    assert "MPICOLL_CUDA_AWARE=1 uses the direct path" in proc.stdout
    assert "cuda-aware: no (" in proc.stdout and "ranks " in proc.stdout  # MPI ran after


def test_info_probe_unreadable_memory_fails():
    """Pointers MPI cannot read, as device pointers are to an MPI that is not CUDA-aware:
    the rank crashes (Open MPI: the signal is named) or MPI reports the error (MPICH's
    cross-process copy), the probe fails and says so, the report still prints."""
    proc = _info("--probe", "--require-cuda-aware",
                 PYTHONPATH=os.pathsep.join([str(FAKECUPY), str(ROOT)]),
                 FAKECUPY_POINTERS="unmapped")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = _probe_line(proc.stdout)
    assert ("crashed (SIGSEGV)" in line or "crashed (SIGBUS)" in line
            or "failed (exit 1): rank 1: Exception:" in line), line
    assert "required: cuda-aware: yes" in proc.stdout


def test_info_probe_without_cupy_says_why():
    proc = _info("--probe", PYTHONPATH=str(ROOT))
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = _probe_line(proc.stdout)
    assert "failed (exit" in line and "No module named 'cupy'" in line, line


def test_the_job_has_two_ranks_and_its_own_environment(before_mpi_init, monkeypatch):
    """Two ranks of one job (not singletons); the MPI settings kept, the launcher's
    variables of this process's job gone (the job's own launcher sets its own)."""
    settings = {"OMPI_MCA_pml": "ob1", "UCX_TLS": "self,sm,cuda_copy", "MPIR_CVAR_NOLOCAL": "1"}
    launcher = dict.fromkeys(("OMPI_COMM_WORLD_RANK", "OMPI_FILE_LOCATION", "PMIX_RANK",
                              "PRTE_LAUNCHED", "PMI_RANK", "PMI_FD", "HYDI_CONTROL_FD",
                              "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), "parent")
    for name, value in {**settings, **launcher}.items():
        monkeypatch.setenv(name, value)
    code = (f"import os\nfrom mpi4py import MPI\nsettings, launcher = {settings!r}, {sorted(launcher)!r}\n"
            "c = MPI.COMM_WORLD\n"
            "assert c.size == 2, c.size\n"
            "assert {k: os.environ.get(k) for k in settings} == settings\n"
            "assert not [k for k in launcher if os.environ.get(k) == 'parent']\n"
            "got = c.gather(c.rank)\n"
            "if c.rank == 0: print('ok' if got == [0, 1] else got)\n")
    ok, text = _cuda.probe_transfer(code=code, timeout=LIMIT)
    assert ok, text


def test_fake_device_send_recv_passes(before_mpi_init):
    """A CUDA-array-interface buffer from rank 0 to rank 1 (fake GPU: host memory)."""
    tests = str(ROOT / "tests")
    code = (
        f"import sys; sys.path[:0] = [{tests!r}, {str(ROOT)!r}]\n"
        "import numpy as np\n"
        "from support import fakegpu\n"
        "from mpi4py import MPI\n"
        "c = MPI.COMM_WORLD\n"
        "rt = fakegpu.FakeRuntime()\n"
        "a = rt.xp.asarray(np.arange(1000.0) * (c.rank == 0))\n"
        "c.Send([a, MPI.DOUBLE], 1, 7) if c.rank == 0 else c.Recv([a, MPI.DOUBLE], 0, 7)\n"
        "if c.rank == 1: print('ok' if np.array_equal(a.get(), np.arange(1000.0)) else 'wrong')\n"
    )
    ok, text = _cuda.probe_transfer(code=code, timeout=LIMIT)
    assert ok, text


def test_wrong_data_is_no(before_mpi_init):
    ok, text = _cuda.probe_transfer(code="import sys; sys.exit('wrong data')", timeout=LIMIT)
    assert ok is False and "failed (exit 1): wrong data" in text, text


def test_crash_is_no(before_mpi_init):
    code = ("import os, signal\nfrom mpi4py import MPI\n"
            "if MPI.COMM_WORLD.rank == 1: os.kill(os.getpid(), signal.SIGSEGV)\n"
            "MPI.COMM_WORLD.Barrier()\n")
    ok, text = _cuda.probe_transfer(code=code, timeout=LIMIT)
    assert ok is False and "crashed (SIGSEGV)" in text, text


def test_hang_is_no_and_leaves_no_process(before_mpi_init, tmp_path):
    """A job that never answers is killed at the timeout, ranks included."""
    mark = tmp_path / "pids"
    code = (f"import os, time\nopen({str(mark)!r} + str(os.getpid()), 'w').close()\n"
            "time.sleep(300)\n")
    ok, text = _cuda.probe_transfer(code=code, timeout=5)
    assert ok is False and "hung (no answer in 5 s)" in text, text
    pids = [int(p.name[len("pids"):]) for p in tmp_path.iterdir()]
    assert pids, "the ranks never started"
    for pid in pids:
        for _ in range(50):
            if not os.path.exists(f"/proc/{pid}") or _zombie(pid):
                break
            import time
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid), f"rank process {pid} left running"


def _zombie(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
