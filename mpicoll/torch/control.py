"""The backend's own point-to-point messages on a group's communicator: tags and ``monitored_barrier``.

The user's ``send``/``recv`` run on the group's MPI communicator with torch's
tags.  The backend's own messages (``monitored_barrier``'s) use the top
:data:`RESERVED` tags below ``MPI_TAG_UB``, which ``send``/``recv`` refuse
(ValueError before any message), so the two never match each other.  Each
``monitored_barrier`` takes the next two of those tags (wrapping), as gloo
takes new tags per call: a message left by a failed barrier (a rank that
arrived after rank 0 gave up) is never matched by a later barrier.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..core.errors import CollectiveTimeout

RESERVED = 1 << 16  # tags kept for the backend's own messages (fewer where MPI_TAG_UB is small)
_PAUSE_S = 0.5e-3  # between tests of a monitored_barrier's requests (a debugging call)
_PASSED, _FAILED = 0, 1  # rank 0's reply


class Control:
    """The reserved tags of one group's communicator and the messages sent with them."""

    def __init__(self, comm):
        ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)  # (set on COMM_WORLD only; the same for all)
        reserved = min(RESERVED, (ub + 1) // 4) // 2 * 2
        self.comm = comm
        self.first = ub + 1 - reserved  # the first reserved tag
        self.pairs = reserved // 2
        self.calls = 0  # monitored_barrier calls on this rank: the next pair of tags
        self.abandoned: list = []  # (request, buffer) of sends a failed barrier left behind

    def check_tag(self, tag) -> None:
        """ValueError unless ``tag`` is one the user's send/recv may use."""
        if not 0 <= tag < self.first:
            raise ValueError(f"tag: expected 0..{self.first - 1} (the tags above are the mpicoll "
                             f"backend's own), got {tag}")

    def monitored_barrier(self, rank: int, size: int, timeout, peer_timeout, wait_all: bool):
        """gloo's monitored barrier: every other rank reports to rank 0 and waits for its reply.

        Rank 0 waits ``timeout`` seconds (None: no limit) for the others, then
        raises CollectiveTimeout naming the first rank missing (``wait_all``:
        every rank missing).  Its reply says whether all arrived, so the
        barrier passes on every rank or on none: on a failure the ranks that
        did arrive raise at once (as on gloo).  They wait up to
        ``peer_timeout`` (the group's timeout) for the reply.  The messages
        are gloo's, which torch's tests match.
        """
        self.abandoned = [(r, b) for r, b in self.abandoned if not r.Test()]
        k = self.calls % self.pairs
        self.calls += 1
        to_zero, from_zero = self.first + 2 * k, self.first + 2 * k + 1
        if rank != 0:
            out, back = np.array([rank], np.int64), np.empty(1, np.int64)
            send = self.comm.Isend(out, 0, to_zero)
            recv = self.comm.Irecv(back, 0, from_zero)
            if not _wait([send, recv], _deadline(peer_timeout)):
                self._give_up([recv], [(send, out)])
                why = f"no reply from rank 0 after {peer_timeout:g} s (the group's timeout)"
            elif back[0] != _PASSED:
                why = "rank 0 reports that not every rank arrived in time"
            else:
                return
            raise CollectiveTimeout(
                f"Rank {rank} successfully reached monitoredBarrier, but received errors "
                f"while waiting for send/recv from rank 0. Please check rank 0 logs for "
                f"faulty rank.\n Original exception: \n{why}",
                collective="monitored_barrier", rank=rank, peer=0, timeout=peer_timeout)
        ms = "inf" if timeout is None else int(timeout * 1000)
        deadline = _deadline(timeout)
        peers = range(1, size)
        bufs = [np.empty(1, np.int64) for _ in peers]
        recvs = {p: self.comm.Irecv(b, p, to_zero) for p, b in zip(peers, bufs)}
        try:
            if wait_all:
                _wait(list(recvs.values()), deadline)
                missing = [p for p, r in recvs.items() if not r.Test()]
                if missing:
                    raise CollectiveTimeout(
                        f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass "
                        f"monitoredBarrier in {ms} ms", collective="monitored_barrier", rank=0,
                        peer=missing[0], timeout=timeout)
            else:
                arrived = []
                for p, r in recvs.items():
                    if deadline is not None and time.monotonic() > deadline:
                        done = (f"Successfully processed ranks: {', '.join(map(str, arrived))}"
                                if arrived else "No ranks successfully processed in monitoredBarrier.")
                        raise CollectiveTimeout(
                            f"Rank 0 timed out in monitoredBarrier after {ms} ms.\n{done}",
                            collective="monitored_barrier", rank=0, peer=p, timeout=timeout)
                    if not _wait([r], deadline):
                        raise CollectiveTimeout(
                            f"[Rank 0]: Rank {p} failed to pass monitoredBarrier in {ms} ms",
                            collective="monitored_barrier", rank=0, peer=p, timeout=timeout)
                    arrived.append(p)
        except CollectiveTimeout:
            arrived = [p for p, r in recvs.items() if r.Test()]
            self._give_up(list(recvs.values()), [])
            # the ranks that arrived learn at once that the barrier failed
            failed = np.full(1, _FAILED, np.int64)
            self._give_up([], [(self.comm.Isend(failed, p, from_zero), failed) for p in arrived])
            raise
        # every rank arrived: release them all
        token = np.full(1, _PASSED, np.int64)
        sends = {p: self.comm.Isend(token, p, from_zero) for p in peers}
        if not _wait(list(sends.values()), deadline):
            late = [p for p, s in sends.items() if not s.Test()]
            self._give_up([], [(s, token) for s in sends.values()])
            raise CollectiveTimeout(
                f"[Rank 0]: Rank {late[0]} failed to pass monitoredBarrier in {ms} ms",
                collective="monitored_barrier", rank=0, peer=late[0], timeout=timeout)

    def _give_up(self, recvs, sends) -> None:
        """Cancel receives nobody will send to; keep unfinished sends (and their buffers)."""
        for r in recvs:
            if not r.Test():
                r.Cancel()
                r.Wait()
        self.abandoned += [(s, b) for s, b in sends if not s.Test()]


def _deadline(seconds):
    return None if seconds is None else time.monotonic() + seconds


def _wait(requests, deadline) -> bool:
    """Test ``requests`` until all are complete (True) or ``deadline`` passed (False)."""
    while not MPI.Request.Testall(requests):
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(_PAUSE_S)
    return True
