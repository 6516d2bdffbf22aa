"""Device check: benchmark records -> JSON rows, each beside the hardware's ceilings.

    python tests/device/floor.py RESULTS.jsonl BENCH.json [--section bench] [--tag key=value ...]

Reads the ceilings rows already in RESULTS.jsonl (tests/device/ceilings.py) and
the records of one ``python -m mpicoll.bench --json`` run; appends one row per
record, with the tags given.  Two yardsticks:

* the staging floor: a staged collective moves its bus bytes per rank
  (``busbw`` x time) through a device-to-host copy, MPI and a host-to-device
  copy, pipelined, so it cannot beat the slowest of the three::

      floor_gbps = min(d2h_pinned, h2d_pinned, mpi_host_p2p)  (per process, largest size,
                                                            measured with the most processes)
      fraction   = busbw_gbps / floor_gbps                     (1.0: at the floor)

  for mpicoll and for the built-in (MPI on host copies, the copies included);
* the device-to-device ceiling: a path that keeps the data on the GPU (a
  CUDA-aware MPI, CUDA IPC between ranks) is bounded by the GPU's copy
  bandwidth, shared by the ranks on it::

      d2d_gbps     = d2d gbps_total at the largest size, measured with as many
                     processes as the record's ranks (else the most measured)
      d2d_fraction = busbw_gbps / d2d_gbps
"""

from __future__ import annotations

import argparse
import json


def floor_gbps(rows):
    best = {}
    for r in rows:
        if r.get("section") != "ceiling" or r["what"] not in ("d2h_pinned", "h2d_pinned", "mpi_host_p2p"):
            continue
        key = r["what"]
        # the most processes measured, then the largest size
        rank = (r["procs"], r["bytes"])
        if key not in best or rank > best[key][0]:
            best[key] = (rank, r["gbps"])
    if len(best) < 3:
        return None, best
    return min(v for _, v in best.values()), {k: v for k, (_, v) in best.items()}


def d2d_gbps(rows, nranks):
    """(aggregate device-to-device GB/s, processes it was measured with) for ``nranks`` ranks."""
    best = None
    for r in rows:
        if r.get("section") != "ceiling" or r["what"] != "d2d":
            continue
        # the record's process count first, then the most processes, then the largest size
        rank = (r["procs"] == nranks, r["procs"], r["bytes"])
        if best is None or rank > best[0]:
            best = (rank, r["gbps_total"], r["procs"])
    return (None, None) if best is None else (best[1], best[2])


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("results")
    p.add_argument("bench")
    p.add_argument("--section", default="bench")
    p.add_argument("--tag", action="append", default=[])
    args = p.parse_args(argv)
    with open(args.results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    floor, parts = floor_gbps(rows)
    with open(args.bench) as f:
        records = json.load(f)
    tags = dict(t.split("=", 1) for t in args.tag)
    with open(args.results, "a") as out:
        for rec in records:
            row = {"section": args.section, **tags,
                   **{k: rec.get(k) for k in ("collective", "algorithm", "selected", "nranks", "dtype",
                                              "bytes", "time_us", "busbw_gbps", "wrong",
                                              "builtin_time_us", "builtin_busbw_gbps", "ratio")},
                   "floor_gbps": floor, "floor_parts": parts}
            if floor:
                row["fraction"] = round(rec["busbw_gbps"] / floor, 3)
                row["builtin_fraction"] = round(rec["builtin_busbw_gbps"] / floor, 3)
            d2d, procs = d2d_gbps(rows, rec.get("nranks"))
            if d2d:
                row.update(d2d_gbps=d2d, d2d_procs=procs, d2d_fraction=round(rec["busbw_gbps"] / d2d, 4))
            out.write(json.dumps(row) + "\n")
            print(f"{row['section']:8} {row['collective']:15} n={row['nranks']} {row['bytes']:>11} B "
                  f"mpicoll {row['busbw_gbps']:8.2f} GB/s builtin {row['builtin_busbw_gbps']:8.2f} GB/s "
                  f"ratio {row['ratio']:.3f} fraction {row.get('fraction')} "
                  f"d2d_fraction {row.get('d2d_fraction')} {tags or ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
