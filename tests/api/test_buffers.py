"""What mpicoll.Comm takes as a buffer, as mpi4py takes it: specs, buffer kinds, DLPack.

* Buffer specs: every spec mpi4py takes, with mpi4py's result.  Each case
  builds the same arguments twice (fresh buffers with sentinel values around the
  message, rank-asymmetric data) and calls the method on an ``mpicoll.Comm`` and
  mpi4py's own method on the plain communicator (``MPI.Intracomm.Allgatherv(WORLD,
  ...)``); every receive buffer, gaps and all, must come out identical.  The spec
  grammar is mpi4py's message_simple / message_vector (``[buf, count, displ, T]``
  with parts left out or None, ``(count, displ)`` pairs, typecodes, bare buffers);
  see mpicoll/api/args.py.  Specs mpi4py refuses, mpicoll refuses too.
* Buffer kinds: every kind of host buffer of mpicoll.tools.arrays (NumPy,
  ``array.array``, ``bytearray``, ``memoryview``, DLPack-only), passed as
  ``[buf, datatype]``; the result must match the exact reference
  (mpicoll.tools.results), be identical on every rank, and leave the input
  untouched.
* DLPack: mpi4py reads a DLPack tensor from its capsule: writable unless a
  versioned (DLPack >= 1.0) producer flags it read-only, a legacy capsule is
  writable, and every type mpi4py names moves (bool included).  Each case passes
  the same DLPack-only objects (no buffer protocol, so both libraries take the
  DLPack path) to an mpicoll.Comm method and to mpi4py's own method on the plain
  communicator, and compares the receive buffers.  The producer is NumPy's own
  ``__dlpack__`` (it keeps the managed tensor alive until its deleter runs), or
  :class:`RawTensor` for types NumPy does not export.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util

import numpy as np
import pytest
from mpi4py import MPI
from mpi4py.util import dtlib
from support import buffers, util
from support.data import rank_data

import mpicoll
from mpicoll.backends import dlpack as _dlpack
from mpicoll.tools import arrays as _arrays
from mpicoll.tools import results as _results

# buffer handling against mpi4py: 1 rank (the trivial path), and 3 for a collective over
# peers with per-rank counts and displacements (not a power of two)
pytestmark = pytest.mark.ranks(1, 3)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COMM = mpicoll.Comm(WORLD)


# ---------------------------------------------------------------------------------------
# Buffer specs
# ---------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
# Buffer kinds
# ---------------------------------------------------------------------------------------
DTYPES = ("int32", "float64", "complex128")
KINDS = [k.name for k in _arrays.HOST_KINDS]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_allreduce_and_allgather_on_every_buffer_kind(kind, dtype):
    arrays = buffers.kind(kind)
    if not arrays.supports(dtype):
        pytest.skip(f"{kind} cannot hold {dtype}")
    dt = np.dtype(dtype)
    mpitype = dtlib.from_numpy_dtype(dt)
    comm = mpicoll.Comm(WORLD)
    problems = []
    n = 2 * SIZE + 3
    x = rank_data(n, RANK, dt)
    try:
        send, recv = arrays.put(x), arrays.empty(n, dt)
        comm.Allreduce([send, mpitype], [recv, mpitype], MPI.SUM)
        got = arrays.get(recv, dt)
        res = _results.compare(got, _results.reference_allreduce(WORLD, x, MPI.SUM), "SUM", SIZE)
        if not res.ok:
            problems.append(f"Allreduce: {res.worst}")
        if not _results.same_values(arrays.get(send, dt), x):
            problems.append("Allreduce: the input changed")
        if not _results.identical_across_ranks(WORLD, got):
            problems.append("Allreduce: ranks differ")
        gathered = arrays.empty(n * SIZE, dt)
        comm.Allgather([send, mpitype], [gathered, mpitype])
        want = np.concatenate([rank_data(n, r, dt) for r in range(SIZE)])
        if not _results.same_values(arrays.get(gathered, dt), want):
            problems.append("Allgather: wrong result")
    except Exception as exc:  # decided together below
        problems.append(f"{type(exc).__name__}: {exc}")
    util.assert_all(WORLD, not problems, "; ".join(problems))


def test_to_host_reads_every_kind():
    x = np.arange(5, dtype=np.float64) + RANK
    for arrays in _arrays.HOST_KINDS:
        buf = arrays.put(x)
        assert _results.same_values(_arrays.to_host(buf, x.dtype), x), arrays.name


# ---------------------------------------------------------------------------------------
# DLPack
# ---------------------------------------------------------------------------------------
TYPECODES = "?bhilqBHILQefdFD"  # every type NumPy exports through DLPack


class Versioned:
    """A DLPack-only view of an array; DLPack 1.0 capsules (read-only flag honoured)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class Legacy(Versioned):
    """A producer older than DLPack 1.0: no keywords, an unversioned "dltensor" capsule."""

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()


PRODUCERS = {"versioned": Versioned, "legacy": Legacy}


def _op(code):
    return MPI.LOR if np.dtype(code).kind == "b" else MPI.SUM


def _calls(code):
    """method -> (sendbuf array, recvbuf array, extra args) with rank-asymmetric data."""
    counts = [1 + r % 3 for r in range(SIZE)]
    op = _op(code)
    return {
        "Allreduce": (rank_data(5, RANK, code), np.zeros(5, code), (op,)),
        "Allgather": (rank_data(3, RANK, code), np.zeros(3 * SIZE, code), ()),
        "Allgatherv": (rank_data(counts[RANK], RANK, code), np.zeros(sum(counts), code), ()),
        "Reduce_scatter_block": (rank_data(2 * SIZE, RANK, code), np.zeros(2, code), (op,)),
        "Reduce_scatter": (rank_data(sum(counts), RANK, code), np.zeros(counts[RANK], code), (counts, op)),
    }


def _recvspec(method, wrapped):
    if method == "Allgatherv":
        return [wrapped, [1 + r % 3 for r in range(SIZE)]]
    return wrapped


@pytest.mark.parametrize("producer", list(PRODUCERS))
@pytest.mark.parametrize("code", list(TYPECODES))
def test_dlpack_like_mpi4py(producer, code):
    """Every method, DLPack send and receive buffers: mpicoll's result is mpi4py's."""
    wrap = PRODUCERS[producer]
    bad = []
    for method, (x, y, extra) in _calls(code).items():
        mine, theirs = y.copy(), y.copy()
        err = None
        try:
            getattr(COMM, method)(wrap(x.copy()), _recvspec(method, wrap(mine)), *extra)
        except Exception as exc:
            err = f"{method}: mpicoll raised {type(exc).__name__}: {exc}"
        getattr(MPI.Intracomm, method)(WORLD, wrap(x.copy()), _recvspec(method, wrap(theirs)),
                                       *extra)
        if err:
            bad.append(err)
        elif mine.tobytes() != theirs.tobytes():
            bad.append(f"{method}: mpicoll {mine} != mpi4py {theirs}")
    util.assert_all(WORLD, not bad, "; ".join(bad))


@pytest.mark.parametrize("producer", list(PRODUCERS))
def test_dlpack_in_place(producer):
    """IN_PLACE with a DLPack recvbuf (legacy capsules are writable)."""
    wrap = PRODUCERS[producer]
    x = rank_data(4, RANK, "d")
    mine, theirs = x.copy(), x.copy()
    COMM.Allreduce(MPI.IN_PLACE, wrap(mine))
    WORLD.Allreduce(MPI.IN_PLACE, wrap(theirs))
    util.assert_all(WORLD, np.array_equal(mine, theirs), f"{mine} != {theirs}")


def test_dlpack_read_only_flag():
    """A versioned producer's read-only tensor: a fine sendbuf, refused as recvbuf (like mpi4py)."""
    x = rank_data(4, RANK, "d")
    x.flags.writeable = False
    y = np.zeros(4)
    COMM.Allreduce(Versioned(x), Versioned(y))  # read-only send: fine
    ok = np.array_equal(y, sum(rank_data(4, r, "d") for r in range(SIZE)))
    with pytest.raises(ValueError, match=r"^recvbuf: expected a writable buffer"):
        COMM.Allreduce(Versioned(y.copy()), Versioned(x))
    with pytest.raises(BufferError):
        WORLD.Allreduce(Versioned(y.copy()), Versioned(x))
    util.assert_all(WORLD, ok, f"{y}")


def test_dlpack_array_functions_write_legacy_out():
    """The array functions take a legacy DLPack ``out`` too."""
    x = rank_data(6, RANK, "f")
    out = np.zeros(6, np.float32)
    mpicoll.allreduce(x, out=Legacy(out))
    want = sum(rank_data(6, r, "f") for r in range(SIZE))
    util.assert_all(WORLD, np.array_equal(out, want), f"{out} != {want}")


def test_dlpack_tensor_outlives_the_producer():
    """The memory stays valid while mpicoll holds it, even when the producer object is gone."""
    views = [_dlpack.asarray(Legacy(np.full(1000, float(k)))) for k in range(20)]
    gc.collect()
    ok = all(np.array_equal(v, np.full(1000, float(k))) for k, v in enumerate(views))
    util.assert_all(WORLD, ok, "a DLPack view lost its memory")


# --- a DLPack producer of any (code, bits, lanes), as real producers behave ------------------
# mpi4py's test/dlpackimpl.py frees its managed tensor together with the capsule, which breaks
# consumers that keep only the tensor; this one keeps the tensor (and the memory) alive until
# the consumer calls the deleter, or the capsule dies unconsumed.

_LIVE: dict = {}  # address of the managed tensor -> what it keeps alive
DELETED: list = []
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # the dying capsule: a raw pointer
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
_capsule_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_ptr = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


@_DELETER
def _deleter(address):
    DELETED.append(address)
    _LIVE.pop(address, None)


@_DESTRUCTOR
def _destructor(capsule):
    if _capsule_valid(capsule, b"dltensor"):  # never consumed: the producer cleans up
        _deleter(_capsule_ptr(capsule, b"dltensor"))


class RawTensor:
    """A legacy DLPack producer over ``array``'s memory, typed (code, bits, lanes)."""

    def __init__(self, array, code, bits, lanes=1):
        self.array, self.dtype = array, (code, bits, lanes)
        self.count = array.nbytes * 8 // (bits * lanes)

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None):
        shape = (ctypes.c_int64 * 1)(self.count)
        managed = _dlpack._Managed()
        t = managed.dl_tensor
        t.data = self.array.ctypes.data
        t.device.device_type, t.device.device_id = 1, 0
        t.ndim = 1
        t.dtype.code, t.dtype.bits, t.dtype.lanes = self.dtype
        t.shape = shape
        t.strides = None
        t.byte_offset = 0
        managed.deleter = ctypes.cast(_deleter, ctypes.c_void_p)
        address = ctypes.addressof(managed)
        _LIVE[address] = (managed, shape, self.array)
        return _capsule_new(address, b"dltensor", ctypes.cast(_destructor, ctypes.c_void_p))


def test_dlpack_bool_tensor():
    """kDLBool tensors move and reduce like mpi4py's (MPI.C_BOOL)."""
    x = rank_data(5, RANK, "?")
    mine, theirs = np.zeros(5, bool), np.zeros(5, bool)
    COMM.Allreduce(RawTensor(x, 6, 8), RawTensor(mine, 6, 8), MPI.LOR)
    WORLD.Allreduce(RawTensor(x, 6, 8), RawTensor(theirs, 6, 8), MPI.LOR)
    g_mine, g_theirs = np.zeros(5 * SIZE, bool), np.zeros(5 * SIZE, bool)
    COMM.Allgather(RawTensor(x, 6, 8), RawTensor(g_mine, 6, 8))
    WORLD.Allgather(RawTensor(x, 6, 8), RawTensor(g_theirs, 6, 8))
    ok = np.array_equal(mine, theirs) and np.array_equal(g_mine, g_theirs)
    util.assert_all(WORLD, ok, f"{mine} {theirs} {g_mine} {g_theirs}")


# With ml_dtypes installed, a DLPack bfloat16 (code 4) tensor is an ml_dtypes bfloat16
# array instead (tests/algorithms/test_numerics.py covers that path): these tests are of the
# bytes path taken without it.
_BYTES_BF16 = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is not None,
                                 reason="ml_dtypes installed: bfloat16 tensors are bfloat16 "
                                        "arrays (tests/algorithms/test_numerics.py)")


@pytest.mark.parametrize("dltype", [pytest.param((4, 16, 1), marks=_BYTES_BF16), (1, 8, 4),
                                    (2, 16, 2)],
                         ids=["bfloat16", "uint8x4 lanes", "float16x2 lanes"])
def test_dlpack_types_moved_as_bytes(dltype):
    """Types mpi4py has no datatype for travel as MPI.BYTE, in mpicoll as in mpi4py."""
    x = (np.arange(12, dtype=np.uint16) * 7 + 1000 * RANK).view(np.uint8)
    mine, theirs = np.zeros(x.nbytes * SIZE, np.uint8), np.zeros(x.nbytes * SIZE, np.uint8)
    COMM.Allgather(RawTensor(x, *dltype), RawTensor(mine, *dltype))
    WORLD.Allgather(RawTensor(x, *dltype), RawTensor(theirs, *dltype))
    counts = [x.nbytes] * SIZE
    v_mine, v_theirs = np.zeros(x.nbytes * SIZE, np.uint8), np.zeros(x.nbytes * SIZE, np.uint8)
    COMM.Allgatherv(RawTensor(x, *dltype), [RawTensor(v_mine, *dltype), counts])
    WORLD.Allgatherv(RawTensor(x, *dltype), [RawTensor(v_theirs, *dltype), counts])
    ok = np.array_equal(mine, theirs) and np.array_equal(v_mine, v_theirs)
    util.assert_all(WORLD, ok, f"{mine} != {theirs} or {v_mine} != {v_theirs}")


def test_dlpack_deleter_runs_once_when_done():
    """mpicoll keeps the capsule while it uses the tensor; the deleter runs once, afterwards."""
    del DELETED[:]
    y = np.zeros(4)
    tensor = RawTensor(y, 2, 64)
    COMM.Allreduce(RawTensor(rank_data(4, RANK, "d"), 2, 64), tensor)
    gc.collect()
    ok = len(DELETED) == 2 and not _LIVE  # the send and the receive tensor, once each
    ok = ok and np.array_equal(y, sum(rank_data(4, r, "d") for r in range(SIZE)))
    util.assert_all(WORLD, ok, f"deleted {len(DELETED)}, live {len(_LIVE)}, {y}")


@_BYTES_BF16
def test_dlpack_bytes_type_with_an_empty_rank():
    """Allgatherv of a bfloat16 tensor where rank 0 sends nothing: every rank moves MPI.BYTE."""
    counts = [0] + [2 * (r + 1) for r in range(1, SIZE)]  # bytes
    x = (np.arange(counts[RANK]) + 10 * RANK).astype(np.uint8)
    mine = np.zeros(sum(counts), np.uint8)
    theirs = mine.copy()
    COMM.Allgatherv(RawTensor(x, 4, 16), [RawTensor(mine, 4, 16), counts])
    WORLD.Allgatherv(RawTensor(x, 4, 16), [RawTensor(theirs, 4, 16), counts])
    util.assert_all(WORLD, np.array_equal(mine, theirs), f"{mine} != {theirs}")


@_BYTES_BF16
def test_dlpack_bytes_type_refused_by_array_functions():
    """The array functions need a NumPy dtype: a bfloat16 tensor is a TypeError naming its type."""
    x = np.zeros(4, np.uint16)
    with pytest.raises(TypeError, match=r"^x: expected an array of a NumPy dtype, got a DLPack "
                                        r"tensor of type \(code 4, bits 16, lanes 1\)"):
        mpicoll.allreduce(RawTensor(x, 4, 16))
    WORLD.Barrier()
