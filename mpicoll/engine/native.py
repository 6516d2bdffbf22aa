"""The compiled repeat (engine/_hit.c): built on first use, used only where it is safe.

A repeated plain blocking call (engine.cache) costs, in Python, about a
microsecond above the MPI calls it cannot avoid: the signature check and one
mpi4py call per request.  ``_hit.c`` does the same check and the same MPI
calls in C (docs/performance.md).  It is an optional implementation of the
cache's repeat, never a second rule: every hit it takes is one the Python
repeat would take, and everything else goes to that Python repeat.

Built with the MPI library's own compiler wrapper
    ``mpicc`` (the ``mpicc`` option, ``MPICOLL_MPICC``; default: the one
    beside this Python, as the PyPI MPI wheels install it, else the first on
    ``PATH``), against NumPy's headers, into the user's private cache folder
    (``<cache>/mpicoll/native``, core.cachedir: created 0700, refused when
    another user could write it; one file per source, MPI library, Python and
    NumPy version), at the first entry remembered with the ``native`` option
    on (``MPICOLL_NATIVE``, default on).  The first build takes about 0.2 s;
    each rank builds in a private scratch folder and renames the file into
    place, and a file is loaded only when this user alone could have written
    it.  Nothing is built at install time: pip installs mpicoll before the
    MPI wheel it depends on, so no ``mpicc`` exists then.

Used only against the library it was built for
    The build's compiler wrapper must link the libmpi this process has
    loaded (mpi4py may load another one: ``MPI4PY_MPIABI``, a site module),
    and the module's ``MPI_Get_library_version`` must equal mpi4py's.
    Otherwise, or without a compiler, the hit stays in Python and
    :func:`status` (``python -m mpicoll.info``) says why.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
from mpi4py import MPI

from ..core import cachedir as _cachedir

_SOURCE = os.path.join(os.path.dirname(__file__), "_hit.c")
BUILD_TIMEOUT_S = 120.0
# (module or None, why not, the built file); set by the first load()
_STATE: dict = {}


def load(mpicc=None, cache_dir=None):
    """The compiled repeat module, set up for engine.cache, or None (see :func:`status`).
    Built and loaded once per process; ``mpicc``/``cache_dir``: the options' values."""
    if not _STATE:
        try:
            mod, path = _build_and_load(mpicc, cache_dir)
            _STATE.update(module=mod, why="", path=path)
        except _NotUsed as exc:
            _STATE.update(module=None, why=str(exc), path=exc.path)
        except OSError as exc:  # (an unwritable cache directory, a full disk)
            _STATE.update(module=None, why=f"cannot build: {exc}", path=None)
    return _STATE["module"]


def status() -> tuple:
    """(in use, what: the built file, or why it is not used); "not built yet" before the
    first entry asked for it."""
    if not _STATE:
        return False, "not built yet (the first repeated call builds it)"
    if _STATE["module"] is not None:
        return True, _STATE["path"]
    return False, _STATE["why"]


class _NotUsed(Exception):
    def __init__(self, why, path=None):
        super().__init__(why)
        self.path = path


def find_mpicc(mpicc=None) -> str:
    """The compiler wrapper to build with: the option's, else beside this Python, else on
    PATH; "" if none."""
    if mpicc:
        return shutil.which(mpicc) or ""
    beside = os.path.join(os.path.dirname(sys.executable), "mpicc")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("mpicc") or ""


def _loaded_libmpi() -> str:
    """The libmpi file this process has mapped (Linux: /proc/self/maps), or ""."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(None, 5)[-1].strip()
                if os.path.basename(path).startswith("libmpi.so"):
                    return os.path.realpath(path)
    except OSError:
        pass
    return ""


def _link_dirs(mpicc) -> list:
    """The library directories ``mpicc`` links from (Open MPI: -showme:link; MPICH and
    its derivatives: -show)."""
    for flag in ("-showme:link", "-show"):
        try:
            out = subprocess.run([mpicc, flag], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip():
            dirs = []
            for word in shlex.split(out.stdout):
                if word.startswith("-L"):
                    dirs.append(word[2:])
                elif word.startswith("-Wl,-rpath,"):
                    dirs.append(word[len("-Wl,-rpath,"):])
            return [os.path.realpath(d) for d in dirs if d]
    return []


def _build_and_load(mpicc, cache_dir):
    if not hasattr(sys, "getrefcount") or sys.implementation.name != "cpython":
        raise _NotUsed("not CPython")
    cc = find_mpicc(mpicc)
    if not cc:
        raise _NotUsed("no mpicc found (beside this Python or on PATH; MPICOLL_MPICC names one)")
    libmpi = _loaded_libmpi()
    if not libmpi:
        raise _NotUsed("cannot tell which libmpi this process loaded (no /proc/self/maps)")
    version = MPI.Get_library_version()
    with open(_SOURCE, "rb") as src:
        source = src.read()
    ident = "\0".join((sys.version, sysconfig.get_config_var("SOABI") or "", np.__version__,
                       version, libmpi, cc))
    key = hashlib.sha256(source + ident.encode()).hexdigest()[:20]
    if cache_dir == "off":
        raise _NotUsed("no cache directory to build in (XDG_CACHE_HOME=off)")
    try:
        folder = _cachedir.folder(cache_dir, "native")
    except _cachedir.Unsafe as exc:
        raise _NotUsed(f"the cache folder is not private ({exc})") from None
    name = f"_hit-{key}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    path = os.path.join(folder, name)
    failed = path + ".failed"
    if _trusted(failed):
        raise _NotUsed(f"the build failed before (see {failed}; delete it to retry)", path)
    if not _trusted(path):
        # (a built file passed this check: its name holds the wrapper and the libmpi)
        if os.path.dirname(libmpi) not in _link_dirs(cc):
            raise _NotUsed(f"{cc} does not link the loaded {libmpi}")
        _build(cc, folder, name)
    spec = importlib.util.spec_from_file_location(
        "mpicoll.engine._hit", path,
        loader=importlib.machinery.ExtensionFileLoader("mpicoll.engine._hit", path))
    try:
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except ImportError as exc:
        raise _NotUsed(f"cannot load {path}: {exc}", path) from None
    if mod.library_version() != version:
        raise _NotUsed(f"{path} runs another MPI library than mpi4py's", path)
    return mod, path


def _trusted(path) -> bool:
    """Whether ``path`` exists as a file this user alone wrote (core.cachedir); _NotUsed
    for one that exists and breaks the rules (never loaded, never trusted)."""
    try:
        _cachedir.check_file(path)
    except FileNotFoundError:
        return False
    except _cachedir.Unsafe as exc:
        raise _NotUsed(f"not loading {path}: {exc}", path) from None
    return True


def _build(cc, folder, name) -> None:
    """Compile the module into a private scratch folder and rename it into ``folder``
    (or, failing, its log as ``<name>.failed``)."""
    with _cachedir.Scratch(folder) as scratch:
        out_file = scratch.file(name)
        cmd = [cc, "-shared", "-fPIC", "-O2", "-I", sysconfig.get_paths()["include"],
               "-I", np.get_include(), _SOURCE, "-o", out_file]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            out = None
            log = f"{shlex.join(cmd)}\n{exc}\n"
        if out is not None and out.returncode == 0 and os.path.exists(out_file):
            os.chmod(out_file, 0o700)
            scratch.keep(name, name)
            return
        if out is not None:
            log = f"{shlex.join(cmd)}\nexit {out.returncode}\n{out.stdout}{out.stderr}"
        with open(scratch.file("log"), "w") as f:
            f.write(log)
        failed = scratch.keep("log", name + ".failed")
    raise _NotUsed(f"the build failed (see {failed})", os.path.join(folder, name))
