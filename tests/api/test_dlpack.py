"""DLPack buffers through mpicoll.Comm, as mpi4py treats them.

mpi4py reads a DLPack tensor from its capsule: writable unless a versioned
(DLPack >= 1.0) producer flags it read-only, a legacy capsule is writable, and
every type mpi4py names moves (bool included).  Each case passes the same
DLPack-only objects (no buffer protocol, so both libraries take the DLPack
path) to an mpicoll.Comm method and to mpi4py's own method on the plain
communicator, and compares the receive buffers.  The producer is NumPy's own
``__dlpack__``, which keeps the managed tensor alive until its deleter runs.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll

# buffer export (DLPack): 1 rank, and 3 for a collective over peers
pytestmark = pytest.mark.ranks(1, 3)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COMM = mpicoll.Comm(WORLD)

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
    import gc

    from mpicoll.backends import dlpack as _dlpack

    views = [_dlpack.asarray(Legacy(np.full(1000, float(k)))) for k in range(20)]
    gc.collect()
    ok = all(np.array_equal(v, np.full(1000, float(k))) for k, v in enumerate(views))
    util.assert_all(WORLD, ok, "a DLPack view lost its memory")


# --- a DLPack producer of any (code, bits, lanes), as real producers behave ------------------
# mpi4py's test/dlpackimpl.py frees its managed tensor together with the capsule, which breaks
# consumers that keep only the tensor; this one keeps the tensor (and the memory) alive until
# the consumer calls the deleter, or the capsule dies unconsumed.

import ctypes  # noqa: E402

from mpicoll.backends import dlpack as _dlpack  # noqa: E402

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
# array instead (tests/test_numerics.py covers that path): these tests are of the
# bytes path taken without it.
_BYTES_BF16 = pytest.mark.skipif(importlib.util.find_spec("ml_dtypes") is not None,
                                 reason="ml_dtypes installed: bfloat16 tensors are bfloat16 "
                                        "arrays (tests/test_numerics.py)")


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
    import gc

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
