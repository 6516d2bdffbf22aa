"""Device check: hold benchmark rows in results.jsonl to a target; exit 1 when one misses it.

    python tests/device/judge.py RESULTS SECTION pair NUM DEN [--field busbw_gbps] TARGET [SIZES]
    python tests/device/judge.py RESULTS SECTION value LABEL FIELD TARGET [SIZES]

    TARGET: --at-least X | --at-most X | --one-of A,B (value)   SIZES: [--min-bytes B] [--max-bytes B]

Rows are those floor.py appended for SECTION, chosen by the start of their
``label`` (the check line's label in tests/device/checks.txt), e.g. every
"bench direct" row at 2 and 4 ranks.

``pair`` divides FIELD of each NUM row by FIELD of the DEN row measured at the
same collective, ranks, dtype and size, e.g. the direct path's bus bandwidth
over the staged path's::

    judge.py results.jsonl routea pair "bench direct" "bench staged" --at-least 10

``value`` holds FIELD of each LABEL row itself to the target, e.g. a fraction
of the device-to-device ceiling, or the time ratio to the built-in::

    judge.py results.jsonl shared value "shared bench" d2d_fraction --at-least 0.5 --min-bytes 64M

or to a set of names (a text field), e.g. the algorithm a torch call ran::

    judge.py results.jsonl torchcuda value "torch bench" selected --one-of shared_oneshot,shared_twoshot

Prints one line per comparison, appends one row ``{"section", "judge", "ok",
"cases"}`` to RESULTS; exit 1 when any comparison misses the target or none
was found (a target nothing was measured for has not been met).
"""

from __future__ import annotations

import argparse
import json

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in UNITS else ""
    return int(float(text[:len(text) - len(unit)]) * UNITS[unit])


def _parser():
    p = argparse.ArgumentParser(prog="judge.py", description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("section")
    sub = p.add_subparsers(dest="mode", required=True)
    pair = sub.add_parser("pair", help="FIELD of NUM rows over FIELD of the matching DEN rows")
    pair.add_argument("num")
    pair.add_argument("den")
    pair.add_argument("--field", default="busbw_gbps")
    value = sub.add_parser("value", help="FIELD of LABEL rows")
    value.add_argument("label")
    value.add_argument("field")
    for s in (pair, value):
        target = s.add_mutually_exclusive_group(required=True)
        target.add_argument("--at-least", type=float)
        target.add_argument("--at-most", type=float)
        if s is value:
            target.add_argument("--one-of", type=lambda text: text.split(","))
        s.add_argument("--min-bytes", type=size, default=0)
        s.add_argument("--max-bytes", type=size, default=None)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    with open(args.results) as f:
        rows = [json.loads(line) for line in f if line.strip()]

    def chosen(prefix):
        return [r for r in rows if r.get("section") == args.section
                and str(r.get("label", "")).startswith(prefix) and r.get("bytes") is not None
                and r["bytes"] >= args.min_bytes
                and (args.max_bytes is None or r["bytes"] <= args.max_bytes)]

    def key(r):
        return r.get("collective"), r.get("nranks"), r.get("dtype"), r.get("bytes")

    cases = []
    if args.mode == "pair":
        den = {key(r): r for r in chosen(args.den)}
        for r in chosen(args.num):
            d = den.get(key(r))
            if d is None or not d.get(args.field):
                continue
            cases.append((key(r), r[args.field] / d[args.field], f"{r[args.field]:.4g} / {d[args.field]:.4g}"))
        what = f"{args.field} of '{args.num}' / '{args.den}'"
    else:
        for r in chosen(args.label):
            if r.get(args.field) is not None:
                cases.append((key(r), r[args.field], ""))
        what = f"{args.field} of '{args.label}'"
    one_of = getattr(args, "one_of", None)
    bound = (f">= {args.at_least:g}" if args.at_least is not None else
             f"<= {args.at_most:g}" if args.at_most is not None else f"in {','.join(one_of)}")

    def meets(v):
        if one_of is not None:
            return v in one_of
        if isinstance(v, str):  # (a name where a number was expected)
            return False
        return v >= args.at_least if args.at_least is not None else v <= args.at_most

    def shown(v):
        return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)

    ok = bool(cases) and all(meets(v) for _, v, _ in cases)
    for (coll, n, dtype, nbytes), v, detail in cases:
        print(f"judge: {what}: {coll} {n} ranks {dtype} {nbytes} B: {shown(v)}"
              f"{f' ({detail})' if detail else ''} {'meets' if meets(v) else 'MISSES'} {bound}")
    if not cases:
        print(f"judge: {what}: no rows in section {args.section} to compare: target {bound} not met")
    with open(args.results, "a") as out:
        out.write(json.dumps({"section": args.section, "judge": f"{what} {bound}", "ok": ok,
                              "cases": [{"collective": c, "nranks": n, "dtype": d, "bytes": b, "value": v}
                                        for (c, n, d, b), v, _ in cases]}) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
