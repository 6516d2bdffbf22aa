"""The numerics options, one table: name -> (environment variable, parser, default, doc).

Read through :func:`get` only, once per process (the value is cached);
:func:`reload` forgets the cache (tests).  Meant to move into the one
options table of core.config.
"""

from __future__ import annotations

from .config import env_value


def _flag(name, raw):
    value = raw.strip().lower()
    if value in ("1", "yes", "true", "on"):
        return True
    if value in ("0", "no", "false", "off", ""):
        return False
    raise ValueError(f"{name}: expected 1/yes/true/on or 0/no/false/off, got {raw!r}")


OPTIONS = {
    "deterministic": (
        "MPICOLL_DETERMINISTIC", _flag, False,
        "floating reductions give bitwise the same result for every algorithm, size, "
        "segment and window: the rank-order fold ((x0 + x1) + x2) + ... (docs/numerics.md)",
    ),
}

_CACHE: dict = {}


def get(name: str):
    """The option's value: its environment variable if set, else its default."""
    try:
        return _CACHE[name]
    except KeyError:
        pass
    env, parse, default, _ = OPTIONS[name]
    raw = env_value(env)
    value = default if raw is None else parse(env, raw)
    _CACHE[name] = value
    return value


def reload() -> None:
    _CACHE.clear()
