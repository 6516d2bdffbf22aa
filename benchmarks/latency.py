"""Small-call latency: mpicoll against MPI's built-in and the plain-mpi4py floor, one run.

Run under an MPI launcher (2 ranks for the floors)::

    mpirun -n 2 python benchmarks/latency.py            # 16 B and 4 KiB, float64 SUM
    mpirun -n 2 python benchmarks/latency.py --sizes 8 16 4096 --reps 41

For every size and collective it interleaves, in one run, rep after rep:

``builtin``   mpi4py's ``Allreduce`` / ``Reduce_scatter_block`` / ``Allgather``
``Comm``      the same call on ``mpicoll.Comm``
``array``     ``mpicoll.allreduce(x, out=y)`` (``reduce_scatter``, ``allgather``)
``array+T``   the same with ``timeout=T`` (``--timeout T``: remembered with its timeout, engine.cache)
``sendrecv``  the floor from Python (2 ranks only): one ``Sendrecv`` of what the
              collective exchanges plus one ``np.add`` (``np.copyto`` for AllGather)
``persist``   the same with persistent requests built once
              (``Recv_init``/``Send_init``; ``Start``, ``Start``, ``Wait``, ``Wait``:
              what a remembered call runs, engine.cache)

With ``--forms nonblocking`` the columns are the other forms of the same call,
each started and waited for at once (the same buffers every time, so
mpicoll restarts its remembered operation; a persistent request starts the
point-to-point requests it bound once, where its messages allow: engine.executor):

``builtin``   the blocking built-in, as above
``Comm``      the blocking call on ``mpicoll.Comm``, as above
``I-builtin`` ``comm.Iallreduce(x, y).Wait()`` (``Iallgather``, ``Ireduce_scatter_block``)
``I-Comm``    the same on ``mpicoll.Comm``
``I-array``   ``mpicoll.iallreduce(x, out=y).wait()`` (``iallgather``, ``ireduce_scatter``)
``P-builtin`` ``Allreduce_init`` (MPI-4) made once; ``Start()``, ``Wait()``
``P-Comm``    the same on ``mpicoll.Comm``

With ``--forms new`` every call is made on a new communicator: ``Split``, the
call, ``Free`` (``builtin``: mpi4py's; ``Comm``: ``mpicoll.Comm``'s ``Split``
and method; ``array``: the array function on mpi4py's ``Split``), what an
application that makes a sub-communicator per call pays for mpicoll's set-up;
a line above the table gives the first call of the process on a new
communicator (``Dup``), mpicoll's and the built-in's, in milliseconds.

Each variant is timed by :mod:`mpicoll.tools.harness`: ``--warmup`` calls,
then ``--reps`` samples of ``--inner`` calls back to back, one sample per
variant per round after a Barrier (the variants interleaved, their order
flipped every round), the slowest rank's sample; the table shows the median
in microseconds per call and the ratio to the built-in.  The size is the bytes
of each rank's input (float64, rank-asymmetric integer values, so every result
is exact); every variant's result is checked against the exact values and a
wrong one is an error.  ``--json PATH`` writes one record per (size,
collective, variant).
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from mpicoll.tools.harness import cli as _cli
from mpicoll.tools.harness import records as _records
from mpicoll.tools.harness.timing import Variant, time_variants
from mpicoll.tools.harness.workload import count_wrong, expected, rank_data

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")
DTYPE = np.dtype(np.float64)


def _variants(collective, comm, mc, x, n, rank, timeout=None):
    """({name: (call, output array)} for one collective, the built-in first; the persistent
    requests the floor holds, for the caller to free)."""
    import mpicoll

    dt = x.dtype
    per = len(x) // n
    out = {}
    if collective == "allreduce":
        shape_out = len(x)
        builtin = (comm.Allreduce, mc.Allreduce)
        array = mpicoll.allreduce
    elif collective == "reduce_scatter":
        shape_out = per
        builtin = (comm.Reduce_scatter_block, mc.Reduce_scatter_block)
        array = mpicoll.reduce_scatter
    else:
        shape_out = len(x) * n
        builtin = (comm.Allgather, mc.Allgather)
        array = mpicoll.allgather
    for name, fn in (("builtin", builtin[0]), ("Comm", builtin[1])):
        y = np.empty(shape_out, dt)
        out[name] = ((lambda fn=fn, y=y: fn(x, y)), y)
    y = np.empty(shape_out, dt)
    out["array"] = ((lambda y=y: array(x, comm=comm, out=y)), y)
    if timeout is not None:
        y = np.empty(shape_out, dt)
        out["array+T"] = ((lambda y=y: array(x, comm=comm, out=y, timeout=timeout)), y)
    if n != 2:
        return out, ()
    peer = 1 - rank
    tmp = np.empty(len(x), dt)
    y = np.empty(shape_out, dt)
    if collective == "allreduce":
        send, recv, a, b = x, tmp, x, tmp
    elif collective == "reduce_scatter":
        mine, theirs = x[rank * per:(rank + 1) * per], x[peer * per:(peer + 1) * per]
        send, recv, a, b = theirs, tmp[:per], mine, tmp[:per]
    else:
        send, recv = x, y[peer * len(x):(peer + 1) * len(x)]
        own = y[rank * len(x):(rank + 1) * len(x)]

    if collective == "allgather":
        def floor():
            comm.Sendrecv(send, peer, 0, recv, peer, 0)
            np.copyto(own, x)
    else:
        def floor():
            comm.Sendrecv(send, peer, 0, recv, peer, 0)
            np.add(a, b, out=y)
    out["sendrecv"] = (floor, y)
    y2 = np.empty(shape_out, dt)
    if collective == "allgather":
        recv2, own2 = y2[peer * len(x):(peer + 1) * len(x)], y2[rank * len(x):(rank + 1) * len(x)]
    else:
        recv2 = np.empty(len(recv), dt)
    rreq, sreq = comm.Recv_init(recv2, peer, 1), comm.Send_init(send, peer, 1)
    if collective == "allgather":
        def persist():
            rreq.Start()
            sreq.Start()
            sreq.Wait()
            rreq.Wait()
            np.copyto(own2, x)
    else:
        def persist():
            rreq.Start()
            sreq.Start()
            sreq.Wait()
            rreq.Wait()
            np.add(a, recv2, out=y2)
    out["persist"] = (persist, y2)
    return out, (rreq, sreq)


def _nonblocking_variants(collective, comm, mc, x, n, rank, timeout=None):
    """({name: (call, output array)}: the blocking built-in, then the non-blocking and
    persistent forms of the built-in and of mpicoll; the persistent requests to free)."""
    import mpicoll

    dt = x.dtype
    method, array, shape_out = {
        "allreduce": ("Allreduce", mpicoll.iallreduce, len(x)),
        "reduce_scatter": ("Reduce_scatter_block", mpicoll.ireduce_scatter, len(x) // n),
        "allgather": ("Allgather", mpicoll.iallgather, len(x) * n),
    }[collective]
    out, held = {}, []

    def outbuf():
        return np.empty(shape_out, dt)

    y, fn = outbuf(), getattr(comm, method)
    out["builtin"] = ((lambda y=y: fn(x, y)), y)
    y, fn = outbuf(), getattr(mc, method)  # (mpicoll's blocking call: what the others match)
    out["Comm"] = ((lambda y=y: fn(x, y)), y)
    for label, c in (("I-builtin", comm), ("I-Comm", mc)):
        start, y = getattr(c, "I" + method.lower()), outbuf()
        out[label] = ((lambda start=start, y=y: start(x, y).Wait()), y)
    y = outbuf()
    out["I-array"] = ((lambda y=y: array(x, comm=comm, out=y).wait()), y)
    for label, c in (("P-builtin", comm), ("P-Comm", mc)):
        y = outbuf()
        try:
            req = getattr(c, method + "_init")(x, y)
        except NotImplementedError:  # an MPI before MPI-4: no persistent collectives
            continue
        held.append(req)
        out[label] = ((lambda req=req: (req.Start(), req.Wait())), y)
    return out, held


def _new_comm_variants(collective, comm, mc, x, n, rank, timeout=None):
    """({name: (call, output array)}: a communicator made, one call on it, freed -- with
    MPI's built-in, mpicoll.Comm and the array function (what an application that makes a
    sub-communicator per call pays for mpicoll's set-up, engine.context); no requests)."""
    import mpicoll

    method, array, shape_out = {
        "allreduce": ("Allreduce", mpicoll.allreduce, len(x)),
        "reduce_scatter": ("Reduce_scatter_block", mpicoll.reduce_scatter, len(x) // n),
        "allgather": ("Allgather", mpicoll.allgather, len(x) * n),
    }[collective]
    out = {}
    for label, c in (("builtin", comm), ("Comm", mc)):
        y = np.empty(shape_out, x.dtype)

        def call(c=c, y=y):
            sub = c.Split(0, rank)
            getattr(sub, method)(x, y)
            sub.Free()
        out[label] = (call, y)
    y = np.empty(shape_out, x.dtype)

    def call_array(y=y):
        sub = comm.Split(0, rank)
        array(x, comm=sub, out=y)
        sub.Free()
    out["array"] = (call_array, y)
    return out, ()


def _first_call(world, x):
    """Milliseconds of the first mpicoll call of this process on a new communicator (its
    set-up, selection and binding; the package imported already), the slowest rank's,
    and of MPI's built-in on another new one."""
    import mpicoll

    times = []
    for run in (lambda c: c.Allreduce(x, np.empty_like(x)),
                lambda c: mpicoll.allreduce(x, comm=c)):
        c = world.Dup()
        c.Barrier()
        t0 = MPI.Wtime()
        run(c)
        times.append(world.allreduce(MPI.Wtime() - t0, op=MPI.MAX) * 1e3)
        c.Free()
    return times


def first_bytes(n: int) -> int:
    """Bytes of each rank's input to the first call (:func:`_first_call`): one float64 per rank."""
    return n * DTYPE.itemsize


def build_parser():
    p = _cli.Parser(prog="python benchmarks/latency.py", description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=_cli.positive_int, nargs="+", default=[16, 4096],
                   help="bytes per rank's input (default 16 4096)")
    p.add_argument("--collectives", nargs="+", default=list(COLLECTIVES), choices=COLLECTIVES)
    p.add_argument("--reps", type=_cli.positive_int, default=21,
                   help="timed samples per variant (default 21)")
    p.add_argument("--inner", type=_cli.positive_int, default=200,
                   help="calls per sample (default 200)")
    p.add_argument("--warmup", type=_cli.nonnegative_int, default=200,
                   help="untimed calls of each variant first (default 200)")
    p.add_argument("--forms", choices=("blocking", "nonblocking", "new"), default="blocking",
                   help="blocking calls and the floors, the non-blocking and persistent "
                        "forms, or a new communicator per call (Split, the call, Free) after "
                        "the process's first call on a new communicator")
    p.add_argument("--timeout", type=_cli.seconds_arg, default=None, metavar="T",
                   help="also time the array function with timeout=T (blocking forms)")
    p.add_output("--json", metavar="PATH",
                   help="write one record per size, collective and variant as JSON")
    return p


@_cli.tool("benchmarks/latency.py")
def main(argv=None, *, comm=None) -> int:
    import mpicoll

    world = MPI.COMM_WORLD if comm is None else comm
    args = build_parser().parse_args(argv, comm=world)
    make = {"blocking": _variants, "nonblocking": _nonblocking_variants,
            "new": _new_comm_variants}[args.forms]
    first = _first_call(world, rank_data(world.Get_rank(), world.Get_size(), world.Get_size(),
                                          DTYPE, "sum")) if args.forms == "new" else None
    comm = world.Dup()
    mc = mpicoll.Comm(comm)
    n, rank = comm.Get_size(), comm.Get_rank()
    meta = _records.environment(comm)
    if rank == 0:
        print(f"# mpicoll latency: {n} ranks, {meta['mpi_library']}")
        print(f"# float64 SUM, median of {args.reps} samples of {args.inner} calls (warm-up "
              f"{args.warmup}), the variants interleaved, the slowest rank; us per call, "
              f"ratio to the built-in")
        if first is not None:
            print(f"# first call of the process on a new communicator: mpicoll "
                  f"{first[1]:.2f} ms, the built-in {first[0]:.2f} ms")
    rows, records, bad = [], [], []
    for size in args.sizes:
        count = max(n, size // DTYPE.itemsize // n * n)  # a multiple of the rank count
        x = rank_data(rank, n, count, DTYPE, "sum")
        for collective in args.collectives:
            variants, held = make(collective, comm, mc, x, n, rank, args.timeout)
            med = time_variants(comm, {name: Variant(fn) for name, (fn, _) in variants.items()},
                                warmup=args.warmup, samples=args.reps, inner=args.inner)
            total = count * n if collective == "allgather" else count
            want = expected(collective, n, total, DTYPE, "sum", rank)
            wrong = comm.allreduce(np.array([count_wrong(y, want, DTYPE, n)
                                             for _, y in variants.values()]))
            for req in held:
                req.Free()
            med = {name: t * 1e6 for name, t in med.items()}
            for name, w in zip(variants, wrong):
                if w:
                    bad.append(f"{collective} {size} B {name}")
                records.append({"tool": "latency", "collective": collective, "bytes": size,
                                "count": count, "dtype": DTYPE.name, "op": "sum",
                                "variant": name, "time_us": med[name],
                                "ratio": med[name] / med["builtin"], "wrong": int(w),
                                "forms": args.forms, "reps": args.reps, "inner": args.inner,
                                "warmup": args.warmup, **meta})
            rows.append((size, collective, med))
    if rank == 0:
        timed = ["array+T"] if args.timeout is not None else []
        names = (["builtin", "Comm", "array", *timed, "sendrecv", "persist"]
                 if args.forms == "blocking"
                 else list(dict.fromkeys(h for _, _, med in rows for h in med)))
        print(f"{'bytes':>9} {'collective':<15}" + "".join(f" {h:>15}" for h in names))
        for size, collective, med in rows:
            base = med["builtin"]
            cells = []
            for h in names:
                if h in med:
                    cells.append(f"{med[h]:8.2f} {med[h] / base:5.2f}x" if h != "builtin"
                                 else f"{med[h]:8.2f}       ")
                else:
                    cells.append(f"{'-':>14}")
            # (a space before every cell: a slow one, thousands of us, stays a column)
            print(f"{size:>9} {collective:<15}" + "".join(f" {c:>15}" for c in cells))
        if bad:
            print("WRONG RESULTS: " + ", ".join(sorted(set(bad))), file=sys.stderr)
    comm.Free()
    if first is not None:
        records.append({"tool": "latency", "collective": "allreduce", "bytes": first_bytes(n),
                        "variant": "first call", "time_us": first[1] * 1e3,
                        "ratio": first[1] / first[0], "wrong": 0, "forms": args.forms,
                        "reps": 1, "inner": 1, "warmup": 0, **meta})
    if rank == 0 and args.json:  # (last: after every collective)
        _records.write_json(args.json, records)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
