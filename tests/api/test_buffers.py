"""mpicoll.Comm takes every buffer spec mpi4py takes, with mpi4py's result.

Each case builds the same arguments twice (fresh buffers with sentinel
values around the message, rank-asymmetric data) and calls the method on an
``mpicoll.Comm`` and mpi4py's own method on the plain communicator
(``MPI.Intracomm.Allgatherv(WORLD, ...)``); every receive buffer, gaps and
all, must come out identical.  The spec grammar is mpi4py's message_simple /
message_vector (``[buf, count, displ, T]`` with parts left out or None,
``(count, displ)`` pairs, typecodes, bare buffers); see mpicoll/api/buffers.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll

# buffer specs against mpi4py: 1 rank, and 3 for per-rank counts/displacements
pytestmark = pytest.mark.ranks(1, 3)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
SENTINEL = -7
T = MPI.INT


def recv(n):
    return np.full(n, SENTINEL, np.int32)


COUNTS = [1 + (r % 3) for r in range(SIZE)]           # uneven
GAPPED = [sum(COUNTS[:r]) + 2 * r + 1 for r in range(SIZE)]  # a gap before every block
NGAP = GAPPED[-1] + COUNTS[-1] + 2
EVEN = 7 * SIZE + SIZE // 2  # a bare buffer split as evenly as possible (mpi4py's rule)
EVEN_COUNTS = [EVEN // SIZE + (EVEN % SIZE > r) for r in range(SIZE)]


# --- Allgatherv: the receive spec in every form (sendbuf -> args, the buffers to compare)
def _agv(spec_of, nrecv, count=None):
    def make():
        y = recv(nrecv)
        n = COUNTS[RANK] if count is None else count
        return (rank_data(n, RANK, np.int32), spec_of(y)), [y]
    return make


ALLGATHERV = {
    "[buf, np.array(counts)]": _agv(lambda y: [y, np.array(COUNTS)], sum(COUNTS) + 3),
    "[buf, np.array(counts), T]": _agv(lambda y: [y, np.array(COUNTS), T], sum(COUNTS)),
    "[buf, counts]": _agv(lambda y: [y, COUNTS], sum(COUNTS) + 1),
    "[buf, (counts, None), T]": _agv(lambda y: [y, (COUNTS, None), T], sum(COUNTS)),
    "[buf, counts, None, T]": _agv(lambda y: [y, COUNTS, None, T], sum(COUNTS) + 2),
    "[buf, counts, displs, T]": _agv(lambda y: [y, COUNTS, GAPPED, T], NGAP),
    "[buf, counts, displs, None]": _agv(lambda y: [y, COUNTS, GAPPED, None], NGAP),
    "[buf, (counts, displs)]": _agv(lambda y: [y, (COUNTS, GAPPED)], NGAP),
    "[buf, (np.array, np.array), T]": _agv(lambda y: [y, (np.array(COUNTS), np.array(GAPPED)), T],
                                          NGAP),
    "[buf, 2, T]": _agv(lambda y: [y, 2, T], 2 * SIZE + 1, count=2),
    "[buf, 2]": _agv(lambda y: [y, 2], 2 * SIZE, count=2),
    "[buf, (2, 3), T] strided": _agv(lambda y: [y, (2, 3), T], 3 * SIZE, count=2),
    "[buf, counts, 4, T] strided": _agv(lambda y: [y, COUNTS, 4, T], 4 * SIZE, count=None),
    "[buf, None, T]": _agv(lambda y: [y, None, T], EVEN, count=EVEN_COUNTS[RANK]),
    "bare buffer": _agv(lambda y: y, EVEN, count=EVEN_COUNTS[RANK]),
    "[buf, T]": _agv(lambda y: [y, T], EVEN, count=EVEN_COUNTS[RANK]),
    "[buf, 'i']": _agv(lambda y: [y, "i"], EVEN, count=EVEN_COUNTS[RANK]),
    "[buf, counts, displs, 'i4']": _agv(lambda y: [y, COUNTS, GAPPED, "i4"], NGAP),
    "[buf, counts, MPI.INT32_T]": _agv(lambda y: [y, COUNTS, MPI.INT32_T], sum(COUNTS)),
    "(buf, counts, displs, T) tuple": _agv(lambda y: (y, COUNTS, GAPPED, T), NGAP),
}


def _agv_send(spec_of):
    def make():
        y = recv(sum(COUNTS) + 2)
        x = np.concatenate([rank_data(COUNTS[RANK], RANK, np.int32), rank_data(3, RANK + 50, np.int32)])  # extra elements after
        return (spec_of(x), [y, COUNTS, None, T]), [y]
    return make


ALLGATHERV_SEND = {
    "sendbuf [buf, count]": _agv_send(lambda x: [x, COUNTS[RANK]]),
    "sendbuf [buf, count, T]": _agv_send(lambda x: [x, COUNTS[RANK], T]),
    "sendbuf [buf, (count, 1), T]": _agv_send(lambda x: [np.concatenate([x[:1], x]),
                                                         (COUNTS[RANK], 1), T]),
    "sendbuf [buf, count, 0, 'i']": _agv_send(lambda x: [x, COUNTS[RANK], 0, "i"]),
}


# --- Allgather ----------------------------------------------------------------------
def _ag(send_of, recv_of, nsend, nrecv):
    def make():
        y = recv(nrecv)
        x = rank_data(nsend, RANK, np.int32)
        return (send_of(x), recv_of(y)), [y]
    return make


ALLGATHER = {
    "bare, bare": _ag(lambda x: x, lambda y: y, 3, 3 * SIZE),
    "[buf, T], [buf, T]": _ag(lambda x: [x, T], lambda y: [y, T], 3, 3 * SIZE),
    "[buf, 2], [buf, 2] per rank": _ag(lambda x: [x, 2], lambda y: [y, 2], 4, 2 * SIZE + 3),
    "[buf, (2, 1), T] both": _ag(lambda x: [x, (2, 1), T], lambda y: [y, (2, 1), T],
                                 4, 2 * SIZE + 2),
    "[buf, 2, 3, T] recv": _ag(lambda x: [x, 2, "i"], lambda y: [y, 2, 3, T], 2, 2 * SIZE + 4),
    "[buf, None, T] recv": _ag(lambda x: [x, None, T], lambda y: [y, None, T], 3, 3 * SIZE),
    "[buf, (None, 2), T] recv": _ag(lambda x: x, lambda y: [y, (None, 2), T], 3, 3 * SIZE + 2),
    "'i4' typecodes": _ag(lambda x: [x, "i4"], lambda y: [y, "i4"], 3, 3 * SIZE),
    "'i' with MPI.INT": _ag(lambda x: [x, "i"], lambda y: [y, MPI.INT], 3, 3 * SIZE),
}


# --- Allreduce ------------------------------------------------------------------------
def _ar(send_of, recv_of, nsend, nrecv, dtype=np.int32, in_place=False):
    def make():
        y = recv(nrecv).astype(dtype)
        if in_place:
            y[:] = rank_data(nrecv, RANK, dtype)
            return (MPI.IN_PLACE, recv_of(y)), [y]
        return (send_of(rank_data(nsend, RANK, dtype)), recv_of(y)), [y]
    return make


ALLREDUCE = {
    "bare": _ar(lambda x: x, lambda y: y, 5, 5),
    "[buf, T]": _ar(lambda x: [x, T], lambda y: [y, T], 5, 5),
    "[buf, 3]": _ar(lambda x: [x, 3], lambda y: [y, 3], 5, 4),
    "[buf, (3, 1)]": _ar(lambda x: [x, (3, 1)], lambda y: [y, (3, 2)], 5, 6),
    "[buf, (3, 1), T]": _ar(lambda x: [x, (3, 1), T], lambda y: [y, [3, 0], T], 5, 6),
    "[buf, 3, 2, T]": _ar(lambda x: [x, 3, 2, T], lambda y: [y, 3, None, T], 5, 3),
    "[buf, None, T]": _ar(lambda x: [x, None, T], lambda y: [y, None, None, T], 5, 5),
    "'i' typecode": _ar(lambda x: [x, "i"], lambda y: [y, 5, "i"], 5, 6),
    "'e' float16": _ar(lambda x: [x, "e"], lambda y: [y, "e"], 5, 5, np.float16),
    "'e' float16, count": _ar(lambda x: [x, 4, "e"], lambda y: [y, (4, 1), "e"], 5, 5, np.float16),
    "in place [buf, (3, 1), T]": _ar(None, lambda y: [y, (3, 1), T], 0, 6, in_place=True),
    "in place [buf, 'i']": _ar(None, lambda y: [y, "i"], 0, 6, in_place=True),
}


# --- Reduce_scatter_block -----------------------------------------------------------------
def _rsb(send_of, recv_of, nsend, nrecv, in_place=False):
    def make():
        y = recv(nrecv)
        if in_place:
            y[:] = rank_data(nrecv, RANK, np.int32)
            return (MPI.IN_PLACE, recv_of(y)), [y]
        return (send_of(rank_data(nsend, RANK, np.int32)), recv_of(y)), [y]
    return make


REDUCE_SCATTER_BLOCK = {
    "bare": _rsb(lambda x: x, lambda y: y, 3 * SIZE, 3),
    "[buf, T]": _rsb(lambda x: [x, T], lambda y: [y, T], 3 * SIZE, 3),
    "send [buf, 2, T] per rank": _rsb(lambda x: [x, 2, T], lambda y: [y, 2, T], 3 * SIZE, 3),
    "send [buf, (2, 1), T]": _rsb(lambda x: [x, (2, 1), T], lambda y: [y, (2, 1)],
                                  2 * SIZE + 1, 3),
    "send [buf, 2, 1, 'i']": _rsb(lambda x: [x, 2, 1, "i"], lambda y: [y, 2, "i"], 2 * SIZE + 2, 3),
    "in place bare": _rsb(None, lambda y: y, 0, 3 * SIZE, in_place=True),
    "in place [buf, 2, T] per rank": _rsb(None, lambda y: [y, 2, T], 0, 2 * SIZE + 1,
                                          in_place=True),
    "in place [buf, (2, 1), T]": _rsb(None, lambda y: [y, (2, 1), T], 0, 2 * SIZE + 1,
                                      in_place=True),
}


# --- Reduce_scatter -------------------------------------------------------------------------
def _rs(send_of, recv_of, counts_of, in_place=False):
    def make():
        n = COUNTS[RANK]
        y = recv(n + 2)
        if in_place:
            y = rank_data(sum(COUNTS) + 1, RANK, np.int32)
            return (MPI.IN_PLACE, recv_of(y, sum(COUNTS)), counts_of()), [y]
        return (send_of(rank_data(sum(COUNTS) + 2, RANK, np.int32)), recv_of(y, n), counts_of()), [y]
    return make


REDUCE_SCATTER = {
    "[buf, n] recvcounts list": _rs(lambda x: [x, sum(COUNTS)], lambda y, n: [y, n],
                                    lambda: COUNTS),
    "[buf, (n, 1), T] np.array counts": _rs(lambda x: [x, (sum(COUNTS), 2), T],
                                            lambda y, n: [y, (n, 1), T],
                                            lambda: np.array(COUNTS)),
    "no recvcounts": _rs(lambda x: [x, sum(COUNTS), "i"], lambda y, n: [y, n, 2, T],
                         lambda: None),
    "in place [buf, n, T]": _rs(None, lambda y, n: [y, n, T], lambda: COUNTS, in_place=True),
}


CASES = [("Allgatherv", k, v) for k, v in {**ALLGATHERV, **ALLGATHERV_SEND}.items()] + \
    [("Allgather", k, v) for k, v in ALLGATHER.items()] + \
    [("Allreduce", k, v) for k, v in ALLREDUCE.items()] + \
    [("Reduce_scatter_block", k, v) for k, v in REDUCE_SCATTER_BLOCK.items()] + \
    [("Reduce_scatter", k, v) for k, v in REDUCE_SCATTER.items()]


@pytest.mark.parametrize("method,label,make", CASES, ids=[f"{m}: {k}" for m, k, _ in CASES])
def test_spec_like_mpi4py(method, label, make):
    """The same spec gives mpicoll.Comm and mpi4py's plain communicator the same buffers."""
    args, mine = make()
    ref_args, theirs = make()
    err = None
    try:
        getattr(mpicoll.Comm(WORLD), method)(*args)
    except Exception as exc:  # report, then fail on every rank together
        err = f"mpicoll raised {type(exc).__name__}: {exc}"
    getattr(MPI.Intracomm, method)(WORLD, *ref_args)
    bad = [f"buffer {i}: mpicoll {a} != mpi4py {b}" for i, (a, b) in enumerate(zip(mine, theirs))
           if a.tobytes() != b.tobytes()]
    util.assert_all(WORLD, err is None and not bad, err or "; ".join(bad))


# Specs mpi4py itself refuses (before any message): mpicoll refuses them too, clearly.
REJECTED = [
    ("Allreduce", "[buf] (1 item)", ValueError, r"2 to 4 items",
     lambda: (rank_data(3, RANK, np.int32), [recv(3)])),
    ("Allreduce", "5 items", ValueError, r"2 to 4 items",
     lambda: (rank_data(3, RANK, np.int32), [recv(3), 3, 0, T, T])),
    ("Allreduce", "(count,) pair", ValueError, r"recvbuf: expected \(count, displ\), got 1 items",
     lambda: (rank_data(3, RANK, np.int32), [recv(3), (3,), T])),
    ("Allreduce", "[buf, count, displ] (3 items: the third is the datatype)", TypeError,
     r"recvbuf: expected an MPI.Datatype or a typecode string as the datatype, got int",
     lambda: (rank_data(3, RANK, np.int32), [recv(5), 3, 1])),
    ("Allgatherv", "[buf, [counts, displs]] (a list is counts)",
     (TypeError, ValueError), r"recvbuf: expected",
     lambda: (rank_data(COUNTS[RANK], RANK, np.int32), [recv(NGAP), [COUNTS, GAPPED]])),
    ("Allreduce", "unknown typecode", TypeError, r"recvbuf: unknown typecode 'zz'",
     lambda: (rank_data(3, RANK, np.int32), [recv(3), "zz"])),
    ("Allreduce", "recvbuf None", TypeError, r"recvbuf: expected a buffer .*got NoneType",
     lambda: (rank_data(3, RANK, np.int32), None)),
]


@pytest.mark.parametrize("method,label,exc,match,make", REJECTED,
                         ids=[f"{m}: {k}" for m, k, *_ in REJECTED])
def test_spec_refused_like_mpi4py(method, label, exc, match, make):
    """mpi4py raises for these; mpicoll raises a clear error on every rank, sends nothing."""
    theirs = None
    try:
        getattr(MPI.Intracomm, method)(WORLD, *make())
    except Exception as e:
        theirs = e
    with pytest.raises(exc, match=match):
        getattr(mpicoll.Comm(WORLD), method)(*make())
    assert theirs is not None, "mpi4py accepts this spec"
    WORLD.Barrier()
