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
table's layout.  A file holds several runs of its command: a measured value is
``[minimum, median, maximum]`` over the runs; a cell shows the median, and a
ratio (each run's mpicoll time over its built-in's) the range beside it,
``0.46 (0.44-0.49)``, so one noisy run moves the range, not the number.  No MPI
and no mpicoll import: the renderer reads JSON only.
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


def _ratio(x: float) -> str:
    return f"{x:.2f}"


def median(value):
    """The median of a measured value (``[min, median, max]``), or the value itself."""
    return value[1] if isinstance(value, list) else value


def cell(value, fmt=_num, bold: bool = False, spread: bool = True) -> str:
    """``median (min-max)`` of a measured value (``spread=False``: the median alone);
    ``-`` where it was not measured."""
    if value is None:
        return "-"
    if not isinstance(value, list):
        value = [value] * 3
    lo, mid, hi = (fmt(v) for v in value)
    text = f"**{mid}**" if bold else mid
    return text if lo == hi or not spread else f"{text} ({lo}–{hi})"


def caption(data: dict) -> str:
    env, machine = data["environment"], data.get("machine", {})
    where = f"{machine.get('cpu', 'unknown CPU')}, {machine.get('cores', '?')} cores"
    if machine.get("note"):
        where += f", {machine['note']}"
    nodes = env.get("nodes") or 1
    on = "one node" if nodes == 1 else f"{nodes} nodes"
    runs = data.get("runs", 1)
    ranged = "each value" if data["tool"] == "overlap" else "each ratio"
    spread = ("one run" if runs == 1 else
              f"the median of {runs} runs, {ranged} with the lowest and highest beside it")
    return (f"{mpi_name(env['mpi_library'])}, {env['nranks']} ranks on {on} ({where}); "
            f"mpicoll {env['mpicoll']}, mpi4py {env['mpi4py']}, NumPy {env['numpy']}, "
            f"Python {env['python']}"
            + (f"; `auto` from the {env['selection']}" if env.get("selection") else "")
            + f"; {spread}.")


def algorithms_table(data: dict) -> list[str]:
    """Several algorithms in one run: a row per collective, size and algorithm, mpicoll's
    time over the built-in's (``auto`` with what it ran)."""
    cells = {}  # (collective, bytes) -> the records of its algorithms, in the run's order
    for r in data["records"]:
        cells.setdefault((r["collective"], r["bytes"]), []).append(r)
    rows = ["| collective | size | built-in (µs) | algorithm | mpicoll / built-in |",
            "|---|---:|---:|---|---:|"]
    for (collective, nbytes), recs in cells.items():
        # the built-in ran beside each algorithm: its middle time of those runs
        builtin = sorted(recs, key=lambda r: median(r["builtin_time_us"]))[len(recs) // 2]
        for i, r in enumerate(recs):
            name = f"`{r['algorithm']}`" + (f" (`{r['selected']}`)" if r["algorithm"] == "auto"
                                            else "")
            rows.append(f"| {collective if i == 0 else ''} | {_size(nbytes) if i == 0 else ''} "
                        f"| {cell(builtin['builtin_time_us'], spread=False) if i == 0 else ''} "
                        f"| {name} "
                        f"| {cell(r['ratio'], _ratio)} |")
    return rows


def bench_table(data: dict) -> list[str]:
    if len({r.get("algorithm", "auto") for r in data["records"]}) > 1:
        return algorithms_table(data)
    # each size twice: out of place, then in place (its own row, against MPI's in place)
    rows = ["| collective | size | `auto` ran | mpicoll (µs) | built-in (µs) "
            "| mpicoll / built-in | busbw (GB/s) |",
            "|---|---:|---|---:|---:|---:|---:|"]
    for r in data["records"]:
        for first, p, ratio in ((True, "", "ratio"), (False, "inplace_", "inplace_ratio")):
            rows.append(f"| {r['collective'] if first else ''} "
                        f"| {_size(r['bytes']) if first else 'in place'} "
                        f"| {'`' + r['selected'] + '`' if first else ''} "
                        f"| {cell(r[p + 'time_us'], spread=False)} "
                        f"| {cell(r.get('builtin_' + p + 'time_us'), spread=False)} "
                        f"| {cell(r.get(ratio), _ratio, bold=True)} "
                        f"| {cell(r[p + 'busbw_gbps'], spread=False)} |")
    return rows


WRONG = ("wrong", "inplace_wrong", "builtin_wrong", "builtin_inplace_wrong")


def _wrong(data: dict) -> int:
    return sum(r.get(k) or 0 for r in data["records"] for k in WRONG)


LATENCY_COLUMNS = (("Comm", "`Comm`"), ("array", "array `out=`"),
                   ("sendrecv", "floor: `Sendrecv` + ufunc"), ("persist", "floor: persistent"),
                   ("I-builtin", "non-blocking built-in"), ("I-Comm", "non-blocking `Comm`"),
                   ("I-array", "non-blocking array"), ("P-builtin", "persistent built-in"),
                   ("P-Comm", "persistent `Comm`"))


def latency_table(data: dict) -> list[str]:
    cells, first = {}, None
    for r in data["records"]:
        if r["variant"] == "first call":  # (the process's first call: a line of its own)
            first = r
            continue
        cells.setdefault((r["bytes"], r["collective"]), {})[r["variant"]] = r
    cols = [(k, title) for k, title in LATENCY_COLUMNS
            if any(k in v for v in cells.values())]
    rows = ["| size | collective | built-in (µs) | " + " | ".join(t for _, t in cols) + " |",
            "|---:|---|---:|" + "---:|" * len(cols)]
    for (nbytes, collective), v in cells.items():
        rows.append(f"| {_size(nbytes)} | {collective} "
                    f"| {cell(v['builtin']['time_us'], spread=False)} | "
                    + " | ".join(cell(v[k]["ratio"], _ratio) if k in v else "-" for k, _ in cols)
                    + " |")
    if first is not None:
        ms = [t / 1e3 for t in first["time_us"]] if isinstance(first["time_us"], list) \
            else first["time_us"] / 1e3
        rows += ["", f"The first call of the process on a new communicator (`Dup`, then one "
                     f"`allreduce` of {_size(first['bytes'])}): {cell(ms)} ms, "
                     f"{cell(first['ratio'], _ratio)} times the built-in's first call."]
    return rows


def overlap_table(data: dict) -> list[str]:
    recs = {r["mode"]: r for r in data["records"]}
    first = data["records"][0]
    rows = [f"{_size(first['bytes'])} per rank ({first['dtype']}) beside "
            f"{round(median(first['products']))} products of {first['matrix']}x{first['matrix']} "
            f"({first['device']}):", "",
            "| mode | time (ms) | overlap |", "|---|---:|---:|"]
    for mode in ("comm", "compute", "wait", "test", "thread"):
        r = recs[mode]
        ov = "" if r["overlap"] is None else cell(r["overlap"], _ratio)
        rows.append(f"| {mode} | {cell(r['time_ms'])} | {ov} |")
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
