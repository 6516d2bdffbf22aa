"""Tables of `python -m mpicoll.bench --json` runs on the emulated cluster, beside the link model.

Usage (no MPI needed; run from the checkout):

    python tests/cluster/across_nodes.py --nodes 0,0,1,1 --rate 1gbit RUN.json [RUN.json ...]

``--nodes``: the node of every rank of the runs (block placement at 2 nodes x
2 ranks: 0,0,1,1; round-robin: 0,1,0,1; 4 nodes x 1: 0,1,2,3); give the runs
of one layout at a time.  The model of an algorithm is the bytes its schedule
sends from the busiest node to other nodes (every rank's schedule built as the
engine builds it, with this layout's ring order) divided by the link rate:
what the node link alone costs, without latency, the reductions or the
intra-node copies.  The built-in is measured once per row; its median over the
rows of one size and collective is what "auto" is compared with.

``--model TUNING.json`` adds, per collective, the cost model's prediction over
the measured time of every forced algorithm by size (the model of the tuning
file's measured entry with the most nodes, ``mpicoll.tools.costmodel``, at the
runs' rank count and ranks per node), and how many cells are within 20 %.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), os.path.dirname(HERE)]

from support import schedsim as sim  # noqa: E402

from mpicoll.engine import select as _select  # noqa: E402

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")


def link_fraction(collective: str, algorithm: str, nodes: tuple, total: int = 4800) -> float:
    """Elements the busiest node sends to other nodes, per element of the array."""
    sent = sim.node_link_elements(collective, _select.builder(collective, algorithm), nodes, total)
    return max(sent.values(), default=0) / total


def ran(rec: dict) -> str:
    """The algorithm a record's call ran (the benchmark's "selected" for "auto": the engine's
    choice with the communicator's node layout)."""
    return rec["algorithm"] if rec["algorithm"] != "auto" else rec["selected"]


def rate_bytes(text: str) -> float:
    v = text.lower()
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if v.endswith(unit):
            return float(v[:-len(unit)]) * mult / 8
    return float(v) / 8


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", required=True, help="node of every rank, e.g. 0,0,1,1")
    p.add_argument("--rate", default="1gbit", help="link rate each way (tc's form; default 1gbit)")
    p.add_argument("--model", metavar="TUNING.json",
                   help="also print the cost model's predicted / measured time per algorithm")
    p.add_argument("runs", nargs="+", metavar="RUN.json")
    a = p.parse_args(argv)
    nodes = tuple(int(x) for x in a.nodes.split(","))
    rate = rate_bytes(a.rate)
    wrong = 0
    print("| run | size | collective | ring | auto (runs) | built-in, median (range) "
          "| auto / ring | auto / built-in |")
    print("|---|---|---|---|---|---|---|---|")
    per_algo: dict = {}
    for path in a.runs:
        with open(path) as f:
            recs = json.load(f)
        if recs and recs[0]["nranks"] != len(nodes):
            p.error(f"{path}: {recs[0]['nranks']} ranks, --nodes names {len(nodes)}")
        name = os.path.basename(path).rsplit(".", 1)[0]
        for size in sorted({r["bytes"] for r in recs}):
            for c in COLLECTIVES:
                rows = [r for r in recs if r["collective"] == c and r["bytes"] == size]
                if not rows:
                    continue
                wrong += sum(r["wrong"] + r["builtin_wrong"] for r in rows)
                builtin = sorted(r["builtin_time_us"] / 1e3 for r in rows)
                median = statistics.median(builtin)
                t = {r["algorithm"]: r["time_us"] / 1e3 for r in rows}
                for r in rows:
                    if r["algorithm"] != "auto":
                        model = link_fraction(c, r["algorithm"], nodes) * size / rate * 1e3
                        per_algo.setdefault((c, r["algorithm"]), {}).setdefault(name, []).append(
                            t[r["algorithm"]] / model)
                auto = next((r for r in rows if r["algorithm"] == "auto"), None)
                if auto is None or "ring" not in t:
                    continue
                print(f"| {name} | {size >> 20} MiB | {c} | {t['ring']:.0f} | {t['auto']:.0f} "
                      f"({ran(auto)}) | {median:.0f} ({builtin[0]:.0f}-{builtin[-1]:.0f}) | "
                      f"{t['auto'] / t['ring']:.2f} | {t['auto'] / median:.2f} |")
    for c in COLLECTIVES:
        algos = [x for x in _select.ALGORITHMS[c] if (c, x) in per_algo]
        if not algos:
            continue
        print(f"\n{c}: time / model, by size\n")
        print("| run | " + " | ".join(f"{x} ({link_fraction(c, x, nodes):g}·N)" for x in algos) + " |")
        print("|---|" + "---|" * len(algos))
        for name in dict.fromkeys(n for x in algos for n in per_algo[(c, x)]):
            print(f"| {name} | " + " | ".join(
                ", ".join(f"{v:.2f}" for v in per_algo[(c, x)].get(name, [])) for x in algos) + " |")
    if a.model:
        model_table(a.model, nodes, a.runs)
    print(f"\nwrong elements (mpicoll and built-in, every record): {wrong}")
    return 0 if wrong == 0 else 1


def model_table(path: str, nodes: tuple, runs: list) -> None:
    """Predicted / measured, per collective: a row per algorithm, a column per size, one value
    per run."""
    from mpicoll.tools import costmodel
    from mpicoll.tools.bench import DTYPES

    with open(path) as f:
        entries = [e for e in json.load(f)["entries"] if e.get("source", "measured") == "measured"]
    if not entries:
        raise SystemExit(f"{path}: no measured entry")
    entry = max(entries, key=lambda e: e["measured"]["nodes"])
    model = costmodel.Model.from_entry(entry)
    nranks = len(nodes)
    ppn = max(nodes.count(k) for k in set(nodes))
    if nodes != tuple(sorted(nodes)) or any(nodes.count(k) != ppn for k in set(nodes)):
        raise SystemExit("--model: the model places ranks node by node, ppn each; "
                         f"--nodes {','.join(map(str, nodes))} is not such a layout")
    cells: dict = {}  # (collective, algorithm) -> {size: [ratio per run]}
    for run in runs:
        with open(run) as f:
            for r in json.load(f):
                if r["algorithm"] == "auto":
                    continue
                itemsize = DTYPES[r["dtype"]].itemsize
                t = model.predict(r["collective"], r["algorithm"], r["bytes"], nranks, ppn,
                                  itemsize)
                cells.setdefault((r["collective"], r["algorithm"]), {}).setdefault(
                    r["bytes"], []).append(t / (r["time_us"] * 1e-6))
    m = entry["measured"]
    print(f"\npredicted / measured: the model of {path} (measured at {m['ranks']} ranks on "
          f"{m['nodes']} node(s)), predicting {nranks} ranks, {ppn} per node")
    inside = total = 0
    for c in COLLECTIVES:
        algos = [x for x in _select.ALGORITHMS[c] if (c, x) in cells]
        if not algos:
            continue
        sizes = sorted({s for x in algos for s in cells[(c, x)]})
        print(f"\n| {c} | " + " | ".join(_size(s) for s in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for x in algos:
            row = cells[(c, x)]
            print(f"| {x} | " + " | ".join(
                ", ".join(f"{v:.2f}" for v in row.get(s, [])) for s in sizes) + " |")
            for vs in row.values():
                inside += sum(0.8 <= v <= 1.2 for v in vs)
                total += len(vs)
    print(f"\nwithin 20 %: {inside} of {total} cells")


def _size(nbytes: int) -> str:
    for shift, unit in ((20, "MiB"), (10, "KiB")):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


if __name__ == "__main__":
    sys.exit(main())
