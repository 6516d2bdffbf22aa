"""Render the performance page's tables from the result files.

    python benchmarks/render.py            # rewrite the tables in docs/performance.md
    python benchmarks/render.py --check    # exit 1 if the page and the result files differ

docs/performance.md marks each table's place with two comments::

    <!-- results: bench-openmpi -->
    ... (generated: replaced on every render) ...
    <!-- end results -->

and the table is made from ``benchmarks/results/bench-openmpi.json`` (written by
``benchmarks/record.py``): a line saying what ran where, the table, and the
commands that reproduce and regenerate it.  The file's ``tool`` picks the
table's layout.  No MPI and no mpicoll import: the renderer reads JSON only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- end results -->)",
                   re.S)


def mpi_name(line: str) -> str:
    """"Open MPI 5.0.11" / "MPICH 5.0.2" from the first line of MPI_Get_library_version."""
    for pattern, name in ((r"Open MPI v?([\d.]+)", "Open MPI"), (r"MPICH Version:\s*([\d.]+)", "MPICH"),
                          (r"Intel\(R\) MPI Library ([\d.]+)", "Intel MPI")):
        m = re.search(pattern, line)
        if m:
            return f"{name} {m.group(1)}"
    return line.split(",")[0].strip()


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _num(x: float) -> str:
    """Three significant digits, no exponent."""
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}" if x >= 1 else f"{x:.3f}"


def caption(data: dict) -> str:
    env, machine = data["environment"], data.get("machine", {})
    where = f"{machine.get('cpu', 'unknown CPU')}, {machine.get('cores', '?')} cores"
    if machine.get("note"):
        where += f", {machine['note']}"
    nodes = env.get("nodes") or 1
    on = "one node" if nodes == 1 else f"{nodes} nodes"
    return (f"{mpi_name(env['mpi_library'])}, {env['nranks']} ranks on {on} ({where}); "
            f"mpicoll {env['mpicoll']}, mpi4py {env['mpi4py']}, NumPy {env['numpy']}, "
            f"Python {env['python']}"
            + (f"; `auto` from the {env['selection']}" if env.get("selection") else "") + ".")


def algorithms_table(data: dict) -> list[str]:
    """Several algorithms in one run: a row per collective and size, mpicoll's time over the
    built-in's for each algorithm (``auto`` with what it ran)."""
    names, cells = [], {}
    for r in data["records"]:
        if r["algorithm"] not in names:
            names.append(r["algorithm"])
        cells.setdefault((r["collective"], r["bytes"]), {})[r["algorithm"]] = r
    rows = ["| collective | size | built-in (µs) | " + " | ".join(f"`{a}`" for a in names) + " |",
            "|---|---:|---:|" + "---:|" * len(names)]
    for (collective, nbytes), v in cells.items():
        builtin = sorted(r["builtin_time_us"] for r in v.values())[len(v) // 2]
        rows.append(f"| {collective} | {_size(nbytes)} | {_num(builtin)} | " + " | ".join(
            "-" if a not in v else f"{v[a]['ratio']:.2f}"
            + (f" (`{v[a]['selected']}`)" if a == "auto" else "") for a in names) + " |")
    return rows


def bench_table(data: dict) -> list[str]:
    if len({r.get("algorithm", "auto") for r in data["records"]}) > 1:
        return algorithms_table(data)
    rows = ["| collective | size | `auto` ran | mpicoll (µs) | in place (µs) | built-in (µs) "
            "| mpicoll / built-in | busbw mpicoll (GB/s) | busbw built-in (GB/s) |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in data["records"]:
        rows.append(f"| {r['collective']} | {_size(r['bytes'])} | `{r['selected']}` "
                    f"| {_num(r['time_us'])} | {_num(r['inplace_time_us'])} "
                    f"| {_num(r['builtin_time_us'])} | **{r['ratio']:.2f}** "
                    f"| {_num(r['busbw_gbps'])} | {_num(r['builtin_busbw_gbps'])} |")
    return rows


def _wrong(data: dict) -> int:
    return sum(r.get(k) or 0 for r in data["records"]
               for k in ("wrong", "inplace_wrong", "builtin_wrong"))


LATENCY_COLUMNS = (("Comm", "`Comm`"), ("array", "array `out=`"),
                   ("sendrecv", "floor: `Sendrecv` + ufunc"), ("persist", "floor: persistent"))


def latency_table(data: dict) -> list[str]:
    cells = {}
    for r in data["records"]:
        cells.setdefault((r["bytes"], r["collective"]), {})[r["variant"]] = r
    cols = [(k, title) for k, title in LATENCY_COLUMNS
            if any(k in v for v in cells.values())]
    rows = ["| size | collective | built-in (µs) | " + " | ".join(t for _, t in cols) + " |",
            "|---:|---|---:|" + "---:|" * len(cols)]
    for (nbytes, collective), v in cells.items():
        rows.append(f"| {_size(nbytes)} | {collective} | {_num(v['builtin']['time_us'])} | "
                    + " | ".join(f"{v[k]['ratio']:.2f}x" if k in v else "-" for k, _ in cols)
                    + " |")
    return rows


def overlap_table(data: dict) -> list[str]:
    recs = {r["mode"]: r for r in data["records"]}
    first = data["records"][0]
    rows = [f"{_size(first['bytes'])} per rank ({first['dtype']}) beside {first['products']} "
            f"products of {first['matrix']}x{first['matrix']} ({first['device']}):", "",
            "| mode | time (ms) | overlap |", "|---|---:|---:|"]
    for mode in ("comm", "compute", "wait", "test", "thread"):
        r = recs[mode]
        ov = "" if r["overlap"] is None else f"{r['overlap']:.2f}"
        rows.append(f"| {mode} | {_num(r['time_ms'])} | {ov} |")
    return rows


TABLES = {"bench": bench_table, "latency": latency_table, "overlap": overlap_table}


def block(name: str) -> str:
    """The generated text of one table (between its markers)."""
    data = json.loads((RESULTS / f"{name}.json").read_text())
    lines = [caption(data), "", *TABLES[data["tool"]](data), "",
             f"Reproduce: `{data['command']}`; regenerate this table: "
             f"`python benchmarks/record.py {name}`; wrong elements: {_wrong(data)}.", ""]
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    def one(m):
        return m.group(1) + block(m.group("name")) + m.group(4)
    return BLOCK.sub(one, text)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/render.py", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="do not write: exit 1 if docs/performance.md differs from the result files")
    args = p.parse_args(argv)
    text = PAGE.read_text()
    try:
        new = render(text)
    except FileNotFoundError as exc:
        print(f"render.py: no result file {exc.filename} (a marker in {PAGE} names it)",
              file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print(f"render.py: {PAGE} is not what the result files give; run "
                  f"python benchmarks/render.py", file=sys.stderr)
            return 1
        return 0
    if new != text:
        PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
