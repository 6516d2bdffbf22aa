"""Sparse COO ``all_reduce``: every rank's nonzeros gathered, summed and coalesced (gloo's method).

A sparse tensor's nonzeros differ from rank to rank, so it cannot go through
AllReduce.  As on gloo, each rank coalesces its tensor; the ranks gather each
other's header (dtype, size, sparse dims, nonzero count: one AllGather), then,
with the counts it gives, every rank's indices and values (an AllGatherv
each); every rank then adds the ranks' tensors in rank order and coalesces
the sum, which replaces the tensor's indices and values.  So the result is
coalesced, the same on every rank and identical to gloo's.  Only SUM applies,
as on gloo.

Ranks whose tensors differ in dtype, size or sparse dims learn it from the
gathered headers, all alike, before any data move: every rank raises the
same error (marked :func:`failures.agreed`: no rank waits for another, so it
ends no job) and the group goes on.

Order of starts.  mpicoll's collectives on a communicator must start in the
same order on every rank (their tags follow that order).  The header's
AllGather starts with the call, on the group's communicator, like any
collective.  The data's can only start once the header is in: at a different
moment on each rank, on whichever thread advances the call (a ``wait()``,
the backend's completion thread).  So they run on a communicator of their
own (one per group, made with it) and start in call order: an exchange's
data start only after those of every exchange called before it
(:class:`Exchanges`).
"""

from __future__ import annotations

import math
import threading
from collections import deque

import numpy as np
import torch
import torch.distributed as dist

from .. import iallgather
from . import failures

# the dtypes of a sparse sum: those torch's sparse addition has on the CPU (not float16, bool)
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64)
_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}
MAX_DIMS = 16  # dimensions a header has room for (gloo's: 4 sparse and 4 dense)
# a header: dtype code, dims, sparse dims, nonzeros, then the size (MAX_DIMS, padded with -1)
_FIXED = 4
_HEADER = _FIXED + MAX_DIMS
_SUM = dist.ReduceOp.RedOpType.SUM


def is_sparse(tensors) -> bool:
    """Whether a call's tensors include a sparse COO tensor (they take this module's path)."""
    return any(getattr(t, "layout", None) is torch.sparse_coo for t in tensors)


def check(tensors, op) -> None:
    """TypeError/ValueError, before any message, for a sparse all_reduce that cannot run."""
    kind = getattr(op, "op", op)  # a ReduceOp holds its RedOpType
    if kind != _SUM:
        name = getattr(kind, "name", type(op).__name__)
        raise ValueError(f"op: expected ReduceOp.SUM for sparse tensors (the only op a sparse "
                         f"all_reduce has, as on gloo), got ReduceOp.{name}")
    for i, t in enumerate(tensors):
        what = f"tensors[{i}]"
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.layout is not torch.sparse_coo:
            raise TypeError(f"{what}: expected layout torch.sparse_coo like the call's other "
                            f"sparse tensors (a call's tensors are all sparse or all dense), got "
                            f"{t.layout}")
        if t.dtype not in _CODE:
            names = ", ".join(_name(d) for d in DTYPES)
            raise TypeError(f"{what}: dtype {_name(t.dtype)} is not supported for sparse tensors "
                            f"by the mpicoll backend (supported: {names})")
        if t.dim() > MAX_DIMS:
            raise ValueError(f"{what}: expected at most {MAX_DIMS} dimensions for a sparse "
                             f"tensor, got {t.dim()}")


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


class Exchanges:
    """The sparse all_reduces of one group whose header is in flight, in call order, and the
    communicator their data run on (``comm``: the group's, duplicated, set up by mpicoll)."""

    def __init__(self, comm):
        self.comm = comm
        self._lock = threading.Lock()
        self._waiting: deque = deque()

    def add(self, exchange) -> None:
        """``exchange``'s header started: its data start after every exchange added before."""
        self._waiting.append(exchange)  # (no lock: a start never waits for another thread)

    def advance(self, until=None) -> None:
        """Start the data of the waiting exchanges whose header is in, in call order.

        ``until``: wait (for the headers before its own too) until that
        exchange's data have started.  The lock keeps the headers' handles to
        one thread at a time; a thread that finds it held and is not waiting
        for an exchange leaves the advancing to the thread holding it.
        """
        if until is None:
            if not self._lock.acquire(blocking=False):
                return
        else:
            self._lock.acquire()
        try:
            waiting = self._waiting
            while waiting and (until is None or until.waiting):
                head = waiting[0]
                if not head.header_in(block=until is not None):
                    return
                waiting.popleft()
                head.start_data(self.comm)
        finally:
            self._lock.release()


class Exchange:
    """One sparse tensor's all_reduce: what the call's Work advances (``test``/``wait``), then
    its :meth:`finish` (the sum, into the tensor)."""

    def __init__(self, tensor, what: str, exchanges: Exchanges, size: int, timeout):
        self.tensor = tensor
        self.what = what
        self.exchanges = exchanges
        self.size = size
        self.timeout = timeout
        self.waiting = True  # data not started yet (nor failed)
        self.error = None
        # coalesced on its device (a CUDA tensor's nonzero count is known on the host then),
        # summed on the host, as on gloo
        local = tensor.detach().coalesce()
        self.local = local if local.is_cpu else local.cpu()
        self.header = np.full(_HEADER, -1, np.int64)
        self.header[:_FIXED] = (_CODE[tensor.dtype], local.dim(), local.sparse_dim(), local._nnz())
        self.header[_FIXED:_FIXED + local.dim()] = local.shape
        self.headers = np.empty(size * _HEADER, np.int64)
        self._header = None  # its AllGather's handle
        self._data: list = []  # the data's AllGathers' handles
        self._indices = self._values = None  # every rank's, once gathered

    # -- the start (the backend's _work), and what the Work advances ------------------------
    def start(self, comm):
        """Start the header's AllGather on ``comm`` (the group's); returns the Work's piece."""
        self._header = iallgather(self.header, comm=comm, out=self.headers, timeout=self.timeout)
        self.exchanges.add(self)
        return self

    def test(self) -> bool:
        if self.waiting:
            self.exchanges.advance()
            if self.waiting:
                return False
        if self.error is not None:
            raise self.error
        return all(h.test() for h in self._data)

    def wait(self) -> None:
        if self.waiting:
            self.exchanges.advance(self)
        if self.error is not None:
            raise self.error
        for h in self._data:
            h.wait()

    # -- Exchanges.advance, under its lock ---------------------------------------------------
    def header_in(self, block: bool) -> bool:
        """Whether the header is in (``block``: wait for it); a failure is kept (True)."""
        try:
            if block:
                self._header.wait()
                return True
            return self._header.test()
        except Exception as exc:
            self.error = exc
            return True

    def start_data(self, comm) -> None:
        """Check the gathered headers, then start the indices' and values' AllGathers on
        ``comm`` (the exchanges' own); an error is kept for the Work."""
        try:
            if self.error is None:
                self._start_data(comm)
        except Exception as exc:
            self.error = exc
        finally:  # (last: the Work's thread reads the handles or the error once it is False)
            self.waiting = False

    def _start_data(self, comm) -> None:
        headers = self.headers.reshape(self.size, _HEADER)
        self._agree(headers)
        nnz = headers[:, 3]
        local = self.local
        per = math.prod(local.shape[local.sparse_dim():])  # elements per nonzero
        values = local.values().contiguous().reshape(-1)
        self._indices = self._gather(local.indices().contiguous().reshape(-1),
                                     nnz * local.sparse_dim(), comm)
        self._values = self._gather(values.view(torch.uint8), nnz * per * values.element_size(),
                                    comm)

    def _gather(self, mine, counts, comm):
        """Every rank's ``mine`` (a flat CPU tensor; rank r's has ``counts[r]`` elements), in
        rank order, into a new tensor (an AllGatherv of mpicoll, unless all are empty)."""
        counts = [int(c) for c in counts]
        out = torch.empty(sum(counts), dtype=mine.dtype)
        if out.numel():
            even = len(set(counts)) == 1
            # (DLPack: unlike Tensor.numpy(), it leaves the tensors' storage resizable)
            self._data.append(iallgather(np.from_dlpack(mine), comm=comm, out=np.from_dlpack(out),
                                         counts=None if even else counts, timeout=self.timeout))
        return out

    def _agree(self, headers) -> None:
        """Raise, alike on every rank, where a rank's header differs from rank 0's."""
        first = headers[0]
        for r in range(1, self.size):
            row = headers[r]
            if np.array_equal(row[:3], first[:3]) and np.array_equal(row[_FIXED:],
                                                                     first[_FIXED:]):
                continue
            if row[0] != first[0]:
                exc = TypeError(f"{self.what}: expected the same dtype on every rank, got "
                                f"{_name(DTYPES[first[0]])} on rank 0 and "
                                f"{_name(DTYPES[row[0]])} on rank {r}")
            else:
                exc = ValueError(f"{self.what}: expected a sparse tensor of the same size and "
                                 f"sparse dims on every rank, got {_describe(first)} on rank 0 "
                                 f"and {_describe(row)} on rank {r}")
            raise failures.agreed(exc)

    # -- the Work's finish ------------------------------------------------------------------
    def finish(self) -> None:
        """Add every rank's tensor, in rank order, coalesce the sum (gloo's steps, so the
        same rounding) and make it the tensor's contents (on its device)."""
        local = self.local
        shape, sparse_dims = local.shape, local.sparse_dim()
        dense = tuple(shape[sparse_dims:])
        values = self._values.view(local.dtype)
        total = None
        at_index = at_value = 0
        with torch.no_grad():
            for n in self.headers.reshape(self.size, _HEADER)[:, 3].tolist():
                index = self._indices[at_index:at_index + n * sparse_dims].view(sparse_dims, n)
                count = n * math.prod(dense)
                part = torch.sparse_coo_tensor(index, values[at_value:at_value + count].view(
                    (n,) + dense), shape, check_invariants=False)  # (valid on the rank it left)
                at_index += n * sparse_dims
                at_value += count
                total = part if total is None else total.add_(part)
            total = total.coalesce()
            self.tensor.copy_(total.to(self.tensor.device))
        self.local = self._indices = self._values = None


def _describe(header) -> str:
    dims, sparse_dims = int(header[1]), int(header[2])
    size = tuple(int(s) for s in header[_FIXED:_FIXED + dims])
    return f"size {size} with {sparse_dims} sparse dims"
