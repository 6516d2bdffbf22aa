"""Every schedule builder, run by tests/support/schedsim.py on all ranks at once (NumPy only, no messages).

For each builder in the modules' ``SCHEDULES`` registries (see
:data:`BUILDERS`), at 1..8 ranks, several count patterns (0, 1, fewer than
the ranks, uneven, a thousand), in and out of place, AllGather's packed and
scattered (gaps, any order) layouts, eager and rendezvous transport and
several segment/window tunings:

* results equal a NumPy reference bitwise (SUM on integer-valued floats; the
  non-commutative "affine" op for order-preserving algorithms, where every
  rank must also hold the same bits);
* inputs are unchanged unless in place (in place: what lies beyond the
  result, and AllGather's gaps);
* the simulator's own checks hold: no deadlock, sizes match, regions within
  their buffers, nothing touched while a message is in flight on it;
* every message has a label whose count is its size;
* broken variants of a builder are caught (so the checks can fail).

Then what a call can select (``engine.select.BUILDERS``), on rendezvous transport
alone, at 1-7 ranks, with ring orders and tunings of their own; the ring
ReduceScatter's work memory bound; and the simulator's own catches (a deadlock,
a buffer reused or read too early).

Under an MPI launcher the cases are shared out over the ranks, so the file
takes the same time at any -n.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
from mpi4py import MPI
from support import schedsim as sim
from support import util

from mpicoll.algorithms import bruck, direct, halving, hierarchical, recursive, ring, schedule, shared
from mpicoll.algorithms.schedule import DST, SRC, Builder, Label, Recv, Reduce, Region, Send, Wait
from mpicoll.engine import select as _select

pytestmark = pytest.mark.local  # simulated ranks in one process: no MPI peer

WORLD = MPI.COMM_WORLD


def _registry():
    """(collective, algorithm, builder) of every module that has a SCHEDULES table.

    Keys are ``(collective, algorithm)``; a module may also key by collective
    alone, its algorithm then being ``default``.
    """
    out = []
    for mod, default in ((ring, "ring"), (recursive, "recursive_doubling"), (halving, None),
                         (bruck, "bruck"), (direct, None), (hierarchical, None), (shared, None)):
        for key, build in getattr(mod, "SCHEDULES", {}).items():
            collective, algorithm = key if isinstance(key, tuple) else (key, default)
            out.append((collective, algorithm, build))
    return out


BUILDERS = _registry()
SHARED = [name for _, name in shared.SCHEDULES]
ORDER_PRESERVING = _select.ORDER_PRESERVING
TUNINGS = [(1, 1), (3, 2), (2, 5), (1 << 17, 2)]  # (segment elements, window)


def _cases(collective, algorithm):
    """(n, counts, displs, length, in_place, model, tuning, op, ring order) of one builder."""
    rng = random.Random(zlib.crc32(f"{collective} {algorithm}".encode()))
    cases = []
    ops = ["sum", "affine"] if algorithm in ORDER_PRESERVING and collective != "allgather" else ["sum"]
    # 1..8 ranks: 8 is the largest power of two here, 5-7 the shapes beside it (4 + 1,
    # even, one short); 9 ranks would repeat 5's shape (a power of two + 1) at the
    # highest cost of any count
    for n in range(1, 9):
        if collective == "allreduce":
            layouts = [((N,), (0,), N) for N in sorted({0, 1, max(n - 1, 0), n, 2 * n + 1, 37, 1000})]
        else:
            layouts = []
            for counts in sim.count_patterns(n, rng):
                layouts.append((counts, [sum(counts[:r]) for r in range(n)], sum(counts)))
                if collective == "allgather":
                    layouts.append((counts, *sim.scattered(counts, rng)))
        rings = [None, tuple(range(n))[::-1]] if algorithm == "ring" else [None]
        for counts, displs, length in layouts:
            for op in ops:
                for k, (in_place, model) in enumerate((a, b) for a in (False, True) for b in sim.MODELS):
                    # the tuning only matters to the ring: the others get one each, in turn
                    tunings = TUNINGS if algorithm == "ring" else [TUNINGS[(k + n + length) % len(TUNINGS)]]
                    if length > 100:  # tiny segments of a large array: many ops, nothing new
                        tunings = [t for t in tunings if t[0] >= 64] or [(64, 2)]
                    for tuning in tunings:
                        for ring_order in rings:
                            cases.append((n, list(counts), list(displs), length, in_place, model,
                                          tuning, op, ring_order))
    return cases


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective,algorithm,build", BUILDERS,
                         ids=[f"{c}-{a}" for c, a, _ in BUILDERS])
def test_schedule_matches_reference(collective, algorithm, build):
    for n, counts, displs, length, in_place, model, tuning, op, ring_order in \
            util.share(_cases(collective, algorithm)):
        sim.run_case(collective, build, n, counts, displs, length, in_place, model, tuning, op, ring_order)


# Node layouts for the hierarchical algorithms: equal and uneven ranks per node, block
# and round-robin placement, labels out of order, one rank per node (no lane peer).
LAYOUTS = [(0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 1, 2), (0, 1, 2, 0), (0, 0, 0, 1, 1), (0, 1, 0, 1, 0),
           (0, 0, 1, 1, 2, 2), (0, 1, 2, 0, 1, 2), (5, 5, 2), (0, 1), (0, 1, 2)]


def _layout_cases(collective):
    from mpicoll.transport import topology
    cases = []
    for nodes in LAYOUTS:
        n = len(nodes)
        if collective == "allreduce":
            layouts = [((N,), (0,), N) for N in (0, 1, n - 1, n, 2 * n + 1, 37, 1000)]
        else:
            layouts = [(c, [sum(c[:r]) for r in range(n)], sum(c))
                       for c in ([3] * n, ring.split(2 * n + 1, n)[0], [0] * n, [0] * (n - 1) + [5],
                                 [1] + [0] * (n - 1), ring.split(1000, n)[0])]
        # the context's ring (nodes together) and the identity: the builder follows either
        for ring_order in (tuple(topology.ring_from_nodes(list(nodes))), tuple(range(n))):
            for counts, displs, length in layouts:
                for in_place in (False, True):
                    for model in sim.MODELS:
                        for tuning in ((3, 2), (64, 1)) if length < 100 else ((64, 2),):
                            cases.append((n, list(counts), list(displs), length, in_place, model,
                                          tuning, ring_order, nodes))
    return cases


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_hierarchical_on_node_layouts(collective):
    """The hierarchical builders on simulated node layouts; across nodes only the model's bytes."""
    build = hierarchical.SCHEDULES[(collective, "hierarchical")]
    for n, counts, displs, length, in_place, model, tuning, ring_order, nodes in \
            util.share(_layout_cases(collective)):
        sim.run_case(collective, build, n, counts, displs, length, in_place, model, tuning, "sum",
                 ring_order, nodes)
    # bytes each node sends to other nodes, 2 nodes x 2 ranks, 1200 elements: half the ring's
    # 2(n-1)/n for AllReduce (2(k-1)/k * N = 1.0 N against 1.5 N), (k-1)/k * N for the others
    n, total, nodes = 4, 1200, (0, 1, 0, 1)
    ring_order = (0, 2, 1, 3)
    counts = ring.split(total, n)[0]
    shapes = [sim.shape(collective, n, r, counts=None if collective == "allreduce" else counts,
                        total=total if collective == "allreduce" else None, ring=ring_order,
                        segment=64, nodes=nodes) for r in range(n)]
    out = [0, 0]
    for r, sh in enumerate(shapes):
        for o in build(sh).sends():
            assert o.region.count <= 16 * 64  # pieces, never a whole step
            if nodes[o.peer] != nodes[r]:
                out[nodes[r]] += o.region.count
    assert out == [total if collective == "allreduce" else total // 2] * 2


PIPELINED = [(c, a) for c, a in (
    ("allreduce", "recursive_doubling"), ("allreduce", "rabenseifner"), ("allreduce", "direct"),
    ("allreduce", "hierarchical"), ("reduce_scatter", "recursive_halving"),
    ("reduce_scatter", "recursive_doubling"), ("reduce_scatter", "hierarchical"),
    ("allgather", "bruck"), ("allgather", "recursive_doubling"), ("allgather", "hierarchical"))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective,algorithm", PIPELINED, ids=[f"{c}-{a}" for c, a in PIPELINED])
def test_pipelines_of_chunks(collective, algorithm):
    """A pipeline (algorithms.pipeline) of 3 or 5 chunks, run in order by the simulator: the
    results of the algorithm itself, every chunk's messages matched in its own tag, work
    buffers in slots (chunk c's slot reused by chunk c + depth), node layouts; the chunks
    name contiguous ranges of ops."""
    from mpicoll.algorithms import pipeline

    base = _select.builder(collective, algorithm)
    for chunks in (3, 5):
        build = pipeline.builder(collective, algorithm, base, chunks,
                                 _select.ALGORITHMS["allreduce"].get(algorithm))
        for n, counts, displs, length, in_place, model, tuning, ring_order, nodes in \
                util.share(_layout_cases(collective)):
            if in_place and collective == "reduce_scatter" or min(counts or (length,)) < chunks:
                continue  # (not pipelined: engine.run, algorithms.pipeline.applies)
            sim.run_case(collective, build, n, counts, displs, length, in_place, model, tuning,
                         "sum", ring_order, nodes)
        sh = sim.shape(collective, 4, 0, counts=(40,) * 4, displs=(0, 40, 80, 120),
                       total=160, nodes=(0, 0, 1, 1))
        sched = build(sh)
        assert len(sched.parts) == chunks and sched.depth == pipeline.PIPELINE_DEPTH
        assert [a for a, _ in sched.parts] == [0] + [b for _, b in sched.parts[:-1]]
        for c, (a, b) in enumerate(sched.parts):
            assert {op.chunk for op in sched.ops[a:b] if type(op) in (Send, Recv)} <= {c}


@pytest.mark.timeout(600)
def test_rabenseifner_on_node_layouts():
    """Across nodes Rabenseifner pairs ranks by ring position: right on every layout, and its
    first, largest exchange stays inside a node whatever the placement (1.0 N on each node
    link at 2 nodes x 2 ranks, block or round-robin, where pairing by rank puts 2.0 N under block)."""
    build = halving.SCHEDULES[("allreduce", "rabenseifner")]
    for n, counts, displs, length, in_place, model, tuning, ring_order, nodes in \
            util.share(_layout_cases("allreduce")):
        sim.run_case("allreduce", build, n, counts, displs, length, in_place, model, tuning, "sum",
                 ring_order, nodes)
    from mpicoll.transport import topology
    total = 1200
    for nodes in ((0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 0, 0, 1, 1, 1, 1), (0, 1, 0, 1, 0, 1, 0, 1)):
        n, ring_order = len(nodes), tuple(topology.ring_from_nodes(list(nodes)))
        out = {}
        for r in range(n):
            sh = sim.shape("allreduce", n, r, total=total, ring=ring_order, nodes=nodes)
            for o in build(sh).sends():
                if nodes[o.peer] != nodes[r]:
                    out[nodes[r]] = out.get(nodes[r], 0) + o.region.count
        # 2(k-1)/k * N for k = 2 nodes, whatever the ranks per node
        assert out == {0: total, 1: total}, (nodes, out)
    # on one node the schedule is the textbook one: pairs by rank
    sh = sim.shape("allreduce", 4, 0, total=total, ring=(0, 2, 1, 3))
    assert build(sh).sends()[0].peer == 2


RECURSIVE = [("allreduce", recursive.allreduce_schedule),
             ("reduce_scatter", recursive.reduce_scatter_schedule),
             ("allgather", recursive.allgather_schedule),
             ("reduce_scatter", halving.reduce_scatter_schedule)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective,build", RECURSIVE,
                         ids=[f"{c}-{b.__module__.split('.')[-1]}" for c, b in RECURSIVE])
def test_recursive_on_node_layouts(collective, build):
    """Across nodes recursive doubling and halving pair ranks by ring position (as Rabenseifner):
    right on every layout, also with scattered blocks and (doubling) a non-commutative op, which
    keeps rank order; the bytes on each node link are the same under block and round-robin
    placement; on one node the schedule pairs by rank (the textbook one)."""
    from mpicoll.transport import topology
    ops = ("sum",) if build is halving.reduce_scatter_schedule or collective == "allgather" \
        else ("sum", "affine")
    for op in ops:
        for n, counts, displs, length, in_place, model, tuning, ring_order, nodes in \
                util.share(_layout_cases(collective)):
            sim.run_case(collective, build, n, counts, displs, length, in_place, model, tuning, op,
                     ring_order, nodes)
    if collective != "allreduce":
        rng = random.Random(7)
        for nodes in ((0, 1, 0, 1), (0, 1, 2, 0, 1)):
            n = len(nodes)
            counts = [rng.randrange(4) for _ in range(n)]
            displs, length = sim.scattered(counts, rng)
            for in_place in (False, True):
                sim.run_case(collective, build, n, counts, displs, length, in_place, "eager", (3, 2),
                         "sum", tuple(topology.ring_from_nodes(list(nodes))), nodes)
    total = 1200

    def link_elements(nodes):
        return sim.node_link_elements(collective, build, nodes, total)

    for block, round_robin in (((0, 0, 1, 1), (0, 1, 0, 1)),
                               ((0, 0, 0, 1, 1, 1), (0, 1, 0, 1, 0, 1)),
                               ((0, 0, 1, 1, 2, 2), (0, 1, 2, 0, 1, 2))):
        assert link_elements(block) == link_elements(round_robin), (block, round_robin)
    if build is halving.reduce_scatter_schedule or collective == "allgather":
        # largest exchange (half the array) inside the node, only the quarter steps cross:
        # (k-1)/k * N per node link at 2 nodes x 2 ranks, where pairing by rank puts N under block
        assert link_elements((0, 0, 1, 1)) == {0: total // 2, 1: total // 2}
    # on one node the schedule is the textbook one: pairs by rank
    counts = None if collective == "allreduce" else [5] * 4
    sh = sim.shape(collective, 4, 0, counts=counts, total=20 if counts is None else None,
                   ring=(0, 2, 1, 3))
    assert build(sh).sends()[0].peer == (2 if build is halving.reduce_scatter_schedule else 1)
    assert recursive.ids(sh) == (0, recursive.ids(sh)[1]) and recursive.ids(sh)[1](2) == 2


@pytest.mark.parametrize("collective,algorithm,build", BUILDERS,
                         ids=[f"{c}-{a}" for c, a, _ in BUILDERS])
def test_every_message_is_a_piece(collective, algorithm, build):
    """No algorithm sends more than a piece in one message: 6 ranks on 3 nodes, uneven,
    segments of 8 elements.  A piece to another node is a segment (the ring's AllGather: its
    pieces of AG_SEGMENT_FACTOR segments); to a rank of the same node the pairwise schedules'
    is LOCAL_PIECE_FACTOR segments (every piece a rendezvous of its own there), and the
    schedules that cut one message into pieces (not the ring's segments, nor direct's, whose
    blocks are cut alike for every rank) use it."""
    if WORLD.rank != 0:
        pytest.skip("single-process check, run on rank 0")
    n, seg, nodes = 6, 8, (0, 0, 0, 1, 1, 2)
    counts = ring.split(1001, n)[0]
    across = seg * (ring.AG_SEGMENT_FACTOR if collective == "allgather" else 1)
    inside = max(across, seg * schedule.LOCAL_PIECE_FACTOR)
    largest = {True: 0, False: 0}  # same node: largest message
    for r in range(n):
        sh = sim.shape(collective, n, r, counts=None if collective == "allreduce" else counts,
                       total=1001 if collective == "allreduce" else None, segment=seg,
                       nodes=nodes)
        for o in build(sh).sends():
            same = nodes[o.peer] == nodes[r]
            assert o.region.count <= (inside if same else across), (algorithm, r, o)
            largest[same] = max(largest[same], o.region.count)
    # (the shared algorithms send nothing to a rank of their node: 0-byte syncs)
    if algorithm not in ("ring", "direct", "hierarchical", *SHARED):
        assert largest[False] <= seg < largest[True], largest


@pytest.mark.parametrize("collective,algorithm,build", BUILDERS,
                         ids=[f"{c}-{a}" for c, a, _ in BUILDERS])
def test_staged_messages_are_one_segment(collective, algorithm, build):
    """Staged through host copies (device arrays, transport.staging), no message is longer
    than the staged segment (STAGED_SEGMENT_FACTOR segments), to any peer, and the ring's
    and the pieces' are that long: the staging channel copies a message whole into one
    pinned buffer, so a longer one would hold that much pinned memory and copy without
    overlap, and a shorter one pays a copy's and a message's cost for fewer bytes."""
    if WORLD.rank != 0:
        pytest.skip("single-process check, run on rank 0")
    n, seg, nodes = 6, 8, (0, 0, 0, 1, 1, 2)
    staged = seg * schedule.STAGED_SEGMENT_FACTOR
    counts = ring.split(4001, n)[0]
    longest = 0
    for r in range(n):
        sh = sim.shape(collective, n, r, counts=None if collective == "allreduce" else counts,
                       total=4001 if collective == "allreduce" else None, segment=seg,
                       nodes=nodes, staged=True)
        assert sh.message_segment == staged
        for o in build(sh).sends():
            assert o.region.count <= staged, (algorithm, r, o)
            longest = max(longest, o.region.count)
    assert longest == staged, longest


# --- the checks catch broken schedules ------------------------------------------------

def _mutated(build, change):
    """A builder whose schedules are ``build``'s with ``change(shape, ops) -> ops`` applied."""
    def broken(shape):
        s = build(shape)
        return s._replace(ops=tuple(change(shape, list(s.ops))))
    broken.__name__ = f"broken_{build.__name__}"
    broken.__module__ = build.__module__
    return broken


def _swap_first_peer(shape, ops):
    """Rank 1 sends its first message to the wrong rank."""
    for i, o in enumerate(ops):
        if shape.rank == 1 and type(o) is Send:
            ops[i] = o._replace(peer=(o.peer + 1) % shape.size)
            break
    return ops


def _swap_operands(shape, ops):
    return [Reduce(o.b, o.a, o.out) if type(o) is Reduce else o for o in ops]


def _drop_waits(shape, ops):
    return [Wait(()) if type(o) is Wait else o for o in ops]


def _send_first(shape, ops):
    """Every exchange (Recv, Send, Wait) becomes send-and-wait, then receive: head to head."""
    b, new, i = Builder(), {}, 0
    while i < len(ops):
        o = ops[i]
        if type(o) is Recv and i + 2 < len(ops) and type(ops[i + 1]) is Send and type(ops[i + 2]) is Wait:
            s = ops[i + 1]
            b.wait(b.send(s.peer, s.region, s.label))
            b.wait(b.recv(o.peer, o.region, o.label))
            i += 3
            continue
        if type(o) is Send:
            new[i] = b.send(o.peer, o.region, o.label)
        elif type(o) is Recv:
            new[i] = b.recv(o.peer, o.region, o.label)
        elif type(o) is Wait:
            b.wait(*(new[h] for h in o.handles))
        else:
            b.ops.append(o)
        i += 1
    return list(b.build(0).ops)


@pytest.mark.parametrize("change,model,op,expect", [
    (_swap_first_peer, "eager", "sum", sim.ScheduleError),
    (_swap_operands, "eager", "affine", AssertionError),
    (_drop_waits, "eager", "sum", sim.ScheduleError),
    (_send_first, "rendezvous", "sum", sim.Deadlock),
])
def test_checks_catch_a_broken_builder(change, model, op, expect):
    """Each mutation of recursive doubling AllReduce is caught; the unbroken one passes."""
    if WORLD.rank != 0:
        pytest.skip("single-process check, run on rank 0")
    # (segments of 64: each exchange one message each way, the pattern _send_first turns)
    sim.run_case("allreduce", recursive.allreduce_schedule, 5, (9,), (0,), 9, False, model, (64, 2), op=op)
    with pytest.raises(expect):
        sim.run_case("allreduce", _mutated(recursive.allreduce_schedule, change), 5, (9,), (0,), 9,
                 False, model, (64, 2), op=op)


# --- readers of the schedules: the ring diagram -------------------------------------------

def handmade_ring_allreduce(shape):
    """A minimal ring AllReduce schedule (no segments), standing in for ring.py's builder
    in the diagram test until that builder exists."""
    n, p, N = shape.size, shape.ring_pos, shape.total
    right, left = shape.ring[(p + 1) % n], shape.ring[(p - 1) % n]
    counts, displs = ring.split(N, n)
    b = Builder()
    chunk = [Region(DST, displs[q], displs[q] + counts[q]) for q in range(n)]
    if not shape.in_place and N:
        b.copy(Region(DST, 0, N), Region(SRC, 0, N))
    tmp = b.buffer("incoming chunk", max(counts))
    for phase, first, send_off, recv_off in (("reduce-scatter", 0, 1, 2), ("allgather", n - 1, 0, 1)):
        for s in range(n - 1):
            sb, rb = (p - send_off - s) % n, (p - recv_off - s) % n
            into = Region(tmp, 0, counts[rb]) if phase == "reduce-scatter" else chunk[rb]
            r = b.recv(left, into, Label(first + s, phase, rb, 0, counts[rb])) if counts[rb] else None
            t = b.send(right, chunk[sb], Label(first + s, phase, sb, 0, counts[sb])) if counts[sb] else None
            b.wait(r, t)
            if phase == "reduce-scatter" and counts[rb]:
                b.reduce(into, chunk[rb], chunk[rb])
    return b.build(2 * (n - 1))


def _diagram_module():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = root / "benchmarks" / "make_ring_diagram.py"
    spec = importlib.util.spec_from_file_location("make_ring_diagram", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, root / "docs" / "ring.svg"


def test_handmade_ring_is_a_ring_allreduce():
    if WORLD.rank != 0:
        pytest.skip("single-process check, run on rank 0")
    for n in range(1, 7):
        for N in (0, 1, n, 3 * n + 1):
            for in_place in (False, True):
                for model in sim.MODELS:
                    sim.run_case("allreduce", handmade_ring_allreduce, n, (N,), (0,), N, in_place, model)


def test_ring_diagram_reads_the_schedule():
    """benchmarks/make_ring_diagram.py draws docs/ring.svg from a ring schedule's labels."""
    if WORLD.rank != 0:
        pytest.skip("single-process check, run on rank 0")
    diagram, svg = _diagram_module()
    builders = [handmade_ring_allreduce] + [b for c, a, b in BUILDERS if (c, a) == ("allreduce", "ring")]
    for build in builders:
        assert diagram.draw(4, build) == svg.read_text(encoding="utf-8"), build
        for n in range(2, 9):
            assert diagram.draw(n, build).startswith("<svg")
    # a schedule whose messages do not follow the ring is refused
    with pytest.raises(AssertionError):
        diagram.draw(4, _mutated(handmade_ring_allreduce, _swap_first_peer))


# --- readers of the schedules: traffic counts ------------------------------------------------

def test_traffic_of_recursive_doubling_is_test_traffics_formula():
    """sim.traffic() of a schedule gives what tests/tools/test_traffic.py's hand formula expects."""
    N, itemsize = 10, 8
    for n in range(1, 10):
        pof2 = 1 << (n.bit_length() - 1)
        rem, rounds = n - pof2, pof2.bit_length() - 1
        for rank in range(n):
            if rank < 2 * rem:
                msgs, nsteps = (1, 1) if rank % 2 == 0 else (rounds + 1, rounds + 1)
            else:
                msgs, nsteps = rounds, rounds
            want = (msgs, msgs * N * itemsize, msgs, msgs * N * itemsize, nsteps)
            s = recursive.allreduce_schedule(sim.shape("allreduce", n, rank, total=N))
            assert tuple(sim.traffic(s, itemsize))[:5] == want, f"n={n} rank={rank}"


# --- recursive doubling: what the partners of an exchange compute ---------------------------

def _exchange_reduces(n, rank, in_place):
    """The reductions that follow this rank's exchanges (fold excluded), each as the
    aliasing of its output: "a" or "b" (written over that operand) or "new"."""
    s = recursive.allreduce_schedule(sim.shape("allreduce", n, rank, total=5, in_place=in_place))
    out, last_recv = [], None
    for op in s.ops:
        if type(op) is Recv:
            last_recv = op.label.phase
        elif type(op) is Reduce and last_recv == "exchange":
            out.append("a" if op.out == op.a else "b" if op.out == op.b else "new")
    return s, out


def test_recursive_doubling_partners_alias_alike_and_copy_nothing():
    """Both partners of every exchange reduce with the same aliasing (NumPy may round
    differently when the output is a separate array, and they must get the same bits);
    an out-of-place 2-rank AllReduce is one exchange and one reduction on both ranks."""
    for n in range(2, 10):
        pof2, rem = recursive.fold(n)
        for in_place in (False, True):
            pattern = {}
            for rank in range(n):
                s, reduces = _exchange_reduces(n, rank, in_place)
                if n == 2 and not in_place:
                    assert [type(op).__name__ for op in s.ops] == ["Recv", "Send", "Wait",
                                                                   "Reduce"], rank
                new = recursive.new_rank(rank, rem)
                if new >= 0:
                    pattern[new] = reduces
            for new, reduces in pattern.items():
                for k, how in enumerate(reduces):
                    assert pattern[new ^ (1 << k)][k] == how, (n, in_place, new, k)

# ---------------------------------------------------------------------------------------
# What a call can select: every builder of engine.select.BUILDERS on a strict network
# ---------------------------------------------------------------------------------------
# Rendezvous transport only, so a schedule that only works because MPI buffers small
# messages deadlocks, and one that touches a buffer while a message is in flight on it
# fails; 1-7 ranks, ring orders (the identity, reversed, a random one) and tunings.

SELECTABLE_TUNINGS = [(1, 1), (1, 2), (3, 3), (1 << 17, 2)]  # (segment elements, window)


def _rings(n, rng):
    """Ring orders: the identity, reversed, and a random one."""
    perm = list(range(n))
    rng.shuffle(perm)
    return [tuple(range(n)), tuple(range(n))[::-1], tuple(perm)]


def _simulate(collective, cases):
    """Run this rank's share of ``cases`` ((algorithm, n, counts, displs, length, in place,
    ring order, tuning, op)) on the schedule simulator, rendezvous transport."""
    for name, n, counts, displs, length, in_place, order, tuning, op in util.share(cases):
        sim.run_case(collective, _select.BUILDERS[collective][name], n, counts, displs, length,
                     in_place, "rendezvous", tuning, op, order)


# --- AllReduce --------------------------------------------------------------

def _allreduce_cases():
    rng = random.Random(1)
    cases = []
    for name in _select.BUILDERS["allreduce"]:
        for n in range(1, 8):
            for N in sorted({0, 1, max(n - 1, 0), n, 2 * n + 1, 37}):
                for order in _rings(n, rng)[: 3 if name == "ring" else 1]:
                    for tuning in SELECTABLE_TUNINGS:
                        cases.append((name, n, (N,), (0,), N, rng.random() < 0.5, order, tuning, "sum"))
                if name in _select.ORDER_PRESERVING:
                    for in_place in (False, True):
                        cases.append((name, n, (N,), (0,), N, in_place, None, (1, 2), "affine"))
    return cases


@pytest.mark.timeout(300)
def test_allreduce_simulated():
    """Every selectable AllReduce, 1-7 ranks, ring orders and tunings, SUM and a
    non-commutative op where the order is kept."""
    _simulate("allreduce", _allreduce_cases())


# --- ReduceScatter ----------------------------------------------------------

def _reduce_scatter_cases():
    rng = random.Random(2)
    cases = []
    for name in _select.BUILDERS["reduce_scatter"]:
        for n in range(1, 8):
            for counts in sim.count_patterns(n, rng)[:-1]:  # a thousand: test_schedule_matches_reference
                displs = [sum(counts[:r]) for r in range(n)]
                for order in _rings(n, rng)[: 3 if name == "ring" else 1]:
                    for tuning in SELECTABLE_TUNINGS:
                        cases.append((name, n, counts, displs, sum(counts), rng.random() < 0.5,
                                      order, tuning, "sum"))
                if name in _select.ORDER_PRESERVING:
                    cases.append((name, n, counts, displs, sum(counts), rng.random() < 0.5, None,
                                  (1, 2), "affine"))
    return cases


@pytest.mark.timeout(300)
def test_reduce_scatter_simulated():
    """Every selectable ReduceScatter, 1-7 ranks, the count patterns, ring orders, tunings."""
    _simulate("reduce_scatter", _reduce_scatter_cases())


# --- AllGather --------------------------------------------------------------

def _allgather_cases():
    rng = random.Random(3)
    cases = []
    for name in _select.BUILDERS["allgather"]:
        for n in range(1, 8):
            for counts in sim.count_patterns(n, rng)[:-1]:  # a thousand: test_schedule_matches_reference
                packed = ([sum(counts[:r]) for r in range(n)], sum(counts))
                for displs, length in (packed, sim.scattered(counts, rng)):
                    for order in _rings(n, rng)[: 3 if name == "ring" else 1]:
                        for tuning in SELECTABLE_TUNINGS[:3]:
                            cases.append((name, n, counts, displs, length, rng.random() < 0.5,
                                          order, tuning, "sum"))
    return cases


@pytest.mark.timeout(300)
def test_allgather_simulated():
    """Every selectable AllGather, 1-7 ranks, packed and scattered layouts, ring orders."""
    _simulate("allgather", _allgather_cases())


# --- bounded memory and the simulator itself ----------------------------------

def test_ring_reduce_scatter_memory_is_bounded():
    """Out of place, the ring ReduceScatter holds 2*window segments of work memory."""
    n, per, seg, win = 4, 1000, 16, 2
    build = _select.BUILDERS["reduce_scatter"]["ring"]
    counts = [per] * n
    res = sim.run_case("reduce_scatter", build, n, counts, [per * r for r in range(n)], per * n,
                       False, "rendezvous", (seg, win))
    assert res.dst(1).size == per
    for r in range(n):
        sh = sim.shape("reduce_scatter", n, r, counts=counts, segment=seg, window=win)
        assert sum(build(sh).work.values()) == 2 * win * seg


def test_harness_detects_deadlock_and_early_reuse():
    """The simulator must catch a head-to-head blocking exchange and a reused send buffer."""
    whole = Region(DST, 0, 4)

    def head_to_head(r):
        b = Builder()
        b.wait(b.send(1 - r, whole))  # both ranks send first and wait: no receive posted
        b.wait(b.recv(1 - r, whole))
        return b.build(2)

    def early_reuse(r):
        b = Builder()
        if r == 0:
            h = b.send(1, whole)
            b.copy(whole, Region(SRC, 0, 4))  # bug: the send has not completed
            b.wait(h)
        else:
            b.wait(b.recv(0, whole))
        return b.build(1)

    def early_read(r):
        b = Builder()
        if r == 0:
            b.wait(b.send(1, whole))
        else:
            h = b.recv(0, whole)
            b.copy(Region(SRC, 0, 4), whole)  # bug: the receive has not completed
            b.wait(h)
        return b.build(1)

    def run(make, alias=False):
        bufs = [{SRC: np.ones(4), DST: np.zeros(4)} for _ in range(2)]
        if alias:  # in place: SRC is DST's memory, which only addresses show
            for b in bufs:
                b[SRC] = b[DST]
        sim.simulate([make(0), make(1)], bufs, np.add, "rendezvous")

    with pytest.raises(sim.Deadlock):
        run(head_to_head)
    with pytest.raises(sim.ScheduleError, match="before it was waited"):
        run(early_reuse)
    with pytest.raises(sim.ScheduleError, match="touches memory of the Recv"):
        run(early_read)
    with pytest.raises(sim.ScheduleError, match="partially overlap|touches memory"):
        run(early_read, alias=True)
