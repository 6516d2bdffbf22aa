"""Rewrite a wheel keeping only the files a run needs (the device tool carries at most 64 MiB).

    python tests/device/trim_wheel.py WHEEL PATTERN...

WHEEL is replaced in place (same file name, so pip installs it as the same
version); a file is kept when its path inside the wheel matches one of the
PATTERNs (``fnmatch``, ``*`` crosses ``/``) or lies in the ``.dist-info``
folder, whose RECORD is rewritten with the kept files' hashes and sizes.
Prints the kept and dropped counts and the sizes before and after; exit 1 if a
PATTERN matched nothing (a renamed file would otherwise be dropped silently).

fetch_wheels.sh uses it on ``libucx-cu13``: 43 MB as published (static
libraries, headers, perftest, each shared library three times under its
three names), about 7 MB with the libraries by their SONAME, the UCX modules,
the CUDA runtime they link and ``ucx_info``.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import os
import sys
import zipfile


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def trim(path: str, patterns: list[str]) -> int:
    with zipfile.ZipFile(path) as src:
        infos = src.infolist()
        dist_info = next((i.filename.split("/")[0] for i in infos
                          if i.filename.split("/")[0].endswith(".dist-info")), None)
        if dist_info is None:
            print(f"trim_wheel: {path}: no .dist-info folder: not a wheel")
            return 1
        record = f"{dist_info}/RECORD"
        used = dict.fromkeys(patterns, 0)
        kept = []
        for info in infos:
            name = info.filename
            if name == record or name.endswith("/"):
                continue
            hits = [p for p in patterns if fnmatch.fnmatchcase(name, p)]
            for p in hits:
                used[p] += 1
            if hits or name.startswith(dist_info + "/"):
                kept.append(info)
        unused = [p for p, n in used.items() if n == 0]
        if unused:
            print(f"trim_wheel: {path}: nothing matches {', '.join(unused)}; wheel left as it was")
            return 1
        tmp = f"{path}.{os.getpid()}.tmp"
        lines = []
        # O_EXCL: never write through a file or link that was already there
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as raw, \
                zipfile.ZipFile(raw, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in kept:
                data = src.read(info)
                dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
                lines.append(_record_line(info.filename, data))
            lines.append(f"{record},,")
            dst.writestr(record, "\n".join(lines) + "\n")
    before = os.path.getsize(path)
    os.replace(tmp, path)
    print(f"trim_wheel: {os.path.basename(path)}: kept {len(kept)} of {len(infos) - 1} files, "
          f"{before / 1e6:.1f} MB -> {os.path.getsize(path) / 1e6:.1f} MB")
    return 0


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2:
        print(__doc__.strip().splitlines()[2].strip())
        return 2
    return trim(args[0], args[1:])


if __name__ == "__main__":
    sys.exit(main())
