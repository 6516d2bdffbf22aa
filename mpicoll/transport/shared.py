"""Node memory: each rank's buffer mapped into the other ranks of its node.

The shared-memory algorithms (mpicoll/algorithms/shared.py) read and write
the buffers of the ranks of their node directly; MPI carries only their
0-byte synchronisation messages.  This module maps those buffers for a
communicator's context, for host and for device arrays, in *regions*
(engine.intranode says which call uses which, and asks for each on first
use): each rank's buffer in a region is two slots of :data:`HOST_SLOT_BYTES`
(device :data:`DEVICE_SLOT_BYTES`), so the memory stays bounded whatever the
array size.  A set-up is an exchange among every rank of the communicator
(point-to-point messages with the blocking calls' tag, under the call's
timeout) and succeeds only if every rank's does; otherwise no rank uses
that backend's node memory on this communicator again, and the reason is
kept (``python -m mpicoll.info`` prints it).

Host arrays: anonymous shared memory (memfd)
    Each rank creates memory of no name (``memfd_create``, mode 0600),
    reserves all of it at once (``posix_fallocate``: where memory is short,
    the set-up fails, never a write mid-collective with SIGBUS), seals its
    size, maps it and writes a random token at its start; the handles
    (``<pid>:<fd>``) go to every rank (one message to each); each rank opens
    its node peers' memory through ``/proc/<pid>/fd/<fd>`` (only a memfd of
    mpicoll's, a regular file of this user of the right size and token:
    another machine's pid names something else), maps it, and every rank
    learns in a second exchange whether all ranks could.  Then each rank
    closes its descriptor: the mappings stay, the kernel frees the memory
    with the last one.  Nothing has a name in any file system, so nothing is
    left behind however a process ends (``MPI_Abort``, a signal, a
    scheduler's limit).  Where ``/proc/<pid>/fd`` of a peer cannot be opened
    (another user, a process made undumpable, a ``/proc`` mounted with
    ``hidepid``, ranks in different PID namespaces), or the memory cannot be
    reserved, the set-up fails on every rank alike: the calls that would
    have used it run MPI's algorithms, and one that names a shared algorithm
    raises MpicollError with the reason (docs/reliability.md).
    Freeing is local (a mapping goes when nothing refers to it), which MPI's
    shared windows do not allow: ``MPI_Win_free`` is a blocking collective,
    which at a communicator's free could wait for a rank that first waits
    for this one.

Device arrays: CUDA IPC
    Each rank allocates a dedicated device buffer (not from a pool: a handle
    names a whole allocation; of a page on a communicator of one node, where
    the schedules use the calls' own buffers instead of slots) and exports
    its ``cudaIpcGetMemHandle``, and an
    interprocess event (``cudaEventInterprocess``) with its
    ``cudaIpcGetEventHandle``; the ranks of a node open each other's handles
    once (``cudaIpcMemLazyEnablePeerAccess``) and keep them until the
    communicator is freed.  An exporter must outlive its importers: at the
    communicator's free each rank waits for its device work on the
    communicator, closes what it opened, then an ``Ibarrier`` tells each
    exporter when its buffers and event may go (freed once that completes,
    checked at later set-ups and frees).  All of it goes through the device
    runtime (backends.devices.CupyRuntime, or the test suite's fake one), so
    it runs without a GPU in CI.

Ordering device work: interprocess events (:class:`SyncChannel`)
    A device schedule's syncs are 0-byte host messages; the GPU work they
    order never waits on the host.  Before a sync's flags a rank records its
    event on the compute stream, after the work the flags publish; when a
    peer's flag has arrived, the stream waits on that peer's event
    (``cudaStreamWaitEvent``) before the work the sync allows.  A wait is on
    the record made before the flag (or a later one of the same stream,
    after it in stream order), so what the host flag promises holds on the
    GPU: the peer's writes before it, its reads before the next write.

The call's own buffers: registration (``Shape.mapped``)
    The schedules on one node read every rank's input and write every
    rank's output where they lie (algorithms.shared), so each call
    tells its node where its buffers are (:func:`views`: a record of a few
    hundred bytes to each rank of the node, the same exchange as a set-up's,
    under the call's timeout).  A buffer is named by its allocation (the base and
    buffer id of the pointer's attributes, ``cuPointerGetAttributes``) and
    its offset in it, with the allocation's handle; a peer opens a handle
    the first time it sees the allocation and keeps it open (a cache per
    context and peer, keyed by the buffer id, which the driver never gives
    another allocation of that process), as UCX's ``cuda_ipc`` and NCCL's
    buffer registration do.  Allocations freed since (the exporter finds
    out when it registers a new one: the pointer attributes of the old base
    give another buffer id, or none) are announced in the next record and
    closed by the peers; everything opened is closed at the communicator's
    free.  Memory that cannot be shared this way (``cudaMallocAsync`` pools,
    ``cuMemCreate``, managed memory) goes through a dedicated buffer of the
    rank's instead (the schedule's copy in and out of it), grown as needed
    and kept until the communicator's free.
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import secrets
import stat
import time
import weakref

import numpy as np
from mpi4py import MPI

from ..core.errors import CollectiveTimeout, MpicollError
from . import timeout as _timeout
from .channel import TAG
from .staging import address as _address

# Bytes of one slot (each rank's buffer in a region holds two).  Host: a chunk of this
# size is one sync of two ranks apart (the shared algorithms' host times: docs/performance.md,
# "Inside a node: the shared-memory algorithms"); device: a chunk of this size takes tens
# of microseconds of the GPU's memory bandwidth, against the same order for a stream
# synchronisation and a 0-byte message.
HOST_SLOT_BYTES = 1 << 20
DEVICE_SLOT_BYTES = 32 << 20

_REC = 192  # bytes of one rank's record in the set-up exchange
_HANDLE, _TOKEN, _DEVICE = slice(8, 72), slice(72, 88), slice(88, 120)
_EVENT = slice(120, 184)  # a device set-up's interprocess event handle
_NONE, _EXPORTED, _FAILED = 0, 1, 2
_EMPTY = np.empty(0, np.uint8)  # what a 0-byte message of a device schedule hands MPI

_HEADER = 64  # bytes before a host segment's buffer: its token, padded
_MEMFD_NAME = "mpicoll-node-memory"  # (what /proc/<pid>/fd shows: "/memfd:<name> (deleted)")


# --- host memory: anonymous shared memory (memfd) ----------------------------------------

class HostSegment:
    """Anonymous shared memory, mapped: a token, then ``nbytes`` of buffer.

    ``handle``: how a peer of the same node opens it while the creator keeps its
    descriptor (until :meth:`settle`): ``"<pid>:<fd>"``, the creator's
    ``/proc/<pid>/fd/<fd>``.
    """

    def __init__(self, handle: str, mm, token: bytes, nbytes: int, fd: int | None = None):
        self.handle, self.token, self.nbytes = handle, token, nbytes
        self._mm = mm
        self._fd = fd  # the creator's descriptor, open until settle()

    @property
    def name(self) -> str:
        return self.handle

    @classmethod
    def create(cls, nbytes: int) -> HostSegment:
        """New memory of no name (``memfd_create``), all of it reserved now: OSError here
        (``ENOSPC``, ``ENOMEM``) rather than SIGBUS at its first write mid-collective.
        Its size is sealed, so no holder can shrink it under the others' mappings."""
        if not hasattr(os, "memfd_create"):
            raise OSError("no memfd_create on this system (Linux only)")
        size = _HEADER + nbytes
        fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        token = secrets.token_bytes(16)
        mm[:16] = token
        return cls(f"{os.getpid()}:{fd}", mm, token, nbytes, fd)

    @classmethod
    def open(cls, handle: str, token: bytes, nbytes: int) -> HostSegment:
        """The memory another rank of this node created, through its descriptor; OSError
        unless that is this job's node memory (a memfd of this user of the right size and
        token: a pid of another machine, or one reused, names something else)."""
        pid, _, fd = handle.partition(":")
        if not (pid.isdigit() and fd.isdigit()):
            raise OSError(f"not a node memory handle: {handle!r}")
        path = f"/proc/{pid}/fd/{fd}"
        # (the link is the kernel's name of the peer's descriptor: only a memfd is opened,
        # never a device, FIFO or socket the number might name)
        target = os.readlink(path)
        if not target.startswith(f"/memfd:{_MEMFD_NAME}"):
            raise OSError(f"{path}: not node memory ({target})")
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() \
                    or st.st_size != _HEADER + nbytes:
                raise OSError(f"{path}: not node memory of this user of {_HEADER + nbytes} bytes")
            mm = mmap.mmap(fd, _HEADER + nbytes)
        finally:
            os.close(fd)
        if mm[:16] != token:
            raise OSError(f"{path}: another process's memory (not on this rank's machine?)")
        return cls(handle, mm, token, nbytes)

    def array(self):
        """The buffer as a uint8 array (it keeps the mapping alive)."""
        return np.frombuffer(self._mm, np.uint8, self.nbytes, _HEADER)

    def settle(self) -> None:
        """Close the creator's descriptor: no peer opens it any more (the mappings stay)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Drop this reference to the mapping: it goes once no array of it is left."""
        self.settle()
        self._mm = None


class _Host:
    """Node memory of host arrays (the runtime interface :class:`_Device` has too)."""

    key = "host"

    @property
    def slot_bytes(self) -> int:
        return HOST_SLOT_BYTES

    def identity(self) -> bytes:
        return b""

    def export(self, nbytes):
        seg = HostSegment.create(nbytes)
        return seg.handle.encode(), seg.token, seg.array(), seg

    def open(self, handle: bytes, token: bytes, nbytes: int, identity: bytes):
        seg = HostSegment.open(handle.rstrip(b"\0").decode(), token, nbytes)
        return seg.array(), seg

    def settled(self, seg) -> None:
        seg.settle()

    def close(self, seg) -> None:
        seg.close()

    def free(self, seg) -> None:
        seg.close()


class _Device:
    """Node memory of device arrays: CUDA IPC through the backend's runtime."""

    def __init__(self, be):
        self.be = be
        self.rt = be.rt
        self.key = (be.name, self.rt.current_device())
        self.slot_bytes = DEVICE_SLOT_BYTES

    def identity(self) -> bytes:
        return self.rt.ipc_device().encode()[:_DEVICE.stop - _DEVICE.start]

    def export(self, nbytes):
        handle, arr, keep = self.rt.ipc_export(nbytes)
        return handle, b"", arr, keep

    def open(self, handle: bytes, token: bytes, nbytes: int, identity: bytes):
        try:
            return self.rt.ipc_open(handle, nbytes)
        except Exception as exc:
            mine = self.identity().rstrip(b"\0").decode(errors="replace")
            theirs = identity.rstrip(b"\0").decode(errors="replace")
            where = f"the same GPU ({mine})" if mine == theirs else f"GPU {theirs} from GPU {mine}"
            raise OSError(f"cudaIpcOpenMemHandle on {where}: {type(exc).__name__}: {exc}") from exc

    def settled(self, keep) -> None:
        self.rt.ipc_settled(keep)

    def close(self, keep) -> None:
        self.rt.ipc_close(keep)

    def free(self, keep) -> None:
        self.rt.ipc_free(keep)

    def export_event(self):
        """(handle, event): this rank's interprocess event (SyncChannel)."""
        return self.rt.ipc_event()

    def open_event(self, handle: bytes):
        return self.rt.ipc_open_event(handle)

    def close_event(self, event) -> None:
        self.rt.ipc_close_event(event)

    def drain(self, devices) -> None:
        """Wait on the host for this rank's device work on a context (``devices``: its
        ``ctx.devices``; each call ends by recording an event there, backends.devices'
        finish): what it queued reading or writing peers' memory is done."""
        event = devices.get("done", {}).get(self.key)
        if event is not None:
            self.rt.event_synchronize(event)


def _memory_of(be):
    return _HOST if be.name == "numpy" else _Device(be)


_HOST = _Host()


# --- per context -----------------------------------------------------------------------

class _Mapped:
    """One region on one backend: this rank's buffer and its node peers' (uint8 arrays)."""

    __slots__ = ("memory", "arrays", "exported", "opened", "nbytes", "event", "events")

    def __init__(self, memory, nbytes):
        self.memory, self.nbytes = memory, nbytes
        self.arrays: dict = {}   # rank -> uint8 array of its buffer
        self.exported = None     # what keeps this rank's buffer
        self.opened: list = []   # what keeps the peers' buffers open here
        self.event = None        # device: this rank's interprocess event
        self.events: dict = {}   # device: rank -> its event, opened here


class NodeMemory:
    """The node memory of one context: mapped regions per backend, failures, holders."""

    def __init__(self, ctx):
        self.mapped: dict = {}    # (backend key, region) -> _Mapped
        self.failed: dict = {}    # backend key -> why its set-up failed (never tried again)
        self.holders: dict = {}   # region -> weak reference to the operation holding it
        self.events: dict = {}    # device key -> (this rank's event, {rank: peer's event})
        self.calls: dict = {}     # device key -> _Registry of the calls' own buffers
        self.devices = ctx.devices  # (the done events of its calls: _Device.drain)
        self.closed = False
        labels = ctx.nodes if len(ctx.nodes) == ctx.size else (0,) * ctx.size
        self.labels = labels
        self.local = [r for r in range(ctx.size) if labels[r] == labels[ctx.rank]]
        # a node with more than one rank of the communicator (else nothing to share)
        self.shares = any(labels.count(x) > 1 for x in set(labels))
        _LIVE.add(self)


_LIVE: weakref.WeakSet = weakref.WeakSet()
# (Ibarrier request, [(memory or None, exported)], its communicator): the buffers and the
# communicator are freed once the request completes (MPI must not free a communicator
# with a non-blocking collective pending: Open MPI crashed in MPI_Finalize)
_RETIRED: list = []


def node_memory(ctx) -> NodeMemory:
    nm = getattr(ctx, "node_memory", None)
    if nm is None:
        nm = ctx.node_memory = NodeMemory(ctx)
    return nm


def _reap() -> None:
    """Free the exported device buffers whose importers all closed them."""
    if MPI.Is_finalized():
        return
    for entry in list(_RETIRED):
        req, exports, comm = entry
        if req.Test():
            _RETIRED.remove(entry)
            for memory, keep in exports:
                if memory is not None:  # (an event goes with its last reference)
                    memory.free(keep)
            MPI.Comm.Free(comm)


class _Message:
    """A set-up message as transport.timeout.wait polls it."""

    __slots__ = ("req", "kind", "peer", "done")

    def __init__(self, req, kind, peer):
        self.req, self.kind, self.peer, self.done = req, kind, peer, None


def _set_up_timeout(ctx, seq, describe, timeout, what, left, idle) -> CollectiveTimeout:
    """The CollectiveTimeout of node memory's set-up (``what``) for call ``seq`` on ``ctx``,
    waiting ``idle`` seconds for the messages ``left``; the context is then unusable."""
    call, collective, algorithm = describe()
    late = next((m for m in left if m.kind == "recv"), left[0]) if left else None
    peer = None if late is None else late.peer
    # (observe.calls' mark, in its words)
    ctx.mpicoll_unusable = f"{collective} #{seq} timed out on rank {ctx.rank}"
    drop = getattr(ctx, "drop_cache", None)
    if drop is not None:
        drop()
    return CollectiveTimeout(
        f"{call} on rank {ctx.rank}: no progress for {idle:.3g} s (timeout {timeout:g} s) "
        f"before step 0, setting up node memory ({what}): waiting for rank {peer}. "
        f"Some rank has not joined this call: it may have skipped it, called a collective "
        f"on another communicator, or be stuck or dead. This communicator cannot be used "
        f"again; end the job with mpicoll.abort()", collective=collective,
        seq=seq, algorithm=algorithm, rank=ctx.rank, peer=peer,
        phase=None if late is None else late.kind, step=None, timeout=timeout)


def _allgather(ctx, mine, timeout, what, describe, wait_for, seq=None):
    """Every rank's ``mine`` (uint8, the same length on every rank), by rank.

    Point-to-point messages on the context's duplicate with the blocking calls'
    tag (the set-up runs at the start of a call, before its own messages): a
    rank that never joins leaves receives that a timeout cancels, never a
    collective pending on the duplicate.  The operations in flight advance
    while it waits; under a timeout, CollectiveTimeout after that long without
    progress (the context is then unusable).  ``wait_for``: the engine's wait
    (engine.executor.wait_for), which advances the operations in flight.  ``seq``: the
    number of the call it belongs to (default: the next call's, a set-up's).
    """
    seq = ctx.seq + 1 if seq is None else seq
    out = np.zeros((ctx.size, len(mine)), np.uint8)
    out[ctx.rank] = mine
    comm, peers = ctx.comm, [q for q in range(ctx.size) if q != ctx.rank]
    msgs = [_Message(MPI.Comm.Irecv(comm, out[q], q, TAG), "recv", q) for q in peers]
    msgs += [_Message(MPI.Comm.Isend(comm, mine, q, TAG), "send", q) for q in peers]
    reqs = [m.req for m in msgs]
    if wait_for(lambda: MPI.Request.Testall(reqs), timeout=timeout):
        return out
    if timeout is None:
        MPI.Request.Waitall(reqs)
        return out

    def expired(left, idle):
        return _set_up_timeout(ctx, seq, describe, timeout, what, left, idle)

    _timeout.wait(msgs, timeout, expired, _timeout.tester(msgs))
    return out


class SetUp:
    """Mapping one region of one backend's memory among the ranks of each node; every rank
    of the communicator takes part, and its verdict is the same on every rank.

    Two exchanges of point-to-point messages on the context's duplicate with the
    blocking calls' tag (a set-up runs before its call's own messages): each
    rank's record (its buffer's handle), then whether it mapped its node peers'.
    A rank that never joins leaves receives that a timeout cancels, never a
    collective pending on the duplicate.  It runs in stages, so that a blocking
    call waits between them (:meth:`run`) and a non-blocking start runs them as
    steps of its operation, never waiting on a peer (engine.intranode):
    :meth:`post_records`, :meth:`post_verdicts` (once the records are in),
    :meth:`finish` (once the verdicts are in).
    """

    def __init__(self, ctx, nm, memory, region, timeout, describe):
        self.ctx, self.nm, self.memory, self.region = ctx, nm, memory, region
        self.timeout, self.describe = timeout, describe
        # (device arrays on one node use no slots, only the calls' own buffers: maps_buffers;
        # a buffer of a page still proves that the ranks map each other's memory)
        self.nbytes = 2 * memory.slot_bytes if memory is _HOST or _spans(nm) else _PAGE
        self.mapped = _Mapped(memory, self.nbytes)
        self.why = None
        self.messages: list = []  # (_Message) of the exchange in progress
        self.what = ""
        self.tag = TAG  # (an operation running it as its first steps: the tag of its call)
        self.done = False
        self._records = self._oks = None

    @property
    def requests(self) -> list:
        return [m.req for m in self.messages]

    def _post(self, mine, what) -> np.ndarray:
        ctx = self.ctx
        out = np.zeros((ctx.size, len(mine)), np.uint8)
        out[ctx.rank] = mine
        comm, peers = ctx.comm, [q for q in range(ctx.size) if q != ctx.rank]
        tag = self.tag
        msgs = [_Message(MPI.Comm.Irecv(comm, out[q], q, tag), "recv", q) for q in peers]
        msgs += [_Message(MPI.Comm.Isend(comm, mine, q, tag), "send", q) for q in peers]
        self.messages, self.what = msgs, what
        return out

    def post_records(self) -> list:
        """Export this rank's buffer and post the exchange of records; its requests.  None
        to post where an operation before this one set the region up (or failed to)
        meanwhile: every rank saw that one end first (engine.intranode.claim)."""
        key = self.memory.key
        if (key, self.region) in self.nm.mapped or key in self.nm.failed:
            self.done = True
            return []
        _reap()
        record = np.zeros(_REC, np.uint8)
        if len(self.nm.local) > 1:
            try:
                handle, token, arr, keep = self.memory.export(self.nbytes)
                self.mapped.exported, self.mapped.arrays[self.ctx.rank] = keep, arr
                record[0] = _EXPORTED
                record[_HANDLE][:len(handle)] = np.frombuffer(handle, np.uint8)
                record[_TOKEN][:len(token)] = np.frombuffer(token, np.uint8)
                ident = self.memory.identity()
                record[_DEVICE][:len(ident)] = np.frombuffer(ident, np.uint8)
                if self.memory is not _HOST:
                    ehandle, self.mapped.event = self.memory.export_event()
                    record[_EVENT][:len(ehandle)] = np.frombuffer(ehandle, np.uint8)
            except Exception as exc:
                self.why = (f"cannot allocate {self.nbytes} bytes to share "
                            f"({type(exc).__name__}: {exc})")
                record[0] = _FAILED
        self._records = self._post(record, "exchanging the buffers' names")
        return self.requests

    def post_verdicts(self) -> list:
        """Map the node peers' buffers (their records are in) and post the exchange of
        verdicts; its requests."""
        if self.done:
            return []
        records, mapped = self._records, self.mapped
        if self.why is None:
            for q in self.nm.local:
                if q == self.ctx.rank:
                    continue
                rec = records[q]
                if rec[0] != _EXPORTED:
                    self.why = f"rank {q} of this node could not allocate its buffer (its " \
                               f"python -m mpicoll.info says why)"
                    break
                try:
                    arr, keep = self.memory.open(rec[_HANDLE].tobytes(), rec[_TOKEN].tobytes(),
                                                 self.nbytes, rec[_DEVICE].tobytes())
                except Exception as exc:
                    self.why = f"cannot map rank {q}'s buffer ({type(exc).__name__}: {exc})"
                    break
                mapped.opened.append(keep)
                mapped.arrays[q] = arr
                if self.memory is not _HOST:
                    try:
                        mapped.events[q] = self.memory.open_event(rec[_EVENT].tobytes())
                    except Exception as exc:
                        self.why = f"cannot open rank {q}'s event ({type(exc).__name__}: {exc})"
                        break
        self._oks = self._post(np.array([self.why is None], np.uint8),
                               "agreeing whether every rank mapped its node's buffers")
        return self.requests

    def finish(self) -> str | None:
        """The verdict (the verdicts are in): None when every rank mapped its node's buffers
        (the region is kept), else why not (the same on every rank)."""
        memory, mapped, nm = self.memory, self.mapped, self.nm
        if self.done:
            return nm.failed.get(memory.key)
        self.done = True
        oks = self._oks[:, 0]
        self.messages = []
        if mapped.exported is not None:
            memory.settled(mapped.exported)  # (every peer opened it or gave up: host files go)
        if oks.all():
            nm.mapped[(memory.key, self.region)] = mapped
            if mapped.event is not None:  # (the first region's events serve every region)
                nm.events.setdefault(memory.key, (mapped.event, mapped.events))
            return None
        why = self.why
        if why is None:
            first = int(np.argmin(oks))
            why = f"rank {first} could not map its node's buffers (its python -m mpicoll.info " \
                  f"says why)"
        _undo(memory, mapped, settled=True)
        nm.failed[memory.key] = why
        return why

    def abandon(self) -> None:
        """The set-up was interrupted (a timeout, an error): give back what it mapped."""
        if not self.done:
            self.done = True
            _undo(self.memory, self.mapped, settled=False)

    def expired(self, left, idle) -> CollectiveTimeout:
        """The CollectiveTimeout of a set-up waiting ``idle`` seconds for ``left``."""
        return _set_up_timeout(self.ctx, self.ctx.seq + 1, self.describe, self.timeout,
                               self.what, left, idle)

    def run(self, wait_for) -> str | None:
        """The whole set-up here, waiting between its stages (a blocking call): the verdict.
        ``wait_for``: the engine's wait, which advances the operations in flight."""
        try:
            for post in (self.post_records, self.post_verdicts):
                reqs = post()
                if wait_for(lambda reqs=reqs: MPI.Request.Testall(reqs), timeout=self.timeout):
                    continue
                if self.timeout is None:
                    MPI.Request.Waitall(reqs)
                    continue
                _timeout.wait(self.messages, self.timeout, self.expired,
                              _timeout.tester(self.messages))
        except BaseException:
            self.abandon()
            raise
        return self.finish()


def _undo(memory, mapped, settled) -> None:
    """Give back what a failed set-up mapped.  An exported device buffer may be open in a
    peer: it is kept until exit (exporters outlive importers)."""
    for keep in mapped.opened:
        memory.close(keep)
    mapped.opened = []
    mapped.arrays = {}
    for event in mapped.events.values():
        memory.close_event(event)
    mapped.events = {}
    if mapped.event is not None:
        _KEPT.append(mapped.event)
        mapped.event = None
    if mapped.exported is not None:
        if memory is _HOST:
            memory.free(mapped.exported)
        else:
            _KEPT.append(mapped.exported)
        mapped.exported = None


_KEPT: list = []  # exported device buffers and events of failed set-ups, kept until exit


def release(ctx) -> None:
    """*engine*, Context._release (before its duplicate is freed): once this rank's device
    work on the context is done, close what it opened; exported device buffers and
    events go once every peer closed them: an Ibarrier on the
    context's duplicate, which this module then frees (``ctx.comm`` becomes
    COMM_NULL) once the barrier completes."""
    nm = getattr(ctx, "node_memory", None)
    if nm is None:
        return
    nm.closed = True
    _LIVE.discard(nm)
    exports, device = [], False
    drained = set()
    for (key, _), mapped in nm.mapped.items():
        if key != "host" and key not in drained:  # (its queued work may still use peers')
            mapped.memory.drain(nm.devices)
            drained.add(key)
    for registry in nm.calls.values():
        registry.close(exports)
    nm.calls.clear()
    for (key, _), mapped in nm.mapped.items():
        for keep in mapped.opened:
            mapped.memory.close(keep)
        mapped.opened = []
        mapped.arrays = {}
        for event in mapped.events.values():
            mapped.memory.close_event(event)
        mapped.events = {}
        if mapped.event is not None:
            exports.append((None, mapped.event))
            mapped.event = None
        if key != "host":
            device = True
        if mapped.exported is not None:
            if key == "host":
                mapped.memory.close(mapped.exported)
            else:
                exports.append((mapped.memory, mapped.exported))
            mapped.exported = None
    nm.mapped.clear()
    nm.events.clear()
    if device and ctx.comm != MPI.COMM_NULL and not MPI.Is_finalized():
        comm, ctx.comm = ctx.comm, MPI.COMM_NULL
        _RETIRED.append((MPI.Intracomm.Ibarrier(comm), exports, comm))
    _reap()


EXIT_WAIT_S = 2.0  # how long the exit handler waits for retired buffers' barriers


@atexit.register
def at_exit() -> None:
    """Close every opened device handle and event of the contexts still alive, once their
    queued device work is done (buffers go with the process), and complete the barriers
    of freed contexts for a moment (peers exiting together complete them; a rank that
    never freed its communicator leaves them to MPI_Finalize)."""
    end = time.perf_counter() + EXIT_WAIT_S
    while _RETIRED and time.perf_counter() < end and not MPI.Is_finalized():
        _reap()
        if _RETIRED:
            time.sleep(_timeout.MIN_SLEEP_S)
    for nm in list(_LIVE):
        device = [m for m in nm.mapped.values() if m.memory is not _HOST]
        try:
            for mapped in device:
                mapped.memory.drain(nm.devices)
            for registry in nm.calls.values():
                registry.close([])
            for mapped in device:
                for keep in mapped.opened:
                    mapped.memory.close(keep)
                for event in mapped.events.values():
                    mapped.memory.close_event(event)
        except Exception:  # (a CUDA context already torn down; a peer already gone)
            pass
        for mapped in device:
            mapped.opened = []
            mapped.arrays = {}
            mapped.events = {}
        nm.calls.clear()
        nm.closed = True


# --- what the engine asks (engine.intranode) ----------------------------------------------

def set_up(ctx, backend, region, timeout, describe):
    """The :class:`SetUp` of ``region`` of ``backend``'s memory, or (None, verdict) where none
    is needed: (None, None) if mapped or nothing to map, (None, why) if it cannot be (a
    backend that failed is not tried again on this context)."""
    nm = node_memory(ctx)
    if nm.closed:
        return None, "the communicator was freed"
    if not nm.shares:
        return None, None  # (no rank has a node peer: the schedules use no node memory)
    memory = _memory_of(backend)
    if memory.key in nm.failed:
        return None, nm.failed[memory.key]
    if (memory.key, region) in nm.mapped:
        return None, None
    if memory is not _HOST and not (hasattr(memory.rt, "ipc_export")
                                    and hasattr(memory.rt, "ipc_event")):
        why = nm.failed[memory.key] = f"the {backend.name} runtime has no CUDA IPC"
        return None, why
    return SetUp(ctx, nm, memory, region, timeout, describe), None


def ready(ctx, backend, region, timeout, describe, wait_for) -> str | None:
    """Map ``region`` of ``backend``'s memory unless it is (a collective exchange on the first
    call that needs it); None if mapped or nothing to map, else why not (the same on every
    rank)."""
    setup, why = set_up(ctx, backend, region, timeout, describe)
    return why if setup is None else setup.run(wait_for)


def slot_elements(ctx, backend, region, itemsize: int) -> int:
    """Elements of ``itemsize`` bytes in one slot of ``region`` (0: nothing mapped there)."""
    mapped = node_memory(ctx).mapped.get((_memory_of(backend).key, region))
    return 0 if mapped is None else mapped.nbytes // 2 // max(itemsize, 1)


def views(ctx, backend, region, buffers, dtype, own=None, call=None, timeout=None,
          describe=None, wait_for=None) -> dict:
    """{name: 1-D array of ``dtype``} of a schedule's node buffers.

    ``buffers``: [(name, rank, elements, role)] of each; ``role`` None for node
    memory (from ``region`` of ``backend``'s), else which buffer of that rank it
    stands for (``"src"``, ``"dst"``: the call's own, registered for CUDA IPC,
    ``Shape.mapped``).  Those take an exchange among the ranks of the node
    (:class:`_Registry`): ``own`` {role: this rank's array}; ``call``: what
    binds them (a binding again of the same call exchanges nothing);
    ``timeout``, ``describe``, ``wait_for`` as for a set-up.
    """
    if not buffers:
        return {}
    nm = node_memory(ctx)
    memory = _memory_of(backend)
    mapped = nm.mapped.get((memory.key, region))
    if mapped is None or nm.closed:
        raise MpicollError("communicator freed: its node memory is gone; start operations "
                           "only on a communicator not yet freed")
    itemsize = np.dtype(dtype).itemsize
    out, calls = {}, []
    for name, q, n, role in buffers:
        if role is not None:
            calls.append((name, q, n, role))
            continue
        if n * itemsize > mapped.nbytes:  # pragma: no cover - slots come from the same constants
            raise ValueError(f"{name}: {n} elements exceed the {mapped.nbytes} bytes mapped")
        out[name] = mapped.arrays[q][: n * itemsize].view(dtype)
    if calls:
        registry = nm.calls.get(memory.key)
        if registry is None:
            registry = nm.calls[memory.key] = _Registry(memory, nm.devices)
        out.update(registry.views(ctx, calls, dtype, own, call, timeout, describe, wait_for))
    return out


def maps_buffers(ctx, backend) -> bool:
    """Whether the schedules on ``backend``'s arrays read and write the call's own buffers
    at the ranks of the node (``Shape.mapped``): device arrays of a runtime that registers
    them, on a communicator of one node of more than one rank."""
    nm = node_memory(ctx)
    return backend.name != "numpy" and nm.shares and not _spans(nm) \
        and hasattr(backend.rt, "ipc_range")


def _spans(nm) -> bool:
    return len(set(nm.labels)) > 1


_PAGE = 4096


_ROLES = ("src", "dst")  # the call's buffers a record names, in its order
_BOUNCE = 1 << 63  # keys of a rank's own buffers for memory that cannot be shared
_GONE = 8  # keys of allocations gone that one record announces (more: the next call's)
_ENTRY = np.dtype([("key", "<u8"), ("base", "<u8"), ("size", "<u8"), ("offset", "<u8"),
                   ("fresh", "<u8"), ("handle", "u1", 64)])
_RECORD = np.dtype([("failed", "<u8"), ("ngone", "<u8"), ("gone", "<u8", _GONE),
                    ("buffers", _ENTRY, len(_ROLES))])


class _Export:
    """An allocation of this rank's, registered: its key (the buffer id), where it lies, its
    handle, and whether every peer opened it (else a record says it is ``fresh``)."""

    __slots__ = ("key", "base", "size", "handle", "agreed")

    def __init__(self, key, base, size, handle):
        self.key, self.base, self.size, self.handle = key, base, size, handle
        self.agreed = False


class _Import:
    """A peer's allocation, open here: a uint8 array of all of it, what keeps it open."""

    __slots__ = ("arr", "keep", "base", "size")

    def __init__(self, arr, keep, base, size):
        self.arr, self.keep, self.base, self.size = arr, keep, base, size


class _Registry:
    """The calls' own buffers of one context on one device, registered for CUDA IPC.

    Exporter side: :attr:`mine`, this rank's allocations by base, each with its
    buffer id and handle (``cudaIpcGetMemHandle`` once per allocation); the
    keys of those that went since (:meth:`_sweep`) go out with the next
    record.  Importer side: :attr:`opened`, the peers' allocations open here by
    (rank, key), closed when the peer announces them gone, when a new one of
    that peer overlaps them (what the address range held went), or at the
    communicator's free.  Memory the pointer attributes refuse goes through
    :attr:`bounces` (``ipc_export``: a dedicated allocation per role, grown to
    twice the largest call, outgrown ones kept until the communicator's free:
    a peer may still hold them open).
    """

    def __init__(self, memory, devices):
        self.memory, self.devices = memory, devices
        self.mine: dict = {}     # allocation base -> _Export
        self.gone: list = []     # keys of this rank's allocations gone, not yet announced
        self.opened: dict = {}   # (rank, key) -> _Import
        self.bounces: dict = {}  # role -> (uint8 array, keep, _Export)
        self.retired: list = []  # keeps of outgrown bounces
        self.made = 0            # bounces made (their keys)
        self.bound = weakref.WeakKeyDictionary()  # call -> its views

    def views(self, ctx, buffers, dtype, own, call, timeout, describe, wait_for) -> dict:
        """{name: array} of ``buffers`` ([(name, rank, elements, role)]), after one exchange
        of records with every rank (one node: the communicator's), a second where some
        allocation is new to a peer (every rank agrees that it opened them).  A rank that
        fails raises, and so does every rank, before the schedule starts."""
        got = self.bound.get(call) if call is not None else None
        if got is not None:
            return got
        itemsize = np.dtype(dtype).itemsize
        need = {role: n for _, q, n, role in buffers if q == ctx.rank and n}  # this rank's
        record = np.zeros(1, _RECORD)
        entries = record["buffers"][0]
        mine, published, why = {}, [], None
        for i, role in enumerate(_ROLES):
            if role not in need:
                continue
            nbytes = need[role] * itemsize
            try:
                entry, offset, arr = self._publish(own[role], role, nbytes)
            except Exception as exc:
                why = f"cannot share its {role} ({type(exc).__name__}: {exc})"
                record["failed"] = 1
                break
            mine[role] = arr if arr is own[role] else arr[:nbytes].view(dtype)
            published.append(entry)
            for field, value in (("key", entry.key), ("base", entry.base), ("size", entry.size),
                                 ("offset", offset), ("fresh", not entry.agreed)):
                entries[field][i] = value
            entries["handle"][i][:len(entry.handle)] = np.frombuffer(entry.handle, np.uint8)
        gone, self.gone = self.gone[:_GONE], self.gone[_GONE:]
        record["ngone"] = len(gone)
        record["gone"][0][:len(gone)] = gone
        records = _allgather(ctx, record.view(np.uint8), timeout, "exchanging where the "
                             "call's buffers lie", describe, wait_for, ctx.seq + 1).view(_RECORD)[:, 0]
        failed = [q for q in range(ctx.size) if records[q]["failed"]]
        if failed:
            raise MpicollError(why if failed[0] == ctx.rank else
                               f"rank {failed[0]} could not share its buffers on its node "
                               f"(CUDA IPC)")
        self._forget(ctx, records)
        out = {}
        for name, q, n, role in buffers:
            if not n:  # (nothing of it is read or written)
                out[name] = own[role][:0]
                continue
            if q == ctx.rank:
                out[name] = mine[role]
                continue
            e = records[q]["buffers"][_ROLES.index(role)]
            try:
                imp = self._open(q, e)
            except Exception as exc:
                why = f"cannot open rank {q}'s {role} ({type(exc).__name__}: {exc})"
                break
            lo, nbytes = int(e["offset"]), n * itemsize
            if lo + nbytes > imp.size:
                why = f"rank {q}'s {role} holds {imp.size - lo} bytes, not {nbytes}"
                break
            out[name] = imp.arr[lo: lo + nbytes].view(dtype)
        if any(records[q]["buffers"]["fresh"].any() for q in range(ctx.size)):
            oks = _allgather(ctx, np.array([why is None], np.uint8), timeout, "agreeing "
                             "whether every rank opened its node's buffers", describe, wait_for,
                             ctx.seq)[:, 0]
            if oks.all():
                for entry in published:
                    entry.agreed = True
            elif why is None:
                why = f"rank {int(np.argmin(oks))} could not open its node's buffers (CUDA IPC)"
        if why is not None:
            raise MpicollError(f"node memory: {why}")
        if call is not None:
            self.bound[call] = out
        return out

    def _publish(self, arr, role, nbytes):
        """(_Export, offset, array) of this rank's ``arr`` for peers: its allocation, or the
        bounce buffer of ``role`` where that cannot be shared (then that array)."""
        rt = self.memory.rt
        if nbytes:
            ptr = _address(arr)
            try:
                base, size, bid = rt.ipc_range(ptr)
            except Exception:  # (memory another process cannot open: the bounce)
                base = None
            if base is not None:
                entry = self.mine.get(base)
                if entry is None or entry.key != bid or entry.size != size:
                    if entry is not None:  # another allocation at its base: it went
                        del self.mine[base]
                        self.gone.append(entry.key)
                    self._sweep()
                    try:
                        entry = self.mine[base] = _Export(bid, base, size, rt.ipc_handle(base))
                    except Exception:
                        entry = None
                if entry is not None:
                    return entry, ptr - base, arr
        have = self.bounces.get(role)
        if have is None or have[0].nbytes < nbytes:
            grown = max(nbytes, 2 * have[0].nbytes if have is not None else 0, 1)
            handle, barr, keep = rt.ipc_export(grown)
            if have is not None:
                self.retired.append(have[1])
            self.made += 1
            have = self.bounces[role] = (barr, keep, _Export(
                _BOUNCE | self.made, _address(barr), grown, handle))
        return have[2], 0, have[0]

    def _sweep(self) -> None:
        """Forget this rank's allocations that went (their base's pointer attributes give
        another buffer id, or none); their keys go to the peers with the next record."""
        rt = self.memory.rt
        for base, entry in list(self.mine.items()):
            try:
                alive = rt.ipc_range(base)[::2] == (base, entry.key)
            except Exception:
                alive = False
            if not alive:
                del self.mine[base]
                self.gone.append(entry.key)

    def _forget(self, ctx, records) -> None:
        """Close what the peers announce gone."""
        gone = [(q, int(k)) for q in range(ctx.size) if q != ctx.rank
                for k in records[q]["gone"][: int(records[q]["ngone"])]]
        self._close([g for g in gone if g in self.opened])

    def _open(self, q, e) -> _Import:
        """Rank ``q``'s allocation of record entry ``e``, opened here once."""
        key, base, size = int(e["key"]), int(e["base"]), int(e["size"])
        imp = self.opened.get((q, key))
        if imp is None:
            self._close([(p, k) for (p, k), o in self.opened.items()
                         if p == q and o.base < base + size and base < o.base + o.size])
            arr, keep = self.memory.rt.ipc_open(e["handle"].tobytes(), size)
            imp = self.opened[(q, key)] = _Import(arr, keep, base, size)
        return imp

    def _close(self, which) -> None:
        if which:
            self.memory.drain(self.devices)  # (queued work may still read or write them)
            for k in which:
                self.memory.close(self.opened.pop(k).keep)

    def close(self, exports: list) -> None:
        """At the communicator's free (device work drained): close every peer's allocation;
        this rank's bounce buffers join ``exports`` (freed once every peer closed them)."""
        for imp in self.opened.values():
            self.memory.close(imp.keep)
        self.opened.clear()
        exports.extend((self.memory, keep) for keep in
                       self.retired + [keep for _, keep, _ in self.bounces.values()])
        self.retired, self.bounces = [], {}


class SyncChannel:
    """The 0-byte messages of a device schedule on one node, the GPU ordered by events.

    A sync's flags say that this rank's device work before them is queued,
    not done: before the first flag after a wait, the rank records its
    interprocess event on the compute stream (after the work the flags
    publish; the caller's too, at the first); once a peer's flag has
    arrived (its request waited for), the stream waits on that peer's event
    (the module docstring).  No host thread waits for the GPU.  The messages
    carry nothing, so MPI never sees a device pointer: it works whether or
    not MPI is CUDA-aware.
    """

    __slots__ = ("inner", "rt", "stream", "event", "peers", "_recorded", "_flags")

    def __init__(self, inner, rt, stream, event, peers):
        self.inner, self.rt, self.stream = inner, rt, stream
        self.event, self.peers = event, peers  # this rank's event, {rank: peer's event}
        self._recorded = False
        self._flags: list = []  # (request, source) of flags posted, not waited for yet

    def isend(self, arr, dest, chunk=0):
        if not self._recorded:
            self.rt.record_ipc(self.stream, self.event)
            self._recorded = True
        return self.inner.isend(_EMPTY, dest, chunk)

    def irecv(self, arr, source, chunk=0):
        req = self.inner.irecv(_EMPTY, source, chunk)
        self._flags.append((req, source))
        return req

    def wait(self, req):
        self.inner.wait(req)
        self._arrived((req,))

    def waitall(self, reqs):
        self.inner.waitall(reqs)
        self._arrived(reqs)

    def _arrived(self, reqs) -> None:
        """The stream waits on the event of every peer whose flag is among ``reqs``."""
        self._recorded = False  # (the next flags publish work queued after this point)
        left = []
        for req, source in self._flags:
            if any(r is req for r in reqs):
                self.rt.wait_ipc(self.stream, self.peers[source])
            else:
                left.append((req, source))
        self._flags = left

    def testall(self, reqs) -> bool:
        test = getattr(self.inner, "testall", None)
        return test(reqs) if test is not None else MPI.Request.Testall(reqs)

    @property
    def test(self):
        """The inner channel's own test of one request, where it has one (transport.timeout
        polls with it under a timeout), else None."""
        return getattr(self.inner, "test", None)


def sync_channel(ctx, backend, inner, stream) -> SyncChannel:
    """The :class:`SyncChannel` of a device schedule on ``ctx`` (its node memory set up)."""
    memory = _memory_of(backend)
    event, peers = node_memory(ctx).events[memory.key]
    return SyncChannel(inner, memory.rt, stream, event, peers)


def status(ctx, backend) -> str:
    """A line for ``python -m mpicoll.info``: whether ``backend``'s node memory is mapped on
    this context (after engine.intranode.probe)."""
    nm = node_memory(ctx)
    key = _memory_of(backend).key
    if not nm.shares:
        return "not used (no rank of this communicator has another on its node)"
    if key in nm.failed:
        return f"no ({nm.failed[key]})"
    if any(k == key for k, _ in nm.mapped):
        return f"yes ({len(nm.local)} ranks on this rank's node map each other's buffers)"
    return "not set up"
