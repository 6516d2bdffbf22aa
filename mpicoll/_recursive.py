"""Latency-optimal algorithms: recursive doubling AllReduce.

Recursive doubling (with the usual fold for rank counts that are not a power
of two) takes ceil(log2 n) (+2 for the fold) steps of whole-array exchanges:
few messages, so it wins for small arrays; each rank moves log2(n) full
arrays, so the ring wins for large ones.

It preserves rank order, so it is also the algorithm for non-commutative
ops: at every step the data of the lower group of ranks is the left operand.
Both partners of a step evaluate the same expression ``lower op higher``, so
all ranks end with bitwise-identical results.
"""

from __future__ import annotations


def _fold(n: int):
    pof2 = 1
    while pof2 * 2 <= n:
        pof2 *= 2
    return pof2, n - pof2


def allreduce(ctx, ch, be, red, src, dst):
    """Recursive-doubling AllReduce of 1-D arrays ``src`` -> ``dst``."""
    n, rank = ctx.size, ctx.rank
    N = len(dst)
    if src is not dst:
        be.copy(dst, src)
    if n == 1 or N == 0:
        return
    pof2, rem = _fold(n)
    buf = dst
    tmp = ctx.scratch(be, dst.dtype, N, slot=200)
    # Fold: among the first 2*rem ranks, even ones hand their data to the odd
    # neighbour (rank order: even is the left operand) and sit out.
    if rank < 2 * rem:
        if rank % 2 == 0:
            ch.sendrecv(buf, rank + 1, None, None)
            newrank = -1
        else:
            ch.sendrecv(None, None, tmp, rank - 1)
            red(tmp, buf, buf)
            newrank = rank // 2
    else:
        newrank = rank - rem
    if newrank != -1:
        mask = 1
        while mask < pof2:
            newpeer = newrank ^ mask
            peer = newpeer * 2 + 1 if newpeer < rem else newpeer + rem
            ch.sendrecv(buf, peer, tmp, peer)
            if peer < rank:
                red(tmp, buf, buf)   # buf = peer's (lower) op mine
            else:
                red(buf, tmp, tmp)   # tmp = mine op peer's (higher)
                buf, tmp = tmp, buf
            mask <<= 1
    if rank < 2 * rem:
        if rank % 2:
            ch.sendrecv(buf, rank - 1, None, None)
        else:
            ch.sendrecv(None, None, dst, rank + 1)
            buf = dst
    if buf is not dst:
        be.copy(dst, buf)


def reduce_scatter(ctx, ch, be, red, src, dst, counts, displs):
    """ReduceScatter as a recursive-doubling AllReduce of the whole input.

    Moves log2(n) whole arrays per rank instead of (n-1)/n of one: used for
    small inputs and for non-commutative ops, whose rank order the ring cannot
    keep.
    """
    total = max((d + c for c, d in zip(counts, displs)), default=0)
    full = ctx.scratch(be, src.dtype, total, slot=201)
    allreduce(ctx, ch, be, red, src[:total], full)
    own = displs[ctx.rank]
    be.copy(dst, full[own: own + counts[ctx.rank]])
