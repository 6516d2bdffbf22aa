"""Tuning: python -m mpicoll.tune writes a file, "auto" reads it, results stay right.

The tool runs at 2-3 ranks on a tiny sweep (no timing is asserted: the
machine is shared); the file's parsing, the refusal of a file of another MPI
library or layout, and the selection being honoured are checked on
hand-written files, and every algorithm a file can select is checked against
the exact result (mpicoll.tools.results).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import warnings

import numpy as np
import pytest
from mpi4py import MPI
from support import util

import mpicoll
from mpicoll.core import config as _config
from mpicoll.engine import context as _context
from mpicoll.engine import select as _select
from mpicoll.engine import tuning as _tuning
from mpicoll.tools import results as _results
from mpicoll.tools import tune as _tune
from mpicoll.tools.tune import choose as _choose
from mpicoll.tools.tune import cli as _tcli
from mpicoll.tools.tune import measure as _measure
from mpicoll.tools.tune import policy as _policy

WORLD = MPI.COMM_WORLD
ALGOS = {c: tuple(t) for c, t in _select.ALGORITHMS.items()}
OMPI = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
MPICH = "MPICH Version:      5.0.2\nMPICH Release date: Fri Sep 25 2026\n"


def _file(selection, ranks=None, nodes=(1, 1), ident=None, source="measured"):
    ident = ident or _tuning.mpi_identity()
    n = WORLD.Get_size()
    return {"format": _tuning.FORMAT, "version": _tuning.VERSION,
            "mpi": {"library": ident["library"], "version": ident["version"], "line": "x"},
            "entries": [{"source": source, "ranks": list(ranks or (n, n)), "nodes": list(nodes),
                         "measured": {"date": "2026-01-01", "host": "h", "ranks": n, "nodes": 1},
                         "selection": selection}]}


@pytest.fixture
def shared_dir():
    """A directory every rank sees (created by rank 0)."""
    path = tempfile.mkdtemp(prefix="mpicoll-tune-") if WORLD.rank == 0 else None
    path = WORLD.bcast(path, root=0)
    yield path
    WORLD.Barrier()
    if WORLD.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def tuning_env(monkeypatch, shared_dir):
    """use(data) -> path: write ``data`` as the tuning file (rank 0), point MPICOLL_TUNING at it."""
    def use(data):
        path = os.path.join(shared_dir, "tuning.json")
        WORLD.Barrier()  # every rank is done reading the previous file
        if WORLD.rank == 0:
            _tcli.write(path, data)  # atomic: a reader sees the old file or the new one
        WORLD.Barrier()
        monkeypatch.setenv("MPICOLL_TUNING", path)
        _select.reset()
        return path
    yield use
    monkeypatch.delenv("MPICOLL_TUNING", raising=False)
    _select.reset()


# --- parsing (no peer) -------------------------------------------------------------------

@pytest.mark.local
def test_mpi_identity_of_both_libraries():
    ompi, mpich = _tuning.mpi_identity(OMPI), _tuning.mpi_identity(MPICH)
    assert (ompi["library"], ompi["version"]) == ("Open MPI", "5.0.11")
    assert (mpich["library"], mpich["version"]) == ("MPICH", "5.0.2")
    assert _tuning.slug(ompi) == "openmpi-5.0.11" and _tuning.slug(mpich) == "mpich-5.0.2"


@pytest.mark.local
def test_default_path_is_in_the_cache_dir(monkeypatch, tmp_path):
    util.env_options(monkeypatch).setenv("XDG_CACHE_HOME", str(tmp_path))
    path = _tuning.default_path(_tuning.mpi_identity(MPICH))
    assert path == str(tmp_path / "mpicoll" / "tuning-mpich-5.0.2.json")


@pytest.mark.local
def test_a_relative_cache_home_is_ignored():
    """XDG_CACHE_HOME counts only as an absolute path (the XDG rule): a relative one would
    name a folder under each job's working directory."""
    from mpicoll.core import config

    home = os.path.expanduser("~/.cache")
    try:
        assert config.read_environment({"XDG_CACHE_HOME": "relative/cache"})["cache_dir"] == home
        assert config.read_environment({"XDG_CACHE_HOME": "/abs"})["cache_dir"] == "/abs"
    finally:
        config.read_environment()  # (the process's own values back)


@pytest.mark.local
def test_selection_rows_parse_and_get_an_open_end():
    rows = _tuning.parse_selection({"allreduce": [[4096, "recursive_doubling"], [65536, "ring"]]},
                                   ALGOS, "sel")
    assert rows == {"allreduce": ((4096, "recursive_doubling"), (65536, "ring"), (None, "ring"))}


@pytest.mark.local
@pytest.mark.parametrize("sel, match", [
    ({"allreduce": [[4096, "bruck"]]}, "not an algorithm of allreduce"),
    ({"alltoall": [[None, "ring"]]}, "unknown collective"),
    ({"allreduce": [[4096, "ring"], [1024, "ring"]]}, "above the previous"),
    ({"allreduce": [[None, "ring"], [4096, "ring"]]}, "only the last row"),
    ({"allreduce": []}, "non-empty list"),
    ({"allreduce": [["4K", "ring"]]}, "max_bytes must be an integer"),
])
def test_bad_selection_rows_are_refused(sel, match):
    with pytest.raises(ValueError, match=match):
        _tuning.parse_selection(sel, ALGOS, "sel")


@pytest.mark.local
def test_bad_files_are_refused(tmp_path):
    p = tmp_path / "t.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        _tuning.read(str(p), ALGOS)
    p.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not an mpicoll tuning file"):
        _tuning.read(str(p), ALGOS)
    data = _file({"allreduce": [[None, "ring"]]})
    data["entries"][0]["ranks"] = [4, 2]
    p.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"entries\[0\].ranks"):
        _tuning.read(str(p), ALGOS)


@pytest.mark.local
def test_a_file_of_another_mpi_is_foreign(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(_file({"allreduce": [[None, "ring"]]}, ident=_tuning.mpi_identity(MPICH))))
    tf = _tuning.read(str(p), ALGOS)
    assert "measured with MPICH 5.0.2" in tf.foreign(_tuning.mpi_identity(OMPI))
    assert tf.foreign(_tuning.mpi_identity(MPICH)) is None


@pytest.mark.local
def test_entries_match_by_layout_measured_first():
    data = _file({"allreduce": [[None, "ring"]]}, ranks=(2, 64), nodes=(1, 8), source="model")
    data["entries"].append(_file({"allreduce": [[None, "rabenseifner"]]}, ranks=(4, 4))["entries"][0])
    tf = _tuning.TuningFile(data, "f", ALGOS)
    assert tf.entry(4, 1).selection["allreduce"][0][1] == "rabenseifner"  # measured wins
    assert tf.entry(8, 2).source == "model"
    assert tf.entry(8, 9) is None and tf.entry(1, 1) is None


@pytest.mark.local
def test_bad_mpicoll_tuning_raises_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("MPICOLL_TUNING", str(tmp_path / "missing.json"))
    _select.reset()
    try:
        with pytest.raises(ValueError, match="MPICOLL_TUNING: cannot read"):
            _select.selection(2, 1)
    finally:
        monkeypatch.delenv("MPICOLL_TUNING")
        _select.reset()


@pytest.mark.local
@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user (chown): root only")
@pytest.mark.parametrize("how", ["other owner", "others write", "group writes", "link",
                                 "folder others write", "folder other owner"])
def test_a_tuning_file_another_user_could_have_written_is_not_read(monkeypatch, tmp_path, how):
    # a file there shapes every schedule: the default one is skipped with the reason, a
    # named one refused; the same file, private, is read
    cache = tmp_path / "cache"
    folder = cache / "mpicoll"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(cache, 0o700)
    path = _tuning.default_path(_tuning.mpi_identity()).replace(
        os.path.join(_config.get("cache_dir"), "mpicoll"), str(folder))
    good = _file({"allreduce": [[None, "ring"]]})
    target = folder / "real.json" if how == "link" else path
    with open(target, "w") as f:
        json.dump(good, f)
    os.chmod(target, 0o644)
    if how == "link":
        os.symlink(target, path)
    elif how == "other owner":
        os.chown(path, 4321, 4321)
    elif how == "others write":
        os.chmod(path, 0o646)
    elif how == "group writes":
        os.chmod(path, 0o664)
    elif how == "folder others write":
        os.chmod(folder, 0o777)
    else:
        os.chown(folder, 4321, 4321)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.delenv("MPICOLL_TUNING", raising=False)
    try:
        _select.reset()
        tf, note = _tuning.find(ALGOS)
        assert tf is None and "default file not used" in note, note
        monkeypatch.setenv("MPICOLL_TUNING", path)
        _select.reset()
        with pytest.raises(ValueError, match="MPICOLL_TUNING"):
            _tuning.find(ALGOS)
        if how != "link":  # (the same file, this user's alone: read)
            os.chown(path, os.geteuid(), os.getegid())
            os.chown(folder, os.geteuid(), os.getegid())
            os.chmod(path, 0o644)
            os.chmod(folder, 0o700)
            assert _tuning.find(ALGOS)[0] is not None
    finally:
        monkeypatch.delenv("MPICOLL_TUNING", raising=False)
        _select.reset()


@pytest.mark.local
def test_off_and_no_file_give_the_builtin_table(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for value, note in (("off", "MPICOLL_TUNING=off"), ("", "no default file")):
        monkeypatch.setenv("MPICOLL_TUNING", value)
        _select.reset()
        sel = _select.selection(4, 1)
        assert sel.source.startswith("built-in") and note in sel.note
        assert sel.rows == _select.builtin_rows(4)
    _select.reset()


@pytest.mark.local
def test_size_ranges_from_winners():
    per = {"a": {1024: 1.0, 2048: 1.0, 4096: 3.0, 8192: 3.0},
           "b": {1024: 2.0, 2048: 1.04, 4096: 1.0, 8192: 1.0}}
    wins = _choose.winners(per)
    assert wins == [(1024, "a"), (2048, "a"), (4096, "b"), (8192, "b")]
    assert _choose.size_ranges("allreduce", wins, None, 2, 2, 8) == [[2048, "a"], [None, "b"]]
    # within 5 % of the fastest everywhere, with the fewest switches
    per["b"][2048] = 0.99
    per["a"][4096], per["a"][8192], per["b"][8192] = 0.5, 0.5, 1.0
    assert [a for _, a in _choose.winners(per)] == ["a", "a", "a", "a"]
    per = {"a": {1: 1.0, 2: 1.03, 3: 1.0, 4: 1.02, 5: 2.0},
           "b": {1: 1.02, 2: 1.0, 3: 1.03, 4: 1.0, 5: 1.0}}
    wins = _choose.winners(per)
    assert [a for _, a in wins] == ["b"] * 5  # b is near the fastest everywhere: no switch
    for s, a in wins:
        assert per[a][s] <= _policy.CLOSE * min(t[s] for t in per.values())


@pytest.mark.local
def test_the_5_percent_rule_holds_by_construction():
    A, B, C = "recursive_doubling", "direct", "ring"
    # synthetic: noise within 5 % between a and b, c fastest at the large sizes only with
    # a segment/window variant, and its options' variant slower than b's
    times = {"allreduce": {
        A: {1024: 1.00, 2048: 1.03, 4096: 1.00, 1 << 20: 9.0, 4 << 20: 40.0},
        B: {1024: 1.02, 2048: 1.00, 4096: 1.04, 1 << 20: 8.0, 4 << 20: 30.0},
        C: {1024: 3.00, 2048: 3.00, 4096: 3.00, 1 << 20: 8.5, 4 << 20: 32.0}}}
    seg = {"allreduce": {B: {1 << 20: {"262144:1": 7.9, "4194304:2": 9.0},
                               4 << 20: {"262144:1": 29.9, "4194304:2": 31.0}},
                         C: {1 << 20: {"262144:1": 6.0, "4194304:2": 8.4},
                               4 << 20: {"262144:1": 25.0, "4194304:2": 31.0}}}}
    eff, chosen, fastest = _choose.choose_segments(times, seg, "1048576:2")
    # b's 262144:1 is within PREFER_DEFAULT of its options' variant: the options stay
    assert chosen["allreduce"][B] == {1 << 20: "1048576:2", 4 << 20: "1048576:2"}
    assert chosen["allreduce"][C] == {1 << 20: "262144:1", 4 << 20: "262144:1"}
    assert fastest["allreduce"][4 << 20] == 25.0
    wins = _choose.winners(eff["allreduce"], fastest["allreduce"])
    assert [a for _, a in wins] == [A, A, A, C, C]
    for s, a in wins:
        assert eff["allreduce"][a][s] <= _policy.CLOSE * fastest["allreduce"][s]
    rows = _choose.segment_rows(chosen["allreduce"][C], "1048576:2")
    assert rows == [[(1 << 20) - 1, None, None], [None, 262144, 1]]
    # what the file says is checked against the same numbers: all within 5 %
    sel = _choose.size_ranges("allreduce", wins, None, 2, 2, 8)
    us = {a: {str(s): t * 1e6 for s, t in per.items()} for a, per in times["allreduce"].items()}
    raw = {"selection": {"allreduce": sel}, "segments": {"allreduce": {C: rows}},
           "seg_default": "1048576:2", "times_us": {"allreduce": us},
           "segment_us": {"allreduce": {a: {str(s): {k: t * 1e6 for k, t in v.items()}
                                            for s, v in pts.items()}
                                        for a, pts in seg["allreduce"].items()}}}
    got = _choose.rule_rows(raw)
    assert [r["chosen"] for r in got] == [A, A, A, C + " 262144:1", C + " 262144:1"]
    assert all(_choose.rule_holds(r) for r in got)
    # a file whose selection breaks the rule is reported
    raw["selection"] = {"allreduce": [[None, A]]}
    bad = [r for r in _choose.rule_rows(raw) if not _choose.rule_holds(r)]
    assert [r["bytes"] for r in bad] == [1 << 20, 4 << 20]
    out = io.StringIO()
    assert _choose.write_rule(out, _choose.rule_rows(raw)) == 2
    assert "over 5 %" in out.getvalue() and "3 of 5 sizes" in out.getvalue()


@pytest.mark.local
def test_half_steps_only_around_crossovers_and_losers_stop():
    per = {"a": {1024: 1.0, 2048: 1.0, 4096: 2.0, 8192: 4.0},
           "b": {1024: 2.0, 2048: 2.0, 4096: 1.0, 8192: 1.0}}
    assert _measure.around_crossovers(per, [1024, 2048, 4096, 8192], [1536, 3072, 6144]) == [3072]
    big = {"a": {1 << 18: 1.0, 1 << 19: 2.0}, "b": {1 << 18: 1.6, 1 << 19: 3.1},
           "c": {1 << 18: 1.4, 1 << 19: 2.5}}
    assert _measure.losing(big, "b", [1 << 18, 1 << 19])        # 1.6x and 1.55x: stops
    assert not _measure.losing(big, "c", [1 << 18, 1 << 19])    # 1.4x: measured on
    small = {a: {k >> 4: v for k, v in t.items()} for a, t in big.items()}
    assert not _measure.losing(small, "b", sorted(small["b"]))  # below SEG_MIN: never


@pytest.mark.local
def test_predict_from_a_one_rank_tuning_is_one_line(tmp_path, capsys):
    """A tuning made at 1 rank measured no exchange curve: ``--predict`` says so in one line
    on stderr and exits 1 (it ended in the cost model's ValueError traceback); ``--check``
    on it likewise."""
    data = _file({c: [[None, "ring"]] for c in _tuning.COLLECTIVES}, ranks=(1, 1))
    data["entries"][0].update(p2p={}, model=None, times_us={}, builtin_us={})
    path = tmp_path / "one-rank.json"
    path.write_text(json.dumps(data))
    for argv, words in ((["--predict", "8", "--file", str(path)], "exchange curve"),
                        (["--check", str(path)], "no measured entry with times")):
        out = io.StringIO()
        assert _tune.main(argv, out=out) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"mpicoll.tune: {path}: ") and err.count("\n") == 1, err
        assert words in err and out.getvalue() == ""


# --- with peers ----------------------------------------------------------------------------



@pytest.mark.ranks(2, 3)  # the tool at a power of two and not
@pytest.mark.timeout(120)
def test_tool_writes_a_file_auto_reads(shared_dir, monkeypatch):
    path = os.path.join(shared_dir, "t.json")
    out = io.StringIO()
    argv = ["--quick", "-b", "1K", "-e", "16K", "-f", "4", "-n", "2", "--p2p-max", "16K",
            "-q", "-o", path]
    assert _tune.main(argv, out=out) == 0
    WORLD.Barrier()
    tf = _tuning.read(path, ALGOS)
    assert tf.foreign(_tuning.mpi_identity()) is None
    n = WORLD.Get_size()
    entry = tf.entry(n, 1)
    assert entry is not None and entry.ranks == (n, n) and entry.source == "measured"
    assert set(entry.selection) == set(_tuning.COLLECTIVES)
    m = entry.raw["measured"]
    assert m["ranks"] == n and m["date"] and m["command"].startswith("python -m mpicoll.tune")
    assert entry.raw["p2p"]["intra"]["bytes"][0] == 8
    if WORLD.rank == 0:
        assert f"wrote {path}" in out.getvalue()
    # a second run at this layout replaces its entry and keeps the others
    WORLD.Barrier()  # every rank has read the file before rank 0 rewrites it
    if WORLD.rank == 0:
        data = json.load(open(path))
        other = dict(data["entries"][0], ranks=[64, 64])
        data["entries"].append(other)
        _tcli.write(path, data)
    WORLD.Barrier()
    assert _tune.main(argv + ["-C", "allreduce"], out=io.StringIO()) == 0
    WORLD.Barrier()
    tf = _tuning.read(path, ALGOS)
    assert sorted(e.ranks for e in tf.entries) == sorted([(n, n), (64, 64)])
    # auto reads it: the selection of this layout comes from the file
    monkeypatch.setenv("MPICOLL_TUNING", path)
    _select.reset()
    try:
        sel = _select.selection(n, 1)
        assert sel.source.startswith(f"tuning file {path}") and sel.note is None
    finally:
        monkeypatch.delenv("MPICOLL_TUNING")
        _select.reset()


@pytest.mark.ranks(2, 3)
@pytest.mark.timeout(60)
def test_tool_tunes_segments_at_large_sizes(shared_dir):
    path = os.path.join(shared_dir, "t.json")
    argv = ["--quick", "-b", "300K", "-e", "300K", "-n", "2", "--p2p-max", "16K", "-q",
            "-o", path, "-C", "allreduce"]  # one size, above SEG_MIN at any rank count
    assert _tune.main(argv, out=io.StringIO()) == 0
    WORLD.Barrier()
    raw = _tuning.read(path, ALGOS).entry(WORLD.Get_size(), 1).raw
    (size,) = next(iter(raw["times_us"]["allreduce"].values()))
    tried = next(iter(raw["segment_us"]["allreduce"].values()))[size]
    tried = {tuple(int(x) for x in k.split(":")) for k in tried}
    quick = _policy.SWEEPS["quick"]
    # every segment size at the options' window, then every window at the best segment size
    assert {(s, 2) for s in quick["segments"]} <= tried
    assert any({(s, w) for w in quick["windows"]} <= tried for s in quick["segments"])
    # what it chose keeps the 5 % rule on what it measured
    assert all(_choose.rule_holds(r) for r in _choose.rule_rows(raw))
    if WORLD.rank == 0:
        out = io.StringIO()
        assert _tune.main(["--check", path], out=out) == 0
        assert "1 of 1 sizes" in out.getvalue()


@pytest.mark.ranks(2, 3)
@pytest.mark.timeout(60)
def test_predict_prints_crossovers(shared_dir):
    path = os.path.join(shared_dir, "t.json")
    argv = ["--quick", "-b", "1K", "-e", "4K", "-f", "4", "-n", "2", "--p2p-max", "8K", "-q",
            "-o", path, "-C", "allreduce"]
    assert _tune.main(argv, out=io.StringIO()) == 0
    WORLD.Barrier()
    out = io.StringIO()
    # 16 ranks, not more: the prediction builds every algorithm's schedule for a few
    # ranks of that count at every size, on every rank, and its cost grows with the
    # count faster than linearly; what this test checks does not depend on it
    assert _tune.main(["--predict", "16", "--file", path], out=out) == 0
    if WORLD.rank == 0:
        text = out.getvalue()
        assert "16 ranks" in text and "allreduce crossovers:" in text
    # written as predicted entries: auto takes them where no measured entry fits
    n = WORLD.Get_size()
    more = n + 2
    WORLD.Barrier()
    assert _tune.main(["--predict", f"{n},{more}", "--ranks-per-node", str(more), "--file", path,
                       "-o", path], out=io.StringIO()) == 0
    WORLD.Barrier()
    tf = _tuning.read(path, ALGOS)
    assert tf.entry(n, 1).source == "measured"  # a measured layout is not predicted over
    entry = tf.entry(more, 1)
    assert entry is not None and entry.source == "model" and entry.ranks == (more, more)
    assert entry.raw["predicted"]["from"]["ranks"] == [n, n]
    assert set(entry.selection) == set(_tuning.COLLECTIVES)
    assert "predicted" in entry.describe() and "from the entry measured" in entry.describe()


def _used(comm, collective, x, **kw):
    """(result, algorithm mpicoll ran) of one auto call."""
    with mpicoll.traffic() as t:
        fn = getattr(mpicoll, collective)
        y = fn(x, comm=comm, **kw)
    return y, t.calls[-1].algorithm


@pytest.mark.ranks(2, 3)  # pof2 and not: the selection overrides the built-in's column
@pytest.mark.timeout(60)
def test_the_selection_is_honoured(tuning_env):
    tuning_env(_file({"allreduce": [[1024, "ring"], [None, "rabenseifner"]],
                      "allgather": [[None, "bruck"]]}))
    comm = WORLD.Dup()  # a new context: it makes its selection from the file
    try:
        x = np.arange(64, dtype=np.float64) + WORLD.rank
        assert _used(comm, "allreduce", x)[1] == "ring"          # 512 B
        assert _used(comm, "allreduce", np.tile(x, 8))[1] == "rabenseifner"  # 4 KiB
        assert _used(comm, "allgather", x)[1] == "bruck"
        # not in the file: the built-in table
        want = _select.choose("reduce_scatter", "auto", x.nbytes, comm.size)
        assert _used(comm, "reduce_scatter", x)[1] == want
        # non-commutative ops still go to an order-preserving algorithm
        name = _select.choose("allreduce", "auto", 8, comm.size, False,
                                 selection=_select.selection(comm.size, 1))
        assert name in _select.ORDER_PRESERVING
    finally:
        comm.Free()


@pytest.mark.local
def test_segment_rows_parse_and_select_by_size():
    rows = {"allreduce": {"ring": [[4096, None, None], [65536, 1024, 1]]}}
    seg = _tuning.parse_segments(rows, ALGOS, "s")
    assert seg == {("allreduce", "ring"): ((4096, None, None), (65536, 1024, 1),
                                           (None, None, None))}
    data = _file({"allreduce": [[None, "ring"]]})
    data["entries"][0]["segments"] = rows
    tf = _tuning.TuningFile(data, "t.json", ALGOS)
    sel = _select.Selection({}, "x", entry=tf.entries[0])
    assert sel.segment("allreduce", "ring", 4096) is None          # null, null: the options
    assert sel.segment("allreduce", "ring", 4097) == (1024, 1)
    assert sel.segment("allreduce", "ring", 1 << 20) is None       # above the tuned sizes
    assert sel.segment("allreduce", "direct", 8192) is None        # not tuned
    assert any("ring segments" in line for line in sel.describe())
    for bad, match in (({"allreduce": {"ring": [[8, 0, 1]]}}, "segment_bytes"),
                       ({"allreduce": {"ring": [[8, 64, 65]]}}, "window"),
                       ({"allreduce": {"nope": [[8, 64, 1]]}}, "not an algorithm"),
                       ({"allreduce": {"ring": [[8, 64]]}}, "expected \\[max_bytes")):
        with pytest.raises(ValueError, match=match):
            _tuning.parse_segments(bad, ALGOS, "s")


@pytest.mark.ranks(2, 3)
@pytest.mark.timeout(60)
def test_a_segment_entry_changes_the_schedule(tuning_env, monkeypatch):
    monkeypatch.delenv("MPICOLL_SEGMENT_BYTES", raising=False)
    monkeypatch.delenv("MPICOLL_WINDOW", raising=False)
    data = _file({"allreduce": [[None, "ring"]]})
    # 1 KiB segments, one in flight, for ring calls of 4 KiB .. 64 KiB chosen by auto
    data["entries"][0]["segments"] = {"allreduce": {"ring": [[4096, None, None],
                                                             [65536, 1024, 1]]}}
    tuning_env(data)
    comm = WORLD.Dup()
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    try:
        ctx = mpicoll.engine.context.context(comm)

        def run(count, **kw):
            x = ((np.arange(count, dtype=np.float64) * 3 + rank * 7) % 13) - 6
            ref = _results.reference_allreduce(WORLD, x, MPI.SUM)
            with mpicoll.traffic() as t:
                y = mpicoll.allreduce(x, comm=comm, **kw)
            assert _results.compare(y, ref, "SUM", n).ok
            shapes = [k[2] for k in ctx.schedules if k[0] == "allreduce" and k[2].total == count]
            return t.calls[-1].messages_sent, {(s.segment, s.window) for s in shapes}

        default = (ctx.segment_bytes // 8, ctx.window)
        sent_auto, shapes = run(4096)           # 32 KiB: in the tuned range
        assert shapes == {(1024 // 8, 1)}
        ctx.schedules.clear()
        sent_ring, shapes = run(4096, algorithm="ring")  # named: the options
        assert shapes == {default} and sent_auto > sent_ring
        ctx.schedules.clear()
        assert run(256)[1] == {default}         # 2 KiB: below it
        ctx.schedules.clear()
        assert run(16384)[1] == {default}       # 128 KiB: above it
    finally:
        comm.Free()


@pytest.mark.ranks(2, 3)
@pytest.mark.timeout(60)
def test_a_foreign_file_is_not_applied(tuning_env):
    other = {"library": "MPICH" if _tuning.mpi_identity()["library"] != "MPICH" else "Open MPI",
             "version": "0.0"}
    tuning_env(_file({"allreduce": [[None, "ring"]]}, ident=other))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sel = _select.selection(WORLD.Get_size(), 1)
    assert sel.source.startswith("built-in") and "measured with" in sel.note
    assert any("not applied" in str(w.message) for w in caught)
    comm = WORLD.Dup()
    try:
        x = np.arange(8, dtype=np.float64)
        want = _select.choose("allreduce", "auto", x.nbytes, comm.size)
        assert _used(comm, "allreduce", x)[1] == want
    finally:
        comm.Free()


@pytest.mark.ranks(2, 3)
@pytest.mark.timeout(60)
def test_an_entry_for_another_layout_is_not_applied(tuning_env):
    n = WORLD.Get_size()
    tuning_env(_file({"allreduce": [[None, "ring"]]}, ranks=(n + 1, n + 1)))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        sel = _select.selection(n, 1)
    assert sel.source.startswith("built-in") and f"no entry for {n} ranks" in sel.note


@pytest.mark.ranks(1, 2, 3, 4, 5)  # every selection at every rank count: uneven blocks, empty ones
@pytest.mark.timeout(120)
@pytest.mark.parametrize("collective", list(_tuning.COLLECTIVES))
def test_results_right_under_every_selection(tuning_env, collective):
    n, rank = WORLD.Get_size(), WORLD.Get_rank()
    bad = []
    for algorithm in ALGOS[collective]:
        tuning_env(_file({collective: [[None, algorithm]]}))
        comm = WORLD.Dup()
        try:
            for count in (0, 1, max(n - 1, 1), 7 * n + 3):
                for in_place in (False, True):
                    x = ((np.arange(count, dtype=np.float64) * 3 + rank * 7) % 13) - 6
                    if collective == "allreduce":
                        ref = _results.reference_allreduce(WORLD, x, MPI.SUM)
                        buf = x.copy()
                        y, used = _used(comm, "allreduce", buf, out=buf if in_place else None)
                        res = _results.compare(y, ref, "SUM", n)
                    elif collective == "reduce_scatter":
                        counts = [count // n + (r < count % n) for r in range(n)]
                        full = _results.reference_allreduce(WORLD, x, MPI.SUM)
                        lo = sum(counts[:rank])
                        ref = full[lo:lo + counts[rank]]
                        buf = x.copy()
                        y, used = _used(comm, "reduce_scatter", buf, out=buf if in_place else None)
                        res = _results.compare(y, ref, "SUM", n)
                    else:
                        mine = x[: count % 5 + rank]
                        counts = WORLD.allgather(len(mine))
                        displs = [sum(counts[:r]) for r in range(n)]
                        want = _results.reference_allgatherv(WORLD, mine, counts, displs,
                                                             np.zeros(sum(counts)))
                        if in_place:
                            buf = np.zeros(sum(counts))
                            buf[displs[rank]:displs[rank] + len(mine)] = mine
                            y, used = _used(comm, "allgather", buf, out=buf, counts=counts)
                        else:
                            y, used = _used(comm, "allgather", mine, counts=counts)
                        res = _results.compare(y, want, None, n)
                    if not res.ok or (n > 1 and used != algorithm):
                        bad.append(f"{algorithm} count {count} in_place {in_place}: "
                                   f"ran {used}, {res.worst or 'ok'}")
        finally:
            comm.Free()
    bad = [b for r in WORLD.allgather(bad) for b in r]
    assert not bad, "\n".join(bad[:10])


@pytest.mark.local
def test_a_model_of_one_rank_per_node_predicts():
    """A tuning of one rank per node (2 nodes x 1) measures no intra-node exchange: the
    model predicts from the inter-node curve (it refused, and the tool failed at its end,
    after the whole sweep).  No curve at all is a ValueError."""
    from mpicoll.tools import costmodel
    inter = {"bytes": [8, 1 << 20], "us": [20.0, 8400.0]}
    model = costmodel.Model({"inter": inter}, 1e-10)
    assert model.measured_inter
    two = model.predict("allreduce", "ring", 1 << 20, 2, 1)
    four = model.predict("allreduce", "ring", 1 << 20, 4, 1)
    assert 0 < two < four, (two, four)
    with pytest.raises(ValueError, match="exchange curve"):
        costmodel.Model({}, 1e-10)


@pytest.mark.local
def test_messages_to_other_nodes_in_one_step_share_the_link():
    """The direct schedule sends to every other rank in one step: at 4 nodes x 1 its
    messages share this rank's link, so on a pure-bandwidth link it takes the ring's time
    (the same bytes, 2(n-1)/n of the array), not a third of it as when the model took them
    as fully parallel."""
    from mpicoll.tools import costmodel
    sizes = [1 << k for k in range(3, 25)]
    inter = {"bytes": sizes, "us": [b / 125e6 * 1e6 for b in sizes]}  # 1 Gbit/s, no latency
    model = costmodel.Model({"inter": inter}, 0.0)
    ring = model.predict("allreduce", "ring", 1 << 20, 4, 1)
    direct = model.predict("allreduce", "direct", 1 << 20, 4, 1)
    assert 0.9 < direct / ring < 1.1, (direct, ring)


@pytest.mark.local
def test_the_ranks_of_a_node_share_its_link():
    """At 2 nodes x 2 the direct AllReduce sends, from each node in each of its two steps,
    its two ranks' halves to the other node: the node's link carries the whole array per
    step, twice its time alone (on a pure-bandwidth link), which the model gave each rank
    as if it had the link to itself (predicted 0.47-0.50x the measured on the emulated
    cluster, MPICH, 100 Mbit/s)."""
    from mpicoll.tools import costmodel
    sizes = [1 << k for k in range(3, 27)]
    rate = 12.5e6  # bytes/s: 100 Mbit/s, no latency
    inter = {"bytes": sizes, "us": [b / rate * 1e6 for b in sizes]}
    intra = {"bytes": sizes, "us": [0.0 for _ in sizes]}
    model = costmodel.Model({"inter": inter, "intra": intra}, 0.0)
    n = 1 << 22
    direct = model.predict("allreduce", "direct", n, 4, 2)
    assert direct == pytest.approx(2 * n / rate, rel=0.02), direct
    # one rank per node: each rank's link is its own
    assert model.predict("allreduce", "direct", n, 2, 1) == pytest.approx(n / rate, rel=0.02)


@pytest.mark.local
def test_the_model_prices_the_schedule_the_layout_runs():
    """The model's schedules carry the node labels of its layout, as a communicator's do:
    inside a node the pairwise schedules' pieces are LOCAL_PIECE_FACTOR segments, so a
    recursive doubling AllGather of 64 MiB at 2 ranks of one node is the 6 operations
    that run (2 messages each way), not 97 (32 pieces of 1 MiB each way); and at 2 nodes
    x 2 the hierarchical AllReduce is its two levels, each node sending 1.0 N to the
    other."""
    from support import schedsim as sim

    from mpicoll.tools import costmodel
    build = _select.builder("allgather", "recursive_doubling")
    item, total = 8, (64 << 20) // 8
    ran = build(sim.shape("allgather", 2, 0, counts=(total // 2,) * 2, nodes=(0, 0),
                          segment=(1 << 20) // item))
    sizes = [1 << k for k in range(3, 27)]
    curve = {"bytes": sizes, "us": [b / 12.5 for b in sizes]}
    model = costmodel.Model({"inter": curve, "intra": curve}, 0.0)
    assert model.parts("allgather", "recursive_doubling", 64 << 20, 2, 2, item)[1] \
        == len(ran.ops) == 6
    hier = _select.builder("allreduce", "hierarchical")
    link = costmodel._node_link(hier, "allreduce", 1 << 22, 4, 2, 0, 4)
    assert sum(link.values()) == 1 << 22, link


@pytest.mark.ranks(2, 3)
@pytest.mark.timeout(60)
def test_the_node_piece_comes_from_the_tuning_unless_set(tuning_env, monkeypatch):
    """A measured entry's node_piece_bytes is the piece a new communicator cuts messages to
    other nodes into; MPICOLL_NODE_PIECE_BYTES wins over it; results exact either way."""
    data = _file({"allreduce": [[None, "recursive_doubling"]]})
    data["entries"][0]["node_piece_bytes"] = 61440
    tuning_env(data)
    x = (np.arange(100_003) % 13 + WORLD.rank).astype(np.float64)
    ref = np.empty_like(x)
    WORLD.Allreduce(x, ref)
    for env, want in ((None, 61440), ("100000", 100000)):
        if env is not None:
            monkeypatch.setenv("MPICOLL_NODE_PIECE_BYTES", env)
        comm = WORLD.Dup()  # a new context reads the file and the option
        try:
            assert _context.context(comm).node_piece == want
            np.testing.assert_array_equal(mpicoll.allreduce(x, comm=comm), ref)
        finally:
            comm.Free()


@pytest.mark.local
def test_the_cluster_table_sets_the_model_beside_the_runs(tmp_path, capsys):
    """tests/cluster/across_nodes.py --model prints the cost model's prediction over each
    forced algorithm's measured time, by size, with the model of the tuning file's measured
    entry with the most nodes (not a predicted one, not the one-node one), and counts the
    cells within 20 %."""
    import importlib.util

    from mpicoll.tools import costmodel
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cluster", "across_nodes.py")
    spec = importlib.util.spec_from_file_location("across_nodes", path)
    across = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(across)

    sizes = [1 << k for k in range(3, 25)]

    def entry(nodes, rate, source="measured"):
        curve = {"bytes": sizes, "us": [20 + b / rate * 1e6 for b in sizes]}
        return {"source": source, "ranks": [2, 2], "nodes": [nodes, nodes],
                "measured": {"ranks": 2, "nodes": nodes}, "p2p": {"inter": curve},
                "model": {"reduce_s_per_byte": 1e-10, "call_s": 1e-5, "op_s": 2e-7}}
    used = entry(2, 12.5e6)  # 100 Mbit/s; the others ten times faster
    tuning = tmp_path / "tune.json"
    tuning.write_text(json.dumps({"entries": [entry(1, 125e6), used,
                                              entry(4, 125e6, source="model")]}))
    model = costmodel.Model.from_entry(used)
    recs = []
    for algo, slower in (("ring", 1.0), ("direct", 1.5), ("auto", 1.0)):
        ran = "ring" if algo == "auto" else algo
        t = model.predict("allreduce", ran, 1 << 20, 4, 1, 4)
        recs.append({"collective": "allreduce", "algorithm": algo, "selected": ran,
                     "nranks": 4, "dtype": "float32", "bytes": 1 << 20,
                     "time_us": t * slower * 1e6, "builtin_time_us": t * 1e6,
                     "wrong": 0, "builtin_wrong": 0})
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(recs))
    args = ["--nodes", "0,1,2,3", "--rate", "100mbit", "--model", str(tuning), str(bench)]
    assert across.main(args) == 0
    out = capsys.readouterr().out
    assert "measured at 2 ranks on 2 node(s)), predicting 4 ranks, 1 per node" in out, out
    assert "| ring | 1.00 |" in out and "| direct | 0.67 |" in out, out
    assert "within 20 %: 1 of 2 cells" in out, out
    with pytest.raises(SystemExit, match="node by node"):
        across.main(["--nodes", "0,1,0,1", "--model", str(tuning), str(bench)])


# --- ranks agree by construction ------------------------------------------------------

@pytest.mark.ranks(2, 3)  # (one rank agrees with itself)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("differs", ["file", "segment"])
def test_ranks_that_read_different_tuning_use_rank_0s(tuning_env, monkeypatch, differs):
    """Rank 0 reads a tuning file selecting the ring at 64 KiB, the others none (a
    node-local cache tuned on one node, a file replaced while the job starts); or rank 0
    runs with another MPICOLL_SEGMENT_BYTES.  Each rank chose from its own: the others
    returned a wrong sum (every element) and rank 0 raised MPI_ERR_IN_STATUS.  The
    set-up agrees: every rank runs rank 0's choice and the result is MPI's; a rank whose
    own differed says so once."""
    tuning_env(_file({"allreduce": [[1 << 20, "ring"], [None, "ring"]]}))
    if differs == "file":
        if WORLD.rank != 0:
            monkeypatch.setenv("MPICOLL_TUNING", "off")
    elif WORLD.rank == 0:
        monkeypatch.setenv("MPICOLL_SEGMENT_BYTES", "4K")
    _select.reset()
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        comm = WORLD.Dup()
        try:
            x = np.arange(8192, dtype=np.float64) * 3 + WORLD.rank  # 64 KiB
            want = np.empty_like(x)
            WORLD.Allreduce(x, want)
            y, algorithm = _used(comm, "allreduce", x, timeout=20)
            ctx = _context.context(comm)
            ok = np.array_equal(y, want) and algorithm == "ring"
            agreed = getattr(ctx, "agreement", None) is not None
            segment = ctx.segment_bytes
        finally:
            comm.Free()
    said = [str(w.message) for w in seen if "rank 0's" in str(w.message)]
    results = WORLD.allgather((ok, agreed, bool(said), segment))
    assert all(r[0] for r in results), results
    assert not results[0][1] and all(r[1] and r[2] for r in results[1:]), results
    assert len({r[3] for r in results}) == 1, results
