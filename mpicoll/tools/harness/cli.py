"""The tools' command lines: argument types, the progress line, and how a mistake is reported.

Every tool's ``main`` is wrapped by :func:`tool`: a :class:`ToolError` (a file
that cannot be read or written, a tuning file that cannot answer the
question, a device that is not there) ends the tool with one line on stderr,
``<tool>: <what was wrong>``, and its exit status (1; 2 for arguments),
never a traceback.  Arguments are checked by argparse before anything is
measured (:class:`Parser`: exit status 2, the message printed once, by rank 0):
numbers by the argument types here, output files by :meth:`Parser.add_output`
(a plot's format from its name when the arguments are read; whether rank 0
can write each file by :meth:`Parser.parse_args`, every rank learning rank
0's answer), so no tool measures first and fails when it writes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
import time

from mpi4py import MPI

from ...core.config import parse_bytes
from ...core.paths import unwritable as _unwritable

__all__ = ["ToolError", "tool", "Parser", "size_arg", "positive_int", "nonnegative_int",
           "factor_arg", "seconds_arg", "seconds_or_zero_arg", "plot_path", "sizes", "human",
           "check_outputs", "write_file", "Progress"]


class ToolError(Exception):
    """A mistake of the tool's user, reported as one line; ``status`` is the exit status.

    ``agreed``: every rank raises it (the ranks agreed on it), so rank 0 alone prints it;
    otherwise each rank that raises it prints it.
    """

    def __init__(self, message: str, status: int = 1, agreed: bool = False):
        super().__init__(message)
        self.status = status
        self.agreed = agreed


def tool(prog: str):
    """Decorate a tool's ``main``: a :class:`ToolError` becomes ``prog: message`` on stderr
    and the return value ``exc.status`` (on the ranks that raised it)."""
    def wrap(main):
        @functools.wraps(main)
        def run(*args, **kwargs):
            try:
                return main(*args, **kwargs)
            except ToolError as exc:
                if not exc.agreed or MPI.COMM_WORLD.Get_rank() == 0:
                    sys.stdout.flush()
                    sys.stderr.write(f"{prog}: {exc}\n")
                    sys.stderr.flush()
                return exc.status
        return run
    return wrap


class Parser(argparse.ArgumentParser):
    """argparse that prints only on rank 0 of the world (every rank exits the same way:
    all ranks parse the same arguments), and refuses output files before anything runs.

    Output files are declared with :meth:`add_output`; :meth:`parse_args` then checks
    that rank 0 can write each one given (collective over its ``comm``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._outputs: dict = {}  # dest -> the option as the user reads it ("--json")

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)

    def add_output(self, *flags, plot: bool = False, **kwargs):
        """An output file argument (``add_argument``'s arguments), checked before the run;
        ``plot``: a figure whose name must end in one of matplotlib's formats."""
        if plot:
            kwargs["type"] = plot_path
        action = self.add_argument(*flags, **kwargs)
        self._outputs[action.dest] = "/".join(action.option_strings)
        return action

    def parse_args(self, args=None, namespace=None, comm=None):
        """argparse's, then every output file given refused (``error``, exit status 2, on
        every rank of ``comm``, default the world) unless rank 0 of ``comm`` can write it."""
        parsed = super().parse_args(args, namespace)
        if self._outputs:
            check_outputs(MPI.COMM_WORLD if comm is None else comm, self,
                          {option: getattr(parsed, dest) for dest, option in self._outputs.items()})
        return parsed


def size_arg(text):
    """argparse type: a size in bytes such as 8, 4K, 64M, 1G."""
    try:
        return parse_bytes(text, "size")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("size: ", "")) from None


def _bounded(text, convert, ok, expected):
    """argparse type: ``convert(text)`` where ``ok`` of it, else "expected ..., got ..."."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_int(text):
    return _bounded(text, int, lambda v: v >= 1, "a positive integer")


def nonnegative_int(text):
    return _bounded(text, int, lambda v: v >= 0, "an integer >= 0")


def factor_arg(text):
    return _bounded(text, float, lambda v: v > 1, "a number > 1")


def seconds_arg(text):
    """argparse type: a finite number of seconds > 0 (a timeout)."""
    return _bounded(text, float, lambda v: 0 < v < math.inf, "a number of seconds > 0")


def seconds_or_zero_arg(text):
    """argparse type: a finite number of seconds >= 0 (a timeout where 0 says none)."""
    return _bounded(text, float, lambda v: 0 <= v < math.inf, "a number of seconds >= 0")


PLOT_PACKAGE = "pip install 'mpicoll[plot]'"


def plot_formats() -> list[str]:
    """The file formats matplotlib writes (ImportError without matplotlib)."""
    from matplotlib.backend_bases import FigureCanvasBase
    return sorted(FigureCanvasBase.get_supported_filetypes())


def plot_path(text):
    """argparse type: a figure's file name, its extension one of matplotlib's formats."""
    try:
        formats = plot_formats()
    except ImportError:
        raise argparse.ArgumentTypeError(
            f"needs matplotlib, which is not installed; install it with: {PLOT_PACKAGE}") from None
    ext = os.path.splitext(text)[1][1:].lower()
    if ext not in formats:
        raise argparse.ArgumentTypeError(
            f"expected a file name ending in .{', .'.join(formats)} (matplotlib's formats), "
            f"got {text!r}")
    return text


def sizes(minbytes: int, maxbytes: int, factor: float) -> list[int]:
    """minbytes, minbytes*factor, ... up to maxbytes (each step at least one byte more)."""
    out = []
    s = minbytes
    while s <= maxbytes:
        out.append(s)
        s = max(s + 1, int(s * factor))
    return out


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def check_outputs(comm, parser, outputs: dict, make_dirs: bool = False) -> None:
    """Refuse (``parser.error``, on every rank) output files rank 0 could not write.

    ``outputs``: {option: path or None}.  Rank 0 writes them, so rank 0 judges
    and every rank learns its answer: a run is refused before it measures,
    never after, and never on some ranks only.  ``make_dirs``: create a missing
    directory first (as the tool's writer would).
    """
    problem = None
    if comm.Get_rank() == 0:
        for option, path in outputs.items():
            why = None
            if path is not None and make_dirs:
                try:
                    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                except OSError as exc:
                    why = exc.strerror or str(exc)
            why = why or (None if path is None else _unwritable(path))
            if why:
                problem = f"{option}: cannot write {path}: {why}"
                break
    problem = comm.bcast(problem, root=0)
    if problem:
        parser.error(problem)


def write_file(path: str, write) -> None:
    """``write(file)`` into ``path`` through a temporary file renamed into place; an
    OSError is a :class:`ToolError` (one line, exit status 1)."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
                write(f)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        raise ToolError(f"cannot write {path}: {exc.strerror or exc}") from None


class Progress:
    """The progress line on stderr: what is being measured, step k of n, seconds so far.

    On a terminal one line rewritten in place, else one line per step;
    ``quiet`` (or not rank 0) prints nothing.
    """

    def __init__(self, prog: str, total: int, quiet: bool):
        self.prog, self.total, self.done, self.quiet = prog, total, 0, quiet
        self.t0 = time.perf_counter()

    def step(self, text: str, weight: int = 1) -> None:
        self.done += weight
        if self.quiet:
            return
        line = f"[{self.prog}] {text} ({self.done}/{self.total}, {time.perf_counter() - self.t0:.0f} s)"
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{line}\033[K")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def end(self) -> None:
        if not self.quiet and sys.stderr.isatty():
            sys.stderr.write("\n")
