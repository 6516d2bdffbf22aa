"""benchmarks/: the performance page is what its result files give, and record.py keeps them honest.

No MPI run: the renderer and record.py read JSON (record.py's ``--from`` takes a
run's records instead of running its command).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _load(name):
    sys.path.insert(0, str(BENCHMARKS))  # record.py imports render
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(BENCHMARKS))


render = _load("render")


def test_the_page_is_in_sync_with_the_result_files():
    """docs/performance.md's tables are what benchmarks/render.py makes of the result files
    (after a new result file: python benchmarks/render.py)."""
    text = render.PAGE.read_text()
    assert render.render(text) == text, "run: python benchmarks/render.py"
    assert render.main(["--check"]) == 0


def test_every_result_file_has_its_table_and_each_is_small():
    text = render.PAGE.read_text()
    marked = set(re.findall(r"<!-- results: ([\w.-]+) -->", text))
    files = {p.stem for p in render.RESULTS.glob("*.json")}
    assert marked == files, (marked ^ files)
    for name in files:
        path = render.RESULTS / f"{name}.json"
        data = json.loads(path.read_text())
        assert data["tool"] in render.TABLES and data["records"], name
        assert _load("record").tool_of(data["command"]) == data["tool"], name
        assert path.stat().st_size < 16 << 10, f"{name}: a curated file, not a dump"
        # every table is shown with the command that reproduces it
        assert f"`{data['command']}`" in text and f"record.py {name}`" in text, name


def test_the_page_is_short():
    """What the page says around its generated tables stays short (the tables are as long
    as their result files)."""
    prose = render.BLOCK.sub("", render.PAGE.read_text())
    assert len(prose.splitlines()) <= 200


def test_a_changed_result_changes_the_page(tmp_path, monkeypatch):
    """The check can fail: a result file that no longer matches the page is found."""
    results = tmp_path / "results"
    results.mkdir()
    for p in render.RESULTS.glob("*.json"):
        (results / p.name).write_text(p.read_text())
    name = sorted(results.glob("bench-*.json"))[0]
    data = json.loads(name.read_text())
    data["records"][0]["ratio"] = [12.0, 12.34, 12.5]
    name.write_text(json.dumps(data))
    monkeypatch.setattr(render, "RESULTS", results)
    text = render.PAGE.read_text()
    new = render.render(text)
    assert new != text and "**12.34** (12.00–12.50)" in new


def _records(tool, library, wrong=0, scale=1.0, selected="ring"):
    """One run's --json records as the tool writes them (``scale``: its times and ratios)."""
    base = {"mpi_library": library, "mpicoll": "0.1.0", "mpi4py": "4.1.2", "numpy": "2.4.6",
            "python": "3.11.7", "nranks": 2, "date": "x", "host": "gpu-node", "cores": 16}
    if tool == "overlap":
        return [{"tool": "overlap", "mode": m, "time_ms": (1.0 + i) * scale,
                 "overlap": None if i < 2 else 0.5 * scale, "bytes": 1 << 26, "dtype": "float32",
                 "matrix": 2048, "products": 9, "device": "gpu", "wrong": wrong, **base}
                for i, m in enumerate(("comm", "compute", "wait", "test", "thread"))]
    return [{"collective": "allreduce", "algorithm": "auto", "bytes": 16, "count": 4,
             "selected": selected, "time_us": 1.23456789 * scale, "inplace_time_us": 1.3 * scale,
             "builtin_time_us": 1.0, "builtin_inplace_time_us": 1.1, "ratio": 1.23 * scale,
             "inplace_ratio": 1.18 * scale, "busbw_gbps": 0.01, "inplace_busbw_gbps": 0.01,
             "builtin_busbw_gbps": 0.02, "builtin_inplace_busbw_gbps": 0.02, "wrong": wrong,
             "inplace_wrong": 0, "builtin_wrong": 0, "builtin_inplace_wrong": 0, "device": "cpu",
             **base}]


def _write_runs(tmp_path, runs):
    paths = []
    for i, records in enumerate(runs):
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(records))
        paths.append(str(path))
    return paths


@pytest.fixture
def record(tmp_path, monkeypatch):
    """record.py writing into tmp_path (results/, performance.md) instead of the repository."""
    record = _load("record")
    results = tmp_path / "results"
    results.mkdir()
    page = tmp_path / "performance.md"
    page.write_text("# Performance\n")
    monkeypatch.setattr(record.render, "RESULTS", results)
    monkeypatch.setattr(record.render, "PAGE", page)
    return record


OMPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution"


def _mark(page, name):
    """Give the table NAME its place on the page (its result file must exist from now on)."""
    page.write_text(page.read_text() + f"<!-- results: {name} -->\n<!-- end results -->\n")
BENCH = "mpiexec -n 2 python -m mpicoll.bench -b 16 -e 16"


def test_record_keeps_the_tables_fields_over_several_runs(record, tmp_path):
    """Three runs made elsewhere: every measured value kept as [min, median, max], the fields
    the table shows and nothing else, the page rendered with the medians and their ranges."""
    results, page = record.render.RESULTS, record.render.PAGE
    overlap = "mpiexec -n 2 python benchmarks/overlap.py --device gpu --size 64M"
    runs = _write_runs(tmp_path, [_records("overlap", OMPI, scale=s) for s in (1.0, 1.2, 0.9)])
    _mark(page, "overlap-gpu")
    assert record.main(["overlap-gpu", "--from", *runs, "--", *overlap.split()]) == 0
    data = json.loads((results / "overlap-gpu.json").read_text())
    assert data["command"] == overlap and data["runs"] == 3
    assert data["machine"] == {"cpu": "host gpu-node", "cores": 16}
    keep = set(record.KEYS["overlap"]) | set(record.AGREE["overlap"]) | set(record.MEASURED["overlap"])
    assert set(data["records"][0]) == keep | {"wrong"}  # (these records carry one)
    assert data["records"][2]["time_ms"] == [2.7, 3.0, 3.6]
    assert "| wait | 3.00 (2.70–3.60) | 0.50 (0.45–0.60) |" in page.read_text()
    assert "the median of 3 runs, each value with the lowest and highest" in page.read_text()
    runs = _write_runs(tmp_path, [_records("bench", OMPI, scale=s) for s in (1.0, 1.1, 1.0)])
    _mark(page, "bench-x")
    assert record.main(["bench-x", "--from", *runs, "--", *BENCH.split()]) == 0
    rec = json.loads((results / "bench-x.json").read_text())["records"][0]
    assert rec["time_us"] == [1.235, 1.235, 1.358] and rec["selected"] == "ring"
    assert rec["inplace_ratio"] == [1.18, 1.18, 1.298]
    text = page.read_text()
    assert "| allreduce | 16 B | `ring` | 1.24 | 1.00 | **1.23** (1.23–1.35) | 0.010 |" in text
    assert "|  | in place |  | 1.30 | 1.10 | **1.18** (1.18–1.30) |" in text


def test_one_noisy_run_moves_the_range_not_the_number(record, tmp_path, capsys):
    """A run on a busy machine (here: four times slower) cannot publish its number: the median
    of the runs stands, the range shows it, and record.py names the value on stderr."""
    runs = _write_runs(tmp_path, [_records("bench", OMPI, scale=s) for s in (1.0, 4.0, 1.02)])
    _mark(record.render.PAGE, "bench-x")
    assert record.main(["bench-x", "--from", *runs, "--", *BENCH.split()]) == 0
    rec = json.loads((record.render.RESULTS / "bench-x.json").read_text())["records"][0]
    assert rec["ratio"] == [1.23, 1.255, 4.92]
    assert "**1.25** (1.23–4.92)" in record.render.PAGE.read_text()
    assert "noisy" in capsys.readouterr().err


def test_record_refuses_runs_that_make_no_table(record, tmp_path, capsys):
    """Fewer than three runs, a wrong result, runs where auto ran different algorithms, or
    another MPI than the file had: refused, the file as it was."""
    results = record.render.RESULTS
    one = _write_runs(tmp_path, [_records("bench", OMPI)])
    with pytest.raises(SystemExit):
        record.main(["bench-x", "--from", *one, "--", *BENCH.split()])
    assert "expected at least 3 runs, got 1" in capsys.readouterr().err
    runs = _write_runs(tmp_path, [_records("bench", OMPI, wrong=w) for w in (0, 3, 0)])
    assert record.main(["bench-x", "--from", *runs, "--", *BENCH.split()]) == 1
    assert "wrong elements" in capsys.readouterr().err and not (results / "bench-x.json").exists()
    runs = _write_runs(tmp_path, [_records("bench", OMPI, selected=a)
                                  for a in ("ring", "ring", "recursive_doubling")])
    assert record.main(["bench-x", "--from", *runs, "--", *BENCH.split()]) == 1
    assert "the runs differ in selected" in capsys.readouterr().err
    runs = _write_runs(tmp_path, [_records("bench", OMPI)] * 3)
    _mark(record.render.PAGE, "bench-x")
    assert record.main(["bench-x", "--from", *runs, "--", *BENCH.split()]) == 0
    # the file holds Open MPI results: an MPICH run does not replace them
    runs = _write_runs(tmp_path, [_records("bench", "MPICH Version:      5.0.2")] * 3)
    assert record.main(["bench-x", "--from", *runs]) == 1
    assert "holds Open MPI results, this run used MPICH" in capsys.readouterr().err


def test_several_algorithms_render_as_one_row_per_algorithm():
    """A run of several algorithms: for each collective and size the built-in's time once,
    then a row per algorithm with its time over the built-in's, auto with what it ran."""
    def rec(collective, algorithm, ratio, selected=None):
        return {"collective": collective, "algorithm": algorithm, "bytes": 4096,
                "selected": selected or algorithm, "builtin_time_us": [9.0, 10.0, 11.0],
                "ratio": [ratio, ratio, ratio + 0.1]}
    rows = render.bench_table({"records": [
        rec("allreduce", "auto", 0.5, "recursive_doubling"), rec("allreduce", "shared_oneshot", 0.8),
        rec("allgather", "auto", 0.9, "ring"), rec("allgather", "shared", 1.25)]})
    assert rows[0] == "| collective | size | built-in (µs) | algorithm | mpicoll / built-in |"
    assert rows[2:] == ["| allreduce | 4 KiB | 10.0 | `auto` (`recursive_doubling`) | 0.50 (0.50–0.60) |",
                        "|  |  |  | `shared_oneshot` | 0.80 (0.80–0.90) |",
                        "| allgather | 4 KiB | 10.0 | `auto` (`ring`) | 0.90 (0.90–1.00) |",
                        "|  |  |  | `shared` | 1.25 (1.25–1.35) |"]


def test_record_reads_what_the_tools_write():
    """Every field record.py keeps of a benchmark record is one the tool writes."""
    from mpicoll.tools import bench
    record = _load("record")
    kept = set(record.KEYS["bench"]) | set(record.AGREE["bench"]) | set(record.MEASURED["bench"])
    assert kept | set(record.WRONG) <= set(bench.RECORD_FIELDS)
