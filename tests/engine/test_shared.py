"""The shared-memory path on host arrays: node memory, its algorithms and options, through MPI.

Every collective against MPI's built-in (mpicoll.verify's runner: rank-asymmetric
inputs, the one tolerance rule, inputs unchanged, bitwise identical across
ranks) with slots of a few elements, so that calls take many chunks; the
rank-order fold inside a node; operations in flight waited in different orders,
more of them than there are regions; the progress thread; persistent
operations and repeated calls; a rank that skips a call; a communicator freed
with work in flight; fake nodes (the hierarchical composition); the
``intranode`` option, its agreement and a set-up that fails on one rank.
Runs at any rank count (1 rank: the trivial schedules, no node memory).
"""

from __future__ import annotations

import errno
import glob
import os
import stat
import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI
from support import util
from support.data import rank_data

import mpicoll
from mpicoll.algorithms import shared as _algorithms
from mpicoll.engine import context as _context
from mpicoll.engine import intranode as _intranode
from mpicoll.tools import verify as V
from mpicoll.transport import shared as _shared

WORLD = MPI.COMM_WORLD
RANK, SIZE = WORLD.Get_rank(), WORLD.Get_size()
_NODE = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
# every rank on one node (not so on the emulated cluster, tests/cluster/): the tests that
# count on one node's ranks mapping each other's memory say so
ONE_NODE = _NODE.Get_size() == SIZE  # (the same on every rank)
_NODE.Free()
one_node = pytest.mark.skipif(not ONE_NODE, reason="the ranks span nodes: a test of one node")
MPI_COMM = MPI.Intracomm  # mpi4py's own methods: the built-in reference
NAMES = {"Allreduce": [_algorithms.ONESHOT, _algorithms.TWOSHOT],
         "allreduce": [_algorithms.ONESHOT, _algorithms.TWOSHOT],
         "Reduce_scatter": [_algorithms.NAME], "Reduce_scatter_block": [_algorithms.NAME],
         "reduce_scatter": [_algorithms.NAME], "Allgather": [_algorithms.NAME],
         "Allgatherv": [_algorithms.NAME], "allgather": [_algorithms.NAME],
         "allgatherv": [_algorithms.NAME]}
SLOT = 256  # bytes per slot in the small-slot tests: 8 clongdouble, 32 float64, 256 int8


def _mine():
    """This job's node memory files under /dev/shm (names that start with a pid of the
    job): node memory has no name, so none may ever exist, during a job or after it."""
    pids = {str(q) for q in WORLD.allgather(os.getpid())}
    return [p for p in glob.glob("/dev/shm/mpicoll-*") if os.path.basename(p).split("-")[1] in pids]


def _no_space(fd, offset, length):
    """os.posix_fallocate where the memory is short (a full tmpfs, a memory limit)."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def small(monkeypatch):
    """A communicator whose node memory has slots of SLOT bytes (set up on its first call)."""
    comm = WORLD.Dup()
    monkeypatch.setattr(_shared, "HOST_SLOT_BYTES", SLOT)
    yield comm
    comm.Free()


def _cases(comm, collective, info, opname, counts, algorithms):
    for count in counts:
        prepared = V.prepare_case(comm, collective, info, opname, count)
        for algo in algorithms:
            for ip in (False, True):
                label = f"{info.name} {opname} count={count} in_place={ip} {algo}"
                yield label, V.run_case(comm, collective, info, opname, count, ip, algo,
                                        prepared=prepared)


TYPES = {t.name: t for t in V.available_types()}
# (type, op): floating and integer, a pair type (MINLOC), complex, 1-byte and 2-byte
KINDS = [("float64", "SUM"), ("float32", "PROD"), ("int32", "BXOR"), ("int8", "MAX"),
         ("complex128", "SUM"), ("float16", "SUM"), ("bool", "LOR"), ("bfloat16", "SUM"),
         ("clongdouble", "PROD"), ("uint64", "MIN")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("collective", list(NAMES))
def test_every_collective_with_small_slots(small, collective):
    """Counts 0, 1, fewer than the ranks, not divisible and a few hundred elements: many
    chunks of a few elements each, every op kind, in place and out."""
    reduces = V.COLLECTIVES[collective][2]
    counts = sorted({0, 1, max(SIZE - 1, 0), SIZE + 1, 7 * SIZE + 3, 301})
    results = []
    for tname, op in KINDS if reduces else [("int16", None), ("float64", None)]:
        if tname in TYPES:
            results += list(_cases(small, collective, TYPES[tname], op, counts, NAMES[collective]))
    util.check_cases(small, results)


@pytest.mark.timeout(300)
def test_pair_types_and_user_ops(small):
    """MINLOC on a pair type (Comm API) and a user-defined op fold in the same order."""
    results = []
    for name in ("float_int", "double_int"):
        if name in TYPES:
            results += list(_cases(small, "Allreduce", TYPES[name], "MINLOC", [7 * SIZE + 3],
                                   NAMES["Allreduce"]))
    util.check_cases(small, results)


def _half_plus(a, b, datatype):
    """inout = in * 0.5 + inout: neither commutative nor associative."""
    x = np.frombuffer(a, np.float64)
    y = np.frombuffer(b, np.float64)
    y[:] = x * 0.5 + y


@one_node
def test_rank_order_fold_inside_a_node(small):
    """Inside one node the shared algorithms fold ((x0 op x1) op x2) ...: with an op that is
    neither commutative nor associative, bit for bit the rank-order fold (direct's)."""
    op = MPI.Op.Create(_half_plus, commute=False)
    try:
        n = 5 * SIZE + 3
        x = rank_data(n, RANK, np.float64, salt=3)
        want = mpicoll.allreduce(x, op, comm=small, algorithm="direct")
        got = {a: mpicoll.allreduce(x, op, comm=small, algorithm=a) for a in NAMES["allreduce"]}
        counts = [n // SIZE + (r < n % SIZE) for r in range(SIZE)]
        rs = mpicoll.reduce_scatter(x, op, comm=small, counts=counts, algorithm="shared")
        rs_want = mpicoll.reduce_scatter(x, op, comm=small, counts=counts, algorithm="direct")
    finally:
        op.Free()
    bad = [a for a, y in got.items() if not util.same_bytes(y, want)]
    if not util.same_bytes(rs, rs_want):
        bad.append("reduce_scatter")
    util.assert_all(small, not bad, f"not the rank-order fold: {bad}")


def _builtin(collective, x, counts=None, comm=WORLD):
    if collective == "allreduce":
        out = np.empty_like(x)
        MPI_COMM.Allreduce(comm, x, out)
    elif collective == "reduce_scatter":
        out = np.empty(counts[comm.Get_rank()], x.dtype)
        MPI_COMM.Reduce_scatter(comm, x, out, counts)
    else:
        out = np.empty(sum(counts), x.dtype)
        MPI_COMM.Allgatherv(comm, x, [out, counts])
    return out


def _start(collective, x, comm, algorithm, counts):
    if collective == "allreduce":
        return mpicoll.iallreduce(x, comm=comm, algorithm=algorithm)
    if collective == "reduce_scatter":
        return mpicoll.ireduce_scatter(x, comm=comm, counts=counts, algorithm=algorithm)
    return mpicoll.iallgather(x, comm=comm, counts=counts, algorithm=algorithm)


def _in_flight(comm, nops=2 * _intranode.NONBLOCKING + 1):
    """``nops`` non-blocking calls (every shared algorithm, more than there are regions, a
    ring among them), a blocking call in the middle, waited in an order that depends on the
    rank; [(what, got, expected)]."""
    n = 40 * SIZE + 3
    counts = [n // SIZE + (r < n % SIZE) for r in range(SIZE)]
    plan = [("allreduce", _algorithms.ONESHOT), ("allreduce", _algorithms.TWOSHOT),
            ("reduce_scatter", _algorithms.NAME), ("allgather", _algorithms.NAME),
            ("allreduce", "ring")]
    started = []
    for k in range(nops):
        collective, algo = plan[k % len(plan)]
        x = rank_data(counts[RANK] if collective == "allgather" else n, RANK, np.float64,
                      salt=40 + k)
        started.append((f"{collective} {algo} #{k}", collective, x,
                        _start(collective, x, comm, algo, counts)))
        if k == nops // 2:  # a blocking call among them
            y = rank_data(n, RANK, np.float64, salt=99)
            got = mpicoll.allreduce(y, comm=comm, algorithm=_algorithms.TWOSHOT)
            started.append(("blocking", "allreduce", y, got))
    order = list(range(len(started)))
    if RANK % 2:
        order.reverse()
    elif RANK % 3 == 2:
        order = order[1::2] + order[::2]
    got = [None] * len(started)
    for i in order:
        h = started[i][3]
        got[i] = h if isinstance(h, np.ndarray) else h.wait()
    # (the built-in references only now: a rank blocked in one would not advance the
    # operations its peers wait for)
    return [(what, g, _builtin(collective, x, counts, comm))
            for (what, collective, x, _), g in zip(started, got)]


def _problems(triples):
    return "; ".join(f"{w}: got {g!r}, expected {e!r}" for w, g, e in triples
                     if not util.same_bytes(g, e) and not np.allclose(g, e, rtol=1e-12))


@pytest.mark.timeout(120)
def test_operations_in_flight_in_different_orders(small):
    """More operations in flight than regions (a start waits for its region's previous
    operation), ranks waiting in different orders: all complete, all right."""
    with mpicoll.options(timeout=60):
        bad = _problems(_in_flight(small))
    util.assert_all(small, not bad, bad)


@pytest.fixture
def progress():
    from mpicoll.api import requests as _requests
    _requests.stop_progress()
    with mpicoll.options(progress=True):
        yield
    _requests.stop_progress()


@pytest.mark.timeout(120)
def test_progress_thread(small, progress):
    """With the progress thread the same operations complete, and one completes without a
    wait."""
    bad = _problems(_in_flight(small))
    x = rank_data(100, RANK, np.float64, salt=5)
    h = mpicoll.iallreduce(x, comm=small, algorithm=_algorithms.TWOSHOT)
    deadline = time.monotonic() + 60
    while not h.done and time.monotonic() < deadline:
        time.sleep(0.001)
    done = h.done
    got = h.wait()
    bad += _problems([("alone", got, _builtin("allreduce", x, comm=small))])
    util.assert_all(small, done and not bad, bad or "not completed by the progress thread")


def test_persistent_and_repeated_calls(small):
    """Persistent operations (two at once, alternated) restarted on new data, and a blocking
    call repeated with its input changed in place (its cache entry, on persistent requests)."""
    comm = mpicoll.Comm(small, algorithm=_algorithms.TWOSHOT)
    x, y = np.empty(50), np.empty(50)
    u, v = np.empty(30), np.empty(30)
    p = comm.Allreduce_init(x, y)
    q = mpicoll.Comm(small, algorithm=_algorithms.ONESHOT).Allreduce_init(u, v)
    bad = []
    for it in range(4):
        x[:] = rank_data(50, RANK, np.float64, salt=10 + it)
        u[:] = rank_data(30, RANK, np.float64, salt=20 + it)
        p.Start()
        q.Start()
        if RANK % 2:
            q.Wait()
            p.Wait()
        else:
            p.Wait()
            q.Wait()
        bad.append(_problems([(f"persistent #{it}", y, _builtin("allreduce", x, comm=small)),
                              (f"second #{it}", v, _builtin("allreduce", u, comm=small))]))
    p.Free()
    q.Free()
    a, b = np.empty(70), np.empty(70)
    for it in range(4):
        a[:] = rank_data(70, RANK, np.float64, salt=30 + it)
        comm.Allreduce(a, b)
        bad.append(_problems([(f"repeat #{it}", b, _builtin("allreduce", a, comm=small))]))
    bad = "; ".join(b for b in bad if b)
    util.assert_all(small, not bad, bad)


@one_node
def test_traffic_names_the_algorithm_and_counts_no_bytes(small):
    """On one node only 0-byte messages travel: traffic() names the algorithm, 0 bytes."""
    counts = [3] * SIZE
    with mpicoll.traffic() as t:
        mpicoll.allreduce(np.ones(100), comm=small, algorithm=_algorithms.ONESHOT)
        mpicoll.allreduce(np.ones(100), comm=small, algorithm=_algorithms.TWOSHOT)
        mpicoll.reduce_scatter(np.ones(3 * SIZE), comm=small, counts=counts, algorithm="shared")
        mpicoll.allgather(np.ones(3), comm=small, counts=counts, algorithm="shared")
    names = [c.algorithm for c in t.calls]
    ok = names == [_algorithms.ONESHOT, _algorithms.TWOSHOT, "shared", "shared"] \
        and t.bytes_sent == 0 and t.bytes_received == 0 \
        and (SIZE == 1 or all(c.messages_sent > 0 for c in t.calls))
    util.assert_all(small, ok, f"{names} {t.bytes_sent} {[c.messages_sent for c in t.calls]}")


@one_node
def test_intranode_option_chooses(monkeypatch):
    """``intranode``: "shared" takes the shared algorithms at every size, "mpi" never, and
    either is read when a communicator is set up (a later change applies to later ones)."""
    got = {}
    for mode in ("shared", "mpi"):
        with mpicoll.options(intranode=mode):
            comm = WORLD.Dup()
            mpicoll.allreduce(np.ones(4), comm=comm)  # its set-up reads the option
        with mpicoll.traffic() as t:
            for n in (1, 1000, 300_000):
                mpicoll.allreduce(np.ones(n), comm=comm)
            mpicoll.allgather(np.ones(2), comm=comm)
            mpicoll.reduce_scatter(np.ones(2 * SIZE), comm=comm)
        got[mode] = [c.algorithm for c in t.calls]
        comm.Free()
    shared = set(NAMES["allreduce"]) | {"shared"}
    ok = not any(a in shared for a in got["mpi"]) and (
        SIZE == 1 or got["shared"] == [_algorithms.ONESHOT, _algorithms.ONESHOT,
                                       _algorithms.TWOSHOT, "shared", "shared"])
    util.assert_all(WORLD, ok, str(got))


@pytest.mark.parametrize("value, exc", [(1, TypeError), ("nodes", ValueError), ("MPI", ValueError)])
def test_intranode_argument_is_checked(value, exc):
    with pytest.raises(exc, match="intranode"):
        mpicoll.configure(intranode=value)


def test_intranode_environment_is_parsed():
    from mpicoll.core.config import read_environment
    assert read_environment({"MPICOLL_INTRANODE": " Shared "})["intranode"] == "shared"
    assert read_environment({})["intranode"] == "auto"
    with pytest.raises(ValueError, match="MPICOLL_INTRANODE: expected auto, mpi or shared"):
        read_environment({"MPICOLL_INTRANODE": "yes"})
    read_environment()


@pytest.mark.skipif(SIZE < 2, reason="needs two ranks to disagree")
def test_ranks_that_disagree_take_rank_0s_option():
    """Ranks with different ``intranode`` options: every rank takes rank 0's (it shapes the
    schedule), the others warn once, and every rank runs the same algorithm."""
    comm = WORLD.Dup()
    try:
        with mpicoll.options(intranode="shared" if RANK == 0 else "mpi"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with mpicoll.traffic() as t:
                    y = mpicoll.allreduce(np.ones(3), comm=comm)
        said = [str(w.message) for w in caught if "differed from rank 0's" in str(w.message)]
        ok = np.array_equal(y, np.full(3, SIZE)) and t.calls[0].algorithm.startswith("shared") \
            and len(said) == (0 if RANK == 0 else 1)
        util.assert_all(comm, ok, f"{y} {[c.algorithm for c in t.calls]} {said}")
    finally:
        comm.Free()


@one_node
@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
def test_a_set_up_failing_on_one_rank(monkeypatch):
    """Rank 0 cannot reserve its memory (ENOSPC): every rank learns it, "auto" keeps the
    MPI algorithms and an explicit shared algorithm raises MpicollError on every rank,
    naming why."""
    comm = WORLD.Dup()
    try:
        if RANK == 0:
            monkeypatch.setattr(os, "posix_fallocate", _no_space)
        with mpicoll.options(intranode="shared"), mpicoll.traffic() as t:
            y = mpicoll.allreduce(rank_data(9, RANK), comm=comm)  # tries node memory first
        err = None
        try:
            mpicoll.allgather(np.ones(2), comm=comm, algorithm="shared")
        except mpicoll.MpicollError as exc:
            err = str(exc)
        why = "No space left on device" if RANK == 0 else "rank 0 of this node could not allocate"
        ok = t.calls[0].algorithm not in NAMES["allreduce"] \
            and np.array_equal(y, _builtin("allreduce", rank_data(9, RANK), comm=comm)) \
            and err is not None and "node memory unavailable" in err and why in err
        util.assert_all(comm, ok, f"{t.calls[0].algorithm} {err}")
    finally:
        comm.Free()
    assert not _mine()


@one_node
@pytest.mark.skipif(SIZE < 2, reason="needs a node peer")
@pytest.mark.timeout(120)
def test_memory_that_cannot_be_reserved(monkeypatch):
    """No rank can reserve its node memory (a full tmpfs, a memory limit): the set-up says
    so on every rank, a 2 MiB AllReduce under intranode="shared" runs MPI's algorithms and
    is right, and a shared algorithm the call names raises MpicollError, naming ENOSPC;
    no signal, no hang, nothing left."""
    comm = WORLD.Dup()
    try:
        monkeypatch.setattr(os, "posix_fallocate", _no_space)
        x = rank_data(1 << 18, RANK)  # 2 MiB of float64
        with mpicoll.options(intranode="shared"), mpicoll.traffic() as t:
            y = mpicoll.allreduce(x, comm=comm)
        err = None
        try:
            mpicoll.allreduce(x, comm=comm, algorithm=_algorithms.ONESHOT)
        except mpicoll.MpicollError as exc:
            err = str(exc)
        ok = t.calls[0].algorithm not in NAMES["allreduce"] \
            and np.array_equal(y, _builtin("allreduce", x, comm=comm)) \
            and err is not None and "node memory unavailable" in err \
            and "No space left on device" in err
        util.assert_all(comm, ok, f"{t.calls[0].algorithm} {err}")
    finally:
        comm.Free()
    assert not _mine()


@pytest.mark.local
def test_host_memory_is_reserved_sealed_and_nameless():
    """A host segment: every byte reserved at creation (a short memory fails here, not at a
    write mid-collective), its size sealed, no name under /dev/shm; a peer maps it through
    the creator's descriptor until the creator settles it."""
    size = 1 << 20
    seg = _shared.HostSegment.create(size)
    try:
        fd = seg._fd
        st = os.fstat(fd)
        assert st.st_blocks * 512 >= size and stat.S_IMODE(st.st_mode) == 0o600, st
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:mpicoll"), fd
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 0)
        assert not glob.glob(f"/dev/shm/mpicoll-{os.getpid()}-*")
        peer = _shared.HostSegment.open(seg.handle, seg.token, size)
        seg.array()[:3] = (7, 8, 9)
        assert list(peer.array()[:3]) == [7, 8, 9]
        peer.close()
        seg.settle()
        with pytest.raises(OSError):
            _shared.HostSegment.open(seg.handle, seg.token, size)
        with pytest.raises(OSError):
            os.fstat(fd)  # (settled: the creator's descriptor is closed)
    finally:
        seg.close()


@pytest.mark.local
def test_host_memory_opens_nothing_else(tmp_path):
    """A handle naming another descriptor (a file, a pipe: opened without blocking), a wrong
    token or size, or no handle at all: OSError, nothing mapped."""
    seg = _shared.HostSegment.create(4096)
    r, w = os.pipe()
    f = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(f, 64 + 4096)
    try:
        pid = os.getpid()
        for handle, token, size, words in [
                (f"{pid}:{f}", seg.token, 4096, "not node memory"),
                (f"{pid}:{r}", seg.token, 4096, "not node memory"),
                (seg.handle, bytes(16), 4096, "another process's memory"),
                (seg.handle, seg.token, 8192, "of 8256 bytes"),
                ("/dev/shm/x", seg.token, 4096, "not a node memory handle")]:
            with pytest.raises(OSError, match=words):
                _shared.HostSegment.open(handle, token, size)
    finally:
        os.close(f)
        os.close(r)
        os.close(w)
        seg.close()


SKIPPER = 1
T = 0.25


@one_node
@pytest.mark.skipif(SIZE < 2, reason="needs a second rank to skip the call")
@pytest.mark.timeout(90)
@pytest.mark.parametrize("algorithm", NAMES["allreduce"])
def test_skipped_call_times_out(algorithm):
    """After the set-up, a rank that skips a call: the others raise CollectiveTimeout in a
    sync, naming the peer they wait for; the communicator is refused afterwards."""
    comm = WORLD.Dup()
    x = rank_data(8 * SIZE, RANK)
    mpicoll.allreduce(x, comm=comm, algorithm=algorithm)  # set up, healthy
    exc, elapsed = None, 0.0
    if RANK != SKIPPER:
        t0 = time.perf_counter()
        try:
            mpicoll.allreduce(x, comm=comm, algorithm=algorithm, timeout=T)
        except mpicoll.CollectiveTimeout as e:
            exc = e
        elapsed = time.perf_counter() - t0
    problem = ""
    if RANK != SKIPPER:
        if exc is None:
            problem = "no CollectiveTimeout"
        elif exc.algorithm != algorithm or exc.phase not in ("send", "recv") \
                or "node: " not in str(exc) or not T <= elapsed <= T + 4.0:
            problem = f"{exc!r} after {elapsed:.2f} s"
        else:
            try:
                mpicoll.allreduce(x, comm=comm)
                problem = "the timed-out communicator was accepted"
            except mpicoll.MpicollError as e:
                if "communicator unusable" not in str(e):
                    problem = str(e)
    peers = WORLD.allgather(None if exc is None else exc.peer)
    util.assert_all(WORLD, not problem, problem)
    assert SKIPPER in peers
    _discard(comm)


def _discard(comm):
    """Drop the messages the timed-out call left unmatched, then free ``comm`` (as
    tests/transport/test_timeout.py does, so later tests in this job match none of them)."""
    WORLD.Barrier()
    private = _context.context(comm).comm
    status = MPI.Status()
    quiet_until = time.perf_counter() + 0.3
    while time.perf_counter() < quiet_until:
        if private.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
            private.Recv([bytearray(status.Get_count(MPI.BYTE)), MPI.BYTE], status.Get_source(),
                         status.Get_tag())
            quiet_until = time.perf_counter() + 0.3
    WORLD.Barrier()
    comm.Free()


def test_freed_with_work_in_flight():
    """The communicator freed while operations on node memory are in flight and a persistent
    one is not freed: they complete, right; the persistent one still starts (a request keeps
    its communicator, as in MPI); once it is freed the node memory goes (no file left)."""
    comm = WORLD.Dup()
    x = rank_data(200, RANK, np.float64, salt=7)
    hs = [mpicoll.iallreduce(x, comm=comm, algorithm=a) for a in NAMES["allreduce"]]
    y = np.empty_like(x)
    p = mpicoll.Comm(comm, algorithm=_algorithms.TWOSHOT).Allreduce_init(x, y)
    ref = _builtin("allreduce", x)
    comm.Free()
    got = [h.wait() for h in reversed(hs)]
    p.Start()
    p.Wait()
    p.Free()
    ok = all(np.allclose(g, ref, rtol=1e-12) for g in got) and np.allclose(y, ref, rtol=1e-12) \
        and not _mine()
    util.assert_all(WORLD, ok, f"files={_mine()}")


@pytest.mark.parametrize("kind", ["split_parity", "split_reversed"])
def test_split_communicators(kind):
    """Node peers are ranks of the communicator (not of COMM_WORLD): split ones, reversed."""
    comms = util.make_comms()
    try:
        comm = comms[kind]
        n = 33
        x = rank_data(n, comm.rank, np.float64, salt=8)
        counts = [n // comm.size + (r < n % comm.size) for r in range(comm.size)]
        got = [("oneshot", mpicoll.allreduce(x, comm=comm, algorithm=_algorithms.ONESHOT),
                _builtin("allreduce", x, comm=comm)),
               ("rs", mpicoll.reduce_scatter(x, comm=comm, counts=counts, algorithm="shared"),
                _builtin("reduce_scatter", x, counts, comm)),
               ("ag", mpicoll.allgather(x[:counts[comm.rank]], comm=comm, counts=counts,
                                        algorithm="shared"),
                _builtin("allgather", x[:counts[comm.rank]], counts, comm))]
        bad = _problems(got)
    finally:
        util.free_comms(comms)
    util.assert_all(WORLD, not bad, bad)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["block:2", "cyclic:2"])
def test_fake_nodes_compose_with_the_hierarchical_algorithms(layout, monkeypatch):
    """On a communicator spanning (fake) nodes the shared algorithms are the hierarchical
    ones with node memory inside each node: every collective right, in place and out;
    ``intranode=shared`` picks them; a non-commutative op is refused there."""
    if SIZE < 2:
        pytest.skip("one rank is one node")
    if not ONE_NODE and layout.startswith("cyclic"):
        pytest.skip("fake nodes wider than the real ones cannot map each other's memory")
    env = util.env_options(monkeypatch)
    env.setenv("MPICOLL_FAKE_NODES", layout)
    comm = WORLD.Dup()
    try:
        results = []
        for collective in ("Allreduce", "Reduce_scatter", "Allgatherv", "reduce_scatter"):
            results += list(_cases(comm, collective, TYPES["float64"],
                                   "SUM" if V.COLLECTIVES[collective][2] else None,
                                   [0, 1, SIZE + 1, 7 * SIZE + 3], NAMES[collective]))
        util.check_cases(comm, results)
        # a large call across nodes (not pipelined: one region of node memory per call,
        # algorithms.pipeline.applies); across nodes travel exactly the lanes' rings: 2(k-1) N
        x = rank_data(300_000, RANK, np.float64, salt=4)
        with mpicoll.traffic() as t:
            y = mpicoll.allreduce(x, comm=comm, algorithm=_algorithms.TWOSHOT)
        k = len(set(_context.context(comm).nodes))
        sent = WORLD.allreduce(t.bytes_sent)
        bad = _problems([("large", y, _builtin("allreduce", x))])
        if sent != 2 * (k - 1) * x.nbytes:
            bad += f" {sent} bytes across nodes"
        util.assert_all(comm, not bad, bad)
        with mpicoll.options(intranode="shared"):
            other = WORLD.Dup()
            mpicoll.allgather(np.ones(1), comm=other)  # its set-up reads the option
        try:
            with mpicoll.traffic() as t:
                mpicoll.allreduce(np.ones(1000), comm=other)
            nodes = _context.context(other).nodes
            shares = len(set(nodes)) < len(nodes)  # (a node of one rank each: nothing to share)
            ok = (t.calls[0].algorithm == _algorithms.TWOSHOT) == shares
            op = MPI.Op.Create(_half_plus, commute=False)
            try:
                with pytest.raises(ValueError, match="non-commutative"):
                    mpicoll.allreduce(np.ones(10), op, comm=other, algorithm=_algorithms.TWOSHOT)
                with mpicoll.traffic() as t:
                    mpicoll.allreduce(np.ones(10), op, comm=other)  # auto: an ordered algorithm
                ok = ok and t.calls[0].algorithm not in NAMES["allreduce"]
            finally:
                op.Free()
        finally:
            other.Free()
        util.assert_all(WORLD, ok, "intranode=shared across nodes")
    finally:
        comm.Free()


def test_no_file_is_left_behind():
    """Every node memory file is removed once its node's ranks mapped it."""
    comm = WORLD.Dup()
    try:
        mpicoll.allreduce(np.ones(10), comm=comm, algorithm=_algorithms.TWOSHOT)
        h = mpicoll.iallreduce(np.ones(10), comm=comm, algorithm=_algorithms.TWOSHOT)
        h.wait()
        left = _mine()
    finally:
        comm.Free()
    util.assert_all(WORLD, not left, str(left))


def test_info_says_whether_node_memory_maps(capsys, monkeypatch):
    """``python -m mpicoll.info``: the option, and whether host memory maps (here it does;
    with one rank there is nobody to share with); then refused on rank 0, why."""
    from mpicoll.tools import info
    assert info.main([], comm=WORLD) in (0, 1)
    out = capsys.readouterr().out
    want = "host memory: yes (" if SIZE > 1 else "host memory: not used (no rank"
    ok = RANK != 0 or ("intranode: auto (MPICOLL_INTRANODE)" in out and want in out)
    if RANK == 0:
        monkeypatch.setattr(os, "posix_fallocate", _no_space)
    info.main([], comm=WORLD)
    out = capsys.readouterr().out
    ok = ok and (RANK != 0 or SIZE == 1 or "host memory: no (cannot allocate" in out)
    util.assert_all(WORLD, ok, out)
