"""Per-communicator state: the library's private duplicate, call counter, work memory.

The state (:class:`Context`) is an MPI attribute of the user's communicator,
made by its first collective, collectively, and freed with it.  Its set-up --
options parsed once (core.config), one ``Idup``, one ``Iallgather`` of node
identities and digests of what shapes schedules, rank 0's configuration
broadcast only where digests differ: the same collectives on every rank
whatever its options -- and what a set-up that times out leaves are
docs/design.md's "The set-up of a communicator (its very first call)".
"""

from __future__ import annotations

import hashlib
import json
import threading
import warnings
from collections import OrderedDict

import numpy as np
from mpi4py import MPI

from ..algorithms.schedule import DIRECT_SEGMENT_BYTES
from ..core import config as _config
from ..core.errors import CollectiveTimeout, MpicollError
from ..observe import calls as _observe
from ..transport import channel as _channel
from ..transport import timeout as _timeout
from ..transport import topology as _topology
from . import intranode as _intranode
from . import select as _select
from .executor import wait_for

_KEYVAL = None
SCHEDULES = 64  # schedules (call shapes) kept per context
# The options each rank reads from its environment that shape schedules (the algorithm
# "auto" runs, segments, windows, the check's extra messages, the dtype policy): agreed
# at set-up with the tuning file's selection (docs/design.md, "The set-up of a
# communicator (its very first call)").
SHAPING = ("check", "algorithm", "segment_bytes", "window", "node_piece_bytes",
           "deterministic", "intranode", "fake_nodes")

# (duplicate, [requests]) of set-ups that timed out: freed once the requests complete
_ABANDONED: list = []


def _digest(text: str) -> int:
    """A 63-bit hash of ``text`` (an int64 every rank computes alike)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


_HOST: list = []
_SHAPED: list = []  # (options, tuning file, digest) of the latest set-up (Context._shaping_digest)


def _host_id() -> int:
    """This process's node identity: a hash of its host name and the kernel's boot id (the
    same for every process of one machine, different across machines; once per process)."""
    if not _HOST:
        try:
            with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        _HOST.append(_digest(f"{MPI.Get_processor_name()}\0{boot}"))
    return _HOST[0]


_AWARE: list = []
REFUSED = -1  # (a rank's answer where its setting forces device buffers its MPI cannot take)


def _device_aware():
    """(1 where this rank would hand device buffers to MPI, else 0, or :data:`REFUSED`; why it
    refused or None): backends.cuda decides; 0 without CuPy (no device arrays can come)."""
    if not _AWARE:
        import importlib.util
        _AWARE.append(importlib.util.find_spec("cupy") is not None)
    if not _AWARE[0] and not _config.configured("cuda_aware") and not _config.text("cuda_aware"):
        return 0, None
    from ..backends import cuda as _cuda  # (no CUDA is touched without CuPy)
    try:
        return int(_cuda.cuda_aware_mpi().aware), None
    except ValueError as exc:  # (said on every rank, at the first device call: cuda_aware())
        return REFUSED, str(exc)


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
        # 1. every option first, read once for this communicator (core.config): a bad
        # value raises before any MPI call
        self.env = dict(_config.read_environment() if env is None else env)
        self._given_env = env is not None  # (its values win over a tuning file's)
        # intranode is read once, here: the program's setting (mpicoll.configure) joins the
        # values the ranks agree on
        resolved = _config.resolve(self.env)
        self.env["intranode"] = resolved["intranode"]
        if timeout is None:  # the set-up waits under the timeout option where no call set one
            timeout = resolved["timeout"]
        _select.check_forced(self.env["algorithm"])
        _topology.fake_labels(self.env["fake_nodes"])  # (checked here: used once agreed)
        self.notes: list = []  # warnings said once the call that set it up completed
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _select.tuning_file()  # read once per process (a bad MPICOLL_TUNING raises)
        self.active = 0  # its operations in flight (its duplicate is freed after the last)
        self.freeing = False  # the user's communicator was freed with operations in flight
        self.holders = 0  # persistent operations not freed (they keep the duplicate too)
        self.mpicoll_unusable = None  # why not, after a timeout (observe.calls)
        self.seq = 0  # collectives started on this communicator
        self.persistent_made = 0  # persistent operations made on it (their tags: executor.tag_of)
        self.work = WorkMemory()  # algorithms' work arrays, by purpose (see engine.context)
        self.cache = None  # its bound calls (engine.cache: made there, dropped by free())
        self.schedules = OrderedDict()  # (collective, algorithm, Shape) -> Schedule, LRU
        self.devices = {}  # device backends' state for this communicator (backends.devices)
        self.agreement = None  # why this rank uses rank 0's configuration, if it does
        self._epoch = -1  # (options(): the options epoch its cached values hold for)
        self._options: dict = {}
        self.observing = False  # a traffic counter or a trace records calls (options())
        self.tag_ub = 32767  # largest tag (MPI guarantees at least this), read from the duplicate
        self.comm = MPI.COMM_NULL
        self._timeout, self._describe = timeout, describe
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        aware, self._refusal = _device_aware()
        _reap()
        # 2. the private duplicate
        dup, req = comm.Idup()
        pending = [req]
        try:
            self._wait(pending, "duplicating the communicator (MPI_Comm_idup)")
            dup.Set_name(f"mpicoll dup of {comm.Get_name() or 'communicator'}")
            # 3. node identities, and whether the ranks would shape schedules alike
            mine = [_host_id(), self._shaping_digest(), aware]
            rows = [mine]
            if self.size > 1:
                table = np.zeros((self.size, len(mine)), dtype=np.int64)
                # MPI's own method: the duplicate of an mpicoll.Comm is an mpicoll.Comm
                pending = [MPI.Intracomm.Iallgather(dup, np.array(mine, dtype=np.int64), table)]
                self._wait(pending, "exchanging node identities (MPI_Iallgather)")
                rows = table.tolist()
            # 4. rank 0's configuration where the ranks' differ
            ids = [row[0] for row in rows]
            differ = len({row[1] for row in rows}) > 1
            if differ:
                self._adopt_rank0(dup, pending, caught, ids)
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
        self.nodes = self._labels(dup, ids)  # node label per rank
        nnodes = len(set(self.nodes))
        with warnings.catch_warnings(record=True) as more:
            warnings.simplefilter("always")
            if not differ:  # (else rank 0's, adopted above)
                self.selection = _select.selection(self.size, nnodes)
        self.notes += [str(w.message) for w in caught + more]
        self.segment_bytes, self.window = self.env["segment_bytes"], self.env["window"]
        # how the ranks of a node move data (engine.intranode): the agreed option
        self.intranode = self.env["intranode"]
        # the piece to another node: the option, else the tuning's (agreed: the same on
        # every rank, as both ends of a message must cut it alike)
        self.node_piece = self._node_piece_wanted()
        # device buffers straight to MPI only where every rank's MPI takes them
        takes = [row[2] for row in rows]
        self.aware = all(t == 1 for t in takes)
        self._refused = [r for r, t in enumerate(takes) if t == REFUSED]
        if 1 in takes and not self.aware and not self._refused:
            self.notes.append(f"mpicoll: device buffers are staged through host memory on "
                              f"every rank: the MPI of rank(s) "
                              f"{[r for r, t in enumerate(takes) if not t]} does not "
                              f"take them (python -m mpicoll.info --probe says why)")
        self.ring = _topology.ring_from_nodes(list(self.nodes))
        self.ring_pos = self.ring.index(self.rank)
        # per rank, whether it shares this rank's node: the channels' piece size
        self.local = _channel.local_ranks(self.nodes, self.rank)
        # the tuning file's segment and window, unless the options were set (an explicit
        # choice wins over a measured default)
        self.tuned_options = tuple(n for n in ("segment_bytes", "window")
                                   if not self.env.get(f"set {n}", bool(_config.text(n)))
                                   and self.env[n] == _config.TABLE[n].default)

    def _labels(self, dup, ids) -> tuple:
        """Every rank's node label: the lowest rank of its node by node identity, or by the
        agreed ``MPICOLL_FAKE_NODES`` (COMM_WORLD ranks' labels)."""
        fake = _topology.fake_labels(self.env["fake_nodes"])
        if fake is not None:
            world = MPI.COMM_WORLD.Get_group()
            group = dup.Get_group()
            try:
                ranks = MPI.Group.Translate_ranks(group, list(range(self.size)), world)
            finally:
                group.Free()
                world.Free()
            ids = [fake[r] for r in ranks]
        first: dict = {}
        for r, i in enumerate(ids):
            first.setdefault(i, r)
        return tuple(first[i] for i in ids)

    def cuda_aware(self) -> bool:
        """Whether device buffers go straight to MPI on this communicator: the program's
        setting (``mpicoll.configure(cuda_aware=...)``), else what every rank's MPI does
        (agreed at set-up; backends.cuda decides each rank's)."""
        if _config.configured("cuda_aware"):
            from ..backends import cuda as _cuda
            return _cuda.cuda_aware_mpi().aware  # (a setting its MPI cannot honour: refused)
        if self._refused:  # (a rank's MPICOLL_CUDA_AWARE=1: refused on every rank alike)
            raise ValueError(self._refusal or (
                f"MPICOLL_CUDA_AWARE: rank(s) {self._refused} force device buffers to MPI, "
                f"which their MPI cannot read (their error says why)"))
        return self.aware

    def flush_notes(self) -> None:
        """Say what the set-up had to say (RuntimeWarning), now that its call completed."""
        notes, self.notes = self.notes, []
        for note in notes:
            warnings.warn(note, RuntimeWarning, stacklevel=3)

    def options(self) -> dict:
        """The options in force for this communicator (core.config.resolve of the values read
        at set-up), and :attr:`observing`: computed again only after a change of settings or
        observers (core.config.EPOCH), not at every call."""
        if self._epoch != _config.EPOCH[0]:
            self._options = _config.resolve(self.env)
            self.observing = _observe.observing()
            self._epoch = _config.EPOCH[0]
        return self._options

    def _shaping_options(self) -> dict:
        return {"options": {n: self.env[n] for n in SHAPING},
                "set": {n: bool(_config.text(n)) or _config.configured(n) or self._given_env
                        for n in SHAPING}}

    def _shaping(self) -> str:
        """What this rank would shape schedules with, as text: the options of
        :data:`SHAPING` (with whether each was set) and the tuning file (its content)."""
        tf, note = _select.tuning_file()
        return json.dumps(dict(self._shaping_options(), file=None if tf is None else tf.data,
                               note=note), sort_keys=True, default=str)

    def _shaping_digest(self) -> int:
        """:func:`_digest` of :meth:`_shaping`, kept for the latest set-up's options and the
        process's tuning file (encoding that file's content is most of a set-up's cost)."""
        found = _select.tuning_file()
        shaping = self._shaping_options()
        key = tuple((v, type(v)) for part in shaping.values() for v in part.values())
        if _SHAPED and _SHAPED[0] == key and _SHAPED[1] is found:
            return _SHAPED[2]
        digest = _digest(self._shaping())
        _SHAPED[:] = [key, found, digest]
        return digest

    def _configuration(self, selection) -> str:
        """What rank 0 sends when the ranks' differ: its options and its selection's entry."""
        entry = selection.entry
        return json.dumps(dict(self._shaping_options(), entry=None if entry is None else entry.raw,
                               source=selection.source), sort_keys=True, default=str)

    def _adopt_rank0(self, dup, pending: list, caught, ids) -> None:
        """Every rank takes rank 0's configuration (module docstring); collective.  Its
        warnings join ``caught`` (said once the call completed)."""
        if self.rank == 0:
            with warnings.catch_warnings(record=True) as more:
                warnings.simplefilter("always")
                self.selection = _select.selection(self.size, len(set(self._labels(dup, ids))))
            caught += more
            data = self._configuration(self.selection).encode()
        else:
            data = b""
        size = np.array([len(data)], dtype=np.int64)
        pending[:] = [dup.Ibcast(size, root=0)]
        self._wait(pending, "agreeing on rank 0's tuning and options (MPI_Ibcast)")
        buf = np.frombuffer(data, dtype=np.uint8).copy() if self.rank == 0 else \
            np.empty(int(size[0]), dtype=np.uint8)
        pending[:] = [dup.Ibcast(buf, root=0)]
        self._wait(pending, "agreeing on rank 0's tuning and options (MPI_Ibcast)")
        if self.rank == 0:
            return
        config = json.loads(buf.tobytes().decode())
        for name in SHAPING:
            self.env[name] = config["options"][name]
            self.env[f"set {name}"] = config["set"][name]
        nodes = len(set(self._labels(dup, ids)))
        self.selection = _select.adopted(config["entry"], self.size, nodes, config["source"])
        self.agreement = (f"this rank's tuning or options differed from rank 0's; rank 0's "
                          f"are used on every rank (rank 0: {config['source']})")
        self.notes.append(f"mpicoll: {self.agreement}")

    def _node_piece_wanted(self) -> int:
        """This rank's piece to another node: ``node_piece_bytes`` if set, else the tuning
        entry's (python -m mpicoll.tune measures it across nodes), else the default."""
        tuned = self.selection.entry.raw.get("node_piece_bytes") if self.selection.entry else None
        explicit = self.env.get("set node_piece_bytes", bool(_config.text("node_piece_bytes")))
        if (self._given_env or explicit or not isinstance(tuned, int)
                or isinstance(tuned, bool) or tuned <= 0):
            return self.env["node_piece_bytes"]
        return tuned

    def _wait(self, pending: list, step: str) -> None:
        """Complete the set-up requests ``pending``; CollectiveTimeout after the call's timeout."""
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

    def segment_window(self, collective: str, algorithm: str, nbytes: int, auto: bool,
                       direct: bool = False):
        """(segment bytes, window) of a call of ``algorithm`` moving ``nbytes``: the options,
        or for an "auto" call the tuning file's values for that size where it has some;
        ``direct``: device arrays handed straight to MPI, whose segment is
        algorithms.schedule.DIRECT_SEGMENT_BYTES where the option was left at its default
        (the tuning file measured host arrays)."""
        seg, win = self.segment_bytes, self.window
        if direct:
            if "segment_bytes" in self.tuned_options and seg == self.env["segment_bytes"]:
                seg = DIRECT_SEGMENT_BYTES
            return seg, win
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
        """``build(shape)``, cached for the :data:`SCHEDULES` shapes used last (built once per
        process where another communicator used the same shape: :func:`built`)."""
        key = (collective, algorithm, shape)
        cache = self.schedules
        sched = cache.get(key)
        if sched is None:
            sched = cache[key] = built(key, build)
            if len(cache) > SCHEDULES:
                cache.popitem(last=False)
        else:
            cache.move_to_end(key)
        return sched

    def drop_cache(self) -> None:
        """Drop this context's bound calls (engine.cache): its communicator is freed, or
        unusable after a timeout."""
        if self.cache is not None:
            self.cache.drop()

    def free(self) -> None:
        """The user's communicator is freed: so is mpicoll's duplicate, once the operations
        in flight on it have completed and the persistent operations made on it are freed
        (MPI's rule for MPI_Comm_free: a request keeps its communicator)."""
        self.drop_cache()
        self.schedules.clear()
        if self.active or self.holders:
            self.freeing = True
            return
        self._release()

    def operation_ended(self) -> None:
        """One of its operations in flight ended."""
        self.active -= 1
        if self.freeing and self.active == 0 and self.holders == 0:
            self._release()

    def let_go(self) -> None:
        """A persistent operation made on it was freed."""
        self.holders -= 1
        if self.freeing and self.active == 0 and self.holders == 0:
            self._release()

    def _release(self) -> None:
        _intranode.release(self)  # node memory (engine.intranode), before the duplicate goes
        self.freeing = False
        self.work = WorkMemory()
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()
        self.comm = MPI.COMM_NULL


_BUILT: OrderedDict = OrderedDict()  # (collective, algorithm, Shape) -> Schedule, process-wide
_BUILDING = threading.Lock()  # (a node memory's set-up binds its call in the progress thread)


def built(key, build):
    """``build(key[2])`` for ``key`` = (collective, algorithm, Shape), kept for the
    :data:`SCHEDULES` keys used last in this process: a schedule is plain data that its key
    fixes, so a new communicator's first call of a shape takes the one built before."""
    with _BUILDING:
        sched = _BUILT.get(key)
        if sched is not None:
            _BUILT.move_to_end(key)
            return sched
    sched = build(key[2])
    with _BUILDING:
        _BUILT[key] = sched
        if len(_BUILT) > SCHEDULES:
            _BUILT.popitem(last=False)
    return sched


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


# --- work memory ---------------------------------------------------------------------------
#
# Work memory: one arena per context; buffers are asked for by purpose, never by number.
#
# A run that needs work arrays opens a *scope* of its context's arena (the
# executor's ``run_on`` does, around a schedule) and asks for each array by
# what it is for::
#
#     with ctx.work.scope(be):
#         tmp = ctx.work.take(dst.dtype, len(dst), "partner's partial result")
#
# Leases: work memory of an operation that outlives a function call
#     A non-blocking or persistent collective (engine.executor) holds its work
#     buffers from its start until it completes (persistent: until freed),
#     while other calls run.  It takes them from a :class:`Lease`
#     (:meth:`WorkMemory.lease`), released explicitly; lifetimes need not
#     nest.  A scope is a lease that a ``with`` block releases.
#
# Why two live uses cannot alias
#     Every region taken (by a scope or a lease) is recorded as an interval
#     of its (backend, dtype) array until it is released, and a new region goes
#     to the lowest gap that none of the live intervals covers (first fit).
#     So the regions of all live scopes and leases are pairwise disjoint,
#     whatever order they are released in, however many buffers a call asks
#     for.  A take always goes to the innermost open scope (or to the lease it
#     is asked of).
#
# Storage
#     One 1-D array per (backend, dtype), reused by every call.  A take that
#     does not fit the array gets an array of its own until it is released;
#     once no region of that array is live any more, the array grows to the
#     highest end a region ever needed.  A repeated call of one signature then
#     allocates nothing.  ``backend.empty(n, dtype)`` is the only allocation.
#
# After a call that timed out, receives may still be pending into the arena;
# such a context is marked unusable (see observe.calls), so no later call on it
# reuses that memory.

class WorkMemory:
    """The arena of one context: see the module docstring.

    Attributes:
        allocations: number of ``backend.empty`` calls made so far (tests and
            the benchmark read it: a repeated call must not add any).
    """

    __slots__ = ("_blocks", "_live", "_need", "_taken", "_scopes", "allocations")

    def __init__(self):
        self._blocks: dict = {}   # (backend name, dtype) -> 1-D array
        self._live: dict = {}     # key -> [[start, end, region], ...] sorted by start
        self._need: dict = {}     # key -> highest end a region needed beyond the array
        self._taken: list = []    # live regions, oldest first (see live())
        self._scopes: list = []   # open scopes, innermost last
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Bytes the arena holds between calls."""
        return sum(int(arr.nbytes) for arr in self._blocks.values())

    def scope(self, backend) -> _Scope:
        """A context manager for one algorithm run on ``backend`` (nests)."""
        return _Scope(self, backend)

    def lease(self, backend) -> Lease:
        """Work memory on ``backend`` held until :meth:`Lease.release` (any order)."""
        return Lease(self, backend)

    def take(self, dtype, n: int, purpose: str):
        """A 1-D work array of ``n`` elements of ``dtype`` for ``purpose`` (contents undefined).

        Disjoint from every other live region; valid until the innermost open
        scope closes.
        """
        if not self._scopes:
            raise RuntimeError(f"work memory for {purpose!r} taken outside a work-memory scope")
        return self._scopes[-1].take(dtype, n, purpose)

    def _take(self, owner, dtype, n: int, purpose: str):
        key = (owner.backend.name, dtype)
        live = self._live.get(key)
        if live is None:
            live = self._live[key] = []
        # first fit: the lowest gap between live intervals that holds n elements
        start, at = 0, len(live)
        for i, iv in enumerate(live):
            if iv[0] - start >= n:
                at = i
                break
            if iv[1] > start:
                start = iv[1]
        end = start + n
        region = _Region(purpose, key, start, end)
        live.insert(at, region)
        self._taken.append(region)
        owner.regions.append(region)
        block = self._blocks.get(key)
        if block is not None and end <= len(block):
            return block[start:end]
        # missing or too short: the arena's array grows once nothing of it is live
        if end > self._need.get(key, 0):
            self._need[key] = end
        if start == 0 and len(live) == 1:
            # nothing else of this kind is live: replace the array by one that fits
            self._blocks[key] = None
            block = self._blocks[key] = self._alloc(owner.backend, max(n, 1), dtype)
            return block[:n]
        region.own = self._alloc(owner.backend, max(n, 1), dtype)
        return region.own[:n]

    def _give_back(self, owner) -> None:
        """Release every region of ``owner``; grow arrays no region lives in any more."""
        for region in owner.regions:
            live = self._live[region.key]
            live.remove(region)
            self._taken.remove(region)
            region.own = None
            need = self._need.get(region.key)
            if need is not None and not live:
                del self._need[region.key]
                block = self._blocks.get(region.key)
                if block is None or len(block) < need:
                    self._blocks[region.key] = None  # freed before the new one is made
                    self._blocks[region.key] = self._alloc(owner.backend, need, region.key[1])
        owner.regions = []

    def live(self) -> list:
        """(purpose, dtype, elements) of every live region, oldest first."""
        return [(r.purpose, r.key[1], r.end - r.start) for r in self._taken]

    def spans(self) -> list:
        """(backend name, dtype, start, end) of every live region in its array, oldest first."""
        return [(*r.key, r.start, r.end) for r in self._taken]

    def release(self) -> None:
        """Drop the arena's arrays (reallocated when needed); not while a region is live."""
        if self._taken or self._scopes:
            raise RuntimeError("work memory released while a call is using it")
        self._blocks.clear()
        self._need.clear()

    def _alloc(self, be, n, dtype):
        self.allocations += 1
        return be.empty(n, dtype)


class _Region:
    __slots__ = ("purpose", "key", "start", "end", "own")

    def __init__(self, purpose, key, start, end):
        self.purpose, self.key, self.start, self.end = purpose, key, start, end
        self.own = None  # an array of its own, where the arena's was too short

    def __getitem__(self, i):  # (start, end), as WorkMemory._take reads live intervals
        return (self.start, self.end)[i]


class Lease:
    """Regions of one operation, held until :meth:`release` (idempotent)."""

    __slots__ = ("mem", "backend", "regions")

    def __init__(self, mem: WorkMemory, backend):
        self.mem, self.backend, self.regions = mem, backend, []

    def take(self, dtype, n: int, purpose: str):
        """A 1-D work array of ``n`` elements for ``purpose``, disjoint from every live region."""
        return self.mem._take(self, dtype, n, purpose)

    @property
    def nbytes(self) -> int:
        """Bytes of the regions it holds."""
        return sum((r.end - r.start) * np.dtype(r.key[1]).itemsize for r in self.regions)

    def release(self) -> None:
        if self.regions:
            self.mem._give_back(self)


class _Scope(Lease):
    """``with mem.scope(backend):`` -- one algorithm call's use of the arena."""

    __slots__ = ()

    def __enter__(self):
        self.mem._scopes.append(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.mem._scopes.remove(self)
        self.release()
        return False
