"""python -m mpicoll.bench at small sizes: table, JSON and CSV fields, #wrong, exit status.

Runs the benchmark's entry point ``main(argv)`` on the current MPI world.
No timing is asserted (this machine is shared); only that every field is
there, consistent and that results are right (and a wrong one is reported).
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.engine import select as _select
from mpicoll.tools import bench
from mpicoll.tools.harness import workload

# the benchmark tool: 1 rank, and 3 for bus-bandwidth factors and #wrong over ranks
pytestmark = pytest.mark.ranks(1, 3)

WORLD = MPI.COMM_WORLD
SMALL = ["-b", "1K", "-e", "64K", "-f", "4", "-n", "3", "-w", "1", "--batch", "2", "-q"]


@pytest.fixture
def shared_dir():
    """A directory every rank sees (created by rank 0)."""
    path = tempfile.mkdtemp(prefix="mpicoll-bench-") if WORLD.rank == 0 else None
    path = WORLD.bcast(path, root=0)
    yield path
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def _run(argv, **kw):
    out = io.StringIO()
    status = bench.main(argv, out=out, **kw)
    return status, out.getvalue()


def _rows(text):
    return [line.split() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _printed(text):
    """(low, high): the values that the table prints as ``text`` (rounded to its digits)."""
    value = float(text)
    decimals = len(text.split(".")[1]) if "." in text else 0
    half = 0.5 * 10.0 ** -decimals + 1e-12 * max(abs(value), 1.0)
    return value - half, value + half


def _assert_rounds(text, lo, hi, what):
    """``text`` is some value in [lo, hi] rounded to the digits printed."""
    p_lo, p_hi = _printed(text)
    assert p_hi >= lo and p_lo <= hi, f"{what}: {text} is no value in [{lo:.6g}, {hi:.6g}] rounded"


def _check_row(r, factor):
    """One table row is one statistic per implementation, to the digits printed.

    algbw = size / time, busbw = algbw * factor, ratio = time / built-in time
    and the in-place ratio = in-place time / the built-in's in-place time,
    where each printed number stands for any value that rounds to it:
    the bounds come from the printed time's interval, never from a rounded
    number multiplied again (which would add its rounding error to the check).
    """
    size = int(r[0])
    times = {}
    for name, (t, algbw, busbw) in (("mpicoll", (5, 6, 7)), ("in place", (9, 10, 11)),
                                    ("built-in", (13, 14, 15)),
                                    ("built-in in place", (17, 18, 19))):
        t_lo, t_hi = times[name] = _printed(r[t])
        assert t_lo > 0, f"{name} time {r[t]}"
        bw_lo, bw_hi = size / (t_hi * 1e3), size / (t_lo * 1e3)  # bytes / us -> GB/s
        _assert_rounds(r[algbw], bw_lo, bw_hi, f"{name} algbw of {size} B in {r[t]} us")
        _assert_rounds(r[busbw], bw_lo * factor, bw_hi * factor,
                       f"{name} busbw of {size} B in {r[t]} us, factor {factor:g}")
    (m_lo, m_hi), (b_lo, b_hi) = times["mpicoll"], times["built-in"]
    _assert_rounds(r[21], m_lo / b_hi, m_hi / b_lo, f"ratio of {r[5]} us and {r[13]} us")
    (m_lo, m_hi), (b_lo, b_hi) = times["in place"], times["built-in in place"]
    _assert_rounds(r[22], m_lo / b_hi, m_hi / b_lo, f"in-place ratio of {r[9]} us and {r[17]} us")


def _table_row(rec):
    """The row bench.Table prints for ``rec``, split into columns."""
    out = io.StringIO()
    bench.Table(out, bench.build_parser().parse_args([])).row(rec)
    return out.getvalue().split()


def _record(nbytes, time_us, builtin_time_us, factor, collective="allreduce", algbw_us=None):
    """A record as bench.measure() makes it (algbw from ``algbw_us`` if given: inconsistent;
    in place as fast as out of place, for mpicoll and the built-in alike)."""
    algbw = nbytes / (algbw_us or time_us) / 1e3
    inplace = nbytes / time_us / 1e3
    builtin = nbytes / builtin_time_us / 1e3
    return {"collective": collective, "op": "sum", "bytes": nbytes, "count": nbytes // 4,
            "dtype": "float32", "selected": "ring", "time_us": time_us, "algbw_gbps": algbw,
            "busbw_gbps": algbw * factor, "wrong": 0, "inplace_time_us": time_us,
            "inplace_algbw_gbps": inplace, "inplace_busbw_gbps": inplace * factor,
            "inplace_wrong": 0, "builtin_time_us": builtin_time_us,
            "builtin_algbw_gbps": builtin, "builtin_busbw_gbps": builtin * factor,
            "builtin_wrong": 0, "builtin_inplace_time_us": builtin_time_us,
            "builtin_inplace_algbw_gbps": builtin, "builtin_inplace_busbw_gbps": builtin * factor,
            "builtin_inplace_wrong": 0, "ratio": time_us / builtin_time_us,
            "inplace_ratio": time_us / builtin_time_us}


def test_row_check_is_exact_about_rounding():
    """Regression: CI failed once on 'assert 0.14 == 0.128 +- 0.011' at 5 ranks.

    The table was consistent: algbw 0.0845 GB/s prints as 0.08 and busbw
    0.0845 * 1.6 = 0.1352 as 0.14, but the old check multiplied the printed
    0.08 by 1.6.  The check must accept every consistent row and still
    reject a row whose columns come from different statistics.
    """
    factor = 2 * (5 - 1) / 5
    for time_us in (1024 / 84.5, 1024 / 84.49, 1024 / 84.51, 0.5, 99.996, 100.04, 1e5 + 0.4):
        for builtin_time_us in (time_us * 0.9, time_us * 1.23, 3.0):
            _check_row(_table_row(_record(1024, time_us, builtin_time_us, factor)), factor)
    for nbytes in (8, 1000, 4096, 1 << 20, 64 << 20):
        for time_us in np.geomspace(0.3, 3e5, 97):
            _check_row(_table_row(_record(nbytes, time_us, time_us * 1.07, factor)), factor)
    inconsistent = _table_row(_record(1 << 20, 50.0, 60.0, factor, algbw_us=50.0 * 1.1))
    with pytest.raises(AssertionError, match="algbw"):
        _check_row(inconsistent, factor)


def _expected_sizes(lo, hi, factor, collective):
    n = WORLD.size
    out = []
    for s in bench.sizes(lo, hi, factor):
        if collective == "allreduce":
            out.append(max(s // 4, 1) * 4)
        else:
            out.append(max(s // (4 * n), 1) * n * 4)
    return out


@pytest.mark.timeout(120)
def test_json_holds_each_measurement_as_it_ends(shared_dir, monkeypatch):
    """A run stopped partway (the device check's time limit on a line) leaves the sizes it
    measured in its --json file, not nothing."""
    class Stopped(Exception):
        pass

    jpath = os.path.join(shared_dir, "cut.json")
    real, done = bench.measure, []

    def measure(*args, **kwargs):
        if len(done) == 2:  # (every rank stops at the same size)
            raise Stopped
        done.append(real(*args, **kwargs))
        return done[-1]

    monkeypatch.setattr(bench, "measure", measure)
    with pytest.raises(Stopped):
        _run(["-C", "allreduce", "-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "-w", "0", "-q",
              "--json", jpath])
    WORLD.Barrier()
    if WORLD.rank == 0:
        with open(jpath) as f:
            assert [r["bytes"] for r in json.load(f)] == [1024, 4096]


@pytest.mark.timeout(300)
def test_table_json_csv(shared_dir):
    jpath = os.path.join(shared_dir, "r.json")
    cpath = os.path.join(shared_dir, "r.csv")
    status, text = _run(SMALL + ["--json", jpath, "--csv", cpath])
    assert status == 0
    WORLD.Barrier()
    if WORLD.rank != 0:
        assert text == ""  # only rank 0 prints
        return
    n = WORLD.size
    assert "# MPI library: " in text and f"# ranks {n} " in text
    assert "warm-up 1 calls (the first size: 100, a new process runs slow), timed 3 calls" in text
    assert "Out of bounds values : 0 wrong (mpicoll), 0 wrong (built-in) OK" in text
    rows = _rows(text)
    per_coll = len(bench.sizes(1024, 65536, 4))
    assert len(rows) == 3 * per_coll
    factors = {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "reduce_scatter": (n - 1) / n}
    for i, coll in enumerate(bench.COLLECTIVES):
        got = rows[i * per_coll: (i + 1) * per_coll]
        assert [int(r[0]) for r in got] == _expected_sizes(1024, 65536, 4, coll)
        for r in got:
            size, count, dtype, redop, algo = int(r[0]), int(r[1]), r[2], r[3], r[4]
            assert count * 4 == size and dtype == "float32"
            assert redop == ("none" if coll == "allgather" else "sum")
            assert algo in _select.ALGORITHMS[coll]
            assert r[8] == r[12] == r[16] == r[20] == "0"
            _check_row(r, factors[coll])

    records = json.load(open(jpath))
    assert len(records) == 3 * per_coll
    for rec in records:
        for field in ("collective", "algorithm", "nranks", "dtype", "op", "bytes", "count",
                      "time_us", "busbw_gbps", "builtin_time_us", "ratio", "wrong",
                      "mpi_library", "date"):
            assert field in rec, field
        assert rec["nranks"] == n
        assert rec["wrong"] == rec["inplace_wrong"] == rec["builtin_wrong"] == rec["builtin_inplace_wrong"] == 0
        assert rec["algorithm"] == "auto" and rec["selected"] in _select.ALGORITHMS[rec["collective"]]
        # one statistic per implementation: every field follows from its time
        factor = factors[rec["collective"]]
        for prefix in ("", "inplace_", "builtin_", "builtin_inplace_"):
            algbw = rec["bytes"] / rec[prefix + "time_us"] / 1e3
            assert rec[prefix + "algbw_gbps"] == pytest.approx(algbw, rel=1e-12)
            assert rec[prefix + "busbw_gbps"] == pytest.approx(algbw * factor, rel=1e-12)
        assert rec["ratio"] == pytest.approx(rec["time_us"] / rec["builtin_time_us"], rel=1e-12)
        assert rec["inplace_ratio"] == pytest.approx(
            rec["inplace_time_us"] / rec["builtin_inplace_time_us"], rel=1e-12)
        assert rec["check_time_us"] is None
    for r, rec in zip(rows, records):  # the table prints the records, rounded
        _assert_rounds(r[5], rec["time_us"], rec["time_us"], "time")
        _assert_rounds(r[9], rec["inplace_time_us"], rec["inplace_time_us"], "in-place time")
        _assert_rounds(r[13], rec["builtin_time_us"], rec["builtin_time_us"], "built-in time")
        _assert_rounds(r[17], rec["builtin_inplace_time_us"], rec["builtin_inplace_time_us"],
                       "built-in in-place time")
    with open(cpath, newline="") as f:
        rows_csv = list(csv.DictReader(f))
    assert len(rows_csv) == len(records)
    assert set(rows_csv[0]) == set(bench.RECORD_FIELDS)
    assert [int(r["bytes"]) for r in rows_csv] == [r["bytes"] for r in records]


@pytest.mark.timeout(300)
def test_every_algorithm_and_dtypes(shared_dir):
    jpath = os.path.join(shared_dir, "all.json")
    for coll in bench.COLLECTIVES:
        for dtype, op in (("int32", "max"), ("float64", "prod"), ("uint8", "bxor")):
            status, text = _run(["-C", coll, "-a", "all", "-d", dtype, "-o", op, "-b", "1", "-e", "4K",
                                 "-f", "64", "-n", "2", "-w", "0", "-q", "--api", "array",
                                 "--json", jpath])
            assert status == 0, text
            if WORLD.rank == 0:
                recs = json.load(open(jpath))
                assert {r["algorithm"] for r in recs} == set(_select.ALGORITHMS[coll])
                assert all(r["selected"] == r["algorithm"] for r in recs)
                assert all(r["wrong"] == r["inplace_wrong"] == r["builtin_wrong"] == r["builtin_inplace_wrong"] == 0
                           for r in recs)
                assert all(r["dtype"] == dtype for r in recs)
            WORLD.Barrier()


def test_half_types_against_float32_builtin(shared_dir):
    """-d float16 / bfloat16 (with ml_dtypes) / float8: mpicoll in the type, the built-in on
    the same count in float32 (or the same bytes for AllGather); both results checked."""
    jpath = os.path.join(shared_dir, "half.json")
    names = ["float16"] + (["bfloat16", "float8_e4m3fn"] if "bfloat16" in bench.DTYPES else [])
    for dtype in names:
        status, text = _run(["-C", "allreduce,allgather,reduce_scatter", "-d", dtype, "-b", "8",
                             "-e", "4K", "-f", "64", "-n", "2", "-w", "0", "-q", "--json", jpath])
        assert status == 0, text
        if WORLD.rank == 0:
            recs = json.load(open(jpath))
            assert recs and all(r["wrong"] == r["inplace_wrong"] == r["builtin_wrong"] == 0
                                for r in recs), dtype
            assert all(r["dtype"] == dtype for r in recs)
        WORLD.Barrier()


@pytest.mark.timeout(120)
def test_the_runs_first_small_size_is_warmed_up_longer(shared_dir, monkeypatch):
    """A new process's first small calls run slow: the run's first size gets at least
    FIRST_WARMUP warm-up calls of each implementation (the first cell of a run took 1.5-2.3x
    the next size's time in 5 of 13 runs with 5), the later ones the option's; -w 0 stays 0; the header
    and the JSON say so."""
    seen = []
    real = bench.time_variants

    def spy(comm, variants, **kw):
        seen.append(kw["warmup"])
        return real(comm, variants, **kw)

    monkeypatch.setattr(bench, "time_variants", spy)
    path = os.path.join(shared_dir, "warm.json")
    status, text = _run(["-C", "allreduce,allgather", "-b", "8", "-e", "16", "-n", "2", "-w", "3",
                         "-q", "--json", path])
    assert status == 0
    assert seen == [bench.FIRST_WARMUP, 3, 3, 3], seen
    if WORLD.rank == 0:
        assert f"warm-up 3 calls (the first size: {bench.FIRST_WARMUP}," in text
        with open(path) as f:
            assert [r["warmup"] for r in json.load(f)] == seen
    seen.clear()
    assert _run(["-C", "allreduce", "-b", "8", "-e", "8", "-n", "2", "-w", "0", "-q"])[0] == 0
    assert seen == [0]
    seen.clear()
    assert _run(["-C", "allreduce", "-b", "1M", "-e", "1M", "-n", "2", "-w", "2", "-q"])[0] == 0
    assert seen == [2]


@pytest.mark.timeout(120)
def test_check_cost_and_no_check():
    status, text = _run(["-C", "allreduce", "-b", "64", "-e", "64", "-n", "2", "-w", "1", "-q",
                         "--check-cost", "-c", "0"])
    assert status == 0
    if WORLD.rank == 0:
        assert "with check" in text
        row = _rows(text)[0]
        assert row[8] == row[12] == row[16] == row[20] == "N/A"
        assert len(row) == 25 and float(row[23]) > 0 and float(row[24]) > 0
        assert "not checked (-c 0)" in text


@pytest.mark.timeout(120)
def test_memory_columns(shared_dir):
    jpath = os.path.join(shared_dir, "m.json")
    status, text = _run(["-C", "allreduce,reduce_scatter", "-a", "ring", "-b", "64K", "-e", "64K",
                         "-n", "1", "-w", "0", "-q", "--memory", "--json", jpath])
    assert status == 0
    if WORLD.rank == 0:
        assert "work memory" in text
        recs = json.load(open(jpath))
        for rec in recs:
            assert rec["peak_alloc_bytes"] >= rec["scratch_bytes"] >= 0
            row = [r for r in _rows(text) if r[4] == "ring"]
            assert all(len(r) == 25 for r in row)
        # out of place the ring AllReduce needs no work memory, the ring
        # ReduceScatter at most 2 * window segments (1 MiB each by default)
        for r in recs:
            if r["collective"] == "allreduce" or WORLD.size <= 2:
                assert r["scratch_bytes"] == 0
            else:
                assert 0 < r["scratch_bytes"] <= 4 << 20


@pytest.mark.timeout(120)
def test_wrong_results_are_counted(monkeypatch):
    """An algorithm that returns garbage must show in #wrong and the exit status."""

    from mpicoll.algorithms.schedule import DST, SRC, Builder, Region

    def broken(shape):  # a schedule builder that moves nothing: only this rank's data
        b = Builder()
        b.copy(Region(DST, 0, shape.total), Region(SRC, 0, shape.total))
        return b.build(0)

    monkeypatch.setitem(_select.ALGORITHMS["allreduce"], "broken", broken)
    status, text = _run(["-C", "allreduce", "-a", "broken", "-b", "1K", "-e", "1K", "-n", "1",
                         "-w", "0", "-q"])
    if WORLD.size == 1:
        assert status == 0  # one rank: its own data is the right answer
        return
    assert status == 1
    if WORLD.rank == 0:
        row = _rows(text)[0]
        assert 0 < int(row[8]) <= 256 * WORLD.size and 0 < int(row[12]) <= 256 * WORLD.size
        assert row[16] == row[20] == "0" and "FAILED" in text


@pytest.mark.timeout(120)
def test_op_in_any_case(shared_dir):
    """-o PROD and -o prod are the same op (verify takes SUM, bench took only sum)."""
    jpath = os.path.join(shared_dir, "op.json")
    status, text = _run(["-C", "allreduce,reduce_scatter", "-o", "PROD", "-d", "int32", "-b", "64",
                         "-e", "64", "-n", "1", "-w", "0", "-q", "--json", jpath])
    assert status == 0, text
    if WORLD.rank == 0:
        assert [r[3] for r in _rows(text)] == ["prod", "prod"]
        assert [(r["op"], r["wrong"], r["inplace_wrong"], r["builtin_wrong"],
                 r["builtin_inplace_wrong"])
                for r in json.load(open(jpath))] == [("prod", 0, 0, 0, 0)] * 2


@pytest.mark.timeout(120)
def test_an_algorithm_list_runs_each_name_where_it_applies(shared_dir):
    """-C all -a auto,ring,shared_oneshot,shared: every collective runs auto and the ring, the
    AllReduce the one-shot, ReduceScatter and AllGather `shared` (the names they have)."""
    jpath = os.path.join(shared_dir, "mixed.json")
    status, text = _run(["-C", "all", "-a", "auto,ring,shared_oneshot,shared", "-b", "64",
                         "-e", "64", "-n", "1", "-w", "0", "-q", "--json", jpath])
    assert status == 0, text
    if WORLD.rank == 0:
        ran = sorted((r["collective"], r["algorithm"]) for r in json.load(open(jpath)))
        assert ran == sorted([(c, a) for c in ("allreduce", "reduce_scatter", "allgather")
                              for a in ("auto", "ring")]
                             + [("allreduce", "shared_oneshot"), ("reduce_scatter", "shared"),
                                ("allgather", "shared")]), ran


@pytest.mark.parametrize("argv, message", [
    (["-C", "bogus"], "-C/--collective"),
    (["-C", "allgather", "-a", "auto,shared_oneshot"], "not an algorithm of allgather"),
    (["-b", "1M", "-e", "1K"], "larger than"),
    (["-b", "0"], "positive"),
    (["-f", "1"], "expected a number > 1"),
    (["-C", "allreduce", "-a", "bruck"], "not an algorithm of allreduce"),
    (["-d", "float32", "-o", "band", "-C", "allreduce"], "BAND does not apply"),
    (["-d", "bool"], "invalid choice"),
    (["-o", "minloc"], "argument -o/--op: invalid choice: 'minloc'"),
    (["-o", "Band", "-d", "float64", "-C", "reduce_scatter"], "MPI.BAND does not apply"),
    (["--overlap", "1M"], "unrecognized arguments: --overlap 1M"),  # (benchmarks/overlap.py)
    (["--json", "/nonexistent-dir/r.json"], "--json: cannot write /nonexistent-dir/r.json"),
    (["--csv", "."], "--csv: cannot write .: is a directory"),
])
def test_bad_arguments(argv, message, capsys):
    """Refused before anything is measured: exit status 2 on every rank, the message once."""
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    if WORLD.rank == 0:
        assert message in err and "Traceback" not in err
    else:
        assert err == ""


def test_plot(shared_dir, capsys):
    path = os.path.join(shared_dir, "p.png")
    argv = ["-C", "allgather", "-b", "64", "-e", "256", "-n", "1", "-w", "0", "-q", "--plot", path]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert "pip install 'mpicoll[plot]'" in capsys.readouterr().err
        return
    status, _ = _run(argv)
    assert status == 0
    if WORLD.rank == 0:
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_sizes():
    assert bench.sizes(1, 8, 2) == [1, 2, 4, 8]
    assert bench.sizes(1024, 5000, 4) == [1024, 4096]
    assert bench.sizes(3, 5, 1.1) == [3, 4, 5]
    assert bench.sizes(10, 10, 2) == [10]


def test_expected_values_are_exact():
    """The check's inputs are small integers: every type and op gives exact results."""
    n = 5
    for dtype in (np.int8, np.uint16, np.float32, np.complex64):
        for op in ("sum", "prod", "min", "max"):
            if np.dtype(dtype).kind == "c" and op in ("min", "max"):
                continue
            want = workload.expected("allreduce", n, 40, np.dtype(dtype), op, 0)
            wide = np.complex128 if np.dtype(dtype).kind == "c" else np.int64
            ref = sum(workload.rank_data(r, n, 40, np.dtype(dtype), op).astype(wide)
                      for r in range(n)) if op == "sum" else None
            if ref is not None:
                np.testing.assert_array_equal(want, ref.astype(dtype))
            assert workload.count_wrong(want, want, np.dtype(dtype), n) == 0
    x = workload.rank_data(1, 3, 10, np.dtype(np.float32), "sum")
    y = x.copy()
    y[3] += 1
    assert workload.count_wrong(y, x, np.dtype(np.float32), 3) == 1
    # floating SUM: rounding within the checker's rule passes, a wrong element does not
    want = workload.expected("allreduce", 3, 10, np.dtype(np.float32), "sum", 0)
    scale = workload.error_scale("allreduce", 3, 10, np.dtype(np.float32), "sum", 0)
    assert scale is not None and np.all(scale >= np.abs(want))
    rounded = want.copy()
    big = int(np.argmax(scale))
    rounded[big] = np.nextafter(rounded[big], np.float32(np.inf))
    assert workload.count_wrong(rounded, want, np.dtype(np.float32), 3, "sum", scale) == 0
    assert workload.count_wrong(rounded, want, np.dtype(np.float32), 3) == 1  # no scale: exact
    rounded[0] += 1
    assert workload.count_wrong(rounded, want, np.dtype(np.float32), 3, "sum", scale) == 1
    assert workload.error_scale("allreduce", 3, 10, np.dtype(np.int32), "sum", 0) is None


@pytest.mark.timeout(120)
def test_gpu_path_with_fake_device():
    """--device gpu: the device path (uploads, staged built-in, downloads) on the fake GPU."""
    from support import fakegpu
    backend = fakegpu.fake_backend(compute="lazy", copies="lazy")
    with fakegpu.registered(backend):
        status, text = _run(["-b", "256", "-e", "4K", "-f", "4", "-n", "2", "-w", "1", "-q",
                             "--device", "gpu"], device_backend=backend)
    assert status == 0, text
    if WORLD.rank == 0:
        assert "device gpu" in text
        assert all(r[8] == r[12] == r[16] == r[20] == "0" for r in _rows(text))


@pytest.mark.timeout(120)
@pytest.mark.ranks(4)  # two emulated nodes of two ranks
def test_selected_is_what_auto_runs_across_nodes(shared_dir, monkeypatch):
    """The "selected" field is the engine's choice with the communicator's node layout: across
    nodes the ring's sizes run hierarchical (it said "ring" there)."""
    monkeypatch.setenv("MPICOLL_FAKE_NODES", "block:2")
    comm = WORLD.Dup()  # a new context: it reads the layout
    try:
        jpath = os.path.join(shared_dir, "r.json")
        status, _ = _run(["-C", "allreduce", "-b", "1M", "-e", "1M", "-n", "1", "-w", "0", "-q",
                          "--json", jpath], comm=comm)
        assert status == 0
        comm.Barrier()
        with mpicoll.traffic() as t:
            mpicoll.allreduce(np.ones(1 << 17), comm=comm)
        ran = t.calls[-1].algorithm
        rec = json.load(open(jpath))[0]
        assert ran == "hierarchical" and rec["selected"] == ran, (rec["selected"], ran)
    finally:
        comm.Free()
