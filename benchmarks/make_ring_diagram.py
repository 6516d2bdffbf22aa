"""Draw the ring ReduceScatter and AllGather step by step as SVG (docs/ring.svg).

    python benchmarks/make_ring_diagram.py                 # 4 ranks -> docs/ring.svg
    python benchmarks/make_ring_diagram.py -n 5 -o /tmp/ring5.svg

The schedule drawn is the library's own: the ring AllReduce schedule builder
of mpicoll/algorithms/ring.py (see mpicoll/algorithms/schedule.py), built for
every rank of an n-rank ring in rank order with one element per block and
unsegmented blocks.  Each Send/Recv label gives the step, the phase
("reduce-scatter", then "allgather") and the block a message carries:

    ReduceScatter, step s = 0 .. n-2: rank p sends its partial sum of block
        (p-1-s) mod n to rank p+1, and receives the partial of block
        (p-2-s) mod n from rank p-1, adding its own contribution to it.
        After n-1 steps rank p holds block p summed over all ranks.
    AllGather, step s = 0 .. n-2: rank p sends block (p-s) mod n to rank p+1
        and receives block (p-1-s) mod n from rank p-1.

The script checks that every message is received by its peer in the same
step with the same block, follows the contributions (sets of ranks per rank
and block) through the messages, checks that both phases end where they
must, and draws each step: one row per rank, one cell per block, the block a
rank sends outlined in red, the block it receives outlined dashed.  Output is
deterministic.
"""

from __future__ import annotations

import argparse
import sys
from html import escape
from pathlib import Path

CELL, GAP_CELL, ROW, COL_GAP = 46, 3, 34, 34
LEFT, TOP_PAD = 70, 12
SEND, RECV = "#c62828", "#1565c0"
PHASES = ("reduce-scatter", "allgather")


def ring_builder():
    """The ring AllReduce schedule builder of mpicoll.algorithms.ring."""
    try:
        from mpicoll.algorithms import ring
    except ImportError:  # run from a checkout without installing: the package is next door
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from mpicoll.algorithms import ring
    table = getattr(ring, "SCHEDULES", {})
    build = (table.get(("allreduce", "ring")) or table.get("allreduce")
             or getattr(ring, "allreduce_schedule", None))
    if build is None:
        raise SystemExit("mpicoll.algorithms.ring has no AllReduce schedule builder "
                         "(SCHEDULES[('allreduce', 'ring')] or allreduce_schedule)")
    return build


def moves(n, build):
    """{phase: [(sends, recvs) per step, in step order]}: sends[p] = the block rank p sends.

    Read from the labels of the schedules ``build`` gives for ranks 0..n-1;
    each message must be received by its peer in the same step, same block.
    """
    from mpicoll.algorithms.schedule import Recv, Send, Shape

    ring = tuple(range(n))
    out = {phase: {} for phase in PHASES}
    posted = {}  # (source, dest) -> [(step, phase, block)] sent, in order
    taken = {}   # (source, dest) -> [(step, phase, block)] received, in order
    for p in range(n):
        shape = Shape(n, p, ring, p, n, (n,), (0,), n, 2, False)
        for op in build(shape).ops:
            if type(op) not in (Send, Recv):
                continue
            lab = op.label
            assert lab is not None and lab.phase in PHASES, f"rank {p}: {op} has no ring label"
            sends, recvs = out[lab.phase].setdefault(lab.step, ({}, {}))
            side, link = (sends, posted) if type(op) is Send else (recvs, taken)
            assert side.get(p, lab.block) == lab.block, f"rank {p}: two blocks in step {lab.step}"
            side[p] = lab.block
            key = (p, op.peer) if type(op) is Send else (op.peer, p)
            link.setdefault(key, []).append((lab.step, lab.phase, lab.block))
    assert posted == taken, "a message is not received in the step and block it was sent"
    return {phase: [steps[s] for s in sorted(steps)] for phase, steps in out.items()}


def _follow(n, steps, state, merge):
    """States before each step and after the last, following the messages of ``steps``."""
    states = []
    for sends, recvs in steps:
        states.append([[set(c) if isinstance(c, set) else c for c in row] for row in state])
        new = [row[:] for row in state]
        for p, b in sends.items():
            q = (p + 1) % n
            assert recvs.get(q) == b, f"rank {q} does not receive block {b} from rank {p}"
            new[q][b] = merge(state[p][b], state[q][b])
        state = new
    states.append(state)
    return states


def reduce_scatter(n, steps):
    """States of the ReduceScatter: state[p][b] = set of ranks summed into rank p's block b."""
    states = _follow(n, steps, [[{p} for _ in range(n)] for p in range(n)], lambda a, b: a | b)
    for p in range(n):
        assert states[-1][p][p] == set(range(n)), f"rank {p} does not hold block {p} fully reduced"
    return states


def allgather(n, steps):
    """States of the AllGather: state[p][b] = True when rank p has block b."""
    def merge(have, mine):
        assert have and not mine, "a block sent before it arrived, or received twice"
        return True
    states = _follow(n, steps, [[b == p for b in range(n)] for p in range(n)], merge)
    assert all(all(row) for row in states[-1]), "a rank misses a block after the AllGather"
    return states


def _fill(frac):
    """White (nothing) to dark blue (everything) by the fraction of contributions summed."""
    lo, hi = (236, 242, 250), (21, 67, 132)
    rgb = tuple(round(a + (b - a) * frac) for a, b in zip(lo, hi))
    return "#{:02x}{:02x}{:02x}".format(*rgb)


class Svg:
    def __init__(self):
        self.items = []

    def rect(self, x, y, w, h, fill, stroke="#90a4ae", width=1, dash=None):
        d = f' stroke-dasharray="{dash}"' if dash else ""
        self.items.append(f'<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}" '
                          f'stroke="{stroke}" stroke-width="{width}"{d}/>')

    def text(self, x, y, s, size=12, anchor="middle", fill="#263238", weight="normal"):
        self.items.append(f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" '
                          f'fill="{fill}" font-weight="{weight}">{escape(s)}</text>')

    def line(self, x1, y1, x2, y2, stroke="#546e7a", width=1.5, arrow=True):
        m = ' marker-end="url(#arrow)"' if arrow else ""
        self.items.append(f'<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{stroke}" '
                          f'stroke-width="{width}"{m}/>')

    def render(self, width, height):
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">\n'
                '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
                'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
                'fill="#546e7a"/></marker></defs>\n'
                f'<rect width="{width}" height="{height}" fill="white"/>\n')
        return head + "\n".join(self.items) + "\n</svg>\n"


def _label(contrib, n):
    if len(contrib) == n:
        return "Σ"
    if len(contrib) > 3:  # too long for a cell: say how many
        return f"{len(contrib)} of {n}"
    return "+".join(str(r) for r in sorted(contrib))


def panel(svg, y0, n, title, states, moves, kind):
    """Draw one phase; returns the y below it."""
    block_w = n * CELL + (n - 1) * GAP_CELL
    svg.text(10, y0 + 16, title, size=15, anchor="start", weight="bold")
    y = y0 + 44
    ncols = len(states)
    for c in range(ncols):
        x = LEFT + c * (block_w + COL_GAP)
        head = f"step {c + 1}" if c < ncols - 1 else "result"
        svg.text(x + block_w / 2, y - 8, head, size=13, weight="bold")
        if c < ncols - 1:
            svg.line(x + block_w + 4, y + n * ROW / 2, x + block_w + COL_GAP - 4, y + n * ROW / 2)
    for b in range(n):
        svg.text(LEFT + b * (CELL + GAP_CELL) + CELL / 2, y + n * ROW + 14, f"block {b}",
                 size=10, fill="#607d8b")
    for p in range(n):
        svg.text(LEFT - 10, y + p * ROW + ROW / 2 + 4, f"rank {p}", size=12, anchor="end")
        for c, state in enumerate(states):
            x = LEFT + c * (block_w + COL_GAP)
            sends, recvs = moves[c] if c < len(moves) else ({}, {})
            for b in range(n):
                cx, cy = x + b * (CELL + GAP_CELL), y + p * ROW + 3
                h = ROW - 6
                if kind == "rs" and c == len(states) - 1 and b != p:
                    # partial sums left in work buffers are not part of the result
                    svg.rect(cx, cy, CELL, h, "#fafafa")
                    label, dark = "", False
                elif kind == "rs":
                    frac = len(state[p][b]) / n
                    svg.rect(cx, cy, CELL, h, _fill(frac))
                    label = _label(state[p][b], n)
                    dark = frac > 0.55
                else:
                    have = state[p][b]
                    svg.rect(cx, cy, CELL, h, _fill(1.0) if have else "#fafafa")
                    label = "Σ" if have else ""
                    dark = have
                if sends.get(p) == b:
                    svg.rect(cx - 1.5, cy - 1.5, CELL + 3, h + 3, "none", SEND, 3)
                if recvs.get(p) == b:
                    svg.rect(cx + 2, cy + 2, CELL - 4, h - 4, "none", RECV, 2, "4 3")
                svg.text(cx + CELL / 2, cy + h / 2 + 4, label, size=11,
                         fill="white" if dark else "#263238")
    return y + n * ROW + 26


def legend(svg, y, n):
    x = LEFT
    svg.rect(x, y, 22, 14, "none", SEND, 3)
    svg.text(x + 30, y + 11, "block this rank sends to rank p+1 in this step", size=12, anchor="start")
    svg.rect(x + 360, y, 22, 14, "none", RECV, 2, "4 3")
    svg.text(x + 390, y + 11, "block it receives from rank p-1 (ReduceScatter: and adds its own to)",
             size=12, anchor="start")
    svg.text(x, y + 34, f"cell text: which ranks' contributions the rank's copy of the block holds; "
             f"Σ = all {n}.  Ring: rank p sends to p+1 (mod {n}), receives from p-1.",
             size=12, anchor="start")
    svg.text(x, y + 52, "A standalone AllGather is the same with rank p's own block p in place of "
             "the sum.", size=12, anchor="start")
    svg.text(x, y + 70, "Each rank sends one block (1/n of the array) per step: (n-1)/n of the array "
             "per phase, 2(n-1)/n for an AllReduce.", size=12, anchor="start")
    return y + 82


def draw(n: int, build=None) -> str:
    """The SVG of the ring schedule ``build`` (default: the library's) at ``n`` ranks."""
    steps = moves(n, build or ring_builder())
    rs_moves, ag_moves = steps["reduce-scatter"], steps["allgather"]
    rs_states = reduce_scatter(n, rs_moves)
    ag_states = allgather(n, ag_moves)
    svg = Svg()
    y = TOP_PAD
    y = panel(svg, y, n, f"Ring ReduceScatter, {n} ranks: {n - 1} steps; rank p ends with "
              f"block p summed over all ranks", rs_states, rs_moves, "rs")
    y = panel(svg, y + 8, n, f"Ring AllGather, {n} ranks: {n - 1} steps (AllReduce = ReduceScatter, "
              f"then this)", ag_states, ag_moves, "ag")
    y = legend(svg, y + 4, n)
    block_w = n * CELL + (n - 1) * GAP_CELL
    width = max(LEFT + n * (block_w + COL_GAP), 900)
    return svg.render(width, y + 8)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-n", "--ranks", type=int, default=4, help="ranks in the ring (2-8, default 4)")
    p.add_argument("-o", "--output",
                   default=str(Path(__file__).resolve().parent.parent / "docs" / "ring.svg"),
                   help="SVG file to write (default docs/ring.svg)")
    args = p.parse_args()
    if not 2 <= args.ranks <= 8:
        p.error(f"--ranks: expected 2 to 8, got {args.ranks}")
    Path(args.output).write_text(draw(args.ranks), encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
