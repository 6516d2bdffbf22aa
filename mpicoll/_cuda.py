"""Is the MPI library CUDA-aware?  Decided once per process, with the reason.

A CUDA-aware MPI accepts device pointers in point-to-point calls, so mpicoll
hands CuPy buffers straight to it; any other MPI gets host copies (the
staging channel, see _staging).  The decision, in order:

1. an explicit setting: the ``cuda_aware`` argument of :func:`cuda_aware_mpi`,
   then ``mpicoll.configure(cuda_aware=...)`` / ``mpicoll.options(...)``,
   then the environment variable ``MPICOLL_CUDA_AWARE=1|0``;
2. what the MPI library in this process reports at run time: MPICH's
   ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``, else
   ``MPIX_Query_cuda_support()`` (Open MPI, MPICH), called through ctypes on
   the libmpi that mpi4py loaded, and only when the library exports it;
3. otherwise host staging, the safe default.

Step 2 is probed once per process, on first use (never at import); step 1
is read at every call, so ``configure`` takes effect immediately.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import NamedTuple

from . import _config

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
        if "cuda_aware" in _config._settings:
            how = f"mpicoll.configure(cuda_aware={setting})"
        else:
            how = f"MPICOLL_CUDA_AWARE={os.environ.get('MPICOLL_CUDA_AWARE', '').strip()}"
        return Decision(setting, f"forced by {how}")
    return _probe_this_process()


@functools.cache
def _probe_this_process() -> Decision:
    from mpi4py import MPI

    name, version = MPI.get_vendor()
    vendor = f"{name} {'.'.join(map(str, version))}"
    return probe(_loaded_mpi_libraries(), vendor, os.environ)


def probe(libraries, vendor: str, environ) -> Decision:
    """What the MPI library reports (step 2 of the decision, uncached).

    Args:
        libraries: ``[(path, lib)]`` where ``lib`` resolves C symbols as
            attributes (a ``ctypes.CDLL``, or a test double) and raises
            AttributeError for a missing one.
        vendor: e.g. "Open MPI 5.0.11", for the reason text.
        environ: the environment (for the conda-forge Open MPI hint).
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
        if aware:
            return Decision(True, f"{vendor} reports CUDA support: {where}")
        return Decision(False, f"{vendor} reports no CUDA support: {where}; "
                               f"{_hint(vendor, path, environ)}staging through host memory")
    paths = ", ".join(p for p, _ in libraries)
    return Decision(False, f"{vendor} ({paths}) exports neither MPIX_GPU_query_support nor "
                           f"MPIX_Query_cuda_support; staging through host memory "
                           f"(MPICOLL_CUDA_AWARE=1 forces direct device transfers)")


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
