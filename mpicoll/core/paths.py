"""Output files a user names: whether this process could write one, checked before the work."""

from __future__ import annotations

import os


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
