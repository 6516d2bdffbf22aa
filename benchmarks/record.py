"""Run a table's benchmark again, keep its result file, and render the performance page.

    python benchmarks/record.py bench-openmpi                 # the command the file holds
    python benchmarks/record.py bench-openmpi --note "idle"   # a note on the machine
    python benchmarks/record.py NAME -- mpiexec -n 2 python -m mpicoll.bench -b 8 -e 1M
    python benchmarks/record.py NAME --from RECORDS.json -- COMMAND   # a run made elsewhere

The command runs as written, from the repository's root, with ``python`` and
``mpiexec`` found on PATH: put the MPI's environment first
(``PATH=$PWD/.venv/bin:$PATH`` for Open MPI, ``$PWD/.venv-mpich/bin`` for
MPICH; as root Open MPI also wants ``OMPI_ALLOW_RUN_AS_ROOT=1
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``).  The tool (``python -m mpicoll.bench``,
``benchmarks/latency.py`` or ``benchmarks/overlap.py``) writes its records
with ``--json`` to a temporary file; this script keeps the fields its table
shows (result files stay small), refuses a run with a wrong result or with
another MPI library than the file had (an Open MPI table cannot get MPICH
numbers), writes ``benchmarks/results/NAME.json`` and runs
``benchmarks/render.py``.  ``--from`` takes the records of a run made
elsewhere (``COMMAND --json RECORDS.json`` on a GPU machine) instead of
running the command here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import render

# what a command runs (``-m MODULE`` or a script's path) -> the table's layout
TOOLS = {"mpicoll.bench": "bench", "benchmarks/latency.py": "latency",
         "benchmarks/overlap.py": "overlap"}


def tool_of(command: str) -> str | None:
    """The layout of what ``command`` runs (:data:`TOOLS`), or None."""
    words = shlex.split(command)
    ran = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m"] + words
    return next((TOOLS[w] for w in ran if w in TOOLS), None)
KEEP = {
    "bench": ("collective", "algorithm", "bytes", "count", "selected", "time_us", "inplace_time_us",
              "builtin_time_us", "ratio", "busbw_gbps", "inplace_busbw_gbps",
              "builtin_busbw_gbps", "wrong", "inplace_wrong", "builtin_wrong"),
    "latency": ("collective", "bytes", "variant", "time_us", "ratio", "wrong"),
    "overlap": ("mode", "time_ms", "overlap", "bytes", "dtype", "matrix", "products", "device"),
}
ENVIRONMENT = ("mpi_library", "mpicoll", "mpi4py", "numpy", "python", "nranks", "nodes", "date",
               "selection")


def _round(x):
    return float(f"{x:.4g}") if isinstance(x, float) else x


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def curate(tool: str, command: str, records: list, machine: dict | None, note: str | None) -> dict:
    """The result file: what ran (command, environment, machine) and the kept fields.
    ``machine`` None: a run made elsewhere, known by its records' host and core count."""
    first = records[0]
    if machine is None:
        machine = {"cpu": f"host {first.get('host')}", "cores": first.get("cores")}
    return {
        "tool": tool, "command": command,
        "environment": {k: first[k] for k in ENVIRONMENT if first.get(k) is not None},
        "machine": {**machine, **({"note": note} if note else {})},
        "records": [{k: _round(r.get(k)) for k in KEEP[tool]} for r in records],
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = None
    if "--" in argv:
        command = shlex.join(argv[argv.index("--") + 1:])
        argv = argv[:argv.index("--")]
    p = argparse.ArgumentParser(prog="python benchmarks/record.py", description=__doc__.splitlines()[0])
    p.add_argument("name", help="the table: benchmarks/results/NAME.json")
    p.add_argument("--note", help="a note on the machine, shown beside the table (e.g. 'idle')")
    p.add_argument("--from", dest="source", metavar="RECORDS.json",
                   help="the records of COMMAND run elsewhere (its --json file): nothing runs here")
    args = p.parse_args(argv)
    path = render.RESULTS / f"{args.name}.json"
    old = json.loads(path.read_text()) if path.exists() else None
    if command is None:
        if old is None:
            p.error(f"{path} does not exist: give the command after --")
        command = old["command"]
    tool = tool_of(command)
    if tool is None:
        p.error(f"the command runs none of {', '.join(TOOLS)}: {command}")
    if args.source:
        records = json.loads(Path(args.source).read_text())
        bad = [r for r in records if any(r.get(k) for k in ("wrong", "inplace_wrong", "builtin_wrong"))]
        if bad:
            print(f"record.py: {args.source} has wrong results; {path.name} unchanged", file=sys.stderr)
            return 1
        machine = None  # (not this one)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "records.json"
            run = subprocess.run(shlex.split(command) + ["--json", str(out)], cwd=render.ROOT)
            if run.returncode != 0 or not out.exists():
                print(f"record.py: the command failed (exit status {run.returncode}); "
                      f"{path.name} unchanged", file=sys.stderr)
                return 1
            records = json.loads(out.read_text())
        machine = {"cpu": _cpu(), "cores": os.cpu_count()}
    note = args.note if args.note is not None else (old or {}).get("machine", {}).get("note")
    new = curate(tool, command, records, machine, note)
    if old is not None:
        was = render.mpi_name(old["environment"]["mpi_library"]).rsplit(" ", 1)[0]
        now = render.mpi_name(new["environment"]["mpi_library"]).rsplit(" ", 1)[0]
        if was != now:
            print(f"record.py: {path.name} holds {was} results, this run used {now} (put the "
                  f"right MPI first on PATH); unchanged", file=sys.stderr)
            return 1
    path.write_text(json.dumps(new, indent=1) + "\n")
    print(f"record.py: wrote {path}")
    return render.main([])


if __name__ == "__main__":
    sys.exit(main())
