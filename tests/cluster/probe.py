"""Checks that a run on the emulated cluster is really across nodes.

Run by ``tests/cluster/cluster.sh run`` (which exports MPICOLL_CLUSTER_NODES,
the node number of every rank), e.g.::

    cluster.sh run DIR --venv V --mpi openmpi --ppn 2 --placement round-robin \\
        -- python tests/cluster/probe.py

1. Placement: rank r runs on host ``node<k>`` with k the placement's node of
   r, ``Split_type(COMM_TYPE_SHARED)`` groups exactly the ranks of one node,
   and mpicoll's node layout (transport.topology) agrees with both; mpicoll's
   ring crosses each node boundary once.
2. Bytes cross the links: for each algorithm of each collective, the bytes
   mpicoll's trace (whose totals must equal mpicoll.traffic()'s) says each node's ranks sent to (received from) ranks on
   other nodes, against the node link's veth counters
   (``/sys/class/net/mc0/statistics``, read inside the node around the call):
   the link must carry at least the payload and at most the payload plus
   TCP/IP overhead (:data:`OVERHEAD`, :data:`SLACK`) plus the segments TCP
   sent again meanwhile (the kernel's ``RetransSegs``, per node, around the
   same call: a link shaped by tbf drops what overflows its queue, more so on
   a loaded machine, and each resent segment crosses it twice).  Equal
   counters also prove the MPI moved no "inter-node" byte over shared memory.
3. Results: every call is checked by mpicoll.tools.results.

Prints ``probe: PASS ...`` or ``probe: FAIL ...`` lines on rank 0 and exits
non-zero on any failure.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

import mpicoll
from mpicoll.tools import results
from mpicoll.transport import topology

IFACE = "mc0"
# Headers per 1448-byte TCP segment (at most 3.6% at MTU 1500, less with
# GSO) and the ACKs of the other direction's data; SLACK covers the MPI's
# own small messages (barriers, the counter exchange) inside the window.
OVERHEAD = 0.06
SLACK = 96 << 10

COLLECTIVES = {
    "allreduce": ("ring", "recursive_doubling", "rabenseifner", "hierarchical", "auto"),
    "reduce_scatter": ("ring", "recursive_halving", "recursive_doubling", "hierarchical", "auto"),
    "allgather": ("ring", "bruck", "recursive_doubling", "hierarchical", "auto"),
}


# the most one resent TCP segment adds to a link counter: MTU 1500 plus Ethernet's header
RESENT_BYTES = 1514


def link_counters() -> tuple[int, int, int]:
    """(tx bytes, rx bytes) of this node's link and the TCP segments it has resent
    (``/proc/net/snmp`` is the network namespace's: this node's)."""
    base = f"/sys/class/net/{IFACE}/statistics/"
    with open(base + "tx_bytes") as f_tx, open(base + "rx_bytes") as f_rx:
        tx, rx = int(f_tx.read()), int(f_rx.read())
    with open("/proc/net/snmp") as f:
        tcp = [line.split() for line in f if line.startswith("Tcp:")]
    resent = int(tcp[1][tcp[0].index("RetransSegs")]) if len(tcp) == 2 else 0
    return tx, rx, resent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=2.0,
                    help="array size per rank in MiB for the byte check (default 2)")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    spec = os.environ.get("MPICOLL_CLUSTER_NODES", "")
    failures: list[str] = []

    def report(ok: bool, what: str) -> None:
        if not ok:
            failures.append(what)
        if rank == 0:
            print(f"probe: {'PASS' if ok else 'FAIL'} {what}", flush=True)

    # 1. placement
    if not spec:
        report(False, "MPICOLL_CLUSTER_NODES is not set (run under cluster.sh run)")
        return 1
    nodes = [int(x) for x in spec.split(",")]
    host = MPI.Get_processor_name()
    hosts = comm.allgather(host)
    report(len(nodes) == size and all(h == f"node{k}" for h, k in zip(hosts, nodes)),
           f"placement: hosts of ranks {hosts}, expected node{nodes}")
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    peers = shared.allgather(rank)
    shared.Free()
    want = [r for r in range(size) if nodes[r] == nodes[rank]]
    ok = comm.allreduce(int(peers == want), op=MPI.MIN) == 1
    report(ok, "Split_type(COMM_TYPE_SHARED) groups each node's ranks")
    labels = topology.node_ids(comm)
    ring = topology.ring_from_nodes(labels)
    same = all((labels[a] == labels[b]) == (nodes[a] == nodes[b])
               for a in range(size) for b in range(size))
    k = len(set(nodes))
    report(same and topology.crossings(ring, labels) == (k if k > 1 else 0),
           f"mpicoll's node layout {labels}, ring {ring} crosses {topology.crossings(ring, labels)} "
           f"node boundaries (nodes: {k})")

    # 2 + 3. bytes on the links against mpicoll's own count, results checked
    leader = rank == min(want)
    count = int(args.mib * (1 << 20)) // 4
    rng = np.random.default_rng(1000 + rank)
    for collective, algorithms in COLLECTIVES.items():
        for algorithm in algorithms:
            if collective == "allgather":
                counts = [count // size + (r < count % size) for r in range(size)]
                x = rng.integers(-1000, 1000, counts[rank]).astype(np.float32)
            else:
                x = rng.integers(-1000, 1000, count).astype(np.float32)
            # (uneven AllGather blocks need counts=: without it every rank's
            # block must have the same length)
            kw = {"counts": counts} if collective == "allgather" else {}
            fn = getattr(mpicoll, collective)
            fn(x[:2], algorithm=algorithm, **({"counts": [2] * size} if kw else {}))  # set-up
            comm.Barrier()
            before = link_counters() if leader else (0, 0, 0)
            comm.Barrier()
            with mpicoll.traffic() as tf, mpicoll.trace() as tr:
                y = fn(x, algorithm=algorithm, **kw)
            comm.Barrier()
            after = link_counters() if leader else (0, 0, 0)
            sent = sum(e["bytes"] for e in tr.events
                       if e["phase"] == "send" and nodes[e["peer"]] != nodes[rank])
            recvd = sum(e["bytes"] for e in tr.events
                        if e["phase"] == "recv" and nodes[e["peer"]] != nodes[rank])
            # The trace gives each message's peer; its totals must be
            # mpicoll.traffic()'s.
            counted = (sum(e["bytes"] for e in tr.events if e["phase"] == "send"),
                       sum(e["bytes"] for e in tr.events if e["phase"] == "recv"))
            ok = counted == (tf.bytes_sent, tf.bytes_received)
            ok = comm.allreduce(int(ok), op=MPI.MIN) == 1
            report(ok, f"{collective} {algorithm}: traced bytes equal mpicoll.traffic()'s")
            node_comm = comm.Split(nodes[rank], rank)
            payload = node_comm.allreduce(np.array([sent, recvd]))
            node_comm.Free()
            link = (after[0] - before[0], after[1] - before[1])
            # segments resent on any node's link: sent by one, received by another
            resent = comm.allreduce(after[2] - before[2] if leader else 0)
            lrows = comm.gather((nodes[rank], tuple(int(v) for v in payload), link) if leader else None)
            # Integers in float32: every order of the sums is exact, so the
            # result must equal the reference bit for bit.
            rows = results.gather_rows(comm, x) if collective != "allgather" else None
            if collective == "allgather":
                ref = np.concatenate(comm.allgather(x))
            elif collective == "allreduce":
                ref = rows.sum(axis=0, dtype=np.float32)
            else:
                ref = np.array_split(rows.sum(axis=0, dtype=np.float32), size)[rank]
            ok = results.same_values(y, ref) and (
                collective == "reduce_scatter" or results.identical_across_ranks(comm, y))
            ok = comm.allreduce(int(bool(ok)), op=MPI.MIN) == 1
            report(ok, f"{collective} {algorithm}: result")
            if rank == 0:
                lines, good = [], True
                for node, (ptx, prx), (ltx, lrx) in sorted(r for r in lrows if r):
                    fine = all(p <= v <= p * (1 + OVERHEAD) + SLACK + resent * RESENT_BYTES
                               for p, v in ((ptx, ltx), (prx, lrx)))
                    good &= fine
                    lines.append(f"node{node} tx {ltx}/{ptx} rx {lrx}/{prx}")
                report(good, f"{collective} {algorithm}: link bytes / mpicoll's inter-node bytes: "
                       + ", ".join(lines) + (f" ({resent} TCP segments resent)" if resent else ""))
            else:
                good = True
            good = comm.bcast(good)
            if not good:
                failures.append("links")
    ok = comm.allreduce(len(failures), op=MPI.MAX) == 0
    if rank == 0:
        print(f"probe: {'PASS' if ok else 'FAIL'}: {size} ranks on {k} nodes", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
