"""Files mpicoll reads and writes: whether this process could write one (checked before the
work), and reading one only another user cannot have written."""

from __future__ import annotations

import os
import stat


def unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written here ("is a directory", "no directory D", "not
    writable"); None: it can (its folder exists and this user may create or replace it)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "is a directory"
    if not os.path.isdir(folder):
        return f"no directory {folder}"
    if not os.access(folder, os.W_OK | os.X_OK) or \
            (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "not writable"
    return None


def _others_may_write(path: str, st, folder: bool) -> str | None:
    """Why another user could have written (or, a folder, renamed entries of) ``path``."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}) or root"
    if st.st_mode & 0o022 and not (folder and st.st_mode & stat.S_ISVTX):  # (sticky: /tmp)
        return f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def read_trusted(path: str) -> str:
    """The text of the file at ``path`` if no other user can have written it, else
    ValueError saying why (the rules of pip's cache and OpenSSH's StrictModes): not a link,
    a regular file owned by this user or root and writable by neither group nor others,
    and every folder from ``/`` down to it owned by this user or root and not writable by
    group or others unless sticky (else its owner could put another file in its place).
    OSError if it cannot be read.  A tuning file shapes every schedule "auto" picks."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # (a link: ELOOP)
    with os.fdopen(fd, encoding="utf-8") as f:
        st = os.fstat(fd)
        why = None if stat.S_ISREG(st.st_mode) else f"{path} is not a regular file"
        why = why or _others_may_write(path, st, False)
        folder = os.path.dirname(os.path.realpath(path))
        while why is None:
            why = _others_may_write(folder, os.stat(folder), True)
            if os.path.dirname(folder) == folder:
                break
            folder = os.path.dirname(folder)
        if why is not None:
            raise ValueError(f"not read: another user could have written it ({why})")
        return f.read()
