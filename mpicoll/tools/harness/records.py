"""What a run records: the environment it ran in, and its records as JSON, CSV or a plot.

A record is a flat dict (one measurement); every tool adds :func:`environment`'s
fields to its records, so a file says what produced it.  Rank 0 writes.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import platform

import numpy as np
from mpi4py import MPI

import mpicoll

from .cli import ToolError, write_file

__all__ = ["environment", "mpi_library", "nodes", "write_json", "keep_json", "write_csv",
           "write_plot"]


def mpi_library() -> str:
    """The first line of ``MPI_Get_library_version``."""
    lines = MPI.Get_library_version().replace("\0", "").strip().splitlines()
    return lines[0].strip() if lines else "unknown"


def nodes(comm) -> int:
    """How many nodes (shared-memory domains) ``comm``'s ranks are on (collective)."""
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return comm.allreduce(1 if shared.Get_rank() == 0 else 0)
    finally:
        shared.Free()


def environment(comm) -> dict:
    """The run's environment, the same on every rank (rank 0's date): MPI library, versions,
    host, ranks, nodes, date (collective)."""
    import mpi4py

    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return {
        "mpi_library": mpi_library(), "mpicoll": mpicoll.__version__, "mpi4py": mpi4py.__version__,
        "numpy": np.__version__, "python": platform.python_version(), "host": platform.node(),
        "cores": os.cpu_count(), "nranks": comm.Get_size(), "nodes": nodes(comm),
        "date": comm.bcast(date, root=0),
    }


def write_json(path, records) -> None:
    def dump(f):
        json.dump(records, f, indent=1)
        f.write("\n")
    write_file(path, dump)


def keep_json(path, records) -> None:
    """Rewrite ``path`` with the records so far, as each measurement ends (rank 0), so a run
    stopped by a time limit keeps what it measured.  A file that cannot be written now is
    left to the final :func:`write_json`, which raises: raised between measurements, the
    error would end rank 0 alone while the other ranks measure on."""
    try:
        write_json(path, records)
    except ToolError:
        pass


def write_csv(path, records, fields) -> None:
    def dump(f):
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        for rec in records:
            writer.writerow({k: ("" if rec.get(k) is None else rec.get(k)) for k in fields})
    write_file(path, dump)


def write_plot(path, records, collectives) -> None:
    """Bus bandwidth (top) and time ratio to the built-in (bottom) against size, one column
    per collective, from the benchmark's records (needs matplotlib)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colls = [c for c in collectives if any(r["collective"] == c for r in records)]
    fig, axes = plt.subplots(2, len(colls), figsize=(5.5 * len(colls), 7), squeeze=False)
    for j, c in enumerate(colls):
        recs = [r for r in records if r["collective"] == c]
        top, bottom = axes[0][j], axes[1][j]
        for algo in dict.fromkeys(r["algorithm"] for r in recs):
            rs = sorted((r for r in recs if r["algorithm"] == algo), key=lambda r: r["bytes"])
            x = [r["bytes"] for r in rs]
            top.plot(x, [r["busbw_gbps"] for r in rs], marker="o", ms=3, label=f"mpicoll {algo}")
            bottom.plot(x, [r["ratio"] for r in rs], marker="o", ms=3, label=f"mpicoll {algo}")
        seen = {}
        for r in recs:  # one built-in curve (median over the algorithms' runs of a size)
            seen.setdefault(r["bytes"], []).append(r["builtin_busbw_gbps"])
        xb = sorted(seen)
        top.plot(xb, [float(np.median(seen[b])) for b in xb], "k--", label="MPI built-in")
        bottom.axhline(1.0, color="k", ls="--", lw=1)
        top.set_title(f"{c}, {recs[0]['nranks']} ranks, {recs[0]['dtype']}")
        top.set_ylabel("bus bandwidth (GB/s)")
        bottom.set_ylabel("time mpicoll / built-in")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("size (bytes)")
            ax.grid(True, which="both", alpha=0.3)
        bottom.set_yscale("log")
        top.legend(fontsize=7)
    fig.suptitle(f"mpicoll vs {records[0]['mpi_library'][:60]}", fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ToolError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
