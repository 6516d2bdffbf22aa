"""Work memory: one arena per context; buffers are asked for by purpose, never by number.

An algorithm that needs work arrays runs inside a *scope* of its context's
arena (:func:`scoped` opens one around the algorithm function) and asks for
each array by what it is for::

    @scoped
    def allreduce(ctx, ch, be, red, src, dst):
        tmp = ctx.work.take(dst.dtype, len(dst), "partner's partial result")

Why two live uses cannot alias
    Within a scope every :meth:`WorkMemory.take` gets a new region above all
    the regions taken before it (a bump pointer that only moves up while the
    scope is open).  Scopes nest: an algorithm built on another one (a
    ReduceScatter made of an AllReduce) opens the inner scope above the
    outer one's regions, and closing it gives back only its own.  A take
    always goes to the innermost open scope, and a scope closes before its
    caller continues, so the regions of all open scopes are pairwise
    disjoint, however many buffers a call asks for.

Storage
    One 1-D array per (backend, dtype), reused by every call.  A take that
    does not fit the array gets an array of its own for the rest of the call;
    when the outermost scope closes (after the algorithm function returned,
    so nothing refers to the call's regions any more), the arena's array
    grows to what the call needed.  A repeated call of one signature then
    allocates nothing.  ``backend.empty(n, dtype)`` is the only allocation.

After a call that timed out, receives may still be pending into the arena;
such a context is marked unusable (see observe.calls), so no later call on it
reuses that memory.
"""

from __future__ import annotations

import functools


class WorkMemory:
    """The arena of one context: see the module docstring.

    Attributes:
        allocations: number of ``backend.empty`` calls made so far (tests and
            the benchmark read it: a repeated call must not add any).
    """

    __slots__ = ("_blocks", "_top", "_need", "_taken", "_backends", "_extra", "_short",
                 "allocations")

    def __init__(self):
        self._blocks: dict = {}   # (backend name, dtype) -> 1-D array
        self._top: dict = {}      # key -> elements taken by the open scopes
        self._need: dict = {}     # key -> most elements one call took, where the array was short
        self._taken: list = []    # (purpose, key, start, end) of the open scopes' regions, in order
        self._backends: list = [] # the backend of each open scope, innermost last
        self._extra: list = []    # arrays of takes that did not fit, kept to the end of the call
        self._short = False       # a take of the current call did not fit its array
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Bytes the arena holds between calls."""
        return sum(int(arr.nbytes) for arr in self._blocks.values())

    def scope(self, backend) -> _Scope:
        """A context manager for one algorithm call on ``backend`` (nests); see :func:`scoped`."""
        return _Scope(self, backend)

    def take(self, dtype, n: int, purpose: str):
        """A 1-D work array of ``n`` elements of ``dtype`` for ``purpose`` (contents undefined).

        Disjoint from every other array taken in the open scopes; valid until
        the innermost open scope closes.
        """
        if not self._backends:
            raise RuntimeError(f"work memory for {purpose!r} taken outside a work-memory scope")
        key = (self._backends[-1].name, dtype)
        tops = self._top
        top = tops.get(key, 0)
        end = tops[key] = top + n
        self._taken.append((purpose, key, top, end))
        block = self._blocks.get(key)
        if block is not None and end <= len(block):
            return block[top:end]
        return self._take_short(key, top, end)

    def _take_short(self, key, top, end):
        """``take`` where the arena's array is missing or too short."""
        self._short = True
        if end > self._need.get(key, 0):
            self._need[key] = end
        be, dtype, n = self._backends[-1], key[1], end - top
        if top == 0:
            # nothing of this kind is live: replace the arena's array by one that fits
            self._blocks[key] = None
            block = self._blocks[key] = self._alloc(be, max(n, 1), dtype)
            return block[:n]
        # live regions below: a separate array for the rest of this call
        arr = self._alloc(be, max(n, 1), dtype)
        self._extra.append(arr)
        return arr[:n]

    def live(self) -> list:
        """(purpose, dtype, elements) of every region of the open scopes, oldest first."""
        return [(p, key[1], end - top) for p, key, top, end in self._taken]

    def release(self) -> None:
        """Drop the arena's arrays (reallocated when needed); not while a scope is open."""
        if self._backends:
            raise RuntimeError("work memory released while a call is using it")
        self._blocks.clear()
        self._need.clear()

    def _alloc(self, be, n, dtype):
        self.allocations += 1
        return be.empty(n, dtype)

    def _enter(self, backend) -> int:
        """Open a scope; returns its mark (regions taken before it)."""
        self._backends.append(backend)
        return len(self._taken)

    def _exit(self, mark: int) -> None:
        """Close the innermost scope: give back the regions taken since ``mark``."""
        taken = self._taken
        if len(taken) > mark:
            tops = self._top
            for _, key, top, _ in reversed(taken[mark:]):
                tops[key] = top
            del taken[mark:]
        be = self._backends.pop()
        if not self._backends:
            self._extra.clear()
            if self._short:
                self._short = False
                self._grow(be)

    def _grow(self, be) -> None:
        """The outermost scope on ``be`` closed: grow its arrays to what the largest call took."""
        for key, need in self._need.items():
            block = self._blocks.get(key)
            if key[0] == be.name and block is not None and len(block) < need:
                block = self._blocks[key] = None  # the old array is freed before the new one is made
                self._blocks[key] = self._alloc(be, need, key[1])


class _Scope:
    """``with mem.scope(backend):`` -- one algorithm call's use of the arena."""

    __slots__ = ("mem", "backend", "mark")

    def __init__(self, mem: WorkMemory, backend):
        self.mem, self.backend, self.mark = mem, backend, None

    def __enter__(self):
        self.mark = self.mem._enter(self.backend)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.mem._exit(self.mark)
        return False


def scoped(fn):
    """Run the algorithm ``fn(ctx, ch, be, ...)`` inside a work-memory scope of ``ctx`` on ``be``."""

    @functools.wraps(fn)
    def run(ctx, ch, be, *args):
        mem = ctx.work
        mark = mem._enter(be)
        try:
            return fn(ctx, ch, be, *args)
        finally:
            mem._exit(mark)

    return run
