"""Per-communicator state: the library's private duplicate, call counter, work memory.

The state is cached on the user's communicator as an MPI attribute, so it is
created once (on the first collective, collectively), shared by every
``mpicoll.Comm`` wrapping the same communicator, and freed together with the
user's communicator (``comm.Free()`` runs the attribute's delete callback).
"""

from __future__ import annotations

import os

from mpi4py import MPI

from ._workmem import WorkMemory

_KEYVAL = None


def _delete_state(comm, keyval, state):
    state.free()


class Context:
    """What mpicoll keeps for one user communicator."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm.Dup()
        self.comm.Set_name(f"mpicoll dup of {comm.Get_name() or 'communicator'}")
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.seq = 0  # collectives started on this communicator
        self.work = WorkMemory()  # algorithms' work arrays, by purpose (see _workmem)
        from . import _ring, _topology
        # pipelining of the ring algorithms (MPICOLL_SEGMENT_BYTES, MPICOLL_WINDOW)
        self.segment_bytes, self.window = _ring.tuning()
        self.ring = _topology.ring_order(self)
        self.ring_pos = self.ring.index(self.rank)

    def free(self) -> None:
        self.work = WorkMemory()
        if self.comm != MPI.COMM_NULL and not MPI.Is_finalized():
            self.comm.Free()


def check_comm(comm, argname: str = "comm") -> MPI.Intracomm:
    """TypeError/ValueError unless ``comm`` is a usable intra-communicator."""
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"{argname}: expected an mpi4py.MPI.Intracomm, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError(f"{argname}: expected a valid communicator, got MPI.COMM_NULL")
    if comm.Is_inter():
        raise TypeError(f"{argname}: expected an intra-communicator, got an inter-communicator")
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"{argname}: expected an mpi4py.MPI.Intracomm, got {type(comm).__name__}")
    return comm


def context(comm: MPI.Intracomm) -> Context:
    """The cached state of ``comm``; the first call on a communicator is collective."""
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_state)
    state = comm.Get_attr(_KEYVAL)
    if state is None:
        state = Context(comm)
        comm.Set_attr(_KEYVAL, state)
    return state


# os.environ.get() raises and catches KeyError inside for an unset variable,
# about a microsecond; collectives read their options on every call and
# usually none is set.  On POSIX, os.environ keeps its contents in a dict of
# bytes that every change made through os.environ updates; reading that dict
# answers "unset" without an exception.  Anywhere else: os.environ.get().
_ENV_BYTES = os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict)
_ENV_KEYS: dict = {}


def env_value(name: str) -> str | None:
    """``os.environ.get(name)``, cheap when the variable is unset."""
    data = os.environ._data if _ENV_BYTES else None
    if type(data) is not dict:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    raw = data.get(key)
    return None if raw is None else os.fsdecode(raw)


def env_flag(name: str) -> bool | None:
    """Read a boolean environment variable: 1/yes/true/on or 0/no/false/off."""
    value = env_value(name)
    if value is None or value.strip() == "":
        return None
    value = value.strip().lower()
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off"):
        return False
    raise ValueError(f"{name}: expected 1/0, yes/no, true/false or on/off, got {value!r}")
