"""The shared-memory schedules (algorithms/shared.py) on the simulator, with node memory checked.

tests/support/schedsim.py runs every rank's schedule in one process, node
memory as one array per rank shared by every schedule naming it, and checks
with vector clocks that no rank reads a peer's element before the write it
reads was synchronised, overwrites one before the readers were done, or ends
while a peer's access to its memory is not ordered before its end.  Here:
every shared builder on node layouts (one node is in test_schedules.py's
generic cases), the AllReduce on the ranks' own buffers (``Shape.mapped``,
each rank's input and output bound apart or to its own SRC and DST), broken
variants that the checks must catch, and what travels as messages (0 bytes)
and how many syncs a call takes.
"""

from __future__ import annotations

import random

import pytest
from support import schedsim as sim
from support import util

from mpicoll.algorithms import ring, shared
from mpicoll.algorithms.schedule import Fold, Recv, Send, Wait, node_role
from mpicoll.transport import topology

pytestmark = pytest.mark.local  # simulated ranks in one process: no MPI peer

BUILDERS = [(c, n, b) for (c, n), b in shared.SCHEDULES.items()]
IDS = [f"{c}-{n}" for c, n, _ in BUILDERS]
LAYOUTS = [(0, 0, 1, 1), (0, 1, 0, 1), (0, 0, 1, 2), (0, 1, 2, 0), (0, 0, 0, 1, 1),
           (0, 1, 0, 1, 0), (0, 0, 1, 1, 2, 2), (5, 5, 2), (0, 1), (0, 1, 2)]


def _layouts(collective, n):
    if collective == "allreduce":
        return [((N,), (0,), N) for N in (0, 1, n - 1, n, 2 * n + 1, 37, 300)]
    return [(c, [sum(c[:r]) for r in range(n)], sum(c))
            for c in ([3] * n, ring.split(2 * n + 1, n)[0], [0] * n, [0] * (n - 1) + [5],
                      [1] + [0] * (n - 1), ring.split(300, n)[0])]


def _cases(collective):
    cases = []
    for nodes in LAYOUTS:
        n = len(nodes)
        for ring_order in (tuple(topology.ring_from_nodes(list(nodes))), tuple(range(n))):
            for counts, displs, length in _layouts(collective, n):
                for in_place in (False, True):
                    for model in sim.MODELS:
                        for tuning in ((1, 2), (3, 2), (64, 1)) if length < 100 else ((4, 2),):
                            cases.append((n, list(counts), list(displs), length, in_place, model,
                                          tuning, ring_order, nodes))
    return cases


@pytest.mark.timeout(600)
@pytest.mark.parametrize("collective,name,build", BUILDERS, ids=IDS)
def test_shared_on_node_layouts(collective, name, build):
    """Across nodes: the hierarchical composition, node memory inside each node (the segment
    is the slot the simulator's shapes take: 1, 3 and 4 elements make many chunks)."""
    for n, counts, displs, length, in_place, model, tuning, ring_order, nodes in \
            util.share(_cases(collective)):
        sim.run_case(collective, build, n, counts, displs, length, in_place, model, tuning, "sum",
                     ring_order, nodes)


@pytest.mark.parametrize("collective,name,build", BUILDERS, ids=IDS)
def test_engine_slot_and_messages(collective, name, build):
    """With the engine's slot (``shape.shared``) the chunks are of that many elements; every
    message carries 0 bytes; each rank's node memory is two slots; the syncs are one per
    chunk (AllReduce two-shot: its two phases) plus the last."""
    n, slot, total = 3, 8, 50
    counts = ring.split(total, n)[0]
    for rank in range(n):
        sh = sim.shape(collective, n, rank, counts=None if collective == "allreduce" else counts,
                       total=total if collective == "allreduce" else None)._replace(shared=slot)
        sched = build(sh)
        assert all(op.region.count == 0 for op in sched.sends() + sched.recvs())
        assert sorted(q for q, _ in sched.shared.values()) == list(range(n))
        assert {k for _, k in sched.shared.values()} == {2 * slot}
        syncs = len({op.label.step for op in sched.sends()})
        per = slot // n  # elements of each block in a reduce chunk
        want = {
            ("allreduce", shared.ONESHOT): -(-total // slot) + 1,
            ("allreduce", shared.TWOSHOT): -(-max(counts) // per) + -(-max(counts) // slot) + 1,
            ("reduce_scatter", shared.NAME): -(-max(counts) // per) + 1,
            ("allgather", shared.NAME): -(-max(counts) // slot) + 1,
        }[(collective, name)]
        assert syncs == want, (collective, name, rank, syncs, want)
        assert sim.traffic(sched, 4).bytes_sent == 0


MAPPED = [(name, shared.SCHEDULES[("allreduce", name)])
          for name in (shared.ONESHOT, shared.TWOSHOT)]


def _mapped_layouts(collective, n):
    """Counts of one node of ``n``: _layouts', with AllReduce's small totals, and
    (AllGather) blocks with gaps between them in another order."""
    if collective == "allreduce":
        return [([t], [0], t) for t in sorted({0, 1, n - 1, n, 2 * n + 1, 37})]
    out = [(list(c), list(d), t) for c, d, t in _layouts(collective, n)]
    if collective == "allgather":
        counts = [3 + r % 2 for r in range(n)]
        out.append((counts, *sim.scattered(counts, random.Random(n))))
    return out


@pytest.mark.parametrize("collective,name,build", BUILDERS, ids=IDS)
@pytest.mark.parametrize("mapped", ["apart", "own"])
def test_mapped_schedules(collective, name, build, mapped):
    """On the ranks' own buffers, one node of 1-5 ranks: every count layout, in place and
    not, eager and rendezvous, a sum and a non-commutative op (bitwise the rank-order fold,
    the same bits on every rank), each rank's input and output apart (a buffer of its own)
    or its SRC and DST themselves (registered): every access of a peer's synchronised."""
    ops = ("sum",) if collective == "allgather" else ("sum", "affine")
    for n in range(1, 6):
        for counts, displs, length in _mapped_layouts(collective, n):
            for in_place in (False, True):
                for model in sim.MODELS:
                    for op in ops:
                        sim.run_case(collective, build, n, counts, displs, length, in_place,
                                     model, op=op, mapped=mapped)


@pytest.mark.parametrize("name,build", MAPPED, ids=[name for name, _ in MAPPED])
def test_mapped_one_fold_two_syncs(name, build):
    """On the ranks' own buffers: no slots, 0-byte messages, two syncs, one Fold of every
    rank's input in local-rank order (two shot: into every rank's output)."""
    n, total = 4, 50
    for rank in range(n):
        sched = build(sim.shape("allreduce", n, rank, total=total, mapped=True))
        roles = sorted({node_role(k) for k in sched.shared})
        assert roles == (["src"] if name == shared.ONESHOT else ["dst", "src"]), roles
        assert sorted({q for q, _ in sched.shared.values()}) == list(range(n))
        assert all(op.region.count == 0 for op in sched.sends() + sched.recvs())
        assert len({op.label.step for op in sched.sends()}) == 2
        folds = [op for op in sched.ops if type(op) is Fold]
        assert len(folds) == 1 and len(folds[0].xs) == n
        assert len(folds[0].outs) == (1 if name == shared.ONESHOT else n)


@pytest.mark.parametrize("name,build", MAPPED, ids=[name for name, _ in MAPPED])
@pytest.mark.parametrize("which", [0, -1])
@pytest.mark.parametrize("mapped", ["apart", "own"])
def test_mapped_missing_sync_is_caught(name, build, which, mapped):
    """Leave out the sync before the fold or the last one: caught, also where each rank's
    input is its SRC itself (no copy into a buffer of its own to see)."""
    broken = _drop_wait(build, which)
    with pytest.raises(sim.ScheduleError):
        sim.run_case("allreduce", broken, 3, [20], [0], 20, True, "eager", mapped=mapped)


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather"])
@pytest.mark.parametrize("which", [0, -1])
def test_mapped_blocks_missing_sync_is_caught(collective, which):
    """The same for ReduceScatter and AllGather on the ranks' own buffers."""
    broken = _drop_wait(shared.SCHEDULES[(collective, shared.NAME)], which)
    with pytest.raises(sim.ScheduleError):
        sim.run_case(collective, broken, 3, [4, 5, 3], [0, 4, 9], 12, False, "eager",
                     mapped="own")


def _drop_wait(build, which):
    """``build`` with its ``which``-th Wait and the messages it waits for left out."""
    def broken(shape):
        sched = build(shape)
        ops = list(sched.ops)
        waits = [i for i, o in enumerate(ops) if type(o) is Wait]
        if not waits:
            return sched
        w = waits[which]
        gone = set(ops[w].handles) | {w}
        keep = [i for i in range(len(ops)) if i not in gone]
        renumber = {old: new for new, old in enumerate(keep)}
        out = []
        for i in keep:
            o = ops[i]
            if type(o) is Wait:
                o = Wait(tuple(renumber[h] for h in o.handles))
            out.append(o)
        return sched._replace(ops=tuple(out))
    broken.__name__ = f"{build.__name__}_without_wait_{which}"
    return broken


def _run(collective, build, n=3, total=20, segment=3, nodes=()):
    counts = ring.split(total, n)[0]
    if collective == "allreduce":
        counts, displs, length = [total], [0], total
    else:
        displs, length = [sum(counts[:r]) for r in range(n)], total
    sim.run_case(collective, build, n, counts, displs, length, False, "eager", (segment, 2),
                 "sum", None, nodes)


@pytest.mark.parametrize("collective,name,build", BUILDERS, ids=IDS)
@pytest.mark.parametrize("which", [0, 1, -1])
def test_missing_sync_is_caught(collective, name, build, which):
    """Leave out a sync (the first, the second, the last): the node memory checks fail,
    though eager messages and the simulator's round-robin order would not show it in the data."""
    with pytest.raises(sim.ScheduleError):
        _run(collective, _drop_wait(build, which))


@pytest.mark.parametrize("collective,name,build", BUILDERS, ids=IDS)
def test_one_slot_is_caught(collective, name, build, monkeypatch):
    """With one slot instead of two, a rank rewrites its slot while a peer may still read the
    chunk before: caught."""
    real = shared._Node.mem

    def one_slot(self, q, start, stop):
        chunks, self.chunks = self.chunks, 0
        try:
            return real(self, q, start, stop)
        finally:
            self.chunks = chunks

    monkeypatch.setattr(shared._Node, "mem", one_slot)
    with pytest.raises(sim.ScheduleError):
        _run(collective, build)


def test_foreign_node_memory_is_caught():
    """A schedule naming the node memory of a rank of another node is refused."""
    def reach(shape):
        sched = shared.allreduce_oneshot(shape._replace(nodes=()))
        return sched
    with pytest.raises(sim.ScheduleError, match="not on its node"):
        _run("allreduce", reach, n=2, nodes=(0, 1))


def test_one_rank_per_node_uses_no_node_memory():
    """Nodes of one rank each: the composition is the hierarchical ring, no node memory."""
    for collective, name, build in BUILDERS:
        for rank in range(3):
            sh = sim.shape(collective, 3, rank, counts=None if collective == "allreduce"
                           else [4, 4, 4], total=12 if collective == "allreduce" else None,
                           nodes=(0, 1, 2))
            sched = build(sh)
            assert not sched.shared, (collective, name)
            assert not any(type(op) in (Send, Recv) and op.region.count == 0 and op.label
                           and op.label.phase.startswith("node") for op in sched.ops)
