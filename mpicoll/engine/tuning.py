"""Tuning files: the selection ``python -m mpicoll.tune`` measured, read by ``auto``.

Which file applies (:func:`find`, read once per process: ``MPICOLL_TUNING``,
else this MPI's default file in the user's cache directory, only where no other
user can have written it; the note says why none), to which MPI and layout it
applies (``TuningFile.entry``), and the file's format (``selection`` and ``segments`` rows in the order
of :data:`mpicoll.engine.select.THRESHOLDS`; an environment variable wins over
the file): docs/tuning.md, "The tuning file".
"""

from __future__ import annotations

import json
import os
import re

from ..core import config as _config
from ..core import paths as _paths

FORMAT = "mpicoll-tuning"
VERSION = 1
COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")


def option(name: str):
    """The value of option ``name`` (core.config's table: the latest environment read)."""
    return _config.get(name)


# --- the MPI library ------------------------------------------------------------------

def mpi_identity(line: str | None = None) -> dict:
    """{"library", "version", "line"} of an ``MPI.Get_library_version()`` text (default: this one)."""
    if line is None:
        from mpi4py import MPI
        line = MPI.Get_library_version()
    text = line.replace("\x00", "").strip()
    first = " ".join(text.splitlines()[0].split()) if text else "unknown"
    patterns = (
        ("Open MPI", r"Open MPI v?([0-9][\w.]*)"),
        ("MPICH", r"MPICH Version:\s*([0-9][\w.]*)"),
        ("Intel MPI", r"Intel\(R\) MPI Library ([0-9][\w.]*)"),
        ("MVAPICH", r"MVAPICH2? Version:?\s*([0-9][\w.]*)"),
    )
    for library, pattern in patterns:
        m = re.search(pattern, text)
        if m:
            return {"library": library, "version": m.group(1).rstrip(".,"), "line": first}
    return {"library": first.split(",")[0][:60] or "unknown", "version": "", "line": first}


def slug(ident: dict) -> str:
    """``"openmpi-5.0.11"``: the identity as a file-name part."""
    name = re.sub(r"[^a-z0-9]+", "", ident["library"].lower()) or "mpi"
    version = re.sub(r"[^A-Za-z0-9.]+", "_", ident.get("version") or "unknown")
    return f"{name}-{version}"


def default_path(ident: dict | None = None) -> str:
    """The default tuning file of this MPI library: ``<cache dir>/mpicoll/tuning-<slug>.json``."""
    ident = mpi_identity() if ident is None else ident
    return os.path.join(option("cache_dir"), "mpicoll", f"tuning-{slug(ident)}.json")


# --- parsing ---------------------------------------------------------------------------

def _range(value, what):
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value)
            or value[0] > value[1]):
        raise ValueError(f"{what}: expected [low, high] with 1 <= low <= high, got {value!r}")
    return int(value[0]), int(value[1])


def _by_collective(obj, what: str):
    """``obj``'s (collective, value) items; ValueError unless it is an object of collectives."""
    if not isinstance(obj, dict):
        raise ValueError(f"{what}: expected an object of collectives, got {type(obj).__name__}")
    for collective, value in obj.items():
        if collective not in COLLECTIVES:
            raise ValueError(f"{what}: unknown collective {collective!r}; expected one of "
                             f"{', '.join(COLLECTIVES)}")
        yield collective, value


def _limit(limit, last: int, final: bool, where: str) -> int:
    """A row's max_bytes checked (an integer above the previous row's ``last``, or null in
    the ``final`` row only); the new ``last``."""
    if limit is None:
        if not final:
            raise ValueError(f"{where}: only the last row may have no limit (null)")
        return last
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= last:
        raise ValueError(f"{where}: max_bytes must be an integer above the previous "
                         f"row's ({last}), got {limit!r}")
    return limit


def parse_selection(sel, algorithms: dict, what: str) -> dict:
    """{collective: ((max_bytes | None, name), ...)} checked against ``algorithms``
    ({collective: names}); ValueError naming ``what`` and the bad row."""
    out = {}
    for collective, rows in _by_collective(sel, what):
        if not isinstance(rows, list) or not rows:
            raise ValueError(f"{what}.{collective}: expected a non-empty list of "
                             f"[max_bytes, algorithm], got {rows!r}")
        table, last = [], -1
        for i, row in enumerate(rows):
            where = f"{what}.{collective}[{i}]"
            if not isinstance(row, list) or len(row) != 2:
                raise ValueError(f"{where}: expected [max_bytes, algorithm], got {row!r}")
            limit, name = row
            if name not in algorithms[collective]:
                raise ValueError(f"{where}: {name!r} is not an algorithm of {collective} "
                                 f"(expected one of {', '.join(algorithms[collective])})")
            last = _limit(limit, last, i == len(rows) - 1, where)
            table.append((limit, name))
        if table[-1][0] is not None:
            table.append((None, table[-1][1]))  # sizes above the last measured one
        out[collective] = tuple(table)
    return out


def parse_segments(seg, algorithms: dict, what: str) -> dict:
    """{(collective, algorithm): ((max_bytes | None, segment_bytes | None, window | None), ...)}
    checked against ``algorithms``; ValueError naming ``what`` and the bad row."""
    if seg is None:
        return {}
    out = {}
    for collective, per in _by_collective(seg, what):
        if not isinstance(per, dict):
            raise ValueError(f"{what}.{collective}: expected an object of algorithms, got {per!r}")
        for name, rows in per.items():
            where0 = f"{what}.{collective}.{name}"
            if name not in algorithms[collective]:
                raise ValueError(f"{where0}: {name!r} is not an algorithm of {collective}")
            if not isinstance(rows, list) or not rows:
                raise ValueError(f"{where0}: expected a non-empty list of "
                                 f"[max_bytes, segment_bytes, window], got {rows!r}")
            table, last = [], -1
            for i, row in enumerate(rows):
                where = f"{where0}[{i}]"
                if not isinstance(row, list) or len(row) != 3:
                    raise ValueError(f"{where}: expected [max_bytes, segment_bytes, window], "
                                     f"got {row!r}")
                limit, segment, window = row
                last = _limit(limit, last, i == len(rows) - 1, where)
                if segment is not None and (isinstance(segment, bool) or not isinstance(segment, int)
                                            or segment < 1):
                    raise ValueError(f"{where}: segment_bytes must be a positive integer or null, "
                                     f"got {segment!r}")
                if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                           or not 1 <= window <= 64):
                    raise ValueError(f"{where}: window must be an integer from 1 to 64 or null, "
                                     f"got {window!r}")
                table.append((limit, segment, window))
            if table[-1][0] is not None:
                table.append((None, None, None))  # above the last tuned size: the options
            out[(collective, name)] = tuple(table)
    return out


class Entry:
    """One entry of a tuning file: the layouts it applies to and its selection."""

    def __init__(self, raw: dict, index: int, algorithms: dict):
        what = f"entries[{index}]"
        if not isinstance(raw, dict):
            raise ValueError(f"{what}: expected an object, got {type(raw).__name__}")
        self.raw = raw
        self.source = raw.get("source", "measured")
        if self.source not in ("measured", "model"):
            raise ValueError(f"{what}.source: expected 'measured' or 'model', got {self.source!r}")
        self.ranks = _range(raw.get("ranks"), f"{what}.ranks")
        self.nodes = _range(raw.get("nodes"), f"{what}.nodes")
        self.selection = parse_selection(raw.get("selection"), algorithms, f"{what}.selection")
        self.segments = parse_segments(raw.get("segments"), algorithms, f"{what}.segments")
        self.measured = raw.get("measured") if isinstance(raw.get("measured"), dict) else {}

    def applies(self, nranks: int, nodes: int) -> bool:
        return self.ranks[0] <= nranks <= self.ranks[1] and self.nodes[0] <= nodes <= self.nodes[1]

    def describe(self) -> str:
        def rng(r):
            return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"
        m = self.measured
        how = (f"measured {m.get('date', '?')} on {m.get('host', '?')}, {m.get('ranks', '?')} ranks "
               f"on {m.get('nodes', '?')} node(s)")
        if self.source == "model":
            p = self.raw.get("predicted") if isinstance(self.raw.get("predicted"), dict) else {}
            how = (f"predicted {p.get('date', '?')} by the cost model, "
                   f"{p.get('ranks_per_node', '?')} ranks per node, from the entry " + how)
        return f"{rng(self.ranks)} ranks on {rng(self.nodes)} node(s), {how}"


class TuningFile:
    """A parsed tuning file (see the module docstring)."""

    def __init__(self, data, path: str, algorithms: dict):
        self.path = path
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"{path}: not an mpicoll tuning file (expected \"format\": "
                             f"\"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise ValueError(f"{path}: tuning file version {data.get('version')!r}; this mpicoll "
                             f"reads version {VERSION} (run python -m mpicoll.tune again)")
        mpi = data.get("mpi")
        if not isinstance(mpi, dict) or not isinstance(mpi.get("library"), str):
            raise ValueError(f"{path}: \"mpi\" must name the library and version it was measured with")
        self.mpi = {"library": mpi["library"], "version": str(mpi.get("version", "")),
                    "line": str(mpi.get("line", ""))}
        entries = data.get("entries")
        if not isinstance(entries, list):
            raise ValueError(f"{path}: \"entries\" must be a list")
        try:
            self.entries = [Entry(e, i, algorithms) for i, e in enumerate(entries)]
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        self.data = data

    def foreign(self, ident: dict) -> str | None:
        """Why this file does not apply to MPI ``ident``, or None if it does."""
        if (self.mpi["library"], self.mpi["version"]) != (ident["library"], ident["version"]):
            return (f"measured with {self.mpi['library']} {self.mpi['version']}, "
                    f"this process runs {ident['library']} {ident['version']}")
        return None

    def entry(self, nranks: int, nodes: int):
        """The entry for this layout: measured before predicted, then the narrowest; or None."""
        fits = [e for e in self.entries if e.applies(nranks, nodes)]
        if not fits:
            return None
        return min(fits, key=lambda e: (e.source != "measured", e.ranks[1] - e.ranks[0],
                                        e.nodes[1] - e.nodes[0]))


def read(path: str, algorithms: dict) -> TuningFile:
    """Parse the tuning file at ``path``; OSError if unreadable, ValueError if malformed."""
    text = _paths.read_trusted(path)  # (ValueError: another user could have written it)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    return TuningFile(data, path, algorithms)


def find(algorithms: dict, ident: dict | None = None):
    """(TuningFile or None, note): the file this process uses and, when none, why.

    ``MPICOLL_TUNING`` names a file that must exist and parse (ValueError
    otherwise: the user asked for it); the default file in the cache
    directory is skipped with a note when it is malformed.  A file for another
    MPI library is returned with the reason in the note (the caller does not
    apply it, and says so).
    """
    ident = mpi_identity() if ident is None else ident
    chosen = option("tuning")
    if chosen == "off":
        return None, "MPICOLL_TUNING=off"
    if chosen is not None:
        try:
            tf = read(chosen, algorithms)
        except OSError as exc:
            raise ValueError(f"MPICOLL_TUNING: cannot read {chosen!r} ({exc.strerror or exc})") from None
        except ValueError as exc:
            raise ValueError(f"MPICOLL_TUNING: {exc}") from None
        return tf, tf.foreign(ident)
    path = default_path(ident)
    if not os.path.exists(path):
        return None, f"MPICOLL_TUNING unset and no default file {path}"
    try:
        tf = read(path, algorithms)
    except (OSError, ValueError) as exc:
        return None, f"default file not used: {exc}"
    return tf, tf.foreign(ident)
