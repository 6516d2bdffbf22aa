"""Bad input: the stated exception, the argument named, before any message, buffers untouched.

Every rank passes the same bad input, so every rank must raise the same way
without entering the collective.  :func:`util.raises_everywhere` checks the
exception type and message on every rank, that mpicoll sent nothing and started
no collective (its channel is patched to refuse, its call counter must not
move), and that every buffer given is bitwise unchanged.  TypeError for a wrong
type, ValueError for a wrong value (as mpi4py and NumPy).

Two parts.  :data:`EXAMPLES`: hand-written cases, one per kind of mistake, the
readable examples.  :data:`CATALOGUE`: the exhaustive, counted sweep, every
entry point x every argument x every way to get it wrong, generated from tables:
the public entry points with good arguments (:data:`ARRAY_ENTRIES`,
:data:`COMM_ENTRIES`) and, per kind of argument, the bad values a user can pass
with the error each must give (``*_BAD`` tables, the op/type table of the MPI
standard, the options).  Its size is quoted in docs/reliability.md
(``python tests/api/test_bad_input.py`` prints it).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import pytest
from mpi4py import MPI
from support import util

import mpicoll
from mpicoll.core import types as _types
from mpicoll.engine import select as _select

# refused before any message: 1 rank (trivial path) and 2 (every case, min_size 2 included)
pytestmark = pytest.mark.ranks(1, 2)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COMM = mpicoll.Comm(WORLD)


class Case(NamedTuple):
    exc: type
    match: str                    # re.search'ed in the message
    build: Callable               # build(fx) -> (thunk, buffers)
    min_size: int = 1


def f64(n=4, extra=0):
    """n float64 values (rank-dependent), as a view into a buffer ``extra`` elements longer."""
    return (np.arange(n + extra, dtype=np.float64) + 10 * RANK)[:n]


def zeros(n, dtype=np.float64):
    return np.zeros(n, dtype=dtype)


def readonly(a):
    a.flags.writeable = False
    return a


def arrays_in(values):
    """Every NumPy array among ``values`` (also inside mpi4py message lists)."""
    out = []
    for v in values:
        if isinstance(v, np.ndarray):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += arrays_in(v)
    return out


def noncommutative_op():
    return MPI.Op.Create(lambda a, b, t: None, commute=False)


# ---------------------------------------------------------------------------------------
# Hand-written examples, one per kind of mistake
# ---------------------------------------------------------------------------------------
def example(exc, match, call, *makers, min_size=1):
    """``call(*buffers)`` must raise ``exc`` matching ``match``; ``makers`` make fresh buffers.

    The buffers must be bitwise unchanged afterwards.
    """
    return exc, match, call, makers, min_size


EXAMPLES = {
    # ---- wrong types --------------------------------------------------------
    "list as sendbuf": example(TypeError, r"sendbuf: expected a buffer.*got a list of int",
                               lambda y: COMM.Allreduce([1, 2, 3], y), f64),
    "list as recvbuf": example(TypeError, r"recvbuf: expected a buffer.*list of float",
                               lambda x: COMM.Allreduce(x, [0.0] * 4), f64),
    "str as sendbuf": example(TypeError, r"sendbuf: expected a buffer",
                              lambda y: COMM.Allreduce("abcd", y), f64),
    "int op": example(TypeError, r"op: expected an MPI\.Op, got int",
                      lambda x, y: COMM.Allreduce(x, y, 3), f64, f64),
    "str op (array)": example(TypeError, r"op: expected an MPI\.Op, got str",
                              lambda x: mpicoll.allreduce(x, "sum"), f64),
    "str comm (Comm)": example(TypeError, r"comm: expected an mpi4py\.MPI\.Intracomm, got str",
                               lambda: mpicoll.Comm("world")),
    "str comm (array)": example(TypeError, r"comm: expected .*Intracomm, got str",
                                lambda x: mpicoll.allgather(x, comm="world"), f64),
    "list as x": example(TypeError, r"x: expected an array, got list",
                         lambda: mpicoll.reduce_scatter([1.0, 2.0])),
    "list as out": example(TypeError, r"out: expected an array, got list",
                           lambda x: mpicoll.allreduce(x, out=[0.0] * 4), f64),
    "int algorithm": example(TypeError, r"algorithm: expected a str, got int",
                             lambda x: mpicoll.allreduce(x, algorithm=1), f64),
    "unknown typecode": example(TypeError, r"sendbuf: unknown typecode 'zz'",
                                lambda x, y: COMM.Allreduce([x, "zz"], y), f64, f64),
    "float count": example(TypeError, r"sendbuf: expected an integer count, got float",
                           lambda x, y: COMM.Allreduce([x, 2.0, MPI.DOUBLE], y), f64, f64),
    "object dtype": example(TypeError, r"x: expected an array of bool, integer, floating or complex.*object",
                            mpicoll.allreduce, lambda: np.array([1, "a"], dtype=object)),
    "big-endian dtype": example(TypeError, r"x: .*native byte order, got dtype >f8",
                                mpicoll.allreduce, lambda: f64().astype(">f8")),
    "recvcounts str": example(TypeError, r"recvcounts: expected a sequence of \d+ integers, got str",
                              lambda x, y: COMM.Reduce_scatter(x, y, "ab"), lambda: f64(SIZE), lambda: f64(1)),
    # ---- send and receive types differ ---------------------------------------
    "float64 into float32": example(TypeError, r"sendbuf holds float64, recvbuf holds float32",
                                    COMM.Allreduce, f64, lambda: np.zeros(4, np.float32)),
    "int32 into int64 (Allgather)": example(TypeError, r"sendbuf holds int32, recvbuf holds int64",
                                            COMM.Allgather, lambda: np.zeros(2, np.int32),
                                            lambda: np.zeros(2 * SIZE, np.int64)),
    "out dtype": example(TypeError, r"out: expected dtype float64 like x, got float32",
                         lambda x, o: mpicoll.allreduce(x, out=o), f64, lambda: np.zeros(4, np.float32)),
    # ---- counts ----------------------------------------------------------------
    "short recvbuf": example(ValueError, r"send count 4 and receive count 3",
                             COMM.Allreduce, f64, lambda: f64(3)),
    "negative count": example(ValueError, r"sendbuf: expected a non-negative count, got -1",
                              lambda x, y: COMM.Allreduce([x, -1, MPI.DOUBLE], y), f64, f64),
    "count beyond buffer": example(ValueError, r"sendbuf: count 9 at displacement 0 exceeds the buffer's 4",
                                   lambda x, y: COMM.Allreduce([x, 9, MPI.DOUBLE], y), f64, lambda: f64(9)),
    "recvcounts length": example(ValueError, rf"recvcounts: expected {SIZE} entries \(one per rank\), got {SIZE + 1}",
                                 lambda x, y: COMM.Reduce_scatter(x, y, [1] * (SIZE + 1)),
                                 lambda: f64(SIZE), lambda: f64(1)),
    "recvcounts negative": example(ValueError, r"recvcounts: expected a non-negative count, got -1",
                                   lambda x, y: COMM.Reduce_scatter(x, y, [-1] + [1] * (SIZE - 1)),
                                   lambda: f64(SIZE), lambda: f64(1)),
    "recvcounts sum": example(ValueError, rf"send count {SIZE + 1} and sum\(counts\) {SIZE}",
                              lambda x, y: COMM.Reduce_scatter(x, y, [1] * SIZE),
                              lambda: f64(SIZE + 1), lambda: f64(1)),
    "recvcount of this rank": example(ValueError, rf"receive count 2 and counts\[{RANK}\] 1",
                                      lambda x, y: COMM.Reduce_scatter(x, y, [1] * SIZE),
                                      lambda: f64(SIZE), lambda: f64(2)),
    "in-place Reduce_scatter without recvcounts": example(
        ValueError, r"recvcounts: expected one count per rank when sendbuf is MPI\.IN_PLACE, got None",
        lambda y: COMM.Reduce_scatter(MPI.IN_PLACE, y), lambda: f64(SIZE)),
    "Reduce_scatter_block sizes": example(ValueError, rf"send count 5 and receive count {2 * SIZE}"
                                          if SIZE in (1, 5) else r"sendbuf: holds 5 elements, not a multiple",
                                          COMM.Reduce_scatter_block, lambda: f64(5), lambda: f64(2)),
    "Allgather recvbuf size": example(ValueError, rf"send count 3 and receive count {2 * SIZE}",
                                      COMM.Allgather, lambda: f64(3), lambda: f64(2 * SIZE)),
    "Allgatherv counts one too many": example(
        ValueError, rf"recvbuf: expected {SIZE} entries \(one per rank\), got {SIZE + 1}",
        lambda x, y: COMM.Allgatherv(x, [y, [2] * (SIZE + 1)]), lambda: f64(2), lambda: f64(2 * SIZE)),
    "Allgatherv buffer too small": example(
        ValueError, rf"recvbuf: counts \[.*\] at displacements \[.*\] need {2 * SIZE} elements, "
                    rf"the buffer holds {2 * SIZE - 1}",
        lambda x, y: COMM.Allgatherv(x, [y, [2] * SIZE, [2 * r for r in range(SIZE)], MPI.DOUBLE]),
        lambda: f64(2), lambda: f64(2 * SIZE - 1)),
    "Allgatherv send count": example(
        ValueError, rf"send count 3 and receive count counts\[{RANK}\] 2",
        lambda x, y: COMM.Allgatherv(x, [y, [2] * SIZE, [2 * r for r in range(SIZE)], MPI.DOUBLE]),
        lambda: f64(3), lambda: f64(2 * SIZE)),
    "Allgatherv overlapping blocks": example(
        ValueError, r"recvbuf: expected displacements that give every rank its own region, got blocks that overlap",
        lambda x, y: COMM.Allgatherv(x, [y, [2] * SIZE, list(range(SIZE)), MPI.DOUBLE]),
        lambda: f64(2), lambda: f64(2 * SIZE), min_size=2),
    "array reduce_scatter counts sum": example(ValueError, rf"counts: expected a sum of {SIZE + 1} \(the rows of x\), got sum\(counts\) = {SIZE}",
                                               lambda x: mpicoll.reduce_scatter(x, counts=[1] * SIZE),
                                               lambda: f64(SIZE + 1)),
    "array allgather counts length": example(ValueError, rf"counts: expected {SIZE} entries",
                                             lambda x: mpicoll.allgather(x, counts=[4] * (SIZE + 1)), f64),
    "array reduce_scatter 0-d": example(ValueError, r"x: expected an array with at least one dimension",
                                        mpicoll.reduce_scatter, lambda: np.array(1.0)),
    "array in-place allgather rows": example(
        ValueError, rf"x: expected a row count divisible by {SIZE} ranks for an in-place allgather",
        lambda x: mpicoll.allgather(x, out=x), lambda: f64(2 * SIZE + 1), min_size=2),
    # ---- read-only and non-contiguous buffers --------------------------------
    "read-only recvbuf": example(ValueError, r"recvbuf: expected a writable buffer, got a read-only one",
                                 COMM.Allreduce, f64, lambda: readonly(f64())),
    "bytes recvbuf": example(ValueError, r"recvbuf: expected a writable buffer",
                             lambda x: COMM.Allreduce(x, bytes(4)), lambda: np.zeros(4, np.uint8)),
    "read-only in-place x": example(ValueError, r"out: expected a writable array",
                                    lambda x: mpicoll.allreduce(x, out=x), lambda: readonly(f64())),
    "read-only out": example(ValueError, r"out: expected a writable",
                             lambda x, o: mpicoll.allreduce(x, out=o), f64, lambda: readonly(f64())),
    "strided sendbuf": example(
        ValueError, r"sendbuf: expected a contiguous buffer, got a non-contiguous array with shape "
                    r"\(4,\) and strides \(16,\)",
        lambda x, y: COMM.Allreduce(x[::2], y), lambda: f64(8), f64),
    "strided recvbuf": example(ValueError, r"recvbuf: expected a contiguous buffer",
                               lambda x, y: COMM.Allreduce(x, y[::2]), f64, lambda: f64(8)),
    # ---- ops that do not apply ---------------------------------------------
    "BAND on float64": example(TypeError, r"op: MPI\.BAND does not apply to float64",
                               lambda x, y: COMM.Allreduce(x, y, MPI.BAND), f64, f64),
    "MAX on complex128": example(TypeError, r"op: MPI\.MAX does not apply to complex128",
                                 lambda x, y: COMM.Allreduce(x, y, MPI.MAX),
                                 lambda: f64().astype(complex), lambda: f64().astype(complex)),
    "SUM on bool": example(TypeError, r"op: MPI\.SUM does not apply to bool",
                           lambda x: mpicoll.allreduce(x, MPI.SUM), lambda: np.ones(4, bool)),
    "LAND on float32": example(TypeError, r"op: MPI\.LAND does not apply to float32",
                               lambda x: mpicoll.reduce_scatter(x, MPI.LAND), lambda: f64(SIZE).astype(np.float32)),
    "MINLOC on float64": example(TypeError, r"op: MPI\.MINLOC does not apply to float64",
                                 lambda x, y: COMM.Allreduce(x, y, MPI.MINLOC), f64, f64),
    "SUM on DOUBLE_INT": example(TypeError, r"op: MPI\.SUM does not apply to MPI\.DOUBLE_INT",
                                 lambda x, y: COMM.Allreduce([x, MPI.DOUBLE_INT], [y, MPI.DOUBLE_INT], MPI.SUM),
                                 lambda: np.zeros(32, np.uint8), lambda: np.zeros(32, np.uint8)),
    "BXOR on MPI.FLOAT": example(TypeError, r"op: MPI\.BXOR does not apply to MPI\.FLOAT",
                                 lambda x, y: COMM.Allreduce([x, MPI.FLOAT], [y, MPI.FLOAT], MPI.BXOR),
                                 lambda: np.zeros(4, np.float32), lambda: np.zeros(4, np.float32)),
    "MPI.REPLACE": example(ValueError, r"op: MPI\.REPLACE is only valid in one-sided",
                           lambda x, y: COMM.Allreduce(x, y, MPI.REPLACE), f64, f64),
    "MPI.NO_OP": example(ValueError, r"op: MPI\.NO_OP is only valid in one-sided",
                         lambda x: mpicoll.allreduce(x, MPI.NO_OP), f64),
    "MPI.OP_NULL": example(ValueError, r"op: expected a reduction operation, got MPI\.OP_NULL",
                           lambda x, y: COMM.Reduce_scatter_block(x, y, MPI.OP_NULL),
                           lambda: f64(SIZE), lambda: f64(1)),
    # ---- communicators -----------------------------------------------------
    "COMM_NULL (Comm)": example(ValueError, r"comm: expected a valid communicator, got MPI\.COMM_NULL",
                                lambda: mpicoll.Comm(MPI.COMM_NULL)),
    "COMM_NULL (array)": example(ValueError, r"comm: expected a valid communicator, got MPI\.COMM_NULL",
                                 lambda x: mpicoll.allreduce(x, comm=MPI.COMM_NULL), f64),
    # ---- overlapping buffers -----------------------------------------------
    "sendbuf is recvbuf": example(ValueError, r"sendbuf: expected memory apart from recvbuf \(or MPI\.IN_PLACE",
                                  lambda x: COMM.Allreduce(x, x), f64),
    "sendbuf overlaps recvbuf": example(ValueError, r"sendbuf: expected memory apart from recvbuf .*, got an overlap$",
                                        lambda b: COMM.Allreduce(b[:4], b[2:6]), lambda: f64(8)),
    "Allgather overlap": example(ValueError, r"sendbuf: expected memory apart from recvbuf .*, got an overlap$",
                                 lambda b: COMM.Allgather(b[:1], b[:SIZE]), lambda: f64(SIZE)),
    "Reduce_scatter overlap": example(ValueError, r"sendbuf: expected memory apart from recvbuf .*, got an overlap$",
                                      lambda b: COMM.Reduce_scatter(b, b[:1], [1] * SIZE), lambda: f64(SIZE)),
    "out overlaps x": example(ValueError, r"out: expected memory apart from x \(or out=x",
                              lambda b: mpicoll.allreduce(b[:4], out=b[1:5]), lambda: f64(8)),
    # ---- algorithm names ---------------------------------------------------
    "unknown algorithm": example(ValueError, r"algorithm: expected one of auto, .*ring.* for allreduce, got 'nope'",
                                 lambda x: mpicoll.allreduce(x, algorithm="nope"), f64),
    "unknown algorithm (Comm)": example(ValueError, r"algorithm: expected one of .*got 'nope'",
                                        lambda: mpicoll.Comm(WORLD, algorithm="nope")),
    "algorithm of another collective": example(
        ValueError, r"algorithm: expected one of auto.* for allgather, got 'rabenseifner'",
        lambda x: mpicoll.allgather(x, algorithm="rabenseifner"), f64),
    # ---- out ---------------------------------------------------------------
    "allreduce out shape": example(ValueError, r"out: expected shape \(4,\), got \(5,\)",
                                   lambda x, o: mpicoll.allreduce(x, out=o), f64, lambda: f64(5)),
    "allgather out shape": example(ValueError, rf"out: expected shape \({4 * SIZE},\), got \(3,\)",
                                   lambda x, o: mpicoll.allgather(x, out=o), f64, lambda: f64(3)),
    "reduce_scatter out shape": example(ValueError, r"out: expected shape \(1, 2\), got \(7, 2\)",
                                        lambda x, o: mpicoll.reduce_scatter(x, out=o),
                                        lambda: f64(2 * SIZE).reshape(SIZE, 2), lambda: f64(14).reshape(7, 2)),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_refused_before_any_message(name):
    exc, match, call, makers, min_size = EXAMPLES[name]
    if SIZE < min_size:
        pytest.skip(f"needs {min_size} ranks")
    buffers = [make() for make in makers]
    util.raises_everywhere(WORLD, exc, match, lambda: call(*buffers), *buffers)


def test_env_algorithm_unknown(monkeypatch):
    """MPICOLL_ALGORITHM with an unknown name: ValueError naming the variable, no message."""
    monkeypatch.setenv("MPICOLL_ALGORITHM", "bogus")  # read when a communicator is set up
    x = f64()
    comm = WORLD.Dup()
    try:
        util.raises_everywhere(WORLD, ValueError,
                                r"MPICOLL_ALGORITHM: expected one of .*got 'bogus'",
                                lambda: mpicoll.allreduce(x, comm=comm), x)
    finally:
        comm.Free()


def test_intercommunicator(fixtures):
    """An inter-communicator is the wrong kind of communicator: TypeError."""
    intercomm = fixtures.intercomm
    if intercomm is None:
        pytest.skip("needs 2 ranks")
    x = f64()
    util.raises_everywhere(WORLD, TypeError, r"comm: expected an intra-communicator, got an inter",
                            lambda: mpicoll.Comm(intercomm), x)
    util.raises_everywhere(WORLD, TypeError, r"comm: expected an intra-communicator, got an inter",
                            lambda: mpicoll.allreduce(x, comm=intercomm), x)


def test_communicator_usable_after_refusals():
    """After a refused call the next correct call works (nothing half-sent is pending)."""
    x = f64(3)
    y = np.empty(3)
    try:
        COMM.Allreduce(x, np.empty(2))
    except ValueError:
        pass
    COMM.Allreduce(x, y)
    want = sum(np.arange(3.0) + 10 * r for r in range(SIZE))
    util.assert_all(WORLD, np.array_equal(y, want), f"{y}")


# ---------------------------------------------------------------------------------------
# Entry points with good arguments (fresh on every call)
# ---------------------------------------------------------------------------------------
ARRAY_ENTRIES = {
    # name: (function, good keyword arguments, shape of the output)
    "allreduce": (mpicoll.allreduce, lambda: {"x": f64(8, 8)}, (8,)),
    "allgather": (mpicoll.allgather, lambda: {"x": f64(4, 4 * SIZE)}, (4 * SIZE,)),
    "reduce_scatter": (mpicoll.reduce_scatter, lambda: {"x": f64(2 * SIZE, 2)}, (2,)),
}
REDUCING = ("allreduce", "reduce_scatter")

COMM_ENTRIES = {
    "Allreduce": lambda: {"sendbuf": f64(8), "recvbuf": zeros(8)},
    "Allgather": lambda: {"sendbuf": f64(2), "recvbuf": zeros(2 * SIZE)},
    "Allgatherv": lambda: {"sendbuf": f64(2),
                           "recvbuf": [zeros(2 * SIZE), [2] * SIZE, [2 * r for r in range(SIZE)],
                                       MPI.DOUBLE]},
    "Reduce_scatter_block": lambda: {"sendbuf": f64(2 * SIZE), "recvbuf": zeros(2)},
    "Reduce_scatter": lambda: {"sendbuf": f64(2 * SIZE), "recvbuf": zeros(2),
                               "recvcounts": [2] * SIZE},
}
COMM_REDUCING = ("Allreduce", "Reduce_scatter_block", "Reduce_scatter")


def array_case(entry, arg, exc, match, bad, min_size=1):
    """Case: entry point ``entry`` with argument ``arg`` replaced by ``bad(kw, fx)``."""
    fn, good, _ = ARRAY_ENTRIES[entry]

    def build(fx):
        kw = good()
        kw[arg] = bad(kw, fx)
        x = kw.pop("x")
        return (lambda: fn(x, **kw)), arrays_in([x, *kw.values()])

    return Case(exc, match, build, min_size)


def comm_case(entry, arg, exc, match, bad, min_size=1, comm=None):
    """Case: ``mpicoll.Comm`` method ``entry`` with ``arg`` replaced by ``bad(kw, fx)``."""

    def build(fx):
        kw = COMM_ENTRIES[entry]()
        kw[arg] = bad(kw, fx)
        method = getattr(comm(fx) if comm else COMM, entry)
        return (lambda: method(**kw)), arrays_in(kw.values())

    return Case(exc, match, build, min_size)


def plain_case(exc, match, thunk, min_size=1):
    return Case(exc, match, lambda fx: (lambda: thunk(fx), []), min_size)


CATALOGUE: dict[str, Case] = {}


def add(name, case):
    assert name not in CATALOGUE, name
    CATALOGUE[name] = case


# ---------------------------------------------------------------------------------------
# Tables of bad values: (label, exception, message pattern, bad(kw, fx))
# ---------------------------------------------------------------------------------------
def _type_errors(arg, expected):
    """Python objects that are not buffers at all."""
    return [
        ("list", TypeError, rf"^{arg}: expected {expected}", lambda kw, fx: [1.0, 2.0]),
        ("tuple", TypeError, rf"^{arg}: expected {expected}", lambda kw, fx: (1.0, 2.0)),
        ("int", TypeError, rf"^{arg}: expected {expected}.*got int", lambda kw, fx: 3),
        ("float", TypeError, rf"^{arg}: expected {expected}.*got float", lambda kw, fx: 2.5),
        ("complex", TypeError, rf"^{arg}: expected {expected}.*got complex", lambda kw, fx: 1j),
        ("bool", TypeError, rf"^{arg}: expected {expected}.*got bool", lambda kw, fx: True),
        ("str", TypeError, rf"^{arg}: expected .*got str", lambda kw, fx: "abcd"),
        ("dict", TypeError, rf"^{arg}: expected .*got dict", lambda kw, fx: {}),
        ("object", TypeError, rf"^{arg}: expected .*got object", lambda kw, fx: object()),
    ]


_DTYPE_MSG = r"expected an array of bool, integer, floating or complex numbers in native byte order, got dtype"


def _dtype_errors(arg, n):
    return [
        ("object dtype", TypeError, rf"^{arg}: {_DTYPE_MSG} object",
         lambda kw, fx: np.array([1, "a"] * (n // 2), dtype=object)),
        ("str dtype", TypeError, rf"^{arg}: {_DTYPE_MSG} <U2", lambda kw, fx: np.array(["ab"] * n)),
        ("bytes dtype", TypeError, rf"^{arg}: {_DTYPE_MSG} \|S2", lambda kw, fx: np.array([b"ab"] * n)),
        ("datetime64", TypeError, rf"^{arg}: {_DTYPE_MSG} datetime64\[s\]",
         lambda kw, fx: np.arange(n).astype("M8[s]")),
        ("timedelta64", TypeError, rf"^{arg}: {_DTYPE_MSG} timedelta64\[s\]",
         lambda kw, fx: np.arange(n).astype("m8[s]")),
        ("structured", TypeError, rf"^{arg}: {_DTYPE_MSG} \[", lambda kw, fx: np.zeros(n, "i4,f8")),
        ("void", TypeError, rf"^{arg}: {_DTYPE_MSG} \|V8", lambda kw, fx: np.zeros(n, "V8")),
        ("big-endian float64", TypeError, rf"^{arg}: {_DTYPE_MSG} >f8",
         lambda kw, fx: f64(n).astype(">f8")),
        ("big-endian int32", TypeError, rf"^{arg}: {_DTYPE_MSG} >i4",
         lambda kw, fx: np.arange(n, dtype=">i4")),
    ]


# -- x of the array functions --------------------------------------------------------------
for entry, (_, good, _shape) in ARRAY_ENTRIES.items():
    n = len(good()["x"])
    for label, exc, match, bad in _type_errors("x", "an array"):
        add(f"{entry}: x {label}", array_case(entry, "x", exc, match, bad))
    add(f"{entry}: x None", array_case(entry, "x", TypeError, r"^x: expected an array, got NoneType",
                                       lambda kw, fx: None))
    for label, exc, match, bad in _dtype_errors("x", n):
        add(f"{entry}: x {label}", array_case(entry, "x", exc, match, bad))
    # any memory layout of x is valid (logical order): see tests/api/test_layouts.py

# -- out of the array functions -------------------------------------------------------------
for entry, (_, _good, shape) in ARRAY_ENTRIES.items():
    m = shape[0]
    for label, exc, match, bad in _type_errors("out", "an array"):
        add(f"{entry}: out {label}", array_case(entry, "out", exc, match, bad))
    for label, exc, match, bad in _dtype_errors("out", m):
        add(f"{entry}: out {label}", array_case(entry, "out", exc, match, bad))
    cases = [
        ("read-only", ValueError, r"^out: expected a writable buffer, got a read-only one",
         lambda kw, fx, m=m: readonly(zeros(m))),
        ("bytes", ValueError, r"^out: expected a writable buffer", lambda kw, fx, m=m: bytes(8 * m)),
        ("float32", TypeError, r"^out: expected dtype float64 like x, got float32",
         lambda kw, fx, m=m: zeros(m, np.float32)),
        ("int64", TypeError, r"^out: expected dtype float64 like x, got int64",
         lambda kw, fx, m=m: zeros(m, np.int64)),
        ("one element more", ValueError, rf"^out: expected shape \({m},\), got \({m + 1},\)",
         lambda kw, fx, m=m: zeros(m + 1)),
        ("one element less", ValueError, rf"^out: expected shape \({m},\), got \({m - 1},\)",
         lambda kw, fx, m=m: zeros(m - 1)),
        ("2-D", ValueError, rf"^out: expected shape \({m},\), got \({m}, 1\)",
         lambda kw, fx, m=m: zeros(m).reshape(m, 1)),
        ("overlaps x", ValueError, r"^out: expected memory apart from x \(or out=x",
         lambda kw, fx, m=m: kw["x"].base[1:1 + m]),
    ]
    for label, exc, match, bad in cases:
        add(f"{entry}: out {label}", array_case(entry, "out", exc, match, bad))
    rows = SIZE if entry == "allgather" else 1  # in place, x is the whole gathered array
    add(f"{entry}: in place on a read-only x", array_case(
        entry, "out", ValueError, rf"^out: expected a writable array for an in-place {entry}",
        lambda kw, fx, rows=rows: kw.__setitem__("x", readonly(f64(len(kw["x"]) * rows))) or kw["x"]))
add("allgather: in place with rows not divisible by the ranks", array_case(
    "allgather", "out", ValueError, rf"^x: expected a row count divisible by {SIZE} ranks for an in-place allgather",
    lambda kw, fx: kw.__setitem__("x", f64(2 * SIZE + 1)) or kw["x"], min_size=2))

# -- op ---------------------------------------------------------------------------------------
OP_BAD = [
    ("int", TypeError, r"^op: expected an MPI\.Op, got int", lambda kw, fx: 3),
    ("str", TypeError, r"^op: expected an MPI\.Op, got str", lambda kw, fx: "sum"),
    ("None", TypeError, r"^op: expected an MPI\.Op, got NoneType", lambda kw, fx: None),
    ("numpy ufunc", TypeError, r"^op: expected an MPI\.Op, got ufunc", lambda kw, fx: np.add),
    ("builtin function", TypeError, r"^op: expected an MPI\.Op, got builtin_function_or_method",
     lambda kw, fx: sum),
    ("MPI.OP_NULL", ValueError, r"^op: expected a reduction operation, got MPI\.OP_NULL",
     lambda kw, fx: MPI.OP_NULL),
    ("freed user-defined op", ValueError, r"^op: expected a reduction operation, got MPI\.OP_NULL",
     lambda kw, fx: fx.freed_op),
    ("MPI.REPLACE", ValueError, r"^op: MPI\.REPLACE is only valid in one-sided", lambda kw, fx: MPI.REPLACE),
    ("MPI.NO_OP", ValueError, r"^op: MPI\.NO_OP is only valid in one-sided", lambda kw, fx: MPI.NO_OP),
]
for entry in REDUCING:
    for label, exc, match, bad in OP_BAD:
        add(f"{entry}: op {label}", array_case(entry, "op", exc, match, bad))
for entry in COMM_REDUCING:
    for label, exc, match, bad in OP_BAD:
        add(f"Comm.{entry}: op {label}", comm_case(entry, "op", exc, match, bad))

# Ops on types they do not apply to (MPI-4.1 6.9.2), one sample type per category.
SAMPLE = {"integer": np.int32, "floating": np.float64, "complex": np.complex128, "logical": np.bool_}
PREDEFINED = [name for name in _types.OP_CATEGORIES]
for opname in PREDEFINED:
    for category, dtype in SAMPLE.items():
        if category in _types.OP_CATEGORIES[opname]:
            continue
        tname = np.dtype(dtype).name
        match = rf"^op: MPI\.{opname} does not apply to {tname}$"
        op = getattr(MPI, opname)
        for entry in REDUCING:
            add(f"{entry}: MPI.{opname} on {tname}", array_case(
                entry, "op", TypeError, match,
                lambda kw, fx, op=op, dtype=dtype: kw.__setitem__("x", kw["x"].astype(dtype)) or op))
        for entry in COMM_REDUCING:
            def bad_bufs(kw, fx, dtype=dtype):
                kw["sendbuf"] = kw["sendbuf"].astype(dtype)
                kw["recvbuf"] = kw["recvbuf"].astype(dtype)
                return None
            add(f"Comm.{entry}: MPI.{opname} on {tname}", comm_case(
                entry, "op", TypeError, match,
                lambda kw, fx, op=op, bad_bufs=bad_bufs: bad_bufs(kw, fx) or op))
    if "byte" not in _types.OP_CATEGORIES[opname]:
        op = getattr(MPI, opname)

        def byte_bufs(kw, fx, op=op):
            for k in ("sendbuf", "recvbuf"):
                kw[k] = [kw[k].view(np.uint8), MPI.BYTE]
            return op
        add(f"Comm.Allreduce: MPI.{opname} on MPI.BYTE", comm_case(
            "Allreduce", "op", TypeError, rf"^op: MPI\.{opname} does not apply to MPI\.BYTE$", byte_bufs))

for entry in REDUCING:
    add(f"{entry}: non-commutative op with algorithm='ring'", array_case(
        entry, "op", ValueError, r"^algorithm: 'ring' reorders operands and cannot run a non-commutative op",
        lambda kw, fx: kw.__setitem__("algorithm", "ring") or fx.noncommutative))
add("Comm(algorithm='ring').Allreduce: non-commutative op", comm_case(
    "Allreduce", "op", ValueError, r"^algorithm: 'ring' reorders operands",
    lambda kw, fx: fx.noncommutative, comm=lambda fx: mpicoll.Comm(WORLD, algorithm="ring")))

# -- comm -------------------------------------------------------------------------------------
COMM_BAD = [
    ("str", TypeError, r"^comm: expected an mpi4py\.MPI\.Intracomm, got str", lambda kw, fx: "world"),
    ("int", TypeError, r"^comm: expected an mpi4py\.MPI\.Intracomm, got int", lambda kw, fx: 0),
    ("MPI.Group", TypeError, r"^comm: expected an mpi4py\.MPI\.Intracomm, got Group",
     lambda kw, fx: fx.group),
    ("MPI.Info", TypeError, r"^comm: expected an mpi4py\.MPI\.Intracomm, got Info", lambda kw, fx: MPI.INFO_NULL),
    ("MPI.Datatype", TypeError, r"^comm: expected an mpi4py\.MPI\.Intracomm, got Datatype",
     lambda kw, fx: MPI.DOUBLE),
    ("plain MPI.Comm", TypeError, r"^comm: expected an mpi4py\.MPI\.Intracomm, got Comm",
     lambda kw, fx: MPI.Comm(WORLD)),
    ("MPI.COMM_NULL", ValueError, r"^comm: expected a valid communicator, got MPI\.COMM_NULL",
     lambda kw, fx: MPI.COMM_NULL),
    ("freed communicator", ValueError, r"^comm: expected a valid communicator, got MPI\.COMM_NULL",
     lambda kw, fx: fx.freed_comm),
    ("inter-communicator", TypeError, r"^comm: expected an intra-communicator, got an inter-communicator",
     lambda kw, fx: fx.intercomm),
]
for entry in ARRAY_ENTRIES:
    for label, exc, match, bad in COMM_BAD:
        add(f"{entry}: comm {label}", array_case(entry, "comm", exc, match, bad,
                                                 min_size=2 if label == "inter-communicator" else 1))
for label, exc, match, bad in COMM_BAD:
    add(f"mpicoll.Comm: comm {label}", plain_case(
        exc, match, lambda fx, bad=bad: mpicoll.Comm(bad({}, fx)),
        min_size=2 if label == "inter-communicator" else 1))
add("mpicoll.Comm: comm ndarray", plain_case(
    TypeError, r"^comm: expected an mpi4py\.MPI\.Intracomm, got ndarray", lambda fx: mpicoll.Comm(zeros(2))))

# -- counts of the array functions -----------------------------------------------------------
COUNTS_BAD = [
    ("str", TypeError, rf"^counts: expected a sequence of {SIZE} integers, got str", lambda kw, fx: "ab"),
    ("int", TypeError, rf"^counts: expected a sequence of {SIZE} integers, got int", lambda kw, fx: 4),
    ("None entries", TypeError, r"^counts: expected an integer count, got NoneType",
     lambda kw, fx: [None] * SIZE),
    ("float entries", TypeError, r"^counts: expected an integer count, got float",
     lambda kw, fx: [2.0] * SIZE),
    ("bool entries", TypeError, r"^counts: expected an integer count, got bool", lambda kw, fx: [True] * SIZE),
    ("float64 array", TypeError, r"^counts: expected an integer count, got float64",
     lambda kw, fx: np.full(SIZE, 2.0)),
    ("one entry more", ValueError, rf"^counts: expected {SIZE} entries \(one per rank\), got {SIZE + 1}",
     lambda kw, fx: [1] * (SIZE + 1)),
    ("one entry less", ValueError, rf"^counts: expected {SIZE} entries \(one per rank\), got {SIZE - 1}",
     lambda kw, fx: [1] * (SIZE - 1)),
    ("negative entry", ValueError, r"^counts: expected a non-negative count, got -1",
     lambda kw, fx: [-1] * SIZE),
]
for entry in ("allgather", "reduce_scatter"):
    for label, exc, match, bad in COUNTS_BAD:
        add(f"{entry}: counts {label}", array_case(entry, "counts", exc, match, bad))
add("reduce_scatter: counts sum below the rows", array_case(
    "reduce_scatter", "counts", ValueError, rf"^counts: expected a sum of {2 * SIZE} \(the rows of x\), got sum\(counts\) = {SIZE}$",
    lambda kw, fx: [1] * SIZE))
add("reduce_scatter: counts sum above the rows", array_case(
    "reduce_scatter", "counts", ValueError, rf"^counts: expected a sum of {2 * SIZE} \(the rows of x\), got sum\(counts\) = {3 * SIZE}$",
    lambda kw, fx: [3] * SIZE))
add("allgather: counts[rank] is not the rows of x", array_case(
    "allgather", "counts", ValueError, rf"^counts: expected counts\[{RANK}\] = 4 \(the rows of x\), got 5$",
    lambda kw, fx: [5] * SIZE))
add("reduce_scatter: 0-d x", array_case(
    "reduce_scatter", "x", ValueError, r"^x: expected an array with at least one dimension, got a 0-d array",
    lambda kw, fx: np.array(1.0)))

# -- algorithm ----------------------------------------------------------------------------------
for entry in ARRAY_ENTRIES:
    other = sorted({a for t in _select.ALGORITHMS.values() for a in t} - set(_select.ALGORITHMS[entry]))
    bad_algos = [
        ("int", TypeError, r"^algorithm: expected a str, got int", lambda kw, fx: 1),
        ("None", TypeError, r"^algorithm: expected a str, got NoneType", lambda kw, fx: None),
        ("bytes", TypeError, r"^algorithm: expected a str, got bytes", lambda kw, fx: b"ring"),
        ("unknown name", ValueError, rf"^algorithm: expected one of auto, .* for {entry}, got 'nope'",
         lambda kw, fx: "nope"),
        ("wrong case", ValueError, rf"^algorithm: expected one of auto, .* for {entry}, got 'Ring'",
         lambda kw, fx: "Ring"),
        ("empty", ValueError, rf"^algorithm: expected one of auto, .* for {entry}, got ''", lambda kw, fx: ""),
    ]
    if other:
        bad_algos.append(("another collective's algorithm", ValueError,
                          rf"^algorithm: expected one of auto, .* for {entry}, got '{other[0]}'",
                          lambda kw, fx, a=other[0]: a))
    for label, exc, match, bad in bad_algos:
        add(f"{entry}: algorithm {label}", array_case(entry, "algorithm", exc, match, bad))
for label, exc, match, value in [("int", TypeError, r"^algorithm: expected a str, got int", 3),
                                 ("unknown name", ValueError, r"^algorithm: expected one of .*got 'nope'", "nope")]:
    add(f"mpicoll.Comm: algorithm {label}", plain_case(
        exc, match, lambda fx, value=value: mpicoll.Comm(WORLD, algorithm=value)))

# -- timeout -----------------------------------------------------------------------------------
TIMEOUT_BAD = [
    ("zero", ValueError, r"^timeout: expected a positive number of seconds, got 0", 0),
    ("negative", ValueError, r"^timeout: expected a positive number of seconds, got -1", -1.0),
    ("nan", ValueError, r"^timeout: expected a positive number of seconds, got nan", float("nan")),
    ("str", TypeError, r"^timeout: expected a number of seconds or None, got str", "1"),
    ("bool", TypeError, r"^timeout: expected a number of seconds or None, got bool", True),
    ("complex", TypeError, r"^timeout: expected a number of seconds or None, got complex", 1j),
]
for entry in ARRAY_ENTRIES:
    for label, exc, match, value in TIMEOUT_BAD:
        add(f"{entry}: timeout {label}", array_case(entry, "timeout", exc, match,
                                                    lambda kw, fx, value=value: value))

# -- buffer arguments of mpicoll.Comm ------------------------------------------------------
def _spec_errors(arg):
    """Bad mpi4py message specs; ``kw[arg]`` is a float64 array of the right size."""
    return [
        ("unknown typecode", TypeError, rf"^{arg}: unknown typecode 'zz'", lambda kw, fx: [kw[arg], "zz"]),
        ("typecode of a non-numeric MPI type", TypeError,
         r"^datatype: expected a predefined numeric MPI datatype, got MPI\.CHAR",
         lambda kw, fx: [kw[arg], "c"]),
        ("count and no datatype, beyond the buffer", ValueError,
         rf"^{arg}: count 1000000 at displacement 0 exceeds the buffer's \d+ elements",
         lambda kw, fx: [kw[arg], 10 ** 6]),
        ("MPI.DATATYPE_NULL", TypeError, r"^datatype: expected an MPI datatype, got MPI\.DATATYPE_NULL",
         lambda kw, fx: [kw[arg], MPI.DATATYPE_NULL]),
        # (a derived datatype runs, api.derived: this one does not divide the buffer)
        ("derived datatype", ValueError,
         rf"^{arg}: buffer length 24 is not a multiple of datatype extent 16",
         lambda kw, fx: [zeros(3), fx.derived]),
        ("float count", TypeError, rf"^{arg}: expected an integer count, got float",
         lambda kw, fx: [kw[arg], 2.0, MPI.DOUBLE]),
        ("bool count", TypeError, rf"^{arg}: expected an integer count, got bool",
         lambda kw, fx: [kw[arg], True, MPI.DOUBLE]),
        ("negative count", ValueError, rf"^{arg}: expected a non-negative count, got -1",
         lambda kw, fx: [kw[arg], -1, MPI.DOUBLE]),
        ("count beyond the buffer", ValueError,
         rf"^{arg}: count 1000 at displacement 0 exceeds the buffer's \d+ elements",
         lambda kw, fx: [kw[arg], 1000, MPI.DOUBLE]),
        ("displacement beyond the buffer", ValueError, rf"^{arg}: count 1 at displacement 1000 exceeds",
         lambda kw, fx: [kw[arg], (1, 1000), MPI.DOUBLE]),
        ("negative displacement", ValueError, rf"^{arg}: expected a non-negative displacement, got -1",
         lambda kw, fx: [kw[arg], (1, -1), MPI.DOUBLE]),
        ("(count,) without displacement", ValueError, rf"^{arg}: expected \(count, displ\), got 1 items",
         lambda kw, fx: [kw[arg], (1,), MPI.DOUBLE]),
        ("(count, displ, extra)", ValueError, rf"^{arg}: expected \(count, displ\), got 3 items",
         lambda kw, fx: [kw[arg], (1, 0, 0), MPI.DOUBLE]),
        ("empty list", ValueError, rf"^{arg}: expected a buffer or a list/tuple of 2 to 4 items .*got 0 item",
         lambda kw, fx: []),
        ("five items", ValueError, rf"^{arg}: expected a buffer or a list/tuple of 2 to 4 items .*got 5 item",
         lambda kw, fx: [kw[arg], 1, 2, 3, MPI.DOUBLE]),
        ("length not a multiple of the datatype", ValueError,
         rf"^{arg}: buffer length 7 is not a multiple of datatype extent 8",
         lambda kw, fx: [zeros(7, np.uint8), MPI.DOUBLE]),
        ("[None, datatype] with a count", ValueError, rf"^{arg}: got no data but a count of 3",
         lambda kw, fx: [None, 3, MPI.DOUBLE]),
        ("[None, None] without datatype", TypeError,
         rf"^{arg}: an empty message \[None, datatype\] needs a datatype",
         lambda kw, fx: [None, None]),
        ("strided", ValueError, rf"^{arg}: expected a contiguous buffer", lambda kw, fx: zeros(4 * SIZE)[::2]),
        ("strided in a message", ValueError, rf"^{arg}: expected a contiguous buffer",
         lambda kw, fx: [zeros(4 * SIZE)[::2], MPI.DOUBLE]),
        ("object dtype", TypeError, rf"^{arg}: {_DTYPE_MSG} object",
         lambda kw, fx: np.array([None] * len(kw[arg]), dtype=object)),
        ("big-endian", TypeError, rf"^{arg}: {_DTYPE_MSG} >f8", lambda kw, fx: kw[arg].astype(">f8")),
        ("MPI.BOTTOM", ValueError, rf"^{arg}: expected a buffer, got MPI\.BOTTOM", lambda kw, fx: MPI.BOTTOM),
        ("list of numbers", TypeError, rf"^{arg}: expected a buffer or a \[buffer, \.\.\.\] message, got a list of float",
         lambda kw, fx: [1.0] * 4),
        ("int", TypeError, rf"^{arg}: expected a buffer .*got int", lambda kw, fx: 5),
        ("str", TypeError, rf"^{arg}: expected a buffer .*got str", lambda kw, fx: "abcd"),
    ]


for entry in COMM_ENTRIES:
    for label, exc, match, bad in _spec_errors("sendbuf"):
        add(f"Comm.{entry}: sendbuf {label}", comm_case(entry, "sendbuf", exc, match, bad))
    add(f"Comm.{entry}: sendbuf float32, recvbuf float64", comm_case(
        entry, "sendbuf", TypeError,
        r"^mismatch in send and receive MPI datatypes: sendbuf holds float32, recvbuf holds (float64|MPI\.DOUBLE)$",
        lambda kw, fx: kw["sendbuf"].astype(np.float32)))
    if entry in ("Reduce_scatter_block", "Reduce_scatter"):  # recvbuf is the smaller one
        add(f"Comm.{entry}: recvbuf inside sendbuf", comm_case(
            entry, "recvbuf", ValueError, r"^sendbuf: expected memory apart from recvbuf \(or MPI\.IN_PLACE",
            lambda kw, fx: kw["sendbuf"][:2]))
    else:
        add(f"Comm.{entry}: sendbuf inside recvbuf", comm_case(
            entry, "sendbuf", ValueError, r"^sendbuf: expected memory apart from recvbuf \(or MPI\.IN_PLACE",
            lambda kw, fx: (kw["recvbuf"][0] if isinstance(kw["recvbuf"], list) else kw["recvbuf"])[
                : len(kw["sendbuf"])]))
    if entry != "Allgatherv":
        for label, exc, match, bad in _spec_errors("recvbuf"):
            add(f"Comm.{entry}: recvbuf {label}", comm_case(entry, "recvbuf", exc, match, bad))
        add(f"Comm.{entry}: recvbuf read-only", comm_case(
            entry, "recvbuf", ValueError, r"^recvbuf: expected a writable buffer, got a read-only one",
            lambda kw, fx: readonly(kw["recvbuf"].copy())))
        add(f"Comm.{entry}: recvbuf bytes", comm_case(
            entry, "recvbuf", ValueError, r"^recvbuf: expected a writable buffer",
            lambda kw, fx: bytes(kw["recvbuf"].nbytes)))
        add(f"Comm.{entry}: recvbuf MPI.IN_PLACE", comm_case(
            entry, "recvbuf", ValueError, r"^recvbuf: expected a buffer, got MPI\.IN_PLACE",
            lambda kw, fx: MPI.IN_PLACE))
        add(f"Comm.{entry}: recvbuf None", comm_case(
            entry, "recvbuf", TypeError, r"^recvbuf: expected a buffer .*got NoneType",
            lambda kw, fx: None))

# sizes that do not fit
add("Comm.Allreduce: recvbuf one element short", comm_case(
    "Allreduce", "recvbuf", ValueError, r"^mismatch in send count 8 and receive count 7",
    lambda kw, fx: zeros(7)))
add("Comm.Allreduce: recvbuf one element long", comm_case(
    "Allreduce", "recvbuf", ValueError, r"^mismatch in send count 8 and receive count 9",
    lambda kw, fx: zeros(9)))
add("Comm.Allgather: sendbuf one element long", comm_case(
    "Allgather", "sendbuf", ValueError, rf"^mismatch in send count 3 and receive count {2 * SIZE}",
    lambda kw, fx: f64(3)))
add("Comm.Allgather: recvbuf not a multiple of the ranks", comm_case(
    "Allgather", "recvbuf", ValueError, rf"^recvbuf: holds {2 * SIZE + 1} elements, not a multiple of the {SIZE} ranks",
    lambda kw, fx: zeros(2 * SIZE + 1), min_size=2))
add("Comm.Reduce_scatter_block: sendbuf one element short", comm_case(
    "Reduce_scatter_block", "sendbuf", ValueError,
    rf"^sendbuf: holds {2 * SIZE - 1} elements, not a multiple of the {SIZE} ranks",
    lambda kw, fx: f64(2 * SIZE - 1), min_size=2))
add("Comm.Reduce_scatter_block: in place, recvbuf not a multiple of the ranks", comm_case(
    "Reduce_scatter_block", "recvbuf", ValueError, rf"^recvbuf: holds {2 * SIZE + 1} elements, not a multiple",
    lambda kw, fx: kw.__setitem__("sendbuf", MPI.IN_PLACE) or zeros(2 * SIZE + 1), min_size=2))
# Allgatherv's vector recvbuf
ALLGATHERV_BAD = [
    ("displs one entry long", ValueError, rf"^recvbuf: expected {SIZE} entries \(one per rank\), got {SIZE + 1}",
     lambda kw, fx: [zeros(2 * SIZE + 2), [2] * SIZE, [2 * r for r in range(SIZE + 1)], MPI.DOUBLE]),
    ("counts one entry long", ValueError, rf"^recvbuf: expected {SIZE} entries \(one per rank\), got {SIZE + 1}",
     lambda kw, fx: [zeros(2 * SIZE + 2), [2] * (SIZE + 1), [2 * r for r in range(SIZE + 1)], MPI.DOUBLE]),
    ("negative count", ValueError, r"^recvbuf: expected a non-negative count, got -1",
     lambda kw, fx: [zeros(2 * SIZE), [-1] * SIZE, [0] * SIZE, MPI.DOUBLE]),
    ("float displacement", TypeError, r"^recvbuf: expected an integer displacement, got float",
     lambda kw, fx: [zeros(2 * SIZE), [2] * SIZE, [0.0] * SIZE, MPI.DOUBLE]),
    ("buffer too small", ValueError,
     rf"^recvbuf: counts \[.*\] at displacements \[.*\] need {2 * SIZE} elements, "
     rf"the buffer holds {2 * SIZE - 1}",
     lambda kw, fx: [zeros(2 * SIZE - 1), [2] * SIZE, [2 * r for r in range(SIZE)], MPI.DOUBLE]),
    ("send count is not counts[rank]", ValueError, rf"^mismatch in send count 2 and receive count counts\[{RANK}\] 3",
     lambda kw, fx: [zeros(3 * SIZE), [3] * SIZE, [3 * r for r in range(SIZE)], MPI.DOUBLE]),
    ("read-only", ValueError, r"^recvbuf: expected a writable buffer",
     lambda kw, fx: [readonly(zeros(2 * SIZE)), [2] * SIZE, [2 * r for r in range(SIZE)], MPI.DOUBLE]),
]
for label, exc, match, bad in ALLGATHERV_BAD:
    add(f"Comm.Allgatherv: recvbuf {label}", comm_case("Allgatherv", "recvbuf", exc, match, bad))
add("Comm.Allgatherv: recvbuf blocks overlap", comm_case(
    "Allgatherv", "recvbuf", ValueError, r"^recvbuf: expected displacements that give every rank its own region, got blocks that overlap",
    lambda kw, fx: [zeros(2 * SIZE), [2] * SIZE, list(range(SIZE)), MPI.DOUBLE], min_size=2))
# Reduce_scatter's recvcounts
for label, exc, match, bad in COUNTS_BAD:
    add(f"Comm.Reduce_scatter: recvcounts {label}", comm_case(
        "Reduce_scatter", "recvcounts", exc, match.replace("counts:", "recvcounts:"), bad))
add("Comm.Reduce_scatter: recvcounts sum is not the send count", comm_case(
    "Reduce_scatter", "recvcounts", ValueError, rf"^mismatch in send count {2 * SIZE} and sum\(counts\) {SIZE}",
    lambda kw, fx: [1] * SIZE))
add("Comm.Reduce_scatter: recvcounts[rank] is not the receive count", comm_case(
    "Reduce_scatter", "recvcounts", ValueError, rf"^mismatch in receive count 2 and counts\[{RANK}\] 1",
    lambda kw, fx: kw.__setitem__("sendbuf", f64(SIZE)) or [1] * SIZE))
add("Comm.Reduce_scatter: in place without recvcounts", comm_case(
    "Reduce_scatter", "recvcounts", ValueError, r"^recvcounts: expected one count per rank when sendbuf is MPI\.IN_PLACE, got None$",
    lambda kw, fx: kw.__setitem__("sendbuf", MPI.IN_PLACE) or None))

# -- options, environment, observers --------------------------------------------------------
OPTION_BAD = [
    ("check str", TypeError, r"^check: expected a bool or None, got str", {"check": "yes"}),
    ("check int", TypeError, r"^check: expected a bool or None, got int", {"check": 1}),
    ("cuda_aware str", TypeError, r"^cuda_aware: expected a bool or None, got str", {"cuda_aware": "on"}),
    ("timeout zero", ValueError, r"^timeout: expected a positive number of seconds, got 0", {"timeout": 0}),
    ("timeout str", TypeError, r"^timeout: expected a number of seconds or None, got str", {"timeout": "5"}),
    ("unknown option", TypeError, r"^configure: unknown option 'chek'; expected one of check, timeout",
     {"chek": True}),
]
for label, exc, match, kwargs in OPTION_BAD:
    add(f"configure: {label}", plain_case(exc, match, lambda fx, kw=kwargs: mpicoll.configure(**kw)))
    add(f"options: {label}", plain_case(
        exc, match, lambda fx, kw=kwargs: mpicoll.options(**kw).__enter__()))
ENV_BAD = [
    ("MPICOLL_CHECK", "maybe", r"^MPICOLL_CHECK: expected 1/0, yes/no, true/false or on/off, got 'maybe'"),
    ("MPICOLL_TIMEOUT", "soon", r"^MPICOLL_TIMEOUT: expected a number of seconds, got 'soon'"),
    ("MPICOLL_TIMEOUT", "-3", r"^MPICOLL_TIMEOUT: expected a positive number of seconds, got '-3'"),
    ("MPICOLL_TIMEOUT", "0", r"^MPICOLL_TIMEOUT: expected a positive number of seconds, got '0'"),
    ("MPICOLL_ALGORITHM", "bogus", r"^MPICOLL_ALGORITHM: expected one of .*got 'bogus'"),
]


def env_case(entry, var, value, match):
    """Case: a bad environment variable, read when a communicator is set up (its first
    collective), here a new one."""
    fn, good, _ = ARRAY_ENTRIES[entry]

    def build(fx):
        fx.setenv(var, value)
        kw = good()
        kw["comm"] = fx.fresh()
        x = kw.pop("x")
        return (lambda: fn(x, **kw)), [x]

    return Case(ValueError, match, build)


for var, value, match in ENV_BAD:
    for entry in ARRAY_ENTRIES:
        add(f"{entry}: {var}={value}", env_case(entry, var, value, match))
add("trace: path int", plain_case(TypeError, r"^path: expected a str or None, got int",
                                  lambda fx: mpicoll.trace(3)))
add("trace: path in a missing folder", plain_case(
    ValueError, r"^path: expected a file this rank can write, got 'no-such-folder/t\.json': "
                r"no directory .*no-such-folder$",
    lambda fx: mpicoll.trace("no-such-folder/t.json")))
add("trace: path a folder", plain_case(
    ValueError, r"^path: expected a file this rank can write, got '\.': is a directory$",
    lambda fx: mpicoll.trace(".")))
add("trace: comm str", plain_case(TypeError, r"^comm: expected an mpi4py\.MPI\.Intracomm, got str",
                                  lambda fx: mpicoll.trace(comm="x")))
add("trace: comm COMM_NULL", plain_case(
    ValueError, r"^comm: expected a valid communicator, got MPI\.COMM_NULL",
    lambda fx: mpicoll.trace(comm=MPI.COMM_NULL)))
HANDLES = r"mpicoll\.Handle, mpicoll\.Request or mpi4py\.MPI\.Request"
REQUESTS = r"mpicoll\.Request or mpi4py\.MPI\.Request"
ITEMS_BAD = [
    ("waitall: None", rf"^handles\[0\]: expected an {HANDLES}, got NoneType$",
     lambda: mpicoll.waitall([None])),
    ("testall: str", rf"^handles\[0\]: expected an {HANDLES}, got str$",
     lambda: mpicoll.testall(["x"])),
    ("waitall: int after a null request", rf"^handles\[1\]: expected an {HANDLES}, got int$",
     lambda: mpicoll.waitall([MPI.REQUEST_NULL, 3])),
    ("waitall: not a sequence", r"^handles: expected a sequence of handles, got NoneType$",
     lambda: mpicoll.waitall(None)),
    ("Request.Waitall: object", rf"^requests\[0\]: expected an {REQUESTS}, got object$",
     lambda: mpicoll.Request.Waitall([object()])),
    ("Request.Testall: int", rf"^requests\[0\]: expected an {REQUESTS}, got int$",
     lambda: mpicoll.Request.Testall([1])),
    ("Request.Testall: not a sequence", r"^requests: expected a sequence of requests, got int$",
     lambda: mpicoll.Request.Testall(1)),
]
for label, match, call in ITEMS_BAD:
    add(label, plain_case(TypeError, match, lambda fx, call=call: call()))
add("abort: comm str", plain_case(TypeError, r"^comm: expected an mpi4py\.MPI\.Comm, got str",
                                  lambda fx: mpicoll.abort("world")))
add("abort: errorcode float", plain_case(TypeError, r"^errorcode: expected an int, got float",
                                         lambda fx: mpicoll.abort(errorcode=1.0)))
add("abort: errorcode str", plain_case(TypeError, r"^errorcode: expected an int, got str",
                                       lambda fx: mpicoll.abort(errorcode="1")))


# ---------------------------------------------------------------------------------------
# The test
# ---------------------------------------------------------------------------------------
class Fixtures:
    """MPI objects some cases need (created collectively, once)."""

    def __init__(self, monkeypatch=None):
        self.monkeypatch = monkeypatch
        self.group = WORLD.Get_group()
        self.derived = MPI.DOUBLE.Create_contiguous(2).Commit()
        self.noncommutative = noncommutative_op()
        self.freed_op = noncommutative_op()
        self.freed_op.Free()
        self.freed_comm = WORLD.Dup()
        self.freed_comm.Free()
        self.intercomm = self.local = None
        self.comms = []
        if SIZE >= 2:
            self.local = WORLD.Split(RANK % 2, RANK)
            self.intercomm = self.local.Create_intercomm(0, WORLD, 1 - RANK % 2, tag=11)

    def setenv(self, name, value):
        self.monkeypatch.setenv(name, value)

    def fresh(self):
        """A new communicator (not set up by mpicoll yet), freed with the fixtures."""
        comm = WORLD.Dup()
        self.comms.append(comm)
        return comm

    def free(self):
        for comm in self.comms:
            comm.Free()
        self.group.Free()
        self.derived.Free()
        self.noncommutative.Free()
        if self.intercomm is not None:
            self.intercomm.Free()
            self.local.Free()


@pytest.fixture(scope="module")
def fixtures():
    fx = Fixtures()
    yield fx
    fx.free()


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_bad_input(name, fixtures, monkeypatch):
    case = CATALOGUE[name]
    if SIZE < case.min_size:
        pytest.skip(f"needs {case.min_size} ranks")
    fixtures.monkeypatch = monkeypatch
    for var in ("MPICOLL_CHECK", "MPICOLL_TIMEOUT", "MPICOLL_ALGORITHM"):
        monkeypatch.delenv(var, raising=False)
    thunk, buffers = case.build(fixtures)
    util.raises_everywhere(WORLD, case.exc, case.match, thunk, *buffers)


def test_communicator_works_after_the_catalogue(fixtures):
    x = f64(5)
    y = mpicoll.allreduce(x)
    want = np.empty(5)
    WORLD.Allreduce(x, want)
    util.assert_all(WORLD, np.array_equal(y, want), "allreduce after the bad inputs is wrong")


if __name__ == "__main__":
    need2 = sum(1 for c in CATALOGUE.values() if c.min_size > 1)
    print(f"{len(CATALOGUE)} cases ({need2} need 2 or more ranks)")
