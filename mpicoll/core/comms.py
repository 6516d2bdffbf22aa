"""Communicator argument checks shared by the layers (api, engine, backends)."""

from __future__ import annotations

from mpi4py import MPI


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
