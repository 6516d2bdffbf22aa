"""Ring order: which rank sits at which position of the logical ring.

A ring link between two nodes is slower than one inside a node, and every
link carries the same traffic, so the ring should cross node boundaries as
few times as possible: once per node.  :func:`ring_order` finds each rank's
node (``Split_type(COMM_TYPE_SHARED)``) and orders the ranks by (node, rank),
nodes in the order of their lowest rank.  With ranks placed in blocks this is
the identity; with ranks placed round-robin (rank r on node r % k) it puts
each node's ranks next to each other instead of crossing nodes at every hop.

``MPICOLL_FAKE_NODES`` replaces the real node membership (for tests and
experiments), by COMM_WORLD rank:

* ``"0,0,1,1"``  node label of each COMM_WORLD rank
* ``"block:K"``  K nodes, consecutive ranks together (numpy.array_split rule)
* ``"cyclic:K"`` K nodes, rank r on node r % K
"""

from __future__ import annotations

import os

from mpi4py import MPI


def parse_fake_nodes(spec: str, world_size: int) -> list[int]:
    """Node label of every COMM_WORLD rank from a ``MPICOLL_FAKE_NODES`` value."""
    text = spec.strip()
    kind, sep, arg = text.partition(":")
    if sep and kind.strip() in ("block", "cyclic"):
        try:
            k = int(arg)
        except ValueError:
            k = 0
        if k < 1:
            raise ValueError(f"MPICOLL_FAKE_NODES: expected a positive node count after "
                             f"'{kind.strip()}:', got {spec!r}")
        if kind.strip() == "cyclic":
            return [r % k for r in range(world_size)]
        q, rem = divmod(world_size, k)
        nodes = []
        for node in range(k):
            nodes += [node] * (q + (node < rem))
        return nodes
    try:
        nodes = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(
            f"MPICOLL_FAKE_NODES: expected 'block:K', 'cyclic:K' or one node number per "
            f"rank such as '0,0,1,1', got {spec!r}"
        ) from None
    if len(nodes) != world_size:
        raise ValueError(
            f"MPICOLL_FAKE_NODES: expected {world_size} node numbers (one per COMM_WORLD rank), "
            f"got {len(nodes)}"
        )
    return nodes


def ring_from_nodes(nodes) -> list[int]:
    """Ranks ordered by (node, rank), nodes in the order of their lowest rank."""
    first: dict = {}
    for rank, node in enumerate(nodes):
        first.setdefault(node, rank)
    return sorted(range(len(nodes)), key=lambda r: (first[nodes[r]], r))


def crossings(ring, nodes) -> int:
    """How many ring links join ranks on different nodes."""
    n = len(ring)
    return sum(nodes[ring[p]] != nodes[ring[(p + 1) % n]] for p in range(n)) if n > 1 else 0


def node_ids(comm: MPI.Intracomm) -> list[int]:
    """Node label of every rank of ``comm`` (collective over ``comm``)."""
    spec = os.environ.get("MPICOLL_FAKE_NODES", "").strip()
    if spec:
        world = MPI.COMM_WORLD
        mine = parse_fake_nodes(spec, world.Get_size())[world.Get_rank()]
    else:
        shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            # label a node by the lowest rank of comm on it
            mine = shared.bcast(comm.Get_rank(), root=0)
        finally:
            shared.Free()
    return comm.allgather(mine)


def ring_order(ctx) -> list[int]:
    """Ranks in ring order; position p sends to p+1 and receives from p-1.

    Called once per communicator, collectively, when its context is created.
    """
    if ctx.size == 1:
        return [0]
    return ring_from_nodes(node_ids(ctx.comm))
