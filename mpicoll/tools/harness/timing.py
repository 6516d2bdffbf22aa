"""Timing: interleaved batches of variants, the slowest rank's median.

A *variant* is one way to do the same work (mpicoll's call, MPI's built-in,
the call in place, a floor written with plain mpi4py calls).  Every variant
of a measurement runs in the same process, in turns, so that a change in the
machine's load falls on all of them alike::

    warm-up     ``warmup`` untimed calls of each variant (inside its context)
    rounds      each variant runs one batch of ``batch`` samples, after a
                ``Barrier``; the order of the variants flips every round
    sample      ``inner`` calls back to back, timed on every rank with
                ``MPI.Wtime``, divided by ``inner``
    result      per variant, the median over samples of the slowest rank's
                sample (a collective takes as long as its slowest rank)

One call per sample (``inner=1``) shows every call's own time; for calls of a
microsecond, ``inner`` calls per sample keep the timer's own cost out.  With
``spread``, the rounds stop early (after at least ``min_samples``) once every
variant's interquartile range is within ``spread`` times its median on every
rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

__all__ = ["Variant", "time_variants"]


@dataclass(frozen=True)
class Variant:
    """One timed variant.

    Args:
        call: the work of one call (it must complete it: synchronise a device).
        context: returns the context manager in force around each of its batches
            (e.g. ``lambda: mpicoll.options(check=False)``).
        reset: untimed, before each of its batches (e.g. refill a buffer).
    """

    call: Callable[[], object]
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext
    reset: Callable[[], object] | None = None


def time_variants(comm, variants: dict[str, Variant], *, warmup: int, samples: int,
                  batch: int = 1, inner: int = 1, min_samples: int | None = None,
                  spread: float | None = None) -> dict[str, float]:
    """``{name: seconds per call}``: each variant's median over samples of the slowest rank.

    Every rank of ``comm`` calls this with the same arguments (the barriers and
    the final reduction are collective on ``comm``).
    """
    names = list(variants)
    for name in names:
        v = variants[name]
        with v.context():
            for _ in range(warmup):
                v.call()
    times = {name: np.empty(samples) for name in names}
    done = dict.fromkeys(names, 0)
    wtime = MPI.Wtime
    rnd = 0
    while done[names[0]] < samples:
        for name in (names if rnd % 2 == 0 else names[::-1]):
            v, t = variants[name], times[name]
            call = v.call
            k0 = done[name]
            k1 = min(k0 + batch, samples)
            if v.reset is not None:
                v.reset()
            with v.context():
                comm.Barrier()
                for k in range(k0, k1):
                    t0 = wtime()
                    for _ in range(inner):
                        call()
                    t[k] = (wtime() - t0) / inner
            done[name] = k1
        rnd += 1
        n = done[names[0]]
        if spread is not None and n < samples and n >= (min_samples or 1):
            steady = True
            for name in names:
                q1, q2, q3 = np.percentile(times[name][:done[name]], (25, 50, 75))
                steady = steady and q3 - q1 <= spread * q2
            if comm.allreduce(steady, op=MPI.LAND):
                break
    out = {}
    for name in names:
        t = times[name][:done[name]]
        comm.Allreduce(MPI.IN_PLACE, t, MPI.MAX)
        out[name] = float(np.median(t))
    return out
