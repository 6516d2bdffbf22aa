"""Every tool reports a user's mistake in one line and an exit status, never a traceback.

The mistakes are the kinds a user makes: an argument out of range, an output
file that cannot be written, a file that cannot answer the question, a
device that is not there.  Each tool's ``main`` runs in this process (an
argument mistake is argparse's ``SystemExit(2)``, the others its return
value); one case runs the command line as a user types it.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys

import pytest
from support import util

pytestmark = pytest.mark.local


def _one_rank_tuning(path):
    """A tuning file as ``python -m mpicoll.tune`` writes it at 1 rank: no exchange curve."""
    from mpicoll.engine import tuning as _tuning
    ident = _tuning.mpi_identity()
    entry = {"source": "measured", "ranks": [1, 1], "nodes": [1, 1],
             "measured": {"date": "d", "host": "h", "ranks": 1, "nodes": 1},
             "selection": {c: [[None, "ring"]] for c in _tuning.COLLECTIVES},
             "p2p": {}, "model": None, "times_us": {}, "builtin_us": {}}
    path.write_text(json.dumps({"format": _tuning.FORMAT, "version": _tuning.VERSION,
                                "mpi": {"library": ident["library"], "version": ident["version"],
                                        "line": "x"}, "entries": [entry]}))
    return str(path)


SMALL_BENCH = ["-C", "allgather", "-b", "8", "-e", "8", "-n", "1", "-w", "0", "-q"]
SMALL_LATENCY = ["--sizes", "16", "--collectives", "allreduce", "--reps", "1", "--inner", "1",
                 "--warmup", "0"]
CASES = [
    # (tool module or benchmarks.SCRIPT, arguments, exit status, the message's words)
    ("mpicoll.tools.tune", ["--predict", "8", "--file", "{one_rank}"], 1,
     "mpicoll.tune: {one_rank}: no measured entry with an exchange curve"),
    ("mpicoll.tools.tune", ["--check", "{missing}"], 1, "mpicoll.tune: cannot read the tuning file"),
    ("mpicoll.tools.tune", ["--ranks-per-node", "4"], 2, "--ranks-per-node: only with --predict"),
    ("mpicoll.tools.bench", ["-C", "allreduce", "--json", "{missing}/r.json"], 2,
     "--json: cannot write {missing}/r.json: no directory"),
    ("benchmarks.overlap", ["--size", "lots"], 2, "argument --size: expected a size"),
    ("benchmarks.overlap", ["--json", "{missing}/o.json"], 2, "--json: cannot write"),
    ("benchmarks.latency", ["--reps", "0"], 2, "argument --reps: expected a positive integer"),
    ("benchmarks.latency", ["--json", "{missing}/l.json"], 2, "--json: cannot write"),
    # (a few small sizes after the mistake: a tool that took it would run quickly, then fail)
    ("mpicoll.tools.bench", ["--plot=out.txt", *SMALL_BENCH], 2,
     "argument --plot: expected a file name ending in ."),
    ("mpicoll.tools.bench", ["--plot", "{missing}/p.png", *SMALL_BENCH], 2,
     "--plot: cannot write {missing}/p.png: no directory"),
    ("benchmarks.latency", ["--timeout=0", *SMALL_LATENCY], 2,
     "argument --timeout: expected a number of seconds > 0, got '0'"),
    ("benchmarks.latency", ["--timeout=-1", *SMALL_LATENCY], 2,
     "argument --timeout: expected a number of seconds > 0, got '-1'"),
    ("benchmarks.latency", ["--timeout=nan", *SMALL_LATENCY], 2,
     "argument --timeout: expected a number of seconds > 0, got 'nan'"),
    ("benchmarks.overlap", ["--json={missing}/o.json", "--size", "64K", "--reps", "1",
                               "--warmup", "0", "--matrix", "16"], 2, "--json: cannot write"),
]


@pytest.mark.parametrize("module, argv, status, message", CASES,
                         ids=[f"{c[0].split('.')[-1]} {c[1][0]}" for c in CASES])
def test_a_mistake_is_one_line(module, argv, status, message, tmp_path, capsys):
    names = {"one_rank": _one_rank_tuning(tmp_path / "one-rank.json"),
             "missing": str(tmp_path / "missing")}
    argv = [a.format(**names) for a in argv]
    main = (util.benchmark(module.split(".", 1)[1]) if module.startswith("benchmarks.")
            else importlib.import_module(module)).main
    try:
        got = main(argv)
    except SystemExit as exc:
        got = exc.code
    err = capsys.readouterr().err
    assert got == status, err
    assert "Traceback" not in err
    assert message.format(**names) in err.splitlines()[-1], err
    if "file name ending" in message:  # (matplotlib's formats, named)
        assert ".png, " in err.splitlines()[-1] and "(matplotlib's formats)" in err, err


TOOLS = ["mpicoll.tools.bench", "benchmarks.latency", "benchmarks.overlap",
         "mpicoll.tools.tune.cli", "benchmarks.torch_bench"]


@pytest.mark.parametrize("module", TOOLS, ids=[m.split(".", 1)[1] for m in TOOLS])
def test_every_output_file_is_checked_before_the_run(module):
    """Every option that names a file a tool writes is declared as an output (harness
    ``Parser.add_output``), so parse_args refuses it before anything runs; the tuning's
    ``-o`` is checked by the tool itself (it creates a missing folder, and ``--check``
    writes nothing)."""
    if module.endswith("torch_bench"):
        pytest.importorskip("torch.distributed")
    mod = (util.benchmark(module.split(".", 1)[1]) if module.startswith("benchmarks.")
           else importlib.import_module(module))
    parser = (getattr(mod, "build_parser", None) or mod._parser)()
    declared = set(parser._outputs)
    written = {a.dest for a in parser._actions if a.dest in ("json", "csv", "plot")}
    assert written <= declared, f"{module}: {sorted(written - declared)} not checked before the run"


@pytest.mark.timeout(60)
def test_the_command_line_prints_no_traceback(tmp_path):
    """``python -m mpicoll.tune --predict 8 --file F`` on a 1-rank tuning: one line, exit 1."""
    path = _one_rank_tuning(tmp_path / "one-rank.json")
    run = subprocess.run([sys.executable, "-m", "mpicoll.tune", "--predict", "8", "--file", path],
                         capture_output=True, text=True, timeout=50)
    assert run.returncode == 1 and run.stdout == "", run
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(f"mpicoll.tune: {path}: "), run


def test_no_gpu_is_one_line(capsys):
    """``--device gpu`` where CuPy is missing: one line, exit status 1."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed: the refusal needs a machine without it")
    from mpicoll.tools import bench
    overlap = util.benchmark("overlap")
    for name, main in (("mpicoll.bench", bench.main), ("benchmarks/overlap.py", overlap.main)):
        assert main(["--device", "gpu"]) == 1
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{name}: --device gpu: "), lines
        assert "CuPy is not installed" in lines[0]
