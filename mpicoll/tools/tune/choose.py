"""Choosing: from measured (or predicted) times to the selection a tuning file holds.

At every size an algorithm within :data:`~policy.CLOSE` of the fastest
measured, with the fewest switches between sizes (:func:`winners`); the size
ranges' boundaries where the cost model's curves cross (:func:`size_ranges`);
per algorithm the segment size and window by size (:func:`choose_segments`,
:func:`segment_rows`); and the 5 % rule checked on what a file selects
(:func:`rule_rows`).
"""

from __future__ import annotations

import datetime
import math

import numpy as np

from ...core import config as _config
from ...engine import select as _select
from ...engine import tuning as _tuning
from .. import costmodel as _costmodel
from ..harness import cli as _cli
from . import policy as P
from .measure import algorithms_of, seg_key


def choose_segments(times, seg, default_key):
    """(times with each tuned point at its chosen variant's time, {collective: {algorithm:
    {bytes: key}}}, {collective: {bytes: fastest seconds over every algorithm and variant}}).

    A point keeps the options' variant (its fastest time in ``times``) unless
    another is faster by more than :data:`~policy.PREFER_DEFAULT`; the
    algorithm's time there is then its chosen variant's, and the fastest is the
    fastest measured at all, so the 5 % rule of :func:`winners` holds for what
    "auto" runs.
    """
    eff = {c: {a: dict(t) for a, t in per.items()} for c, per in times.items()}
    chosen, fastest = {}, {}
    for c, per in times.items():
        fastest[c] = {nb: min(t[nb] for t in per.values() if nb in t)
                      for nb in {x for t in per.values() for x in t}}
        for a, pts in seg.get(c, {}).items():
            for nb, variants in pts.items():
                cands = dict(variants)
                cands[default_key] = times[c][a][nb]
                best = min(cands, key=cands.get)
                key = default_key if cands[default_key] <= P.PREFER_DEFAULT * cands[best] else best
                chosen.setdefault(c, {}).setdefault(a, {})[nb] = key
                eff[c][a][nb] = cands[key]
                fastest[c][nb] = min(fastest[c][nb], cands[best])
            # a size measured with the options only (a half step) keeps the options: the
            # file then gives nothing there that was not measured
            for nb in times[c][a]:
                if nb >= P.SEG_MIN and nb not in pts:
                    chosen[c][a][nb] = default_key
    return eff, chosen, fastest


def segment_rows(points: dict, default_key: str) -> list:
    """[[max_bytes, segment_bytes | None, window | None], ...] of one algorithm's chosen
    variants ({bytes: key}): the options below the first tuned size and wherever the
    options' variant was chosen; between two tuned sizes the boundary is their geometric
    mean; the last tuned size's variant holds above it."""
    pts = sorted(points.items())
    rows = [[pts[0][0] - 1, None, None]]
    for i, (nb, key) in enumerate(pts):
        limit = None if i == len(pts) - 1 else int(math.sqrt(nb * pts[i + 1][0]))
        if key == default_key:
            row = [limit, None, None]
        else:
            sg, w = (int(x) for x in key.split(":"))
            row = [limit, sg, w]
        if rows[-1][1:] == row[1:]:
            rows[-1][0] = limit
        else:
            rows.append(row)
    if rows[-1][1:] == [None, None] and len(rows) > 1 and rows[-2][1:] == [None, None]:
        rows.pop(-2)
    return [] if all(r[1:] == [None, None] for r in rows) else rows


def winners(per_algo: dict, fastest: dict | None = None) -> list[tuple[int, str]]:
    """[(size, algorithm)]: at every size an algorithm within :data:`~policy.CLOSE` of the
    fastest, with the fewest switches between sizes; among equal choices the faster.
    ``fastest``: {size: seconds} of the fastest measured there when that is not one of
    ``per_algo``'s (a variant not chosen).
    """
    sizes = sorted(set.union(*(set(t) for t in per_algo.values())))
    algos = list(per_algo)  # (one not measured at a size is not a choice there)
    # cost[a]: (switches, summed time relative to the best) of the best path ending in a
    cost, back = {}, []
    for i, s in enumerate(sizes):
        best = min(per_algo[a][s] for a in algos if s in per_algo[a])
        if fastest is not None and s in fastest:
            best = min(best, fastest[s])
        near = [a for a in algos if per_algo[a].get(s, math.inf) <= P.CLOSE * best]
        new, prev = {}, {}
        for a in near:
            rel = per_algo[a][s] / best if best > 0 else 1.0
            if i == 0:
                new[a], prev[a] = (0, rel), None
                continue
            b = min(cost, key=lambda b: (cost[b][0] + (b != a), cost[b][1]))
            new[a], prev[a] = (cost[b][0] + (b != a), cost[b][1] + rel), b
        cost = new
        back.append(prev)
    a = min(cost, key=lambda a: cost[a])
    path = [a]
    for prev in reversed(back[1:]):
        a = prev[a]
        path.append(a)
    return list(zip(sizes, reversed(path)))


def size_ranges(collective, wins, model, nranks, ppn, itemsize) -> list:
    """[[max_bytes, algorithm], ..., [None, algorithm]] from the per-size winners.

    Between a size won by A and the next won by B the boundary is the last
    size (a multiple of 8 elements' bytes, checked at 32 points) where the
    model predicts A no slower than B; where the model disagrees with both
    measurements it is the last measured size of A.
    """
    rows = []
    for (s0, a), (s1, b) in zip(wins, wins[1:]):
        if a == b:
            continue
        limit = s0
        if model is not None:
            grid = np.unique(np.geomspace(s0, s1, 34)[1:-1].astype(int) // (8 * itemsize) * 8 * itemsize)
            ok = [s for s in grid if s0 < s < s1 and
                  model.predict(collective, a, s, nranks, ppn, itemsize)
                  <= model.predict(collective, b, s, nranks, ppn, itemsize)]
            if ok:
                limit = int(max(ok))
        rows.append([limit, a])
    rows.append([None, wins[-1][1]])
    return rows


def predicted_entry(model, source, n: int, ppn: int, itemsize: int, command: str) -> dict:
    """The tuning-file entry the model predicts for ``n`` ranks, ``ppn`` per node: per
    collective the fastest predicted algorithm by size (boundaries where the curves
    cross), marked ``"source": "model"`` with the measured entry it comes from."""
    nodes = -(-n // ppn)
    labels = [r // ppn for r in range(n)]
    sizes = _cli.sizes(8 * n * itemsize, 64 << 20, 2.0)
    selection = {}
    for c in _tuning.COLLECTIVES:
        allowed = algorithms_of(c, labels)
        rows = _costmodel.crossovers(model, c, n, ppn, sizes, itemsize)
        wins = [(nb, min(allowed, key=times.get)) for nb, _, times in rows]
        selection[c] = size_ranges(c, wins, model, n, ppn, itemsize)
    m = source.raw["measured"]
    return {
        "source": "model", "ranks": [n, n], "nodes": [nodes, nodes],
        "measured": m,
        "predicted": {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "ranks": n, "nodes": nodes, "ranks_per_node": ppn,
            "from": {"ranks": list(source.ranks), "nodes": list(source.nodes),
                     "date": m.get("date"), "host": m.get("host")},
        },
        "selection": selection,
    }


# --- the 5 % rule ---------------------------------------------------------------------

def rule_rows(raw: dict) -> list[dict]:
    """What an entry's selection runs at each measured size against the fastest measured.

    One dict per (collective, size): ``chosen`` (algorithm, or algorithm and
    ``seg:win`` where the entry's segments give another variant than the
    options'), ``chosen_us`` (None: that variant was not measured),
    ``fastest``, ``fastest_us`` (over every algorithm and variant measured)
    and ``ratio``.
    """
    algorithms = {c: tuple(t) for c, t in _select.ALGORITHMS.items()}
    sel = _tuning.parse_selection(raw.get("selection"), algorithms, "selection")
    segs = _tuning.parse_segments(raw.get("segments"), algorithms, "segments")
    default = raw.get("seg_default") or seg_key(_config.TABLE["segment_bytes"].default,
                                                 _config.TABLE["window"].default)
    dseg, dwin = (int(x) for x in default.split(":"))
    lookup = _select.Selection({}, "", entry=None)
    lookup.segments = segs
    out = []
    for c, per in (raw.get("times_us") or {}).items():
        if c not in sel or not per:
            continue
        seg_us = (raw.get("segment_us") or {}).get(c, {})
        for size in sorted({int(x) for t in per.values() for x in t}):
            key = str(size)
            combos = {a: t[key] for a, t in per.items() if key in t}
            for a, pts in seg_us.items():
                for k, us in pts.get(key, {}).items():
                    if k != default:  # the options' variant: times_us holds its fastest
                        combos[f"{a} {k}"] = us
            name = next(a for limit, a in sel[c] if limit is None or size <= limit)
            tuned = lookup.segment(c, name, size)
            if tuned is not None:
                k = seg_key(tuned[0] or dseg, tuned[1] or dwin)
                name = name if k == default else f"{name} {k}"
            best = min(combos, key=combos.get)
            got = combos.get(name)
            out.append({"collective": c, "bytes": size, "chosen": name, "chosen_us": got,
                        "fastest": best, "fastest_us": combos[best],
                        "ratio": got / combos[best] if got is not None and combos[best] > 0
                        else None})
    return out


def rule_holds(row) -> bool:
    # (the file keeps times to the nanosecond: a ratio at the limit may round over by 1e-3)
    return row["ratio"] is not None and row["ratio"] <= P.CLOSE + 1e-3


def write_rule(out, rows, header: str = "") -> int:
    """The 5 % rule's table; returns how many sizes break it."""
    w = out.write
    bad = 0
    if header:
        w(header)
    w(f"#{'collective':>14} {'size (B)':>10} {'chosen':>28} {'us':>9} {'fastest':>28} "
      f"{'us':>9} {'ratio':>6}\n")
    for r in rows:
        ok = rule_holds(r)
        bad += not ok
        got = f"{r['chosen_us']:9.2f}" if r["chosen_us"] is not None else f"{'-':>9}"
        ratio = f"{r['ratio']:6.3f}" if r["ratio"] is not None else f"{'-':>6}"
        w(f" {r['collective']:>14} {r['bytes']:>10} {r['chosen'][:28]:>28} {got} "
          f"{r['fastest'][:28]:>28} {r['fastest_us']:9.2f} {ratio}"
          f"{'' if ok else '  <- over 5 %' if r['ratio'] is not None else '  <- not measured'}\n")
    w(f"# the chosen algorithm within 5 % of the fastest measured: {len(rows) - bad} of "
      f"{len(rows)} sizes\n")
    return bad
