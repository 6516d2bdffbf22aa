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
3. the library says no (or cannot be asked) but its UCX transport loaded its
   CUDA transports (``libuct_cuda`` mapped in this process, ``UCX_TLS`` not
   leaving them out): the answer of :func:`probe_transfer`, one device
   ``Sendrecv`` in a child process.  An Open MPI built without CUDA still
   hands contiguous buffers straight to UCX (``pml ucx``), and a UCX with
   CUDA transports handles device memory itself, so such a library answers
   0 and is CUDA-aware for mpicoll's messages (docs/gpu.md, "A CUDA-aware
   MPI from PyPI wheels");
4. otherwise host staging, the safe default.

Open MPI's ``MPIX_Query_cuda_support()`` returns 1 when its CUDA accelerator
component is selected, even where the transport cannot touch device memory
(a UCX without its CUDA transports), and a wrong "yes" crashes.  So a "yes"
from Open MPI is checked against the evidence it offers (:class:`Evidence`):
its build information (``ompi_info``: ``mpi_built_with_cuda_support``) and,
when the UCX transport is loaded, whether UCX loaded its CUDA transports
(``libuct_cuda``) and whether ``UCX_TLS`` leaves them out.  The reason names
the evidence that decided.  :func:`probe_transfer` (``python -m mpicoll.info
--probe``) is the direct test: one device ``Sendrecv`` in a child process,
so a crash there costs nothing; step 3 runs it only where UCX's CUDA
transports are loaded, so a CPU-only job never starts a child.

Steps 2 and 3 are decided once per process, on first use (never at import);
step 1 is read at every call, so ``configure`` takes effect immediately.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
from typing import NamedTuple

from ..core import config as _config

MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's enum value for CUDA (mpi.h)
MPI_SUCCESS = 0
_AUTO_PROBE_TIMEOUT = 30.0  # seconds for step 3's child (CuPy import, CUDA context, MPI init)


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
    mapped = tuple(_mapped_paths())
    transfer = None
    if importlib.util.find_spec("cupy") is not None:
        # a hang costs every rank this long once, before it falls back to staging
        transfer = functools.partial(probe_transfer, timeout=_AUTO_PROBE_TIMEOUT)
    return probe(libraries, vendor, os.environ, lambda: _evidence(libraries, mapped),
                 transfer=transfer, mapped=mapped)


def _evidence(libraries, mapped=None) -> Evidence:
    """Open MPI's build information and the transports loaded in this process."""
    return Evidence(_ompi_info_cuda(libraries), tuple(_mapped_paths() if mapped is None else mapped))


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


def probe(libraries, vendor: str, environ, evidence=None, transfer=None, mapped=()) -> Decision:
    """What the MPI library reports, checked (steps 2 and 3 of the decision, uncached).

    Args:
        libraries: ``[(path, lib)]`` where ``lib`` resolves C symbols as
            attributes (a ``ctypes.CDLL``, or a test double) and raises
            AttributeError for a missing one.
        vendor: e.g. "Open MPI 5.0.11", for the reason text.
        environ: the environment (for the conda-forge Open MPI hint, ``UCX_TLS``).
        evidence: an :class:`Evidence`, or a callable returning one, asked
            only when Open MPI says yes (None: believe it).
        transfer: a callable returning ``(ok, text)`` like
            :func:`probe_transfer`, asked only when the library says no (or
            cannot be asked) while UCX's CUDA transports are in ``mapped``
            (None: never asked).
        mapped: paths of the shared objects loaded in this process.
    """
    if not libraries:
        said = f"no MPI library found in this process to ask ({vendor})"
        return _by_transfer(said, mapped, environ, transfer) or Decision(
            False, f"{said}; staging through host memory (MPICOLL_CUDA_AWARE=1 forces direct)")
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
        said = f"{vendor} reports no CUDA support: {where}"
        return _by_transfer(said, mapped, environ, transfer) or Decision(
            False, f"{said}; {_hint(vendor, path, environ)}staging through host memory")
    paths = ", ".join(p for p, _ in libraries)
    said = f"{vendor} ({paths}) exports neither MPIX_GPU_query_support nor MPIX_Query_cuda_support"
    return _by_transfer(said, mapped, environ, transfer) or Decision(
        False, f"{said}; staging through host memory (MPICOLL_CUDA_AWARE=1 forces direct device transfers)")


def ucx_cuda_transports(mapped, environ) -> str | None:
    """Why UCX cannot carry device memory here, or None when it can (as far as this process shows).

    Args:
        mapped: paths of the shared objects loaded in this process.
        environ: the environment (``UCX_TLS``).

    Returns None when UCX (``libucp``) is loaded, loaded its CUDA transports
    (``libuct_cuda``) and ``UCX_TLS`` does not leave them out; else the reason.
    """
    names = [os.path.basename(p) for p in mapped]
    if not any(n.startswith("libucp") for n in names):
        return "no UCX in this process"
    tls = environ.get("UCX_TLS", "").strip()
    listed = [t.strip() for t in tls.lstrip("^").split(",") if t.strip()]
    if tls.startswith("^"):  # an exclusion list: cuda_copy (or all of cuda) left out
        usable = not {"cuda", "cuda_copy"} & set(listed)
    else:
        usable = not listed or any(t == "all" or t.startswith("cuda") for t in listed)
    if not usable:
        return f"the UCX transport is limited to UCX_TLS={tls}, without its CUDA transports"
    if not any(n.startswith("libuct_cuda") for n in names):
        return "the UCX transport loaded no CUDA transport (no libuct_cuda in this process)"
    return None


def ucx_report(mapped=None, environ=None) -> str:
    """One line on the UCX in this process: version, library, CUDA transports, ``UCX_TLS``.

    Args:
        mapped: paths of the shared objects loaded (None: this process's).
        environ: the environment (None: this process's).
    """
    mapped = tuple(_mapped_paths()) if mapped is None else mapped
    environ = os.environ if environ is None else environ
    ucp = next((p for p in mapped if os.path.basename(p).startswith("libucp")), None)
    if ucp is None:
        return "not loaded in this process"
    version = _ucx_version(ucp)
    why_not = ucx_cuda_transports(mapped, environ)
    cuda = "CUDA transports loaded (libuct_cuda)" if why_not is None else why_not
    tls = environ.get("UCX_TLS", "").strip()
    return f"{version or 'version unknown'} ({ucp}); {cuda}{f'; UCX_TLS={tls}' if tls else ''}"


def _ucx_version(path: str) -> str | None:
    """``ucp_get_version`` of the loaded libucp at ``path`` (RTLD_NOLOAD: nothing new loaded)."""
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        get = lib.ucp_get_version
    except (OSError, AttributeError):
        return None
    parts = [ctypes.c_uint(0), ctypes.c_uint(0), ctypes.c_uint(0)]
    get.restype = None
    get.argtypes = [ctypes.POINTER(ctypes.c_uint)] * 3
    get(*(ctypes.byref(v) for v in parts))
    return ".".join(str(v.value) for v in parts)


def _by_transfer(said: str, mapped, environ, transfer) -> Decision | None:
    """Step 3: the library said no, UCX's CUDA transports are loaded: a device transfer decides."""
    if transfer is None or ucx_cuda_transports(mapped, environ) is not None:
        return None
    ok, text = transfer()
    if ok:
        return Decision(True, f"{said}, but its UCX transport loaded its CUDA transports "
                              f"(libuct_cuda) and {text}")
    return Decision(False, f"{said}; its UCX transport loaded its CUDA transports (libuct_cuda) "
                           f"but {text}; staging through host memory")


def _weigh(vendor: str, where: str, evidence: Evidence, environ) -> Decision:
    """Open MPI said yes: check its build and transports before believing it."""
    staging = "; staging through host memory (MPICOLL_CUDA_AWARE=1 forces direct)"
    if evidence.built_with_cuda is False:
        return Decision(False, f"{vendor} reports CUDA support ({where}) but ompi_info says "
                               f"mpi_built_with_cuda_support:false{staging}")
    said = [f"{vendor} reports CUDA support ({where})"]
    if evidence.built_with_cuda:
        said.append("ompi_info: mpi_built_with_cuda_support:true")
    why_not = ucx_cuda_transports(evidence.mapped, environ)
    if why_not is None:
        said.append("UCX loaded its CUDA transports (libuct_cuda)")
    elif why_not != "no UCX in this process":
        return Decision(False, f"{said[0]} but {why_not}{staging}")
    return Decision(True, "; ".join(said))


def probe_transfer(python: str | None = None, code: str | None = None, timeout: float = 60.0):
    """Try one device ``Sendrecv`` (CuPy, MPI_COMM_SELF) in a child process: ``(ok, text)``.

    The child is a fresh MPI singleton, outside any launcher (the variables
    the launcher sets for its ranks removed, the MPI settings kept: Open MPI's
    ``OMPI_MCA_*``, MPICH's ``MPIR_CVAR_*``, ``UCX_*``, ``LD_LIBRARY_PATH``, so
    the child picks the transport its parent runs on), forced to hand device
    pointers straight to MPI; a CUDA-aware library copies the data, any other
    reads device memory as host memory and crashes or sends garbage, which
    costs the child only.  It checks the one path a self-message takes, not
    the network: a pass is evidence, not proof.

    Args:
        python: the interpreter (default: this one).
        code: the child's program (tests substitute one); prints "ok" on success.
        timeout: seconds before the child counts as hung.
    """
    env = {k: v for k, v in os.environ.items() if not _set_by_launcher(k)}
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


def _set_by_launcher(name: str) -> bool:
    """True for a variable a launcher gives its ranks (which would make a child join the job).

    Open MPI's ``mpirun`` sets ``OMPI_COMM_WORLD_*``, ``OMPI_*`` job facts,
    ``PMIX_*`` and ``PRTE_*``; MPICH's Hydra ``PMI_*``, ``HYDI_*``/``HYDRA_*``,
    ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS``.  Settings stay: ``OMPI_MCA_*``
    (``--mca`` options arrive as these too) and ``OMPI_ALLOW_RUN_AS_ROOT*``.
    """
    if name.startswith(("OMPI_MCA_", "OMPI_ALLOW_RUN_AS_ROOT")):
        return False
    return name.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "HYDRA_", "HYDI_",
                            "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))


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
