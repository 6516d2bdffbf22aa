"""MPICOLL_CHECK: mismatched calls raise the same MismatchError on every rank, no hang.

Run under an MPI launcher at any rank count (cases that need two ranks skip
at one).  Each case has rank 1 call something different from the others;
every rank must raise MismatchError with the same message, naming the
collective, the call number, the field and who passed what, with no buffer
touched, and the communicator must work right afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from support.data import rank_data

import mpicoll
from mpicoll.engine import context as _context
from mpicoll.observe import check as _check

# mismatch detection: 1 rank, 2 (a power of two), 3 (not)
pytestmark = [pytest.mark.timeout(60), pytest.mark.ranks(1, 2, 3)]

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
ODD = 1  # the rank that passes something different
SENTINEL = -7.0


def ranks_text(rs) -> str:
    """The documented rank list format: 'rank 1', 'ranks 0,2,3', 'ranks 0,2-4'."""
    rs = sorted(rs)
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts += [f"{rs[i]}-{rs[j]}"] if j - i >= 2 else [str(r) for r in rs[i:j + 1]]
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(parts)


def groups_text(verb, usual, odd) -> str:
    """Largest group first (at two ranks: rank 0's, the lowest rank, first)."""
    others = [r for r in range(SIZE) if r != ODD]
    return f"{ranks_text(others)} {verb} {usual}, {ranks_text([ODD])} {verb} {odd}"


@pytest.fixture
def comm():
    c = WORLD.Dup()
    yield c
    c.Free()


def ref_allreduce(x, op=MPI.SUM):
    """MPI's built-in result."""
    out = np.empty_like(x)
    WORLD.Allreduce(x, out, op)
    return out


def _case_count(comm, out):
    n = 1014 if RANK == ODD else 1024
    return mpicoll.allreduce(rank_data(n, RANK), comm=comm, out=out[:n])


def _case_dtype(comm, out):
    if RANK == ODD:
        return mpicoll.allreduce(rank_data(16, RANK, np.float32), comm=comm)
    return mpicoll.allreduce(rank_data(16, RANK), comm=comm, out=out[:16])


def _case_op(comm, out):
    op = MPI.MAX if RANK == ODD else MPI.SUM
    return mpicoll.allreduce(rank_data(16, RANK), op, comm=comm, out=out[:16])


def _case_collective(comm, out):
    if RANK == ODD:
        return mpicoll.allgather(rank_data(4, RANK), comm=comm, out=out[: 4 * SIZE])
    return mpicoll.allreduce(rank_data(4, RANK), comm=comm, out=out[:4])


def _case_algorithm(comm, out):
    algo = "recursive_doubling" if RANK == ODD else "ring"
    return mpicoll.allreduce(rank_data(64, RANK), comm=comm, out=out[:64], algorithm=algo)


def _case_allgather_counts(comm, out):
    counts = [3] * SIZE
    if RANK == ODD:
        counts[0] = 2
    x = rank_data(counts[RANK], RANK)
    return mpicoll.allgather(x, comm=comm, counts=counts, out=out[: sum(counts)])


def _case_reduce_scatter_counts(comm, out):
    counts = [2] * SIZE
    if RANK == ODD:
        counts = [1] + [2] * (SIZE - 2) + [3]
    x = rank_data(sum(counts), RANK)
    return mpicoll.reduce_scatter(x, comm=comm, counts=counts, out=out[: counts[RANK]])


def _case_user_op(comm, out):
    op = MPI.Op.Create(lambda a, b, t: None, commute=True)
    try:
        return mpicoll.allreduce(rank_data(16, RANK), op if RANK == ODD else MPI.SUM, comm=comm,
                                 out=out[:16])
    finally:
        op.Free()


def _case_comm_datatype(comm, out):
    """The drop-in Comm: MPI.INT on one rank, MPI.FLOAT (same size) on the others."""
    c = mpicoll.Comm(comm)
    buf = np.arange(8, dtype=np.int32)
    recv = out[:4].view(np.int32)  # 4 float64 = 8 int32 of the sentinel buffer
    t = MPI.INT if RANK == ODD else MPI.FLOAT
    c.Allreduce([buf, t], [recv, t], op=MPI.SUM)


RS = "reduce_scatter"
CASES = {
    # name: (call, expected message after "<prefix>: ")
    "count": (_case_count, "allreduce #1", "count differs", "passed", 1024, 1014),
    "dtype": (_case_dtype, "allreduce #1", "dtype differs", "passed", "float64", "float32"),
    "op": (_case_op, "allreduce #1", "op differs", "passed", "MPI.SUM", "MPI.MAX"),
    "collective": (_case_collective, "allreduce/allgather #1", "collective differs", "called",
                   "allreduce",
                   "allgather"),
    "algorithm": (_case_algorithm, "allreduce #1", "algorithm differs", "chose", "ring",
                  "recursive_doubling"),
    "allgather counts": (_case_allgather_counts, "allgather #1", "counts[0] differs", "passed",
                         3, 2),
    "reduce_scatter counts": (_case_reduce_scatter_counts, f"{RS} #1", "counts[0] differs",
                              "passed", 2, 1),
    "user op": (_case_user_op, "allreduce #1", "op differs", "passed", "MPI.SUM",
                "a user-defined MPI.Op"),
    "Comm datatype": (_case_comm_datatype, "allreduce #1", "dtype differs", "passed", "float32",
                      "int32"),
}


def _gathered_messages(exc):
    return WORLD.allgather(None if exc is None else (type(exc).__name__, str(exc)))


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs two ranks")
@pytest.mark.parametrize("name", list(CASES))
def test_mismatch_raises_same_error_everywhere(comm, name):
    call, prefix, what, verb, usual, odd = CASES[name]
    out = np.full(1024 * max(SIZE, 2), SENTINEL)
    with mpicoll.options(check=True):
        try:
            call(comm, out)
        except mpicoll.MismatchError as e:
            exc = e
        else:
            exc = None
    seen = _gathered_messages(exc)
    assert all(s is not None and s[0] == "MismatchError" for s in seen), seen
    assert len({s[1] for s in seen}) == 1, f"ranks raised different messages: {seen}"
    expected = f"{prefix}: {what}: {groups_text(verb, usual, odd)}"
    assert seen[0][1] == expected
    assert exc.seq == 1
    assert set(exc.values) == set(range(SIZE))
    # nothing was written, and the communicator works right after
    assert np.all(out == SENTINEL)
    with mpicoll.options(check=True):
        y = mpicoll.allreduce(rank_data(10, RANK), comm=comm)
    assert np.array_equal(y, ref_allreduce(rank_data(10, RANK)))


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs two ranks")
def test_error_attributes(comm):
    with mpicoll.options(check=True), pytest.raises(mpicoll.MismatchError) as info:
        _case_count(comm, np.empty(1024))
    e = info.value
    assert isinstance(e, mpicoll.MpicollError)
    assert e.field == "count" and e.collective == "allreduce" and e.seq == 1
    assert e.values == {r: (1014 if r == ODD else 1024) for r in range(SIZE)}


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs two ranks")
def test_call_number_differs_and_resynchronises(comm):
    """A rank whose call counter is ahead: 'call number differs'; later calls agree again."""
    mpicoll.allreduce(rank_data(4, RANK), comm=comm)          # creates the context; call #1
    if RANK == ODD:
        _context.context(comm).seq += 1            # as if it had run one call more
    with mpicoll.options(check=True), pytest.raises(mpicoll.MismatchError) as info:
        mpicoll.allreduce(rank_data(4, RANK), comm=comm)
    msg = str(info.value)
    assert msg == f"allreduce: call number differs: {groups_text('reached', '#2', '#3')}"
    with mpicoll.options(check=True):
        y = mpicoll.allreduce(rank_data(4, RANK), comm=comm)
    assert np.array_equal(y, ref_allreduce(rank_data(4, RANK)))


@pytest.mark.skipif(SIZE < 2, reason="a mismatch needs two ranks")
def test_environment_variable(comm, monkeypatch):
    monkeypatch.setenv("MPICOLL_CHECK", "1")
    with pytest.raises(mpicoll.MismatchError, match=r"^allreduce #1: count differs"):
        _case_count(comm, np.empty(1024))
    monkeypatch.setenv("MPICOLL_CHECK", "0")
    y = mpicoll.allreduce(rank_data(5, RANK), comm=comm)
    assert np.array_equal(y, ref_allreduce(rank_data(5, RANK)))


def test_matching_calls_pass_and_are_correct(comm):
    """No false alarms: every collective and both APIs with the check on."""
    counts = [r % 3 for r in range(SIZE)]
    with mpicoll.options(check=True):
        for n in (0, 1, SIZE + 3, 5000):
            x = rank_data(n, RANK)
            assert np.array_equal(mpicoll.allreduce(x, comm=comm), ref_allreduce(x))
            assert np.array_equal(mpicoll.allreduce(x, MPI.MAX, comm=comm, algorithm="ring"),
                                  ref_allreduce(x, MPI.MAX))
        g = mpicoll.allgather(rank_data(counts[RANK], RANK), comm=comm, counts=counts)
        assert np.array_equal(g, np.concatenate(WORLD.allgather(rank_data(counts[RANK], RANK))))
        x = rank_data(sum(counts) + SIZE, RANK)
        rcounts = [c + 1 for c in counts]
        r = mpicoll.reduce_scatter(x, comm=comm, counts=rcounts)
        full = ref_allreduce(x)
        lo = sum(rcounts[:RANK])
        assert np.array_equal(r, full[lo: lo + rcounts[RANK]])
        # Reduce_scatter without recvcounts exchanges the counts first (checked too)
        c = mpicoll.Comm(comm)
        recv = np.empty(rcounts[RANK])
        c.Reduce_scatter(x, recv, op=MPI.SUM)
        assert np.array_equal(recv, full[lo: lo + rcounts[RANK]])
    assert _context.context(comm).seq == 12


def test_one_rank_needs_no_exchange():
    solo = WORLD.Split(RANK, 0)
    try:
        with mpicoll.options(check=True):
            assert np.array_equal(mpicoll.allreduce(rank_data(7, RANK), comm=solo), rank_data(7, RANK))
    finally:
        solo.Free()


def test_fingerprint_is_fixed_size():
    """Different collectives, dtypes and ops encode to the same number of words."""

    class Msg:
        def __init__(self, dtype, category="floating", typename=None):
            self.dtype, self.category = np.dtype(dtype), category
            self.typename = typename or str(self.dtype)

    class Call:
        def __init__(self, label, msg, op, counts, total, algorithm):
            self.label, self.msg, self.op, self.counts = label, msg, op, counts
            self.total, self.algorithm, self.seq = total, algorithm, 3

    calls = [
        Call("allreduce", Msg("f8"), MPI.SUM, None, 10, "ring"),
        Call("allgather", Msg("i4", "integer"), None, [1, 2, 3], 6, "ring"),
        Call("reduce_scatter.recvcounts", Msg("u1", "byte", "MPI.BYTE"), MPI.BXOR,
             list(range(1000)), 10 ** 12, "recursive_doubling"),
    ]
    words = {len(_check.fingerprint(c)) for c in calls}
    assert words == {_check.WORDS}
    decoded = _check._decode(_check.fingerprint(calls[2]))
    assert decoded["collective"] == "reduce_scatter.recvcounts"
    assert decoded["dtype"] == "MPI.BYTE" and decoded["op"] == "MPI.BXOR"
    assert decoded["count"] == 10 ** 12 and decoded["algorithm"] == "recursive_doubling"


@pytest.mark.parametrize("ranks, text", [
    ([1], "rank 1"), ([0, 2, 3], "ranks 0,2,3"), ([0, 1, 2, 3], "ranks 0-3"),
    ([0, 2, 3, 4, 7], "ranks 0,2-4,7"), ([5, 6], "ranks 5,6"),
])
def test_rank_list_format(ranks, text):
    assert _check._ranks(ranks) == text


def test_mismatch_message_from_table():
    """The message is a function of the gathered table alone (so it is the same everywhere)."""
    class Msg:
        dtype, category, typename = np.dtype("f8"), "floating", "float64"

    class Call:
        label, msg, op, counts, algorithm, seq = "allreduce", Msg(), MPI.SUM, None, "ring", 17

    rows = []
    for r in range(4):
        c = Call()
        c.total = 1000 if r == 1 else 1024
        rows.append(_check.fingerprint(c))
    err = _check.mismatch_error(np.array(rows), np.full((4, 4), -1))
    assert str(err) == "allreduce #17: count differs: ranks 0,2,3 passed 1024, rank 1 passed 1000"


# --- without the check: MPI's own error for the failed message, named -----------------

# 2: the rank whose receive is too small fails, the other finishes (at more ranks some are
# left waiting for the failed one until their timeout: seconds of nothing but waiting)
@pytest.mark.ranks(2)
@pytest.mark.parametrize("form", ["array", "Comm", "non-blocking"])
def test_without_the_check_a_truncated_message_says_what_mpi_said(form):
    """Counts that differ across ranks (rank r: 5 + r elements) and no check: a rank whose
    receive is too small raises MPI's own error for that request (MPI_ERR_TRUNCATE), not
    the MPI_ERR_IN_STATUS of the wait that found it, with the call, the peer and the step,
    and says that MPICOLL_CHECK=1 diagnoses it.  (A rank whose receives are long enough
    may finish: MPI accepts a shorter message.)"""
    comm = WORLD.Dup()
    try:
        x = np.ones(5 + RANK)
        out = np.empty_like(x)
        try:
            if form == "array":
                mpicoll.allreduce(x, comm=comm, out=out, algorithm="recursive_doubling",
                                  timeout=10)
            elif form == "Comm":
                with mpicoll.options(timeout=10):  # (a rank left waiting must not hang)
                    mpicoll.Comm(comm, algorithm="recursive_doubling").Allreduce(x, out)
            else:
                mpicoll.iallreduce(x, comm=comm, out=out, algorithm="recursive_doubling",
                                   timeout=10).wait()
            text = None
        except mpicoll.CollectiveTimeout:
            text = "timeout"  # (a rank left waiting for one that failed)
        except MPI.Exception as exc:
            text = str(exc)
            ok = (isinstance(exc, mpicoll.MessageError) and "ERR_IN_STATUS" not in text
                  and exc.Get_error_class() == MPI.ERR_TRUNCATE
                  and "MPICOLL_CHECK=1" in text and "allreduce #1" in text
                  and f"from rank {exc.peer}" in text and exc.step is not None
                  and f"step {exc.step}" in text)
            if not ok:
                text = f"BAD: {text!r}"
        texts = WORLD.allgather(text)
        assert not any(t and t.startswith("BAD") for t in texts), texts
        assert any(t not in (None, "timeout") for t in texts), texts
    finally:
        comm.Free()
