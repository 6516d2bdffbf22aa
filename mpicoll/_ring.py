"""Ring algorithms: ReduceScatter, AllGather, and AllReduce as their composition.

Block split
    ``split(N, n)`` cuts N elements into n contiguous blocks the way
    ``numpy.array_split`` does: the first ``N % n`` blocks hold ``N // n + 1``
    elements, the rest ``N // n``.  Blocks may be empty (N < n, N = 0); an empty
    block is never sent, and both ends of a link know it, so nothing waits for it.

Ring
    ``ctx.ring`` lists the ranks in ring order (see _topology); the rank at
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
    ``window`` segments ahead into a small ring of work slots, so while one
    segment is reduced the next ones are already arriving; a reduced segment
    is forwarded to the right at once.  AllReduce needs only ``window``
    segments of work memory: partials live in the output buffer.
    ReduceScatter keeps partials in two block-sized accumulators (a partial
    must stay intact until its send completes).

Only commutative ops may use the ring: the chain for block b starts at
position b+1, so it combines contributions in rotated order.  Non-commutative
ops are routed to the order-preserving recursive-doubling algorithm by
_select.
"""

from __future__ import annotations

DEFAULT_SEGMENT_BYTES = 1 << 20
DEFAULT_WINDOW = 2


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


def _reduce_pipeline(ch, ctx, red, be, src, units, dest_of, dtype):
    """Receive ``units`` from the left, reduce each into its destination, forward.

    units    [(step, a, b)]: element ranges of ``src`` whose partials arrive in order
    dest_of  dest_of(step, a, b) -> (dest, sendlist): where ``slot op src[a:b]`` goes,
             and the list to append its forwarding send to (None: not forwarded)
    """
    if not units:
        return
    n = ctx.size
    p = ctx.ring_pos
    left = ctx.ring[(p - 1) % n]
    right = ctx.ring[(p + 1) % n]
    seg = max(b - a for _, a, b in units)
    window = min(getattr(ctx, "window", DEFAULT_WINDOW), len(units))
    slots = [ctx.scratch(be, dtype, seg, slot=k) for k in range(window)]
    rreqs = [ch.irecv(slots[k][: b - a], left) for k, (_, a, b) in enumerate(units[:window])]
    nunits = len(units)
    for i, (step, a, b) in enumerate(units):
        k = i % window
        ch.wait(rreqs[k])
        dest, sendlist = dest_of(step, a, b)
        red(slots[k][: b - a], src[a:b], dest)
        j = i + window
        if j < nunits:
            _, a2, b2 = units[j]
            rreqs[k] = ch.irecv(slots[k][: b2 - a2], left)
        if sendlist is not None:
            sendlist.append(ch.isend(dest, right))


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
    last = n - 2

    def dest_of(step, a, b):
        return dst[a:b], (sends if step < last else None)

    _reduce_pipeline(ch, ctx, red, be, src, units, dest_of, dst.dtype)
    ch.waitall(sends)
    _allgather_ring(ctx, ch, dst, counts, displs, seg, first_block=p)


def reduce_scatter(ctx, ch, be, red, src, dst, counts, displs):
    """Ring ReduceScatter: ``dst`` (``counts[rank]`` elements) gets this rank's block.

    ``src`` holds the blocks laid out by ``counts``/``displs``.  In place,
    ``dst`` is the start of ``src``'s buffer; only ``dst`` is written.
    """
    n = ctx.size
    rank = ctx.rank
    own = displs[rank]
    if n == 1:
        be.copy(dst, src[own: own + counts[rank]])
        return
    p = ctx.ring_pos
    order = ctx.ring
    right = order[(p + 1) % n]
    seg = _segment_elems(ctx, src.dtype.itemsize)

    def blk(q):
        r = order[q % n]
        return displs[r], counts[r]

    first = [ch.isend(src[a:b], right) for a, b in _segments(*blk(p - 1), seg)]
    units = [(s, a, b) for s in range(n - 1) for a, b in _segments(*blk(p - 2 - s), seg)]
    last = n - 2
    in_place = _shares_memory(src, dst)
    acc = [ctx.scratch(be, src.dtype, max(counts), slot=100 + k) for k in (0, 1)] if n > 2 else None
    pending = [[], []]  # forwarding sends out of acc[0] / acc[1]
    current = [-1]

    def dest_of(step, a, b):
        if step != current[0]:
            current[0] = step
            if step == last and in_place:
                # dst overlaps input blocks whose sends may still be in flight
                ch.waitall(first + pending[0] + pending[1])
                first.clear()
                pending[0].clear()
                pending[1].clear()
            elif step >= 2:
                # acc[step % 2] was forwarded at step-2; reuse it only when sent
                ch.waitall(pending[step % 2])
                pending[step % 2].clear()
        if step == last:
            return dst[a - own: b - own], None
        base = blk(p - 2 - step)[0]
        return acc[step % 2][a - base: b - base], pending[step % 2]

    _reduce_pipeline(ch, ctx, red, be, src, units, dest_of, src.dtype)
    ch.waitall(first + pending[0] + pending[1])


def allgather(ctx, ch, be, src, dst, counts, displs):
    """Ring AllGather(v): block r of ``dst`` (``counts[r]`` at ``displs[r]``) from rank r.

    ``src`` is this rank's block, or None when it is already in place in ``dst``.
    """
    rank = ctx.rank
    own = dst[displs[rank]: displs[rank] + counts[rank]]
    if src is not None:
        be.copy(own, src)
    if ctx.size == 1:
        return
    order = ctx.ring
    seg = _segment_elems(ctx, dst.dtype.itemsize)
    pc = [counts[r] for r in order]
    pd = [displs[r] for r in order]
    _allgather_ring(ctx, ch, dst, pc, pd, seg, first_block=ctx.ring_pos)


def _allgather_ring(ctx, ch, dst, counts, displs, seg, first_block):
    """Pass blocks (indexed by ring position) around the ring, segment by segment.

    Receives are posted directly into ``dst``; each received segment is
    forwarded to the right as soon as it arrives (except in the last step).
    """
    n = ctx.size
    p = ctx.ring_pos
    left = ctx.ring[(p - 1) % n]
    right = ctx.ring[(p + 1) % n]

    def segs(q):
        q %= n
        return _segments(displs[q], counts[q], seg)

    sends = [ch.isend(dst[a:b], right) for a, b in segs(first_block)]
    units = [(s, a, b) for s in range(n - 1) for a, b in segs(first_block - 1 - s)]
    if units:
        window = min(max(getattr(ctx, "window", DEFAULT_WINDOW), 2), len(units))
        rreqs = [ch.irecv(dst[a:b], left) for _, a, b in units[:window]]
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
