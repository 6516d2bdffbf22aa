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
    assert len(render.PAGE.read_text().splitlines()) <= 300


def test_a_changed_result_changes_the_page(tmp_path, monkeypatch):
    """The check can fail: a result file that no longer matches the page is found."""
    results = tmp_path / "results"
    results.mkdir()
    for p in render.RESULTS.glob("*.json"):
        (results / p.name).write_text(p.read_text())
    name = sorted(results.glob("bench-*.json"))[0]
    data = json.loads(name.read_text())
    data["records"][0]["ratio"] = 12.34
    name.write_text(json.dumps(data))
    monkeypatch.setattr(render, "RESULTS", results)
    text = render.PAGE.read_text()
    new = render.render(text)
    assert new != text and "**12.34**" in new


def _records(tool, library, wrong=0):
    base = {"mpi_library": library, "mpicoll": "0.1.0", "mpi4py": "4.1.2", "numpy": "2.4.6",
            "python": "3.11.7", "nranks": 2, "date": "x", "host": "gpu-node", "cores": 16}
    if tool == "overlap":
        return [{"tool": "overlap", "mode": m, "time_ms": 1.0 + i, "overlap": None if i < 2 else 0.5,
                 "bytes": 1 << 26, "dtype": "float32", "matrix": 2048, "products": 9,
                 "device": "gpu", "wrong": wrong, **base}
                for i, m in enumerate(("comm", "compute", "wait", "test", "thread"))]
    return [{"collective": "allreduce", "bytes": 16, "count": 4, "selected": "ring",
             "time_us": 1.23456789, "inplace_time_us": 1.3, "builtin_time_us": 1.0, "ratio": 1.23,
             "busbw_gbps": 0.01, "inplace_busbw_gbps": 0.01, "builtin_busbw_gbps": 0.02,
             "wrong": wrong, "inplace_wrong": 0, "builtin_wrong": 0, "device": "cpu", **base}]


def test_record_keeps_the_tables_fields_and_refuses_bad_runs(tmp_path, monkeypatch, capsys):
    record = _load("record")
    results = tmp_path / "results"
    results.mkdir()
    page = tmp_path / "performance.md"
    page.write_text("<!-- results: overlap-gpu -->\n<!-- end results -->\n")
    monkeypatch.setattr(record.render, "RESULTS", results)
    monkeypatch.setattr(record.render, "PAGE", page)
    ompi = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution"
    src = tmp_path / "run.json"
    overlap = "mpiexec -n 2 python benchmarks/overlap.py --device gpu --size 64M"
    src.write_text(json.dumps(_records("overlap", ompi)))
    assert record.main(["overlap-gpu", "--from", str(src), "--", *overlap.split()]) == 0
    data = json.loads((results / "overlap-gpu.json").read_text())
    assert data["command"] == overlap and data["machine"] == {"cpu": "host gpu-node", "cores": 16}
    assert set(data["records"][0]) == set(record.KEEP["overlap"])
    assert "| wait | 3.00 | 0.50 |" in page.read_text()
    page.write_text(page.read_text() + "<!-- results: bench-x -->\n<!-- end results -->\n")
    bench = "mpiexec -n 2 python -m mpicoll.bench -b 16 -e 16"
    src.write_text(json.dumps(_records("bench", ompi, wrong=3)))
    assert record.main(["bench-x", "--from", str(src), "--", *bench.split()]) == 1
    assert "wrong results" in capsys.readouterr().err and not (results / "bench-x.json").exists()
    src.write_text(json.dumps(_records("bench", ompi)))
    assert record.main(["bench-x", "--from", str(src), "--", *bench.split()]) == 0
    assert json.loads((results / "bench-x.json").read_text())["records"][0]["time_us"] == 1.235
    # the file holds Open MPI results: an MPICH run does not replace them
    src.write_text(json.dumps(_records("bench", "MPICH Version:      5.0.2")))
    assert record.main(["bench-x", "--from", str(src)]) == 1
    assert "holds Open MPI results, this run used MPICH" in capsys.readouterr().err


def test_several_algorithms_render_as_one_row_per_collective_and_size():
    """A run of several algorithms: each algorithm's time over the built-in's, auto with what
    it ran, "-" where a collective has no such algorithm."""
    def rec(collective, algorithm, ratio, selected=None):
        return {"collective": collective, "algorithm": algorithm, "bytes": 4096,
                "selected": selected or algorithm, "builtin_time_us": 10.0, "ratio": ratio}
    rows = render.bench_table({"records": [
        rec("allreduce", "auto", 0.5, "recursive_doubling"), rec("allreduce", "shared_oneshot", 0.8),
        rec("allgather", "auto", 0.9, "ring"), rec("allgather", "shared", 1.25)]})
    assert rows[0] == "| collective | size | built-in (µs) | `auto` | `shared_oneshot` | `shared` |"
    assert rows[2:] == ["| allreduce | 4 KiB | 10.0 | 0.50 (`recursive_doubling`) | 0.80 | - |",
                        "| allgather | 4 KiB | 10.0 | 0.90 (`ring`) | - | 1.25 |"]
