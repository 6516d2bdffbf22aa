"""CUDA-aware MPI detection: explicit settings first, then the MPI library's report, then staging.

Plain unit tests (no messages); they run the same at any number of ranks.
The library's query functions are exercised through test doubles of the
loaded library, and the real probe runs on whatever MPI this process uses.
"""

from __future__ import annotations

import ctypes
import os

import pytest
from support import util

import mpicoll
from mpicoll.backends import cuda as _cuda
from mpicoll.core import config as _config

# no messages: the same at any rank count (the local group)
pytestmark = pytest.mark.local


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
    """No explicit setting from the environment or configure()."""
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
    assert not aware and "mpi_built_with_cuda_support:false" in reason


def test_open_mpi_yes_with_ucx_tls_without_cuda_is_no():
    aware, reason = _open_mpi_yes(_cuda.Evidence(True, UCX_CUDA), {"UCX_TLS": "rc,sm,self"})
    assert not aware and "UCX_TLS=rc,sm,self" in reason


def test_open_mpi_yes_with_evidence_is_yes_and_says_why():
    aware, reason = _open_mpi_yes(_cuda.Evidence(True, UCX_CUDA), {"UCX_TLS": "rc,cuda_copy,cuda_ipc"})
    assert aware
    assert "mpi_built_with_cuda_support:true" in reason and "libuct_cuda" in reason


def test_open_mpi_yes_without_ucx_is_yes():
    """ob1 with the smcuda BTL (no UCX loaded): the query and the build decide."""
    aware, reason = _open_mpi_yes(_cuda.Evidence(True, ("/opt/ompi/lib/libmpi.so.40",)))
    assert aware and "mpi_built_with_cuda_support:true" in reason


def test_this_process_evidence_is_gathered():
    """The evidence of this process: its mapped objects include the MPI library."""
    libs = _cuda._loaded_mpi_libraries()
    ev = _cuda._evidence(libs)
    if os.path.exists("/proc/self/maps"):
        assert any(os.path.basename(p).startswith("libmpi") for p in ev.mapped)
    assert ev.built_with_cuda in (None, False, True)


# -- the opt-in device Sendrecv probe (child process) --------------------------------------

def test_probe_transfer_crash_is_no():
    ok, text = _cuda.probe_transfer(code="import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert not ok and "crashed (SIGSEGV)" in text


def test_probe_transfer_wrong_data_is_no():
    ok, text = _cuda.probe_transfer(code="raise SystemExit('wrong data')")
    assert not ok and "failed (exit 1): wrong data" in text


def test_probe_transfer_hang_is_no():
    ok, text = _cuda.probe_transfer(code="import time; time.sleep(30)", timeout=1)
    assert not ok and "hung" in text


def test_probe_transfer_fake_device_sendrecv_passes():
    """The child's MPI Sendrecv of a CUDA-array-interface buffer (fake GPU: host memory)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = (
        f"import sys; sys.path[:0] = [{tests!r}, {os.path.dirname(tests)!r}]\n"
        "import numpy as np\n"
        "from support import fakegpu\n"
        "from mpi4py import MPI\n"
        "rt = fakegpu.FakeRuntime()\n"
        "a = rt.xp.asarray(np.arange(1000.0)); b = rt.xp.asarray(np.zeros(1000))\n"
        "MPI.COMM_SELF.Sendrecv([a, MPI.DOUBLE], 0, 7, [b, MPI.DOUBLE], 0, 7)\n"
        "assert np.array_equal(b.get(), np.arange(1000.0))\n"
        "print('ok')\n"
    )
    ok, text = _cuda.probe_transfer(code=code, timeout=120)
    assert ok, text


def test_probe_transfer_child_keeps_mpi_settings_not_launcher_variables(monkeypatch):
    """The child runs on the transport its parent was configured for (a CUDA-aware UCX
    route is only OMPI_MCA_*/UCX_* settings), and is no rank of the parent's job."""
    settings = {"OMPI_MCA_pml": "ucx", "OMPI_MCA_btl": "^uct,ofi", "UCX_TLS": "self,sm,cuda_copy",
                "MPIR_CVAR_NOLOCAL": "1", "OMPI_ALLOW_RUN_AS_ROOT": "1"}
    launcher = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_FILE_LOCATION": "/tmp/x", "PMIX_RANK": "3",
                "PRTE_LAUNCHED": "1", "PMI_RANK": "3", "PMI_FD": "9", "HYDI_CONTROL_FD": "7",
                "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"}
    for name, value in {**settings, **launcher}.items():
        monkeypatch.setenv(name, value)
    code = (f"import os\nsettings, launcher = {settings!r}, {sorted(launcher)!r}\n"
            "got = {k: os.environ.get(k) for k in settings}\n"
            "assert got == settings, got\n"
            "left = [k for k in launcher if k in os.environ]\n"
            "assert not left, left\n"
            "print('ok')\n")
    ok, text = _cuda.probe_transfer(code=code)
    assert ok, text


# -- step 3: the library says no, UCX's CUDA transports are loaded: a device transfer decides --

class Transfer:
    """A probe_transfer double: its answer, and how often it was asked."""

    def __init__(self, ok, text):
        self.answer, self.calls = (ok, text), 0

    def __call__(self):
        self.calls += 1
        return self.answer


PASSED = "the device Sendrecv probe passed (a device buffer through MPI_COMM_SELF)"


def _open_mpi_no(transfer, mapped=UCX_CUDA, environ=None):
    lib = FakeLib(MPIX_Query_cuda_support=query_cuda(0))
    return _cuda.probe([("/opt/ompi/lib/libmpi.so.40", lib)], "Open MPI 5.0.11", environ or {},
                       transfer=transfer, mapped=mapped)


def test_query_no_but_ucx_cuda_and_transfer_passes_is_yes():
    """The PyPI Open MPI with a UCX that has CUDA transports: 0 from the query, the probe decides."""
    transfer = Transfer(True, PASSED)
    aware, reason = _open_mpi_no(transfer, environ={"UCX_TLS": "self,sm,cuda_copy,cuda_ipc"})
    assert aware and transfer.calls == 1
    assert "MPIX_Query_cuda_support() returned 0" in reason
    assert "libuct_cuda" in reason and "probe passed" in reason and "staging" not in reason


def test_query_no_ucx_cuda_transfer_fails_is_no_with_both_reasons():
    transfer = Transfer(False, "the device Sendrecv probe crashed (SIGSEGV): MPI cannot read device memory")
    aware, reason = _open_mpi_no(transfer)
    assert not aware and transfer.calls == 1
    assert "returned 0" in reason and "crashed (SIGSEGV)" in reason and "staging" in reason


@pytest.mark.parametrize("mapped, environ", [
    (UCX_NO_CUDA, {}),                                # UCX without its CUDA transports
    (UCX_CUDA, {"UCX_TLS": "self,sm"}),               # transports listed without CUDA
    (UCX_CUDA, {"UCX_TLS": "^cuda_copy"}),            # CUDA copies excluded
    (("/opt/ompi/lib/libmpi.so.40",), {}),            # no UCX at all (ob1)
])
def test_query_no_without_usable_ucx_cuda_never_starts_the_probe(mapped, environ):
    transfer = Transfer(True, PASSED)
    aware, reason = _open_mpi_no(transfer, mapped, environ)
    assert not aware and transfer.calls == 0
    assert reason.startswith("Open MPI 5.0.11 reports no CUDA support") and "staging" in reason


def test_query_no_ucx_cuda_without_cupy_is_no():
    """transfer=None (CuPy not installed): nothing to probe with, the library's answer stands."""
    aware, reason = _open_mpi_no(None)
    assert not aware and "OMPI_MCA_opal_cuda_support" in reason


def test_mpich_query_no_ucx_cuda_transfer_passes_is_yes():
    """The PyPI MPICH (ch4:ucx) with the same UCX: the GPU query sets 0, the probe decides."""
    lib = FakeLib(MPIX_GPU_query_support=gpu_query(0))
    transfer = Transfer(True, PASSED)
    aware, reason = _cuda.probe([("libmpi.so.12", lib)], "MPICH 5.0.2", {"UCX_TLS": "^cuda_ipc"},
                                transfer=transfer, mapped=UCX_CUDA)
    assert aware and "MPIX_GPU_query_support(CUDA) set 0" in reason and transfer.calls == 1


def test_no_query_function_ucx_cuda_transfer_decides():
    transfer = Transfer(True, PASSED)
    aware, reason = _cuda.probe([("libmpi.so", FakeLib())], "Some MPI 1.0", {},
                                transfer=transfer, mapped=UCX_CUDA)
    assert aware and "exports neither" in reason and "probe passed" in reason


def test_query_yes_never_starts_the_probe():
    transfer = Transfer(False, "should not run")
    lib = FakeLib(MPIX_Query_cuda_support=query_cuda(1))
    aware, _ = _cuda.probe([("/opt/ompi/lib/libmpi.so.40", lib)], "Open MPI 5.0.5", {},
                           _cuda.Evidence(True, UCX_CUDA), transfer=transfer, mapped=UCX_CUDA)
    assert aware and transfer.calls == 0


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
