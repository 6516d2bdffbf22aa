"""A cost model of mpicoll's algorithms, fitted from ``python -m mpicoll.tune``'s measurements.

Inputs (all measured by the tool, stored in the tuning file):

exchange curve per level
    the time of one ``Sendrecv`` of s bytes between two ranks (both send at
    once, as every step of these algorithms does), at the sizes measured,
    with the protocol cliffs (eager limits) bracketed by probes a few bytes
    apart.  Levels: ``intra`` (two ranks of one node) and ``inter`` (two
    ranks on different nodes; absent on one node, then ``intra`` stands in
    and the prediction says so).  Between measured sizes the time is
    interpolated linearly, above the largest it grows at the last slope.
reduction rate
    seconds per byte of ``np.add`` into an output, measured on this rank.
overheads
    per call and per schedule operation (mpicoll's Python executor), fitted
    by least squares to the measured collective times.

The schedule of an algorithm (its builder, for any :class:`Shape`) gives
every rank's messages: grouped by their label's (phase, step), a step costs
the sum of its messages' exchange times to the same peer (the slowest peer
when it has several), at the level of the link (a peer on another node:
``inter``), and at least the exchange of every byte its node's ranks send to
other nodes in that step (they share the node's link).  The schedules are
built with the layout's node labels (ranks placed node by node), as a
communicator's are.  A rank's time is the sum of its steps, its reductions and its
operations' overhead; the algorithm's is the slowest rank's, over a sample
of ranks that covers the node boundaries (ranks placed node by node).
"""

from __future__ import annotations

import bisect
import functools

import numpy as np

from ..algorithms.schedule import Copy, Reduce, Send, Shape
from ..core import config as _config
from ..engine import select as _select


class Curve:
    """Piecewise-linear time (seconds) of an exchange by size (bytes)."""

    def __init__(self, sizes, seconds):
        pts = sorted(zip(sizes, seconds))
        self.x = [float(s) for s, _ in pts]
        self.y = [float(t) for _, t in pts]
        if len(self.x) >= 2:
            # the slope above the largest size: bandwidth of the last two points
            dx = self.x[-1] - self.x[-2]
            self.tail = max((self.y[-1] - self.y[-2]) / dx, 0.0) if dx > 0 else 0.0
        else:
            self.tail = 0.0

    def __call__(self, nbytes: float) -> float:
        x, y = self.x, self.y
        if nbytes <= x[0]:
            return y[0]
        if nbytes >= x[-1]:
            return y[-1] + (nbytes - x[-1]) * self.tail
        i = bisect.bisect_right(x, nbytes)
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        return y0 + (y1 - y0) * (nbytes - x0) / (x1 - x0)


class Model:
    """Fitted parameters: exchange curves by level, reduction rate, overheads."""

    def __init__(self, p2p: dict, reduce_s_per_byte: float, call_s: float = 0.0,
                 op_s: float = 0.0):
        self.p2p = p2p
        self.curves = {level: Curve(c["bytes"], [u * 1e-6 for u in c["us"]])
                       for level, c in p2p.items() if c}
        if not self.curves:
            raise ValueError("the model needs an exchange curve (intra- or inter-node)")
        self.reduce_s_per_byte = reduce_s_per_byte
        self.call_s, self.op_s = call_s, op_s

    @property
    def measured_inter(self) -> bool:
        return "inter" in self.curves

    def to_json(self) -> dict:
        return {"reduce_s_per_byte": self.reduce_s_per_byte, "call_s": self.call_s,
                "op_s": self.op_s}

    @classmethod
    def from_entry(cls, entry: dict) -> Model:
        m = entry.get("model") or {}
        return cls(entry["p2p"], m.get("reduce_s_per_byte", 0.0), m.get("call_s", 0.0),
                   m.get("op_s", 0.0))

    # --- prediction -----------------------------------------------------------

    def parts(self, collective, algorithm, nbytes, nranks, ppn, itemsize=8):
        """(communication + reduction seconds, operations) of the slowest sampled rank."""
        build = _select.builder(collective, algorithm)
        worst = (0.0, 0)
        for rank in sample_ranks(nranks, ppn):
            sched = _schedule(build, collective, nbytes, nranks, ppn, rank, itemsize)
            first = rank // ppn * ppn
            link = _node_link(build, collective, nbytes, nranks, ppn, first, itemsize)
            t, nops = self._rank_time(sched, rank, ppn, itemsize, link)
            worst = max(worst, (t, nops))
        return worst

    def predict(self, collective, algorithm, nbytes, nranks, ppn, itemsize=8) -> float:
        """Predicted seconds of one call."""
        t, nops = self.parts(collective, algorithm, nbytes, nranks, ppn, itemsize)
        return t + self.call_s + self.op_s * nops

    def _rank_time(self, sched, rank, ppn, itemsize, link=None):
        # a tuning of one rank per node has no intra-node curve: every exchange it
        # measured crosses nodes, and a prediction that needs one assumes it as fast
        intra = self.curves.get("intra") or self.curves["inter"]
        inter = self.curves.get("inter", intra)
        node = rank // ppn
        steps: dict = {}  # (phase, step) or op index -> {peer: seconds}
        across: dict = {}  # the same key -> bytes this rank sends to other nodes in that step
        t = 0.0
        for i, op in enumerate(sched.ops):
            kind = type(op)
            if kind is Send:
                key = (op.label.phase, op.label.step) if op.label is not None else i
                nbytes = op.region.count * itemsize
                if op.peer // ppn == node:
                    seconds = intra(nbytes)
                else:
                    seconds = inter(nbytes)
                    across[key] = across.get(key, 0) + nbytes
                per_peer = steps.setdefault(key, {})
                per_peer[op.peer] = per_peer.get(op.peer, 0.0) + seconds
            elif kind is Reduce:
                t += op.out.count * itemsize * self.reduce_s_per_byte
            elif kind is Copy:
                t += op.dst.count * itemsize * self.reduce_s_per_byte * 0.5
        # A step's messages to several peers overlap (the slowest peer), but those to other
        # nodes share the node's link with every message its other ranks send to other
        # nodes in the same step (``link``: bytes per step, the node's ranks together): the
        # step takes at least those bytes through one exchange.  (The direct schedule at
        # 4 nodes x 1 was predicted 3x too fast without this rank's share; recursive doubling
        # and direct at 2 nodes x 2 about 2x without the node's: both ranks cross at once.)
        link = across if link is None else link
        t += sum(max(max(p.values()), inter(link.get(k, across[k])) if k in across else 0.0)
                 for k, p in steps.items())
        return t, len(sched.ops)

    def fit(self, points, ppn, itemsize=8) -> None:
        """Fit the per-call and per-operation overheads to measured points.

        ``points``: (collective, algorithm, nbytes, nranks, seconds).  Least
        squares on the relative error (every size counts alike); both >= 0.
        """
        rows, rhs = [], []
        for collective, algorithm, nbytes, nranks, seconds in points:
            t, nops = self.parts(collective, algorithm, nbytes, nranks, ppn, itemsize)
            w = 1.0 / seconds
            rows.append([w, nops * w])
            rhs.append((seconds - t) * w)
        if not rows:
            return
        a, b = np.asarray(rows), np.asarray(rhs)
        coef = np.linalg.lstsq(a, b, rcond=None)[0]
        if coef[0] < 0 or coef[1] < 0:  # one of them alone
            best = None
            for j in (0, 1):
                col = a[:, j]
                c = max(float(col @ b / (col @ col)), 0.0) if col @ col > 0 else 0.0
                err = float(np.sum((b - c * col) ** 2))
                if best is None or err < best[0]:
                    best = (err, j, c)
            coef = [0.0, 0.0]
            coef[best[1]] = best[2]
        self.call_s, self.op_s = float(coef[0]), float(coef[1])


def sample_ranks(nranks: int, ppn: int) -> list[int]:
    """Ranks whose times bound every rank's: the ends of the first two nodes and the last rank."""
    picks = {0, min(ppn - 1, nranks - 1), min(ppn, nranks - 1), nranks - 1,
             min(nranks - 1, max(nranks // 2, 0))}
    return sorted(picks)


@functools.lru_cache(maxsize=4096)
def _schedule(build, collective, nbytes, nranks, ppn, rank, itemsize):
    """``rank``'s schedule of a call of ``nbytes`` as it runs with ranks placed node by node,
    ``ppn`` per node: the node labels are part of the shape, since the schedules depend on
    them (the hierarchical levels, pairing by ring position, the pieces to a rank of the
    same node), and the ring order of block placement is the ranks' own."""
    nodes = tuple(r // max(ppn, 1) for r in range(nranks))
    seg = max(1, _config.TABLE["segment_bytes"].default // itemsize)
    window = _config.TABLE["window"].default
    if collective == "allreduce":
        total = max(nbytes // itemsize, 1)
        counts, displs = (total,), (0,)
    else:
        per = max(nbytes // (itemsize * nranks), 1)
        counts = (per,) * nranks
        displs = tuple(per * r for r in range(nranks))
        total = per * nranks
    shape = Shape(nranks, rank, tuple(range(nranks)), rank, total, counts, displs, seg, window,
                  False, True, nodes)
    return build(shape)


@functools.lru_cache(maxsize=4096)
def _node_link(build, collective, nbytes, nranks, ppn, first, itemsize) -> dict:
    """{(phase, step): bytes} the ranks of the node whose first rank is ``first`` send to
    other nodes in each step, together (the load on that node's link)."""
    link: dict = {}
    for rank in range(first, min(first + ppn, nranks)):
        for op in _schedule(build, collective, nbytes, nranks, ppn, rank, itemsize).ops:
            if type(op) is Send and op.peer // ppn != rank // ppn:
                key = (op.label.phase, op.label.step) if op.label is not None else None
                link[key] = link.get(key, 0) + op.region.count * itemsize
    return link


def crossovers(model, collective, nranks, ppn, sizes, itemsize=8):
    """[(size, fastest algorithm, {algorithm: seconds})] predicted at ``sizes``."""
    out = []
    for nbytes in sizes:
        times = {a: model.predict(collective, a, nbytes, nranks, ppn, itemsize)
                 for a in _select.ALGORITHMS[collective]}
        out.append((nbytes, min(times, key=times.get), times))
    return out
