"""Draw the ring ReduceScatter and AllGather step by step as SVG (docs/ring.svg).

    python docs/make_ring_diagram.py                 # 4 ranks -> docs/ring.svg
    python docs/make_ring_diagram.py -n 5 -o /tmp/ring5.svg

Pure Python, no dependency.  The schedule drawn is the one in
mpicoll/algorithms/ring.py (ranks in ring order 0, 1, ..., n-1):

    ReduceScatter, step s = 0 .. n-2: rank p sends its partial sum of block
        (p-1-s) mod n to rank p+1, and receives the partial of block
        (p-2-s) mod n from rank p-1, adding its own contribution to it.
        After n-1 steps rank p holds block p summed over all ranks.
    AllGather, step s = 0 .. n-2: rank p sends block (p-s) mod n to rank p+1
        and receives block (p-1-s) mod n from rank p-1.

The script simulates both schedules (sets of contributions per rank and
block), checks that they end where they must, and draws each step: one row
per rank, one cell per block, the block a rank sends outlined in red, the
block it receives outlined dashed.  Output is deterministic.
"""

from __future__ import annotations

import argparse
from html import escape
from pathlib import Path

CELL, GAP_CELL, ROW, COL_GAP = 46, 3, 34, 34
LEFT, TOP_PAD = 70, 12
SEND, RECV = "#c62828", "#1565c0"


def reduce_scatter(n):
    """States before each step and after the last: state[p][b] = set of ranks summed in."""
    state = [[{p} for _ in range(n)] for p in range(n)]
    states, moves = [], []
    for s in range(n - 1):
        sends = {p: (p - 1 - s) % n for p in range(n)}
        recvs = {p: (p - 2 - s) % n for p in range(n)}
        states.append([[set(c) for c in row] for row in state])
        moves.append((sends, recvs))
        new = [[set(c) for c in row] for row in state]
        for p in range(n):
            q = (p + 1) % n
            assert recvs[q] == sends[p]
            new[q][sends[p]] = state[p][sends[p]] | state[q][sends[p]]
        state = new
    states.append(state)
    for p in range(n):
        assert state[p][p] == set(range(n)), f"rank {p} does not hold block {p} fully reduced"
    return states, moves


def allgather(n):
    """States before each step and after the last: state[p][b] = True when rank p has block b."""
    state = [[b == p for b in range(n)] for p in range(n)]
    states, moves = [], []
    for s in range(n - 1):
        sends = {p: (p - s) % n for p in range(n)}
        recvs = {p: (p - 1 - s) % n for p in range(n)}
        states.append([row[:] for row in state])
        moves.append((sends, recvs))
        new = [row[:] for row in state]
        for p in range(n):
            q = (p + 1) % n
            assert recvs[q] == sends[p] and state[p][sends[p]] and not state[q][sends[p]]
            new[q][sends[p]] = True
        state = new
    states.append(state)
    assert all(all(row) for row in state), "a rank misses a block after the AllGather"
    return states, moves


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


def draw(n: int) -> str:
    rs_states, rs_moves = reduce_scatter(n)
    ag_states, ag_moves = allgather(n)
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
    p.add_argument("-o", "--output", default=str(Path(__file__).with_name("ring.svg")),
                   help="SVG file to write (default docs/ring.svg)")
    args = p.parse_args()
    if not 2 <= args.ranks <= 8:
        p.error(f"--ranks: expected 2 to 8, got {args.ranks}")
    Path(args.output).write_text(draw(args.ranks), encoding="utf-8")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
