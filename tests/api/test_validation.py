"""Bad arguments: the stated exception, the argument named, before any message, buffers untouched.

Every rank passes the same bad arguments, so every rank must raise the same
way without entering the collective.  :func:`util.raises_everywhere` checks
the type and message on every rank, that mpicoll sent nothing and started no
collective (its channel is patched to refuse, its call counter must not
move), and that every buffer given is bitwise unchanged.

TypeError for a wrong type, ValueError for a wrong value (as mpi4py and NumPy).
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from support import util

import mpicoll

# refused before any message: 1 rank (trivial path) and 2 (cases that need a peer)
pytestmark = pytest.mark.ranks(1, 2)

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
COMM = mpicoll.Comm(WORLD)


def f64(n=4):
    return np.arange(n, dtype=np.float64) + 10 * RANK


def readonly(a):
    a.flags.writeable = False
    return a


def case(exc, match, call, *makers, min_size=1):
    """``call(*buffers)`` must raise ``exc`` matching ``match``; ``makers`` make fresh buffers.

    The buffers must be bitwise unchanged afterwards.
    """
    return exc, match, call, makers, min_size


CASES = {
    # ---- wrong types --------------------------------------------------------
    "list as sendbuf": case(TypeError, r"sendbuf: expected a buffer.*got a list of int",
                            lambda y: COMM.Allreduce([1, 2, 3], y), f64),
    "list as recvbuf": case(TypeError, r"recvbuf: expected a buffer.*list of float",
                            lambda x: COMM.Allreduce(x, [0.0] * 4), f64),
    "str as sendbuf": case(TypeError, r"sendbuf: expected a buffer",
                           lambda y: COMM.Allreduce("abcd", y), f64),
    "int op": case(TypeError, r"op: expected an MPI\.Op, got int",
                   lambda x, y: COMM.Allreduce(x, y, 3), f64, f64),
    "str op (array)": case(TypeError, r"op: expected an MPI\.Op, got str",
                           lambda x: mpicoll.allreduce(x, "sum"), f64),
    "str comm (Comm)": case(TypeError, r"comm: expected an mpi4py\.MPI\.Intracomm, got str",
                            lambda: mpicoll.Comm("world")),
    "str comm (array)": case(TypeError, r"comm: expected .*Intracomm, got str",
                             lambda x: mpicoll.allgather(x, comm="world"), f64),
    "list as x": case(TypeError, r"x: expected an array, got list",
                      lambda: mpicoll.reduce_scatter([1.0, 2.0])),
    "list as out": case(TypeError, r"out: expected an array, got list",
                        lambda x: mpicoll.allreduce(x, out=[0.0] * 4), f64),
    "int algorithm": case(TypeError, r"algorithm: expected a str, got int",
                          lambda x: mpicoll.allreduce(x, algorithm=1), f64),
    "unknown typecode": case(TypeError, r"sendbuf: unknown typecode 'zz'",
                             lambda x, y: COMM.Allreduce([x, "zz"], y), f64, f64),
    "float count": case(TypeError, r"sendbuf: expected an integer count, got float",
                        lambda x, y: COMM.Allreduce([x, 2.0, MPI.DOUBLE], y), f64, f64),
    "object dtype": case(TypeError, r"x: expected an array of bool, integer, floating or complex.*object",
                         mpicoll.allreduce, lambda: np.array([1, "a"], dtype=object)),
    "big-endian dtype": case(TypeError, r"x: .*native byte order, got dtype >f8",
                             mpicoll.allreduce, lambda: f64().astype(">f8")),
    "recvcounts str": case(TypeError, r"recvcounts: expected a sequence of \d+ integers, got str",
                           lambda x, y: COMM.Reduce_scatter(x, y, "ab"), lambda: f64(SIZE), lambda: f64(1)),
    # ---- send and receive types differ ---------------------------------------
    "float64 into float32": case(TypeError, r"sendbuf holds float64, recvbuf holds float32",
                                 COMM.Allreduce, f64, lambda: np.zeros(4, np.float32)),
    "int32 into int64 (Allgather)": case(TypeError, r"sendbuf holds int32, recvbuf holds int64",
                                         COMM.Allgather, lambda: np.zeros(2, np.int32),
                                         lambda: np.zeros(2 * SIZE, np.int64)),
    "out dtype": case(TypeError, r"out: expected dtype float64 like x, got float32",
                      lambda x, o: mpicoll.allreduce(x, out=o), f64, lambda: np.zeros(4, np.float32)),
    # ---- counts ----------------------------------------------------------------
    "short recvbuf": case(ValueError, r"send count 4 and receive count 3",
                          COMM.Allreduce, f64, lambda: f64(3)),
    "negative count": case(ValueError, r"sendbuf: expected a non-negative count, got -1",
                           lambda x, y: COMM.Allreduce([x, -1, MPI.DOUBLE], y), f64, f64),
    "count beyond buffer": case(ValueError, r"sendbuf: count 9 at displacement 0 exceeds the buffer's 4",
                                lambda x, y: COMM.Allreduce([x, 9, MPI.DOUBLE], y), f64, lambda: f64(9)),
    "recvcounts length": case(ValueError, rf"recvcounts: expected {SIZE} entries \(one per rank\), got {SIZE + 1}",
                              lambda x, y: COMM.Reduce_scatter(x, y, [1] * (SIZE + 1)),
                              lambda: f64(SIZE), lambda: f64(1)),
    "recvcounts negative": case(ValueError, r"recvcounts: expected a non-negative count, got -1",
                                lambda x, y: COMM.Reduce_scatter(x, y, [-1] + [1] * (SIZE - 1)),
                                lambda: f64(SIZE), lambda: f64(1)),
    "recvcounts sum": case(ValueError, rf"send count {SIZE + 1} and sum\(counts\) {SIZE}",
                           lambda x, y: COMM.Reduce_scatter(x, y, [1] * SIZE),
                           lambda: f64(SIZE + 1), lambda: f64(1)),
    "recvcount of this rank": case(ValueError, rf"receive count 2 and counts\[{RANK}\] 1",
                                   lambda x, y: COMM.Reduce_scatter(x, y, [1] * SIZE),
                                   lambda: f64(SIZE), lambda: f64(2)),
    "in-place Reduce_scatter without recvcounts": case(
        ValueError, r"recvcounts: expected one count per rank when sendbuf is MPI\.IN_PLACE, got None",
        lambda y: COMM.Reduce_scatter(MPI.IN_PLACE, y), lambda: f64(SIZE)),
    "Reduce_scatter_block sizes": case(ValueError, rf"send count 5 and receive count {2 * SIZE}"
                                       if SIZE in (1, 5) else r"sendbuf: holds 5 elements, not a multiple",
                                       COMM.Reduce_scatter_block, lambda: f64(5), lambda: f64(2)),
    "Allgather recvbuf size": case(ValueError, rf"send count 3 and receive count {2 * SIZE}",
                                   COMM.Allgather, lambda: f64(3), lambda: f64(2 * SIZE)),
    "Allgatherv counts one too many": case(
        ValueError, rf"recvbuf: expected {SIZE} entries \(one per rank\), got {SIZE + 1}",
        lambda x, y: COMM.Allgatherv(x, [y, [2] * (SIZE + 1)]), lambda: f64(2), lambda: f64(2 * SIZE)),
    "Allgatherv buffer too small": case(
        ValueError, rf"recvbuf: counts \[.*\] at displacements \[.*\] need {2 * SIZE} elements, "
                    rf"the buffer holds {2 * SIZE - 1}",
        lambda x, y: COMM.Allgatherv(x, [y, [2] * SIZE, [2 * r for r in range(SIZE)], MPI.DOUBLE]),
        lambda: f64(2), lambda: f64(2 * SIZE - 1)),
    "Allgatherv send count": case(
        ValueError, rf"send count 3 and receive count counts\[{RANK}\] 2",
        lambda x, y: COMM.Allgatherv(x, [y, [2] * SIZE, [2 * r for r in range(SIZE)], MPI.DOUBLE]),
        lambda: f64(3), lambda: f64(2 * SIZE)),
    "Allgatherv overlapping blocks": case(
        ValueError, r"recvbuf: expected displacements that give every rank its own region, got blocks that overlap",
        lambda x, y: COMM.Allgatherv(x, [y, [2] * SIZE, list(range(SIZE)), MPI.DOUBLE]),
        lambda: f64(2), lambda: f64(2 * SIZE), min_size=2),
    "array reduce_scatter counts sum": case(ValueError, rf"counts: expected a sum of {SIZE + 1} \(the rows of x\), got sum\(counts\) = {SIZE}",
                                            lambda x: mpicoll.reduce_scatter(x, counts=[1] * SIZE),
                                            lambda: f64(SIZE + 1)),
    "array allgather counts length": case(ValueError, rf"counts: expected {SIZE} entries",
                                          lambda x: mpicoll.allgather(x, counts=[4] * (SIZE + 1)), f64),
    "array reduce_scatter 0-d": case(ValueError, r"x: expected an array with at least one dimension",
                                     mpicoll.reduce_scatter, lambda: np.array(1.0)),
    "array in-place allgather rows": case(
        ValueError, rf"x: expected a row count divisible by {SIZE} ranks for an in-place allgather",
        lambda x: mpicoll.allgather(x, out=x), lambda: f64(2 * SIZE + 1), min_size=2),
    # ---- read-only and non-contiguous buffers --------------------------------
    "read-only recvbuf": case(ValueError, r"recvbuf: expected a writable buffer, got a read-only one",
                              COMM.Allreduce, f64, lambda: readonly(f64())),
    "bytes recvbuf": case(ValueError, r"recvbuf: expected a writable buffer",
                          lambda x: COMM.Allreduce(x, bytes(4)), lambda: np.zeros(4, np.uint8)),
    "read-only in-place x": case(ValueError, r"out: expected a writable array",
                                 lambda x: mpicoll.allreduce(x, out=x), lambda: readonly(f64())),
    "read-only out": case(ValueError, r"out: expected a writable",
                          lambda x, o: mpicoll.allreduce(x, out=o), f64, lambda: readonly(f64())),
    "strided sendbuf": case(
        ValueError, r"sendbuf: expected a contiguous buffer, got a non-contiguous array with shape "
                    r"\(4,\) and strides \(16,\)",
        lambda x, y: COMM.Allreduce(x[::2], y), lambda: f64(8), f64),
    "strided recvbuf": case(ValueError, r"recvbuf: expected a contiguous buffer",
                            lambda x, y: COMM.Allreduce(x, y[::2]), f64, lambda: f64(8)),
    # ---- ops that do not apply ---------------------------------------------
    "BAND on float64": case(TypeError, r"op: MPI\.BAND does not apply to float64",
                            lambda x, y: COMM.Allreduce(x, y, MPI.BAND), f64, f64),
    "MAX on complex128": case(TypeError, r"op: MPI\.MAX does not apply to complex128",
                              lambda x, y: COMM.Allreduce(x, y, MPI.MAX),
                              lambda: f64().astype(complex), lambda: f64().astype(complex)),
    "SUM on bool": case(TypeError, r"op: MPI\.SUM does not apply to bool",
                        lambda x: mpicoll.allreduce(x, MPI.SUM), lambda: np.ones(4, bool)),
    "LAND on float32": case(TypeError, r"op: MPI\.LAND does not apply to float32",
                            lambda x: mpicoll.reduce_scatter(x, MPI.LAND), lambda: f64(SIZE).astype(np.float32)),
    "MINLOC on float64": case(TypeError, r"op: MPI\.MINLOC does not apply to float64",
                              lambda x, y: COMM.Allreduce(x, y, MPI.MINLOC), f64, f64),
    "SUM on DOUBLE_INT": case(TypeError, r"op: MPI\.SUM does not apply to MPI\.DOUBLE_INT",
                              lambda x, y: COMM.Allreduce([x, MPI.DOUBLE_INT], [y, MPI.DOUBLE_INT], MPI.SUM),
                              lambda: np.zeros(32, np.uint8), lambda: np.zeros(32, np.uint8)),
    "BXOR on MPI.FLOAT": case(TypeError, r"op: MPI\.BXOR does not apply to MPI\.FLOAT",
                              lambda x, y: COMM.Allreduce([x, MPI.FLOAT], [y, MPI.FLOAT], MPI.BXOR),
                              lambda: np.zeros(4, np.float32), lambda: np.zeros(4, np.float32)),
    "MPI.REPLACE": case(ValueError, r"op: MPI\.REPLACE is only valid in one-sided",
                        lambda x, y: COMM.Allreduce(x, y, MPI.REPLACE), f64, f64),
    "MPI.NO_OP": case(ValueError, r"op: MPI\.NO_OP is only valid in one-sided",
                      lambda x: mpicoll.allreduce(x, MPI.NO_OP), f64),
    "MPI.OP_NULL": case(ValueError, r"op: expected a reduction operation, got MPI\.OP_NULL",
                        lambda x, y: COMM.Reduce_scatter_block(x, y, MPI.OP_NULL),
                        lambda: f64(SIZE), lambda: f64(1)),
    # ---- communicators -----------------------------------------------------
    "COMM_NULL (Comm)": case(ValueError, r"comm: expected a valid communicator, got MPI\.COMM_NULL",
                             lambda: mpicoll.Comm(MPI.COMM_NULL)),
    "COMM_NULL (array)": case(ValueError, r"comm: expected a valid communicator, got MPI\.COMM_NULL",
                              lambda x: mpicoll.allreduce(x, comm=MPI.COMM_NULL), f64),
    # ---- overlapping buffers -----------------------------------------------
    "sendbuf is recvbuf": case(ValueError, r"sendbuf: expected memory apart from recvbuf \(or MPI\.IN_PLACE",
                               lambda x: COMM.Allreduce(x, x), f64),
    "sendbuf overlaps recvbuf": case(ValueError, r"sendbuf: expected memory apart from recvbuf .*, got an overlap$",
                                     lambda b: COMM.Allreduce(b[:4], b[2:6]), lambda: f64(8)),
    "Allgather overlap": case(ValueError, r"sendbuf: expected memory apart from recvbuf .*, got an overlap$",
                              lambda b: COMM.Allgather(b[:1], b[:SIZE]), lambda: f64(SIZE)),
    "Reduce_scatter overlap": case(ValueError, r"sendbuf: expected memory apart from recvbuf .*, got an overlap$",
                                   lambda b: COMM.Reduce_scatter(b, b[:1], [1] * SIZE), lambda: f64(SIZE)),
    "out overlaps x": case(ValueError, r"out: expected memory apart from x \(or out=x",
                           lambda b: mpicoll.allreduce(b[:4], out=b[1:5]), lambda: f64(8)),
    # ---- algorithm names ---------------------------------------------------
    "unknown algorithm": case(ValueError, r"algorithm: expected one of auto, .*ring.* for allreduce, got 'nope'",
                              lambda x: mpicoll.allreduce(x, algorithm="nope"), f64),
    "unknown algorithm (Comm)": case(ValueError, r"algorithm: expected one of .*got 'nope'",
                                     lambda: mpicoll.Comm(WORLD, algorithm="nope")),
    "algorithm of another collective": case(
        ValueError, r"algorithm: expected one of auto.* for allgather, got 'rabenseifner'",
        lambda x: mpicoll.allgather(x, algorithm="rabenseifner"), f64),
    # ---- out ---------------------------------------------------------------
    "allreduce out shape": case(ValueError, r"out: expected shape \(4,\), got \(5,\)",
                                lambda x, o: mpicoll.allreduce(x, out=o), f64, lambda: f64(5)),
    "allgather out shape": case(ValueError, rf"out: expected shape \({4 * SIZE},\), got \(3,\)",
                                lambda x, o: mpicoll.allgather(x, out=o), f64, lambda: f64(3)),
    "reduce_scatter out shape": case(ValueError, r"out: expected shape \(1, 2\), got \(7, 2\)",
                                     lambda x, o: mpicoll.reduce_scatter(x, out=o),
                                     lambda: f64(2 * SIZE).reshape(SIZE, 2), lambda: f64(14).reshape(7, 2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refused_before_any_message(name):
    exc, match, call, makers, min_size = CASES[name]
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


@pytest.fixture(scope="module")
def intercomm():
    if SIZE < 2:
        yield None
        return
    local = WORLD.Split(RANK % 2, RANK)
    inter = local.Create_intercomm(0, WORLD, 1 - RANK % 2, tag=7)
    yield inter
    inter.Free()
    local.Free()


def test_intercommunicator(intercomm):
    """An inter-communicator is the wrong kind of communicator: TypeError."""
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
