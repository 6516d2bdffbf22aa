"""Ring algorithms: ReduceScatter, AllGather, and AllReduce as their composition.

Block split
    ``split(N, n)`` cuts N elements into n contiguous blocks the way
    ``numpy.array_split`` does: the first ``N % n`` blocks hold ``N // n + 1``
    elements, the rest ``N // n``.  Blocks may be empty (N < n, N = 0); both
    ends of a link know it, so AllGather and AllReduce never send an empty
    block and nothing waits for one (ReduceScatter sends empty pieces, below).

Ring
    ``ctx.ring`` lists the ranks in ring order (see transport.topology); the rank at
    position p sends to position p+1 and receives from p-1.  Block b belongs
    to the rank at position b (ReduceScatter: the block of that rank's
    ``counts`` entry).

ReduceScatter (n-1 steps)
    At step s the rank at position p sends its partial of block p-1-s and
    receives the partial of block p-2-s from the left, reducing its own input
    into it.  After step n-2 it holds block p reduced over all ranks.

AllGather (n-1 steps)
    At step s position p sends block p-s and receives block p-1-s.

Schedules
    Each algorithm is a schedule builder ``*_schedule(shape) -> Schedule`` (see
    algorithms.schedule): the messages, reductions and copies of one rank in
    issue order, with the step, block and segment of every message on its
    label.  The executor (engine.executor) runs them.

Pipelining
    Blocks are cut into segments of ``seg`` elements.  Receives are posted
    ``window`` segments ahead into a small ring of work slots (work memory
    from the context's arena, see engine.workmem), so while one
    segment is reduced the next ones are already arriving; a reduced segment
    is forwarded to the right at once.  AllReduce needs only ``window``
    segments of work memory: partials live in the output buffer.
    ReduceScatter forwards partials from ``window`` send slots, reused once
    their sends complete; it processes segments in groups (see
    :func:`reduce_scatter_schedule`) so that this bounded memory cannot deadlock.
    The AllGather reduces nothing, so it moves pieces of
    ``AG_SEGMENT_FACTOR`` segments: fewer messages, and every link is busy at
    every step anyway.

Tuning
    ``MPICOLL_SEGMENT_BYTES`` (bytes, suffixes K/M/G) and ``MPICOLL_WINDOW``
    override :data:`DEFAULT_SEGMENT_BYTES` and :data:`DEFAULT_WINDOW`; they
    are read once, when a communicator's context is created (see
    :func:`tuning`).

Only commutative ops may use the ring: the chain for block b starts at
position b+1, so it combines contributions in rotated order.  Non-commutative
ops are routed to the order-preserving recursive-doubling algorithm by
_select.
"""

from __future__ import annotations

import os

from .schedule import DST, SRC, Builder, Label, Region, Schedule

DEFAULT_SEGMENT_BYTES = 1 << 20
DEFAULT_WINDOW = 2
# The ring AllGather (nothing to reduce) moves pieces of this many segments.
AG_SEGMENT_FACTOR = 16

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str, name: str) -> int:
    """``"4096"``, ``"64K"``, ``"1M"``, ``"1G"`` -> bytes; ValueError naming ``name``."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = raw[-1:] if raw[-1:] in _SUFFIX else ""
    try:
        value = int(raw[: len(raw) - len(unit)]) * _SUFFIX[unit]
    except ValueError:
        raise ValueError(f"{name}: expected a size in bytes such as 65536, 64K or 1M, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"{name}: expected a positive size, got {text!r}")
    return value


def tuning(environ=os.environ) -> tuple[int, int]:
    """(segment bytes, window) from MPICOLL_SEGMENT_BYTES / MPICOLL_WINDOW, else the defaults."""
    seg = environ.get("MPICOLL_SEGMENT_BYTES", "").strip()
    win = environ.get("MPICOLL_WINDOW", "").strip()
    segment_bytes = parse_bytes(seg, "MPICOLL_SEGMENT_BYTES") if seg else DEFAULT_SEGMENT_BYTES
    if win:
        try:
            window = int(win)
        except ValueError:
            raise ValueError(f"MPICOLL_WINDOW: expected a positive integer, got {win!r}") from None
        if not 1 <= window <= 64:
            raise ValueError(f"MPICOLL_WINDOW: expected an integer from 1 to 64, got {win!r}")
    else:
        window = DEFAULT_WINDOW
    return segment_bytes, window


def split(total: int, n: int):
    """(counts, displs) of ``total`` elements cut into ``n`` blocks (array_split rule)."""
    q, r = divmod(total, n)
    counts = [q + 1] * r + [q] * (n - r)
    displs = [0] * n
    for i in range(1, n):
        displs[i] = displs[i - 1] + counts[i - 1]
    return counts, displs


def _segments(lo: int, count: int, seg: int):
    """[(start, stop), ...] covering lo..lo+count in pieces of at most ``seg``."""
    return [(a, min(a + seg, lo + count)) for a in range(lo, lo + count, seg)]


def _ring_pass(b, s, first_block, blocks, seg, window, first_step, phase, label_of, sent,
               after_post=None):
    """AllGather pass: blocks (by ring position) travel around the ring, segment by segment.

    At step k position p sends block ``first_block - k`` and receives block
    ``first_block - 1 - k`` straight into ``DST``; each received segment is
    forwarded to the right as soon as it arrived (except in the last step).
    ``sent``: handles of the first block's sends, already issued by the
    caller; ``after_post``: called once the first receives are posted (local
    work that overlaps the first transfers).  Returns the open send handles.
    """
    n, p = s.size, s.ring_pos
    left, right = s.ring[(p - 1) % n], s.ring[(p + 1) % n]
    units = []
    for k in range(n - 1):
        q = (first_block - 1 - k) % n
        lo, cnt = blocks[q]
        units.extend((k, q, j, a, c) for j, (a, c) in enumerate(_segments(lo, cnt, seg)))
    sends = list(sent)
    if not units:
        if after_post is not None:
            after_post()
        return sends
    window = min(max(window, 2), len(units))

    def post(i):
        k, q, j, a, c = units[i]
        return b.recv(left, Region(DST, a, c), Label(first_step + k, phase, label_of(q), j, c - a))

    rreqs = [post(i) for i in range(window)]
    if after_post is not None:
        after_post()
    last = n - 2
    for i, (k, q, j, a, c) in enumerate(units):
        b.wait(rreqs[i % window])
        if i + window < len(units):
            rreqs[i % window] = post(i + window)
        if k < last:
            sends.append(b.send(right, Region(DST, a, c),
                                Label(first_step + k + 1, phase, label_of(q), j, c - a)))
    return sends


def allreduce_schedule(s) -> Schedule:
    """Ring AllReduce: ReduceScatter steps 0..n-2 on ``split(N, n)`` chunks, AllGather n-1..2n-3.

    The ReduceScatter phase receives each partial from the left, reduces it
    with this rank's input and forwards it.  Out of place a partial is
    received straight into its range of ``DST`` (each range is received
    once and read by no send before it is reduced), so no work memory is
    needed; in place ``DST`` still holds the input there and partials go
    through ``window`` receive slots.  The last ReduceScatter step completes
    chunk p segment by segment; each one starts the AllGather at once (its
    first step sends chunk p), so the AllGather overlaps the last reductions.
    """
    n, N = s.size, s.total
    b = Builder()
    if n == 1 or N == 0:
        if not s.in_place and N:
            b.copy(Region(DST, 0, N), Region(SRC, 0, N))
        return b.build(0)
    p = s.ring_pos
    right = s.ring[(p + 1) % n]
    left = s.ring[(p - 1) % n]
    counts, displs = split(N, n)
    seg = s.segment
    blocks = list(zip(displs, counts))
    phase = "reduce-scatter"
    q0 = (p - 1) % n
    sends = [b.send(right, Region(SRC, a, c), Label(0, phase, q0, j, c - a))
             for j, (a, c) in enumerate(_segments(*blocks[q0], seg))]
    units = []
    for k in range(n - 1):
        q = (p - 2 - k) % n
        units.extend((k, q, j, a, c) for j, (a, c) in enumerate(_segments(*blocks[q], seg)))
    last = n - 2
    ag_sends = []
    nunits = len(units)
    window = min(s.window, nunits)
    direct = not s.in_place
    if not direct and units:
        width = max(c - a for _, _, _, a, c in units)
        slots = b.buffer("ring allreduce: receive slots", window * width)

    def target(i):
        k, q, j, a, c = units[i]
        if direct:
            return Region(DST, a, c)
        return Region(slots, (i % window) * width, (i % window) * width + c - a)

    def post(i):
        k, q, j, a, c = units[i]
        return b.recv(left, target(i), Label(k, phase, q, j, c - a))

    rreqs = [post(i) for i in range(window)]
    for i, (k, q, j, a, c) in enumerate(units):
        b.wait(rreqs[i % window])
        dest = Region(DST, a, c)
        b.reduce(target(i), Region(SRC, a, c), dest)
        if i + window < nunits:
            rreqs[i % window] = post(i + window)
        if k < last:
            sends.append(b.send(right, dest, Label(k + 1, phase, q, j, c - a)))
        else:
            ag_sends.append(b.send(right, dest, Label(n - 1, "allgather", q, j, c - a)))
    # AllGather receives land in chunks that ReduceScatter sends may still read
    b.wait(*sends)
    _ring_pass(b, s, p, blocks, seg, s.window, n - 1, "allgather", lambda q: q, ag_sends)
    return b.build(2 * (n - 1))


def reduce_scatter_schedule(s) -> Schedule:
    """Ring ReduceScatter: ``DST`` (``counts[rank]`` elements) gets this rank's block.

    ``SRC`` holds the blocks laid out by ``counts``/``displs``.  In place,
    ``DST`` is the start of ``SRC``'s buffer; only ``DST`` is written.

    Work memory: ``window`` receive pieces and at most ``window`` send
    pieces, a piece being at most one segment (none with 2 ranks out of
    place: the last step receives into ``DST``), plus in place one block to
    stage the result when this rank's block does not start at offset 0.
    Every block is cut into the same number of pieces (``split`` of its
    count; empty pieces still travel as empty messages), so all ranks run one
    schedule: groups of up to ``2*window - 1`` pieces, step by step within a
    group, the group's pieces of the first block sent first.  Why this
    bounded memory cannot deadlock (L < window + K, with L pieces per group
    and K send slots) is argued once, in docs/performance.md ("Bounded work
    memory for the ring ReduceScatter").
    """
    n, rank = s.size, s.rank
    counts, displs = s.counts, s.displs
    own, mine = displs[rank], counts[rank]
    b = Builder()
    if n == 1:
        if not s.in_place or own != 0:
            b.copy(Region(DST, 0, mine), Region(SRC, own, own + mine))
        return b.build(0)
    biggest = max(counts)
    if biggest == 0:
        return b.build(0)
    p, order = s.ring_pos, s.ring
    left, right = order[(p - 1) % n], order[(p + 1) % n]
    nseg = -(-biggest // s.segment)
    piece = -(-biggest // nseg)
    window = min(max(1, s.window), 64)
    # L = group pieces, K = nout send slots: L < window + K (see the docstring)
    group = min(2 * window - 1, nseg)
    nout = max(1, group - window + 1)
    phase = "reduce-scatter"

    def bounds(q):
        """Piece boundaries of the block at ring position q (nseg + 1 offsets)."""
        r = order[q % n]
        c, d = split(counts[r], nseg)
        base = displs[r]
        return r, [base + x for x in d] + [base + counts[r]]

    first_rank, first = bounds(p - 1)
    steps = [bounds(p - 2 - k) for k in range(n - 1)]
    last = n - 2
    units = []          # (step, block rank, piece, a, b) in processing order
    first_at = {}       # unit index -> pieces of the first block to send before it
    for g in range(0, nseg, group):
        ks = range(g, min(g + group, nseg))
        first_at[len(units)] = [(j, first[j], first[j + 1]) for j in ks]
        for k in range(n - 1):
            r, bd = steps[k]
            units.extend((k, r, j, bd[j], bd[j + 1]) for j in ks)
    # In place the result may only go to DST when that cannot overwrite input
    # still to be read or sent: DST is SRC's first ``mine`` elements, which is
    # this rank's own block only if the block starts at 0.
    out = DST
    base = own
    if s.in_place and own != 0:
        out = b.buffer("ring reduce_scatter: in-place result", mine)
    nunits = len(units)
    # Out of place, last-step partials are received straight into DST and
    # reduced there; only forwarded partials (n > 2) need work slots.
    direct = not s.in_place
    nslots = min(window, nunits) if (n > 2 or not direct) else 0
    slots = b.buffer("ring reduce_scatter: receive slots", nslots * piece) if nslots else None
    nouts = nout if n > 2 else 0
    outs = b.buffer("ring reduce_scatter: partials to forward", nouts * piece) if nouts else None
    out_req = [None] * nouts
    sends = []

    def target(i):
        k, r, j, a, c = units[i]
        if direct and k == last:
            return Region(out, a - base, c - base)
        at = (i % window) * piece
        return Region(slots, at, at + c - a)

    def post(i):
        k, r, j, a, c = units[i]
        return b.recv(left, target(i), Label(k, phase, r, j, c - a))

    rreqs = [post(i) for i in range(min(window, nunits))]
    o = 0
    for i, (k, r, j, a, c) in enumerate(units):
        pieces = first_at.get(i)
        if pieces is not None:
            sends.extend(b.send(right, Region(SRC, x, y), Label(0, phase, first_rank, jj, y - x))
                         for jj, x, y in pieces)
        b.wait(rreqs[i % window])
        incoming = target(i)
        if k == last:
            b.reduce(incoming, Region(SRC, a, c), Region(out, a - base, c - base))
        else:
            slot = o % nout
            o += 1
            if out_req[slot] is not None:
                b.wait(out_req[slot])
            dest = Region(outs, slot * piece, slot * piece + c - a)
            b.reduce(incoming, Region(SRC, a, c), dest)
            out_req[slot] = b.send(right, dest, Label(k + 1, phase, r, j, c - a))
        if i + window < nunits:
            rreqs[i % window] = post(i + window)
    b.wait(*sends, *out_req)
    if out != DST:
        b.copy(Region(DST, 0, mine), Region(out, 0, mine))
    return b.build(n - 1)


def allgather_schedule(s) -> Schedule:
    """Ring AllGather(v): block r of ``DST`` (``counts[r]`` at ``displs[r]``) from rank r.

    ``SRC`` is this rank's block, unless in place (already in ``DST``).
    Nothing is reduced on the way, so small pieces only add messages: the
    AllGather moves pieces of ``AG_SEGMENT_FACTOR`` segments.
    """
    n, rank = s.size, s.rank
    lo, cnt = s.displs[rank], s.counts[rank]
    b = Builder()
    if n == 1:
        if not s.in_place and cnt:
            b.copy(Region(DST, lo, lo + cnt), Region(SRC, 0, cnt))
        return b.build(0)
    seg = AG_SEGMENT_FACTOR * s.segment
    blocks = [(s.displs[r], s.counts[r]) for r in s.ring]  # by ring position
    right = s.ring[(s.ring_pos + 1) % n]
    label_of = s.ring.__getitem__
    p = s.ring_pos
    if s.in_place:
        sent = [b.send(right, Region(DST, a, c), Label(0, "allgather", rank, j, c - a))
                for j, (a, c) in enumerate(_segments(lo, cnt, seg))]
        _ring_pass(b, s, p, blocks, seg, s.window, 0, "allgather", label_of, sent)
        return b.build(n - 1)
    # Out of place: send this rank's block from SRC and post the first receives,
    # then copy the block into DST while the neighbours already move data.
    sent = [b.send(right, Region(SRC, a - lo, c - lo), Label(0, "allgather", rank, j, c - a))
            for j, (a, c) in enumerate(_segments(lo, cnt, seg))]

    def copy_own():
        if cnt:
            b.copy(Region(DST, lo, lo + cnt), Region(SRC, 0, cnt))

    _ring_pass(b, s, p, blocks, seg, s.window, 0, "allgather", label_of, sent, copy_own)
    return b.build(n - 1)


# (collective, algorithm) -> schedule builder, as the other algorithm modules list theirs
SCHEDULES = {
    ("allreduce", "ring"): allreduce_schedule,
    ("reduce_scatter", "ring"): reduce_scatter_schedule,
    ("allgather", "ring"): allgather_schedule,
}
