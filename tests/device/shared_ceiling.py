"""Device check, shared memory: benchmark records -> JSON rows beside the device-to-device ceiling.

    python tests/device/shared_ceiling.py RESULTS.jsonl BENCH.json [--tag key=value ...]

Reads the ceilings rows already in RESULTS.jsonl (tests/device/ceilings.py, run
with as many processes as the benchmark's ranks) and the records of one
``python -m mpicoll.bench --device gpu --json`` run of the shared algorithms;
appends one row per record.  The ranks share one GPU, so the ceiling is the
aggregate device-to-device copy bandwidth of that many processes:

    ceiling_gbps = d2d gbps_total (procs = the benchmark's ranks, largest size)
    fraction     = busbw_gbps / ceiling_gbps

A copy moves its bytes twice (read and write) and an AllReduce's bus bytes
(2(n-1)/n of the array) need every rank's input read and its output written
at least once, so even a single kernel doing the whole AllReduce on one GPU
reaches ``1.5/4 = 0.375`` of this ceiling at 4 ranks (ReduceScatter ``0.3``,
AllGather ``0.19``); the row gives that bound too (``bound``).
"""

from __future__ import annotations

import argparse
import json


def ceiling(rows, procs):
    best = None
    for r in rows:
        if r.get("section") == "ceiling" and r["what"] == "d2d" and r["procs"] == procs:
            if best is None or r["bytes"] > best[0]:
                best = (r["bytes"], r["gbps_total"])
    return None if best is None else best[1]


def bound(collective, n):
    """busbw over copy bandwidth of one kernel reading every input and writing every output
    once (memory bytes / 2 per copied byte), all ranks on one GPU."""
    if collective == "allreduce":  # bus 2(n-1)/n N; memory: n inputs + n outputs of N
        return (2 * (n - 1) / n) / n
    if collective == "reduce_scatter":  # bus (n-1)/n N; memory: n inputs of N, n outputs of N/n
        return ((n - 1) / n) / ((n + 1) / 2)
    return ((n - 1) / n) / n  # allgather, N gathered: every rank reads N and writes N


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("bench")
    p.add_argument("--tag", action="append", default=[])
    args = p.parse_args(argv)
    with open(args.results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(args.bench) as f:
        records = json.load(f)
    tags = dict(t.split("=", 1) for t in args.tag)
    with open(args.results, "a") as out:
        for rec in records:
            n = rec["nranks"]
            top = ceiling(rows, n)
            row = {"section": "shared", **tags,
                   **{k: rec.get(k) for k in ("collective", "algorithm", "selected", "nranks",
                                              "dtype", "bytes", "time_us", "busbw_gbps", "wrong",
                                              "builtin_time_us", "builtin_busbw_gbps", "ratio")},
                   "ceiling_gbps": top, "bound": round(bound(rec["collective"], n), 3)}
            if top:
                row["fraction"] = round(rec["busbw_gbps"] / top, 3)
            out.write(json.dumps(row) + "\n")
            print(f"shared {row['collective']:15} {row['algorithm']:15} n={n} {row['bytes']:>11} B "
                  f"{row['busbw_gbps']:8.2f} GB/s ({row['ratio']}x the built-in's time) "
                  f"ceiling {top} GB/s fraction {row.get('fraction')} bound {row['bound']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
