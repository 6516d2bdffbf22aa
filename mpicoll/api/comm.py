"""``mpicoll.Comm``: an ``MPI.Intracomm`` whose reductions and gathers are mpicoll's."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..core import types as _types
from ..core.comms import check_comm
from ..engine import collectives as _collectives
from ..engine import plan as _plan
from . import args as _args
from . import numerics as _numerics
from . import requests as _requests


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
            ``"recursive_halving"``, ``"bruck"``, ``"direct"``, ``"hierarchical"``
            (docs/algorithms.md).
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
    _numerics = (None, None)  # (deterministic, accumulate): api.numerics

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
    # Each one first tries its plan (engine.plan): the same buffer objects as its
    # last plain call run again with no validation.  Otherwise api.args validates
    # (the one validation path, also used by the non-blocking and persistent forms)
    # and returns exactly the arguments of engine.collectives.start_*.

    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """Combine ``sendbuf`` of every rank with ``op`` into every rank's ``recvbuf``."""
        algorithm = self._algorithm  # (as forced; resolved on the slow path)
        if _plan.repeat(self, "Comm.Allreduce", sendbuf, recvbuf, op, algorithm):
            return
        ran, s, r = _bare_repeat(self, "Comm.Allreduce", sendbuf, recvbuf, op, algorithm)
        if ran:
            return
        key = _plan.key(s, r, op, algorithm)
        args = _args.Allreduce(self, sendbuf, recvbuf, op)  # (the specs: errors name them)
        if not self._routed("allreduce", args):  # numerics
            _collectives.run_allreduce(*args, memo=_memo("Comm.Allreduce", key, s, r, op))

    def Allgather(self, sendbuf, recvbuf):
        """Gather every rank's ``sendbuf`` into every rank's ``recvbuf``, in rank order."""
        algorithm = self._algorithm  # (as forced; resolved on the slow path)
        if _plan.repeat(self, "Comm.Allgather", sendbuf, recvbuf, algorithm):
            return
        ran, s, r = _bare_repeat(self, "Comm.Allgather", sendbuf, recvbuf, algorithm)
        if ran:
            return
        key = _plan.key(s, r, algorithm)
        args = _args.Allgather(self, sendbuf, recvbuf)
        if not self._routed("allgather", args):  # numerics
            _collectives.run_allgather(*args, memo=_memo("Comm.Allgather", key, s, r))

    def Allgatherv(self, sendbuf, recvbuf):
        """Gather ``counts[r]`` elements from each rank r into ``recvbuf``.

        ``recvbuf`` is any mpi4py vector spec: ``[buf, counts, displs, T]``,
        ``[buf, counts]``, ``[buf, (counts, displs), T]``, ``[buf, count, T]``
        (the same count from every rank), a bare buffer (split as evenly as
        possible), with None for what is inferred.
        """
        _collectives.run_allgather(*_args.Allgatherv(self, sendbuf, recvbuf))

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        """Reduce ``sendbuf`` (size*count elements) and leave block ``rank`` in ``recvbuf``.

        In place (``sendbuf=MPI.IN_PLACE``), ``recvbuf`` holds the whole input
        and receives the result in its first ``count`` elements; a bare buffer
        means count = len(recvbuf) / size, ``[buf, count, type]`` states it.
        As in mpi4py, a count given in a ``sendbuf`` spec is also per rank.
        """
        algorithm = self._algorithm  # (as forced; resolved on the slow path)
        if _plan.repeat(self, "Comm.Reduce_scatter_block", sendbuf, recvbuf, op, algorithm):
            return
        ran, s, r = _bare_repeat(self, "Comm.Reduce_scatter_block", sendbuf, recvbuf, op,
                                 algorithm)
        if ran:
            return
        key = _plan.key(s, r, op, algorithm)
        args = _args.Reduce_scatter_block(self, sendbuf, recvbuf, op)
        if not self._routed("reduce_scatter", args):  # numerics
            _collectives.run_reduce_scatter(
                *args, memo=_memo("Comm.Reduce_scatter_block", key, s, r, op))

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        """Reduce ``sendbuf`` and leave ``recvcounts[rank]`` elements of block ``rank`` in ``recvbuf``.

        Without ``recvcounts`` each rank's receive count is its ``recvbuf``
        length, exchanged among the ranks first (as mpi4py does).  Each rank's
        verdict on its own arguments travels with its count, so every rank
        raises if any rank's arguments are bad (none is left waiting).
        """
        args = _args.Reduce_scatter(self, sendbuf, recvbuf, recvcounts, op)
        if not self._routed("reduce_scatter", args):  # numerics
            _collectives.run_reduce_scatter(*args)

    # -- non-blocking and persistent collectives (see mpicoll.api.requests) ----------
    # The same checks as the blocking calls (api.args), then
    # the engine's start_* function; the request keeps the buffers alive.

    # A repeated call (the same buffer objects, the last one's request seen complete)
    # restarts the operation that call left (engine.plan.restart): no validation.

    # -- numerics: 16/8-bit floats, deterministic mode (api.numerics) --------------

    def _route(self, collective, args, one_operation=False):
        """The api.numerics route of a validated call's engine ``args``, or None."""
        det, acc = self._numerics
        if collective == "allgather":
            return _numerics.route("allgather", args[0], args[1], args[2], None, args[5],
                                   args[3], args[4])
        if collective == "allreduce":
            op, algorithm, counts, displs = args[3], args[4], None, None
        else:
            op, algorithm, counts, displs = args[5], args[6], args[3], args[4]
        route = _numerics.route(collective, args[0], args[1], args[2], op, algorithm, counts,
                                displs, deterministic=det, accumulate=acc,
                                one_operation=one_operation)
        return route

    def _routed(self, collective, args) -> bool:
        """Run a blocking call through api.numerics if it routes it; whether it did."""
        route = self._route(collective, args)
        if route is None:
            return False
        route.run(None)
        return True

    _COLLECTIVE = {_requests.start_allreduce: "allreduce", _requests.start_allgather: "allgather",
                   _requests.start_reduce_scatter: "reduce_scatter"}

    # -- end numerics ------------------------------------------------------------------

    def _start(self, start, args, persistent=False):
        _requests.check_progress()
        route = self._route(self._COLLECTIVE[start], args, True)  # numerics
        if route is not None:
            return _requests.Request(route.start(None, persistent), args[1:3], persistent,
                                     route.finish, route.prepare)
        op = start(*args, persistent=persistent)
        return _requests.Request(op, args[1:3], persistent)

    def _istart(self, name, start, validate, sendbuf, recvbuf, op=None):
        """A request of ``name``'s kept operation restarted, else of a new one started on
        ``validate()`` (an api.args call) and kept for the call's repeat if plain."""
        _requests.check_progress()
        algorithm = self._algorithm
        s, r = _bare(sendbuf), _bare(recvbuf)  # (validate() reads the specs: errors name them)
        operation = _plan.restart(self, name, s, r, op, algorithm)
        if operation is not None:
            return _requests.Request(operation, (s, r))
        args = validate()
        route = self._route(self._COLLECTIVE[start], args, True)  # numerics
        if route is not None:
            return _requests.Request(route.start(None), args[1:3], finish=route.finish)
        memo = _memo(name, _plan.key(s, r, op, algorithm), s, r, op)
        return _requests.Request(start(*args, memo=memo), (sendbuf, recvbuf))

    def Iallreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        """Start an :meth:`Allreduce`; returns a request (``Test``/``Wait``)."""
        return self._istart("Comm.Iallreduce", _requests.start_allreduce,
                            lambda: _args.Allreduce(self, sendbuf, recvbuf, op), sendbuf, recvbuf, op)

    def Iallgather(self, sendbuf, recvbuf):
        """Start an :meth:`Allgather`; returns a request (``Test``/``Wait``)."""
        return self._istart("Comm.Iallgather", _requests.start_allgather,
                            lambda: _args.Allgather(self, sendbuf, recvbuf), sendbuf, recvbuf)

    def Iallgatherv(self, sendbuf, recvbuf):
        """Start an :meth:`Allgatherv`; returns a request (``Test``/``Wait``)."""
        return self._start(_requests.start_allgather, _args.Allgatherv(self, sendbuf, recvbuf))

    def Ireduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        """Start a :meth:`Reduce_scatter_block`; returns a request (``Test``/``Wait``)."""
        return self._istart("Comm.Ireduce_scatter_block", _requests.start_reduce_scatter,
                            lambda: _args.Reduce_scatter_block(self, sendbuf, recvbuf, op),
                            sendbuf, recvbuf, op)

    def Ireduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        """Start a :meth:`Reduce_scatter`; returns a request (``Test``/``Wait``).

        Without ``recvcounts`` the receive counts are exchanged first, before
        this returns (as for the blocking call).
        """
        return self._start(_requests.start_reduce_scatter,
                           _args.Reduce_scatter(self, sendbuf, recvbuf, recvcounts, op))

    def Allreduce_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL):
        """A persistent :meth:`Allreduce` (MPI-4): inactive until ``Start()``; ``Free()`` at the end."""
        return self._start(_requests.start_allreduce, _args.Allreduce(self, sendbuf, recvbuf, op),
                           True)

    def Allgather_init(self, sendbuf, recvbuf, info=MPI.INFO_NULL):
        """A persistent :meth:`Allgather` (MPI-4): inactive until ``Start()``."""
        return self._start(_requests.start_allgather, _args.Allgather(self, sendbuf, recvbuf), True)

    def Allgatherv_init(self, sendbuf, recvbuf, info=MPI.INFO_NULL):
        """A persistent :meth:`Allgatherv` (MPI-4): inactive until ``Start()``."""
        return self._start(_requests.start_allgather, _args.Allgatherv(self, sendbuf, recvbuf),
                           True)

    def Reduce_scatter_block_init(self, sendbuf, recvbuf, op=MPI.SUM, info=MPI.INFO_NULL):
        """A persistent :meth:`Reduce_scatter_block` (MPI-4): inactive until ``Start()``."""
        return self._start(_requests.start_reduce_scatter,
                           _args.Reduce_scatter_block(self, sendbuf, recvbuf, op), True)

    def Reduce_scatter_init(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM,
                            info=MPI.INFO_NULL):
        """A persistent :meth:`Reduce_scatter` (MPI-4): inactive until ``Start()``."""
        return self._start(_requests.start_reduce_scatter,
                           _args.Reduce_scatter(self, sendbuf, recvbuf, recvcounts, op), True)


def _bare(spec):
    """``spec``'s array where it is ``[array, T]`` (or a tuple) of a C-contiguous NumPy array
    and T the datatype mpi4py gives that array anyway (core.types.natural_type): the same
    message as the bare array (api.buffers.message makes one Msg of both, but for the
    type's name in its errors, which is why validation still reads the spec), so the same
    plan.  Anything else is returned as it is."""
    if type(spec) in _PAIR and len(spec) == 2:
        arr, datatype = spec
        if type(arr) is np.ndarray and type(datatype) is MPI.Datatype \
                and arr.flags.c_contiguous and datatype == _types.natural_type(arr.dtype):
            return arr
    return spec


_PAIR = (list, tuple)


def _bare_repeat(comm, name, sendbuf, recvbuf, *rest):
    """After a plan's miss: (whether the plan of the bare form of ``[array, T]`` specs ran,
    sendbuf, recvbuf in that form).  A spec is a new list at every call, so only its array
    can be the plan's (mpi4py users write ``comm.Allreduce([x, MPI.DOUBLE], [y,
    MPI.DOUBLE])``: it took the general path at every call, 35 against 1 us at 16 B)."""
    s, r = _bare(sendbuf), _bare(recvbuf)
    if s is sendbuf and r is recvbuf:
        return False, s, r
    return _plan.repeat(comm, name, s, r, *rest), s, r


def _memo(name, key, sendbuf, recvbuf, op=None):
    """(name, key, flat) to keep a plain call as a plan: bare NumPy buffers (or IN_PLACE) and
    a predefined op only (a user op could be freed between calls).  ``flat``: validation
    read a C-contiguous buffer as its flat memory (api.buffers.message), whatever its
    shape, so the plan's signature need not hold shapes (engine.plan)."""
    if type(recvbuf) is np.ndarray and (type(sendbuf) is np.ndarray or sendbuf is MPI.IN_PLACE) \
            and (op is None or _types.op_name(op) is not None):
        return name, key, True
    return None
