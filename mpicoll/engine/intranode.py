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
from ..core.errors import MpicollError
from ..transport import shared as _memory
from . import select as _select
from .executor import AFTER, CALL, WAIT, wait_for

NONBLOCKING = 4  # regions for non-blocking calls (a pipeline keeps 4 chunks in flight)
PERSISTENT = 2   # regions for persistent operations

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


def unavailable(name, why) -> MpicollError:
    """The error of a shared algorithm ``name`` called where node memory is not: ``why``."""
    return MpicollError(f"algorithm {name!r}: node memory unavailable on this communicator: "
                        f"{why}")


def choose(ctx, collective, algorithm, name, nbytes, backend, commutative, to_end,
           persistent, timeout, describe, accumulate=None):
    """*run.prepare*: (the algorithm to run, the region it maps or None, the set-up its
    operation runs first or None).

    A shared algorithm the call names (or ``MPICOLL_ALGORITHM``, or a tuning
    file) sets its region up, or raises MpicollError where it cannot run;
    ``"auto"`` takes one where engine.select's table says so for this layout
    and option (a failed set-up keeps ``name``).  A call that runs to the end
    (``to_end``) or a persistent operation being made sets the region up here,
    a collective exchange; a non-blocking call never waits on a peer at its
    start: its operation runs the set-up as its first steps (:func:`prelude`).
    """
    if name in ALGORITHMS:
        if spans_nodes(ctx) and not commutative:
            if algorithm == "auto":  # (MPICOLL_ALGORITHM: where it applies, see engine.select)
                return _select.choose(collective, "auto", nbytes, ctx.size, False), None, None
            raise ValueError(f"algorithm: {name!r} reorders operands across nodes and cannot "
                             f"run a non-commutative op on a communicator that spans nodes; "
                             f"use 'auto' or 'direct'")
        region = region_of(ctx, to_end, persistent)
        setup, why = _set_up(ctx, backend, region, timeout, describe, to_end or persistent)
        if why is not None:
            raise unavailable(name, why)
        return name, region, setup
    if algorithm != "auto" or accumulate is not None or ctx.size == 1:
        return name, None, None
    sel = getattr(ctx, "selection", None)
    device = backend.name != "numpy"
    if sel is not None and sel.entry is not None and collective in sel.entry.selection \
            and ctx.intranode != "shared" and not device:
        return name, None, None  # (a tuning file measured this collective, on host arrays)
    want = _select.shared_choice(collective, nbytes, ctx.intranode, device, spans_nodes(ctx),
                                 commutative)
    if want is None or not _memory.node_memory(ctx).shares:
        return name, None, None
    region = region_of(ctx, to_end, persistent)
    setup, why = _set_up(ctx, backend, region, timeout, describe, to_end or persistent)
    if why is not None:
        return name, None, None
    return want, region, setup


def _set_up(ctx, backend, region, timeout, describe, here):
    """(the set-up to run first or None, why the region cannot be used or None): run here
    (``here``) or left to the operation."""
    setup, why = _memory.set_up(ctx, backend, region, timeout, describe)
    if setup is None or not here:
        return setup, why
    return None, setup.run(wait_for)


def prelude(setup, holder, tag, then) -> tuple:
    """*run.prepare*: the first steps of a non-blocking operation whose region is not set
    up yet: wait for the region's holder (``holder``, :func:`claim`), the set-up's two
    exchanges (transport.shared.SetUp) on the tag of the start's call (``tag()``: other
    operations' set-ups may be in flight too), then ``then()``, which binds the call's own
    steps (run._bind) for the operation to go on with."""
    first, second = [], []

    def records():
        setup.tag = tag()
        first[:] = setup.post_records()

    def verdicts():
        second[:] = setup.post_verdicts()

    return ((AFTER, holder), (CALL, records), (WAIT, None, first, setup), (CALL, verdicts),
            (WAIT, None, second, setup), (CALL, then))


def shape(ctx, shape, backend, region, itemsize: int):
    """*run._schedule*: a shared algorithm's shape with the slot of the region it
    maps (elements; 0 where no rank shares a node: no node memory is used), or on one
    node of device arrays ``mapped``: the call's own buffers, registered for CUDA IPC."""
    if _memory.maps_buffers(ctx, backend):
        return shape._replace(mapped=True)
    return shape._replace(shared=_memory.slot_elements(ctx, backend, region, itemsize))


def views(ctx, backend, region, schedule, dtype, own=None, bound=None) -> dict:
    """*binding* (transports.NodeMemory.views): the node buffers ``schedule`` names.

    Where they include the call's own buffers at the ranks of the node (``Shape.mapped``),
    ``own``: the views bound so far ({SRC, DST, ...}); ``bound``: the run.Bound binding
    them (its timeout and name for the exchange that tells the node where they lie)."""
    buffers = [(name, q, n, node_role(name)) for name, (q, n) in schedule.shared.items()]
    timeout = describe = None
    if bound is not None:
        label, what = bound.label, bound.what
        timeout = ctx.options()["timeout"] if bound.timeout_arg is None else bound.timeout_arg

        def describe():
            return f"{label} #{ctx.seq + 1} ({bound.name}, {what})", label, bound.name
    return _memory.views(ctx, backend, region, buffers, dtype, own, bound, timeout, describe,
                         wait_for)


class Holder:
    """What a start of an operation on node memory waits for first (its ``AFTER`` step): the
    operation that held its region before (:func:`claim`), or None."""

    __slots__ = ("op",)

    def __init__(self):
        self.op = None


def claim(ctx, region, operation, holder) -> None:
    """*before an operation starts* (its transport's claim): ``holder.op`` becomes the
    operation of the context that still holds ``region``, which this start's first step
    waits for (that one's error stays its own; a start never waits here); MpicollError
    after the communicator's free."""
    nm = _memory.node_memory(ctx)
    if nm.closed:
        raise MpicollError("communicator freed: its node memory is gone; start operations "
                           "only on a communicator not yet freed")
    if region == 0:
        return
    ref = nm.holders.get(region)
    prev = ref() if ref is not None else None
    holder.op = prev if prev is not None and prev is not operation and prev._active else None
    nm.holders[region] = weakref.ref(operation)


def channel(ctx, backend, mpitype, schedule):
    """*run.Bound.begin*: the channel of a device schedule on one node (its messages
    are all 0-byte syncs), else None (the backend's own)."""
    if backend.name == "numpy" or not schedule.shared or spans_nodes(ctx):
        return None
    return _memory.sync_channel(ctx, backend, backend.host_channel(ctx, mpitype),
                                backend._begin(ctx))


def probe(ctx, backend, timeout=None) -> str:
    """*python -m mpicoll.info*: set up region 0 of ``backend`` on ``ctx`` (collective) and
    say how it went."""
    _memory.ready(ctx, backend, 0, timeout, lambda: ("python -m mpicoll.info", None, None),
                  wait_for)
    return _memory.status(ctx, backend)
