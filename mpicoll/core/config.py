"""Run-time options: one table (:data:`OPTIONS`) of every ``MPICOLL_*`` knob, read once per communicator.

:func:`read_environment` parses every variable of the table when mpicoll sets a
communicator's context up (a bad value raises ``ValueError`` naming it, before
any message); nothing reads the environment on a call after that.
``mpicoll.configure``/``mpicoll.options`` set options from Python and bump
:data:`EPOCH`, which a remembered call compares.  The options page
(docs/options.md) is generated from the table and says when each is read.
"""

from __future__ import annotations

import contextlib
import os

_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bytes(text: str, name: str) -> int:
    """``"4096"``, ``"64K"``, ``"1M"``, ``"1G"`` -> bytes; ValueError naming ``name``."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = raw[-1:] if raw[-1:] in _SUFFIX else ""
    try:
        value = int(raw[: len(raw) - len(unit)]) * _SUFFIX[unit]
    except ValueError:
        raise ValueError(f"{name}: expected a size in bytes such as 65536, 64K or 1M, "
                         f"got {text!r}") from None
    if value <= 0:
        raise ValueError(f"{name}: expected a positive size, got {text!r}")
    return value


def parse_flag(text: str, name: str) -> bool:
    """1/yes/true/on or 0/no/false/off (any case); ValueError naming ``name``."""
    value = text.strip().lower()
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off"):
        return False
    raise ValueError(f"{name}: expected 1/0, yes/no, true/false or on/off, got {text!r}")


def parse_seconds(text: str, name: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"{name}: expected a number of seconds, got {text!r}") from None
    if not seconds > 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {text!r}")
    return seconds


def parse_on_error(text: str, name: str) -> str:
    """"abort" or "raise" (any case); ValueError naming ``name``."""
    value = text.strip().lower()
    if value not in ("abort", "raise"):
        raise ValueError(f"{name}: expected abort or raise, got {text!r}")
    return value


def parse_window(text: str, name: str) -> int:
    try:
        window = int(text)
    except ValueError:
        raise ValueError(f"{name}: expected a positive integer, got {text!r}") from None
    if not 1 <= window <= 64:
        raise ValueError(f"{name}: expected an integer from 1 to 64, got {text!r}")
    return window


def parse_text(text: str, name: str) -> str:
    return text.strip()


INTRANODE_MODES = ("auto", "mpi", "shared")


def parse_intranode(text: str, name: str) -> str:
    """auto, mpi or shared (any case); ValueError naming ``name``."""
    value = text.strip().lower()
    if value not in INTRANODE_MODES:
        raise ValueError(f"{name}: expected auto, mpi or shared, got {text!r}")
    return value


def parse_path_or_off(text: str, name: str) -> str:
    """A path (``~`` expanded), or "off" for off/none/0."""
    text = text.strip()
    if text.lower() in ("off", "none", "0"):
        return "off"
    return os.path.expanduser(text)


def parse_cache_dir(text: str, name: str) -> str:
    """An absolute path (``~`` expanded), or "off"; a relative path is ignored, as the XDG
    rule says (the default applies: it would name a folder under each job's working
    directory)."""
    value = parse_path_or_off(text, name)
    if value != "off" and not os.path.isabs(value):
        return os.path.expanduser("~/.cache")
    return value


class Option:
    """One row of :data:`OPTIONS`: name, variable, parser, default, whether configure() sets it."""

    __slots__ = ("name", "env", "parse", "default", "api", "doc")

    def __init__(self, name, env, parse, default, api, doc):
        self.name, self.env, self.parse, self.default, self.api, self.doc = \
            name, env, parse, default, api, doc


OPTIONS = (
    Option("check", "MPICOLL_CHECK", parse_flag, False, True,
           "ranks agree on a fingerprint of every call before any payload message"),
    Option("timeout", "MPICOLL_TIMEOUT", parse_seconds, None, True,
           "seconds a collective may go without progress before CollectiveTimeout"),
    Option("cuda_aware", "MPICOLL_CUDA_AWARE", parse_flag, None, True,
           "force (1) or forbid (0) handing device pointers to MPI; unset: detect"),
    Option("progress", "MPICOLL_PROGRESS", parse_flag, False, True,
           "a background thread advances non-blocking and persistent collectives"),
    Option("algorithm", "MPICOLL_ALGORITHM", parse_text, None, False,
           "the algorithm every 'auto' call runs where it exists and applies to the op"),
    Option("segment_bytes", "MPICOLL_SEGMENT_BYTES", parse_bytes, 1 << 20, False,
           "segment size: schedules cut blocks into segments, each passed on as soon as it is "
           "ready (pipelining), and messages to other nodes into pieces of a segment; unset, "
           "device arrays handed straight to a CUDA-aware MPI take a segment of their own "
           "(docs/gpu.md, \"Direct path (CUDA-aware MPI)\")"),
    Option("window", "MPICOLL_WINDOW", parse_window, 2, False,
           "segments (or pieces) a schedule keeps posted ahead of the one it consumes, per peer"),
    Option("node_piece_bytes", "MPICOLL_NODE_PIECE_BYTES", parse_bytes, 1 << 20, False,
           "messages to a rank of another node move in pieces of at most this size; the "
           "communicator takes its ranks' least (transport.channel; Open MPI over TCP: 60K, "
           "under its eager limit: docs/tuning.md, \"What the tool does\")"),
    Option("fake_nodes", "MPICOLL_FAKE_NODES", parse_text, None, False,
           "node layout for tests: block:K, cyclic:K or one label per COMM_WORLD rank"),
    Option("trace", "MPICOLL_TRACE", parse_text, None, False,
           "trace the whole run and save it to this JSON file at exit"),
    Option("tuning", "MPICOLL_TUNING", parse_path_or_off, None, False,
           "a tuning file (python -m mpicoll.tune) 'auto' selects from; off: the built-in table"),
    Option("cache_dir", "XDG_CACHE_HOME", parse_cache_dir, os.path.expanduser("~/.cache"),
           False, "the user's cache directory (absolute; a relative one is ignored): its "
           "mpicoll folder holds the default tuning file"),
    Option("deterministic", "MPICOLL_DETERMINISTIC", parse_flag, False, True,
           "floating reductions are the rank-order fold ((x0 + x1) + x2) + ..., bitwise the "
           "same for every algorithm, size, segment and window (docs/numerics.md)"),
    Option("torch_on_error", "MPICOLL_TORCH_ON_ERROR", parse_on_error, "abort", False,
           "torch backend: a collective that fails on a rank (bad input, a timeout) ends the "
           "job with MPI_Abort and a message naming the rank and error; raise: raise it there "
           "(docs/torch.md)"),
    Option("intranode", "MPICOLL_INTRANODE", parse_intranode, "auto", True,
           "ranks of one node: auto (node memory where measured faster), mpi (messages "
           "only) or shared (node memory at every size; across nodes inside each node); "
           "read when a communicator is first used, the same on every rank "
           "(transport.shared)"),
)
TABLE = {opt.name: opt for opt in OPTIONS}
_API = tuple(opt.name for opt in OPTIONS if opt.api)

_settings: dict = {}  # API settings: option -> value
# Bumped by every change of an API setting (and by observers switching on or off,
# see bump): a cached call compares it instead of re-reading anything.
EPOCH = [0]
_process: dict = {}  # the latest read of the environment (process-wide options)
_raw: dict = {}  # the text of each variable set at the latest read (for messages)
_errors: dict = {}  # option -> the ValueError its variable gave at the latest read


def bump() -> None:
    """Something that changes how calls run was switched on or off: cached calls miss."""
    EPOCH[0] += 1


def _texts(environ) -> tuple:
    """The text of every option's variable in ``environ`` (None where unset), and ``HOME``
    (the paths' ``~``).  os.environ's own table is read where it has one (CPython's):
    its ``get`` raises and catches a KeyError for every unset name, most of a read's cost."""
    data = getattr(environ, "_data", None) if environ is os.environ else None
    if type(data) is not dict:
        return tuple(map(environ.get, _NAMES))
    decode = environ.decodevalue
    return tuple(None if v is None else decode(v) for v in map(data.get, _KEYS))


_NAMES = tuple(opt.env for opt in OPTIONS) + ("HOME",)
_KEYS = tuple(map(os.environ.encodekey, _NAMES))
_PARSED: list = []  # (texts, values, texts set, errors) of the latest parse


def read_environment(environ=None) -> dict:
    """Every option's value from the environment (its default where unset); the one read.

    ValueError naming the variable for a bad value.  Also becomes the process-wide
    values (:func:`get`).  The variables' texts are read every time; they are parsed
    again only where they differ from the latest read's.
    """
    environ = os.environ if environ is None else environ
    raws = _texts(environ)
    if _PARSED and _PARSED[0] == raws:
        values, texts, errors = _PARSED[1:]
    else:
        values, texts, errors = {}, {}, {}
        for opt, raw in zip(OPTIONS, raws):
            values[opt.name] = opt.default
            if raw is not None and raw.strip() != "":
                texts[opt.name] = raw.strip()
                try:
                    values[opt.name] = opt.parse(raw, opt.env)
                except ValueError as exc:
                    errors[opt.name] = exc
        _PARSED[:] = [raws, values, texts, errors]
        _raw.clear()
        _raw.update(texts)
        _errors.clear()
        _errors.update(errors)
        if values != _process:
            _process.clear()
            _process.update(values)
            bump()
    if errors:  # (the same error object each read: its traceback starts afresh)
        raise next(iter(errors.values())).with_traceback(None)
    return dict(values)


def resolve(env: dict) -> dict:
    """The options in force for a communicator whose environment read is ``env``."""
    if not _settings:
        return env
    merged = dict(env)
    merged.update(_settings)
    return merged


def check_value(name, value):
    """``value`` checked for option ``name`` (TypeError/ValueError naming it); None stays None."""
    if value is None:
        return None
    if name in ("check", "cuda_aware", "progress", "deterministic"):
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool or None, got {type(value).__name__}")
        return value
    if name == "intranode":
        if not isinstance(value, str):
            raise TypeError(f"{name}: expected a str or None, got {type(value).__name__}")
        if value not in INTRANODE_MODES:
            raise ValueError(f"{name}: expected auto, mpi or shared, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number of seconds or None, got {type(value).__name__}")
    if not value > 0:
        raise ValueError(f"{name}: expected a positive number of seconds, got {value}")
    return float(value)


def configure(**kwargs) -> dict:
    """Set options for this process; returns the previous settings (for restoring).

    Args:
        check: agree on a fingerprint of every call across ranks (bool).
        timeout: seconds a collective may go without progress (float).
        cuda_aware: force (True) or forbid (False) CUDA-aware MPI.
        progress: advance non-blocking collectives in a background thread (bool).
        deterministic: floating reductions are the rank-order fold (bool).
        intranode: "auto", "mpi" or "shared" (str): how ranks of one node exchange
            data; read when a communicator is first used (transport.shared).
        Each accepts None to fall back to its environment variable.
    """
    for name in kwargs:
        if name not in _API:
            raise TypeError(f"configure: unknown option {name!r}; expected one of {', '.join(_API)}")
    values = {name: check_value(name, value) for name, value in kwargs.items()}
    previous = {}
    for name, value in values.items():
        previous[name] = _settings.get(name)
        if value is None:
            _settings.pop(name, None)
        else:
            _settings[name] = value
    bump()
    return previous


@contextlib.contextmanager
def options(**kwargs):
    """``with mpicoll.options(check=True): ...`` sets options for the block."""
    previous = configure(**kwargs)
    try:
        yield
    finally:
        configure(**previous)


def configured(name: str) -> bool:
    """True if option ``name`` is set through configure()/options() (not the environment)."""
    return name in _settings


def get(name: str):
    """A process-wide option now: its API setting, else the latest environment read
    (ValueError naming the variable if it was bad then)."""
    value = _settings.get(name, _settings)
    if value is not _settings:
        return value
    if not _process:
        read_environment()
    error = _errors.get(name)
    if error is not None:
        raise error
    return _process[name]


def text(name: str) -> str:
    """The text option ``name``'s variable had at the latest read ("" if unset)."""
    return _raw.get(name, "")


def describe() -> list:
    """(variable, default, meaning) of every option, for ``python -m mpicoll.info``."""
    return [(opt.env, opt.default, opt.doc) for opt in OPTIONS]
