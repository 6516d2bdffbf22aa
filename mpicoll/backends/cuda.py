"""Is the MPI library CUDA-aware?  Decided once per process, with the reason.

A CUDA-aware MPI accepts device pointers in point-to-point calls, so mpicoll
hands CuPy buffers straight to it; any other MPI gets host copies (the
staging channel, see transport.staging).  The decision, in order:

1. an explicit setting: the ``cuda_aware`` argument of :func:`cuda_aware_mpi`,
   then ``mpicoll.configure(cuda_aware=...)`` / ``mpicoll.options(...)``,
   then the environment variable ``MPICOLL_CUDA_AWARE=1|0``.  A forced yes
   is refused (ValueError naming the setting) where the MPI's UCX transport
   cannot carry device memory (:func:`ucx_cuda_transports`): MPI would read
   device pointers as host memory and crash;
2. what the MPI library in this process reports at run time: MPICH's
   ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``, else
   ``MPIX_Query_cuda_support()`` (Open MPI, MPICH), called through ctypes on
   the libmpi that mpi4py loaded, and only when the library exports it;
3. otherwise host staging, the safe default.  Where the library says no (or
   cannot be asked) but its UCX transport loaded its CUDA transports
   (``libuct_cuda`` mapped in this process, ``UCX_TLS`` not leaving them
   out), the reason says so: an Open MPI or MPICH built without CUDA still
   hands contiguous buffers straight to UCX, and a UCX with CUDA transports
   handles device memory itself, so such a library may be CUDA-aware for
   mpicoll's messages (docs/gpu.md, "A CUDA-aware MPI from PyPI wheels").
   Whether it is, :func:`probe_transfer` tests (``python -m mpicoll.info
   --probe``: a device buffer from rank 0 to rank 1 of a two-process child
   job), and ``MPICOLL_CUDA_AWARE=1`` then uses the direct path.

Open MPI's ``MPIX_Query_cuda_support()`` returns 1 when its CUDA accelerator
component is selected, even where the transport cannot touch device memory
(a UCX without its CUDA transports), and a wrong "yes" crashes.  So a "yes"
from Open MPI is checked against the evidence it offers (:class:`Evidence`):
its build (the MPI_T control variable ``mpi_built_with_cuda_support``, which
``ompi_info`` prints) and, when the UCX transport is loaded, whether UCX
loaded its CUDA transports (``libuct_cuda``) and whether ``UCX_TLS`` leaves
them out.  The reason names the evidence that decided.

Nothing here starts a process inside a job: no process may be started after
MPI_Init (a fork can break an interconnect's registered memory, and a child
of a rank is no part of its job).  The decision reads only this process: the
settings, the library's answer, its MPI_T variables and its mapped shared
objects.  The child job of :func:`probe_transfer` runs only before this
process initialises MPI (:func:`probe_first`, for ``python -m mpicoll.info
--probe``).

Step 2 is decided once per process, on first use (never at import); step 1
is read at every call, so ``configure`` takes effect immediately.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import NamedTuple

from ..core import config as _config

MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's enum value for CUDA (mpi.h)
MPI_SUCCESS = 0
NO_UCX = "no UCX in this process"
PROBE_TIMEOUT = 60.0  # seconds for the probe job (two CuPy imports, CUDA contexts, MPI init)
# The launcher variables that give a process its rank in a job (the probe job starts from rank 0)
_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")


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

    Raises:
        TypeError: ``cuda_aware`` is not a bool or None.
        ValueError: ``MPICOLL_CUDA_AWARE`` is malformed, or a yes is forced
            where the MPI's UCX transport cannot carry device memory (no
            CUDA transport loaded, or ``UCX_TLS`` leaves them out).

    Example::

        aware, why = mpicoll.cuda_aware_mpi()
        # (False, 'Open MPI 5.0.11 reports no CUDA support: ...')
    """
    if cuda_aware is not None:
        if not isinstance(cuda_aware, bool):
            raise TypeError(f"cuda_aware: expected a bool or None, got {type(cuda_aware).__name__}")
        return _forced(cuda_aware, f"the argument cuda_aware={cuda_aware}")
    setting = _config.get("cuda_aware")
    if setting is not None:
        if _config.configured("cuda_aware"):
            how = f"mpicoll.configure(cuda_aware={setting})"
        else:
            how = f"MPICOLL_CUDA_AWARE={_config.text('cuda_aware')}"
        return _forced(setting, how)
    return _probe_this_process()


def _forced(aware: bool, how: str) -> Decision:
    """An explicit setting; a yes refused where the UCX transport cannot carry device memory."""
    if aware:
        why = _ucx_without_cuda()
        if why is not None:
            raise ValueError(
                f"{how}: expected an MPI that can read device memory, but {why}, so MPI would "
                f"read device pointers as host memory (a crash or garbage); unset it to stage "
                f"through host memory, or load a UCX with its CUDA transports (docs/gpu.md)")
    return Decision(aware, f"forced by {how}")


_UCX_HERE: list = []  # [why UCX here cannot carry device memory, or None], once MPI is up


def _ucx_without_cuda() -> str | None:
    """Why the UCX transport in this process cannot carry device memory (None: it can, or
    there is no UCX).  Read once MPI is initialised (UCX loads in MPI_Init), not per call."""
    if _UCX_HERE:
        return _UCX_HERE[0]
    why = ucx_cuda_transports(_mapped_paths(), os.environ)
    why = None if why == NO_UCX else why
    if _mpi_initialized():
        _UCX_HERE.append(why)
    return why


def _mpi_initialized() -> bool:
    """Whether this process has initialised MPI (mpi4py imported and MPI_Init run)."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and bool(mpi.Is_initialized())


class Evidence(NamedTuple):
    """What else Open MPI tells about its CUDA support (None: not known).

    ``built_with_cuda``: the MPI_T control variable ``mpi_built_with_cuda_support``
    (``opal_built_with_cuda_support`` in Open MPI 5; ``ompi_info`` prints both);
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
    return probe(libraries, vendor, os.environ, lambda: _evidence(libraries, mapped), mapped=mapped)


def _evidence(libraries, mapped=None) -> Evidence:
    """Open MPI's build information (MPI_T) and the transports loaded in this process."""
    built = None
    for _, lib in libraries:
        built = _mpit_flag(lib, ("mpi_built_with_cuda_support", "opal_built_with_cuda_support"))
        if built is not None:
            break
    return Evidence(built, tuple(_mapped_paths() if mapped is None else mapped))


def _mpit_flag(lib, names) -> bool | None:
    """The first of the boolean MPI_T control variables ``names`` that ``lib`` has, read in
    this process (None: no such variable, or no MPI_T).  MPI_T may be used before, during
    and after MPI_Init; the library counts its own MPI_T_init_thread/MPI_T_finalize pairs."""
    try:
        init, fin = lib.MPI_T_init_thread, lib.MPI_T_finalize
        get_index, alloc = lib.MPI_T_cvar_get_index, lib.MPI_T_cvar_handle_alloc
        read, free = lib.MPI_T_cvar_read, lib.MPI_T_cvar_handle_free
    except AttributeError:
        return None
    for fn in (init, fin, get_index, alloc, read, free):
        fn.restype = ctypes.c_int
    init.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    get_index.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    alloc.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                      ctypes.POINTER(ctypes.c_int)]
    read.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    free.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    # the thread level MPI runs at: Open MPI takes MPI_T's as the process's own
    # (MPI_THREAD_SINGLE here would turn its thread safety off)
    mpi = sys.modules.get("mpi4py.MPI")
    level = mpi.Query_thread() if _mpi_initialized() else mpi.THREAD_SINGLE if mpi else 0
    provided = ctypes.c_int(0)
    if init(level, ctypes.byref(provided)) != MPI_SUCCESS:
        return None
    try:
        for name in names:
            index, handle, count = ctypes.c_int(-1), ctypes.c_void_p(), ctypes.c_int(0)
            if get_index(name.encode(), ctypes.byref(index)) != MPI_SUCCESS:
                continue
            if alloc(index, None, ctypes.byref(handle), ctypes.byref(count)) != MPI_SUCCESS:
                continue
            try:
                value = (ctypes.c_char * 16)()  # a bool or an int, zero-filled around it
                if count.value != 1 or read(handle, value) != MPI_SUCCESS:
                    continue
            finally:
                free(ctypes.byref(handle))
            return any(value.raw[:4])
        return None
    finally:
        fin()


def probe(libraries, vendor: str, environ, evidence=None, mapped=()) -> Decision:
    """What the MPI library reports, checked (step 2 of the decision, uncached).

    Args:
        libraries: ``[(path, lib)]`` where ``lib`` resolves C symbols as
            attributes (a ``ctypes.CDLL``, or a test double) and raises
            AttributeError for a missing one.
        vendor: e.g. "Open MPI 5.0.11", for the reason text.
        environ: the environment (for the conda-forge Open MPI hint, ``UCX_TLS``).
        evidence: an :class:`Evidence`, or a callable returning one, asked
            only when Open MPI says yes (None: believe it).
        mapped: paths of the shared objects loaded in this process: a no
            beside a UCX that loaded its CUDA transports says how to test
            and use the direct path.
    """
    if not libraries:
        said = f"no MPI library found in this process to ask ({vendor})"
        return Decision(False, f"{said}; {_undecided(mapped, environ)}staging through host memory "
                               f"(MPICOLL_CUDA_AWARE=1 forces direct)")
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
        hint = _undecided(mapped, environ) or _hint(vendor, path, environ)
        return Decision(False, f"{said}; {hint}staging through host memory")
    paths = ", ".join(p for p, _ in libraries)
    said = f"{vendor} ({paths}) exports neither MPIX_GPU_query_support nor MPIX_Query_cuda_support"
    return Decision(False, f"{said}; {_undecided(mapped, environ)}staging through host memory "
                           f"(MPICOLL_CUDA_AWARE=1 forces direct device transfers)")


def _undecided(mapped, environ) -> str:
    """The library said no (or nothing) beside a UCX with its CUDA transports: how to find out
    whether device buffers pass anyway, and how to use them ("" without such a UCX)."""
    if not mapped or ucx_cuda_transports(mapped, environ) is not None:
        return ""
    return ("its UCX transport loaded its CUDA transports (libuct_cuda), which may carry "
            "device buffers: `python -m mpicoll.info --probe` sends one between two processes, "
            "and where it passes MPICOLL_CUDA_AWARE=1 uses the direct path; ")


def ucx_cuda_transports(mapped, environ) -> str | None:
    """Why UCX cannot carry device memory here, or None when it can (as far as this process shows).

    Args:
        mapped: paths of the shared objects loaded in this process.
        environ: the environment (``UCX_TLS``).

    Returns None when UCX (``libucp``) is loaded, loaded its CUDA transports
    (``libuct_cuda``) and ``UCX_TLS`` does not leave them out; else the
    reason (:data:`NO_UCX` where no UCX is loaded).
    """
    names = [os.path.basename(p) for p in mapped]
    if not any(n.startswith("libucp") for n in names):
        return NO_UCX
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


def _weigh(vendor: str, where: str, evidence: Evidence, environ) -> Decision:
    """Open MPI said yes: check its build and transports before believing it."""
    staging = "; staging through host memory (MPICOLL_CUDA_AWARE=1 forces direct)"
    if evidence.built_with_cuda is False:
        return Decision(False, f"{vendor} reports CUDA support ({where}) but its MPI_T variable "
                               f"says mpi_built_with_cuda_support=false{staging}")
    said = [f"{vendor} reports CUDA support ({where})"]
    if evidence.built_with_cuda:
        said.append("MPI_T: mpi_built_with_cuda_support=true")
    why_not = ucx_cuda_transports(evidence.mapped, environ)
    if why_not is None:
        said.append("UCX loaded its CUDA transports (libuct_cuda)")
    elif why_not != NO_UCX:
        return Decision(False, f"{said[0]} but {why_not}{staging}")
    return Decision(True, "; ".join(said))


# -- the probe job: a device buffer from rank 0 to rank 1 of a two-process child job -------

def probe_transfer(python: str | None = None, code: str | None = None,
                   timeout: float = PROBE_TIMEOUT, launcher: str | None = None):
    """Send a device buffer from rank 0 to rank 1 of a two-process child job: ``(ok, text)``.

    The job (:func:`probe_job`) runs two processes of this Python under the
    launcher of its MPI, outside any job of this process (the launcher's
    variables removed, the MPI settings kept: Open MPI's ``OMPI_MCA_*``,
    MPICH's ``MPIR_CVAR_*``, ``UCX_*``, ``LD_LIBRARY_PATH``), so it runs on
    the transport this process's job would; device pointers go straight to
    MPI (CuPy, ``Send``/``Recv`` of a 64 KiB and an 8 MiB message), as on
    mpicoll's direct path between two ranks of a node: a CUDA-aware MPI
    moves the data, any other reads device memory as host memory and crashes
    or delivers garbage, which costs the child job only.  It tests the
    node's path (CUDA IPC, copies), not the network between nodes: a pass is
    evidence, not proof.

    No process is started after MPI_Init: where this process has initialised
    MPI the probe is not run, and ``ok`` is None (:func:`probe_first` runs it
    for ``python -m mpicoll.info --probe`` before MPI_Init).

    Args:
        python: the interpreter of both ranks (default: this one).
        code: the ranks' program (tests substitute one); rank 1 prints "ok"
            when the data arrived intact.
        timeout: seconds before the job counts as hung (and is killed).
        launcher: the launcher (default: :func:`find_launcher`).

    Returns:
        ``(True, text)`` passed, ``(False, text)`` failed (crash, hang, wrong
        data, CuPy missing, no launcher), ``(None, text)`` not run.
    """
    if _mpi_initialized():
        return None, ("MPI is initialised in this process, and no process is started after "
                      "MPI_Init: run `python -m mpicoll.info --probe` on its own")
    argv, env = probe_job(python, code, launcher)
    if argv is None:
        return False, ("the probe job could not start: no mpiexec beside "
                       f"{python or sys.executable} nor on PATH")
    what = f"the probe job ({os.path.basename(argv[0])} -n 2)"
    try:
        child = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, start_new_session=True)
    except OSError as exc:
        return False, f"{what} could not start ({exc})"
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_job(child)
        return False, f"{what} hung (no answer in {timeout:g} s)"
    rc = child.returncode
    if rc == 0 and "ok" in out.split():
        return True, (f"{what} passed: a device buffer went from rank 0 to rank 1 intact "
                      f"(64 KiB and 8 MiB)")
    signo = _signal_of(rc, out + err)
    if signo is not None:
        return False, f"{what} crashed ({signo}): MPI cannot read device memory"
    return False, f"{what} failed (exit {rc}): {_last_words(err) or _last_words(out)}"


def _signal_of(rc: int, text: str) -> str | None:
    """The signal that ended a rank of the probe job (its name), from the launcher's exit
    status (-N: the launcher itself; 128+N: Open MPI) or its report ("signal 11": MPICH's
    and Open MPI's words), else None."""
    found = re.search(r"\bsignal:? (\d+)", text, re.IGNORECASE)
    signo = -rc if rc < 0 else int(found.group(1)) if found else rc - 128 if rc > 128 else None
    try:
        return signal.Signals(signo).name
    except (TypeError, ValueError):
        return None


def _last_words(text: str) -> str:
    """What the ranks said of their failure: the first line a rank of the probe program
    wrote as "rank N: ...", else the last line outside the launcher's boxed reports
    (between lines of dashes or equals signs, Open MPI's and MPICH's); 200 characters."""
    said, boxed = [], False
    for line in text.splitlines():
        bare = line.strip()
        if re.match(r"rank \d+: ", bare):
            return bare[:200]
        if len(bare) >= 10 and set(bare) <= set("-="):
            boxed = not boxed
        elif bare and not boxed:
            said.append(bare)
    return said[-1][:200] if said else ""


def _kill_job(child) -> None:
    """End a hung probe job: its launcher's process group, then reap it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, sig)
        except OSError:
            break
        try:
            child.communicate(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def probe_job(python: str | None = None, code: str | None = None, launcher: str | None = None,
              environ=None):
    """``(argv, env)`` of the probe job: two ranks of ``python`` under ``launcher``, with the
    launcher's variables of this process's own job removed (``(None, None)``: no launcher).

    Args:
        python: the interpreter (default: this one).
        code: the ranks' program (default: the device transfer).
        launcher: the launcher (default: :func:`find_launcher`).
        environ: the environment to start from (default: this process's).
    """
    python = python or sys.executable
    environ = os.environ if environ is None else environ
    launcher = launcher or find_launcher(python, environ)
    if launcher is None:
        return None, None
    # Open MPI refuses more ranks than the slots it counts (one core, a one-task allocation)
    flags = ["--oversubscribe"] if _open_mpi_launcher(launcher) else []
    argv = [launcher, *flags, "-n", "2", python, "-c", code or _PROBE_CODE]
    return argv, {k: v for k, v in environ.items() if not _set_by_launcher(k)}


def find_launcher(python: str | None = None, environ=None) -> str | None:
    """The launcher of the MPI ``python`` runs on: ``mpiexec`` beside it (a virtual or conda
    environment with the PyPI MPIs, the MPI's own prefix), else on ``PATH``."""
    python = python or sys.executable
    environ = os.environ if environ is None else environ
    for folder in dict.fromkeys((os.path.dirname(python), os.path.dirname(os.path.realpath(python)))):
        path = os.path.join(folder, "mpiexec")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("mpiexec", path=environ.get("PATH"))


def _open_mpi_launcher(launcher: str) -> bool:
    """Whether ``launcher`` is Open MPI's (its ``ompi_info`` beside it, or PRRTE's prterun)."""
    folder = os.path.dirname(launcher)
    return (os.path.exists(os.path.join(folder, "ompi_info"))
            or os.path.basename(os.path.realpath(launcher)) in ("prterun", "orterun"))


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
import sys
try:
    import cupy, numpy
    from mpi4py import MPI
except Exception as exc:
    sys.exit(f"{type(exc).__name__}: {exc}")
c = MPI.COMM_WORLD
if c.size != 2:
    sys.exit(f"the launcher started {c.size} process(es) of one rank each, not a 2-rank job: "
             f"it is not the launcher of {MPI.Get_library_version().splitlines()[0].strip()}")
try:
    cupy.cuda.Device(c.rank % cupy.cuda.runtime.getDeviceCount()).use()
    ok = True
    for n in (1 << 13, 1 << 20):  # doubles: 64 KiB (eager) and 8 MiB (rendezvous, CUDA IPC)
        a = cupy.arange(n, dtype=cupy.float64) + 3 if c.rank == 0 else cupy.zeros(n, cupy.float64)
        cupy.cuda.get_current_stream().synchronize()
        if c.rank == 0:
            c.Send([a, MPI.DOUBLE], 1, 7)
        else:
            c.Recv([a, MPI.DOUBLE], 0, 7)
            ok = ok and bool(numpy.array_equal(cupy.asnumpy(a), numpy.arange(n) + 3))
except Exception as exc:  # (the other rank may wait in its Send or Recv for ever)
    sys.stderr.write(f"rank {c.rank}: {type(exc).__name__}: {exc}\\n")
    sys.stderr.flush()
    c.Abort(1)
    sys.exit(1)
if c.rank == 1:
    print("ok" if ok else "wrong data: a device buffer arrived changed (64 KiB or 8 MiB)")
sys.exit(0 if c.bcast(ok, root=1) else 1)
"""


_EARLY: list = []  # [(ok, text)] of the probe run before MPI_Init (probe_first)


def probe_first(argv=None) -> None:
    """Run the probe job now if this process is ``python -m mpicoll.info --probe`` and has
    not initialised MPI yet (importing mpicoll does, next); :func:`early_probe` keeps the
    answer.  Under a launcher only its rank 0 probes.

    Args:
        argv: the interpreter's command line (default: ``sys.orig_argv``, or
            ``/proc/self/cmdline`` before Python 3.10).
    """
    argv = _command_line() if argv is None else list(argv)
    if _EARLY or "mpi4py.MPI" in sys.modules or not _runs_info_probe(argv):
        return
    if any(os.environ.get(v, "0") != "0" for v in _RANK_VARS):
        return
    _EARLY.append(probe_transfer())


def early_probe():
    """``(ok, text)`` of the probe :func:`probe_first` ran before MPI_Init, or None."""
    return _EARLY[0] if _EARLY else None


def _runs_info_probe(argv) -> bool:
    """Whether ``argv`` (the interpreter's command line) is ``python ... -m mpicoll.info ... --probe``."""
    i = 1
    while i < len(argv):
        word = argv[i]
        if word == "-m" or (word.startswith("-m") and len(word) > 2):
            module = word[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            rest = argv[i + (1 if word[2:] else 2):]
            return (module in ("mpicoll.info", "mpicoll.tools.info") and "--probe" in rest
                    and not {"-h", "--help"} & set(rest))
        if word == "-c" or word == "-" or not word.startswith("-"):  # a program or a script
            return False
        i += 2 if word in ("-W", "-X") else 1  # (the options that take a value)
    return False


def _command_line() -> list:
    argv = getattr(sys, "orig_argv", None)
    if argv is not None:
        return list(argv)
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return []


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
