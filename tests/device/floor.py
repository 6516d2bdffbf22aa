"""Device check: benchmark records -> JSON rows, each beside the hardware's ceilings.

    python tests/device/floor.py RESULTS.jsonl BENCH.json [--section bench] [--tag key=value ...]

Reads the ceilings rows already in RESULTS.jsonl (tests/device/ceilings.py) and
the records of one ``python -m mpicoll.bench --json`` run; appends one row per
record, with the tags given.  Two yardsticks:

* the staging floor: a staged collective moves its bus bytes per rank
  (``busbw`` x time) through a device-to-host copy, MPI and a host-to-device
  copy, pipelined, so it cannot beat the slowest of the three::

      floor_gbps = min(d2h_pinned, h2d_pinned, mpi_host_p2p)  (each process's share of
                                                            the largest size's window, with
                                                            the most processes measured)
      fraction   = busbw_gbps / floor_gbps                     (1.0: at the floor)

  for mpicoll and for the built-in (MPI on host copies, the copies included);
* the device-to-device ceiling: a path that keeps the data on the GPU (a
  CUDA-aware MPI, CUDA IPC between ranks) is bounded by the GPU's copy
  bandwidth, shared by the ranks on it::

      d2d_gbps     = d2d gbps_total at the largest size: the bytes every process
                     copied in one timed window (ceilings.py), measured with as many
                     processes as the record's ranks (else the most measured)
      d2d_fraction = busbw_gbps / d2d_gbps

    A copy moves its bytes twice (read and write); a collective's bus bytes
    need every rank's input read and its output written at least once, so
    even one kernel doing the whole collective on the GPU the ranks share
    stays below ``d2d_bound`` of this ceiling (AllReduce ``2(n-1)/n / n``:
    0.5 at 2 ranks, 0.375 at 4; ReduceScatter ``(n-1)/n / ((n+1)/2)``;
    AllGather ``(n-1)/n / n``), and ``d2d_of_bound = d2d_fraction /
    d2d_bound`` says how near a path comes to it.

A record's other fields are kept (the torch benchmark's ``gloo_ratio``); the
fractions are added where the record has the bandwidths they divide.
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


def d2d_bound(collective, n):
    """Bus bandwidth over the copy bandwidth of one kernel reading every input and writing
    every output once (memory bytes / 2 per copied byte), all ranks on one GPU."""
    if collective == "allreduce":  # bus 2(n-1)/n N; memory: n inputs + n outputs of N
        return (2 * (n - 1) / n) / n
    if collective == "reduce_scatter":  # bus (n-1)/n N; memory: n inputs of N, n outputs of N/n
        return ((n - 1) / n) / ((n + 1) / 2)
    return ((n - 1) / n) / n  # allgather, N gathered: every rank reads N and writes N


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
            row = {"section": args.section, **tags, **rec, "floor_gbps": floor, "floor_parts": parts}
            busbw, builtin = rec.get("busbw_gbps"), rec.get("builtin_busbw_gbps")
            if floor and busbw is not None:
                row["fraction"] = round(busbw / floor, 3)
            if floor and builtin is not None:
                row["builtin_fraction"] = round(builtin / floor, 3)
            n = rec.get("nranks")
            d2d, procs = d2d_gbps(rows, n)
            if d2d and busbw is not None:
                row.update(d2d_gbps=d2d, d2d_procs=procs, d2d_fraction=round(busbw / d2d, 4))
                if n and n > 1 and rec.get("collective"):
                    bound = d2d_bound(rec["collective"], n)
                    row.update(d2d_bound=round(bound, 3),
                               d2d_of_bound=round(row["d2d_fraction"] / bound, 3))
            out.write(json.dumps(row) + "\n")
            extra = "".join(f" {k} {row[k]:.3g}" for k in ("ratio", "gloo_ratio") if k in row)
            print(f"{row['section']:8} {row.get('collective')} {row.get('algorithm', '')} "
                  f"n={n} {row.get('bytes')} B busbw {busbw} GB/s{extra} "
                  f"fraction {row.get('fraction')} d2d_fraction {row.get('d2d_fraction')} "
                  f"d2d_of_bound {row.get('d2d_of_bound')} {tags or ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
