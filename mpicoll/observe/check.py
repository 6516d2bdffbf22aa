"""Mismatch detection: ranks agree on a fingerprint of each call before any data moves.

With ``MPICOLL_CHECK=1`` (or ``configure(check=True)`` / ``options(check=True)``)
every collective first exchanges a fixed-size fingerprint of the call:

==============  ==============================================================
field           content
==============  ==============================================================
collective      "allreduce", "reduce_scatter", "allgather", ...
call number     the call's sequence number on the communicator (1, 2, ...)
dtype           element type ("float64", "MPI.BYTE", "MPI.DOUBLE_INT", ...)
op              "MPI.SUM", ..., "a user-defined MPI.Op", "no op" (allgather)
counts          per-rank element counts (ReduceScatter, AllGather); must agree
count           elements reduced (AllReduce), or the sum of ``counts``
algorithm       the algorithm the rank chose ("ring", "recursive_doubling")
==============  ==============================================================

Every call encodes to :data:`WORDS` int64 words whatever its arguments, so
ranks calling different collectives still exchange matching messages.  The
exchange is a recursive-doubling AllReduce of ``[f, -f]`` with MIN on the
library's private communicator under its own tag (:data:`TAG`): ceil(log2 n)
message rounds, after which every rank holds the minimum and maximum of every
field.  They differ only when some ranks disagree; then (on every rank alike)
the ranks all-gather their fingerprints and every rank raises the same
:class:`~mpicoll.MismatchError`, naming the first field that differs and which
ranks passed what.  No data has moved and no buffer was touched; the
communicator stays usable.

User-defined ops are compared only as "user-defined": two different user ops
on different ranks are not detected.
"""

from __future__ import annotations

import hashlib

import numpy as np
from mpi4py import MPI

from ..algorithms import recursive as _recursive
from ..algorithms import ring as _ring
from ..algorithms.schedule import Shape
from ..backends.host import NUMPY
from ..core import types as _types
from ..core.errors import MismatchError
from ..transport import channel as _channel
from ..transport.channel import Channel

TAG = _channel.CHUNKS  # above every blocking call's chunks (transport.channel)
TEXT = 32           # bytes per text field
_TW = TEXT // 8     # int64 words per text field
DETAIL_COUNTS = 64  # entries of ``counts`` shown when they differ

# (field, kind, words); kinds: text, int, hash.  Order = order of comparison.
FIELDS = (
    ("collective", "text", _TW),
    ("call number", "int", 1),
    ("dtype", "text", _TW),
    ("op", "text", _TW),
    ("counts", "hash", 1),
    ("count", "int", 1),
    ("algorithm", "text", _TW),
)
WORDS = sum(w for _, _, w in FIELDS)
_VERBS = {"collective": "called", "call number": "reached", "algorithm": "chose"}


class _CheckChannel(Channel):
    """Host channel on the check tag: fingerprints never match payload messages."""

    __slots__ = ()

    def isend(self, arr, dest, chunk=0):
        return self.comm.Isend([arr, self.mpitype], dest, TAG)

    def irecv(self, arr, source, chunk=0):
        return self.comm.Irecv([arr, self.mpitype], source, TAG)


def dtype_label(msg) -> str:
    """The element type as ranks compare it: the dtype, or the MPI name where it says more."""
    if msg.category in ("byte", "pair"):
        return msg.typename
    return str(msg.dtype)


def op_label(op) -> str:
    if op is None:
        return "no op"
    name = _types.op_name(op)
    return f"MPI.{name}" if name else "a user-defined MPI.Op"


def _text(s: str) -> np.ndarray:
    raw = s.encode("ascii", "replace")[:TEXT].ljust(TEXT, b"\0")
    return np.frombuffer(raw, dtype=np.int64)


def _untext(words) -> str:
    return np.asarray(words, dtype=np.int64).tobytes().rstrip(b"\0").decode("ascii", "replace")


def _counts_hash(counts) -> int:
    if counts is None:
        return 0
    digest = hashlib.blake2b(np.asarray(counts, dtype=np.int64).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2  # 62 bits: -h stays representable


_STATIC: dict = {}  # (collective, dtype, op, algorithm) -> fingerprint with the rest zero


def _slots() -> dict:
    """Field -> index of its first word."""
    out, at = {}, 0
    for f, _, w in FIELDS:
        out[f] = at
        at += w
    return out


_SLOTS = _slots()


_SEQ, _HASH, _COUNT = _SLOTS["call number"], _SLOTS["counts"], _SLOTS["count"]


def fingerprint(call) -> np.ndarray:
    """The :data:`WORDS` int64 words describing ``call`` (an _observe.Call)."""
    msg, op = call.msg, call.op
    key = (call.label, msg.dtype, msg.category, msg.typename, None if op is None else op.handle,
           call.algorithm)
    base = _STATIC.get(key)
    if base is None:
        texts = (call.label, dtype_label(msg), op_label(op), call.algorithm)
        base = np.zeros(WORDS, dtype=np.int64)
        for f, value in zip(("collective", "dtype", "op", "algorithm"), texts):
            base[_SLOTS[f]: _SLOTS[f] + _TW] = _text(value)
        if len(_STATIC) < 1024 and (op is None or _types.op_name(op) is not None):
            _STATIC[key] = base  # (a user op's handle may be reused after it is freed)
    f = base.copy()
    f[_SEQ] = call.seq
    f[_HASH] = _counts_hash(call.counts)
    f[_COUNT] = call.total
    return f


def _decode(words) -> dict:
    out, i = {}, 0
    for f, kind, w in FIELDS:
        out[f] = _untext(words[i:i + w]) if kind == "text" else int(words[i])
        i += w
    return out


def agree(call, ch, run) -> None:
    """Raise MismatchError on every rank unless all ranks' fingerprints are equal.

    ``ch`` is the transport for fingerprints (a _CheckChannel, possibly wrapped
    for timeouts); ``run(schedule, ctx, ch, be, red, src, dst)`` runs a
    schedule to the end (the engine's executor.run_on: observe does not
    import the engine, which imports observe).  Collective over
    ``call.ctx``; sends nothing else.
    """
    ctx = call.ctx
    f = fingerprint(call)
    both = np.concatenate([f, -f])
    out = np.empty_like(both)
    red = NUMPY.reducer(MPI.MIN, MPI.INT64_T, "integer")
    run(_recursive.allreduce_schedule(_shape(ctx, len(both), (len(both),), (0,))),
        ctx, ch, NUMPY, red, both, out)
    if np.count_nonzero(out[:WORDS] + out[WORDS:]) == 0:  # min == max in every field
        return
    # Every rank got the same minima and maxima, so all take this path together.
    n = ctx.size
    d = min(n, DETAIL_COUNTS)
    mine = np.full(WORDS + d, -1, dtype=np.int64)
    mine[:WORDS] = f
    if call.counts is not None:
        mine[WORDS:] = call.counts[:d]
    table = np.empty((n, WORDS + d), dtype=np.int64)
    width = WORDS + d
    sched = _ring.allgather_schedule(_shape(ctx, width * n, (width,) * n,
                                            tuple(width * r for r in range(n))))
    run(sched, ctx, ch, NUMPY, None, mine, table.reshape(-1))
    err = mismatch_error(table[:, :WORDS], table[:, WORDS:])
    if err.field == "call number":
        ctx.seq = max(err.values.values())  # resynchronise, so later calls can agree
    raise err


def _shape(ctx, total, counts, displs) -> Shape:
    """The Shape of a fingerprint exchange on ``ctx`` (out of place, one segment)."""
    return Shape(ctx.size, ctx.rank, tuple(ctx.ring), ctx.ring_pos, total, counts, displs,
                 max(total, 1), 2, False)


def mismatch_error(fps, details) -> MismatchError:
    """The error for a table of every rank's fingerprint (same on every rank)."""
    rows = [_decode(w) for w in fps]
    field = next(f for f, _, _ in FIELDS if len({r[f] for r in rows}) > 1)
    kinds = list(dict.fromkeys(r["collective"] for r in rows))
    seqs = {r["call number"] for r in rows}
    prefix = "/".join(kinds) + (f" #{seqs.pop()}" if len(seqs) == 1 else "")
    if field == "counts":
        what, values = _counts_difference(rows, details)
    else:
        what, values = f"{field} differs", {r: rows[r][field] for r in range(len(rows))}
    shown = {r: _show(field, v) for r, v in values.items()}
    verb = _VERBS.get(field, "passed")
    groups = ", ".join(f"{_ranks(rs)} {verb} {v}" for v, rs in _groups(shown))
    return MismatchError(
        f"{prefix}: {what}: {groups}",
        collective=rows[0]["collective"], seq=rows[0]["call number"], field=field,
        values={r: rows[r][field] for r in range(len(rows))} if field != "counts" else values,
    )


def _counts_difference(rows, details):
    """(description, {rank: value}) for ranks whose ``counts`` differ."""
    n = len(rows)
    for i in range(details.shape[1]):
        col = {r: int(details[r, i]) for r in range(n)}
        if len(set(col.values())) > 1:
            return f"counts[{i}] differs", col
    totals = {r: rows[r]["count"] for r in range(n)}
    if len(set(totals.values())) > 1:
        return "sum(counts) differs", totals
    return f"counts differ past entry {details.shape[1] - 1}", {r: rows[r]["counts"] for r in range(n)}


def _show(field, value):
    if field == "call number":
        return f"#{value}"
    return str(value)


def _groups(shown):
    """[(value, ranks)] with the largest group first, ties by lowest rank."""
    by = {}
    for r, v in shown.items():
        by.setdefault(v, []).append(r)
    return sorted(by.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))


def _ranks(rs) -> str:
    """'rank 1' or 'ranks 0,2,3' (runs of three or more as 'a-b')."""
    parts, i = [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{rs[i]}-{rs[j]}")
        else:
            parts.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    return ("rank " if len(rs) == 1 else "ranks ") + ",".join(parts)


def channel(ctx):
    """The transport fingerprints travel on."""
    return _CheckChannel(ctx.comm, MPI.INT64_T)
