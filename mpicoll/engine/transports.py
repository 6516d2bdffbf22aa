"""Transports: where a bound call's messages go and where its arrays live, one class each.

An operation (engine.executor) runs its steps on whatever transport engine.run
picked for the call; the algorithm never asks which.  Every transport has one
interface:

``channel``                 where messages go (``isend``, ``irecv``, ``waitall``, ...)
``backend``, ``reducer``    copies and reductions of the steps
``views(schedule, lease, src, dst)``   the arrays the schedule's regions name
``claim(op)``               before a start: what the start needs of earlier ones
``enter(op)``, ``leave(op, exc)``      around each start (device ordering, staging)
``static``                  True when nothing of the above changes from start to start
``close()``                 what it holds goes back

* :class:`Host` -- host (NumPy) arrays straight to MPI (transport.channel).
* :class:`NodeMemory` -- the shared-memory algorithms: each rank's buffer mapped
  into the ranks of its node (transport.shared; engine.intranode holds the
  regions), MPI carrying only 0-byte flags.
* :class:`Device` -- device arrays, their messages either straight to a
  CUDA-aware MPI (transport.staging.DirectChannel) or staged through pinned host
  memory per message (StagingChannel).
* :class:`WholeStage` -- small device calls on the staging path: the whole
  arrays copied to pinned host memory once, the host algorithm run there
  (backends.devices.WholeStage).

Observation (check, trace, traffic, windowed pieces under a timeout) is not a
transport: observe.calls wraps whatever channel a start runs on.  A new
transport (UCC or NCCL underneath, say) is one class here and one line in
engine.run's choice.
"""

from __future__ import annotations

from ..algorithms.schedule import DST, SRC
from ..backends.host import NUMPY
from ..transport.channel import Channel
from . import executor as _executor
from . import intranode as _intranode


class Host:
    """Host arrays, their messages straight to MPI on the context's duplicate."""

    static = True

    def __init__(self, ctx, msg, reducer):
        self.ctx = ctx
        self.backend = NUMPY if msg.backend.name == "numpy" else msg.backend
        self.reducer = reducer
        self.channel = Channel(ctx.comm, msg.mpitype, local=ctx.local,
                               node_bytes=ctx.node_piece)

    def views(self, schedule, lease, dtype, src, dst, bound=None) -> dict:
        views = _executor.work_views(schedule, lease, dtype) if schedule.work else {}
        views[DST] = dst
        views[SRC] = dst if src is None else src
        return views

    def claim(self, op) -> None:
        pass

    def enter(self, op) -> None:
        pass

    def leave(self, op, exc) -> None:
        pass

    def close(self) -> None:
        pass


class NodeMemory(Host):
    """The shared-memory algorithms: the node buffers of ``region`` (engine.intranode) bound
    with the call's arrays; every start first waits for the operation that holds the
    region (:func:`engine.intranode.claim`).  Device arrays' messages are 0-byte flags after
    their stream drained (transport.shared.SyncChannel)."""

    def __init__(self, ctx, msg, reducer, region, holder=None):
        super().__init__(ctx, msg, reducer)
        self.region = region
        self.holder = _intranode.Holder() if holder is None else holder
        self.device = msg.backend.name != "numpy"
        self.static = not self.device
        self._be = msg.backend
        self._mpitype = msg.mpitype

    def views(self, schedule, lease, dtype, src, dst, bound=None) -> dict:
        views = super().views(schedule, lease, dtype, src, dst)
        views.update(_intranode.views(self.ctx, self._be, self.region, schedule, dtype, views,
                                      bound))
        return views

    def claim(self, op) -> None:
        _intranode.claim(self.ctx, self.region, op, self.holder)

    def enter(self, op) -> None:
        if self.device:  # (the stream of this start: the caller's current one)
            ch = _intranode.channel(self.ctx, self._be, self._mpitype, op.bound.schedule)
            op.use_channel(ch or self._be.channel(self.ctx, self._mpitype))
            self._be.prepare()

    def leave(self, op, exc) -> None:
        if self.device and exc is None:
            self._be.finish()


class Deferred:
    """The transport of a non-blocking operation before its node memory is set up (its first
    steps: engine.intranode.prelude): it claims the region; run._bind replaces it."""

    static = True
    channel = backend = reducer = None

    def __init__(self, ctx, region, setup):
        self.ctx, self.region, self.setup = ctx, region, setup
        self.holder = _intranode.Holder()

    def claim(self, op) -> None:
        _intranode.claim(self.ctx, self.region, op, self.holder)

    def enter(self, op) -> None:
        pass

    def leave(self, op, exc) -> None:
        if exc is not None:
            self.setup.abandon()

    def close(self) -> None:
        pass


class Device:
    """Device arrays: messages straight to a CUDA-aware MPI or staged through pinned host
    memory (the backend's channel, made at every start on the caller's current stream)."""

    static = False

    def __init__(self, ctx, msg, reducer):
        self.ctx = ctx
        self.backend = msg.backend
        self.reducer = reducer
        self._mpitype = msg.mpitype
        self.channel = None

    views = Host.views
    claim = Host.claim

    def enter(self, op) -> None:
        op.use_channel(self.backend.channel(self.ctx, self._mpitype))
        self.backend.prepare()

    def leave(self, op, exc) -> None:
        if exc is None:
            self.backend.finish()

    close = Host.close


class WholeStage(Device):
    """Small device calls on the staging path: the host algorithm on one pinned copy of the
    arrays (backends.devices.WholeStage), rebound to that copy at every start."""

    def __init__(self, ctx, msg, reducer, op, writes_all):
        super().__init__(ctx, msg, reducer)
        self._op = op
        self._writes_all = writes_all
        self._stage = None

    def enter(self, op) -> None:
        b = op.bound
        stage = self._stage = self.backend.whole_stage(self.ctx, b.nbytes, b.msg, self._op)
        op.use_channel(stage.channel, stage.backend, stage.reducer)
        self.backend.prepare()
        src, dst = stage.enter(b.src, b.dst, self._writes_all)
        op._run_steps = b.bind(src, dst, stage.backend)

    def leave(self, op, exc) -> None:
        stage, self._stage = self._stage, None
        if exc is None and stage is not None:
            stage.leave()
            self.backend.finish()
