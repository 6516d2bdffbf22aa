"""Device-array test cases shared by the fake-GPU suite (CI) and the CuPy suite (real GPU).

A :class:`Device` says how a test makes an input on the device (through a
kernel still running, or not yet run, when the collective starts), allocates
and reads back device arrays.  ``run_*`` run one collective on device arrays
through the array functions or ``mpicoll.Comm``, compare with MPI's built-in
collective on host copies of the same (rank-asymmetric) data, check that
the input is unchanged and that every rank holds the same bytes, and return
a description of what is wrong (None when right).  :func:`cases` lists the
cases for one collective: dtypes and ops, counts 0, 1, fewer than the ranks,
not divisible by them and many segments, both APIs, in place and not, every
registered algorithm.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.algorithms.ring import split
from mpicoll.engine import select as _select
from mpicoll.tools import results as _results
from support.data import rank_data

# CUDA source of a producer kernel that spins ``spin`` clock cycles, then copies
# ``n`` bytes: an input still being written when a collective starts (the CuPy
# suite and tests/device/stress.py compile it with cupy.RawKernel).
LATE_COPY_SRC = r"""
extern "C" __global__ void late_copy(const unsigned char* src, unsigned char* dst,
                                     long long n, long long spin) {
    long long t0 = clock64();
    while (clock64() - t0 < spin) { }
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        dst[i] = src[i];
}
"""


class Device:
    """make(host) -> device array (written by in-flight work); empty(n, dtype); get(x) -> host."""

    def __init__(self, make, empty, get):
        self.make = make
        self.empty = empty
        self.get = get


def _left(inbuf, inoutbuf, datatype):
    """User op ``in op inout = in`` (associative, not commutative): the result is rank 0's data."""
    dtype = mpicoll.core.types.dtype_of_datatype(datatype)[0]
    a = np.frombuffer(inbuf, dtype=dtype)
    b = np.frombuffer(inoutbuf, dtype=dtype)
    b[...] = a


def _plus(inbuf, inoutbuf, datatype):
    dtype = mpicoll.core.types.dtype_of_datatype(datatype)[0]
    b = np.frombuffer(inoutbuf, dtype=dtype)
    b += np.frombuffer(inbuf, dtype=dtype)


_USER_OPS = {}


def user_op(name):
    """MPI.Op.Create'd ops, created once per process (they are never freed)."""
    if name not in _USER_OPS:
        fn, commute = {"user+": (_plus, True), "user-left": (_left, False)}[name]
        _USER_OPS[name] = MPI.Op.Create(fn, commute=commute)
    return _USER_OPS[name]


# (op name, dtype): predefined ops on every category, float16, user ops.
OPS = [
    ("SUM", "float64"), ("SUM", "float32"), ("MAX", "int32"), ("MIN", "int64"),
    ("PROD", "complex64"), ("SUM", "float16"), ("LAND", "bool"), ("BXOR", "uint8"),
    ("user+", "int32"), ("user-left", "float64"),
]


def op_of(name):
    return getattr(MPI, name) if hasattr(MPI, name) else user_op(name)


def data(n, dtype, rank, salt=0):
    """:func:`support.data.rank_data` in this module's argument order."""
    return rank_data(n, rank, dtype, salt)


def cases(collective, size):
    """[(n, op name, dtype, api, in_place, algorithm)] for one collective at ``size`` ranks."""
    names = ["auto"] + sorted(_select.ALGORITHMS[collective])
    sizes = sorted({0, 1, max(size - 1, 0), 3 * size + 1, 257})
    out = []
    k = 0
    ops = OPS if collective != "allgather" else [(None, d) for d in
                                                 ("float64", "int16", "float16", "complex128", "bool")]
    for op, dtype in ops:
        for n in sizes:
            api = ("fn", "comm")[k % 2]
            in_place = bool((k // 2) % 2)
            algorithm = names[k % len(names)]
            if op is not None and not op_of(op).Is_commutative():
                algorithm = "auto"
            out.append((n, op, dtype, api, in_place, algorithm))
            k += 1
    return out


def _native(dtype):
    return np.dtype(dtype) != np.float16


def _spec(x, dtype):
    """An mpi4py buffer spec: [x, MPI type], or bare x for float16 (MPI has no such type)."""
    return [x, mpicoll.core.types.wire_type(np.dtype(dtype))] if _native(dtype) else x


def _vspec(x, counts, displs, dtype):
    return [x, counts, displs] + ([mpicoll.core.types.wire_type(np.dtype(dtype))] if _native(dtype) else [])


def _same_everywhere(comm, arr):
    return _results.identical_across_ranks(comm, arr)


def _reduce_ref(comm, h, op_name):
    """The exact reduction of every rank's ``h`` (mpicoll.tools.results), in ``h``'s dtype.

    The data are small integers, so the exact result is representable in
    every dtype here and the cast loses nothing.
    """
    ref = _results.reference_allreduce(comm, h, op_of(op_name))
    return np.asarray(ref.value).astype(h.dtype)


def _check(comm, dev, got, ref, x, h, in_place, what, same=True):
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return f"{what}: got shape {got.shape} {got.dtype}, expected {ref.shape} {ref.dtype}"
    res = _results.compare(got.reshape(-1), ref.reshape(-1), None, comm.Get_size(), exact=True)
    if not res.ok:
        return f"{what}: {res.nbad} element(s) wrong, {res.worst}"
    if not in_place and not _results.same_values(dev.get(x), h):
        return f"{what}: the input changed"
    if same and not _same_everywhere(comm, got):
        return f"{what}: ranks hold different bytes"
    return None


def run_allreduce(comm, dev, case):
    n, op_name, dtype, api, in_place, algorithm = case
    what = f"allreduce {case}"
    h = data(n, dtype, comm.Get_rank())
    ref = _reduce_ref(comm, h, op_name)
    op = op_of(op_name)
    x = dev.make(h)
    if api == "fn":
        y = mpicoll.allreduce(x, op, comm=comm, out=x if in_place else None, algorithm=algorithm)
        if in_place and y is not x:
            return f"{what}: in place did not return x"
    else:
        c = mpicoll.Comm(comm, algorithm=algorithm)
        if in_place:
            c.Allreduce(MPI.IN_PLACE, _spec(x, dtype), op=op)
            y = x
        else:
            y = dev.empty(n, dtype)
            c.Allreduce(_spec(x, dtype), _spec(y, dtype), op=op)
    return _check(comm, dev, dev.get(y), ref, x, h, in_place, what)


def run_reduce_scatter(comm, dev, case):
    n, op_name, dtype, api, in_place, algorithm = case
    what = f"reduce_scatter {case}"
    size, rank = comm.Get_size(), comm.Get_rank()
    h = data(n, dtype, rank, salt=1)
    ref_all = _reduce_ref(comm, h, op_name)
    op = op_of(op_name)
    x = dev.make(h)
    if api == "fn":
        counts = split(n, size)[0]
        y = mpicoll.reduce_scatter(x, op, comm=comm, out=x if in_place else None,
                                   algorithm=algorithm)
    else:
        counts = list(reversed(split(n, size)[0]))  # uneven, unlike the default split
        c = mpicoll.Comm(comm, algorithm=algorithm)
        if in_place:
            c.Reduce_scatter(MPI.IN_PLACE, _spec(x, dtype), counts, op=op)
            y = x[: counts[rank]]
        else:
            y = dev.empty(counts[rank], dtype)
            c.Reduce_scatter(_spec(x, dtype), _spec(y, dtype), counts, op=op)
    lo = sum(counts[:rank])
    ref = ref_all[lo: lo + counts[rank]]
    got = dev.get(y)
    if in_place:
        rest = dev.get(x)[counts[rank]:]
        if not np.array_equal(rest, h[counts[rank]:]):
            return f"{what}: in place changed x beyond the result"
    return _check(comm, dev, got, ref, x, h, in_place, what, same=False)


def run_allgather(comm, dev, case):
    n, _, dtype, api, in_place, algorithm = case
    what = f"allgather {case}"
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = [(n + 2 * r) % (n + 3) for r in range(size)]
    displs = [sum(counts[:r]) for r in range(size)]
    h = data(counts[rank], dtype, rank, salt=2)
    ref = np.concatenate(comm.allgather(h)).astype(dtype)
    total = sum(counts)
    if in_place:
        full = np.zeros(total, dtype)
        full[displs[rank]: displs[rank] + counts[rank]] = h
        x = dev.make(full)
    else:
        x = dev.make(h)
    if api == "fn":
        y = mpicoll.allgather(x, comm=comm, counts=counts, out=x if in_place else None,
                              algorithm=algorithm)
    else:
        c = mpicoll.Comm(comm, algorithm=algorithm)
        y = x if in_place else dev.empty(total, dtype)
        c.Allgatherv(MPI.IN_PLACE if in_place else _spec(x, dtype), _vspec(y, counts, displs, dtype))
    return _check(comm, dev, dev.get(y), ref, x, full if in_place else h, in_place, what)


RUNNERS = {"allreduce": run_allreduce, "reduce_scatter": run_reduce_scatter,
           "allgather": run_allgather}


def run_all(comm, dev, collective):
    """Run every case of ``collective``; the failures of all ranks (same list on every rank)."""
    failures = []
    for case in cases(collective, comm.Get_size()):
        problem = RUNNERS[collective](comm, dev, case)
        if problem:
            failures.append(f"rank {comm.Get_rank()}: {problem}")
    return [f for part in comm.allgather(failures) for f in part]
