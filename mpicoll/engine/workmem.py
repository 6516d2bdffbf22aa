"""Work memory: one arena per context; buffers are asked for by purpose, never by number.

A run that needs work arrays opens a *scope* of its context's arena (the
executor's ``run_on`` does, around a schedule) and asks for each array by
what it is for::

    with ctx.work.scope(be):
        tmp = ctx.work.take(dst.dtype, len(dst), "partner's partial result")

Leases: work memory of an operation that outlives a function call
    A non-blocking or persistent collective (engine.executor) holds its work
    buffers from its start until it completes (persistent: until freed),
    while other calls run.  It takes them from a :class:`Lease`
    (:meth:`WorkMemory.lease`), released explicitly; lifetimes need not
    nest.  A scope is a lease that a ``with`` block releases.

Why two live uses cannot alias
    Every region taken (by a scope or a lease) is recorded as an interval
    of its (backend, dtype) array until it is released, and a new region goes
    to the lowest gap that none of the live intervals covers (first fit).
    So the regions of all live scopes and leases are pairwise disjoint,
    whatever order they are released in, however many buffers a call asks
    for.  A take always goes to the innermost open scope (or to the lease it
    is asked of).

Storage
    One 1-D array per (backend, dtype), reused by every call.  A take that
    does not fit the array gets an array of its own until it is released;
    once no region of that array is live any more, the array grows to the
    highest end a region ever needed.  A repeated call of one signature then
    allocates nothing.  ``backend.empty(n, dtype)`` is the only allocation.

After a call that timed out, receives may still be pending into the arena;
such a context is marked unusable (see observe.calls), so no later call on it
reuses that memory.
"""

from __future__ import annotations


class WorkMemory:
    """The arena of one context: see the module docstring.

    Attributes:
        allocations: number of ``backend.empty`` calls made so far (tests and
            the benchmark read it: a repeated call must not add any).
    """

    __slots__ = ("_blocks", "_live", "_need", "_taken", "_scopes", "allocations")

    def __init__(self):
        self._blocks: dict = {}   # (backend name, dtype) -> 1-D array
        self._live: dict = {}     # key -> [[start, end, region], ...] sorted by start
        self._need: dict = {}     # key -> highest end a region needed beyond the array
        self._taken: list = []    # live regions, oldest first (see live())
        self._scopes: list = []   # open scopes, innermost last
        self.allocations = 0

    @property
    def nbytes(self) -> int:
        """Bytes the arena holds between calls."""
        return sum(int(arr.nbytes) for arr in self._blocks.values())

    def scope(self, backend) -> _Scope:
        """A context manager for one algorithm run on ``backend`` (nests)."""
        return _Scope(self, backend)

    def lease(self, backend) -> Lease:
        """Work memory on ``backend`` held until :meth:`Lease.release` (any order)."""
        return Lease(self, backend)

    def take(self, dtype, n: int, purpose: str):
        """A 1-D work array of ``n`` elements of ``dtype`` for ``purpose`` (contents undefined).

        Disjoint from every other live region; valid until the innermost open
        scope closes.
        """
        if not self._scopes:
            raise RuntimeError(f"work memory for {purpose!r} taken outside a work-memory scope")
        return self._scopes[-1].take(dtype, n, purpose)

    def _take(self, owner, dtype, n: int, purpose: str):
        key = (owner.backend.name, dtype)
        live = self._live.get(key)
        if live is None:
            live = self._live[key] = []
        # first fit: the lowest gap between live intervals that holds n elements
        start, at = 0, len(live)
        for i, iv in enumerate(live):
            if iv[0] - start >= n:
                at = i
                break
            if iv[1] > start:
                start = iv[1]
        end = start + n
        region = _Region(purpose, key, start, end)
        live.insert(at, region)
        self._taken.append(region)
        owner.regions.append(region)
        block = self._blocks.get(key)
        if block is not None and end <= len(block):
            return block[start:end]
        # missing or too short: the arena's array grows once nothing of it is live
        if end > self._need.get(key, 0):
            self._need[key] = end
        if start == 0 and len(live) == 1:
            # nothing else of this kind is live: replace the array by one that fits
            self._blocks[key] = None
            block = self._blocks[key] = self._alloc(owner.backend, max(n, 1), dtype)
            return block[:n]
        region.own = self._alloc(owner.backend, max(n, 1), dtype)
        return region.own[:n]

    def _give_back(self, owner) -> None:
        """Release every region of ``owner``; grow arrays no region lives in any more."""
        for region in owner.regions:
            live = self._live[region.key]
            live.remove(region)
            self._taken.remove(region)
            region.own = None
            need = self._need.get(region.key)
            if need is not None and not live:
                del self._need[region.key]
                block = self._blocks.get(region.key)
                if block is None or len(block) < need:
                    self._blocks[region.key] = None  # freed before the new one is made
                    self._blocks[region.key] = self._alloc(owner.backend, need, region.key[1])
        owner.regions = []

    def live(self) -> list:
        """(purpose, dtype, elements) of every live region, oldest first."""
        return [(r.purpose, r.key[1], r.end - r.start) for r in self._taken]

    def spans(self) -> list:
        """(backend name, dtype, start, end) of every live region in its array, oldest first."""
        return [(*r.key, r.start, r.end) for r in self._taken]

    def release(self) -> None:
        """Drop the arena's arrays (reallocated when needed); not while a region is live."""
        if self._taken or self._scopes:
            raise RuntimeError("work memory released while a call is using it")
        self._blocks.clear()
        self._need.clear()

    def _alloc(self, be, n, dtype):
        self.allocations += 1
        return be.empty(n, dtype)


class _Region:
    __slots__ = ("purpose", "key", "start", "end", "own")

    def __init__(self, purpose, key, start, end):
        self.purpose, self.key, self.start, self.end = purpose, key, start, end
        self.own = None  # an array of its own, where the arena's was too short

    def __getitem__(self, i):  # (start, end), as WorkMemory._take reads live intervals
        return (self.start, self.end)[i]


class Lease:
    """Regions of one operation, held until :meth:`release` (idempotent)."""

    __slots__ = ("mem", "backend", "regions")

    def __init__(self, mem: WorkMemory, backend):
        self.mem, self.backend, self.regions = mem, backend, []

    def take(self, dtype, n: int, purpose: str):
        """A 1-D work array of ``n`` elements for ``purpose``, disjoint from every live region."""
        return self.mem._take(self, dtype, n, purpose)

    def release(self) -> None:
        if self.regions:
            self.mem._give_back(self)


class _Scope(Lease):
    """``with mem.scope(backend):`` -- one algorithm call's use of the arena."""

    __slots__ = ()

    def __enter__(self):
        self.mem._scopes.append(self)
        return self

    def __exit__(self, exc_type, exc, tb):
        self.mem._scopes.remove(self)
        self.release()
        return False
