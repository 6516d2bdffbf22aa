"""Transports: where a bound call's messages go and where its arrays live, one class each.

An operation (engine.executor) runs its steps on whatever transport engine.run
picked; the algorithm never asks which.  One interface: ``channel`` (where
messages go), ``backend`` and ``reducer`` (the steps' copies and reductions),
``views(schedule, lease, src, dst)``, ``claim(op)`` before a start,
``enter(op)``/``leave(op, exc)`` around it, ``static`` (nothing changes from
start to start) and ``close()``.  :class:`Host` (NumPy arrays straight to MPI),
:class:`NodeMemory` (the shared-memory algorithms, MPI carrying 0-byte flags),
:class:`Device` (direct to a CUDA-aware MPI, or staged per message) and
:class:`WholeStage` (small device calls staged whole).  Observation wraps
whatever channel a start runs on (observe.calls); a new transport (UCC or NCCL
underneath) is one class here and one line in engine.run's choice.
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
