"""Ring order: which rank sits at which position of the logical ring.

A ring link between two nodes is slower than one inside a node, and every
link carries the same traffic, so the ring should cross node boundaries as
few times as possible: once per node.  :func:`node_label` finds each rank's
node (``Split_type(COMM_TYPE_SHARED)``); the context set-up (mpicoll.engine.context)
gathers the labels and :func:`ring_from_nodes` orders the ranks by (node, rank),
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


def fake_labels(spec: str | None) -> list[int] | None:
    """Node label of every COMM_WORLD rank from ``MPICOLL_FAKE_NODES``'s value, None if unset.

    Sends nothing (a bad value raises before any message, see engine.context).
    """
    if not spec:
        return None
    return parse_fake_nodes(spec, MPI.COMM_WORLD.Get_size())


def node_label(comm: MPI.Intracomm, fake: list[int] | None) -> int:
    """This rank's node label: ``fake`` (by COMM_WORLD rank), else the lowest rank of ``comm`` on its node.

    Without ``fake`` this calls ``Split_type(COMM_TYPE_SHARED)``, a blocking
    collective over ``comm``: call it only when every rank is known to have
    reached it (the context set-up first completes an ``Ibarrier``).
    """
    if fake is not None:
        return fake[MPI.COMM_WORLD.Get_rank()]
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)  # key 0: ordered by rank in comm
    group, shared_group = comm.Get_group(), shared.Get_group()
    try:
        return MPI.Group.Translate_ranks(shared_group, [0], group)[0]
    finally:
        group.Free()
        shared_group.Free()
        shared.Free()


def node_ids(comm: MPI.Intracomm, spec: str | None = None) -> list[int]:
    """Node label of every rank of ``comm`` (blocking collective over ``comm``); ``spec``:
    ``MPICOLL_FAKE_NODES``'s value, if set."""
    return comm.allgather(node_label(comm, fake_labels(spec)))
