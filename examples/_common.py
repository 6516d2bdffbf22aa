"""Helpers shared by the examples: device choice, ordered printing, result checks.

The examples import this module as ``_common`` (``python examples/x.py`` puts
``examples/`` first on ``sys.path``).  Nothing here is part of mpicoll's API.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.tools.arrays import to_host as _to_host
from mpicoll.tools.results import identical_across_ranks

DEVICES = ("auto", "cpu", "gpu")


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the ``--device`` option every example takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--device", choices=DEVICES, default="auto",
        help="where the arrays live: cpu (NumPy), gpu (CuPy; one GPU per rank, "
             "chosen by mpicoll.bind_device()), or auto (gpu if CuPy and a GPU are "
             "usable on every rank, else cpu; default)")
    return p


def count(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _gpu_usable() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "not usable"
        return False


def array_module(device: str, comm=MPI.COMM_WORLD):
    """(xp, device) for ``--device``: numpy and "cpu", or cupy and "gpu".

    "auto" picks "gpu" only when every rank can use CuPy and a GPU, so all
    ranks agree.  "gpu" imports CuPy and binds this rank to its GPU with
    :func:`mpicoll.bind_device`.
    """
    if device == "auto":
        device = "gpu" if comm.allreduce(_gpu_usable(), op=MPI.LAND) else "cpu"
    if device == "cpu":
        return np, "cpu"
    try:
        mpicoll.bind_device(comm)
    except mpicoll.MpicollError as exc:  # no CuPy or no GPU: say so, not a traceback
        print0(f"--device gpu: {exc}", comm=comm)
        sys.exit(2)
    import cupy
    return cupy, "gpu"


def to_host(a) -> np.ndarray:
    """A NumPy copy (or view) of a NumPy or CuPy array (mpicoll.tools.arrays.to_host)."""
    return _to_host(a)


def blocks(total: int, nblocks: int):
    """(counts, displs) of ``total`` elements cut as numpy.array_split cuts them.

    The first ``total % nblocks`` blocks get one element more; this is the
    split mpicoll.reduce_scatter uses when no ``counts`` are given.
    """
    q, r = divmod(total, nblocks)
    counts = [q + 1] * r + [q] * (nblocks - r)
    displs = [sum(counts[:i]) for i in range(nblocks)]
    return counts, displs


def print_ordered(text: str, comm=MPI.COMM_WORLD) -> None:
    """Rank 0 prints every rank's ``text``, in rank order (no interleaving)."""
    texts = comm.gather(text, root=0)
    if comm.rank == 0:
        print("\n".join(t for t in texts if t), flush=True)


def show(title: str, arr, comm=MPI.COMM_WORLD) -> None:
    """Rank 0 prints ``title``, then every rank's array, in rank order."""
    print0(title, comm=comm)
    print_ordered(f"  rank {comm.rank}: {to_host(arr)}", comm)


def print0(*args, comm=MPI.COMM_WORLD) -> None:
    if comm.rank == 0:
        print(*args, flush=True)


def same_on_all_ranks(a, comm=MPI.COMM_WORLD) -> bool:
    """True on every rank when ``a`` (NumPy or CuPy) is bitwise identical on all ranks."""
    return identical_across_ranks(comm, to_host(a))


def mismatch(got, ref, tol=0.0, name="result", reference="MPI's built-in"):
    """None when ``got`` equals ``ref`` within ``tol`` (elementwise), else why not.

    ``got`` and ``ref`` are NumPy arrays of one shape; ``tol`` is a scalar or an
    array of that shape (0: exact).
    """
    if got.shape != ref.shape:
        return f"{name}: shape {got.shape}, {reference} {ref.shape}"
    err = np.abs(got - ref) if np.issubdtype(got.dtype, np.inexact) else (got != ref)
    bad = np.flatnonzero(np.broadcast_to(err > tol, got.shape))
    if bad.size == 0:
        return None
    i = np.unravel_index(bad[0], got.shape)
    return (f"{name}: {bad.size} of {got.size} elements differ from {reference}"
            f"{' beyond the tolerance' if np.any(tol) else ''}; first at index "
            f"{tuple(int(k) for k in i)}: {got[i]!r} vs {ref[i]!r}")


def finish(ok: bool, what: str, comm=MPI.COMM_WORLD) -> None:
    """Agree on ``ok`` over all ranks; print OK or FAILED and exit 1 on failure.

    A rank whose own check failed has already printed why.
    """
    bad = comm.allgather(not ok)
    if any(bad):
        ranks = ", ".join(str(r) for r, b in enumerate(bad) if b)
        print0(f"FAILED: {what} (wrong on rank {ranks})", comm=comm)
        sys.exit(1)
    print0(f"OK: {what}", comm=comm)


def report(problem, comm=MPI.COMM_WORLD) -> bool:
    """True when ``problem`` is None; else print it, prefixed with this rank, and return False."""
    if problem is None:
        return True
    print(f"rank {comm.rank}: {problem}", file=sys.stderr, flush=True)
    return False


def check(ok: bool, message: str, comm=MPI.COMM_WORLD) -> bool:
    """``report(None if ok else message)``."""
    return report(None if ok else message, comm)


def torch_device(device: str, comm=MPI.COMM_WORLD):
    """The ``torch.device`` for ``--device`` in the torch examples (imports torch).

    "gpu" binds this rank to GPU (local rank mod GPU count), as
    :func:`mpicoll.bind_device` does for CuPy; "auto" picks "gpu" only when
    every rank sees a GPU.
    """
    import torch

    if device == "auto":
        device = "gpu" if comm.allreduce(torch.cuda.is_available(), op=MPI.LAND) else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        print0("--device gpu: torch sees no GPU on this rank", comm=comm)
        sys.exit(2)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    index = local.Get_rank() % torch.cuda.device_count()
    local.Free()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)
