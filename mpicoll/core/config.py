"""Run-time options: an API setting wins over the environment variable.

=============  ======================  ==========================================
option         environment variable    meaning
=============  ======================  ==========================================
check          MPICOLL_CHECK           ranks agree on a call fingerprint first
timeout        MPICOLL_TIMEOUT         seconds without progress before raising
cuda_aware     MPICOLL_CUDA_AWARE      hand device pointers straight to MPI
progress       MPICOLL_PROGRESS        a thread advances non-blocking collectives
=============  ======================  ==========================================

``mpicoll.configure(check=True)`` sets options for the process (``None``
returns an option to its environment variable); ``with mpicoll.options(...)``
sets them for a block.  Options are read at every collective call, so both
take effect immediately.
"""

from __future__ import annotations

import contextlib
import os

_ENV = {
    "check": "MPICOLL_CHECK",
    "timeout": "MPICOLL_TIMEOUT",
    "cuda_aware": "MPICOLL_CUDA_AWARE",
    "progress": "MPICOLL_PROGRESS",
}
_FLAGS = ("check", "cuda_aware", "progress")
_UNSET = object()
_settings: dict = {}
_watchers: list = []  # called with the settings after every change (see watch)


def check_value(name, value):
    """``value`` checked for option ``name`` (TypeError/ValueError naming it); None stays None."""
    if value is None:
        return None
    if name in _FLAGS:
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool or None, got {type(value).__name__}")
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
        Each accepts None to fall back to its environment variable.
    """
    for name in kwargs:
        if name not in _ENV:
            raise TypeError(f"configure: unknown option {name!r}; expected one of {', '.join(_ENV)}")
    values = {name: check_value(name, value) for name, value in kwargs.items()}
    previous = {}
    for name, value in values.items():
        previous[name] = _settings.get(name)
        if value is None:
            _settings.pop(name, None)
        else:
            _settings[name] = value
    for fn in _watchers:
        fn(_settings)
    return previous


def watch(fn) -> None:
    """Call ``fn(settings)`` now and after every change made by configure()/options().

    ``settings`` is the live {option: value} dict of the API settings, to be read,
    not changed (observe.calls keeps what a plan's hit tests up to date this way).
    """
    _watchers.append(fn)
    fn(_settings)


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
    """Current value of an option: API setting, else environment, else None."""
    value = _settings.get(name, _UNSET)
    if value is not _UNSET:
        return value
    var = _ENV[name]
    raw = env_value(var)
    if raw is None or raw.strip() == "":
        return None
    if name in _FLAGS:
        return env_flag(var)
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{var}: expected a number of seconds, got {raw!r}") from None
    if not seconds > 0:
        raise ValueError(f"{var}: expected a positive number of seconds, got {raw!r}")
    return seconds


# os.environ.get() raises and catches KeyError inside for an unset variable,
# about a microsecond; collectives read their options on every call and
# usually none is set.  On POSIX, os.environ keeps its contents in a dict of
# bytes that every change made through os.environ updates; reading that dict
# answers "unset" without an exception.  Anywhere else: os.environ.get().
_ENV_BYTES = os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict)
_ENV_KEYS: dict = {}


def env_value(name: str) -> str | None:
    """``os.environ.get(name)``, cheap when the variable is unset."""
    data = os.environ._data if _ENV_BYTES else None
    if type(data) is not dict:
        return os.environ.get(name)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    raw = data.get(key)
    return None if raw is None else os.fsdecode(raw)


def env_flag(name: str) -> bool | None:
    """Read a boolean environment variable: 1/yes/true/on or 0/no/false/off."""
    value = env_value(name)
    if value is None or value.strip() == "":
        return None
    value = value.strip().lower()
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off"):
        return False
    raise ValueError(f"{name}: expected 1/0, yes/no, true/false or on/off, got {value!r}")


def live_env(names: tuple):
    """(the dict ``os.environ`` keeps its contents in, the keys ``names`` have in it), for a
    membership test inline on a hot path; None where ``os.environ`` keeps no such dict.

    Every change made through ``os.environ`` (``monkeypatch.setenv`` included)
    writes through to that dict, so testing it is reading the environment now.
    """
    data = getattr(os.environ, "_data", None)
    encode = getattr(os.environ, "encodekey", None)
    if type(data) is not dict or encode is None:
        return None
    return data, tuple(encode(name) for name in names)


def unset_test(names: tuple, off: dict | None = None):
    """A function of no arguments: whether nothing of ``names`` and ``off`` is on, cheaply.

    ``names``: environment variables that must be unset.  ``off``: {option:
    its variable}: options that must not be on.  An API setting of False
    switches one off whatever its variable says (``with mpicoll.options(
    check=False)``); without an API setting its variable must be unset.  Any
    other API setting makes the function return False.  The variables are
    read at every call (a test or a user may set one at run time); only the
    encoded keys and the lookups are prepared.
    """
    off = dict(off or {})
    live = live_env(tuple(names) + tuple(off.values()))
    if live is None:
        def slow() -> bool:
            for name, value in _settings.items():
                if name not in off or value is not False:
                    return False
            return (all(os.environ.get(n) is None for n in names)
                    and all(os.environ.get(var) is None
                            for opt, var in off.items() if opt not in _settings))
        return slow
    data, keys = live
    off_keys = tuple(zip(off, keys[len(names):]))
    settings = _settings
    env = data.keys()  # a live view of the environment (os.environ writes through)

    def test() -> bool:
        if not settings:
            return env.isdisjoint(keys)
        for name, value in settings.items():
            if name not in off or value is not False:
                return False
        for opt, key in off_keys:
            if opt not in settings and key in data:
                return False
        return env.isdisjoint(keys[:len(names)])

    return test
