"""The engine's side of node memory: the ``intranode`` option, choosing and gating the shared algorithms.

mpicoll/transport/shared.py maps each rank's buffer into the ranks of its
node; mpicoll/algorithms/shared.py holds the schedules that use it.  This
module is what the rest of the engine asks (each function names its caller):
which algorithm a call runs and which *region* of node memory it maps,
setting the region up on first use; the shape and the views of a schedule;
the channel of a device schedule; and whether an operation may start on its
region.

Regions
    A context holds one region per use that may be in flight at once:
    region 0 for blocking calls (they never overlap on a communicator, and
    device calls always run to the end), :data:`NONBLOCKING` for
    non-blocking calls (call number modulo that), :data:`PERSISTENT` for
    persistent operations (creation number modulo that).  Every rank numbers
    calls alike, so every rank picks the same region.  An operation starting
    on a region another operation of the context still holds first waits for
    that one (:func:`claim`).  A non-blocking call is never remembered
    (its region changes from start to start); a blocking one is (region 0).

Agreement
    The option is one of those the ranks agree on when the context is made
    (engine.context.SHAPING: rank 0's where they differ).  A region's set-up
    succeeds only if every rank's does.
"""

from __future__ import annotations

import weakref

from ..algorithms import shared as _algorithms
from ..algorithms.schedule import node_role
from ..core import config as _config
from ..core.errors import MpicollError
from ..transport import shared as _memory
from . import select as _select
from .executor import wait_for

NONBLOCKING = 4  # regions for non-blocking calls (a pipeline keeps 4 chunks in flight)
PERSISTENT = 2   # regions for persistent operations

MODES = _config.INTRANODE_MODES
ALGORITHMS = frozenset(name for _, name in _algorithms.SCHEDULES)


def release(ctx) -> None:
    """*Context._release*, before its duplicate is freed: node memory goes (transport.shared)."""
    _memory.release(ctx)


def spans_nodes(ctx) -> bool:
    return len(set(ctx.nodes)) > 1


def region_of(ctx, blocking: bool, persistent: bool) -> int:
    """The region a call about to start uses (the same on every rank, see the module
    docstring): the call number and the persistent count are the ones it will take."""
    if blocking:
        return 0
    if persistent:
        return 1 + NONBLOCKING + (ctx.persistent_made + 1) % PERSISTENT
    return 1 + (ctx.seq + 1) % NONBLOCKING


def _ready(ctx, backend, region, timeout, describe):
    return _memory.ready(ctx, backend, region, timeout, describe, wait_for)


def choose(ctx, collective, algorithm, name, nbytes, backend, commutative, blocking,
           persistent, timeout, describe, accumulate=None):
    """*run.start*: (the algorithm to run, the region it maps or None).

    A shared algorithm the call names (or ``MPICOLL_ALGORITHM``, or a tuning
    file) sets its region up here, or raises MpicollError where it cannot run;
    ``"auto"`` takes one where engine.select's table says so for this layout
    and option, set up here (a failed set-up keeps ``name``).
    """
    if name in ALGORITHMS:
        if spans_nodes(ctx) and not commutative:
            if algorithm == "auto":  # (MPICOLL_ALGORITHM: where it applies, see engine.select)
                return _select.choose(collective, "auto", nbytes, ctx.size, False), None
            raise ValueError(f"algorithm: {name!r} reorders operands across nodes and cannot "
                             f"run a non-commutative op on a communicator that spans nodes; "
                             f"use 'auto' or 'direct'")
        region = region_of(ctx, blocking, persistent)
        why = _ready(ctx, backend, region, timeout, describe)
        if why is not None:
            raise MpicollError(f"algorithm {name!r}: node memory unavailable on this "
                               f"communicator: {why}")
        return name, region
    if algorithm != "auto" or accumulate is not None or ctx.size == 1:
        return name, None
    sel = getattr(ctx, "selection", None)
    if sel is not None and sel.entry is not None and collective in sel.entry.selection \
            and ctx.intranode != "shared":
        return name, None  # (a tuning file measured this collective: it decides)
    want = _select.shared_choice(collective, nbytes, ctx.intranode, backend.name != "numpy",
                                 spans_nodes(ctx), commutative)
    if want is None or not _memory.node_memory(ctx).shares:
        return name, None
    region = region_of(ctx, blocking, persistent)
    if _ready(ctx, backend, region, timeout, describe) is not None:
        return name, None
    return want, region


def shape(ctx, shape, backend, region, itemsize: int):
    """*run._schedule*: a shared algorithm's shape with the slot of the region it
    maps (elements; 0 where no rank shares a node: no node memory is used), or on one
    node of device arrays ``mapped``: the call's own buffers, registered for CUDA IPC."""
    if _memory.maps_buffers(ctx, backend):
        return shape._replace(mapped=True)
    return shape._replace(shared=_memory.slot_elements(ctx, backend, region, itemsize))


def views(ctx, backend, region, schedule, dtype, bound=None, call=None) -> dict:
    """*binding* (run.Bound._bind, cache._entry): the node buffers ``schedule`` names.

    Where they include the call's own buffers at the ranks of the node (``Shape.mapped``),
    ``bound``: the views bound so far ({SRC, DST, ...}); ``call``: the run.Bound (its
    timeout and description for the exchange that tells the node where they lie)."""
    buffers = [(name, q, n, node_role(name)) for name, (q, n) in schedule.shared.items()]
    timeout = describe = None
    if call is not None:
        label, seq, name, what = call.about()[:4]
        timeout = call.timeout

        def describe():
            return f"{label} #{seq} ({name}, {what})", label, name
    return _memory.views(ctx, backend, region, buffers, dtype, bound, call, timeout, describe,
                         wait_for)


def claim(ctx, region, operation) -> None:
    """*before an operation starts* (run.start, run.start_persistent): wait for the
    operation of the context that still holds its region (that one's error stays its own);
    MpicollError after the communicator's free.  ``region``: the call's (run.py asks only
    for a call on node memory)."""
    nm = _memory.node_memory(ctx)
    if nm.closed:
        raise MpicollError("communicator freed: its node memory is gone; start operations "
                           "only on a communicator not yet freed")
    if region == 0:
        return
    ref = nm.holders.get(region)
    prev = ref() if ref is not None else None
    if prev is not None and prev is not operation and prev._active:
        def done():
            try:
                return prev.test()
            except BaseException:  # (raised again to its own caller)
                return True
        wait_for(done, me=operation)  # (False only once nothing else is in flight: done)
    nm.holders[region] = weakref.ref(operation)


def uses(schedule) -> bool:
    """*run.Bound.begin*: whether ``schedule`` maps node memory (a device call then
    stages nothing)."""
    return bool(schedule.shared)


def channel(ctx, backend, mpitype, schedule):
    """*run.Bound.begin*: the channel of a device schedule on one node (its messages
    are all 0-byte syncs), else None (the backend's own)."""
    if backend.name == "numpy" or not schedule.shared or spans_nodes(ctx):
        return None
    return _memory.sync_channel(ctx, backend, backend.host_channel(ctx, mpitype),
                                backend._begin(ctx))


def plain(run) -> bool:
    """*run.plain*: whether a call may be remembered as far as node memory goes:
    not a non-blocking one on node memory (its region changes from start to start)."""
    return not (run.region and not run.blocking)


def probe(ctx, backend, timeout=None) -> str:
    """*python -m mpicoll.info*: set up region 0 of ``backend`` on ``ctx`` (collective) and
    say how it went."""
    _ready(ctx, backend, 0, timeout, lambda: ("python -m mpicoll.info", None, None))
    return _memory.status(ctx, backend)
