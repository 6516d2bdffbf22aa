"""CUDA-aware MPI detection: explicit settings first, then the MPI library's report, then staging.

Plain unit tests (no messages); they run the same at any number of ranks.
The library's query functions are exercised through test doubles of the
loaded library, and the real probe runs on whatever MPI this process uses.
The decision starts no process; the probe job runs only before MPI_Init (its
runs: tests/launch/test_launch_probe.py).
"""

from __future__ import annotations

import ctypes
import os
import re
from pathlib import Path

import pytest
from support import util

import mpicoll
from mpicoll.backends import cuda as _cuda
from mpicoll.core import config as _config

# no messages: the same at any rank count (the local group)
pytestmark = pytest.mark.local

FAKECUPY = Path(__file__).resolve().parents[1] / "support" / "fakecupy"  # an importable cupy


class FakeLib:
    """A loaded library: C functions as attributes, AttributeError for missing symbols."""

    def __init__(self, **functions):
        for name, fn in functions.items():
            setattr(self, name, fn)


def query_cuda(value):
    def MPIX_Query_cuda_support():
        return value
    return MPIX_Query_cuda_support


def gpu_query(flag, rc=0, calls=None):
    def MPIX_GPU_query_support(gpu_type, ptr):
        if calls is not None:
            calls.append(gpu_type)
        ptr.contents.value = flag
        return rc
    return MPIX_GPU_query_support


@pytest.fixture
def clean(monkeypatch):
    """No explicit setting from the environment or configure(); a forced yes not refused for
    the UCX this process loaded (the refusal's own tests set what it sees: ucx_sees)."""
    monkeypatch.setattr(_cuda, "_ucx_without_cuda", lambda: None)
    env = util.env_options(monkeypatch)  # (read again at once, as a new communicator would)
    env.delenv("MPICOLL_CUDA_AWARE", raising=False)
    previous = mpicoll.configure(cuda_aware=None)
    yield env
    mpicoll.configure(**previous)
    monkeypatch.undo()
    _config.read_environment()


@pytest.mark.parametrize("value, expected", [("1", True), ("yes", True), ("0", False), ("off", False)])
def test_environment_forces(clean, value, expected):
    clean.setenv("MPICOLL_CUDA_AWARE", value)
    aware, reason = mpicoll.cuda_aware_mpi()
    assert aware is expected
    assert reason == f"forced by MPICOLL_CUDA_AWARE={value}"


def test_environment_bad_value(clean):
    clean.setenv("MPICOLL_CUDA_AWARE", "maybe")
    with pytest.raises(ValueError, match="MPICOLL_CUDA_AWARE"):
        mpicoll.cuda_aware_mpi()


def test_configure_wins_over_environment(clean):
    clean.setenv("MPICOLL_CUDA_AWARE", "1")
    with mpicoll.options(cuda_aware=False):
        assert mpicoll.cuda_aware_mpi() == (False, "forced by mpicoll.configure(cuda_aware=False)")
    assert mpicoll.cuda_aware_mpi().aware is True


def test_argument_wins_over_everything(clean):
    clean.setenv("MPICOLL_CUDA_AWARE", "0")
    with mpicoll.options(cuda_aware=False):
        assert mpicoll.cuda_aware_mpi(True) == (True, "forced by the argument cuda_aware=True")
    with pytest.raises(TypeError, match="cuda_aware: expected a bool"):
        mpicoll.cuda_aware_mpi(1)


def test_open_mpi_query_yes():
    lib = FakeLib(MPIX_Query_cuda_support=query_cuda(1))
    aware, reason = _cuda.probe([("/x/libmpi.so.40", lib)], "Open MPI 5.0.3", {})
    assert aware
    assert "MPIX_Query_cuda_support() returned 1 in /x/libmpi.so.40" in reason


def test_open_mpi_query_no_names_the_switch():
    lib = FakeLib(MPIX_Query_cuda_support=query_cuda(0))
    aware, reason = _cuda.probe([("/x/libmpi.so.40", lib)], "Open MPI 5.0.3", {})
    assert not aware
    assert "OMPI_MCA_opal_cuda_support=true" in reason and "staging" in reason


def test_conda_open_mpi(tmp_path):
    (tmp_path / "conda-meta").mkdir()
    (tmp_path / "lib").mkdir()
    path = str(tmp_path / "lib" / "libmpi.so.40")
    lib = FakeLib(MPIX_Query_cuda_support=query_cuda(0))
    aware, reason = _cuda.probe([(path, lib)], "Open MPI 4.1.6", {})
    assert not aware
    assert "conda" in reason and "OMPI_MCA_opal_cuda_support=true" in reason and "not set" in reason
    aware, reason = _cuda.probe([(path, lib)], "Open MPI 4.1.6",
                                {"OMPI_MCA_opal_cuda_support": "true"})
    assert not aware and "is set" in reason


def test_mpich_gpu_query_preferred():
    calls = []
    lib = FakeLib(MPIX_GPU_query_support=gpu_query(1, calls=calls),
                  MPIX_Query_cuda_support=query_cuda(0))
    aware, reason = _cuda.probe([("libmpi.so.12", lib)], "MPICH 4.2.0", {})
    assert aware and calls == [_cuda.MPIX_GPU_SUPPORT_CUDA]
    assert "MPIX_GPU_query_support(CUDA) set 1" in reason


def test_mpich_gpu_query_error_falls_back():
    lib = FakeLib(MPIX_GPU_query_support=gpu_query(1, rc=17),
                  MPIX_Query_cuda_support=query_cuda(0))
    aware, reason = _cuda.probe([("libmpi.so.12", lib)], "MPICH 4.2.0", {})
    assert not aware and "MPIX_Query_cuda_support() returned 0" in reason
    assert "MPICH_GPU_SUPPORT_ENABLED" in reason


def test_no_query_function_means_staging():
    aware, reason = _cuda.probe([("libmpi.so", FakeLib())], "Intel MPI 2021.10", {})
    assert not aware
    assert "exports neither" in reason and "staging" in reason


def test_first_library_that_answers():
    libs = [("libmpi_abi.so", FakeLib()), ("libmpi.so.12", FakeLib(MPIX_Query_cuda_support=query_cuda(1)))]
    assert _cuda.probe(libs, "MPICH 4.3", {}).aware


def test_no_library_means_staging():
    aware, reason = _cuda.probe([], "Open MPI 5.0.3", {})
    assert not aware and "no MPI library" in reason


def test_default_is_probed_once_per_process(clean):
    _cuda._probe_this_process.cache_clear()
    first = mpicoll.cuda_aware_mpi()
    info = _cuda._probe_this_process.cache_info()
    second = mpicoll.cuda_aware_mpi()
    assert first == second
    assert _cuda._probe_this_process.cache_info().hits == info.hits + 1
    assert first.reason


def test_this_process_mpi_library_is_found():
    """mpi4py's libmpi is mapped in this process and found by name."""
    paths = _cuda._mapped_mpi_paths()
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("no /proc/self/maps on this system")
    assert paths, "no libmpi* in /proc/self/maps"
    libs = _cuda._loaded_mpi_libraries()
    assert libs and all(isinstance(lib, ctypes.CDLL) for _, lib in libs)


def test_this_process_decision_is_explained(clean):
    aware, reason = mpicoll.cuda_aware_mpi()
    assert isinstance(aware, bool)
    if not aware:
        assert "staging" in reason
    assert any(f in reason for f in ("MPIX_GPU_query_support", "MPIX_Query_cuda_support",
                                     "exports neither", "no MPI library"))


def test_maps_parsing(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /opt/mpi/lib/libmpi.so.40.30.0\n"
        "7f01-7f02 r--p 00001000 08:01 1 /opt/mpi/lib/libmpi.so.40.30.0\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/libmpich.so.12\n"
        "7f03-7f04 r-xp 00000000 08:01 3 /usr/lib/libmpfr.so.6\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n"
        "7f05-7f06 r-xp 00000000 08:01 4 /tmp/libmpi_dir/other.so\n"
    )
    assert _cuda._mapped_mpi_paths(str(maps)) == ["/opt/mpi/lib/libmpi.so.40.30.0",
                                                  "/usr/lib/libmpich.so.12"]
    assert _cuda._mapped_mpi_paths(str(tmp_path / "missing")) == []


# -- Open MPI's "yes" checked against its other evidence ---------------------------------

UCX_NO_CUDA = ("/opt/ompi/lib/libmpi.so.40", "/opt/ucx/lib/libucp.so.0", "/opt/ucx/lib/libuct.so.0",
               "/opt/ucx/lib/ucx/libuct_ib.so.0")
UCX_CUDA = UCX_NO_CUDA + ("/opt/ucx/lib/ucx/libuct_cuda.so.0",)


def _open_mpi_yes(evidence, environ=None):
    lib = FakeLib(MPIX_Query_cuda_support=query_cuda(1))
    return _cuda.probe([("/opt/ompi/lib/libmpi.so.40", lib)], "Open MPI 5.0.5", environ or {}, evidence)


def test_open_mpi_yes_without_ucx_cuda_transport_is_no():
    """The accelerator component says 1, but UCX loaded no CUDA transport: staging (a false yes)."""
    aware, reason = _open_mpi_yes(_cuda.Evidence(built_with_cuda=True, mapped=UCX_NO_CUDA))
    assert not aware
    assert "no libuct_cuda" in reason and "MPIX_Query_cuda_support() returned 1" in reason


def test_open_mpi_yes_but_built_without_cuda_is_no():
    aware, reason = _open_mpi_yes(_cuda.Evidence(built_with_cuda=False, mapped=UCX_CUDA))
    assert not aware and "mpi_built_with_cuda_support=false" in reason


def test_open_mpi_yes_with_ucx_tls_without_cuda_is_no():
    aware, reason = _open_mpi_yes(_cuda.Evidence(True, UCX_CUDA), {"UCX_TLS": "rc,sm,self"})
    assert not aware and "UCX_TLS=rc,sm,self" in reason


def test_open_mpi_yes_with_evidence_is_yes_and_says_why():
    aware, reason = _open_mpi_yes(_cuda.Evidence(True, UCX_CUDA), {"UCX_TLS": "rc,cuda_copy,cuda_ipc"})
    assert aware
    assert "mpi_built_with_cuda_support=true" in reason and "libuct_cuda" in reason


def test_open_mpi_yes_without_ucx_is_yes():
    """ob1 with the smcuda BTL (no UCX loaded): the query and the build decide."""
    aware, reason = _open_mpi_yes(_cuda.Evidence(True, ("/opt/ompi/lib/libmpi.so.40",)))
    assert aware and "mpi_built_with_cuda_support=true" in reason


def test_this_process_evidence_is_gathered():
    """The evidence of this process: its mapped objects include the MPI library; Open MPI's
    build, read from its MPI_T variable (not ompi_info, a process), is a bool."""
    from mpi4py import MPI

    libs = _cuda._loaded_mpi_libraries()
    level = MPI.Query_thread()
    ev = _cuda._evidence(libs)
    # (Open MPI takes MPI_T's thread level as the process's: asking at a lower one turned
    # its thread safety off, MPI_THREAD_MULTIPLE became MPI_THREAD_SINGLE)
    assert MPI.Query_thread() == level
    if os.path.exists("/proc/self/maps"):
        assert any(os.path.basename(p).startswith("libmpi") for p in ev.mapped)
    if MPI.get_vendor()[0] == "Open MPI":
        assert isinstance(ev.built_with_cuda, bool)
    else:
        assert ev.built_with_cuda in (None, False, True)


def test_open_mpi_build_read_from_mpi_t_as_ompi_info_says():
    """Open MPI's MPI_T variable gives what ompi_info prints (the PyPI wheel: false); an MPI
    without the variable (MPICH) gives None."""
    import shutil
    import subprocess

    from mpi4py import MPI

    libs = _cuda._loaded_mpi_libraries()
    if MPI.get_vendor()[0] != "Open MPI":
        assert all(_cuda._mpit_flag(lib, ("mpi_built_with_cuda_support",)) is None
                   for _, lib in libs)
        return
    prefix_bin = os.path.join(os.path.dirname(os.path.dirname(libs[0][0])), "bin")
    tool = shutil.which("ompi_info", path=prefix_bin) or shutil.which("ompi_info")
    if tool is None:
        pytest.skip("no ompi_info beside this Open MPI to compare with")
    out = subprocess.run([tool, "--parsable", "--all", "--level", "9"], capture_output=True,
                         text=True, timeout=120).stdout
    said = [line.endswith(":true") for line in out.splitlines()
            if re.search(r":(mpi|opal)_built_with_cuda_support:value:(true|false)$", line)]
    assert said and _cuda._evidence(libs).built_with_cuda is said[0]


# -- no process inside a job ------------------------------------------------------------

def _no_processes(monkeypatch) -> list:
    """Make every way of starting a process fail the test; the list of attempts."""
    import subprocess

    started = []

    def refuse(*args, **kwargs):
        started.append(args[:1])
        raise AssertionError(f"a process was started: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)
    return started


@pytest.mark.parametrize("answer", [1, 0], ids=["yes", "no"])
def test_the_decision_inside_a_job_starts_no_process(clean, monkeypatch, tmp_path, answer):
    """The in-job decision reads this process only: an Open MPI yes is weighed without
    ompi_info (a process), and a no beside UCX's CUDA transports starts no probe child,
    though an ompi_info sits beside the library and CuPy is importable."""
    from mpi4py import MPI

    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    tool = tmp_path / "bin" / "ompi_info"
    tool.write_text("#!/bin/sh\necho mca:mpi:base:param:mpi_built_with_cuda_support:value:true\n")
    tool.chmod(0o755)
    monkeypatch.syspath_prepend(str(FAKECUPY))
    lib = FakeLib(MPIX_Query_cuda_support=query_cuda(answer))
    path = str(tmp_path / "lib" / "libmpi.so.40")
    monkeypatch.setattr(_cuda, "_loaded_mpi_libraries", lambda: [(path, lib)])
    monkeypatch.setattr(_cuda, "_mapped_paths", lambda maps=None: list(UCX_CUDA))
    monkeypatch.setattr(MPI, "get_vendor", lambda: ("Open MPI", (5, 0, 11)))
    _cuda._probe_this_process.cache_clear()
    started = _no_processes(monkeypatch)
    try:
        aware, reason = mpicoll.cuda_aware_mpi()
    finally:
        _cuda._probe_this_process.cache_clear()
    assert not started
    if answer:
        assert aware and "libuct_cuda" in reason, reason
    else:
        assert not aware and "python -m mpicoll.info --probe" in reason, reason


def test_the_probe_is_not_run_after_mpi_init(monkeypatch):
    """This pytest process initialised MPI: the probe job is not started, and says why."""
    started = _no_processes(monkeypatch)
    ok, text = _cuda.probe_transfer()
    assert ok is None and not started
    assert text.startswith("MPI is initialised in this process, and no process is started")


def test_the_probe_job_command(monkeypatch, tmp_path):
    """Two ranks of this Python under the launcher beside it (Open MPI's oversubscribing),
    the launcher variables of this process's job removed, the MPI settings kept."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python, launcher = bin_dir / "python", bin_dir / "mpiexec"
    for f in (python, launcher):
        f.write_text("#!/bin/sh\n")
        f.chmod(0o755)
    environ = {"PATH": "/nowhere", "OMPI_MCA_pml": "ucx", "UCX_TLS": "self,sm,cuda_copy",
               "MPIR_CVAR_NOLOCAL": "1", "LD_LIBRARY_PATH": "/opt/ucx/lib",
               "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_COMM_WORLD_RANK": "0", "PMIX_RANK": "0",
               "PMI_FD": "9", "HYDI_CONTROL_FD": "7", "PRTE_LAUNCHED": "1", "MPI_LOCALNRANKS": "4"}
    argv, env = _cuda.probe_job(str(python), "print('ok')", environ=environ)
    assert argv == [str(launcher), "-n", "2", str(python), "-c", "print('ok')"]
    assert env == {k: environ[k] for k in ("PATH", "OMPI_MCA_pml", "UCX_TLS", "MPIR_CVAR_NOLOCAL",
                                           "LD_LIBRARY_PATH", "OMPI_ALLOW_RUN_AS_ROOT")}
    (bin_dir / "ompi_info").write_text("")  # Open MPI's: more ranks than the slots it counts
    argv, _ = _cuda.probe_job(str(python), "print('ok')", environ=environ)
    assert argv[:4] == [str(launcher), "--oversubscribe", "-n", "2"]
    launcher.unlink()
    assert _cuda.probe_job(str(python), "x", environ=environ) == (None, None)
    monkeypatch.setattr(_cuda, "_mpi_initialized", lambda: False)
    monkeypatch.setattr(_cuda, "find_launcher", lambda python, environ: None)
    started = _no_processes(monkeypatch)
    ok, text = _cuda.probe_transfer(str(python))
    assert ok is False and "no mpiexec beside" in text and not started


class _Job:
    """A stand-in for the probe job's launcher process: ``subprocess.Popen`` returns it; its
    exit status and output, or a hang until the job's process group is killed."""

    pid = 4242

    def __init__(self, rc=0, out="", err="", hang=False):
        self.rc, self.out, self.err, self.hang = rc, out, err, hang
        self.killed, self.argv, self.kwargs, self.returncode = [], None, None, None

    def __call__(self, argv, **kwargs):
        self.argv, self.kwargs = argv, kwargs
        return self

    def communicate(self, timeout=None):
        import subprocess

        if self.hang and not self.killed:
            raise subprocess.TimeoutExpired(self.argv, timeout)
        self.returncode = -9 if self.killed else self.rc
        return self.out, self.err


@pytest.fixture
def job(monkeypatch):
    """``job(**answer)``: run probe_transfer as before MPI_Init, its launcher a :class:`_Job`."""
    import subprocess

    def run(**answer):
        child = _Job(**answer)
        monkeypatch.setattr(_cuda, "_mpi_initialized", lambda: False)
        monkeypatch.setattr(_cuda, "find_launcher", lambda python, environ: "/opt/mpi/bin/mpiexec")
        monkeypatch.setattr(subprocess, "Popen", child)
        monkeypatch.setattr(os, "killpg", lambda pid, sig: child.killed.append((pid, sig)))
        return child, _cuda.probe_transfer(timeout=1)
    return run


@pytest.mark.parametrize("rc, err", [
    (139, "[vm:1] *** Process received signal ***\n---\nprterun noticed that process rank 1 with "
          "PID 7 on node vm exited on\nsignal 11 (Segmentation fault).\n---"),
    (11, "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Segmentation fault (signal 11)"),
], ids=["open-mpi", "mpich"])
def test_probe_transfer_crash_is_no(job, rc, err):
    """A rank that read a device pointer as host memory: the signal named, as either
    launcher reports it."""
    _, (ok, text) = job(rc=rc, err=err)
    assert ok is False and "crashed (SIGSEGV): MPI cannot read device memory" in text, text


def test_probe_transfer_wrong_data_is_no(job):
    _, (ok, text) = job(rc=1, out="wrong data: a device buffer arrived changed (64 KiB or 8 MiB)\n",
                        err="-" * 40 + "\nprterun detected that one or more processes exited\n"
                            + "-" * 40 + "\n")
    assert ok is False and "failed (exit 1): wrong data: a device buffer arrived changed" in text


def test_probe_transfer_rank_error_is_named(job):
    """MPI's own error in a rank (MPICH's cross-process copy of an unreadable buffer): the
    rank's line, not the launcher's report after it."""
    _, (ok, text) = job(rc=1, err="rank 1: Exception: Other MPI error, error stack:\n"
                                  "copy_iovs(224): process_vm_readv failed (errno 14)\n"
                                  "Abort(1) on node 1 (rank 1 in comm 0): application called "
                                  "MPI_Abort(MPI_COMM_WORLD, 1) - process 1\n")
    assert ok is False and text.endswith("failed (exit 1): rank 1: Exception: Other MPI error, "
                                         "error stack:"), text


def test_probe_transfer_hang_is_no(job):
    """No answer in the timeout: the launcher's whole process group is ended."""
    child, (ok, text) = job(hang=True)
    assert ok is False and "hung (no answer in 1 s)" in text
    assert child.killed and child.killed[0][0] == _Job.pid


def test_probe_transfer_pass_is_yes(job):
    child, (ok, text) = job(rc=0, out="ok\n")
    assert ok is True and "passed: a device buffer went from rank 0 to rank 1 intact" in text
    assert child.argv[0] == "/opt/mpi/bin/mpiexec" and child.kwargs["start_new_session"]


def test_probe_transfer_child_keeps_mpi_settings_not_launcher_variables(job, monkeypatch):
    """The job runs on the transport this process was configured for (a CUDA-aware UCX
    route is only OMPI_MCA_*/UCX_* settings), two ranks, and joins no job of this one."""
    settings = {"OMPI_MCA_pml": "ucx", "OMPI_MCA_btl": "^uct,ofi", "UCX_TLS": "self,sm,cuda_copy",
                "MPIR_CVAR_NOLOCAL": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1"}
    launcher = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_FILE_LOCATION": "/tmp/x", "PMIX_RANK": "3",
                "PRTE_LAUNCHED": "1", "PMI_RANK": "3", "PMI_FD": "9", "HYDI_CONTROL_FD": "7",
                "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}
    for name, value in {**settings, **launcher}.items():
        monkeypatch.setenv(name, value)
    child, (ok, _) = job(rc=0, out="ok\n")
    env = child.kwargs["env"]
    assert ok and {k: env.get(k) for k in settings} == settings
    assert not [k for k in launcher if k in env]
    assert child.argv[child.argv.index("-n"):child.argv.index("-n") + 2] == ["-n", "2"]


@pytest.mark.parametrize("argv, runs", [
    (["python", "-m", "mpicoll.info", "--probe"], True),
    (["python3", "-X", "dev", "-W", "error", "-m", "mpicoll.info", "--require-cuda-aware", "--probe"], True),
    (["python", "-mmpicoll.info", "--probe"], True),
    (["python", "-m", "mpicoll.tools.info", "--probe"], True),
    (["python", "-m", "mpicoll.info"], False),
    (["python", "-m", "mpicoll.info", "--probe", "--help"], False),
    (["python", "-m", "mpicoll.bench", "--probe"], False),
    (["python", "script.py", "-m", "mpicoll.info", "--probe"], False),
    (["python", "-c", "import mpicoll", "-m", "mpicoll.info", "--probe"], False),
    (["python", "-m", "pytest", "tests/gpu/test_gpu_info.py"], False),
])
def test_which_command_probes_before_mpi_init(argv, runs):
    assert _cuda._runs_info_probe(argv) is runs


def test_probe_first_leaves_a_started_mpi_alone(monkeypatch):
    """Importing mpicoll in any other program, or once MPI is up, starts nothing."""
    started = _no_processes(monkeypatch)
    _cuda.probe_first(["python", "-m", "mpicoll.info", "--probe"])  # (mpi4py.MPI is imported)
    _cuda.probe_first(["python", "-m", "pytest"])
    assert not started and _cuda.early_probe() is None


# -- a forced yes refused where the UCX transport cannot carry device memory ----------------

_UCX_CHECK = _cuda._ucx_without_cuda


@pytest.fixture
def ucx_sees(monkeypatch):
    """``see(mapped, tls)``: the forced-yes check reads ``mapped`` (and ``UCX_TLS``) as this
    process's, afresh."""
    def see(mapped, tls=None):
        monkeypatch.setattr(_cuda, "_ucx_without_cuda", _UCX_CHECK)
        monkeypatch.setattr(_cuda, "_UCX_HERE", [])
        monkeypatch.setattr(_cuda, "_mapped_paths", lambda maps=None: list(mapped))
        if tls is None:
            monkeypatch.delenv("UCX_TLS", raising=False)
        else:
            monkeypatch.setenv("UCX_TLS", tls)
    return see


@pytest.mark.parametrize("how", ["argument", "configure", "environment"])
def test_forced_yes_without_ucx_cuda_transport_is_refused(clean, ucx_sees, how):
    """MPI would read device pointers as host memory: refused, naming the setting and what
    is missing; forbidding is never refused."""
    ucx_sees(UCX_NO_CUDA)
    setting = {"argument": r"the argument cuda_aware=True",
               "configure": r"mpicoll\.configure\(cuda_aware=True\)",
               "environment": r"MPICOLL_CUDA_AWARE=1"}[how]
    if how == "environment":
        clean.setenv("MPICOLL_CUDA_AWARE", "1")
    with mpicoll.options(cuda_aware=True if how == "configure" else None):
        with pytest.raises(ValueError, match=setting + r": expected an MPI that can read device "
                           r"memory, but the UCX transport loaded no CUDA transport \(no libuct_cuda"):
            mpicoll.cuda_aware_mpi(True if how == "argument" else None)
        assert mpicoll.cuda_aware_mpi(False).aware is False


def test_forced_yes_with_ucx_tls_without_cuda_is_refused(clean, ucx_sees):
    ucx_sees(UCX_CUDA, "rc,sm,self")
    with pytest.raises(ValueError, match="limited to UCX_TLS=rc,sm,self"):
        mpicoll.cuda_aware_mpi(True)


@pytest.mark.parametrize("mapped", [UCX_CUDA, ("/opt/mpich/lib/libmpi.so.12",)],
                         ids=["ucx-cuda", "no-ucx"])
def test_forced_yes_where_ucx_can_or_is_absent(clean, ucx_sees, mapped):
    ucx_sees(mapped, "self,sm,cuda_copy,cuda_ipc")
    assert mpicoll.cuda_aware_mpi(True) == (True, "forced by the argument cuda_aware=True")


def test_the_ucx_check_is_read_once_mpi_is_up(monkeypatch, ucx_sees):
    """Not /proc/self/maps at every collective: once MPI is initialised the answer is kept."""
    ucx_sees(UCX_NO_CUDA)
    reads = util.spy(monkeypatch, _cuda, ["_mapped_paths"])
    first = _cuda._ucx_without_cuda()
    assert first and "no libuct_cuda" in first
    assert _cuda._ucx_without_cuda() == first and reads == ["_mapped_paths"]


# -- a no beside UCX's CUDA transports: staged, and the reason says how to test and use them --

def _open_mpi_no(mapped=UCX_CUDA, environ=None):
    lib = FakeLib(MPIX_Query_cuda_support=query_cuda(0))
    return _cuda.probe([("/opt/ompi/lib/libmpi.so.40", lib)], "Open MPI 5.0.11", environ or {},
                       mapped=mapped)


def test_query_no_but_ucx_cuda_says_how_to_test_and_use_it():
    """The PyPI Open MPI with a UCX that has CUDA transports: 0 from the query; staged, and
    the reason names the probe job and the switch."""
    aware, reason = _open_mpi_no(environ={"UCX_TLS": "self,sm,cuda_copy,cuda_ipc"})
    assert not aware
    assert "MPIX_Query_cuda_support() returned 0" in reason and "libuct_cuda" in reason
    assert "python -m mpicoll.info --probe" in reason and "MPICOLL_CUDA_AWARE=1" in reason
    assert reason.endswith("staging through host memory")


@pytest.mark.parametrize("mapped, environ", [
    (UCX_NO_CUDA, {}),                                # UCX without its CUDA transports
    (UCX_CUDA, {"UCX_TLS": "self,sm"}),               # transports listed without CUDA
    (UCX_CUDA, {"UCX_TLS": "^cuda_copy"}),            # CUDA copies excluded
    (("/opt/ompi/lib/libmpi.so.40",), {}),            # no UCX at all (ob1)
])
def test_query_no_without_usable_ucx_cuda_names_the_build_switch(mapped, environ):
    aware, reason = _open_mpi_no(mapped, environ)
    assert not aware and "--probe" not in reason
    assert reason.startswith("Open MPI 5.0.11 reports no CUDA support") and "staging" in reason
    assert "OMPI_MCA_opal_cuda_support" in reason


def test_mpich_query_no_ucx_cuda_says_how_to_test():
    """The PyPI MPICH (ch4:ucx) with the same UCX: the GPU query sets 0."""
    lib = FakeLib(MPIX_GPU_query_support=gpu_query(0))
    aware, reason = _cuda.probe([("libmpi.so.12", lib)], "MPICH 5.0.2", {"UCX_TLS": "^cuda_ipc"},
                                mapped=UCX_CUDA)
    assert not aware and "MPIX_GPU_query_support(CUDA) set 0" in reason and "--probe" in reason


def test_no_query_function_ucx_cuda_says_how_to_test():
    aware, reason = _cuda.probe([("libmpi.so", FakeLib())], "Some MPI 1.0", {}, mapped=UCX_CUDA)
    assert not aware and "exports neither" in reason and "--probe" in reason


def test_query_yes_is_weighed_not_probed():
    """A yes with UCX's CUDA transports: believed on the evidence, no hint to probe."""
    lib = FakeLib(MPIX_Query_cuda_support=query_cuda(1))
    aware, reason = _cuda.probe([("/opt/ompi/lib/libmpi.so.40", lib)], "Open MPI 5.0.5", {},
                                _cuda.Evidence(True, UCX_CUDA), mapped=UCX_CUDA)
    assert aware and "--probe" not in reason


@pytest.mark.parametrize("tls, usable", [
    ("", True), ("all", True), ("self,sm,cuda_copy,cuda_ipc", True), ("rc,cuda", True),
    ("^cuda_ipc", True), ("self,sm", False), ("^cuda_copy", False), ("^cuda,tcp", False),
])
def test_ucx_tls_reading(tls, usable):
    why = _cuda.ucx_cuda_transports(UCX_CUDA, {"UCX_TLS": tls} if tls else {})
    assert (why is None) is usable, why


def test_ucx_report_line():
    assert _cuda.ucx_report(("/opt/ompi/lib/libmpi.so.40",), {}) == "not loaded in this process"
    line = _cuda.ucx_report(UCX_CUDA, {"UCX_TLS": "self,cuda_copy"})
    assert "/opt/ucx/lib/libucp.so.0" in line and "CUDA transports loaded" in line
    assert line.endswith("UCX_TLS=self,cuda_copy") and line.startswith("version unknown")
    assert "no libuct_cuda" in _cuda.ucx_report(UCX_NO_CUDA, {})


def test_this_process_ucx_version():
    """Where this process's MPI loaded UCX (the PyPI Open MPI does), its version is read."""
    mapped = _cuda._mapped_paths()
    ucp = next((p for p in mapped if os.path.basename(p).startswith("libucp")), None)
    if ucp is None:
        pytest.skip("no UCX loaded by this MPI")
    version = _cuda._ucx_version(ucp)
    assert version and version.count(".") == 2 and version.split(".")[0] == "1"
