"""Run a table's benchmark several times, keep its result file, and render the performance page.

    python benchmarks/record.py bench-openmpi                 # the file's command, 5 runs
    python benchmarks/record.py bench-openmpi --runs 7 --note "idle"
    python benchmarks/record.py NAME -- mpiexec -n 2 python -m mpicoll.bench -b 8 -e 1M
    python benchmarks/record.py NAME --from R1.json R2.json R3.json -- COMMAND   # runs made elsewhere

The command runs as written, from the repository's root, with ``python`` and
``mpiexec`` found on PATH: put the MPI's environment first
(``PATH=$PWD/.venv/bin:$PATH`` for Open MPI, ``$PWD/.venv-mpich/bin`` for
MPICH; as root Open MPI also wants ``OMPI_ALLOW_RUN_AS_ROOT=1
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1``).  The tool (``python -m mpicoll.bench``,
``benchmarks/latency.py`` or ``benchmarks/overlap.py``) writes its records
with ``--json`` to a temporary file.

The command runs ``--runs`` times (default 5, at least 3), each run a job of
its own, and the file keeps every measured value as ``[minimum, median,
maximum]`` over the runs; the page shows the median with that range.  A tool
times its variants in turns within a run, so a ratio is taken within a run and
its range is that of the runs' ratios.  One noisy run moves a range, not a
published number; a range wider than ``--spread`` (a fraction of the median)
is named on stderr, so a busy machine shows before the page is committed.

The file keeps the fields its table shows (result files stay small).  A run
with a wrong result, one whose ``auto`` ran another algorithm than the others,
or one with another MPI library than the file had (an Open MPI table cannot
get MPICH numbers) is refused and the file left as it was; else
``benchmarks/results/NAME.json`` is written and ``benchmarks/render.py`` runs.
``--from`` takes the records of runs made elsewhere (``COMMAND --json R1.json``
on a GPU machine, once per run) instead of running the command here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import render

# what a command runs (``-m MODULE`` or a script's path) -> the table's layout
TOOLS = {"mpicoll.bench": "bench", "benchmarks/latency.py": "latency",
         "benchmarks/overlap.py": "overlap"}

# per layout: the fields that name a record (the same in every run), the measured ones (kept as
# [min, median, max] over the runs), and those every run must agree on
KEYS = {"bench": ("collective", "algorithm", "bytes"), "latency": ("bytes", "collective", "variant"),
        "overlap": ("mode",)}
MEASURED = {
    "bench": ("time_us", "inplace_time_us", "builtin_time_us", "builtin_inplace_time_us", "ratio",
              "inplace_ratio", "busbw_gbps", "inplace_busbw_gbps", "builtin_busbw_gbps",
              "builtin_inplace_busbw_gbps"),
    "latency": ("time_us", "ratio"),
    "overlap": ("time_ms", "overlap", "products"),
}
AGREE = {"bench": ("count", "selected"), "latency": (), "overlap": ("bytes", "dtype", "matrix", "device")}
WRONG = render.WRONG
# a table of several algorithms shows only their ratios and the built-in's time
ALGORITHMS_TABLE = ("collective", "algorithm", "bytes", "selected", "builtin_time_us", "ratio")
ENVIRONMENT = ("mpi_library", "mpicoll", "mpi4py", "numpy", "python", "nranks", "nodes", "date",
               "selection")
MIN_RUNS = 3


class Refused(Exception):
    """Runs that cannot make a table (the message says why)."""


def tool_of(command: str) -> str | None:
    """The layout of what ``command`` runs (:data:`TOOLS`), or None."""
    words = shlex.split(command)
    ran = [words[i + 1] for i, w in enumerate(words[:-1]) if w == "-m"] + words
    return next((TOOLS[w] for w in ran if w in TOOLS), None)


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


def spread(values: list) -> list | None:
    """``[min, median, max]`` of one field over the runs (None where a run has none)."""
    if any(v is None for v in values):
        return None
    return [_round(float(v)) for v in (min(values), statistics.median(values), max(values))]


def combine(tool: str, runs: list[list[dict]]) -> list[dict]:
    """One record per measurement: its identity, the agreed fields, each measured field as
    ``[min, median, max]`` over ``runs`` (each run: a tool's --json records) and the wrong
    elements of all runs.  :class:`Refused` where the runs do not make one table."""
    keys = KEYS[tool]
    several = tool == "bench" and len({r.get("algorithm", "auto") for r in runs[0]}) > 1
    order, by_key = [], {}
    for i, records in enumerate(runs):
        seen = set()
        for r in records:
            key = tuple(r.get(k) for k in keys)
            if i == 0:
                order.append(key)
            elif key not in by_key:
                raise Refused(f"run {i + 1} measured {key}, which run 1 did not")
            seen.add(key)
            by_key.setdefault(key, []).append(r)
        if seen != set(order):
            raise Refused(f"run {i + 1} did not measure {sorted(set(order) - seen)}")
    out = []
    for key in order:
        recs = by_key[key]
        bad = sum(r.get(k) or 0 for r in recs for k in WRONG)
        if bad:
            raise Refused(f"{key}: {bad} wrong elements")
        rec = dict(zip(keys, key))
        for field in AGREE[tool]:
            values = {json.dumps(r.get(field)) for r in recs}
            if len(values) > 1:
                raise Refused(f"{key}: the runs differ in {field} ({', '.join(sorted(values))})")
            rec[field] = recs[0].get(field)
        for field in MEASURED[tool]:
            rec[field] = spread([r.get(field) for r in recs])
        for field in WRONG:
            if any(field in r for r in recs):
                rec[field] = 0
        if several:
            rec = {k: rec[k] for k in ALGORITHMS_TABLE}
        out.append(rec)
    return out


def noisy(tool: str, records: list[dict], limit: float) -> list[str]:
    """The measured values whose range is wider than ``limit`` times their median."""
    found = []
    for r in records:
        for field in MEASURED[tool]:
            v = r.get(field)
            if isinstance(v, list) and v[1] and (v[2] - v[0]) / abs(v[1]) > limit:
                found.append(f"{' '.join(str(r[k]) for k in KEYS[tool])} {field}: "
                             f"{v[0]:g}-{v[2]:g} around {v[1]:g}")
    return found


def curate(tool: str, command: str, runs: list[list[dict]], machine: dict | None,
           note: str | None) -> dict:
    """The result file: what ran (command, environment, machine, how many runs) and the
    combined records.  ``machine`` None: runs made elsewhere, known by their records' host
    and core count."""
    first = runs[0][0]
    libraries = {r.get("mpi_library") for records in runs for r in records}
    if len(libraries) > 1:
        raise Refused(f"the runs used different MPI libraries: {sorted(map(str, libraries))}")
    if machine is None:
        machine = {"cpu": f"host {first.get('host')}", "cores": first.get("cores")}
    return {
        "tool": tool, "command": command, "runs": len(runs),
        "environment": {k: first[k] for k in ENVIRONMENT if first.get(k) is not None},
        "machine": {**machine, **({"note": note} if note else {})},
        "records": combine(tool, runs),
    }


def dumps(data: dict) -> str:
    """The result file's text: one record a line (small, and a rerun's diff reads by row)."""
    head = {k: v for k, v in data.items() if k != "records"}
    text = json.dumps(head, indent=1)[:-2]
    rows = ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in data["records"])
    return f'{text},\n "records": [\n{rows}\n ]\n}}\n'


def _run(command: str, runs: int) -> list[list[dict]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            path = Path(tmp) / f"run{i}.json"
            print(f"record.py: run {i + 1} of {runs}: {command}", file=sys.stderr, flush=True)
            run = subprocess.run(shlex.split(command) + ["--json", str(path)], cwd=render.ROOT)
            if run.returncode != 0 or not path.exists():
                raise Refused(f"run {i + 1}: the command failed (exit status {run.returncode})")
            out.append(json.loads(path.read_text()))
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = None
    if "--" in argv:
        command = shlex.join(argv[argv.index("--") + 1:])
        argv = argv[:argv.index("--")]
    p = argparse.ArgumentParser(prog="python benchmarks/record.py", description=__doc__.splitlines()[0])
    p.add_argument("name", help="the table: benchmarks/results/NAME.json")
    p.add_argument("--runs", type=int, default=5,
                   help=f"how many times the command runs (default 5, at least {MIN_RUNS})")
    p.add_argument("--spread", type=float, default=0.25,
                   help="name every value whose range over the runs is wider than this fraction "
                        "of its median (default 0.25)")
    p.add_argument("--note", help="a note on the machine, shown beside the table (e.g. 'idle')")
    p.add_argument("--from", dest="sources", nargs="+", metavar="RECORDS.json",
                   help="the records of COMMAND run elsewhere, one file per run (its --json "
                        "files): nothing runs here")
    args = p.parse_args(argv)
    count = len(args.sources) if args.sources else args.runs
    if count < MIN_RUNS:
        p.error(f"{'--from' if args.sources else '--runs'}: expected at least {MIN_RUNS} runs, "
                f"got {count}: one run is one sample of the machine's noise")
    path = render.RESULTS / f"{args.name}.json"
    old = json.loads(path.read_text()) if path.exists() else None
    if command is None:
        if old is None:
            p.error(f"{path} does not exist: give the command after --")
        command = old["command"]
    tool = tool_of(command)
    if tool is None:
        p.error(f"the command runs none of {', '.join(TOOLS)}: {command}")
    note = args.note if args.note is not None else (old or {}).get("machine", {}).get("note")
    try:
        if args.sources:
            runs = [json.loads(Path(s).read_text()) for s in args.sources]
            machine = None  # (not this one)
        else:
            runs = _run(command, args.runs)
            machine = {"cpu": _cpu(), "cores": os.cpu_count()}
        new = curate(tool, command, runs, machine, note)
        if old is not None:
            was = render.mpi_name(old["environment"]["mpi_library"]).rsplit(" ", 1)[0]
            now = render.mpi_name(new["environment"]["mpi_library"]).rsplit(" ", 1)[0]
            if was != now:
                raise Refused(f"{path.name} holds {was} results, this run used {now} (put the "
                              f"right MPI first on PATH)")
    except Refused as exc:
        print(f"record.py: {exc}; {path.name} unchanged", file=sys.stderr)
        return 1
    for line in noisy(tool, new["records"], args.spread):
        print(f"record.py: noisy (range over {args.spread:.0%} of the median): {line}",
              file=sys.stderr)
    path.write_text(dumps(new))
    print(f"record.py: wrote {path} ({new['runs']} runs)")
    return render.main([])


if __name__ == "__main__":
    sys.exit(main())
