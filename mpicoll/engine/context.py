"""Per-communicator state: the library's private duplicate, call counter, work memory.

The state is cached on the user's communicator as an MPI attribute, so it is
created once (on the first collective, collectively), shared by every
``mpicoll.Comm`` wrapping the same communicator, and freed together with the
user's communicator (``comm.Free()`` runs the attribute's delete callback).

Set-up (:class:`Context`), in this order:

1. every option it reads (``MPICOLL_SEGMENT_BYTES``, ``MPICOLL_WINDOW``,
   ``MPICOLL_FAKE_NODES``) is parsed; a bad value raises before any MPI call;
2. ``Idup`` of the user's communicator;
3. with more than one rank: ``Ibarrier`` on the duplicate (only for the real
   node membership: after it every rank is known to be in the set-up, so the
   blocking ``Split_type`` that follows cannot wait for a missing rank), then
   ``Iallgather`` of the node labels, which gives the ring order.

Each request is waited for with the call's timeout (the poller of
:mod:`_timeout`; no timeout: ``Wait``), so a rank that never reaches its
first collective on a communicator makes the others raise
:class:`~mpicoll.CollectiveTimeout` instead of hanging.  After such a timeout
the user's communicator still has mpicoll's ``Idup`` (or the duplicate its
exchange) pending, and MPI matches collectives in order: any later collective
on it, mpicoll's or the user's, could pair with that one.  So the
communicator is marked unusable (every later mpicoll call raises
``MpicollError``), and the duplicate, which MPI forbids freeing while its
creation or exchange is pending, is kept and freed as soon as those complete
(checked at every later set-up and when the user's communicator is freed).
A set-up that fails otherwise frees what it created and caches nothing.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np
from mpi4py import MPI

from ..core import config as _config
from ..core.errors import CollectiveTimeout, MpicollError
from ..transport import channel as _channel
from ..transport import timeout as _timeout
from .workmem import WorkMemory

_KEYVAL = None
SCHEDULES = 64  # schedules (call shapes) kept per context

# (duplicate, [requests]) of set-ups that timed out: freed once the requests complete
_ABANDONED: list = []


def _delete_state(comm, keyval, state):
    state.free()


def _reap() -> None:
    """Free the duplicates of timed-out set-ups whose pending requests have completed."""
    if MPI.Is_finalized():
        return
    for entry in list(_ABANDONED):
        dup, reqs = entry
        if MPI.Request.Testall(reqs):
            _ABANDONED.remove(entry)
            if dup != MPI.COMM_NULL:
                dup.Free()


class _Step:
    """A set-up request as :func:`_timeout.wait` polls it."""

    __slots__ = ("req", "kind", "done")

    def __init__(self, req):
        self.req = req
        self.kind = "setup"
        self.done = None


class _Unusable:
    """Cached in place of a Context whose set-up timed out: refuses every later call."""

    def __init__(self, why: str):
        self.why = why

    def free(self) -> None:
        _reap()


class Context:
    """What mpicoll keeps for one user communicator.

    Args:
        comm: the user's communicator.
        timeout: seconds each set-up step may wait without progress (None: wait).
        describe: ``describe() -> (call, collective, algorithm)`` for a timeout:
            how the call that triggered the set-up names itself in the message
            (``"allreduce #1 (ring, 100 x float64)"``) and the exception's
            attributes; None: "collective #1".
    """

    def __init__(self, comm: MPI.Intracomm, timeout: float | None = None, describe=None,
                 env: dict | None = None):
        from ..transport import topology as _topology
        from . import intranode as _intranode
        # 1. every option first, read once for this communicator (core.config): a bad
        # value raises before any MPI call
        self.env = _config.read_environment() if env is None else env
        self._given_env = env is not None  # (its values win over a tuning file's)
        self.segment_bytes, self.window = self.env["segment_bytes"], self.env["window"]
        fake = _topology.fake_labels(self.env["fake_nodes"])
        self.active = 0  # its operations in flight (its duplicate is freed after the last)
        self.freeing = False  # the user's communicator was freed with operations in flight
        from . import select as _select
        _select.tuning_file()  # the tuning file, read once per process (a bad MPICOLL_TUNING raises)
        self.seq = 0  # collectives started on this communicator
        self.persistent_made = 0  # persistent operations made on it (their tags: executor.tag_of)
        self.work = WorkMemory()  # algorithms' work arrays, by purpose (see engine.workmem)
        self.plans = OrderedDict()  # (name, comm, argument ids) -> engine.plan.Plan
        # (name, ids of the communicator and argument objects) -> engine.plan.Plan: the
        # non-blocking repeats (engine.plan)
        self.kept = OrderedDict()
        self.schedules = OrderedDict()  # (collective, algorithm, Shape) -> Schedule, LRU
        self.programs = weakref.WeakSet()  # runs of persistent operations holding programs
        self.devices = {}  # device backends' state for this communicator (backends.devices)
        self.tag_ub = 32767  # largest tag (MPI guarantees at least this), read from the duplicate
        self.comm = MPI.COMM_NULL
        self._timeout, self._describe = timeout, describe
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        _reap()
        # 2. the private duplicate
        dup, req = comm.Idup()
        pending = [req]
        try:
            self._wait(pending, "duplicating the communicator (MPI_Comm_idup)")
            dup.Set_name(f"mpicoll dup of {comm.Get_name() or 'communicator'}")
            # 3. the ring order
            # per rank: its node label and (transport.shared) its intranode option
            labels = np.zeros((self.size, 2), dtype=np.int64)
            labels[self.rank, 1] = _intranode.option_code(self.env)
            if self.size > 1:
                if fake is None:
                    pending = [dup.Ibarrier()]
                    self._wait(pending, "waiting for every rank to reach the set-up (MPI_Ibarrier)")
                mine = np.array([_topology.node_label(dup, fake), labels[self.rank, 1]],
                                dtype=np.int64)
                # MPI's own method: the duplicate of an mpicoll.Comm is an mpicoll.Comm
                pending = [MPI.Intracomm.Iallgather(dup, mine, labels)]
                self._wait(pending, "exchanging node labels (MPI_Iallgather)")
            # --- node memory (transport.shared): the ranks' agreed intranode option
            self.intranode = _intranode.agree_option(labels[:, 1])
            # 4. what "auto" picks on this communicator (its rank and node counts choose the
            # tuning), and the piece to another node: the option, else the tuning's, the
            # ranks' least (both ends of a message must cut it alike)
            nodes = tuple(labels[:, 0].tolist())
            self.selection = _select.selection(self.size, len(set(nodes)))
            piece = np.array([self._node_piece_wanted()], dtype=np.int64)
            if len(set(nodes)) > 1:  # (on one node no message goes to another: nothing to agree)
                least = np.empty(1, dtype=np.int64)
                pending = [MPI.Intracomm.Iallreduce(dup, piece, least, MPI.MIN)]
                self._wait(pending, "agreeing on the piece size across nodes (MPI_Iallreduce)")
                piece = least
        except BaseException:
            if MPI.Request.Testall(pending):
                dup.Free()
            else:
                _ABANDONED.append((dup, pending))
            raise
        del self._timeout, self._describe
        self.comm = dup
        ub = dup.Get_attr(MPI.TAG_UB)
        if ub:
            self.tag_ub = int(ub)
        self.node_piece = int(piece[0])  # (channels to other nodes: transport.channel)
        self.nodes = nodes  # node label per rank (Shape.nodes, select.choose)
        self.ring = _topology.ring_from_nodes(list(nodes))
        self.ring_pos = self.ring.index(self.rank)
        # per rank, whether it shares this rank's node: the channels' piece size
        self.local = _channel.local_ranks(self.nodes, self.rank)
        # the tuning file's segment and window, unless the options were set (an explicit
        # choice wins over a measured default)
        self.tuned_options = tuple(n for n in ("segment_bytes", "window")
                                   if not _config.text(n)
                                   and self.env[n] == _config.TABLE[n].default)

    def _node_piece_wanted(self) -> int:
        """This rank's piece to another node: ``node_piece_bytes`` if set, else the tuning
        entry's (python -m mpicoll.tune measures it across nodes), else the default."""
        tuned = self.selection.entry.raw.get("node_piece_bytes") if self.selection.entry else None
        if (self._given_env or _config.text("node_piece_bytes") or not isinstance(tuned, int)
                or isinstance(tuned, bool) or tuned <= 0):
            return self.env["node_piece_bytes"]
        return tuned

    def _wait(self, pending: list, step: str) -> None:
        """Complete the set-up requests ``pending``; CollectiveTimeout after the call's timeout."""
        from .executor import wait_for
        # the operations in flight advance meanwhile (a peer may wait for them first)
        if wait_for(lambda: MPI.Request.Testall(pending), timeout=self._timeout):
            return
        if self._timeout is None:
            MPI.Request.Waitall(pending)
            return
        steps = [_Step(r) for r in pending]
        _timeout.wait(steps, self._timeout, lambda left, idle: self._expired(step, idle),
                      _timeout.tester(steps))

    def _expired(self, step: str, idle: float) -> CollectiveTimeout:
        call, collective, algorithm = ("collective #1", None, None) if self._describe is None \
            else self._describe()
        msg = (
            f"{call} on rank {self.rank}: no progress for {idle:.3g} s "
            f"(timeout {self._timeout:g} s) while setting up mpicoll on this communicator, "
            f"{step}. Some rank has not joined the set-up: it may have skipped this call, "
            f"called a collective on another communicator, or be stuck or dead. This "
            f"communicator cannot be used again; end the job with mpicoll.abort()"
        )
        return CollectiveTimeout(msg, collective=collective, seq=1, algorithm=algorithm,
                                 rank=self.rank, peer=None, phase="setup", step=None,
                                 timeout=self._timeout)

    def segment_window(self, collective: str, algorithm: str, nbytes: int, auto: bool):
        """(segment bytes, window) of a call of ``algorithm`` moving ``nbytes``: the options,
        or for an "auto" call the tuning file's values for that size where it has some."""
        seg, win = self.segment_bytes, self.window
        if not (auto and self.selection.segments):  # (the common case: nothing to look up)
            return seg, win
        tuned = self.selection.segment(collective, algorithm, nbytes)
        if tuned is not None:  # (a value set on the context itself wins too, as the options)
            if tuned[0] is not None and "segment_bytes" in self.tuned_options \
                    and seg == self.env["segment_bytes"]:
                seg = tuned[0]
            if tuned[1] is not None and "window" in self.tuned_options \
                    and win == self.env["window"]:
                win = tuned[1]
        return seg, win

    def schedule(self, collective: str, algorithm: str, build, shape):
        """``build(shape)``, cached for the :data:`SCHEDULES` shapes used last."""
        key = (collective, algorithm, shape)
        cache = self.schedules
        sched = cache.get(key)
        if sched is None:
            sched = cache[key] = build(shape)
            if len(cache) > SCHEDULES:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return sched

    def drop_plans(self) -> None:
        """Drop the plans of this context (engine.plan) and the programs of its persistent
        operations (engine.executor): freed, or unusable after a timeout."""
        from .collectives import drop_programs
        from .plan import drop_all
        drop_all(self)
        drop_programs(self)

    def free(self) -> None:
        """The user's communicator is freed: so is mpicoll's duplicate, once the operations
        in flight on it have completed (MPI's rule for MPI_Comm_free)."""
        self.drop_plans()
        self.schedules.clear()
        if self.active:
            self.freeing = True
            return
        self._release()

    def operation_ended(self) -> None:
        """One of its operations in flight ended."""
        self.active -= 1
        if self.freeing and self.active == 0:
            self._release()

    def _release(self) -> None:
        from . import intranode as _intranode
        _intranode.release(self)  # node memory (engine.intranode), before the duplicate goes
        self.freeing = False
        self.work = WorkMemory()
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self.comm = MPI.COMM_NULL


def keyval() -> int:
    """The MPI attribute key the contexts are cached under on the user's communicators."""
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_state)
    return _KEYVAL


def existing(comm: MPI.Intracomm):
    """The context of ``comm`` if it has one (None before its first call); MpicollError if
    an earlier set-up on ``comm`` timed out."""
    state = comm.Get_attr(keyval())
    if type(state) is _Unusable:
        context(comm)
    return state


def context(comm: MPI.Intracomm, timeout: float | None = None, describe=None,
            env: dict | None = None) -> Context:
    """The cached state of ``comm``; the first call on a communicator is collective.

    The other arguments only matter for that first call (see :class:`Context`).
    MpicollError if an earlier set-up on ``comm`` timed out.
    """
    key = keyval()
    state = comm.Get_attr(key)
    if state is None:
        try:
            state = Context(comm, timeout, describe, env)
        except CollectiveTimeout as exc:
            comm.Set_attr(key, _Unusable(f"{exc.collective or 'a collective'} #1 timed out "
                                             f"on rank {exc.rank} while setting it up"))
            raise
        comm.Set_attr(key, state)
    elif type(state) is _Unusable:
        raise MpicollError(
            f"communicator unusable: {state.why}; mpicoll's set-up collectives may still be "
            f"pending on it, so end the job with mpicoll.abort() (see docs/reliability.md)"
        )
    return state
