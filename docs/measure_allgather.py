"""Large AllGathers at 2 ranks against their floor (docs/performance.md).

Each call after a Barrier, the variants in a new random order every round (a
fixed order favours or penalizes the variant that follows another: on MPICH
whichever variant ran right after the built-in Allgather at 4-8 MiB took up to
1.6-2x); rank 0 prints, per gathered size, the built-in's median (slowest
rank) and every variant's median over it.  Variants:

builtin     ``comm.Allgather``
mpicoll     ``mpicoll.Comm(comm).Allgather`` (``auto``)
array       ``mpicoll.allgather(x, out=out)``
ring, rd    ``mpicoll.Comm(comm, algorithm=...)``
after       floor: ``Sendrecv`` of this rank's block, then a NumPy copy of it into place
before      the copy, then the ``Sendrecv``
during      ``Irecv``, ``Isend``, the copy, ``Waitall``
persistent  ``Recv_init``/``Send_init`` made once; ``Startall``, the copy, ``Waitall``
sendrecv    the ``Sendrecv`` alone; copy: the copy alone (the two parts of the floor)

Run: mpirun -n 2 python docs/measure_allgather.py [ROUNDS [MIB,MIB,... [VARIANT,...]]]
(default 40 rounds; 1,2,4,16,64 MiB gathered, float32; every variant).  With all of
them the mpicoll.Comm variants ran 3-8 % over ``array`` at 1-4 MiB; with
``builtin,mpicoll,array`` alone the two are equal (the many plans and requests of the
whole set, not the API, cost that).
"""

import sys

import numpy as np
from mpi4py import MPI

import mpicoll

comm = MPI.COMM_WORLD


def variants(x, out):
    rank = comm.Get_rank()
    peer = 1 - rank
    n = len(x)
    own, theirs = out[rank * n:(rank + 1) * n], out[peer * n:(peer + 1) * n]
    auto, ring = mpicoll.Comm(comm), mpicoll.Comm(comm, algorithm="ring")
    rd = mpicoll.Comm(comm, algorithm="recursive_doubling")
    preq = [comm.Recv_init(theirs, peer, 5), comm.Send_init(x, peer, 5)]

    def copy():
        own[:] = x

    def sendrecv():
        comm.Sendrecv(x, peer, 0, theirs, peer, 0)

    def during():
        reqs = [comm.Irecv(theirs, peer, 0), comm.Isend(x, peer, 0)]
        copy()
        MPI.Request.Waitall(reqs)

    def persistent():
        MPI.Prequest.Startall(preq)
        copy()
        MPI.Request.Waitall(preq)

    return {
        "builtin": lambda: comm.Allgather(x, out),
        "mpicoll": lambda: auto.Allgather(x, out),
        "array": lambda: mpicoll.allgather(x, out=out),
        "ring": lambda: ring.Allgather(x, out),
        "rd": lambda: rd.Allgather(x, out),
        "after": lambda: (sendrecv(), copy()),
        "before": lambda: (copy(), sendrecv()),
        "during": during,
        "persistent": persistent,
        "sendrecv": sendrecv,
        "copy": copy,
    }, preq


def main():
    assert comm.Get_size() == 2, "run at 2 ranks"
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    sizes = [float(v) for v in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,16,64").split(",")]
    rank = comm.Get_rank()
    for mib in sizes:
        n = int(mib * (1 << 20)) // 4 // 2
        x = np.full(n, rank + 1, np.float32)
        out = np.empty(2 * n, np.float32)
        vs, preq = variants(x, out)
        names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(vs)
        if "builtin" not in names:
            names.insert(0, "builtin")
        for k in names:
            vs[k]()
            vs[k]()
        times = {k: [] for k in names}
        for it in range(rounds):
            for k in np.random.default_rng(it).permutation(names):  # the same order on both ranks
                comm.Barrier()
                t0 = MPI.Wtime()
                vs[k]()
                times[k].append(MPI.Wtime() - t0)
        vs["builtin"]()
        assert (out[:n] == 1).all() and (out[n:] == 2).all()
        for r in preq:
            r.Free()
        med = {}
        for k in names:
            t = np.array(times[k])
            comm.Allreduce(MPI.IN_PLACE, t, MPI.MAX)
            med[k] = float(np.median(t))
        if rank == 0:
            b = med["builtin"]
            print(f"{mib:g} MiB: builtin {b * 1e6:.0f} us; "
                  + ", ".join(f"{k} {med[k] / b:.3f}" for k in names[1:]), flush=True)


if __name__ == "__main__":
    main()
