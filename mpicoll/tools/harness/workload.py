"""One collective call as the tools run it, and its check against the exact result.

:class:`Case` holds, for one (collective, algorithm, size), the input, the
mpicoll call out of place and in place and MPI's built-in the same two ways on
the same input, as :class:`~mpicoll.tools.harness.timing.Variant` objects; :func:`check_case`
compares each output with the exact values.

Sizes follow nccl-tests: ``nbytes`` is the whole array (AllReduce: each rank's
array; AllGather: the gathered array; ReduceScatter: each rank's input),
rounded down to a whole number of elements per rank.  The inputs are small
integers (:func:`rank_data`), different per rank and element and exact in
every type, so the expected result is known exactly (:func:`expected`) and
:mod:`mpicoll.tools.results`' rule judges it (integers exactly, floating
SUM/PROD within ``gamma(n-1) * sum|x|``).

MPI has no datatype for float16, bfloat16 and float8; for them the built-in
is what a user of plain MPI runs: the same count in float32 (reductions) or
the same bytes as words (AllGather).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

import mpicoll

from ...core import types as _types
from .. import arrays as _arrays
from .. import results as _results
from .cli import ToolError
from .timing import Variant

__all__ = ["COLLECTIVES", "BUSBW_FACTOR", "DTYPES", "OPS", "rank_data", "expected",
           "error_scale", "count_wrong", "HostDevice", "GpuDevice", "gpu_device", "Case",
           "check_case", "memory_probe"]

COLLECTIVES = ("allreduce", "allgather", "reduce_scatter")

# nccl-tests' bus bandwidth: busbw = algbw * factor(n), the fraction of the data each
# rank's link carries in a bandwidth-optimal algorithm, so busbw compares with the link
BUSBW_FACTOR = {
    "allreduce": lambda n: 2 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}

# the predefined ops with a NumPy ufunc for the exact expected values, in lower case
# as nccl-tests names them
OPS = tuple(name.lower() for name in _types.NUMPY_UFUNCS)


def _builtin_dtypes() -> dict:
    """Every dtype mpicoll carries that MPI's built-in collectives reduce natively, by
    NumPy name, plus the nccl-tests / C spellings (not long double: its name and size
    differ between platforms)."""
    out = {}
    for code in np.typecodes["AllInteger"] + np.typecodes["AllFloat"]:
        dtype = np.dtype(code)
        if dtype.char in "eEgG":
            continue
        try:
            _types.category_of_dtype(dtype)
        except TypeError:  # no MPI datatype for it in this build
            continue
        out[dtype.name] = dtype
    out.update(int=np.dtype(np.int32), float=np.dtype(np.float32), double=np.dtype(np.float64))
    return out


def _half_dtypes() -> dict:
    """float16, and bfloat16 and float8 where ml_dtypes is installed."""
    out = {"float16": np.dtype(np.float16)}
    try:
        import ml_dtypes
    except ImportError:
        return out
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        out[name] = np.dtype(getattr(ml_dtypes, name))
    return out


DTYPES = {**_builtin_dtypes(), **_half_dtypes()}


# --- data and the check ---------------------------------------------------------

def rank_data(rank: int, nranks: int, count: int, dtype: np.dtype, op: str, offset: int = 0):
    """Rank ``rank``'s input: small integers (exact in every type), different per rank and element."""
    i = np.arange(offset, offset + count, dtype=np.int64)
    if op == "prod":
        v = np.ones(count, dtype=np.int64)
        v[i % nranks == rank] = 2  # one factor 2 per element: products stay tiny
        if dtype.kind != "u":
            v[(i + rank) % 5 == 0] *= -1
    else:
        v = (rank * 7 + i * 3) % 13
        if dtype.kind not in "ub" and op not in ("band", "bor", "bxor"):
            v -= 6
    if dtype.kind == "c":
        return (v + 1j * ((rank * 5 + i) % 7 - 3)).astype(dtype)
    return v.astype(dtype)


def expected(collective, nranks, count, dtype, op, rank):
    """The exact result this rank should hold (``count``: the whole array's elements)."""
    if collective == "allgather":
        per = count // nranks
        return np.concatenate([rank_data(r, nranks, per, dtype, op) for r in range(nranks)])
    ufunc = _types.NUMPY_UFUNCS[op.upper()]
    acc = rank_data(0, nranks, count, dtype, op)
    for r in range(1, nranks):
        acc = ufunc(acc, rank_data(r, nranks, count, dtype, op)).astype(dtype, copy=False)
    if collective == "reduce_scatter":
        per = count // nranks
        return acc[rank * per: (rank + 1) * per]
    return acc


def error_scale(collective, nranks, count, dtype, op, rank):
    """``sum_r |x_r|`` (SUM) or ``prod_r |x_r|`` (PROD) of this rank's result elements, or None.

    The scale of mpicoll.tools.results' tolerance rule; None where the result must be exact.
    """
    opname = op.upper()
    if collective == "allgather" or not _results.needs_tolerance(opname, dtype):
        return None
    scale = None
    for r in range(nranks):
        mag = _results.magnitude(rank_data(r, nranks, count, dtype, op), opname)
        scale = mag if scale is None else (scale + mag if opname == "SUM" else scale * mag)
    if collective == "reduce_scatter":
        per = count // nranks
        scale = scale[rank * per: (rank + 1) * per]
    return scale


def count_wrong(got, want, dtype, nranks, op=None, scale=None) -> int:
    """Elements of ``got`` that differ from the exact ``want`` (mpicoll.tools.results' rule).

    With ``op`` and ``scale`` (:func:`error_scale`) floating SUM/PROD may
    differ by rounding, within ``gamma(n-1) * scale``; everything else must
    be identical.
    """
    got = np.asarray(got)
    if got.shape != np.shape(want):
        return max(got.size, np.size(want))
    ref = _results.Reference(np.asarray(want, dtype), scale, "exact")
    opname = op.upper() if op is not None and scale is not None else None
    return _results.compare(got, ref, opname, nranks).nbad


# --- devices --------------------------------------------------------------------

class HostDevice(_arrays.NumpyArrays):
    """NumPy arrays (mpicoll.tools.arrays); the input is used as it is, nothing to synchronise."""

    name = "cpu"

    @staticmethod
    def upload(host):
        return host

    def download(self, arr):
        return self.get(arr)

    def builtin_call(self, call, sbuf, rbuf):
        """The built-in collective as a user of these arrays calls it."""
        def run():
            call(sbuf, rbuf)
        return run

    def builtin_in_place_call(self, call, buf):
        """The built-in collective in place (``MPI.IN_PLACE``) on ``buf``."""
        def run():
            call(buf)
        return run


class GpuDevice(_arrays.DeviceArrays):
    """Device arrays of a registered mpicoll device backend (CuPy by default)."""

    def __init__(self, backend):
        super().__init__(backend.rt, "gpu")
        self.backend = backend

    def upload(self, host):
        return self.put(host)

    def download(self, arr):
        return self.get(arr)

    def _pinned(self, n, dtype):
        return self.rt.pinned(max(n, 1) * dtype.itemsize).view(dtype)[:n]

    def builtin_call(self, call, sbuf, rbuf):
        """Copy the input to pinned host memory, run MPI there, copy the result back: what a
        user of an MPI without CUDA support does."""
        hs = self._pinned(len(sbuf), sbuf.dtype)
        hr = self._pinned(len(rbuf), rbuf.dtype)
        rt, stream_of = self.rt, self.rt.current_stream

        def run():
            stream = stream_of()
            rt.d2h(hs, sbuf, stream)
            rt.synchronize(stream)
            call(hs, hr)
            rt.h2d(rbuf, hr, stream)
            rt.synchronize(stream)
        return run

    def builtin_in_place_call(self, call, buf):
        """The built-in in place on a pinned host copy of ``buf``, copied back."""
        hb = self._pinned(len(buf), buf.dtype)
        rt, stream_of = self.rt, self.rt.current_stream

        def run():
            stream = stream_of()
            rt.d2h(hb, buf, stream)
            rt.synchronize(stream)
            call(hb)
            rt.h2d(buf, hb, stream)
            rt.synchronize(stream)
        return run


def gpu_device(comm, backend=None) -> GpuDevice:
    """Bind this rank's GPU (``mpicoll.bind_device``, collective) and return the device
    wrapper (:class:`~mpicoll.tools.harness.cli.ToolError` on every rank if a rank has
    none); ``backend``: a registered device backend to use instead (tests)."""
    if backend is None:
        from ...backends import devices as _devices
        try:
            mpicoll.bind_device(comm)  # every rank raises, or none
        except mpicoll.MpicollError as exc:
            raise ToolError(f"--device gpu: {exc}", agreed=True) from None
        backend = _devices.CUPY
    return GpuDevice(backend)


# --- one measurement ------------------------------------------------------------

def _unchecked():
    """mpicoll's calls are timed without the cross-rank agreement check (its own variant)."""
    return mpicoll.options(check=False)


class Case:
    """Buffers and calls for one (collective, algorithm, size).

    ``variants``: ``"mpicoll"`` (out of place), ``"in_place"``, ``"builtin"`` (MPI's,
    out of place) and ``"builtin_in_place"`` (MPI's with ``MPI.IN_PLACE``, the form torch
    and DDP use), each a :class:`Variant`.  ``api``: ``"comm"`` times
    :class:`mpicoll.Comm` methods (``MPI.IN_PLACE`` in place), ``"array"`` the array
    functions (``out=x`` in place).
    """

    def __init__(self, comm, device, collective, algorithm, nbytes, dtype, op: str,
                 api: str = "comm"):
        n, rank = comm.size, comm.rank
        self.comm, self.device = comm, device
        dtype = np.dtype(dtype)
        item = dtype.itemsize
        if collective == "allreduce":
            count = max(nbytes // item, 1)
            per = count
        else:
            per = max(nbytes // (item * n), 1)
            count = per * n
        self.collective, self.algorithm, self.op = collective, algorithm, op
        self.count, self.per, self.nbytes, self.dtype = count, per, count * item, dtype
        mop = _types.predefined_op(op)
        self.host_in = rank_data(rank, n, per if collective == "allgather" else count, dtype, op)
        out_len = per if collective == "reduce_scatter" else count
        self.sbuf = device.upload(self.host_in)
        self.out_m = device.empty(out_len, dtype)
        self.out_b = device.empty(out_len, dtype)
        # in place: the buffer holds the input where the collective reads it
        self.inplace = device.empty(count, dtype)
        sbuf_b = self.sbuf
        self.host_in_b = self.host_in  # the built-in's input
        if _types.accumulation_dtype(dtype) is not None:  # no MPI datatype (module docstring)
            if collective == "allgather":
                words = _types.view_dtype(dtype)
                self.host_in_b = self.host_in.view(words)
            else:
                self.host_in_b = self.host_in.astype(_types.accumulation_dtype(dtype))
            sbuf_b = device.upload(self.host_in_b)
            self.out_b = device.empty(out_len, self.host_in_b.dtype)
        self.inplace_b = device.empty(count, self.host_in_b.dtype)
        sync = device.sync
        s, om, ip = self.sbuf, self.out_m, self.inplace
        algo = algorithm
        if api == "comm":
            mcomm = mpicoll.Comm(comm, algorithm=algo)
            IN = MPI.IN_PLACE
            call, call_in_place = {
                "allreduce": (lambda: mcomm.Allreduce(s, om, mop),
                              lambda: mcomm.Allreduce(IN, ip, mop)),
                "allgather": (lambda: mcomm.Allgather(s, om),
                              lambda: mcomm.Allgather(IN, ip)),
                "reduce_scatter": (lambda: mcomm.Reduce_scatter_block(s, om, mop),
                                   lambda: mcomm.Reduce_scatter_block(IN, ip, mop)),
            }[collective]
        else:
            fn = getattr(mpicoll, collective)
            kw = {} if collective == "allgather" else {"op": mop}

            def call():
                fn(s, comm=comm, out=om, algorithm=algo, **kw)

            def call_in_place():
                fn(ip, comm=comm, out=ip, algorithm=algo, **kw)

        def run(f):
            def timed():
                f()
                sync()
            return timed

        builtin = {
            "allreduce": lambda a, b: comm.Allreduce(a, b, mop),
            "allgather": lambda a, b: comm.Allgather(a, b),
            "reduce_scatter": lambda a, b: comm.Reduce_scatter_block(a, b, mop),
        }[collective]
        IN_PLACE = MPI.IN_PLACE
        builtin_in_place = {
            "allreduce": lambda b: comm.Allreduce(IN_PLACE, b, mop),
            "allgather": lambda b: comm.Allgather(IN_PLACE, b),
            "reduce_scatter": lambda b: comm.Reduce_scatter_block(IN_PLACE, b, mop),
        }[collective]
        self.call = run(call)
        self.call_in_place = run(call_in_place)
        self.call_builtin_in_place = device.builtin_in_place_call(builtin_in_place, self.inplace_b)
        self.reset_in_place()
        self.variants = {
            "mpicoll": Variant(self.call, _unchecked),
            # (the input put back before each batch: repeated in-place reductions grow it,
            # and an overflow would time NumPy's floating-point error handling)
            "in_place": Variant(self.call_in_place, _unchecked, reset=self.reset_in_place),
            "builtin": Variant(device.builtin_call(builtin, sbuf_b, self.out_b)),
            "builtin_in_place": Variant(self.call_builtin_in_place, reset=self.reset_in_place),
        }
        kw = {} if collective == "allgather" else {"op": mop}

        def call_on(c):
            """One mpicoll call of this case on communicator ``c`` (array API)."""
            getattr(mpicoll, collective)(s, comm=c, out=om, algorithm=algo, **kw)
            sync()

        self.call_on = call_on

    def _in_place_input(self, host_in):
        """The whole in-place buffer holding ``host_in`` where the collective reads it."""
        host = np.zeros(self.count, host_in.dtype)
        if self.collective == "allgather":
            r = self.comm.rank
            host[r * self.per:(r + 1) * self.per] = host_in
        else:
            host[:] = host_in
        return host

    def reset_in_place(self) -> None:
        """Put the input back into the in-place buffers, mpicoll's and the built-in's (every
        call overwrites them)."""
        self.inplace = _refill(self.device, self.inplace, self._in_place_input(self.host_in))
        self.inplace_b = _refill(self.device, self.inplace_b,
                                 self._in_place_input(self.host_in_b))

    def ran(self) -> str:
        """The algorithm mpicoll runs for this case (one call, seen by ``mpicoll.traffic()``;
        "auto" resolved as the engine resolves it, the node layout and numerics included)."""
        with mpicoll.traffic() as t:
            self.call()
        return t.calls[-1].algorithm if t.calls else self.algorithm


def _refill(device, buf, host):
    """``buf[...] = host`` on the device (the same buffer: the in-place calls hold it)."""
    if isinstance(buf, np.ndarray):
        buf[...] = host
    else:
        device.rt.to_device(buf, host)
        device.sync()
    return buf


def check_case(comm, case, builtin: bool = True, in_place: bool = True) -> dict:
    """Wrong elements, summed over ranks, per variant (``mpicoll``, ``in_place``,
    ``builtin``, ``builtin_in_place``): the outputs of the calls timed last, and one
    in-place call of each on the input put back, against the exact values."""
    n, device = comm.size, case.device
    want = expected(case.collective, n, case.count, case.dtype, case.op, comm.rank)
    scale = error_scale(case.collective, n, case.count, case.dtype, case.op, comm.rank)

    def wrong(got):
        return count_wrong(got, want, case.dtype, n, case.op, scale)

    def result(got):
        """An in-place buffer's result part, in the case's type."""
        if case.collective == "reduce_scatter":
            got = got[:case.per]
        if got.dtype != case.dtype:  # float32 or words (module docstring)
            got = got.view(case.dtype) if got.dtype.kind == "u" else got.astype(case.dtype)
        return got

    local = {"mpicoll": wrong(device.download(case.out_m))}
    if in_place:
        case.reset_in_place()
        with _unchecked():
            case.call_in_place()
        local["in_place"] = wrong(result(device.download(case.inplace)))
    if builtin:
        local["builtin"] = wrong(result(device.download(case.out_b)))
    if builtin and in_place:
        case.reset_in_place()
        case.call_builtin_in_place()
        local["builtin_in_place"] = wrong(result(device.download(case.inplace_b)))
    names = list(local)
    total = comm.allreduce(np.array([local[k] for k in names], dtype=np.int64))
    return {k: int(v) for k, v in zip(names, total)}


def memory_probe(comm, case) -> tuple[int, int | None]:
    """(scratch bytes held, tracemalloc peak bytes) of one call on a fresh communicator, max over ranks.

    The fresh communicator gets a new mpicoll context, so the call allocates
    its work arrays; what the context holds afterwards is what every later
    call of that size reuses.  tracemalloc sees host (NumPy) allocations only:
    the peak is None for device arrays.  (Reads the context's work memory:
    ``engine.context``, the one internal the benchmark uses.)
    """
    import tracemalloc

    from ...engine import context as _context

    dup = comm.Dup()
    try:
        ctx = _context.context(dup)  # created (collectively) before the measurement
        started = not tracemalloc.is_tracing()
        if started:
            tracemalloc.start()
        try:
            dup.Barrier()
            base = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            case.call_on(dup)
            peak = tracemalloc.get_traced_memory()[1] - base
        finally:
            if started:
                tracemalloc.stop()
        held = ctx.work.nbytes
    finally:
        dup.Free()
    held = comm.allreduce(held, op=MPI.MAX)
    peak = comm.allreduce(peak, op=MPI.MAX)
    return held, (peak if isinstance(case.sbuf, np.ndarray) else None)
