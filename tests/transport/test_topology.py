"""Topology-aware ring order: fewest node crossings, and correct results on a permuted ring."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.engine import context as _context
from mpicoll.transport import topology as _topology

WORLD = MPI.COMM_WORLD


# --- ring order from node membership (no messages) ----------------------------

@pytest.mark.local
@pytest.mark.parametrize("nodes, ring", [
    ([0, 0, 1, 1], [0, 1, 2, 3]),                  # block placement: identity
    ([0, 1, 0, 1], [0, 2, 1, 3]),                  # cyclic over 2 nodes
    ([0, 1, 2, 0, 1, 2], [0, 3, 1, 4, 2, 5]),      # cyclic over 3 nodes
    ([5, 5, 2, 2, 5], [0, 1, 4, 2, 3]),            # labels need not be ordered
    ([1, 0, 1, 0], [0, 2, 1, 3]),                  # nodes ordered by their lowest rank
    ([7], [0]),
])
def test_ring_from_nodes(nodes, ring):
    assert _topology.ring_from_nodes(nodes) == ring


@pytest.mark.local
@pytest.mark.parametrize("n", [2, 5, 8, 12])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ring_crosses_each_node_once(n, k):
    for spec in (f"block:{k}", f"cyclic:{k}"):
        nodes = _topology.parse_fake_nodes(spec, n)
        ring = _topology.ring_from_nodes(nodes)
        assert sorted(ring) == list(range(n))
        used = len(set(nodes))
        assert _topology.crossings(ring, nodes) == (used if used > 1 else 0), spec
    # round-robin placement with the identity ring crosses at every link
    if k > 1 and n % k == 0:
        cyclic = _topology.parse_fake_nodes(f"cyclic:{k}", n)
        assert _topology.crossings(list(range(n)), cyclic) == n


@pytest.mark.local
def test_parse_fake_nodes():
    assert _topology.parse_fake_nodes("block:2", 5) == [0, 0, 0, 1, 1]
    assert _topology.parse_fake_nodes("cyclic:2", 5) == [0, 1, 0, 1, 0]
    assert _topology.parse_fake_nodes(" 3,3,1 ", 3) == [3, 3, 1]
    assert _topology.parse_fake_nodes("block:9", 3) == [0, 1, 2]
    for bad in ("block:0", "cyclic:x", "a,b", "0,1", "", "ring:2"):
        with pytest.raises(ValueError, match="MPICOLL_FAKE_NODES"):
            _topology.parse_fake_nodes(bad, 3)


# --- a real communicator with fake node membership ----------------------------

def _comm_with_nodes(spec, comm=WORLD):
    """A Dup of ``comm`` whose mpicoll context was built under MPICOLL_FAKE_NODES=spec."""
    old = os.environ.get("MPICOLL_FAKE_NODES")
    os.environ["MPICOLL_FAKE_NODES"] = spec
    try:
        dup = comm.Dup()
        _context.context(dup)
    finally:
        if old is None:
            del os.environ["MPICOLL_FAKE_NODES"]
        else:
            os.environ["MPICOLL_FAKE_NODES"] = old
    return dup


def test_real_nodes():
    """Without the override the node layout is the launch's: one node here, or the emulated cluster's.

    tests/cluster/cluster.sh exports MPICOLL_CLUSTER_NODES (the node of every
    rank); without it every rank shares this machine and the ring is the identity.
    """
    if os.environ.get("MPICOLL_FAKE_NODES"):
        pytest.skip("MPICOLL_FAKE_NODES is set for this run")
    comm = WORLD.Dup()
    try:
        spec = os.environ.get("MPICOLL_CLUSTER_NODES")
        placed = [int(k) for k in spec.split(",")] if spec else [0] * comm.size
        want = [placed.index(placed[r]) for r in range(comm.size)]  # lowest rank on r's node
        assert _topology.node_ids(comm) == want
        assert _context.context(comm).ring == _topology.ring_from_nodes(want)
    finally:
        comm.Free()


def _check_collectives(comm, algorithm):
    n, rank = comm.size, comm.rank
    for N in (0, 1, n - 1, 2 * n + 1, 1000):
        x = (np.arange(N) * 3 + rank * 7) % 11 + rank * 1000
        x = x.astype(np.int64)
        ref = np.empty_like(x)
        comm.Allreduce(x, ref, MPI.SUM)
        np.testing.assert_array_equal(mpicoll.allreduce(x, comm=comm, algorithm=algorithm), ref)
        # ReduceScatter: rank r gets block r (array_split rule), whatever the ring order
        blocks = np.array_split(ref, n)
        got = mpicoll.reduce_scatter(x, comm=comm, algorithm=algorithm)
        np.testing.assert_array_equal(got, blocks[rank], err_msg=f"reduce_scatter N={N}")
        # AllGather(v): blocks in rank order
        mine = np.full(rank % 3 + (N % 2), rank, dtype=np.int64)
        counts = comm.allgather(len(mine))
        got = mpicoll.allgather(mine, comm=comm, counts=counts, algorithm=algorithm)
        np.testing.assert_array_equal(got, np.repeat(np.arange(n), counts), err_msg=f"allgather N={N}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ["cyclic:2", "cyclic:3", "block:2"])
def test_fake_nodes_ring_and_results(spec):
    comm = _comm_with_nodes(spec)
    try:
        nodes = _topology.parse_fake_nodes(spec, WORLD.size)
        ctx = _context.context(comm)
        assert ctx.ring == _topology.ring_from_nodes(nodes)
        assert ctx.ring[ctx.ring_pos] == comm.rank
        _check_collectives(comm, "ring")
        _check_collectives(comm, "auto")
    finally:
        comm.Free()


@pytest.mark.timeout(120)
def test_fake_nodes_on_reversed_split():
    """Node labels follow COMM_WORLD ranks; the ring is built in the sub-communicator's ranks."""
    sub = WORLD.Split(0, WORLD.size - 1 - WORLD.rank)  # reversed rank order
    comm = _comm_with_nodes("cyclic:2", sub)
    try:
        world_nodes = _topology.parse_fake_nodes("cyclic:2", WORLD.size)
        nodes = [world_nodes[WORLD.size - 1 - r] for r in range(comm.size)]
        assert _context.context(comm).ring == _topology.ring_from_nodes(nodes)
        _check_collectives(comm, "ring")
    finally:
        comm.Free()
        sub.Free()


@pytest.mark.timeout(120)
@pytest.mark.skipif(WORLD.size < 2, reason="needs a peer")
def test_messages_are_cut_by_where_the_peer_is():
    """A message to a rank of this node moves as pieces of LOCAL_PIECE_BYTES, one to another
    node as pieces of PIECE_BYTES; both ends agree (the node labels were exchanged), so a
    message of every length between the two cuts arrives whole, whatever the placement."""
    from mpicoll.transport import channel as _channel
    comm = _comm_with_nodes("cyclic:2")
    try:
        ctx = _context.context(comm)
        nodes = [_topology.parse_fake_nodes("cyclic:2", WORLD.size)[r] for r in range(comm.size)]
        assert ctx.local == tuple(nodes[r] == nodes[comm.rank] for r in range(comm.size))
        ch = _channel.Channel(ctx.comm, MPI.BYTE, local=ctx.local)
        rank, n = comm.rank, comm.size
        nbytes = 3 * _channel.PIECE_BYTES + 5  # 4 pieces across nodes, 1 inside one
        right, left = (rank + 1) % n, (rank - 1) % n
        send = np.full(nbytes, rank, dtype=np.uint8)
        got = np.empty(nbytes, dtype=np.uint8)
        reqs = [ch.irecv(got, left), ch.isend(send, right)]
        for peer, req in ((left, reqs[0]), (right, reqs[1])):
            parts = len(req.parts) if type(req) is _channel.Pieces else 1
            assert parts == (1 if ctx.local[peer] else 4), (peer, parts)
        ch.waitall(reqs)
        assert (got == left).all()
        # the same through the collectives: ring AllGather blocks of that length
        out = mpicoll.allgather(send, comm=comm, algorithm="ring")
        np.testing.assert_array_equal(out, np.repeat(np.arange(n, dtype=np.uint8), nbytes))
    finally:
        comm.Free()


@pytest.mark.timeout(120)
@pytest.mark.skipif(WORLD.size < 2, reason="needs a peer")
def test_node_piece_is_the_ranks_least(monkeypatch):
    """MPICOLL_NODE_PIECE_BYTES set differently on each rank: the communicator cuts by the
    least (every rank's, exchanged with the node labels), so messages still match."""
    from mpicoll.transport import channel as _channel
    mine = (WORLD.rank + 1) * 100_000 + 3  # rank 0 the least; not a multiple of the element
    monkeypatch.setenv("MPICOLL_NODE_PIECE_BYTES", str(mine))
    comm = _comm_with_nodes("cyclic:2")
    try:
        ctx = _context.context(comm)
        assert ctx.node_piece == 100_003
        ch = _channel.Channel(ctx.comm, MPI.BYTE, local=ctx.local, node_bytes=ctx.node_piece)
        remote = [r for r in range(comm.size) if not ctx.local[r]]
        assert ch.piece_for(remote[0]) == 100_003
        n, rank = comm.size, comm.rank
        x = (np.arange(300_001) % 97 + rank).astype(np.float64)  # 2.4 MB: pieces every way
        ref = np.empty_like(x)
        comm.Allreduce(x, ref)
        for algorithm in ("ring", "recursive_doubling", "direct"):
            np.testing.assert_array_equal(mpicoll.allreduce(x, comm=comm, algorithm=algorithm),
                                          ref, err_msg=algorithm)
        got = mpicoll.allgather(x[: 200_000 + rank], comm=comm, counts=[200_000 + r for r in range(n)])
        want = np.concatenate([(np.arange(200_000 + r) % 97 + r).astype(np.float64) for r in range(n)])
        np.testing.assert_array_equal(got, want)
    finally:
        comm.Free()
