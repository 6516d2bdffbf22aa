"""The performance bands over `python -m mpicoll.bench --json` runs.

Per MPI library, collective and band: the sizes whose ratio (mpicoll / built-in)
is within the band, of the band's sizes, per run; the median and the worst ratio
over the runs.  Bands: up to 4 KiB at most 1.5x, 8 KiB to 512 KiB 1.2x, from
1 MiB 0.9x (AllGather 1.0x: nothing is reduced, and the floor is MPI's own copy).
Sizes between the bands' edges (above 4 KiB and below 8 KiB, above 512 KiB and
below 1 MiB) are in none.

Run: python benchmarks/bands.py RUN.json [RUN.json ...]   (no MPI needed)
"""

import json
import statistics
import sys

from mpicoll.engine.tuning import mpi_identity

KIB, MIB = 1 << 10, 1 << 20
BANDS = (("<= 4 KiB", 0, 4 * KIB, 1.5), ("8-512 KiB", 8 * KIB, 512 * KIB, 1.2),
         (">= 1 MiB", MIB, float("inf"), 0.9))


def limit(collective, band):
    return 1.0 if collective == "allgather" and band[0] == ">= 1 MiB" else band[3]


def main(paths):
    runs = {}  # (library, collective) -> [ {bytes: ratio} per run ]
    for path in paths:
        with open(path) as f:
            recs = json.load(f)
        per = {}
        for r in recs:
            if r.get("ratio") is None:
                continue
            ident = mpi_identity(r.get("mpi_library") or "?")
            lib = f"{ident['library']} {ident['version']}"
            per.setdefault((lib, r["collective"]), {})[r["bytes"]] = r["ratio"]
        for key, ratios in per.items():
            runs.setdefault(key, []).append(ratios)
    print("| MPI | collective | " + " | ".join(
        f"{name} (<= {lim}x)" for name, _, _, lim in BANDS) + " |")
    print("|---|---|" + "---|" * len(BANDS))
    for (lib, collective), rs in sorted(runs.items()):
        cells = []
        for band in BANDS:
            lim = limit(collective, band)
            counts, values = [], []
            for ratios in rs:
                inside = [v for b, v in ratios.items() if band[1] <= b <= band[2]]
                counts.append(f"{sum(v <= lim for v in inside)}/{len(inside)}")
                values += inside
            if not values:
                cells.append("-")
                continue
            cells.append(f"{', '.join(counts)} (median {statistics.median(values):.2f}, "
                         f"worst {max(values):.2f})")
        print(f"| {lib} | {collective} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
