"""The user's private cache folder: what mpicoll may trust from disk, and how it writes there.

mpicoll keeps two things in ``<cache>/mpicoll`` (``<cache>``: the
``cache_dir`` option, ``XDG_CACHE_HOME``, else ``~/.cache``): the compiled
repeat, a shared object it loads as code (engine.native), and the default
tuning file, which shapes every schedule "auto" picks (engine.tuning).
Another local user who can write either can run code as this user or change
what this user's jobs compute, so both live under rules (those of pip's cache
and OpenSSH's StrictModes):

* ``XDG_CACHE_HOME`` counts only when it is an absolute path (the XDG rule:
  a relative one is ignored, and ``~/.cache`` is used).
* ``<cache>/mpicoll`` and every folder below it that mpicoll creates are
  made with mode 0700.  One that exists must be a real folder (not a link),
  owned by this user and not writable by group or others.
* Every folder above it, from ``/`` down to ``<cache>`` (links resolved),
  must be owned by this user or root, and not writable by group or others
  unless it is sticky (``/tmp``): otherwise its owner could rename
  ``mpicoll`` and put another folder in its place.
* A file is read or loaded only if it is a regular file (not a link), owned
  by this user and not writable by group or others.
* Files are written in a fresh private folder (``tempfile.mkdtemp``: mode
  0700, an unpredictable name) and renamed into place, so no name another
  user could predict is ever opened for writing.

Whatever breaks a rule raises :class:`Unsafe`, whose text says which path and
why; the caller falls back (no compiled repeat, no tuning file) and says so in
``python -m mpicoll.info``.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

NAME = "mpicoll"


class Unsafe(Exception):
    """A path mpicoll must not trust (the text says which, and why)."""


def _owner_ok(st, allow_root: bool) -> bool:
    return st.st_uid == os.geteuid() or (allow_root and st.st_uid == 0)


def _check_dir(path: str, st, *, allow_root: bool, allow_sticky: bool) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise Unsafe(f"{path} is not a folder")
    if not _owner_ok(st, allow_root):
        raise Unsafe(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022 and not (allow_sticky and st.st_mode & stat.S_ISVTX):
        raise Unsafe(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def _check_chain(path: str) -> None:
    """Every folder from / down to ``path`` (links resolved) as the rules say."""
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    current = os.sep
    for i, part in enumerate(parts):
        if part:
            current = os.path.join(current, part)
        elif i:
            continue
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            return  # (the rest is created by folder(), 0700)
        _check_dir(current, st, allow_root=True, allow_sticky=True)


def root(cache_dir: str | None) -> str:
    """``<cache>/mpicoll`` for the ``cache_dir`` option's value (None: ``~/.cache``)."""
    base = cache_dir if cache_dir and os.path.isabs(cache_dir) else \
        os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, NAME)


def folder(cache_dir: str | None, *parts: str, create: bool = True) -> str:
    """``<cache>/mpicoll/<parts...>``, created (0700) where missing and checked as the rules
    say; :class:`Unsafe` otherwise (``create`` False: FileNotFoundError if missing)."""
    top = root(cache_dir)
    base = os.path.dirname(top)
    if create:
        try:
            os.makedirs(base, mode=0o700, exist_ok=True)  # (the user's own cache folder)
        except OSError as exc:
            raise Unsafe(f"cannot create {base}: {exc.strerror or exc}") from None
    _check_chain(base)
    path = top
    for part in ("",) + parts:
        if part:
            path = os.path.join(path, part)
        if create:
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                pass
            except OSError as exc:
                raise Unsafe(f"cannot create {path}: {exc.strerror or exc}") from None
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            raise Unsafe(f"{path} is a link")
        _check_dir(path, st, allow_root=False, allow_sticky=False)
    return path


def check_file(path: str) -> None:
    """:class:`Unsafe` unless ``path`` is a regular file of this user that only this user
    can write (FileNotFoundError if there is none)."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise Unsafe(f"{path} is not a regular file")
    if not _owner_ok(st, allow_root=False):
        raise Unsafe(f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise Unsafe(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


class Scratch:
    """A fresh private folder inside a checked ``folder`` (mode 0700, an unpredictable name),
    removed on exit; :meth:`keep` renames a file made there into the folder."""

    def __init__(self, folder_path: str):
        self.folder = folder_path
        self.path = ""

    def __enter__(self) -> Scratch:
        self.path = tempfile.mkdtemp(prefix=".tmp-", dir=self.folder)
        return self

    def __exit__(self, *exc) -> bool:
        shutil.rmtree(self.path, ignore_errors=True)
        return False

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def keep(self, name: str, final: str) -> str:
        """Rename scratch file ``name`` to ``final`` in the folder (atomic); its path."""
        target = os.path.join(self.folder, final)
        os.replace(os.path.join(self.path, name), target)
        return target


def write(folder_path: str, name: str, data) -> str:
    """Write ``data`` (str or bytes) to ``folder_path/name`` through a private scratch file
    renamed into place; its path."""
    with Scratch(folder_path) as scratch:
        mode = "w" if isinstance(data, str) else "wb"
        with open(scratch.file("data"), mode, **({"encoding": "utf-8"} if mode == "w" else {})) \
                as f:
            f.write(data)
        return scratch.keep("data", name)
