"""The GPU device check's tools, on the CPU: its table, trim_wheel.py, floor.py and judge.py.

The device run itself needs a GPU (tests/device/run_device_check.sh); what
decides whether that one short run is right the first time is checked here:
the check table parses, a malformed table or an unknown section stops the
run before anything is installed, a trimmed wheel stays installable, and
the rows the run writes are judged as documented.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

# no messages: the same at any rank count (the local group)
pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "tests" / "device"
SCRIPT = DEVICE / "run_device_check.sh"


def _run_script(tmp_path, **env):
    """The device check with no wheels: it parses the table, then stops at the wheels (exit 2)."""
    out = tmp_path / "out"
    full = {k: v for k, v in os.environ.items() if k not in ("SECTIONS", "MATCH", "CHECKS")}
    full.update(OUT=str(out), WHEELS=str(tmp_path / "no-wheels"), PYTHON=sys.executable, **env)
    proc = subprocess.run(["bash", str(SCRIPT)], env=full, capture_output=True, text=True, timeout=60)
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").exists() else ""
    return proc.returncode, summary


def test_the_check_table_parses(tmp_path):
    rc, summary = _run_script(tmp_path)
    assert rc == 2, summary
    assert "wheels missing" in summary, summary  # got past the table


def test_every_table_section_can_be_named(tmp_path):
    sections = [line.split("]")[0][1:] for line in (DEVICE / "checks.txt").read_text().splitlines()
                if line.startswith("[")]
    assert {"ceilings", "routea", "routeb", "shared", "torchcuda", "overlap"} <= set(sections)
    rc, summary = _run_script(tmp_path, SECTIONS=" ".join(sections))
    assert rc == 2 and "wheels missing" in summary, summary


def test_every_default_section_has_lines_and_names_files_that_exist():
    """A default section without lines reports "not configured" on the device, and a moved
    test file, script or module fails its line there: all are found here, before a device
    run is spent."""
    import re
    import shlex

    section, lines = None, {}
    for text in (DEVICE / "checks.txt").read_text().splitlines():
        if text.startswith("["):
            section = text.split("]")[0][1:]
            lines[section] = [] if " default " in text else None
        elif text.strip() and not text.startswith("#") and lines.get(section) is not None:
            lines[section].append(text)
    assert lines and all(lines[s] for s in lines if lines[s] is not None), \
        [s for s in lines if lines[s] == []]
    words = [shlex.split(line.split("|", 1)[1]) for group in lines.values() if group
             for line in group]
    missing = [word for line in words for word in line
               if re.fullmatch(r"(tests|examples|benchmarks)/[\w/.-]+\.(py|sh)", word)
               and not (ROOT / word).exists()]
    # a module run with -m (python -m mpicoll.bench) that moved or went
    import importlib.util
    missing += [f"-m {line[i + 1]}" for line in words for i, word in enumerate(line[:-1])
                if word == "-m" and line[i + 1].startswith("mpicoll")
                and importlib.util.find_spec(line[i + 1]) is None]
    assert not missing, missing


def _table():
    """{section: (budget, kind, [(env, ranks, seconds, label, command)])} of checks.txt."""
    import re

    sections, current = {}, None
    for text in (DEVICE / "checks.txt").read_text().splitlines():
        head = re.match(r"^\[(\w+)\]\s+(\d+)\s+(default|extra)\s", text)
        if head:
            current = sections[head.group(1)] = (int(head.group(2)), head.group(3), [])
            continue
        line = re.match(r"^(ompi|mpich|a|b)\s+(\d+)\s+(\d+)\s+([^|]*?)\s*\|\s*(.*)$", text)
        if line and current is not None:
            env, ranks, secs, label, command = line.groups()
            current[2].append((env, int(ranks), int(secs), label, command))
    return sections


def test_the_default_run_fits_its_budget_with_room():
    """Each default section's lines fit its budget, and the default sections with the
    preflight (about 75 s) fit the run's BUDGET_S with 30 s left for lines still to come;
    BUDGET_S fits the device tool's 7-minute call."""
    import re

    budget_s = int(re.search(r"BUDGET_S=\$\{BUDGET_S:-(\d+)\}", SCRIPT.read_text()).group(1))
    sections = _table()
    over = [f"[{name}] lines {sum(s for _, _, s, _, _ in lines)} s > {budget} s"
            for name, (budget, kind, lines) in sections.items()
            if kind == "default" and sum(s for _, _, s, _, _ in lines) > budget]
    assert not over, over
    default = sum(budget for budget, kind, _ in sections.values() if kind == "default")
    assert default + 75 + 30 <= budget_s <= 7 * 60 - 20, (default, budget_s)


def test_route_lines_force_the_path():
    """Route A and B lines that run mpicoll set MPICOLL_CUDA_AWARE (the wheels say no CUDA
    support, so mpicoll's own decision stages there); only the judges do not."""
    unforced = [label for _, _, lines in _table().values() for env, _, _, label, command in lines
                if env in ("a", "b") and "judge.py" not in command
                and not command.startswith(("MPICOLL_CUDA_AWARE=1 ", "MPICOLL_CUDA_AWARE=0 "))]
    assert not unforced, unforced


@pytest.mark.parametrize("table, says", [
    ("ompi 2 10 a line before its section | -c 1\n", "before any [section] line"),
    ("[x] 10 default a section\nompi two 5 ranks not a number | -c 1\n", "checks.txt:2: not '[section]"),
    ("[x] 10 default a section\nzzz 2 5 unknown environment | -c 1\n", "(ENV: ompi, mpich, a, b)"),
    ("[x] 10 default a section\nompi 2 5 no command\n", "checks.txt:2"),
    ("[x] ten default a budget that is not a number\n", "checks.txt:1"),
    ("[x] 10 default a section\n[x] 10 default the same name\n", "a second [x] section"),
])
def test_a_malformed_table_stops_the_run(tmp_path, table, says):
    path = tmp_path / "checks.txt"
    path.write_text(table)
    rc, summary = _run_script(tmp_path, CHECKS=str(path))
    assert rc == 2 and says in summary, summary


def test_an_unknown_section_stops_the_run(tmp_path):
    rc, summary = _run_script(tmp_path, SECTIONS="routea nosuch")
    assert rc == 2 and "SECTIONS names 'nosuch'" in summary, summary


# -- trim_wheel.py ------------------------------------------------------------------------

def _wheel(path, files):
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
        z.writestr("pkg-1.0.dist-info/RECORD", "\n".join(record) + "\npkg-1.0.dist-info/RECORD,,\n")


def _trim(*args):
    return subprocess.run([sys.executable, str(DEVICE / "trim_wheel.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_trim_wheel_keeps_the_patterns_and_rewrites_record(tmp_path):
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    files = {"pkg/__init__.py": b"x = 1\n", "pkg/lib/libfoo.so.0": b"\x7fELF0", "pkg/lib/libfoo.a": b"big",
             "pkg/lib/libfoo.so": b"\x7fELF0", "pkg/include/foo.h": b"int f();",
             "pkg-1.0.dist-info/METADATA": b"Name: pkg\nVersion: 1.0\n"}
    _wheel(whl, files)
    proc = _trim(whl, "pkg/*.py", "pkg/lib/lib*.so.0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        record = z.read("pkg-1.0.dist-info/RECORD").decode().split()
        kept = {n: z.read(n) for n in names}
    assert names == {"pkg/__init__.py", "pkg/lib/libfoo.so.0", "pkg-1.0.dist-info/METADATA",
                     "pkg-1.0.dist-info/RECORD"}
    for line in record:
        name, digest, size = line.split(",")
        if name.endswith("RECORD"):
            continue
        data = kept[name]
        assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert int(size) == len(data)


def test_trim_wheel_refuses_a_pattern_that_matches_nothing(tmp_path):
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    _wheel(whl, {"pkg/__init__.py": b"", "pkg-1.0.dist-info/METADATA": b"Name: pkg\n"})
    before = whl.read_bytes()
    proc = _trim(whl, "pkg/*.py", "pkg/lib/renamed*.so.0")
    assert proc.returncode == 1 and "nothing matches pkg/lib/renamed*.so.0" in proc.stdout
    assert whl.read_bytes() == before
    assert list(tmp_path.iterdir()) == [whl]  # no temporary file left


# -- floor.py and judge.py ------------------------------------------------------------------

def _ceiling(what, procs, nbytes, gbps, total):
    return {"section": "ceiling", "what": what, "procs": procs, "bytes": nbytes, "gbps": gbps,
            "gbps_total": total}


def _bench(busbw, ratio, nranks, nbytes=64 << 20):
    return {"collective": "allreduce", "algorithm": "auto", "selected": "ring", "nranks": nranks,
            "dtype": "float32", "bytes": nbytes, "time_us": 1.0, "busbw_gbps": busbw, "wrong": 0,
            "builtin_time_us": 1.0, "builtin_busbw_gbps": 2.0, "ratio": ratio}


def _floor(results, records, *tags, section="routea"):
    bench = results.parent / "bench.json"
    bench.write_text(json.dumps(records))
    proc = subprocess.run([sys.executable, str(DEVICE / "floor.py"), str(results), str(bench),
                           "--section", section, *(f"--tag={t}" for t in tags)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _judge(results, *args):
    return subprocess.run([sys.executable, str(DEVICE / "judge.py"), str(results), *args],
                          capture_output=True, text=True, timeout=60)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_floor_rows_beside_both_ceilings(tmp_path):
    results = tmp_path / "results.jsonl"
    ceilings = [_ceiling("d2h_pinned", 4, 16 << 20, 13.0, 52.0), _ceiling("h2d_pinned", 4, 16 << 20, 12.0, 48.0),
                _ceiling("mpi_host_p2p", 4, 16 << 20, 10.0, 40.0),
                _ceiling("d2d", 2, 16 << 20, 300.0, 600.0), _ceiling("d2d", 4, 16 << 20, 180.0, 720.0),
                _ceiling("d2d", 4, 1 << 20, 20.0, 80.0)]
    results.write_text("".join(json.dumps(r) + "\n" for r in ceilings))
    _floor(results, [_bench(60.0, 0.5, 2), _bench(72.0, 0.5, 4)], "label=bench direct, 2 ranks")
    rows = [r for r in _rows(results) if r["section"] == "routea"]
    assert [r["d2d_gbps"] for r in rows] == [600.0, 720.0]  # as many processes as ranks, largest size
    assert [r["d2d_fraction"] for r in rows] == [0.1, 0.1]
    # AllReduce: 2(n-1)/n bus bytes over n inputs and n outputs copied once
    assert [r["d2d_bound"] for r in rows] == [0.5, 0.375]
    assert [r["d2d_of_bound"] for r in rows] == [0.2, 0.267]
    assert all(r["floor_gbps"] == 10.0 and r["label"] == "bench direct, 2 ranks" for r in rows)


def test_floor_keeps_a_records_own_fields(tmp_path):
    """The torch benchmark's records (no built-in bandwidth) become rows with their fields."""
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_ceiling("d2d", 2, 16 << 20, 300.0, 600.0)) + "\n")
    record = {"collective": "allreduce", "nranks": 2, "dtype": "float32", "bytes": 1 << 20,
              "time_us": 50.0, "busbw_gbps": 21.0, "gloo_time_us": 400.0, "gloo_ratio": 0.125}
    _floor(results, [record], "label=torch bench, CUDA, 2 ranks", section="torchcuda")
    row, = (r for r in _rows(results) if r["section"] == "torchcuda")
    assert row["gloo_ratio"] == 0.125 and row["d2d_fraction"] == 0.035
    assert "builtin_fraction" not in row
    ok = _judge(results, "torchcuda", "value", "torch bench", "gloo_ratio", "--at-most", "0.25",
                "--min-bytes", "1M")
    assert ok.returncode == 0, ok.stdout


def test_judge_pair_meets_and_misses(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text("")
    _floor(results, [_bench(50.0, 0.1, 2)], "label=bench direct, 2 ranks")
    _floor(results, [_bench(4.0, 0.9, 2)], "label=bench staged, 2 ranks")
    _floor(results, [_bench(30.0, 0.1, 4)], "label=bench direct, 4 ranks")
    _floor(results, [_bench(2.5, 0.9, 4)], "label=bench staged, 4 ranks")
    ok = _judge(results, "routea", "pair", "bench direct", "bench staged", "--at-least", "10")
    assert ok.returncode == 0, ok.stdout
    assert ok.stdout.count("meets >= 10") == 2  # 2 and 4 ranks paired separately: 12.5x, 12x
    miss = _judge(results, "routea", "pair", "bench direct", "bench staged", "--at-least", "12.2")
    assert miss.returncode == 1 and "MISSES >= 12.2" in miss.stdout
    verdicts = [r for r in _rows(results) if "judge" in r]
    assert [v["ok"] for v in verdicts] == [True, False]


def test_judge_value_within_sizes(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_ceiling("d2d", 2, 16 << 20, 300.0, 600.0)) + "\n")
    _floor(results, [_bench(30.0, 1.8, 2, 1 << 20), _bench(330.0, 0.2, 2, 64 << 20)],
           "label=shared bench", section="shared")
    big = _judge(results, "shared", "value", "shared bench", "d2d_of_bound", "--at-least", "0.5",
                 "--min-bytes", "64M")
    # 0.55 of the copy ceiling at 64 MiB, 1.1 of the one-kernel bound (0.5 at 2 ranks);
    # the 1 MiB row is outside the range
    assert big.returncode == 0, big.stdout
    small = _judge(results, "shared", "value", "shared bench", "ratio", "--at-most", "1.0",
                   "--max-bytes", "1M")
    assert small.returncode == 1 and "1.8 MISSES <= 1" in small.stdout


def test_judge_value_one_of_names(tmp_path):
    """A text field held to a set of names: the algorithm the torch benchmark's call ran."""
    results = tmp_path / "results.jsonl"
    results.write_text("")
    records = [{"collective": "allreduce", "nranks": 2, "dtype": "float32", "bytes": n,
                "time_us": 50.0, "selected": name}
               for n, name in ((1 << 20, "shared_twoshot"), (16 << 20, "ring"))]
    _floor(results, records, "label=torch bench, CUDA, 2 ranks", section="torchcuda")
    names = "shared_oneshot,shared_twoshot"
    ok = _judge(results, "torchcuda", "value", "torch bench", "selected", "--one-of", names,
                "--max-bytes", "1M")
    assert ok.returncode == 0 and "shared_twoshot meets in" in ok.stdout, ok.stdout
    miss = _judge(results, "torchcuda", "value", "torch bench", "selected", "--one-of", names)
    assert miss.returncode == 1 and "ring MISSES in" in miss.stdout, miss.stdout


def test_judge_without_rows_fails(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text("")
    proc = _judge(results, "routea", "pair", "bench direct", "bench staged", "--at-least", "10")
    assert proc.returncode == 1 and "no rows" in proc.stdout
