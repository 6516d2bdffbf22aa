"""``mpicoll.Comm``: an ``MPI.Intracomm`` whose reductions and gathers are mpicoll's."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..core import types as _types
from ..core.comms import check_comm
from ..engine import run as _run
from ..engine.cache import plain as _plain
from . import args as _args
from . import delegate as _delegate
from . import derived as _derived
from . import requests as _requests

_repeat = _run.repeat


class Comm(MPI.Intracomm):
    """Drop-in intra-communicator running mpicoll's collectives.

    ``mpicoll.Comm(comm)`` refers to the same MPI communicator as ``comm``
    (same group, same handle; nothing is duplicated for the user).  Its
    ``Allreduce``, ``Allgather``, ``Allgatherv``, ``Reduce_scatter_block`` and
    ``Reduce_scatter`` take exactly the arguments mpi4py takes and run mpicoll's
    algorithms on mpicoll's private duplicate of the communicator; every other
    method is mpi4py's.

    Args:
        comm: the intra-communicator to wrap (default ``MPI.COMM_WORLD``).
        algorithm: ``"auto"``, or an algorithm forced for every call of the collectives
            that have it: ``"ring"``, ``"recursive_doubling"``, ``"rabenseifner"``,
            ``"recursive_halving"``, ``"bruck"``, ``"direct"``, ``"hierarchical"``,
            ``"shared_oneshot"``, ``"shared_twoshot"``, ``"shared"`` (docs/algorithms.md).
        deterministic: True: floating SUM/PROD reductions are the rank-order fold,
            bitwise the same for every algorithm and setting (default:
            ``MPICOLL_DETERMINISTIC``); see docs/numerics.md.
        accumulate: False: SUM/PROD of 16/8-bit floats keep partials in the input
            type (default: float32, rounded once; the non-blocking and persistent
            forms keep them in the input type).

    Example (4 ranks)::

        comm = mpicoll.Comm(MPI.COMM_WORLD)
        x = np.full(3, comm.rank + 1.0)       # rank r holds [r+1, r+1, r+1]
        y = np.empty(3)
        comm.Allreduce(x, y, op=MPI.SUM)      # every rank: [10., 10., 10.]
    """

    _algorithm = "auto"  # (forced for every call; set by __init__ and _derived)
    _numerics = (None, None)  # (deterministic, accumulate): engine.select

    def __new__(cls, comm=None, algorithm: str = "auto", deterministic=None, accumulate=None):
        comm = MPI.COMM_WORLD if comm is None else comm
        check_comm(comm)
        self = super().__new__(cls, comm)
        return self

    def __init__(self, comm=None, algorithm: str = "auto", deterministic=None, accumulate=None):
        _args.check_comm_options(algorithm, deterministic, accumulate)
        self._algorithm = algorithm
        self._numerics = (deterministic, accumulate)

    # -- communicators made from this one keep its forced algorithm ----------------
    # mpi4py builds the result of Dup/Clone/Idup as ``type(self).__new__`` without
    # ``__init__`` and the result of Split/Create as a plain Intracomm; both lose
    # the algorithm, so every method that makes an intra-communicator hands its
    # result to _derived.

    def _derived(self, new):
        """``new`` as an mpicoll.Comm with this communicator's algorithm (COMM_NULL as is)."""
        if new == MPI.COMM_NULL:
            return new
        if not isinstance(new, Comm):
            new = MPI.Intracomm.__new__(Comm, new)
        new._algorithm = self._algorithm
        new._numerics = self._numerics
        return new

    def Dup(self, info=None):
        return self._derived(super().Dup(info))

    def Dup_with_info(self, info):
        return self._derived(super().Dup_with_info(info))

    def Clone(self):
        return self._derived(super().Clone())

    def Idup(self, info=None):
        comm, request = super().Idup(info)  # already a Comm; its handle is set on completion
        comm._algorithm = self._algorithm
        comm._numerics = self._numerics
        return comm, request

    def Idup_with_info(self, info):
        comm, request = super().Idup_with_info(info)
        comm._algorithm = self._algorithm
        comm._numerics = self._numerics
        return comm, request

    def Split(self, color=0, key=0):
        return self._derived(super().Split(color, key))

    def Split_type(self, split_type, key=0, info=MPI.INFO_NULL):
        return self._derived(super().Split_type(split_type, key, info))

    def Create(self, group):
        return self._derived(super().Create(group))

    def Create_group(self, group, tag=0):
        return self._derived(super().Create_group(group, tag))

    # -- the collectives ------------------------------------------------------------
    # Each one first tries the cache of bound calls (engine.cache): the same buffer
    # objects as a call it remembered run again with no validation.  Otherwise api.args
    # validates into a Call (the one validation path, also used by the non-blocking and
    # persistent forms) and engine.run runs it (:meth:`_run_call`).

    def _run_call(self, method, args, validate, key=None):
        """Run a blocking call: ``validate()`` (api.args) makes its Call, which engine.run
        runs (remembered under ``key()``, read once the arguments are valid), the messages
        of derived datatypes packed around it (api.derived); a call mpicoll does not run
        is MPI's own (api.delegate), on ``args`` as given."""
        try:
            call = validate()
        except _derived.Delegate:
            _delegate.run(self, method, args)
            return
        packing = _derived.packing(call)
        if packing is None:
            _run.run(call, None if key is None else key())
            return
        packing.pack()
        _run.run(call)
        packing.complete()

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """Combine ``sendbuf`` of every rank with ``op`` into every rank's ``recvbuf``."""
        algorithm = self._algorithm  # (as forced; resolved by validation)
        if _repeat(self, "Comm.Allreduce", sendbuf, recvbuf, op, algorithm):
            return
        ran, s, r = _bare_repeat(self, "Comm.Allreduce", sendbuf, recvbuf, op, algorithm)
        if ran:
            return
        self._run_call("Allreduce", (sendbuf, recvbuf, op),
                       lambda: _args.Allreduce(self, sendbuf, recvbuf, op),  # (errors name the specs)
                       lambda: _key("Comm.Allreduce", (s, r, op, algorithm, None), op))

    def Allgather(self, sendbuf, recvbuf):
        """Gather every rank's ``sendbuf`` into every rank's ``recvbuf``, in rank order."""
        algorithm = self._algorithm
        if _repeat(self, "Comm.Allgather", sendbuf, recvbuf, None, algorithm):
            return
        ran, s, r = _bare_repeat(self, "Comm.Allgather", sendbuf, recvbuf, None, algorithm)
        if ran:
            return
        self._run_call("Allgather", (sendbuf, recvbuf),
                       lambda: _args.Allgather(self, sendbuf, recvbuf),
                       lambda: _key("Comm.Allgather", (s, r, None, algorithm, None)))

    def Allgatherv(self, sendbuf, recvbuf):
        """Gather ``counts[r]`` elements from each rank r into ``recvbuf``.

        ``recvbuf`` is any mpi4py vector spec: ``[buf, counts, displs, T]``,
        ``[buf, counts]``, ``[buf, (counts, displs), T]``, ``[buf, count, T]``
        (the same count from every rank), a bare buffer (split as evenly as
        possible), with None for what is inferred.
        """
        self._run_call("Allgatherv", (sendbuf, recvbuf),
                       lambda: _args.Allgatherv(self, sendbuf, recvbuf))

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        """Reduce ``sendbuf`` (size*count elements) and leave block ``rank`` in ``recvbuf``.

        In place (``sendbuf=MPI.IN_PLACE``), ``recvbuf`` holds the whole input
        and receives the result in its first ``count`` elements; a bare buffer
        means count = len(recvbuf) / size, ``[buf, count, type]`` states it.
        As in mpi4py, a count given in a ``sendbuf`` spec is also per rank.
        """
        algorithm = self._algorithm
        if _repeat(self, "Comm.Reduce_scatter_block", sendbuf, recvbuf, op, algorithm):
            return
        ran, s, r = _bare_repeat(self, "Comm.Reduce_scatter_block", sendbuf, recvbuf, op,
                                 algorithm)
        if ran:
            return
        self._run_call("Reduce_scatter_block", (sendbuf, recvbuf, op),
                       lambda: _args.Reduce_scatter_block(self, sendbuf, recvbuf, op),
                       lambda: _key("Comm.Reduce_scatter_block", (s, r, op, algorithm, None),
                                    op))

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        """Reduce ``sendbuf`` and leave ``recvcounts[rank]`` elements of block ``rank`` in ``recvbuf``.

        Without ``recvcounts`` each rank's receive count is its ``recvbuf``
        length, exchanged among the ranks first (as mpi4py does).  Each rank's
        verdict on its own arguments travels with its count, so every rank
        raises if any rank's arguments are bad (none is left waiting).
        """
        self._run_call("Reduce_scatter", (sendbuf, recvbuf, recvcounts, op),
                       lambda: _args.Reduce_scatter(self, sendbuf, recvbuf, recvcounts, op))

    # -- non-blocking and persistent collectives (see mpicoll.api.requests) ----------
    # The same validation as the blocking calls (api.args), then engine.run.start; the
    # request keeps the buffers alive.  A repeated call (the same buffer objects, the last
    # one's request seen complete) restarts the operation the cache remembered
    # (engine.cache.restart): no validation.

    def _start(self, method, args, validate, persistent=False, key=None):
        """The request of ``validate()``'s call (api.args) started (``persistent``: bound, not
        started; remembered under ``key()``), its derived datatypes' messages packed at
        each start and written back when it completes (api.derived); a call mpicoll does
        not run is MPI's own (api.delegate), on ``args`` as given."""
        _requests.check_progress()
        try:
            call = validate()
        except _derived.Delegate:
            return _delegate.start(self, method, args, persistent)
        buffers = args[:2]
        packing = _derived.packing(call)
        if packing is None:
            op = _run.persistent(call) if persistent else \
                _run.start(call, None if key is None else key())
            return _requests.Request(op, buffers, persistent)
        if not persistent:
            packing.pack()
        op = _run.persistent(call) if persistent else _run.start(call)
        return _requests.Request(op, buffers, persistent, via=packing)

    def _istart(self, name, method, validate, sendbuf, recvbuf, op=None):
        """A request of ``name``'s remembered operation restarted, else of a new one started
        on ``validate()`` (an api.args call) and remembered for the call's repeat."""
        _requests.check_progress()
        algorithm = self._algorithm
        s, r = _bare(sendbuf), _bare(recvbuf)  # (validate() reads the specs: errors name them)
        operation = _run.restart(self, name, s, r, op, algorithm)
        if operation is not None:
            return _requests.Request(operation, (s, r))
        args = (sendbuf, recvbuf) if op is None else (sendbuf, recvbuf, op)
        return self._start(method, args, validate,
                           key=lambda: _key(name, (s, r, op, algorithm, None), op))

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """Start an :meth:`Allreduce`; returns a request (``Test``/``Wait``)."""
        return self._istart("Comm.Iallreduce", "Allreduce",
                            lambda: _args.Allreduce(self, sendbuf, recvbuf, op), sendbuf, recvbuf,
                            op)

    def Iallgather(self, sendbuf, recvbuf):
        """Start an :meth:`Allgather`; returns a request (``Test``/``Wait``)."""
        return self._istart("Comm.Iallgather", "Allgather",
                            lambda: _args.Allgather(self, sendbuf, recvbuf), sendbuf, recvbuf)

    def Iallgatherv(self, sendbuf, recvbuf):
        """Start an :meth:`Allgatherv`; returns a request (``Test``/``Wait``)."""
        return self._start("Allgatherv", (sendbuf, recvbuf),
                           lambda: _args.Allgatherv(self, sendbuf, recvbuf))

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        """Start a :meth:`Reduce_scatter_block`; returns a request (``Test``/``Wait``)."""
        return self._istart("Comm.Ireduce_scatter_block", "Reduce_scatter_block",
                            lambda: _args.Reduce_scatter_block(self, sendbuf, recvbuf, op),
                            sendbuf, recvbuf, op)

    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        """Start a :meth:`Reduce_scatter`; returns a request (``Test``/``Wait``).

        Without ``recvcounts`` the receive counts are exchanged first, before
        this returns (as for the blocking call).
        """
        return self._start("Reduce_scatter", (sendbuf, recvbuf, recvcounts, op),
                           lambda: _args.Reduce_scatter(self, sendbuf, recvbuf, recvcounts, op))

    def Allreduce_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL):
        """A persistent :meth:`Allreduce` (MPI-4): inactive until ``Start()``; ``Free()`` at the end."""
        return self._start("Allreduce", (sendbuf, recvbuf, op),
                           lambda: _args.Allreduce(self, sendbuf, recvbuf, op), True)

    def Allgather_init(self, sendbuf, recvbuf, info=MPI.INFO_NULL):
        """A persistent :meth:`Allgather` (MPI-4): inactive until ``Start()``."""
        return self._start("Allgather", (sendbuf, recvbuf),
                           lambda: _args.Allgather(self, sendbuf, recvbuf), True)

    def Allgatherv_init(self, sendbuf, recvbuf, info=MPI.INFO_NULL):
        """A persistent :meth:`Allgatherv` (MPI-4): inactive until ``Start()``."""
        return self._start("Allgatherv", (sendbuf, recvbuf),
                           lambda: _args.Allgatherv(self, sendbuf, recvbuf), True)

    def Reduce_scatter_block_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL):
        """A persistent :meth:`Reduce_scatter_block` (MPI-4): inactive until ``Start()``."""
        return self._start("Reduce_scatter_block", (sendbuf, recvbuf, op),
                           lambda: _args.Reduce_scatter_block(self, sendbuf, recvbuf, op), True)

    def Reduce_scatter_init(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM,
                            info=MPI.INFO_NULL):
        """A persistent :meth:`Reduce_scatter` (MPI-4): inactive until ``Start()``."""
        return self._start("Reduce_scatter", (sendbuf, recvbuf, recvcounts, op),
                           lambda: _args.Reduce_scatter(self, sendbuf, recvbuf, recvcounts, op),
                           True)


def _bare(spec):
    """``spec``'s array where it is ``[array, T]`` (or a tuple) of a C-contiguous NumPy array
    and T the datatype mpi4py gives that array anyway (core.types.natural_type): the same
    message as the bare array (api.args.message makes one Msg of both, but for the
    type's name in its errors, which is why validation still reads the spec), so the same
    call.  Anything else is returned as it is."""
    if type(spec) in _PAIR and len(spec) == 2:
        arr, datatype = spec
        if type(arr) is np.ndarray and type(datatype) is MPI.Datatype \
                and arr.flags.c_contiguous and datatype == _types.natural_type(arr.dtype):
            return arr
    return spec


_PAIR = (list, tuple)


def _bare_repeat(comm, name, sendbuf, recvbuf, *rest):
    """After a miss: (whether the remembered call of the bare form of ``[array, T]`` specs
    ran, sendbuf, recvbuf in that form).  A spec is a new list at every call, so only its
    array can be the remembered one (mpi4py users write ``comm.Allreduce([x, MPI.DOUBLE],
    [y, MPI.DOUBLE])``)."""
    s, r = _bare(sendbuf), _bare(recvbuf)
    if s is sendbuf and r is recvbuf:
        return False, s, r
    return _run.repeat(comm, name, s, r, *rest), s, r


def _key(name, args, op=None):
    """The cache key (name, ``args``: what its repeat compares, flat) under which a call may
    be remembered (engine.cache): bare C-contiguous NumPy buffers or a device backend's
    own arrays (or IN_PLACE; engine.cache.plain) and a predefined op only (a user op
    could be freed between calls); else None.  ``flat``: validation read a C-contiguous
    buffer as its flat memory (api.args.message), whatever its shape, so the signature
    need not hold shapes."""
    sendbuf, recvbuf = args[0], args[1]
    if _plain(recvbuf) and (sendbuf is MPI.IN_PLACE or _plain(sendbuf)) \
            and (op is None or _types.op_name(op) is not None):
        return name, args, True
    return None
