"""``python -m mpicoll.info``: what mpicoll runs on (MPI, NumPy, CuPy, GPUs, CUDA-aware MPI).

Usage::

    python -m mpicoll.info                   # one process (MPI singleton)
    mpirun -n 4 python -m mpicoll.info       # rank 0 prints; ranks that differ are named

Prints the MPI library (first line of ``MPI.Get_library_version()``), the
versions of mpi4py, NumPy and CuPy ("not installed" without it), the GPUs this
process sees ("none" without them), and ``cuda-aware: yes|no (how it was
decided)``: whether mpicoll hands device buffers straight to MPI or stages
them through host memory (see docs/gpu.md).

``selection:`` lines show what ``algorithm="auto"`` picks on this
communicator (its rank and node counts): the source (a tuning file written by
``python -m mpicoll.tune`` and its entry, or the built-in table), why a tuning
file was not applied, and the size ranges of each collective.

``UCX`` names the UCX library in this process (version, path), whether its
CUDA transports are loaded and ``UCX_TLS``: a UCX with CUDA transports under
the MPI is what makes it CUDA-aware where it reports no CUDA support itself
(the PyPI Open MPI and MPICH with ``libucx-cu13``, docs/gpu.md).

``intranode:`` lines say whether the ranks of a node can map each other's
memory (the shared-memory algorithms, mpicoll/transport/shared.py): for host
arrays and, where every rank sees a GPU, for device arrays (CUDA IPC), each
``yes`` or ``no (why not)``, found by setting it up on a duplicate of the
communicator as a collective would (the ``intranode`` option's value first).

``datatypes:`` lines say which buffer datatypes of ``mpicoll.Comm`` mpicoll
runs itself and which it hands to MPI's own collective ("delegated", as
``mpicoll.trace`` and ``mpicoll.traffic`` show those calls; docs/api.md).

``--probe`` adds one line, ``probe: passed|failed|not run (...)``: a device
buffer sent from rank 0 to rank 1 of a two-process child job, under the
launcher of this Python's MPI (see :func:`mpicoll.backends.cuda.probe_transfer`).
No process is started after MPI_Init, so the job runs when this command
starts, before it initialises MPI (on rank 0 only, under a launcher); run
from a program that already initialised MPI, it is "not run".  The command
exits 1 when the probe contradicts a "yes", and says how to use the direct
path (``MPICOLL_CUDA_AWARE=1``) when it passes beside a "no".
``--require-cuda-aware`` exits 1 unless the decision is "yes" (and, with
``--probe``, the probe passed): a job's check that its MPI takes device buffers.
"""

from __future__ import annotations

import argparse
import importlib
import sys

import numpy as np
from mpi4py import MPI

import mpicoll

from ..api import derived as _derived
from ..backends import cuda as _cuda
from ..core import config as _config
from ..engine import select as _select
from ..transport import topology as _topology


def _cupy_and_gpus():
    """(CuPy version line, GPU line) for this process."""
    try:
        cupy = importlib.import_module("cupy")
    except ModuleNotFoundError as exc:
        if exc.name == "cupy":
            return "not installed", "none (CuPy is not installed)"
        return f"installed but cannot be imported ({exc})", "unknown (CuPy cannot be imported)"
    except Exception as exc:  # e.g. a CUDA library missing
        return f"installed but cannot be imported ({type(exc).__name__}: {exc})", "unknown"
    version = cupy.__version__
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        return version, f"none ({type(exc).__name__}: {exc})"
    if count == 0:
        return version, "none"
    names = []
    for i in range(count):
        name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
        names.append(f"{i}: {name.decode() if isinstance(name, bytes) else name}")
    return version, f"{count} ({'; '.join(names)})"


def report() -> list[tuple[str, str]]:
    """[(label, value)] of this process's report (no MPI communication)."""
    try:
        _config.read_environment()  # the environment now, as a new communicator reads it
        aware, reason = _cuda.cuda_aware_mpi()
        decision = f"{'yes' if aware else 'no'} ({reason})"
    except ValueError as exc:  # a malformed MPICOLL_* variable
        decision = f"unknown ({exc})"
    major, minor = MPI.Get_version()
    cupy_version, gpus = _cupy_and_gpus()
    ucx = _cuda.ucx_report()
    return [
        ("mpicoll", mpicoll.__version__),
        # Open MPI 5.0.11's string ends in a NUL, which makes grep call the output binary
        ("MPI", " ".join(MPI.Get_library_version().replace("\x00", "").splitlines()[0].split())),
        ("MPI standard", f"{major}.{minor}"),
        ("mpi4py", _version("mpi4py")),
        ("NumPy", np.__version__),
        ("CuPy", cupy_version),
        ("GPUs", gpus),
        ("UCX", ucx),
        ("cuda-aware", decision),
    ]


def _intranode(comm) -> list[str]:
    """The ``intranode:`` lines (rank 0's, and ranks whose differ): node memory set up on a
    duplicate of ``comm`` for host arrays and, where every rank has a GPU, device arrays."""
    from ..backends.host import NUMPY
    from ..engine import context as _context
    from ..engine import intranode as _intranode
    dup = comm.Dup()
    try:
        try:
            ctx = _context.context(dup)
        except ValueError as exc:  # a bad MPICOLL_* variable, or ranks that disagree
            return [f"intranode: unknown ({exc})"]
        lines = [("intranode", f"{ctx.intranode} (MPICOLL_INTRANODE)"),
                 ("  host memory", _intranode.probe(ctx, NUMPY))]
        device = None
        try:
            from ..backends.devices import CUPY
            if CUPY.available() and CUPY.rt.device_count() > 0:
                device = CUPY
        except Exception:  # no CuPy, no driver
            device = None
        if comm.allreduce(device is not None, op=MPI.LAND):
            lines.append(("  device memory", _intranode.probe(ctx, device)))
        else:
            lines.append(("  device memory", "not tried (not every rank sees a GPU with CuPy)"))
    finally:
        dup.Free()
    everyone = comm.gather(lines, root=0)
    if comm.Get_rank() != 0:
        return []
    out = [f"{label}: {value}" for label, value in lines]
    for rank, theirs in enumerate(everyone):
        out += [f"  rank {rank} differs: {label.strip()} {value}"
                for (label, value), (_, mine) in zip(theirs, lines) if value != mine]
    return out


_PROBE_WORD = {True: "passed", False: "failed", None: "not run"}


def _version(module: str) -> str:
    return importlib.import_module(module).__version__


def main(argv=None, comm=None) -> int:
    """Print the report on rank 0 of ``comm`` (default MPI.COMM_WORLD).

    Returns 0, or 1 when the CUDA-aware setting cannot be read (malformed
    ``MPICOLL_CUDA_AWARE``), when the probe contradicts a "yes", or, with
    ``--require-cuda-aware``, when the decision is not "yes" or the probe
    failed; the report says why.
    """
    parser = argparse.ArgumentParser(prog="python -m mpicoll.info", description=__doc__.splitlines()[0])
    parser.add_argument("--probe", action="store_true",
                        help="also send a device buffer between the two ranks of a child job, "
                             "before this process initialises MPI (needs CuPy and a GPU)")
    parser.add_argument("--require-cuda-aware", action="store_true",
                        help="exit 1 unless device buffers go straight to MPI (cuda-aware: yes, "
                             "and with --probe the probe passed)")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    mine = report()
    everyone = comm.gather(mine, root=0)
    nodes = len(set(_topology.node_ids(comm)))  # collective: every rank runs main
    intranode = _intranode(comm)  # collective too
    try:
        sel_lines = _select.selection(comm.Get_size(), nodes).describe()
    except ValueError as exc:  # a bad MPICOLL_TUNING
        sel_lines = [f"source: none ({exc})"]
    if comm.Get_rank() != 0:
        return 0
    width = max(len(label) for label, _ in mine)
    lines = [f"{'ranks':{width}}  {comm.Get_size()} (rank 0's report)"]
    for label, value in mine:
        if label == "cuda-aware":
            lines.append(f"cuda-aware: {value}")
        else:
            lines.append(f"{label:{width}}  {value}")
    for rank, theirs in enumerate(everyone):
        for (label, value), (_, mine_value) in zip(theirs, mine):
            if value != mine_value:
                lines.append(f"  rank {rank} differs: {label} {value}")
    lines += intranode
    lines.append(f"selection: {comm.Get_size()} ranks on {nodes} node(s)")
    lines += [f"  {line}" for line in sel_lines]
    lines.append("datatypes: who runs mpicoll.Comm's calls")
    lines += [f"  {what}: {who}" for what, who in _derived.ROUTES]
    status = 1 if dict(mine)["cuda-aware"].startswith("unknown") else 0
    if sel_lines[0].startswith("source: none"):
        status = 1
    aware = dict(mine)["cuda-aware"]
    if args.probe:
        # (run when this command started, before MPI_Init: backends.cuda.probe_first)
        ok, text = _cuda.early_probe() or _cuda.probe_transfer()
        lines.append(f"probe: {_PROBE_WORD[ok]} ({text})")
        if ok is False and aware.startswith("yes"):
            lines.append("probe: contradicts cuda-aware: yes; set MPICOLL_CUDA_AWARE=0 to stage")
            status = 1
        elif ok and aware.startswith("no") and "(forced by" not in aware:
            lines.append("probe: device buffers passed between two processes, though the decision "
                         "is no: MPICOLL_CUDA_AWARE=1 uses the direct path")
        if args.require_cuda_aware and not ok:
            status = 1
    if args.require_cuda_aware and not aware.startswith("yes"):
        lines.append("required: cuda-aware: yes (--require-cuda-aware)")
        status = 1
    print("\n".join(lines))
    sys.stdout.flush()
    return status


if __name__ == "__main__":
    sys.exit(main())
