"""Is the MPI library CUDA-aware?  Decided once per process, with the reason.

A CUDA-aware MPI accepts device pointers in point-to-point calls, so mpicoll
hands CuPy buffers straight to it; any other MPI gets host copies (the
staging channel, see transport.staging).  The decision, in order:

1. an explicit setting: the ``cuda_aware`` argument of :func:`cuda_aware_mpi`,
   then ``mpicoll.configure(cuda_aware=...)`` / ``mpicoll.options(...)``,
   then the environment variable ``MPICOLL_CUDA_AWARE=1|0``;
2. what the MPI library in this process reports at run time: MPICH's
   ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``, else
   ``MPIX_Query_cuda_support()`` (Open MPI, MPICH), called through ctypes on
   the libmpi that mpi4py loaded, and only when the library exports it;
3. otherwise host staging, the safe default.

Open MPI's ``MPIX_Query_cuda_support()`` returns 1 when its CUDA accelerator
component is selected, even where the transport cannot touch device memory
(a UCX without its CUDA transports), and a wrong "yes" crashes.  So a "yes"
from Open MPI is checked against the evidence it offers (:class:`Evidence`):
its build information (``ompi_info``: ``mpi_built_with_cuda_support``) and,
when the UCX transport is loaded, whether UCX loaded its CUDA transports
(``libuct_cuda``) and whether ``UCX_TLS`` leaves them out.  The reason names
the evidence that decided.  :func:`probe_transfer` (``python -m mpicoll.info
--probe``) is the opt-in, direct test: one device ``Sendrecv`` in a child
process, so a crash there costs nothing.

Step 2 is probed once per process, on first use (never at import); step 1
is read at every call, so ``configure`` takes effect immediately.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import subprocess
import sys
from typing import NamedTuple

from ..core import config as _config

MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's enum value for CUDA (mpi.h)
MPI_SUCCESS = 0


class Decision(NamedTuple):
    """Whether device buffers go straight to MPI, and why."""

    aware: bool
    reason: str


def cuda_aware_mpi(cuda_aware: bool | None = None) -> Decision:
    """Decide whether MPI is CUDA-aware: ``(aware, reason)``.

    Args:
        cuda_aware: force the answer (True/False); None decides from
            ``mpicoll.configure(cuda_aware=...)``, then ``MPICOLL_CUDA_AWARE``,
            then the MPI library's own report, then False (host staging).

    Returns:
        A :class:`Decision` named tuple ``(aware, reason)``; ``reason`` says
        how it was decided, in words fit for ``python -m mpicoll.info``.

    Example::

        aware, why = mpicoll.cuda_aware_mpi()
        # (False, 'Open MPI 5.0.11 reports no CUDA support: ...')
    """
    if cuda_aware is not None:
        if not isinstance(cuda_aware, bool):
            raise TypeError(f"cuda_aware: expected a bool or None, got {type(cuda_aware).__name__}")
        return Decision(cuda_aware, f"forced by the argument cuda_aware={cuda_aware}")
    setting = _config.get("cuda_aware")
    if setting is not None:
        if _config.configured("cuda_aware"):
            how = f"mpicoll.configure(cuda_aware={setting})"
        else:
            how = f"MPICOLL_CUDA_AWARE={_config.text('cuda_aware')}"
        return Decision(setting, f"forced by {how}")
    return _probe_this_process()


class Evidence(NamedTuple):
    """What else Open MPI tells about its CUDA support (None: not known).

    ``built_with_cuda``: ``ompi_info``'s ``mpi_built_with_cuda_support``;
    ``mapped``: paths of the shared objects loaded in this process (the UCX
    transport ``libucp``, its CUDA transports ``libuct_cuda``).
    """

    built_with_cuda: bool | None = None
    mapped: tuple = ()


@functools.cache
def _probe_this_process() -> Decision:
    from mpi4py import MPI

    name, version = MPI.get_vendor()
    vendor = f"{name} {'.'.join(map(str, version))}"
    libraries = _loaded_mpi_libraries()
    return probe(libraries, vendor, os.environ, lambda: _evidence(libraries))


def _evidence(libraries) -> Evidence:
    """Open MPI's build information and the transports loaded in this process."""
    return Evidence(_ompi_info_cuda(libraries), tuple(_mapped_paths()))


def _ompi_info_cuda(libraries):
    """``mpi_built_with_cuda_support`` from the ``ompi_info`` beside the library (or on PATH)."""
    candidates = [os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(p))), "bin", "ompi_info")
                  for p, _ in libraries if os.path.isabs(p)]
    found = shutil.which("ompi_info")
    tools = [c for c in candidates if os.access(c, os.X_OK)] + ([found] if found else [])
    for tool in tools:
        try:
            out = subprocess.run([tool, "--parsable", "--param", "mpi", "base", "--level", "9"],
                                 capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        for line in out.splitlines():
            if "mpi_built_with_cuda_support:value:" in line:
                return line.rsplit(":", 1)[1].strip().lower() == "true"
    return None


def probe(libraries, vendor: str, environ, evidence=None) -> Decision:
    """What the MPI library reports (step 2 of the decision, uncached).

    Args:
        libraries: ``[(path, lib)]`` where ``lib`` resolves C symbols as
            attributes (a ``ctypes.CDLL``, or a test double) and raises
            AttributeError for a missing one.
        vendor: e.g. "Open MPI 5.0.11", for the reason text.
        environ: the environment (for the conda-forge Open MPI hint, ``UCX_TLS``).
        evidence: an :class:`Evidence`, or a callable returning one, asked
            only when Open MPI says yes (None: believe it).
    """
    if not libraries:
        return Decision(False, f"no MPI library found in this process to ask ({vendor}); "
                               f"staging through host memory (MPICOLL_CUDA_AWARE=1 forces direct)")
    for path, lib in libraries:
        answer = _ask(lib)
        if answer is None:
            continue
        aware, how = answer
        where = f"{how} in {path}"
        if aware and evidence is not None and vendor.startswith("Open MPI"):
            return _weigh(vendor, where, evidence() if callable(evidence) else evidence, environ)
        if aware:
            return Decision(True, f"{vendor} reports CUDA support: {where}")
        return Decision(False, f"{vendor} reports no CUDA support: {where}; "
                               f"{_hint(vendor, path, environ)}staging through host memory")
    paths = ", ".join(p for p, _ in libraries)
    return Decision(False, f"{vendor} ({paths}) exports neither MPIX_GPU_query_support nor "
                           f"MPIX_Query_cuda_support; staging through host memory "
                           f"(MPICOLL_CUDA_AWARE=1 forces direct device transfers)")


def _weigh(vendor: str, where: str, evidence: Evidence, environ) -> Decision:
    """Open MPI said yes: check its build and transports before believing it."""
    staging = "; staging through host memory (MPICOLL_CUDA_AWARE=1 forces direct)"
    if evidence.built_with_cuda is False:
        return Decision(False, f"{vendor} reports CUDA support ({where}) but ompi_info says "
                               f"mpi_built_with_cuda_support:false{staging}")
    names = [os.path.basename(p) for p in evidence.mapped]
    ucx = any(n.startswith("libucp") for n in names)
    ucx_cuda = any(n.startswith("libuct_cuda") for n in names)
    tls = environ.get("UCX_TLS", "").strip()
    said = [f"{vendor} reports CUDA support ({where})"]
    if evidence.built_with_cuda:
        said.append("ompi_info: mpi_built_with_cuda_support:true")
    if ucx:
        if tls and "cuda" not in tls and "all" not in tls.split(","):
            return Decision(False, f"{said[0]} but the UCX transport is limited to "
                                   f"UCX_TLS={tls}, without its CUDA transports{staging}")
        if not ucx_cuda:
            return Decision(False, f"{said[0]} but the UCX transport loaded no CUDA transport "
                                   f"(no libuct_cuda in this process){staging}")
        said.append("UCX loaded its CUDA transports (libuct_cuda)")
    return Decision(True, "; ".join(said))


def probe_transfer(python: str | None = None, code: str | None = None, timeout: float = 60.0):
    """Try one device ``Sendrecv`` (CuPy, MPI_COMM_SELF) in a child process: ``(ok, text)``.

    The child is a fresh MPI singleton, outside any launcher (its variables
    removed), forced to hand device pointers straight to MPI; a CUDA-aware
    library copies the data, any other reads device memory as host memory and
    crashes or sends garbage, which costs the child only.  It checks the one
    path a self-message takes, not the network: a pass is evidence, not proof.

    Args:
        python: the interpreter (default: this one).
        code: the child's program (tests substitute one); prints "ok" on success.
        timeout: seconds before the child counts as hung.
    """
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "MPI_LOCALRANKID"))}
    try:
        done = subprocess.run([python or sys.executable, "-c", code or _PROBE_CODE], env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"the device Sendrecv probe hung (no answer in {timeout:g} s)"
    except OSError as exc:
        return False, f"the device Sendrecv probe could not start ({exc})"
    if done.returncode < 0:
        sig = signal.Signals(-done.returncode).name
        return False, f"the device Sendrecv probe crashed ({sig}): MPI cannot read device memory"
    lines = (done.stdout + done.stderr).strip().splitlines()
    last = lines[-1] if lines else ""
    if done.returncode == 0 and last == "ok":
        return True, "the device Sendrecv probe passed (a device buffer through MPI_COMM_SELF)"
    return False, f"the device Sendrecv probe failed (exit {done.returncode}): {last[:200]}"


_PROBE_CODE = """
import cupy, numpy
from mpi4py import MPI
n = 1 << 16
a = cupy.arange(n, dtype=cupy.float64) + 3
b = cupy.zeros(n, dtype=cupy.float64)
cupy.cuda.get_current_stream().synchronize()
MPI.COMM_SELF.Sendrecv([a, MPI.DOUBLE], 0, 7, [b, MPI.DOUBLE], 0, 7)
assert numpy.array_equal(cupy.asnumpy(b), numpy.arange(n) + 3), "wrong data"
print("ok")
"""


def _ask(lib):
    """(aware, how) from the first query function ``lib`` exports, else None."""
    try:
        query = lib.MPIX_GPU_query_support
    except AttributeError:
        query = None
    if query is not None:
        flag = ctypes.c_int(0)
        query.restype = ctypes.c_int
        query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        rc = query(MPIX_GPU_SUPPORT_CUDA, ctypes.pointer(flag))
        if rc == MPI_SUCCESS:
            return bool(flag.value), f"MPIX_GPU_query_support(CUDA) set {flag.value}"
    try:
        query = lib.MPIX_Query_cuda_support
    except AttributeError:
        return None
    query.restype = ctypes.c_int
    query.argtypes = []
    value = int(query())
    return bool(value), f"MPIX_Query_cuda_support() returned {value}"


def _hint(vendor: str, path: str, environ) -> str:
    """Why a CUDA-capable build may still say no, and the switch that turns it on."""
    if vendor.startswith("Open MPI"):
        flag = environ.get("OMPI_MCA_opal_cuda_support", "").strip().lower()
        if flag in ("1", "true", "yes", "on"):
            return (f"OMPI_MCA_opal_cuda_support={flag} is set, so this build has no usable "
                    f"CUDA support (built without CUDA, or no CUDA driver); ")
        if _conda_prefix(path):
            return ("this is a conda Open MPI: conda-forge builds are CUDA-aware only with "
                    "OMPI_MCA_opal_cuda_support=true in the environment (not set); ")
        return ("built without CUDA or CUDA support switched off (conda-forge builds need "
                "OMPI_MCA_opal_cuda_support=true); ")
    if vendor.startswith("MPICH"):
        return ("built without GPU support or switched off (MPIR_CVAR_ENABLE_GPU=0; Cray MPICH "
                "needs MPICH_GPU_SUPPORT_ENABLED=1); ")
    return ""


def _conda_prefix(path: str) -> bool:
    """True when ``path`` is a library inside a conda environment (prefix/lib/...)."""
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(path)))
    return os.path.isdir(os.path.join(prefix, "conda-meta"))


def _loaded_mpi_libraries():
    """[(path, ctypes.CDLL)] of the MPI libraries loaded in this process.

    mpi4py loads libmpi with RTLD_LOCAL, so its symbols are not in the global
    namespace: the library is found in /proc/self/maps and re-opened with
    RTLD_NOLOAD (the same handle, nothing new loaded).  Without /proc (not
    Linux) the global namespace is the only place to look.
    """
    libs = []
    for path in _mapped_mpi_paths():
        try:
            libs.append((path, ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)))
        except OSError:
            continue
    if not libs:
        try:
            libs.append(("the process's global symbols", ctypes.CDLL(None)))
        except OSError:
            pass
    return libs


def _mapped_paths(maps: str = "/proc/self/maps"):
    """Paths of every shared object mapped in this process (empty without /proc)."""
    seen = {}
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and ".so" in parts[5]:
                    seen[parts[5].strip()] = None
    except OSError:
        return []
    return list(seen)


def _mapped_mpi_paths(maps: str = "/proc/self/maps"):
    """Paths of mapped shared objects named libmpi* (libmpi, libmpich, libmpi_abi, ...)."""
    seen = []
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                base = os.path.basename(path)
                if base.startswith("libmpi") and ".so" in base and path not in seen:
                    seen.append(path)
    except OSError:
        return []
    return seen
