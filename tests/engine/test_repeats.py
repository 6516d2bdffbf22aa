"""Repeated calls (engine.cache): a repeat is a start of the call's kept operation, proven valid.

A repeated call with the same arguments starts its kept operation again (no
validation, no binding, no allocation); an argument changed in place (dtype,
shape, strides, writeability, its data buffer) or another object is a miss
that validates as a new call; an observer, a check or a timeout switched on is
the operation's own (it runs observed, still without validation); a kept
operation never keeps a user's array alive.
"""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
from mpi4py import MPI
from support import util

import mpicoll
from mpicoll.api import args as _args
from mpicoll.engine import cache as _cache
from mpicoll.engine import context as _context
from mpicoll.transport import channel as _channel

WORLD = MPI.COMM_WORLD
# The cache's rules are per rank: 1 (copies only), 2 (one exchange), 3 (the fold, uneven
# blocks) reach every path a hit or a miss takes.
pytestmark = pytest.mark.ranks(1, 2, 3)


# --- a repeated call with the same arrays goes straight to moving data ------------

@pytest.mark.timeout(60)
def test_a_repeat_neither_validates_nor_allocates(monkeypatch):
    """The same buffers again: no validation, no schedule binding, no allocation; right results."""
    from mpicoll.engine import executor as _executor
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        ctx = _context.context(comm)
        rank, n = WORLD.rank, WORLD.size
        checks = util.spy(monkeypatch, _args, ["Allreduce", "Allgather", "Reduce_scatter_block",
                                                "allreduce", "allgather", "reduce_scatter"])
        binds = util.spy(monkeypatch, _executor, ["bind"])
        for N in (1, 7, 1000):
            x = (np.arange(N * n) * 3 + rank).astype(np.float64)
            ar, ar2 = np.empty_like(x), np.empty_like(x)
            ag, ag2 = np.empty(N * n * n), np.empty(N * n * n)
            rs, rs2 = np.empty(N), np.empty(N)
            want_ar = np.empty_like(x)
            want_ag = np.empty_like(ag)
            want_rs = np.empty_like(rs)
            for step in range(3):
                x += step  # new contents, same buffers
                WORLD.Allreduce(x, want_ar)
                WORLD.Allgather(x, want_ag)
                WORLD.Reduce_scatter_block(x, want_rs)
                before = (len(checks), len(binds), ctx.work.allocations)
                mc.Allreduce(x, ar)
                mc.Allgather(x, ag)
                mc.Reduce_scatter_block(x, rs)
                assert mpicoll.allreduce(x, comm=comm, out=ar2) is ar2
                assert mpicoll.allgather(x, comm=comm, out=ag2) is ag2
                assert mpicoll.reduce_scatter(x, comm=comm, out=rs2) is rs2
                for got, want in ((ar, want_ar), (ag, want_ag), (rs, want_rs), (ar2, want_ar),
                                  (ag2, want_ag), (rs2, want_rs)):
                    np.testing.assert_array_equal(got, want)
                if step:
                    assert (len(checks), len(binds), ctx.work.allocations) == before
                else:
                    assert len(checks) == before[0] + 6
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_a_spec_of_the_arrays_own_datatype_repeats(monkeypatch):
    """``[array, T]`` with T the datatype mpi4py gives the array anyway is the bare array's
    message: its repeat starts the kept operation, blocking and non-blocking, and shares it with the bare
    form (it took the general path at every call: 35 us against 1 us at 16 B, 143 against
    67 us at 1 MiB).  Any other spec (another datatype over the same memory, a count, a
    non-contiguous array) is validated as it was; results exact throughout."""
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        rank, n = WORLD.rank, WORLD.size
        checks = util.spy(monkeypatch, _args, ["Allreduce", "Allgather", "Reduce_scatter_block"])
        x = (np.arange(4 * n) * 3 + rank).astype(np.float32)
        F = MPI.FLOAT
        ar, ag, rs = np.empty_like(x), np.empty(4 * n * n, np.float32), np.empty(4, np.float32)
        want = {"ar": np.empty_like(ar), "ag": np.empty_like(ag), "rs": np.empty_like(rs)}
        WORLD.Allreduce(x, want["ar"])
        WORLD.Allgather(x, want["ag"])
        WORLD.Reduce_scatter_block(x, want["rs"])
        calls = {
            "ar": lambda: mc.Allreduce([x, F], [ar, F]),
            "ag": lambda: mc.Allgather([x, F], (ag, F)),
            "rs": lambda: mc.Reduce_scatter_block([x, F], [rs, F], MPI.SUM),
        }
        outs = {"ar": ar, "ag": ag, "rs": rs}
        for name, call in calls.items():
            for step in range(3):
                outs[name].fill(-1)
                before = len(checks)
                call()
                np.testing.assert_array_equal(outs[name], want[name], err_msg=name)
                assert len(checks) - before == (step == 0), (name, step)
        before = len(checks)
        mc.Allreduce(x, ar)  # the bare form: the same operation
        mc.Allreduce(MPI.IN_PLACE, [ar, F])  # (in place: its own)
        mc.Allreduce(MPI.IN_PLACE, [ar, F])
        assert len(checks) - before == 1
        for _ in range(2):
            WORLD.Allreduce(MPI.IN_PLACE, want["ar"])
        np.testing.assert_array_equal(ar, want["ar"])
        # specs that are not the bare array keep validating at every call
        words = x.view(np.int32)
        for call in (lambda: mc.Allreduce([x, MPI.INT], [ar, MPI.INT], MPI.BXOR),
                     lambda: mc.Allreduce([words, F], [ar, F]),
                     lambda: mc.Allreduce([x, 4 * n, F], [ar, 4 * n, F])):
            call()
            before = len(checks)
            call()
            assert len(checks) - before == 1
        two = np.zeros((4 * n, 2), np.float32)
        with pytest.raises(ValueError, match="non-contiguous"):
            mc.Allreduce([two[:, 0], F], [ar, F])
        # non-blocking: the restart of a kept operation
        WORLD.Allreduce(x, want["ar"])
        mc.Iallreduce([x, F], [ar, F]).Wait()
        before = len(checks)
        for _ in range(2):
            ar.fill(-1)
            mc.Iallreduce([x, F], [ar, F]).Wait()
            np.testing.assert_array_equal(ar, want["ar"])
        assert len(checks) == before
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_calls_alternating_ops_or_algorithms_on_the_same_arrays_each_repeat(monkeypatch):
    """An entry's place was its function and arrays alone: a call with another op or algorithm
    on the same arrays forgot the other's, so calls alternating them validated at every
    call.  Now each has its own (blocking and non-blocking, both APIs); results exact."""
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        checks = util.spy(monkeypatch, _args, ["Allreduce", "allreduce", "allgather"])
        x = (np.arange(7 * WORLD.size) % 5 + WORLD.rank).astype(np.float64)
        y = np.empty_like(x)
        ag = np.empty(len(x) * WORLD.size)
        want = {name: np.empty_like(x) for name in ("SUM", "MAX")}
        for name, w in want.items():
            WORLD.Allreduce(x, w, getattr(MPI, name))
        want_ag = np.empty_like(ag)
        WORLD.Allgather(x, want_ag)
        calls = [
            (lambda: mc.Allreduce(x, y, MPI.SUM), y, want["SUM"]),
            (lambda: mc.Allreduce(x, y, MPI.MAX), y, want["MAX"]),
            (lambda: mpicoll.allreduce(x, MPI.MAX, comm=comm, out=y), y, want["MAX"]),
            (lambda: mpicoll.allreduce(x, MPI.SUM, comm=comm, out=y, algorithm="ring"), y,
             want["SUM"]),
            (lambda: mpicoll.allreduce(x, MPI.SUM, comm=comm, out=y), y, want["SUM"]),
            (lambda: mpicoll.allgather(x, comm=comm, out=ag, algorithm="ring"), ag, want_ag),
            (lambda: mpicoll.allgather(x, comm=comm, out=ag), ag, want_ag),
            (lambda: mc.Iallreduce(x, y, MPI.SUM).Wait(), y, want["SUM"]),
            (lambda: mc.Iallreduce(x, y, MPI.MAX).Wait(), y, want["MAX"]),
        ]
        for rnd in range(3):
            before = len(checks)
            for call, got, w in calls:
                got.fill(-1)
                call()
                np.testing.assert_array_equal(got, w)
            assert len(checks) - before == (len(calls) if rnd == 0 else 0), rnd
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_repeats_and_persistent_starts_warn_for_no_op():
    """Every predefined op repeats and starts persistently without a warning
    (NumPy 2.4 deprecates a positional output for maximum and minimum; the compiled
    reductions passed it positionally)."""
    import warnings

    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        x = (np.arange(6) * 7 + WORLD.rank * 3 % 5).astype(np.int64)
        y, want = np.empty_like(x), np.empty_like(x)
        for name in ("SUM", "PROD", "MIN", "MAX", "LAND", "LOR", "LXOR", "BAND", "BOR", "BXOR"):
            op = getattr(MPI, name)
            req = mc.Allreduce_init(x, y, op)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                for _ in range(3):  # the run path, then the repeat / the program
                    mc.Allreduce(x, y, op)
                    req.Start()
                    req.Wait()
            req.Free()
            WORLD.Allreduce(x, want, op)
            np.testing.assert_array_equal(y, want, err_msg=name)
    finally:
        comm.Free()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "complex128", "int8",
                                   "uint64", "bool"])
def test_repeats_are_right_for_every_dtype_and_in_place(dtype):
    """Repeated calls (persistent requests, one object per region) stay exact.

    Every message keeps the channel's datatype (float16 travels as 16-bit
    words); every repeat gets new contents and is judged by values.
    """
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        rank, n = WORLD.rank, WORLD.size
        op = MPI.LOR if dtype == "bool" else MPI.SUM
        for N in (1, 5, 300):
            x = np.empty(N * n, dtype)
            ar, rs, ag = np.empty_like(x), np.empty(N, dtype), np.empty(N * n * n, dtype)
            inplace, inplace_rs = np.empty_like(x), np.empty_like(x)
            for step in range(3):
                rows = [(np.arange(N * n) * 3 + r + step) % 5 for r in range(n)]
                if dtype == "bool":
                    rows = [row % 2 == (r % 2) for r, row in enumerate(rows)]
                x[...] = rows[rank]
                want = np.logical_or.reduce(rows) if dtype == "bool" else np.sum(rows, axis=0)
                want = want.astype(dtype)
                mc.Allreduce(x, ar, op)
                mc.Reduce_scatter_block(x, rs, op)
                mc.Allgather(x, ag)
                inplace[...] = x
                mc.Allreduce(MPI.IN_PLACE, inplace, op)
                inplace_rs[...] = x
                mc.Reduce_scatter_block(MPI.IN_PLACE, inplace_rs, op)
                np.testing.assert_array_equal(ar, want)
                np.testing.assert_array_equal(inplace, want)
                np.testing.assert_array_equal(rs, want[rank * N:(rank + 1) * N])
                np.testing.assert_array_equal(inplace_rs[:N], want[rank * N:(rank + 1) * N])
                np.testing.assert_array_equal(ag, np.concatenate(rows).astype(dtype))
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_an_observed_repeat_is_counted_and_changed_arguments_validate():
    """Other objects, an observer or an option change take the validating path again."""
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        x = np.arange(6.0) + WORLD.rank
        y = np.empty(6)
        mc.Allreduce(x, y)
        # a bad buffer of the same signature is refused, not repeated
        ro = np.empty(6)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="recvbuf"):
            mc.Allreduce(x, ro)
        with mpicoll.traffic() as t:
            mc.Allreduce(x, y)
        assert len(t.calls) == 1  # counted: it went through the observed path
        with mpicoll.traffic() as t:
            mpicoll.allreduce(x, comm=comm, out=y)
        assert len(t.calls) == 1
        with pytest.raises(TypeError, match="op"):
            mc.Allreduce(x, y, op="sum")
        want = np.empty(6)
        WORLD.Allreduce(x, want, MPI.MAX)
        mc.Allreduce(x, y, MPI.MAX)  # another op, same buffers
        np.testing.assert_array_equal(y, want)
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_a_repeat_runs_under_any_options_without_validation(monkeypatch):
    """Options switched on or off never validate a repeat again: the kept operation decides
    at each start how it runs (the fingerprint check first under ``check``, its deadline
    under a timeout, its persistent requests when nothing observes it).  The environment
    is read when a communicator is set up, so a variable set later changes nothing on an
    existing one."""
    from mpicoll.observe import check as _check
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        checks = util.spy(monkeypatch, _args, ["Allreduce"])
        agreed = util.spy(monkeypatch, _check, ["agree"])
        x = np.arange(5.0) * (WORLD.rank + 2)
        y, want = np.empty(5), np.empty(5)
        WORLD.Allreduce(x, want)

        def validated(**options):
            with mpicoll.options(**options):
                before = len(checks)
                mc.Allreduce(x, y)
                np.testing.assert_array_equal(y, want)
                return len(checks) - before

        validated(check=False)  # (the first call: kept)
        assert validated(check=False) == 0
        assert validated() == 0
        before = len(agreed)
        assert validated(check=True) == 0
        assert len(agreed) == before + (WORLD.size > 1)  # (the check ran: one exchange)
        assert validated(timeout=60.0) == 0
        assert validated() == 0
        assert validated(progress=False) == 0  # nothing a blocking call runs with
        assert len(agreed) == before + (WORLD.size > 1)
        monkeypatch.setenv("MPICOLL_CHECK", "1")  # read when a communicator is set up
        assert validated() == 0
        assert len(agreed) == before + (WORLD.size > 1)
        other = WORLD.Dup()
        try:  # a communicator set up now reads it
            y2 = np.empty(5)
            mpicoll.Comm(other).Allreduce(x, y2)
            assert _context.context(other).env["check"] is True
        finally:
            other.Free()
    finally:
        comm.Free()


def _the_timeout_is_in_the_signature(validated, timed):
    """``timed(t)``: a call under timeout ``t``; ``validated(call)``: how many times running
    it validated.  The first call is kept, its repeat validates nothing; another timeout
    argument (another object, another value, none) is another call."""
    validated(timed(30.0))
    assert validated(timed(30.0)) == 0
    assert validated(timed(30)) == 1  # (another timeout object: another call)
    assert validated(timed(31.0)) == 1
    assert validated(timed(31.0)) == 0
    assert validated(timed(None)) == 1


def _deadline_of(comm, name):
    """The deadline the kept operation of ``name`` on ``comm`` ran its last start under."""
    return _cache.latest(_context.context(comm), name).timeout


@pytest.mark.timeout(60)
def test_a_call_under_a_timeout_repeats_under_its_deadline(monkeypatch):
    """A timeout is the kept operation's deadline (engine.executor): a blocking call under
    one repeats without validation, its waits polling under the same deadline; the
    ``timeout=`` argument is part of the signature, so another one is a miss; the
    option's timeout changing is not (the next start runs under the new one).  A message
    over one piece repeats too, its pieces windowed so that the deadline sees them move."""
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        checks = util.spy(monkeypatch, _args, ["allreduce", "allgather", "Allreduce"])
        x = np.arange(5.0) * (WORLD.rank + 2)
        y, want = np.empty(5), np.empty(5)
        WORLD.Allreduce(x, want)

        def validated(call):
            before = len(checks)
            y[:] = -1
            call()
            np.testing.assert_array_equal(y, want)
            return len(checks) - before

        def timed(t):
            return lambda: mpicoll.allreduce(x, comm=comm, out=y, timeout=t)

        _the_timeout_is_in_the_signature(validated, timed)
        with mpicoll.options(timeout=30.0):
            validated(lambda: mc.Allreduce(x, y))
            assert validated(lambda: mc.Allreduce(x, y)) == 0
            assert _deadline_of(comm, "Comm.Allreduce") == 30.0
        with mpicoll.options(timeout=20.0):
            assert validated(lambda: mc.Allreduce(x, y)) == 0
            assert _deadline_of(comm, "Comm.Allreduce") == 20.0
        assert validated(lambda: mc.Allreduce(x, y)) == 0
        assert _deadline_of(comm, "Comm.Allreduce") is None
        # gathered in more than one piece (a block longer than the channel's piece, in one
        # message: a ring segment as long): kept as well, its pieces windowed
        big = np.full(_channel.LOCAL_PIECE_BYTES // 8 + 8, float(WORLD.rank))
        out = np.empty(big.size * WORLD.size)
        _context.context(comm).segment_bytes = _channel.LOCAL_PIECE_BYTES
        for i in range(2):
            before = len(checks)
            out[:] = -1
            mpicoll.allgather(big, comm=comm, out=out, timeout=30.0, algorithm="ring")
            assert len(checks) - before == (i == 0)
            np.testing.assert_array_equal(out, np.repeat(np.arange(WORLD.size), big.size))
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_a_non_blocking_call_under_a_timeout_restarts_under_its_deadline(monkeypatch):
    """A non-blocking call under a timeout restarts its kept operation too (its start gets
    its call's tag; its waits and test() poll under the deadline): it used to be validated
    and bound afresh at every call under a timeout, which every torch group has.  The
    ``timeout=`` argument is part of the signature; several in flight together, completed in
    either order; a message over one piece restarts as well."""
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        checks = util.spy(monkeypatch, _args, ["allreduce", "allgather", "Allreduce"])
        x = np.arange(5.0) * (WORLD.rank + 2)
        y, y2, want = np.empty(5), np.empty(5), np.empty(5)
        WORLD.Allreduce(x, want)

        def validated(start, out=y, polled=True):
            before = len(checks)
            out[:] = -1
            h = start()  # (a Handle, or mpicoll.Comm's Request)
            if polled:  # (test(): as the completion thread and torch's is_completed() do)
                test = getattr(h, "test", None) or h.Test
                while not test():
                    pass
            else:
                (getattr(h, "wait", None) or h.Wait)()
            np.testing.assert_array_equal(out, want)
            return len(checks) - before

        def timed(t, out=y):
            return lambda: mpicoll.iallreduce(x, comm=comm, out=out, timeout=t)

        _the_timeout_is_in_the_signature(validated, timed)  # (a restart polled with test())
        validated(timed(30.0))
        assert validated(timed(30.0), polled=False) == 0  # (and one waited for)
        with mpicoll.options(timeout=30.0):
            validated(lambda: mc.Iallreduce(x, y))
            assert validated(lambda: mc.Iallreduce(x, y)) == 0
        with mpicoll.options(timeout=20.0):
            assert validated(lambda: mc.Iallreduce(x, y)) == 0
        # two kept calls in flight together, waited for in one order and the other (y's
        # kept operation is the one above; Comm.Iallreduce's are another function's)
        validated(timed(30.0, y2), y2)
        for order in (0, 1, 0):
            before = len(checks)
            y[:] = y2[:] = -1
            hs = [timed(30.0)(), timed(30.0, y2)()]
            for h in (hs if order == 0 else hs[::-1]):
                h.wait()
            assert len(checks) == before
            np.testing.assert_array_equal(y, want)
            np.testing.assert_array_equal(y2, want)
        # gathered in more than one piece: restarted too, its pieces windowed
        big = np.full(_channel.LOCAL_PIECE_BYTES // 8 + 8, float(WORLD.rank))
        out = np.empty(big.size * WORLD.size)
        _context.context(comm).segment_bytes = _channel.LOCAL_PIECE_BYTES
        for i in range(2):
            before = len(checks)
            out[:] = -1
            mpicoll.iallgather(big, comm=comm, out=out, timeout=30.0, algorithm="ring").wait()
            assert len(checks) - before == (i == 0)
            np.testing.assert_array_equal(out, np.repeat(np.arange(WORLD.size), big.size))
    finally:
        comm.Free()


@pytest.mark.local
def test_a_bad_option_changes_no_setting():
    """configure() checks every value before it sets any (it used to set ``check``
    before refusing the ``timeout`` after it), and a refused call moves no epoch."""
    from mpicoll.core import config
    epoch = config.EPOCH[0]
    with pytest.raises(ValueError, match="^timeout: "):
        mpicoll.configure(check=True, timeout=0)
    assert not config.configured("check") and config.EPOCH[0] == epoch
    with mpicoll.options(check=False):
        assert config.EPOCH[0] == epoch + 1  # every setting moves the epoch repeats compare
    assert config.EPOCH[0] == epoch + 2


@pytest.mark.timeout(60)
def test_kept_requests_are_freed_with_their_operation():
    """A kept operation's persistent requests are freed when it is dropped: one of its arrays
    collected, the communicator freed; another call of its function keeps an operation of its
    own beside it; the work goes on right."""
    from mpicoll.engine import executor as _executor
    comm = WORLD.Dup()
    mc = mpicoll.Comm(comm)
    n, rank = WORLD.size, WORLD.rank
    x = np.arange(4.0 * n) + rank
    y, y2 = np.empty_like(x), np.empty_like(x)
    want = np.empty_like(x)
    WORLD.Allreduce(x, want)

    def kept_requests():
        op = _cache.latest(_context.context(comm), "Comm.Allreduce")
        return list(_executor._HOLDING.get(op, ()))

    try:
        mc.Allreduce(x, y)
        assert kept_requests() == []  # (a call run once makes none)
        mc.Allreduce(x, y)  # its first repeat: its program's requests
        first = kept_requests()
        # one receive and one send per exchange; 2 ranks: one exchange; 1 rank: a copy
        assert len(first) == {1: 0, 2: 2}.get(n, len(first)) and len(first) % 2 == 0
        if n > 1:
            assert first and all(r != MPI.REQUEST_NULL for r in first)
        mc.Allreduce(x, y)  # a repeat: the same requests again
        assert kept_requests() == first and all(r != MPI.REQUEST_NULL for r in first)
        for _ in range(2):  # other buffers: an operation of their own, beside the first
            mc.Allreduce(x, y2)
        second = kept_requests()
        assert all(r != MPI.REQUEST_NULL for r in first + second)
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(y2, want)
        del y
        gc.collect()  # (the first operation's array: it goes, with its requests)
        assert all(r == MPI.REQUEST_NULL for r in first)
        assert all(r != MPI.REQUEST_NULL for r in second)
    finally:
        comm.Free()
    assert all(r == MPI.REQUEST_NULL for r in second)
    assert not [p for p in _executor._HOLDING if getattr(p, "ctx", None) is not None
                and p.ctx.comm == MPI.COMM_NULL]


@pytest.mark.timeout(60)
@pytest.mark.ranks(1, 2, 3)  # 1: a program of copies; 2: one exchange; 3: the fold
def test_a_call_run_once_makes_no_persistent_request(monkeypatch):
    """A new communicator's first call runs its steps: it binds no program and makes no
    persistent request (Send_init/Recv_init); its first repeat binds the program, once,
    and the repeats after it run that program."""
    from mpicoll.engine import executor as _executor
    made = util.spy(monkeypatch, _executor, ["on_requests"])
    comm = WORLD.Dup()
    try:
        x = np.arange(5.0) + WORLD.rank
        y, want = np.empty(5), np.empty(5)
        WORLD.Allreduce(x, want)
        mpicoll.allreduce(x, comm=comm, out=y)
        op = _cache.latest(_context.context(comm), "allreduce")
        once = (len(made), op.program, list(_executor._HOLDING.get(op, ())), y.tolist())
        results = []
        for _ in range(3):
            y[...] = -1
            mpicoll.allreduce(x, comm=comm, out=y)
            results.append(y.tolist())
        program = op.program is not None and _cache.latest(_context.context(comm),
                                                            "allreduce") is op
        held = len(_executor._HOLDING.get(op, ()))
    finally:
        comm.Free()
    ok = once == (0, None, [], want.tolist()) and len(made) == 1 and program \
        and (held > 0) == (WORLD.size > 1) and results == [want.tolist()] * 3
    util.assert_all(WORLD, ok, f"first call: {once[:3]}; on_requests {len(made)} times, "
                               f"program={program}, {held} requests held")


@pytest.mark.timeout(60)
def test_repeats_and_first_calls_mix_across_ranks():
    """Ranks on different paths in one call agree on algorithm and call number."""
    comm = WORLD.Dup()
    try:
        ctx = _context.context(comm)
        for N in (1, 100, 100000):
            x = np.arange(N, dtype=np.float64) + WORLD.rank
            ref = np.empty_like(x)
            comm.Allreduce(x, ref)
            seq = ctx.seq
            # a timeout is observed, so odd ranks take the general path
            got = mpicoll.allreduce(x, comm=comm, timeout=60.0 if WORLD.rank % 2 else None)
            assert ctx.seq == seq + 1
            np.testing.assert_array_equal(got, ref)
        with mpicoll.options(check=True):  # fingerprints agree whatever path each rank took before
            mpicoll.allreduce(np.ones(3), comm=comm)
    finally:
        comm.Free()


@pytest.mark.timeout(60)
@pytest.mark.ranks(1, 2, 3)  # 1: no requests; 2: one exchange; 3: the fold
def test_an_interrupted_repeat_is_dropped():
    """A repeat interrupted between starting its requests and waiting for them (Ctrl-C, an
    MPI error) never runs again: the next call takes the run path and is right."""
    from mpicoll.engine import executor as _executor
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        ctx = _context.context(comm)
        x = np.arange(6.0) + WORLD.rank
        y = np.empty(6)
        want = np.empty(6)
        WORLD.Allreduce(x, want)
        for _ in range(2):  # (its first repeat makes its program)
            mc.Allreduce(x, y)
        op = _cache.latest(ctx, "Comm.Allreduce")
        requests = list(_executor._HOLDING.get(op, ()))
        assert op.program is not None and bool(requests) == (WORLD.size > 1)

        def interrupt():
            raise KeyboardInterrupt

        def posts(step):  # (a message posted, or started: the program's Startall)
            return step[0] in (_executor.SEND, _executor.RECV) or (
                step[0] == _executor.CALL
                and getattr(step[1], "func", None) is MPI.Prequest.Startall)

        for form in ("program", "steps"):
            steps = list(getattr(op, form) or ())
            at = 1 + max([i for i, s in enumerate(steps) if posts(s)], default=len(steps) - 1)
            # (every message of the call posted, the last ones not waited for: each one
            # a peer posts has its match, so later calls match theirs)
            setattr(op, form, tuple(steps[:at] + [(_executor.CALL, interrupt)] + steps[at:]))
        with pytest.raises(KeyboardInterrupt):
            mc.Allreduce(x, y)
        assert _cache.latest(ctx, "Comm.Allreduce") is None
        assert all(r == MPI.REQUEST_NULL for r in requests) and op not in _executor._HOLDING
        for _ in range(3):  # the run path, then a new kept operation
            y[...] = -1
            mc.Allreduce(x, y)
            np.testing.assert_array_equal(y, want)
        assert _cache.latest(ctx, "Comm.Allreduce") is not op
    finally:
        comm.Free()


# --- a hit is proven valid: arguments changed in place are a miss -------------------

def _forms(comm):
    """(name, call(x, out), reference(x) -> expected out) of every cached blocking form."""
    mc = mpicoll.Comm(comm)
    n = comm.size

    def ref_allreduce(x):
        want = np.empty_like(x)
        WORLD.Allreduce(x, want)
        return want

    def ref_rs(x):
        want = np.empty(len(x) // n, x.dtype)
        WORLD.Reduce_scatter_block(x, want)
        return want

    return [
        ("allreduce", lambda x, o: mpicoll.allreduce(x, comm=comm, out=o), ref_allreduce, 1),
        ("Comm.Allreduce", lambda x, o: mc.Allreduce(x, o), ref_allreduce, 1),
        ("reduce_scatter", lambda x, o: mpicoll.reduce_scatter(x, comm=comm, out=o), ref_rs, n),
        ("Comm.Reduce_scatter_block", lambda x, o: mc.Reduce_scatter_block(x, o), ref_rs, n),
        ("iallreduce", lambda x, o: mpicoll.iallreduce(x, comm=comm, out=o).wait(),
         ref_allreduce, 1),
        ("Comm.Iallreduce", lambda x, o: mc.Iallreduce(x, o).Wait(), ref_allreduce, 1),
        ("ireduce_scatter", lambda x, o: mpicoll.ireduce_scatter(x, comm=comm, out=o).wait(),
         ref_rs, n),
        ("Comm.Ireduce_scatter_block", lambda x, o: mc.Ireduce_scatter_block(x, o).Wait(),
         ref_rs, n),
    ]


@pytest.mark.timeout(120)
def test_a_dtype_changed_in_place_is_a_miss():
    """``x.dtype = o.dtype = float64`` between repeats: the call sees the new type (it
    returned reinterpreted garbage, e.g. [inf, -0.44, -1.5] for [3, 4.5, 6] at 3 ranks)."""
    comm = WORLD.Dup()
    n, rank = WORLD.size, WORLD.rank
    try:
        for name, call, ref, per in _forms(comm):
            x = (np.arange(3 * n) + rank).astype(np.int64)
            o = np.empty(3 * n // per, np.int64)
            for _ in range(2):
                call(x, o)
            np.testing.assert_array_equal(o, ref(x), err_msg=name)
            x.dtype = np.float64
            o.dtype = np.float64
            x[...] = np.arange(3 * n) * 1.5 + rank
            call(x, o)
            np.testing.assert_array_equal(o, ref(x), err_msg=name)
    finally:
        comm.Free()


@pytest.mark.timeout(120)
def test_an_array_given_new_memory_in_place_is_a_miss():
    """``out.__setstate__(state)`` (NumPy's pickle protocol) gives ``out`` a new data buffer
    of the same shape, dtype and strides: the repeat writes the new memory, not the old
    one (the sum landed in the freed buffer, another live array's memory, and ``out``
    kept its old values).  The same for the input: the repeat reads its new memory.  The
    arrays start over memory of a ``bytearray`` held here, so the old buffer stays alive
    (a freed one may be handed back at the same address) and a write into it shows."""
    comm = WORLD.Dup()
    n, rank = WORLD.size, WORLD.rank

    def over_bytes(values):
        held = bytearray(values.nbytes)
        arr = np.frombuffer(held, dtype=values.dtype)
        arr[...] = values
        return arr, held

    try:
        for name, call, ref, per in _forms(comm):
            x, x_old = over_bytes((np.arange(3 * n) + rank).astype(np.float64))
            o, o_old = over_bytes(np.zeros(3 * n // per))
            for _ in range(2):
                call(x, o)
            o.__setstate__(o.__reduce__()[2])  # (the same state, in a new buffer)
            stale = bytes(o_old)
            x[...] += 10
            call(x, o)
            np.testing.assert_array_equal(o, ref(x), err_msg=f"{name}: out moved")
            assert bytes(o_old) == stale, f"{name}: wrote into out's old memory"
            keep = x.copy()
            x.__setstate__(x.__reduce__()[2])
            x[...] = keep + 100  # (the old buffer still holds keep; the new one keep + 100)
            call(x, o)
            np.testing.assert_array_equal(o, ref(x), err_msg=f"{name}: input moved")
    finally:
        comm.Free()


@pytest.mark.timeout(120)
def test_the_output_passed_as_the_input_is_a_miss():
    """After hits with ``(x, out)``, a call with ``(out, out)`` is another call: it behaves
    as that call does the first time (the hit read the old input ``x``: an in-place
    ``allreduce(o, out=o)`` at one rank returned ``x``'s values)."""
    comm, fresh = WORLD.Dup(), WORLD.Dup()
    n, rank = WORLD.size, WORLD.rank

    def outcome(call, buf):
        try:
            call(buf, buf)
        except (TypeError, ValueError) as exc:
            return type(exc).__name__
        return buf.tolist()

    try:
        first = {name: call for name, call, _, _ in _forms(fresh)}
        for name, call, _, per in _forms(comm):
            if per != 1:  # (a reduce-scatter's output cannot also be its input)
                continue
            x = (np.arange(3 * n) + 100 + rank).astype(np.float64)
            o = np.zeros(3 * n)
            for _ in range(2):
                call(x, o)
            o[...] = np.arange(3 * n) * 2 + rank
            want = outcome(first[name], o.copy())
            assert outcome(call, o) == want, name
    finally:
        comm.Free()
        fresh.Free()


@pytest.mark.timeout(120)
def test_a_buffer_made_non_contiguous_in_place_is_a_miss():
    """``mpicoll.Comm``'s repeats compare contiguity, not shape and strides: ``o.strides``
    set in place to every other element behaves as that call does the first time."""
    comm, fresh = WORLD.Dup(), WORLD.Dup()
    n, rank = WORLD.size, WORLD.rank

    def outcome(call, x, o):
        try:
            call(x, o)
        except (TypeError, ValueError) as exc:
            return type(exc).__name__
        return o.base.tolist()

    try:
        first = {name: call for name, call, _, _ in _forms(fresh)}
        for name, call, _, per in _forms(comm):
            x = (np.arange(4 * n) + rank).astype(np.float64)
            o = np.zeros(8 * n // per)[:4 * n // per]
            for _ in range(2):
                call(x, o)
            o.base[...] = -1
            o.strides = (16,)
            o2 = np.full(8 * n // per, -1.0)[:4 * n // per]
            o2.strides = (16,)
            assert outcome(call, x, o) == outcome(first[name], x, o2), name
    finally:
        comm.Free()
        fresh.Free()


@pytest.mark.timeout(120)
def test_a_read_only_or_reshaped_out_is_refused_after_hits():
    """A hit checks what validation checked: ``out`` made read-only raises and is not
    written; ``out`` reshaped in place or its dtype changed alone raises too."""
    comm = WORLD.Dup()
    n, rank = WORLD.size, WORLD.rank
    try:
        results = []
        for name, call, ref, per in _forms(comm):
            x = (np.arange(4 * n) + rank).astype(np.float64)
            o = np.zeros(4 * n // per)
            for _ in range(2):
                call(x, o)
            o[...] = -7
            o.flags.writeable = False
            with pytest.raises(ValueError, match="out|recvbuf"):
                call(x, o)
            results.append((name, bool((o == -7).all())))
            o.flags.writeable = True
            o.dtype = np.int64  # same itemsize, only the dtype changed
            with pytest.raises(TypeError):
                call(x, o)
            o.dtype = np.float64
            if o.size % 2 == 0 and o.size:
                o.shape = (2, o.size // 2)  # refused by the array functions, a buffer to Comm
                try:
                    call(x, o)
                except (TypeError, ValueError):
                    assert not name.startswith("Comm."), name
                else:
                    assert name.startswith("Comm."), name
                o.shape = (o.size,)
            call(x, o)
            np.testing.assert_array_equal(o, ref(x), err_msg=name)
        assert all(ok for _, ok in results), results
    finally:
        comm.Free()


@pytest.mark.timeout(120)
def test_kept_operations_keep_no_user_array_alive():
    """Fresh buckets through a cached form, deleted: every one is collected (16 of 20
    8 MiB buckets stayed alive, 1 GiB per communicator with 64 MiB buckets)."""
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        refs = []
        for k in range(20):
            g = np.full(1 << 10, float(k + WORLD.rank))
            o = np.empty_like(g)
            mpicoll.iallreduce(g, comm=comm, out=g).wait()
            mpicoll.allreduce(g, comm=comm, out=o)
            mc.Allreduce(g, o)
            mc.Iallreduce(MPI.IN_PLACE, o).Wait()
            refs += [weakref.ref(g), weakref.ref(o)]
            del g, o
        gc.collect()
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} arrays kept alive"
        # and the cache still works on live arrays
        x = np.arange(8.0) + WORLD.rank
        want = np.empty_like(x)
        WORLD.Allreduce(x, want)
        for _ in range(3):
            y = np.empty_like(x)
            mc.Allreduce(x, y)
            np.testing.assert_array_equal(y, want)
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_calls_alternating_between_arrays_each_repeat_their_own(monkeypatch):
    """Gradient buckets: blocking calls that alternate between arrays each repeat their
    own (it used to be one entry per function, so every call of an alternation was
    validated again); past BLOCKING, or past WORK_BYTES of work memory held, the least
    recently run entries go."""
    comm = WORLD.Dup()
    try:
        checks = util.spy(monkeypatch, _args, ["allreduce"])
        buckets = [np.arange(5.0 + i) * (WORLD.rank + 1) for i in range(4)]
        outs = [np.empty_like(g) for g in buckets]
        wants = [np.empty_like(g) for g in buckets]
        for g, w in zip(buckets, wants):
            WORLD.Allreduce(g, w)
        for step in range(3):
            before = len(checks)
            for g, o, w in zip(buckets, outs, wants):
                o[:] = -1
                mpicoll.allreduce(g, comm=comm, out=o)
                np.testing.assert_array_equal(o, w)
            assert len(checks) - before == (4 if step == 0 else 0), step
        ctx = _context.context(comm)
        assert len(ctx.cache.blocking) == 4
        # a bounded table: the oldest go first
        monkeypatch.setattr(_cache, "BLOCKING", 2)
        extra, extra_out = np.ones(3), np.empty(3)
        mpicoll.allreduce(extra, comm=comm, out=extra_out)
        assert len(ctx.cache.blocking) == 2
        before = len(checks)
        mpicoll.allreduce(buckets[3], comm=comm, out=outs[3])  # (the second newest: kept)
        assert len(checks) == before
        mpicoll.allreduce(buckets[0], comm=comm, out=outs[0])  # (dropped: validated again)
        assert len(checks) == before + 1
        np.testing.assert_array_equal(outs[0], wants[0])
        # work memory: entries holding more than the budget together keep only the newest
        if WORLD.size > 1:
            monkeypatch.setattr(_cache, "BLOCKING", 16)
            monkeypatch.setattr(_cache, "WORK_BYTES", 1)
            for g, o in zip(buckets, outs):
                mpicoll.allreduce(g, comm=comm, out=o, algorithm="recursive_doubling")
            held = [e for e in ctx.cache.blocking.values() if e.work]
            # (at a rank count that is not a power of two, a rank folded out holds none)
            assert len(held) <= 1 and all(e.recv_ref() is outs[-1] for e in held), held
    finally:
        comm.Free()


def test_a_collected_array_drops_its_operation():
    """A kept operation goes with its arrays: a new array at the same address is validated anew."""
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        ctx = _context.context(comm)
        x, y = np.arange(6.0) + WORLD.rank, np.empty(6)
        mc.Allreduce(x, y)
        op = _cache.latest(ctx, "Comm.Allreduce")
        assert op is not None
        del y
        gc.collect()
        assert _cache.latest(ctx, "Comm.Allreduce") is None and op.program is None
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_a_call_keeps_no_array_alive_after_it_returns():
    """Arrays of a finished call that was not kept are freed by reference counting alone
    (a run and its operation referring to each other kept them until the cyclic
    collector ran: a DLPack deleter test saw capsules of earlier tests go at its gc)."""
    comm = WORLD.Dup()
    mc = mpicoll.Comm(comm)
    gc.disable()
    try:
        refs = []
        for _ in range(3):
            x = np.arange(5.0) + WORLD.rank
            y = mpicoll.allreduce(x, comm=comm)                     # no out=: not kept
            h = mpicoll.iallreduce(x, comm=comm, algorithm="ring")
            h.wait()
            z = np.empty(5)
            mc.Allreduce(x.view(np.ndarray)[:], z)                  # a view: not kept
            refs += [weakref.ref(x), weakref.ref(y), weakref.ref(z)]
            del x, y, h, z
        alive = [r for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} arrays alive without the cyclic collector"
    finally:
        gc.enable()
        comm.Free()
