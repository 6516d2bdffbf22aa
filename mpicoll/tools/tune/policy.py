"""The tuner's policy: every threshold it decides by, defined once, with the reason.

The measurements behind the reasons are on the performance page
(docs/performance.md, "How the tools measure").
"""

from __future__ import annotations

# The sweeps (``--quick`` and the default):
#   p2p_max   largest exchange of the point-to-point curve
#   coll      (smallest, largest, factor) of the collectives' sizes
#   extra     sizes added to the collectives' (quick: the medium sizes, where the
#             crossovers are, which a factor of 4 steps over)
#   iters, warmup   timed and untimed calls per point (fewer at large sizes: iters_at)
#   bisect    a protocol cliff is bracketed to this many bytes
#   passes    every point is measured up to this many times, in alternating order of
#             sizes, and keeps its fastest median: on a shared machine load only ever
#             adds time
#   half_steps  also measure half a step between two sizes where the fastest algorithm
#             changes (the crossovers get the finer steps)
#   segments, windows   the grid of segment sizes and windows tried from SEG_MIN up, the
#             options' values with them
SWEEPS = {
    "quick": {"p2p_max": 4 << 20, "coll": (256, 4 << 20, 4.0), "extra": (2048, 4096, 8192),
              "iters": 20, "warmup": 3, "bisect": 64, "passes": 2,
              "segments": (256 << 10, 1 << 20, 4 << 20), "windows": (1, 2)},
    "full": {"p2p_max": 16 << 20, "coll": (8, 16 << 20, 2.0), "extra": (),
             "iters": 40, "warmup": 5, "bisect": 16, "passes": 2, "half_steps": True,
             "segments": (64 << 10, 256 << 10, 1 << 20, 4 << 20), "windows": (1, 2, 4)},
}

# The 5 % rule: an algorithm within this factor of the fastest measured at a size is
# as good as the fastest there (the spread of one median on a quiet machine), so among
# those the choice with the fewest switches between sizes wins, and noise between
# near-equal algorithms does not split a size range.
CLOSE = 1.05

# Later passes measure again only the algorithms within this factor of the fastest: a
# loser by more cannot come within CLOSE in another pass unless the first pass was off
# by a fifth.
WIDE = 1.25

# Segment size and window only matter where a call is cut into several segments: they
# are tried from this size up (below, one segment) ...
SEG_MIN = 256 << 10
# ... for the algorithms within this factor of the fastest at the size ...
SEG_WIDE = 1.15
# ... at the doubling sizes only (each tuned size at least this factor above the last:
# the half steps only place crossovers) ...
SEG_STEP = 1.9
# ... and another segment/window replaces the options' values only where it beats them
# by more than this: the options are the simpler choice, and the algorithm's time is
# then within CLOSE of its fastest variant, so the 5 % rule still holds.
PREFER_DEFAULT = CLOSE

# In the bandwidth regime (from SEG_MIN up) the volume decides: an algorithm this much
# slower than the fastest at two sizes in a row does not come back, and is not measured
# at the larger ones.
LOSING = 1.5

# A size's loop stops early once every variant's interquartile range is within this
# fraction of its median (after a quarter of the calls): the median's standard error is
# then under 2 %, and more calls would not move it.
SPREAD = 0.05

# The model's overheads (per call, per schedule operation) show at small sizes; above
# this the exchange curve decides, so they are fitted to the sizes up to it.
FIT_MAX = 64 << 10

# A protocol cliff (an eager limit) on the exchange curve: the larger of two
# neighbouring sizes takes more than CLIFF_RATIO times the smaller's time, and more
# than CLIFF_EXCESS of it above what the slope below predicts.  Eager limits sit below
# CLIFF_MAX; above it the curve is bandwidth and its steps are load.
CLIFF_RATIO = 1.4
CLIFF_EXCESS = 0.25
CLIFF_MAX = 1 << 20

# Pieces to another node tried (transport.channel's node_piece_bytes): the default,
# and sizes below Open MPI's TCP eager limit (64 KiB with its header), where its
# exchanges back to back do not fall to half the line's speed.  Each is timed on an
# exchange of NODE_PIECE_BYTES, NODE_PIECE_ITERS in a row (the slowdown sets in after a
# few exchanges, and not in every run), and keeps its slowest of NODE_PIECE_ROUNDS runs,
# so a piece that ran at half speed once loses.  The largest within CLOSE of the
# fastest wins (fewer pieces, fewer messages).
NODE_PIECES = (1 << 20, 256 << 10, 60 << 10)
NODE_PIECE_BYTES = 4 << 20
NODE_PIECE_ITERS = 12
NODE_PIECE_ROUNDS = 3

# Calls from LARGE bytes up take a millisecond or more: a few timed calls give a
# steady median there, and the sweep would take minutes with the small sizes' count.
LARGE = 1 << 20


def iters_at(base: int, nbytes: int) -> int:
    """Timed calls of a collective at ``nbytes`` (``base``: the sweep's or ``-n``)."""
    if nbytes < LARGE:
        return base
    return max(3, base // (4 if nbytes < 8 * LARGE else 8))


def p2p_iters_at(base: int, nbytes: int) -> int:
    """Timed exchanges of the point-to-point curve at ``nbytes``."""
    return base if nbytes < LARGE else max(3, base // 4)


def segment_iters_at(base: int, warmup: int, nbytes: int) -> tuple[int, int]:
    """(timed, untimed) calls of a segment/window variant at ``nbytes``: from LARGE up one
    warm-up call and at most 5 timed ones."""
    iters = iters_at(base, nbytes)
    return (min(iters, 5), 1) if nbytes >= LARGE else (iters, warmup)
