"""python -m mpicoll.verify's command line: what it accepts, what it refuses, what it reports.

Calls the tool's ``main(argv)`` on the current MPI world (any number of
ranks).  A bad option or a selection with nothing in it must end every rank
with exit status 2 before any collective runs (rank 0 says why; the others
print nothing); a good selection must run checks and say how many.
"""

from __future__ import annotations

import re

import pytest
from mpi4py import MPI

from mpicoll.tools import verify as V

# the command line: 1 rank, and 3 for every rank exiting the same way
pytestmark = pytest.mark.ranks(1, 3)

WORLD = MPI.COMM_WORLD


def _refused(argv, capsys):
    """Run main(argv), expecting exit status 2; return rank 0's stderr ('' elsewhere)."""
    with pytest.raises(SystemExit) as exc:
        V.main(argv)
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    if WORLD.rank != 0:
        assert err == ""  # only rank 0 prints
    WORLD.Barrier()  # every rank got here: nobody is left inside a collective
    return err


@pytest.mark.parametrize("argv, message", [
    # nothing selected: "PASS: all 0 checks agree" used to end these with status 0
    (["--collective", "allreduce", "--algorithm", "bruck"],
     "--algorithm: bruck is no algorithm of allreduce (expected auto or one of ring,"),
    (["--collective", "Allreduce,allgather", "--algorithm", "bruck"],
     "--algorithm: bruck is no algorithm of Allreduce"),
    (["--collective", "Allgather", "--algorithm", "ring", "--op", "sum"],
     "--op: none of the selected collectives (Allgather) reduces"),
    (["--op", "band", "--dtype", "float32"], "--op: BAND applies to none of float32"),
    (["--collective", "Allreduce", "--op", "bxor", "--dtype", "float64,complex64"],
     "--collective Allreduce: --op BXOR applies to none of float64, complex64"),
    (["--collective", "allreduce", "--dtype", "double_int"],
     "--collective allreduce: takes plain arrays, not the pair types double_int"),
    (["--collective", "allreduce,reduce_scatter", "--dtype", "int32,float_int"],
     "--dtype: nothing selected checks float_int: a pair type goes through the Comm methods"),
    (["--collective", "Allreduce", "--op", "sum,land", "--dtype", "float32"],
     "--op: LAND applies to none of float32"),
    (["--collective", ","], "argument --collective: expected a comma-separated list of"),
    (["--dtype", ""], "argument --dtype: expected a comma-separated list of"),
    (["--op", "sum,bogus"], "argument --op: unknown bogus; choose from SUM, PROD,"),
    # a timeout that is no positive number used to abort the job at the first case
    (["--timeout", "0"], "argument --timeout: expected a number of seconds > 0, got '0'"),
    (["--timeout", "-1"], "argument --timeout: expected a number of seconds > 0, got '-1'"),
    (["--timeout", "nan"], "argument --timeout: expected a number of seconds > 0, got 'nan'"),
    (["--timeout", "inf"], "argument --timeout: expected a number of seconds > 0, got 'inf'"),
    (["--timeout", "soon"], "argument --timeout: expected a number of seconds > 0, got 'soon'"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
])
def test_refused_before_any_collective(argv, message, capsys):
    err = _refused(argv, capsys)
    if WORLD.rank == 0:
        assert message in err, err
        assert "usage: python -m mpicoll.verify" in err


def _rows(text):
    return [line.split() for line in text.splitlines()
            if line.split()[:1] and line.split()[0] in V.COLLECTIVES]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spelling", ["sum", "SUM", "Sum"])
def test_op_names_in_any_case(spelling, capsys):
    """--op sum, SUM and Sum all select MPI.SUM, and a real selection reports real checks."""
    status = V.main(["--quick", "--collective", "allreduce,Reduce_scatter_block",
                     "--dtype", "int32,float64", "--op", spelling, "--algorithm", "ring,auto"])
    out = capsys.readouterr().out
    assert status == 0
    if WORLD.rank != 0:
        assert out == ""
        return
    rows = _rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ("allreduce", "int32", "SUM"), ("allreduce", "float64", "SUM"),
        ("Reduce_scatter_block", "int32", "SUM"), ("Reduce_scatter_block", "float64", "SUM")]
    assert all(r[4] == "ring,auto" and r[-1] == "ok" for r in rows)
    n_counts = len(V._counts(WORLD.size, True))
    cases = 4 * n_counts * 2  # quick: each (count, algorithm) once, in or out of place
    assert re.search(rf"^PASS: all 4 checks agree with MPI's built-in \({cases} cases, "
                     rf"{WORLD.size} ranks", out, re.M), out


def test_op_table_is_the_library_one():
    """One op-name table: verify's ops are _types'; bench takes the same names in any case."""
    from mpicoll.core import types as _types
    from mpicoll.tools import bench
    assert V.REDUCTION_OPS == tuple(_types.OP_CATEGORIES)
    for name in V.REDUCTION_OPS:
        op = getattr(MPI, name)
        assert _types.predefined_op(name) == op
        assert _types.predefined_op(name.lower()) == op
        assert _types.predefined_op(name.capitalize()) == op
    for bad in ("REPLACE", "NO_OP", "sum2", "", None):
        with pytest.raises(ValueError, match="expected one of SUM, PROD"):
            _types.predefined_op(bad)
    parser = bench.build_parser()
    for spelling in ("sum", "SUM", "bXor"):
        assert parser.parse_args(["-o", spelling]).op == spelling.lower()
