"""mpicoll.verify's runner: one collective on one input through mpicoll, checked. Collective.

The input and layout come from :mod:`.cases`, the reference, tolerance and
comparison from :mod:`mpicoll.tools.results`, the buffers from
:mod:`mpicoll.tools.arrays` (NumPy, or CuPy for ``--device gpu``).
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from .. import results as _results
from ..arrays import NUMPY
from ..results import Reference, compare, reference_allgatherv, reference_allreduce, same_values
from .cases import COLLECTIVES, TypeInfo, gapped_displs, make_input, uneven_counts


@dataclass
class CaseResult:
    """Outcome of :func:`run_case`, the same on every rank."""

    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    identical: bool | None = None  # None: not applicable (ReduceScatter) or not checked
    problems: list = field(default_factory=list)  # "rank r: ..." strings

    def report(self) -> str:
        return "; ".join(self.problems) if self.problems else "ok"


def _exchange(comm, row, timeout: float) -> np.ndarray:
    """Allgather of one int64 row per rank; abort the job if some rank does not arrive in time.

    A rank that raised inside a collective may leave others waiting inside
    mpicoll for messages that never come: the ranks that can still arrive
    wait ``timeout`` seconds, then abort the job instead of hanging.
    """
    send = np.asarray(row, np.int64)
    recv = np.zeros((comm.Get_size(), len(send)), np.int64)
    req = MPI.Comm.Iallgather(comm, send, recv)
    deadline = time.monotonic() + timeout
    while not req.Test():
        if time.monotonic() > deadline:
            sys.stderr.write(
                f"mpicoll.verify: rank {MPI.COMM_WORLD.Get_rank()}: other ranks did not finish "
                f"the collective within {timeout:g} s; aborting the job\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        time.sleep(1e-4)
    return recv


def _unchanged(name, before, arr, arrays, problems):
    if not same_values(arrays.get(arr), before):
        problems.append(f"{name} changed")


@dataclass
class Prepared:
    """Input, layout and reference of one case (shared by its in-place/algorithm variants)."""

    x: np.ndarray                  # this rank's input (host)
    want: Reference                # expected result on this rank
    counts: list | None            # per-rank counts (None: Allreduce)
    displs: list | None = None     # gathers: where each rank's block goes
    initial: np.ndarray | None = None  # gathers: receive buffer before the call
    n: int = 0                     # reductions: elements of this rank's result


def _layout(collective, count, size):
    """(counts, total input length) of a reduction collective."""
    if collective in ("Allreduce", "allreduce"):
        return None, count
    if collective == "Reduce_scatter_block":
        return [count] * size, count * size
    if collective == "Reduce_scatter":
        counts = uneven_counts(count, size)
        return counts, sum(counts)
    from ...algorithms.ring import split  # array reduce_scatter: numpy.array_split rule
    return split(count, size)[0], count


def prepare_case(comm, collective: str, info: TypeInfo, opname: str | None, count: int,
                 seed: int = 0) -> Prepared:
    """Input and MPI built-in reference of a case (collective: built-ins only)."""
    reduces = COLLECTIVES[collective][2]
    size, rank = comm.Get_size(), comm.Get_rank()
    if reduces:
        counts, total = _layout(collective, count, size)
        x = make_input(info.dtype, total, rank, size, opname, seed)
        ref = reference_allreduce(comm, x, getattr(MPI, opname), info.datatype)
        lo, n = (0, total) if counts is None else (sum(counts[:rank]), counts[rank])
        return Prepared(x, ref[lo:lo + n], counts, n=n)
    if collective in ("Allgather", "allgather"):
        counts = [count] * size
        displs = [count * r for r in range(size)]
        length = count * size
    elif collective == "Allgatherv":
        counts = uneven_counts(count, size)
        displs, length = gapped_displs(counts)
    else:  # array allgather with counts: contiguous blocks
        counts = uneven_counts(count, size)
        displs = [sum(counts[:r]) for r in range(size)]
        length = sum(counts)
    x = make_input(info.dtype, counts[rank], rank, size, None, seed)
    initial = make_input(info.dtype, length, 0, size, "sentinel", seed + 1)
    want = Reference(reference_allgatherv(comm, x, counts, displs, initial), None, "MPI built-in")
    return Prepared(x, want, counts, displs, initial)


def _rank_order_fold(comm, x, opname):
    """``((x0 op x1) op x2) ...`` over the ranks' inputs, in the accumulation type (float32
    for the 8/16-bit floats, else the type itself), rounded once to the input type."""
    from ...core import types as _types

    rows = _results.gather_rows(comm, x)
    wide = _types.accumulation_dtype(x.dtype) or x.dtype
    acc = rows[0].astype(wide)
    for row in rows[1:]:
        acc = _types.NUMPY_UFUNCS[opname](acc, row.astype(wide))
    return acc.astype(x.dtype)


def run_case(comm, collective: str, info: TypeInfo, opname: str | None, count: int,
             in_place: bool, algorithm: str = "auto", *, arrays=NUMPY, seed: int = 0,
             timeout: float = 120.0, prepared: Prepared | None = None,
             deterministic: bool = False) -> CaseResult:
    """Run one collective through mpicoll and MPI's built-in; check everything. Collective.

    Checks: result equals the reference (exact, or within :func:`tolerance`),
    bitwise identical on every rank (AllReduce, AllGather), inputs unchanged,
    in-place ReduceScatter writes only the result part, Allgatherv leaves
    the gaps between blocks unchanged.

    Args:
        comm: intra-communicator (mpicoll's calls run on ``mpicoll.Comm(comm)``).
        collective: a key of :data:`COLLECTIVES`.
        info: element type.
        opname: predefined op name for reductions (None for gathers).
        count: size parameter: elements per rank (Allreduce: the whole array;
            Reduce_scatter_block/Allgather: per rank; Reduce_scatter/Allgatherv:
            :func:`uneven_counts` of it; reduce_scatter: total, split as numpy.array_split).
        in_place: use MPI.IN_PLACE (``out=x`` for the array functions).
        algorithm: forced algorithm name, or "auto".
        arrays: where mpicoll's buffers live (NumPy; CuPy for ``--device gpu``).
        seed: varies the input.
        timeout: seconds to wait for the other ranks before aborting the job.
        prepared: :func:`prepare_case` of the same arguments, to reuse.
        deterministic: run under ``mpicoll.options(deterministic=True)`` and also
            check a floating SUM/PROD bitwise against the rank-order fold
            ``((x0 op x1) op x2) ...`` in the accumulation type, rounded once.

    Returns:
        CaseResult, identical on every rank.
    """
    from ...api.comm import Comm
    _, api, reduces = COLLECTIVES[collective]
    rank = comm.Get_rank()
    size = comm.Get_size()
    problems: list[str] = []
    op = getattr(MPI, opname) if opname else None
    dtype = info.dtype
    check_identical = collective not in ("Reduce_scatter_block", "Reduce_scatter",
                                         "reduce_scatter")
    if prepared is None:
        prepared = prepare_case(comm, collective, info, opname, count, seed)
    x, want, counts = prepared.x, prepared.want, prepared.counts
    displs, initial, n = prepared.displs, prepared.initial, prepared.n

    # ---- run mpicoll --------------------------------------------------------
    got = None
    raised = 0
    import contextlib

    import mpicoll
    mode = mpicoll.options(deterministic=True) if deterministic else contextlib.nullcontext()
    try:
        mode.__enter__()
        xd = arrays.put(x)
        if api == "comm":
            c = Comm(comm, algorithm=algorithm)
            spec = info.spec
            if reduces:
                if in_place:
                    buf = xd
                    if collective == "Allreduce":
                        c.Allreduce(MPI.IN_PLACE, spec(buf), op)
                    elif collective == "Reduce_scatter_block":
                        c.Reduce_scatter_block(MPI.IN_PLACE, spec(buf), op)
                    else:
                        c.Reduce_scatter(MPI.IN_PLACE, spec(buf), counts, op)
                    host = arrays.get(buf)
                    got = host[:n]
                    if not same_values(host[n:], x[n:]):
                        problems.append("in place: elements outside the result were written")
                else:
                    out = arrays.empty(n, dtype)
                    if collective == "Allreduce":
                        c.Allreduce(spec(xd), spec(out), op)
                    elif collective == "Reduce_scatter_block":
                        c.Reduce_scatter_block(spec(xd), spec(out), op)
                    else:
                        c.Reduce_scatter(spec(xd), spec(out), counts, op)
                    got = arrays.get(out)
                    _unchanged("sendbuf", x, xd, arrays, problems)
            else:
                buf = arrays.put(initial)
                if in_place:
                    own = initial.copy()
                    own[displs[rank]:displs[rank] + counts[rank]] = x
                    buf = arrays.put(own)
                    send = MPI.IN_PLACE
                else:
                    send = spec(xd)
                if collective == "Allgather":
                    c.Allgather(send, spec(buf))
                else:
                    rspec = ([buf, counts, displs] if info.datatype is None
                             else [buf, counts, displs, info.datatype])
                    c.Allgatherv(send, rspec)
                got = arrays.get(buf)
                if not in_place:
                    _unchanged("sendbuf", x, xd, arrays, problems)
        else:
            if collective == "allreduce":
                res = mpicoll.allreduce(xd, op, comm=comm, out=xd if in_place else None,
                                        algorithm=algorithm)
                got = arrays.get(res)
            elif collective == "reduce_scatter":
                res = mpicoll.reduce_scatter(xd, op, comm=comm, out=xd if in_place else None,
                                             algorithm=algorithm)
                got = arrays.get(res)
                if in_place:
                    host = arrays.get(xd)
                    if not same_values(host[n:], x[n:]):
                        problems.append("in place: elements outside the result were written")
            else:
                kw = {} if collective == "allgather" else {"counts": counts}
                if in_place:
                    own = initial.copy()
                    own[displs[rank]:displs[rank] + counts[rank]] = x
                    buf = arrays.put(own)
                    res = mpicoll.allgather(buf, comm=comm, out=buf, algorithm=algorithm, **kw)
                else:
                    res = mpicoll.allgather(xd, comm=comm, algorithm=algorithm, **kw)
                got = arrays.get(res)
            if not in_place:
                _unchanged("x", x, xd, arrays, problems)
    except Exception as exc:  # reported, then agreed on below
        raised = 1
        tb = traceback.extract_tb(exc.__traceback__)
        where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
        problems.append(f"raised {type(exc).__name__}: {exc}{where}")

    finally:
        mode.__exit__(None, None, None)
    fold = None
    # complex PROD left out: NumPy's complex64 multiply gives different bits for the same
    # operands in arrays of different lengths (its SIMD loop versus the scalar one: seen
    # at 3 ranks, count 1), so no reference fold is unique (docs/numerics.md)
    if deterministic and reduces and (opname == "SUM" or (opname == "PROD" and
                                                          info.category == "floating")) and \
            info.category in ("floating", "complex"):
        fold = _rank_order_fold(comm, x, opname)
        lo = 0 if counts is None else sum(counts[:rank])
        fold = fold[lo:lo + n]

    # ---- checks (local), then one exchange of every rank's outcome ------------
    max_abs = max_rel = 0.0
    digest = 0
    if not raised and fold is not None and not same_values(got, fold):
        problems.append("deterministic: not bitwise the rank-order fold")
    if not raised:
        cmp = compare(got, want, opname, size)
        max_abs, max_rel = cmp.max_abs, cmp.max_rel
        if not cmp.ok:
            problems.append(
                f"{cmp.nbad} of {got.size} elements differ from {want.source} ({cmp.worst})")
        digest = _results.digest(got) if check_identical else 0
    floats = np.array([max_abs, max_rel], np.float64).view(np.int64)
    rows = _exchange(comm, [raised, len(problems), digest, *floats], timeout)
    any_raised = bool(rows[:, 0].any())
    identical = None
    if check_identical and not any_raised:
        identical = bool((rows[:, 2] == rows[0, 2]).all())
    all_problems = []
    if rows[:, 1].any():
        everyone = comm.allgather(problems)
        all_problems = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
    if identical is False:
        all_problems.append("results are not bitwise identical across ranks")
    fl = np.ascontiguousarray(rows[:, 3:5]).view(np.float64)
    return CaseResult(
        ok=not all_problems,
        max_abs=float(fl[:, 0].max()),
        max_rel=float(fl[:, 1].max()),
        identical=identical,
        problems=all_problems,
    )
