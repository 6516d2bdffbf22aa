"""Bruck AllGather(v): ceil(log2 n) steps for any number of ranks.

Each rank keeps the blocks in a work array rotated to start at its own
block (position j holds rank ``(rank + j) % n``).  At the step with distance
``d`` (1, 2, 4, ...) it sends its first ``min(d, n - d)`` positions to rank
``rank - d`` and receives as many from rank ``rank + d``, whose first positions
are its own positions ``d`` .. ``d + min(d, n - d)``.  A final rotation puts
the blocks in rank order.  Unlike recursive doubling it needs no fold for
rank counts that are not powers of two, at the price of two local copies.
"""

from __future__ import annotations

from ..engine.workmem import scoped


@scoped
def allgather(ctx, ch, be, src, dst, counts, displs):
    """Bruck AllGather(v): block r of ``dst`` (``counts[r]`` at ``displs[r]``) from rank r.

    ``src`` is this rank's block, or None when it is already in place in ``dst``.
    """
    n, rank = ctx.size, ctx.rank
    own = dst[displs[rank]: displs[rank] + counts[rank]]
    if src is not None:
        be.copy(own, src)
    if n == 1:
        return
    # offset of position j in the rotated work array
    at = [0] * (n + 1)
    for j in range(n):
        at[j + 1] = at[j] + counts[(rank + j) % n]
    total = at[n]
    if total == 0:
        return
    work = ctx.work.take(dst.dtype, total, "bruck: rotated blocks")
    be.copy(work[: at[1]], own)
    d = 1
    while d < n:
        c = min(d, n - d)
        ch.sendrecv(work[: at[c]], (rank - d) % n, work[at[d]: at[d + c]], (rank + d) % n)
        d <<= 1
    # rotate back: positions 1 .. n-1 are ranks rank+1 .. n-1, 0 .. rank-1
    packed = all(displs[r + 1] == displs[r] + counts[r] for r in range(n - 1))
    if packed:
        tail = n - rank  # positions 1 .. tail-1 are ranks rank+1 .. n-1
        if tail > 1:
            lo = displs[rank] + counts[rank]
            be.copy(dst[lo: lo + at[tail] - at[1]], work[at[1]: at[tail]])
        if rank:
            lo = displs[0]
            be.copy(dst[lo: lo + total - at[tail]], work[at[tail]: total])
        return
    for j in range(1, n):
        r = (rank + j) % n
        if counts[r]:
            be.copy(dst[displs[r]: displs[r] + counts[r]], work[at[j]: at[j + 1]])
