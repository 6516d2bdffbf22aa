"""The cache of bound calls: a repeat proven to be the same call is a start of its operation.

A call the API may see again (it hands its cache key) keeps its operation here
under the signature of its arguments; a later call whose arguments match is
that operation started again -- :func:`repeat` (blocking), :func:`restart`
(non-blocking) -- with no validation, no choice, no binding.  What is
remembered, the hit rule (:meth:`Entry.matches`, the only one), where entries
live and why they hold no user memory: docs/design.md, "The cache of bound
calls".
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np
from mpi4py import MPI

from ..backends import registry as _registry
from ..core.config import EPOCH
from ..core.errors import MpicollError
from . import context as _context

_IN_PLACE = MPI.IN_PLACE
_buffer = MPI.buffer  # (MPI.buffer(arr).address: the cheapest way to read an address)
# function name -> its last blocking Entry, its last non-blocking one (any communicator):
# a hit needs no MPI attribute lookup (docs/design.md, "The cache of bound calls")
_LAST: dict = {}
_LAST_STARTED: dict = {}
NON_BLOCKING = 32  # non-blocking entries per context (gradient buckets in flight together)
BLOCKING = 16  # blocking entries per context
# work memory the blocking entries of a context may hold together (beyond it the least
# recently run entries that hold some go, however few there are): enough for the
# latency-bound calls whose repeat the cache is for, little beside a large call's arrays
WORK_BYTES = 1 << 20


def _address(arr) -> int:
    """The address of an array's data (what MPI.buffer says: the same at every call for an
    array of no elements too)."""
    return _buffer(arr).address


class Entry:
    """A kept operation and the signature that proves a hit (docs/design.md, "The cache of bound calls").
    ``recv`` is the output argument, ``send`` the input (None: in place)."""

    __slots__ = ("name", "comm", "ctx", "op", "recv_ref", "recv_layout", "recv_dtype",
                 "recv_address", "recv_nbytes", "send_ref", "send_layout", "send_dtype",
                 "send_address", "send_nbytes",
                 "op_arg", "algorithm", "timeout", "epoch", "deterministic", "flat", "work",
                 "device", "aware", "__weakref__")

    def matches(self, comm, send, recv, op, algorithm, timeout) -> bool:
        """Whether a call with these arguments is this entry's call, unchanged."""
        if not (self.recv_ref() is recv and self.comm is comm and recv.dtype is self.recv_dtype
                and (self.op_arg is op or self.op_arg == op)
                and (self.algorithm is algorithm or self.algorithm == algorithm)
                and (self.timeout is timeout or (type(timeout) is type(self.timeout)
                                                 and self.timeout == timeout))):
            return False
        if not self._at(recv, self.recv_address, self.recv_nbytes, self.recv_layout, True):
            return False
        ref = self.send_ref
        if ref is None:
            if send is not _IN_PLACE:
                return False
        elif ref() is not send:
            return False
        elif send is not recv and (  # (send is recv: the entry's call was that too)
                send.dtype is not self.send_dtype
                or not self._at(send, self.send_address, self.send_nbytes, self.send_layout)):
            return False
        return self.epoch == EPOCH[0] or self._still_chosen()

    def _at(self, arr, address, nbytes, layout, out=False) -> bool:
        """Whether array ``arr`` (its dtype the recorded one) is at the recorded memory, as
        contiguous as it was, of the recorded layout where one was recorded (``out``: and
        writeable).  Host arrays: one buffer view gives the address, the length, the
        writeability and contiguity (a non-contiguous array has none), and a contiguous
        1-D array of as many bytes has the same shape and strides.  Device arrays (a
        backend's own type): the address from the backend (CuPy's ``.data.ptr``: no export,
        no synchronisation), C contiguity and the shape."""
        be = self.device
        if be is None:
            try:
                b = _buffer(arr)
            except (BufferError, ValueError):
                return False
            return not (out and b.readonly) and b.address == address and b.nbytes == nbytes \
                and (layout is None or (arr.shape, arr.strides) == layout)
        return be.address(arr) == address and arr.nbytes == nbytes \
            and arr.flags.c_contiguous and (layout is None or arr.shape == layout)

    def _still_chosen(self) -> bool:
        """After a change of options: whether the call still reduces as this entry's does
        (``deterministic``) and, of device arrays, moves as its does (``cuda_aware``: the
        path its transport took); then it holds for the new epoch."""
        if self.ctx.options()["deterministic"] != self.deterministic:
            return False
        if self.device is not None and self.ctx.cuda_aware() != self.aware:
            return False
        self.epoch = EPOCH[0]
        return True

    def release(self) -> None:
        """Never starts again: its requests and work memory go back (now, or once its start
        in flight completes)."""
        for last in (_LAST, _LAST_STARTED):
            if last.get(self.name) is self:
                del last[self.name]
        op, self.op = self.op, None
        if op is not None:
            if op._active:
                op.bound.kept = False  # (released by its own end)
            else:
                op.release()


class Cache:
    """A context's kept operations, least recently used dropped first."""

    __slots__ = ("blocking", "non_blocking")

    def __init__(self):
        self.blocking = OrderedDict()      # key -> Entry (least recently run first)
        self.non_blocking = OrderedDict()  # key -> Entry (least recently started first)

    def drop(self) -> None:
        """Forget every entry (the communicator is freed or unusable)."""
        for table in (self.blocking, self.non_blocking):
            for entry in list(table.values()):
                entry.release()
            table.clear()


def _slot(name, comm, send, recv, op, algorithm) -> tuple:
    """Where the entry of ``name`` called on ``comm`` with these arguments is kept in its
    context's cache: the communicator and arrays by object identity, which the entry's
    weak references prove on a hit (an object's id is not reused while the entry that
    refers to it lives), the op and the algorithm by value.  So calls that alternate ops
    or algorithms on the same arrays each repeat their own."""
    return (name, id(comm), id(send), id(recv), _value(op), _value(algorithm))


def _value(v):
    """A hashable value of an op or algorithm argument (an MPI.Op is not hashable)."""
    if v is None or type(v) is str:
        return v
    if type(v) is MPI.Op:
        return ("op", v.py2f())
    return ("id", id(v))


def _table(comm, blocking: bool):
    """The blocking or non-blocking entries of ``comm``'s context (None without one)."""
    try:
        ctx = comm.Get_attr(_context.keyval())
    except (AttributeError, TypeError, MPI.Exception):
        return None
    cache = getattr(ctx, "cache", None)
    if cache is None:
        return None
    return cache.blocking if blocking else cache.non_blocking


def _find(table, name, comm, send, recv, op, algorithm, timeout):
    """The entry of ``table`` for these arguments if it matches (a stale one is dropped)."""
    if not table:
        return None
    key = _slot(name, comm, send, recv, op, algorithm)
    e = table.get(key)
    if e is None:
        return None
    if e.op is None or e.op.error is not None \
            or not e.matches(comm, send, recv, op, algorithm, timeout):
        # these arrays changed in place (or the options did, or it failed): validated as a
        # new call, which remembers a new entry if it can
        forget(e)
        return None
    table.move_to_end(key)
    return e


def repeat(comm, name: str, send, recv, op=None, algorithm=None, timeout=None) -> bool:
    """Run the remembered blocking call of ``name`` again if these are its arguments,
    unchanged (True); False if there is none (the caller validates and runs the call)."""
    e = _LAST.get(name)  # (an entry there has an operation that did not fail: forget())
    if e is None or not e.matches(comm, send, recv, op, algorithm, timeout):
        e = _find(_table(comm, True), name, comm, send, recv, op, algorithm, timeout)
        if e is None:
            return False
        _LAST[name] = e
    try:
        e.op.run()
    except BaseException:
        forget(e)  # (interrupted: its requests may still be active; never again)
        raise
    return True


def restart(comm, name: str, send, recv, op=None, algorithm=None, timeout=None):
    """The remembered non-blocking operation of ``name`` for these arguments, started again;
    None when there is none, it is still active or its caller has not seen it complete."""
    e = _LAST_STARTED.get(name)
    if e is None or e.op is None or e.op.error is not None \
            or not e.matches(comm, send, recv, op, algorithm, timeout):
        e = _find(_table(comm, False), name, comm, send, recv, op, algorithm, timeout)
        if e is None:
            return None
        _LAST_STARTED[name] = e
    operation = e.op
    if operation._active or operation.owner is not None:
        return None
    operation.start()
    return operation


def remember(op, key) -> None:
    """Keep operation ``op`` (its bound call kept: engine.run.prepare) of the public call
    ``key`` (function name, its arguments, flat: whether validation read the buffers as
    flat memory) in its context's cache."""
    name, args, flat = key
    send, recv, op_arg, algorithm, timeout = args
    ctx = op.ctx
    cache = ctx.cache
    if cache is None:
        cache = ctx.cache = Cache()
    blocking = op.tag is None
    table = cache.blocking if blocking else cache.non_blocking
    slot = _slot(name, op.bound.call.comm, send, recv, op_arg, algorithm)
    old = table.pop(slot, None)
    if old is not None:
        old.release()
    e = Entry()
    e.name, e.comm, e.ctx, e.op = name, op.bound.call.comm, ctx, op
    e.op_arg, e.algorithm, e.timeout = op_arg, algorithm, timeout
    e.epoch, e.deterministic = EPOCH[0], ctx.options()["deterministic"]
    # a C-contiguous buffer read as its flat memory: validation read only the dtype, the
    # contiguity and out's writeability
    e.flat = flat
    # device arrays (a backend's own array type, api's keys): their address from the
    # backend, and the path their transport took
    e.device = None if type(recv) is np.ndarray else op.bound.msg.backend
    if e.device is None:
        address, layout = _address, _layout
    else:
        address, layout = e.device.address, _shape
        e.aware = ctx.cuda_aware()
    drop = _dropper(weakref.ref(e))
    e.recv_ref = weakref.ref(recv, drop)
    e.recv_layout = layout(recv, flat)
    e.recv_dtype, e.recv_address, e.recv_nbytes = recv.dtype, address(recv), recv.nbytes
    if send is _IN_PLACE:
        e.send_ref = None
    else:
        e.send_ref = weakref.ref(send, drop)
        e.send_layout = layout(send, flat)
        e.send_dtype, e.send_address, e.send_nbytes = send.dtype, address(send), send.nbytes
    lease = op.bound.lease
    e.work = 0 if lease is None else lease.nbytes
    table[slot] = e
    if not blocking:
        while len(table) > NON_BLOCKING:
            table.popitem(last=False)[1].release()
        return
    _LAST[name] = e
    while len(table) > BLOCKING:
        table.popitem(last=False)[1].release()
    held = sum(x.work for x in table.values())
    if held > WORK_BYTES:
        for k, x in list(table.items())[:-1]:  # (oldest first; the new entry stays)
            if x.work:
                del table[k]
                x.release()
                held -= x.work
                if held <= WORK_BYTES:
                    break


def _layout(arr, flat):
    """What a hit compares of an array's layout beyond its buffer (Entry.matches): nothing
    where validation read it as flat memory or it is 1-D, else (shape, strides)."""
    return None if flat or arr.ndim == 1 else (arr.shape, arr.strides)


def _shape(arr, flat):
    """What a hit compares of a device array's layout beyond its bytes and C contiguity
    (Entry._at): nothing where validation read it as flat memory, else its
    shape."""
    return None if flat else arr.shape


def _dropper(ref):
    def drop(_):  # an argument array is being collected: the entry goes first
        e = ref()
        if e is not None:
            forget(e)
    return drop


def forget(e) -> None:
    """Drop entry ``e`` from its context's cache and release it."""
    cache = e.ctx.cache
    if cache is not None:
        for table in (cache.blocking, cache.non_blocking):
            for key, kept in list(table.items()):
                if kept is e:
                    del table[key]
    e.release()


def latest(ctx, name: str):
    """The operation of the blocking entry of ``name`` on ``ctx`` run (or made) last, or
    None."""
    cache = ctx.cache
    if cache is None:
        return None
    for e in reversed(cache.blocking.values()):
        if e.name == name:
            return e.op
    return None


def raw(arr, backend=None):
    """A view of array ``arr``'s memory (C-contiguous, 1-D) that keeps nothing alive: host
    memory, or through ``backend`` device memory (backends.devices.DeviceBackend.unowned)."""
    if type(arr) is not np.ndarray:
        return backend.unowned(arr)
    return np.frombuffer(MPI.buffer.fromaddress(_address(arr), arr.nbytes), dtype=arr.dtype)


def plain(arr) -> bool:
    """Whether a call may be remembered bound to ``arr`` as it is (api's cache keys): a
    C-contiguous NumPy array, or a C-contiguous array of a device backend's own type
    (CuPy's ndarray: :meth:`Entry.matches` reads its address from the backend)."""
    if type(arr) is np.ndarray:
        return arr.flags.c_contiguous
    be = _registry.backend_of(arr)
    return be is not None and be.device == "gpu" and be.native(arr) and arr.flags.c_contiguous


__all__ = ["Entry", "Cache", "repeat", "restart", "remember", "forget", "latest", "raw",
           "plain", "MpicollError"]
