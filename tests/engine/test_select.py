"""Choosing the algorithm and its pipelining parameters: the table "auto" follows, the overrides.

``MPICOLL_SEGMENT_BYTES`` and ``MPICOLL_WINDOW`` are parsed (and refused) as
documented and read once, when a communicator's context is made; "auto" follows
``engine.select.THRESHOLDS`` (a power-of-two rank count or not), keeps a
non-commutative op on an order-preserving algorithm, and the ``algorithm``
option (``MPICOLL_ALGORITHM``) replaces "auto" only where it applies.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from mpi4py import MPI

from mpicoll.engine import context as _context
from mpicoll.engine import select as _select

WORLD = MPI.COMM_WORLD


# --- pipelining parameters ----------------------------------------------------

@pytest.mark.local
def test_tuning_from_environment():
    from mpicoll.core.config import parse_bytes, read_environment

    defaults = read_environment({})
    assert (defaults["segment_bytes"], defaults["window"]) == (1 << 20, 2)
    got = read_environment({"MPICOLL_SEGMENT_BYTES": "64K", "MPICOLL_WINDOW": "3"})
    assert (got["segment_bytes"], got["window"]) == (65536, 3)
    got = read_environment({"MPICOLL_SEGMENT_BYTES": " 2MiB ", "MPICOLL_WINDOW": ""})
    assert (got["segment_bytes"], got["window"]) == (2 << 20, 2)
    assert parse_bytes("4096", "x") == 4096 and parse_bytes("1g", "x") == 1 << 30
    for bad in ({"MPICOLL_SEGMENT_BYTES": "0"}, {"MPICOLL_SEGMENT_BYTES": "1.5M"},
                {"MPICOLL_SEGMENT_BYTES": "big"}):
        with pytest.raises(ValueError, match="MPICOLL_SEGMENT_BYTES"):
            read_environment(bad)
    for bad in ("0", "65", "two"):
        with pytest.raises(ValueError, match="MPICOLL_WINDOW"):
            read_environment({"MPICOLL_WINDOW": bad})
    read_environment()


@pytest.mark.local
def test_environment_parsed_again_only_after_a_change(monkeypatch):
    """A new communicator's read parses its variables only where their texts changed since
    the latest read (os.environ's or a mapping's); a bad value raises at every read."""
    from mpicoll.core import config

    parsed = []
    opt = config.TABLE["window"]
    monkeypatch.setattr(opt, "parse", lambda text, name: parsed.append(text) or int(text))
    monkeypatch.setenv("MPICOLL_WINDOW", "3")
    assert config.read_environment()["window"] == 3
    assert config.read_environment()["window"] == 3
    assert parsed == ["3"]
    monkeypatch.setenv("MPICOLL_WINDOW", "4")  # (a change applies to the next read)
    assert config.read_environment()["window"] == 4
    assert config.read_environment({"MPICOLL_WINDOW": "5"})["window"] == 5
    assert config.get("window") == 5
    assert parsed == ["3", "4", "5"]
    monkeypatch.undo()
    for _ in range(2):
        with pytest.raises(ValueError, match="MPICOLL_WINDOW"):
            config.read_environment({"MPICOLL_WINDOW": "two"})
    assert config.read_environment()["window"] == opt.default


@pytest.mark.timeout(60)
def test_context_reads_tuning_once(monkeypatch):
    monkeypatch.setenv("MPICOLL_SEGMENT_BYTES", "8K")
    monkeypatch.setenv("MPICOLL_WINDOW", "3")
    comm = WORLD.Dup()
    try:
        ctx = _context.context(comm)
        assert (ctx.segment_bytes, ctx.window) == (8192, 3)
        monkeypatch.setenv("MPICOLL_SEGMENT_BYTES", "1M")  # read at creation only
        x = np.arange(10000, dtype=np.float64) + comm.rank
        ref = np.empty_like(x)
        comm.Allreduce(x, ref)
        from mpicoll import allreduce
        np.testing.assert_array_equal(allreduce(x, comm=comm, algorithm="ring"), ref)
        assert _context.context(comm).segment_bytes == 8192
    finally:
        comm.Free()


# --- automatic selection ------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_later_change_on_one_rank_is_agreed(monkeypatch):
    """Communicators made one after another: a variable rank 0 changes in between applies to
    the next one on every rank (the others take rank 0's and say why), and setting it back
    applies to the one after."""
    windows, agreed = [], []
    for value in (None, "3", None):
        if value is not None and WORLD.rank == 0:
            monkeypatch.setenv("MPICOLL_WINDOW", value)
        else:
            monkeypatch.delenv("MPICOLL_WINDOW", raising=False)
        comm = WORLD.Dup()
        try:
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                ctx = _context.context(comm)
            windows.append(ctx.window)
            agreed.append(ctx.agreement is not None)
        finally:
            comm.Free()
    ok = windows == [2, 3, 2] and agreed == [False, WORLD.size > 1 and WORLD.rank > 0, False]
    got = WORLD.allgather((ok, windows, agreed))
    assert all(r[0] for r in got), got

@pytest.mark.local
def test_threshold_table_is_well_formed():
    for collective, rows in _select.THRESHOLDS.items():
        limits = [r[0] for r in rows]
        assert limits[-1] is None and all(a < b for a, b in zip(limits[:-2], limits[1:-1]))
        for _, pof2, other in rows:
            assert pof2 in _select.ALGORITHMS[collective] and other in _select.ALGORITHMS[collective]


@pytest.mark.local
def test_auto_follows_the_table():
    for collective, rows in _select.THRESHOLDS.items():
        lo = 0
        for limit, pof2, other in rows:
            for nbytes in {lo, (limit if limit is not None else lo + (1 << 30))}:
                assert _select.choose(collective, "auto", nbytes, 4) == pof2
                assert _select.choose(collective, "auto", nbytes, 6) == other
            lo = (limit or 0) + 1
    # non-commutative ops: always an order-preserving algorithm
    for collective in ("allreduce", "reduce_scatter"):
        for nbytes in (8, 1 << 30):
            name = _select.choose(collective, "auto", nbytes, 5, commutative=False)
            assert name in _select.ORDER_PRESERVING


@pytest.mark.local
def test_environment_override():
    """The ``algorithm`` option (MPICOLL_ALGORITHM) replaces "auto" where it applies."""
    assert _select.choose("allreduce", "auto", 8, 4, forced="ring") == "ring"
    assert _select.choose("allreduce", "auto", 8, 4, commutative=False,
                          forced="ring") == "recursive_doubling"
    assert _select.choose("allreduce", "rabenseifner", 8, 4, forced="ring") == "rabenseifner"
    # AllGather only: the others stay on auto
    assert _select.choose("allgather", "auto", 1 << 30, 4, forced="bruck") == "bruck"
    assert _select.choose("allreduce", "auto", 1 << 30, 4, forced="bruck") == "ring"
