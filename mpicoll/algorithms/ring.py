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

Pipelining
    Blocks are cut into segments of ``seg`` elements.  Receives are posted
    ``window`` segments ahead into a small ring of work slots (work memory
    from the context's arena, see engine.workmem), so while one
    segment is reduced the next ones are already arriving; a reduced segment
    is forwarded to the right at once.  AllReduce needs only ``window``
    segments of work memory: partials live in the output buffer.
    ReduceScatter forwards partials from ``window`` send slots, reused once
    their sends complete; it processes segments in groups (see
    :func:`reduce_scatter`) so that this bounded memory cannot deadlock.
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

from ..engine.workmem import scoped

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


def _segment_elems(ctx, itemsize: int) -> int:
    return max(1, getattr(ctx, "segment_bytes", DEFAULT_SEGMENT_BYTES) // max(itemsize, 1))


def _reduce_pipeline(ch, ctx, red, be, src, dst, units, last, sends, ag_sends):
    """AllReduce's ReduceScatter phase: receive ``units`` from the left, reduce, forward.

    units  [(step, a, b)]: element ranges whose partials arrive in this order;
           ``dst[a:b] = partial op src[a:b]``, then sent on (to ``sends`` below
           step ``last``, to ``ag_sends`` at step ``last``: AllGather's first step).
    Out of place a partial is received straight into ``dst[a:b]`` (each range
    is received once and read by no send before it is reduced), so no work
    memory is needed; in place ``dst`` still holds the input there and
    partials go through ``window`` work slots.
    """
    if not units:
        return
    n = ctx.size
    p = ctx.ring_pos
    left = ctx.ring[(p - 1) % n]
    right = ctx.ring[(p + 1) % n]
    nunits = len(units)
    window = min(getattr(ctx, "window", DEFAULT_WINDOW), nunits)
    direct = src is not dst
    if direct:
        slots = None
        rreqs = [ch.irecv(dst[a:b], left) for _, a, b in units[:window]]
    else:
        seg = max(b - a for _, a, b in units)
        slots = [ctx.work.take(dst.dtype, seg, "ring allreduce: receive slot") for _ in range(window)]
        rreqs = [ch.irecv(slots[k][: b - a], left) for k, (_, a, b) in enumerate(units[:window])]
    for i, (step, a, b) in enumerate(units):
        k = i % window
        ch.wait(rreqs[k])
        dest = dst[a:b]
        red(dest if direct else slots[k][: b - a], src[a:b], dest)
        j = i + window
        if j < nunits:
            _, a2, b2 = units[j]
            rreqs[k] = ch.irecv(dst[a2:b2] if direct else slots[k][: b2 - a2], left)
        (sends if step < last else ag_sends).append(ch.isend(dest, right))


@scoped
def allreduce(ctx, ch, be, red, src, dst):
    """Ring AllReduce of 1-D arrays ``src`` -> ``dst`` (``src is dst``: in place)."""
    n = ctx.size
    N = len(dst)
    if n == 1 or N == 0:
        if src is not dst:
            be.copy(dst, src)
        return
    p = ctx.ring_pos
    right = ctx.ring[(p + 1) % n]
    counts, displs = split(N, n)
    seg = _segment_elems(ctx, dst.dtype.itemsize)

    def blk(q):
        q %= n
        return displs[q], counts[q]

    sends = [ch.isend(src[a:b], right) for a, b in _segments(*blk(p - 1), seg)]
    units = [(s, a, b) for s in range(n - 1) for a, b in _segments(*blk(p - 2 - s), seg)]
    # The last ReduceScatter step completes block p segment by segment; each
    # one starts the AllGather at once (its first step sends block p), so the
    # AllGather overlaps the last reductions instead of waiting for them.
    ag_sends = []
    _reduce_pipeline(ch, ctx, red, be, src, dst, units, n - 2, sends, ag_sends)
    # AllGather receives land in dst blocks that ReduceScatter sends may still read
    ch.waitall(sends)
    _allgather_ring(ctx, ch, dst, counts, displs, seg, first_block=p, sent=ag_sends)


@scoped
def reduce_scatter(ctx, ch, be, red, src, dst, counts, displs):
    """Ring ReduceScatter: ``dst`` (``counts[rank]`` elements) gets this rank's block.

    ``src`` holds the blocks laid out by ``counts``/``displs``.  In place,
    ``dst`` is the start of ``src``'s buffer; only ``dst`` is written.

    Work memory: ``window`` receive pieces and at most ``window`` send
    pieces, a piece being at most one segment (none with 2 ranks out of
    place: the last step receives into ``dst``), plus in place one block to
    stage the result when this rank's block does not start at offset 0.
    Every block is cut into the same number of pieces (``split`` of its
    count; empty pieces still travel as empty messages), so all ranks run one
    schedule: groups of up to ``2*window - 1`` pieces, step by step within a
    group.  See docs/performance.md for why this cannot deadlock.
    """
    n = ctx.size
    rank = ctx.rank
    own, mine = displs[rank], counts[rank]
    if n == 1:
        be.copy(dst, src[own: own + mine])
        return
    biggest = max(counts)
    if biggest == 0:
        return
    p = ctx.ring_pos
    order = ctx.ring
    left = order[(p - 1) % n]
    right = order[(p + 1) % n]
    dtype = src.dtype
    nseg = -(-biggest // _segment_elems(ctx, dtype.itemsize))
    piece = -(-biggest // nseg)
    window = min(max(1, getattr(ctx, "window", DEFAULT_WINDOW)), 64)
    # Pieces per group: up to 2*window - 1, so that window + nout send slots
    # (nout <= window) satisfy the deadlock-freedom condition group < window + nout;
    # short blocks need fewer send slots.
    group = min(2 * window - 1, nseg)
    nout = max(1, group - window + 1)

    def bounds(q):
        """Piece boundaries of the block at ring position q (nseg + 1 offsets)."""
        r = order[q % n]
        c, d = split(counts[r], nseg)
        base = displs[r]
        return [base + x for x in d] + [base + counts[r]]

    first = bounds(p - 1)
    steps = [bounds(p - 2 - s) for s in range(n - 1)]
    last = n - 2
    units = []          # (step, a, b) in processing order
    first_at = {}       # unit index -> pieces of the first block to send before it
    for g in range(0, nseg, group):
        ks = range(g, min(g + group, nseg))
        first_at[len(units)] = [(first[k], first[k + 1]) for k in ks]
        for s in range(n - 1):
            b = steps[s]
            units.extend((s, b[k], b[k + 1]) for k in ks)
    # In place the result may only go to dst when that cannot overwrite input
    # still to be read or sent: dst is src's first ``mine`` elements, which is
    # this rank's own block only if the block starts at 0.
    in_place = _shares_memory(src, dst)
    stage = None
    if in_place and own != 0:
        stage = ctx.work.take(dtype, mine, "ring reduce_scatter: in-place result")
    out = dst if stage is None else stage
    nunits = len(units)
    # Out of place, last-step partials are received straight into dst and
    # reduced there; only forwarded partials (n > 2) need work slots.
    direct = not in_place
    nslots = min(window, nunits) if (n > 2 or not direct) else 0
    slots = [ctx.work.take(dtype, piece, "ring reduce_scatter: receive slot") for _ in range(nslots)]
    outs = [ctx.work.take(dtype, piece, "ring reduce_scatter: partial to forward")
            for _ in range(nout if n > 2 else 0)]
    out_req = [None] * len(outs)
    sends = []

    def target(i):
        step, a, b = units[i]
        if direct and step == last:
            return out[a - own: b - own]
        return slots[i % window][: b - a]

    rreqs = [ch.irecv(target(i), left) for i in range(min(window, nunits))]
    o = 0
    for i in range(nunits):
        step, a, b = units[i]
        pieces = first_at.get(i)
        if pieces is not None:
            sends.extend(ch.isend(src[x:y], right) for x, y in pieces)
        k = i % window
        ch.wait(rreqs[k])
        incoming = target(i)
        if step == last:
            red(incoming, src[a:b], out[a - own: b - own])
        else:
            j = o % nout
            o += 1
            if out_req[j] is not None:
                ch.wait(out_req[j])
            dest = outs[j][: b - a]
            red(incoming, src[a:b], dest)
            out_req[j] = ch.isend(dest, right)
        nxt = i + window
        if nxt < nunits:
            rreqs[k] = ch.irecv(target(nxt), left)
    ch.waitall(sends + [r for r in out_req if r is not None])
    if stage is not None:
        be.copy(dst, stage)


def allgather(ctx, ch, be, src, dst, counts, displs):
    """Ring AllGather(v): block r of ``dst`` (``counts[r]`` at ``displs[r]``) from rank r.

    ``src`` is this rank's block, or None when it is already in place in ``dst``.
    """
    rank = ctx.rank
    lo = displs[rank]
    own = dst[lo: lo + counts[rank]]
    if ctx.size == 1:
        if src is not None:
            be.copy(own, src)
        return
    # Nothing is reduced on the way, so small pieces only add messages: the
    # AllGather moves pieces of AG_SEGMENT_FACTOR segments.
    seg = AG_SEGMENT_FACTOR * _segment_elems(ctx, dst.dtype.itemsize)
    pc = [counts[r] for r in ctx.ring]
    pd = [displs[r] for r in ctx.ring]
    if src is None:
        _allgather_ring(ctx, ch, dst, pc, pd, seg, first_block=ctx.ring_pos)
        return
    # Out of place: send this rank's block from src and post the first receives,
    # then copy the block into dst while the neighbours already move data.
    right = ctx.ring[(ctx.ring_pos + 1) % ctx.size]
    sent = [ch.isend(src[a - lo: b - lo], right) for a, b in _segments(lo, counts[rank], seg)]
    _allgather_ring(ctx, ch, dst, pc, pd, seg, first_block=ctx.ring_pos, sent=sent,
                    after_post=lambda: be.copy(own, src))


def _allgather_ring(ctx, ch, dst, counts, displs, seg, first_block, sent=None, after_post=None):
    """Pass blocks (indexed by ring position) around the ring, segment by segment.

    Receives are posted directly into ``dst``; each received segment is
    forwarded to the right as soon as it arrives (except in the last step).
    ``sent``: requests of the first block's segments, already sent by the caller;
    ``after_post``: called once the first receives are posted (local work that
    can overlap the first transfers).
    """
    n = ctx.size
    p = ctx.ring_pos
    left = ctx.ring[(p - 1) % n]
    right = ctx.ring[(p + 1) % n]

    def segs(q):
        q %= n
        return _segments(displs[q], counts[q], seg)

    if sent is None:
        sends = [ch.isend(dst[a:b], right) for a, b in segs(first_block)]
    else:
        sends = sent
    units = [(s, a, b) for s in range(n - 1) for a, b in segs(first_block - 1 - s)]
    if not units:
        if after_post is not None:
            after_post()
    else:
        window = min(max(getattr(ctx, "window", DEFAULT_WINDOW), 2), len(units))
        rreqs = [ch.irecv(dst[a:b], left) for _, a, b in units[:window]]
        if after_post is not None:
            after_post()
        last = n - 2
        for i, (step, a, b) in enumerate(units):
            ch.wait(rreqs[i % window])
            j = i + window
            if j < len(units):
                _, a2, b2 = units[j]
                rreqs[i % window] = ch.irecv(dst[a2:b2], left)
            if step < last:
                sends.append(ch.isend(dst[a:b], right))
    ch.waitall(sends)


def _shares_memory(a, b) -> bool:
    try:
        import numpy as np
        return bool(np.shares_memory(a, b)) if isinstance(a, np.ndarray) else _device_overlap(a, b)
    except Exception:
        return True


def _device_overlap(a, b) -> bool:
    ia = a.__cuda_array_interface__["data"][0]
    ib = b.__cuda_array_interface__["data"][0]
    return ia < ib + b.nbytes and ib < ia + a.nbytes
