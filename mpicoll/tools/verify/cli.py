"""``python -m mpicoll.verify``: the command line (options, plan, the table rank 0 prints)."""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np
from mpi4py import MPI

from ...core import types as _types
from ...engine import select as _select
from .. import arrays as _arrays
from ..harness import cli as _cli
from .cases import COLLECTIVES, REDUCTION_OPS, algorithms_for, available_types, ops_for
from .runner import prepare_case, run_case

# A full run adds a large count (2**18 + 5: pipeline segments on the ring) for
# these types, with their first op (SUM) and in the gathers.
_LARGE_TYPES = ("int32", "int64", "float32", "float64", "complex128")


def _counts(size: int, quick: bool, large: bool = True) -> list[int]:
    """Counts tried: empty, one element (fewer than ranks), not divisible by the ranks, large."""
    if quick:
        counts = [0, 1, 7 * size + 3]
    else:
        counts = [0, 1, size - 1, size + 1, 7 * size + 3, 1000 * size + 17]
        if large:
            counts.append(2 ** 18 + 5)
    seen = []
    for c in counts:
        if c >= 0 and c not in seen:
            seen.append(c)
    return seen


def _placements(quick: bool, k: int, j: int, cells: int) -> tuple[bool, ...]:
    """In place and/or out of place for count k, algorithm j.

    --quick alternates them over the (count, algorithm) grid, so each count
    and each algorithm still runs both ways (given two or more of the other).
    """
    if not quick or cells < 2:
        return (False, True)
    return ((k + j) % 2 == 1,)


class _Parser(argparse.ArgumentParser):
    """argparse that prints only on rank 0 (every rank still exits the same way)."""

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def _csv(choices, spelling=None):
    """argparse type: a comma-separated list of ``choices`` (``spelling`` maps aliases to them)."""
    def parse(text):
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list of {', '.join(choices)}, got {text!r}")
        if spelling is not None:
            items = [spelling(t) for t in items]
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
        return list(dict.fromkeys(items))
    return parse


def _op_spelling(text):
    """An op name in any case as its canonical name ("sum" -> "SUM"); unknown names unchanged."""
    try:
        return _types.op_name(_types.predefined_op(text))
    except ValueError:
        return text


def _parser() -> argparse.ArgumentParser:
    all_algos = sorted({a for table in _select.ALGORITHMS.values() for a in table})
    type_names = [t.name for t in available_types()]
    p = _Parser(
        prog="python -m mpicoll.verify",
        description="Check every mpicoll collective against MPI's built-in on this machine "
                    "(run under mpirun/srun; rank 0 prints). Exit status 0: all agree.")
    p.add_argument("--quick", action="store_true",
                   help="a short smoke test: fewer counts, in place and out of place alternating")
    p.add_argument("--collective", type=_csv(list(COLLECTIVES)), default=None,
                   help="comma-separated collectives (default: all)")
    p.add_argument("--dtype", type=_csv(type_names), default=None,
                   help="comma-separated element types (default: all)")
    p.add_argument("--op", type=_csv(list(REDUCTION_OPS), _op_spelling), default=None,
                   help="comma-separated reduction ops, any case (default: every op that applies)")
    p.add_argument("--algorithm", type=_csv(["auto"] + all_algos), default=None,
                   help="comma-separated algorithms (default: every registered one)")
    p.add_argument("--device", choices=("cpu", "gpu", "auto"), default="cpu",
                   help="where the buffers live: NumPy (cpu), CuPy (gpu), or gpu if usable")
    p.add_argument("--timeout", type=_cli.seconds_arg, default=120.0,
                   help="seconds to wait for the other ranks after a case before aborting")
    p.add_argument("--deterministic", action="store_true",
                   help="run every case in deterministic mode (mpicoll.options(deterministic=True)) "
                        "and check floating SUM/PROD bitwise against the rank-order fold")
    p.add_argument("--verbose", "-v", action="store_true", help="print every failing case")
    return p


class _EmptySelection(Exception):
    """The options select nothing to check (the message says which option and why)."""


def _plan(args, types) -> list:
    """What the options select: [(collective, algorithms, [(TypeInfo, op name or None)])].

    Local and the same on every rank.  Raises _EmptySelection when the
    selection is empty or an option given selects nothing.
    """
    named = args.collective is not None
    collectives = args.collective or list(COLLECTIVES)
    plan = []
    for collective in collectives:
        own = algorithms_for(collective)
        algos = [a for a in (args.algorithm or own) if a == "auto" or a in own]
        if not algos:
            if named:
                raise _EmptySelection(
                    f"--algorithm: {','.join(args.algorithm)} is no algorithm of {collective} "
                    f"(expected auto or one of {', '.join(own)})")
            continue
        _, api, reduces = COLLECTIVES[collective]
        usable = [t for t in types if api == "comm" or t.datatype is None]
        cells = []
        for info in usable:
            ops = ops_for(info) if reduces else (None,)
            if args.op and reduces:
                ops = [o for o in ops if o in args.op]
            cells += [(info, o) for o in ops]
        if not cells:
            if not named:
                continue
            if not usable:
                raise _EmptySelection(
                    f"--collective {collective}: takes plain arrays, not the pair types "
                    f"{', '.join(t.name for t in types)} (use the Comm methods, e.g. Allreduce)")
            raise _EmptySelection(
                f"--collective {collective}: --op {','.join(args.op)} applies to none of "
                f"{', '.join(t.name for t in usable)}")
        plan.append((collective, algos, cells))
    chosen = ", ".join(c for c, _, _ in plan) or ", ".join(collectives)
    for algo in args.algorithm or ():
        if not any(algo in algos for _, algos, _ in plan):
            raise _EmptySelection(f"--algorithm: {algo} is no algorithm of {chosen}")
    if args.op and not any(COLLECTIVES[c][2] for c in collectives):
        raise _EmptySelection(
            f"--op: none of the selected collectives ({', '.join(collectives)}) reduces")
    for name in args.op or ():
        if not any(op == name for _, _, cells in plan for _, op in cells):
            raise _EmptySelection(
                f"--op: {name} applies to none of {', '.join(t.name for t in types)}")
    for info in types if args.dtype else ():
        if not any(i.name == info.name for _, _, cells in plan for i, _ in cells):
            why = (f"a pair type goes through the Comm methods only, not {chosen}"
                   if info.datatype is not None and all(COLLECTIVES[c][1] == "array"
                                                         for c, _, _ in plan)
                   else f"--op {','.join(args.op or ())} does not apply to it")
            raise _EmptySelection(f"--dtype: nothing selected checks {info.name}: {why}")
    if not plan:
        raise _EmptySelection("nothing to check with these options")
    return plan


def _gpu_arrays():
    """(arrays, None) when CuPy and a GPU are usable here, else (None, reason). Local only."""
    import mpicoll
    try:
        import cupy
    except ImportError as exc:
        return None, f"CuPy is not importable ({exc}); install mpicoll[cuda12] or mpicoll[cuda13]"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no GPU"
    except Exception as exc:
        return None, f"CuPy cannot use a GPU ({exc})"
    if getattr(mpicoll, "bind_device", None) is None:
        return None, "this mpicoll has no mpicoll.bind_device(): GPU support is missing"
    return _arrays.CupyArrays(cupy), None


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if math.isinf(v):
        return "inf"
    return f"{v:.2e}"


def main(argv=None) -> int:
    """Run the checks; returns the exit status (the same on every rank)."""
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    parser = _parser()
    args = parser.parse_args(argv)  # every rank parses the same argv: all exit 2 or none
    types = available_types()
    if args.dtype:
        types = [t for t in types if t.name in args.dtype]
    try:
        _plan(args, types)  # an empty selection is an error before any MPI call
    except _EmptySelection as exc:
        parser.error(str(exc))

    def say(text=""):
        if rank == 0:
            print(text, flush=True)

    device = args.device
    arrays = _arrays.NUMPY
    if device in ("gpu", "auto"):
        gpu, reason = _gpu_arrays()
        reasons = comm.allgather(reason)  # every rank decides the same way
        if gpu is not None and not any(reasons):
            import mpicoll
            mpicoll.bind_device(comm)  # collective
            arrays, device = gpu, "gpu"
        elif device == "gpu":
            if rank == 0:
                bad = next(r for r, why in enumerate(reasons) if why)
                sys.stderr.write(f"mpicoll.verify: --device gpu: rank {bad}: {reasons[bad]}\n")
            return 2
        else:
            device = "cpu"

    types = available_types(device=device)
    if args.dtype:
        missing = [name for name in args.dtype if name not in {t.name for t in types}]
        if missing:  # the same on every rank: the device was agreed on above
            say(f"mpicoll.verify: --dtype: {', '.join(missing)} cannot live on {device}")
            return 2
        types = [t for t in types if t.name in args.dtype]
    plan = _plan(args, types)

    import mpicoll
    lib = MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip()
    say(f"mpicoll.verify {mpicoll.__version__}: {size} rank(s), {lib}")
    say(f"mpi4py {__import__('mpi4py').__version__}, numpy {np.__version__}, "
        f"buffers: {arrays.name} ({device}), {'quick' if args.quick else 'full'} counts")
    say("reference: every rank's input reduced exactly (gathers: MPI's built-in); floating "
        "SUM/PROD within gamma(n-1)*scale + the reference's error (see python -m pydoc "
        "mpicoll.tools.results), everything else exact")
    say()
    aw = max([len(",".join(a)) for _, a, _ in plan] + [10])
    cw = max(len(",".join(map(str, _counts(size, args.quick)))), 6)
    head = (f"{'collective':<21} {'dtype':<15} {'op':<6} {'counts':<{cw}} {'algorithms':<{aw}} "
            f"{'max abs':>9} {'max rel':>9} {'identical':>9}  verdict")
    say(head)
    say("-" * len(head))

    rows = failed = cases = 0
    t0 = time.perf_counter()
    for collective, algos, cells in plan:
        for info, opname in cells:
            large = info.name in _LARGE_TYPES and opname in (None, ops_for(info)[0])
            counts = _counts(size, args.quick, large)
            max_abs = max_rel = 0.0
            identical = True
            bad = []
            for k, count in enumerate(counts):
                prepared = prepare_case(comm, collective, info, opname, count)
                for j, algo in enumerate(algos):
                    for in_place in _placements(args.quick, k, j, len(counts) * len(algos)):
                        res = run_case(comm, collective, info, opname, count, in_place, algo,
                                       arrays=arrays, timeout=args.timeout, prepared=prepared,
                                       deterministic=args.deterministic)
                        cases += 1
                        max_abs = max(max_abs, res.max_abs)
                        max_rel = max(max_rel, res.max_rel)
                        if res.identical is False:
                            identical = False
                        if not res.ok:
                            bad.append(f"count={count} {'in place' if in_place else 'out of place'}"
                                       f" {algo}: {res.report()}")
            rows += 1
            ident = "yes" if identical else "NO"
            if collective in ("Reduce_scatter_block", "Reduce_scatter", "reduce_scatter"):
                ident = "n/a"
            verdict = "ok" if not bad else f"FAIL ({len(bad)})"
            failed += bool(bad)
            say(f"{collective:<21} {info.name:<15} {opname or '-':<6} "
                f"{','.join(map(str, counts)):<{cw}} {','.join(algos):<{aw}} "
                f"{_fmt(max_abs):>9} {_fmt(max_rel):>9} {ident:>9}  {verdict}")
            for line in bad[: None if args.verbose else 3]:
                say(f"    {line}")
            if len(bad) > 3 and not args.verbose:
                say(f"    ... {len(bad) - 3} more (use --verbose)")
    elapsed = time.perf_counter() - t0
    failed = comm.allreduce(failed, op=MPI.MAX)
    say()
    if failed:
        say(f"FAIL: {failed} of {rows} checks failed ({cases} cases, {size} ranks, "
            f"{elapsed:.1f} s)")
    else:
        say(f"PASS: all {rows} checks agree with MPI's built-in ({cases} cases, {size} ranks, "
            f"{elapsed:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
