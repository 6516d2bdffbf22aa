"""Ring order: which rank sits at which position of the logical ring."""

from __future__ import annotations


def ring_order(ctx) -> list[int]:
    """Ranks in ring order; position p sends to p+1 and receives from p-1."""
    return list(range(ctx.size))
