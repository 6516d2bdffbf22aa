"""``MpicollBackend``: torch.distributed's collectives on mpicoll and MPI, for CPU and CUDA.

The backend torch finds for a group of the ``"mpicoll"`` backend on either
device (``group._get_backend(device)``): what torch's C++ side calls
(``recv_anysource``, ``monitored_barrier``, the coalescing manager's
``start_coalescing``/``end_coalescing``) and, through the group
(:class:`~mpicoll.torch.group.ProcessGroupMpicoll`), every collective.

mpicoll's own algorithms run AllReduce, AllGather and ReduceScatter in every
form torch has (list, single-tensor, coalesced), and the AllGathers of a
sparse COO all_reduce (mpicoll.torch.sparse: gloo's method); broadcast,
barrier, gather, scatter, reduce, all-to-all and send/recv use MPI's
built-ins (reduce runs as mpicoll's AllReduce, because MPI's built-in has no
float16 or bfloat16).
Every call runs in two phases: its checks, which build everything the call
needs (``Staged`` tensors, reductions, buffers) and may refuse it
(TypeError/ValueError), then its starts, run by :meth:`MpicollBackend._work`,
the one place the call's messages begin (a sparse all_reduce's data follow
once its sizes are in: mpicoll.torch.sparse); it returns a
:class:`~mpicoll.torch.work.Work`.  Tensors on a CUDA device go to mpicoll as
device arrays on torch's current stream (mpicoll.torch.devices).

MPI's built-ins and the user's send/recv run on the group's communicator;
mpicoll sends its messages on its own duplicate of it; the backend's own
point-to-point messages (``monitored_barrier``) use the top tags of the
group's communicator, which send/recv refuse.

Errors (mpicoll.torch.failures): a refusal in the checks is raised to the
caller in every mode (nothing of the call started; the group stays usable).
An error once the starts began (an MPI error, ``CollectiveTimeout``) leaves
the other ranks waiting in the call: by default (``MPICOLL_TORCH_ON_ERROR=
abort``, as NCCL's async error handling) the rank prints it, naming itself,
and ends the job with ``MPI_Abort``; ``raise`` raises it on that rank only,
the others then raise ``CollectiveTimeout`` after the group's timeout
(torch's ``timeout=``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import allreduce, iallgather, iallreduce, ireduce_scatter
from . import devices as _devices
from . import failures
from . import sparse as _sparse
from .control import Control
from .ops import reduction
from .tensors import DTYPES, Staged, check_output, check_same, check_tensor, memory_view
from .work import Finished, MpiPiece, Work

_SUM = dist.ReduceOp.SUM
_MPI_SUM = MPI.SUM
_Tensor = torch.Tensor
_STRIDED = torch.strided
# dtypes whose SUM is MPI's SUM on the tensor's own memory (not bool: logical OR; not
# bfloat16: an ml_dtypes view, or a float32 copy)
_PLAIN_SUM = frozenset(DTYPES) - {torch.bool}


def _seconds(timeout):
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return seconds if seconds > 0 else None


def _collective(method, what=None):
    """A call of the backend (``what``: its name, the method's by default): an error out of
    its checks is a refusal, raised (marked for failures' exit hook in abort mode); one out
    of its starts was handled by ``_work`` (in abort mode the job ended there)."""
    what = what or method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if self._fail is not None:
                failures.note_refusal(exc, what, self._rank, self._size)
            raise

    return call


def _op(opts):
    return _SUM if opts is None else opts.reduceOp


def _bytes(array):
    return array.view(np.uint8)


def _shares_memory(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.numel() and b.numel()


class MpicollBackend(dist._Backend):
    """torch.distributed's backend on mpicoll (name ``"mpicoll"``), for CPU and CUDA tensors.

    One per group, made by :func:`mpicoll.torch.group.create` on the group's
    MPI communicator ``comm`` (its ranks in group-rank order); ``timeout``:
    seconds without progress before a collective fails (None: no limit);
    ``sparse_comm``: a duplicate of ``comm`` that mpicoll has set up, on which
    the data of sparse all_reduces run (mpicoll.torch.sparse).
    """

    # torch reads these (batch_isend_irecv, splitting, ...); the binding's own properties
    # ask back for Python overrides and recurse without them
    supports_coalescing = False  # batch_isend_irecv: one Work per operation, as on gloo
    supports_splitting = False
    supports_time_estimate = False
    supports_shrinking = False
    supports_reconfigure = False
    supports_window = False

    def __init__(self, comm, rank: int, size: int, timeout=None, on_error: str = "abort", *,
                 sparse_comm):
        super().__init__(rank, size)
        if on_error not in ("abort", "raise"):
            raise ValueError(f"on_error: expected 'abort' or 'raise', got {on_error!r}")
        self._comm = comm
        self.on_error = on_error
        # what a failed collective calls (None: the error is only raised); read per call
        self._fail = self._abort if on_error == "abort" else None
        self._rank = rank
        self._size = size
        self._timeout = _seconds(timeout)
        self._control = Control(comm)
        self._sparse = _sparse.Exchanges(sparse_comm)
        self._coalescing = None  # the works started since start_coalescing(), or None

    def getBackendName(self) -> str:
        return "mpicoll"

    def set_timeout(self, timeout) -> None:
        self._timeout = _seconds(timeout)

    def _abort(self, what: str, exc: BaseException) -> None:
        """End the job: ``exc`` made this rank's ``what`` fail, so the others would wait in it."""
        failures.end_job(what, exc, self._rank, self._size)

    def _work(self, starts, finish, result, what, opts, keep=None, scope=None, sync=False):
        """Start the call (``starts``: each begins its messages and returns what completes
        them, or None for a blocking call complete on return) and return its Work.

        The one place a call's messages begin: an error from here on is a failure
        (``self._fail``: abort, or raise), everything before it a refusal.  ``scope``
        (devices.Scope): the stream of a call on device tensors, current while it starts,
        advances and finishes; ``sync``: synchronise it first (MPI reads device memory).
        """
        try:
            if scope is None:
                pieces = [p for p in (start() for start in starts) if p is not None]
            else:
                with scope:
                    if sync:
                        scope.synchronize()
                    pieces = [p for p in (start() for start in starts) if p is not None]
        except Exception as exc:
            if self._fail is not None:
                self._fail(what, exc)
            raise
        if not pieces and finish is None:  # (a blocking call, complete)
            work = Finished(result, scope)
        else:
            work = Work(pieces, finish, result, what, opts, self._fail, keep, scope)
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    @property
    def timeout(self):
        """The seconds every collective of the group may go without progress (None: no limit)."""
        return self._timeout

    @property
    def comm(self):
        """The MPI communicator of this group (its ranks in group-rank order)."""
        return self._comm

    def __repr__(self) -> str:
        return f"<MpicollBackend rank {self._rank} of {self._size}>"

    # -- where a call's tensors live --------------------------------------------------------
    def _device(self, tensors, what):
        """``(layer, scope)`` for a call on ``tensors`` (mpicoll.torch.devices): (None, None) on
        the CPU, or where the tensors go through host copies.  Items that are not tensors are
        left to the call's checks; tensors on different devices are refused."""
        device = None
        for t in tensors:
            d = getattr(t, "device", None)
            if d is None:
                continue
            if device is None:
                device = d
            elif d != device:
                raise TypeError(f"{what}: expected every tensor on one device, got {device} "
                                f"and {d}")
        if device is None:
            return None, None
        layer = _devices.layer_of(device)  # (None on the CPU)
        return (None, None) if layer is None else (layer, layer.scope(device))

    @staticmethod
    def _mpi_layer(layer):
        """The layer MPI's own collectives take device memory through: ``layer`` where MPI is
        CUDA-aware, else None (host copies)."""
        return layer if layer is not None and layer.direct_mpi() else None

    # -- AllReduce ------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        # dist.all_reduce's usual call: one contiguous CPU tensor, SUM, blocking.  The same
        # steps as the general path below (check, reduction, Staged, mpicoll's blocking
        # AllReduce on the tensor's memory), with only the tests that pick them (none can
        # raise): the backend's cost at 16 B was 2x mpicoll's own (docs/torch.md)
        if opts is not None and len(tensors) == 1 and not opts.asyncOp:
            t = tensors[0]
            if (type(t) is _Tensor and t.layout is _STRIDED and t.is_cpu
                    and not t.requires_grad and t.dtype in _PLAIN_SUM
                    and t.is_contiguous() and opts.reduceOp == _SUM):
                array = memory_view(t)
                try:
                    allreduce(array, _MPI_SUM, comm=self._comm, out=array, timeout=self._timeout)
                except Exception as exc:  # a failure, as in _work
                    if self._fail is not None:
                        self._fail("allreduce", exc)
                    raise
                return Finished(tensors)
        return self._allreduce_checked(tensors, opts)

    def _allreduce_checked(self, tensors, opts):
        tensors = list(tensors)
        if _sparse.is_sparse(tensors):
            return self._allreduce_sparse(tensors, opts, "allreduce")
        for i, t in enumerate(tensors):
            check_tensor(t, "tensors", i, sparse=True)
        return self._allreduce(tensors, opts, "allreduce")

    _allreduce_checked = _collective(_allreduce_checked, "allreduce")

    @_collective
    def allreduce_sparse(self, tensors, opts=None):
        """torch's entry for sparse tensors: :meth:`allreduce` (as gloo's)."""
        return self.allreduce(tensors, opts)

    def _allreduce_sparse(self, tensors, opts, what):
        """Sparse COO tensors (mpicoll.torch.sparse): each summed over the ranks and coalesced,
        in place; the data's AllGathers start once the gathered headers agree."""
        _sparse.check(tensors, _op(opts))
        _, scope = self._device(tensors, "tensors")
        exchanges = [_sparse.Exchange(t, f"tensors[{i}]", self._sparse, self._size, self._timeout)
                     for i, t in enumerate(tensors)]

        def finish():
            for ex in exchanges:
                ex.finish()

        return self._work([functools.partial(ex.start, self._comm) for ex in exchanges], finish,
                          tensors, what, opts, scope=scope)

    @_collective
    def allreduce_coalesced(self, tensors, opts=None):
        tensors = list(tensors)
        if tensors:
            check_same(tensors, tensors[0].dtype, "tensors")
        return self._allreduce(tensors, opts, "allreduce_coalesced")

    def _allreduce(self, tensors, opts, what):
        layer, scope = self._device(tensors, "tensors")
        op = _op(opts)
        reds = [reduction(op, t.dtype) for t in tensors]
        staged = [Staged(t, layer=layer) for t in tensors]
        # a blocking call (torch's asyncOp False) runs mpicoll's blocking AllReduce, which
        # repeats a call on the same arrays without validating it again (engine.cache);
        # its Work is complete when made
        blocking = opts is not None and not opts.asyncOp
        starts = [functools.partial(self._start_allreduce, s, red, blocking)
                  for s, red in zip(staged, reds)]
        # nothing to finish where every sum is already in its tensor's memory
        if all(not red.avg and s.direct for s, red in zip(staged, reds)):
            return self._work(starts, None, tensors, what, opts, scope=scope)

        def finish():
            for s, red in zip(staged, reds):
                red.post(s, self._size)

        return self._work(starts, finish, tensors, what, opts, scope=scope)

    def _start_allreduce(self, staged, red, blocking):
        red.pre(staged)  # (PREMUL_SUM: the factor, on the array that is sent)
        array = staged.array
        if blocking:
            allreduce(array, red.mpi_op, comm=self._comm, out=array, timeout=self._timeout)
            return None
        return iallreduce(array, red.mpi_op, comm=self._comm, out=array, timeout=self._timeout)

    # -- AllGather ------------------------------------------------------------------------
    @_collective
    def allgather(self, output_tensors, input_tensors, opts=None):
        inputs = list(input_tensors)
        outputs = [list(o) for o in output_tensors]
        if len(outputs) != len(inputs):
            raise ValueError(f"output_tensors: expected one list per input ({len(inputs)}), "
                             f"got {len(outputs)}")
        layer, scope = self._device(inputs + [o for outs in outputs for o in outs], "tensors")
        starts, finishes = [], []
        for j, (outs, inp) in enumerate(zip(outputs, inputs)):
            self._gather_into_list(outs, inp, f"output_tensors[{j}]", starts, finishes, layer)
        return self._work(starts, _all(finishes), outputs, "allgather", opts, inputs, scope)

    @_collective
    def allgather_coalesced(self, output_lists, input_list, opts=None):
        inputs = list(input_list)
        outputs = [list(o) for o in output_lists]
        if len(outputs) != self._size:
            raise ValueError(f"output_lists: expected one list per rank ({self._size}), "
                             f"got {len(outputs)}")
        layer, scope = self._device(inputs + [o for outs in outputs for o in outs], "tensors")
        starts, finishes = [], []
        for j, inp in enumerate(inputs):
            outs = [outputs[r][j] for r in range(self._size)]
            self._gather_into_list(outs, inp, f"output_lists[*][{j}]", starts, finishes, layer)
        return self._work(starts, _all(finishes), outputs, "allgather_coalesced", opts, inputs,
                          scope)

    def _gather_into_list(self, outs, inp, what, starts, finishes, layer):
        check_tensor(inp, "input")
        if len(outs) != self._size:
            raise ValueError(f"{what}: expected {self._size} tensors (one per rank), got {len(outs)}")
        check_same(outs, inp.dtype, what, output=True)
        counts = [o.numel() for o in outs]
        if counts[self._rank] != inp.numel():
            raise ValueError(f"{what}[{self._rank}]: expected {inp.numel()} elements like the "
                             f"input, got {counts[self._rank]}")
        src = Staged(inp, "bits", layer)
        if layer is None:
            flat = received = np.empty(sum(counts), dtype=src.array.dtype)
        else:  # (kept as a tensor: the copies out are torch's, on the device)
            flat = torch.empty(sum(counts), dtype=src.host.dtype, device=inp.device)
            received = layer.array(flat)
        even = len(set(counts)) == 1
        starts.append(functools.partial(iallgather, src.array, comm=self._comm, out=received,
                                        counts=None if even else counts, timeout=self._timeout))

        def finish():
            at = 0
            for o, n in zip(outs, counts):
                dst = Staged(o, "out", layer)
                dst.fill(flat[at:at + n])
                dst.done()
                at += n

        finishes.append(finish)

    @_collective
    def all_gather_single(self, output, input, opts=None):
        layer, scope = self._device([output, input], "output")
        starts, finishes = [], []
        self._gather_single(output, input, "output", starts, finishes, layer)
        return self._work(starts, _all(finishes), [output], "all_gather_single", opts, input,
                          scope)

    @_collective
    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._coalesced(outputs, inputs, self._gather_single,
                               "all_gather_single_coalesced", opts)

    def _coalesced(self, outputs, inputs, one, name, opts):
        """One Work of ``one(output, input, what, starts, finishes, layer)`` over the pairs."""
        outputs, inputs = list(outputs), list(inputs)
        if len(outputs) != len(inputs):
            raise ValueError(f"outputs: expected {len(inputs)} tensors like inputs, got {len(outputs)}")
        layer, scope = self._device(outputs + inputs, "outputs")
        starts, finishes = [], []
        for j, (out, inp) in enumerate(zip(outputs, inputs)):
            one(out, inp, f"outputs[{j}]", starts, finishes, layer)
        return self._work(starts, _all(finishes), outputs, name, opts, inputs, scope)

    def _gather_single(self, output, input, what, starts, finishes, layer):
        check_tensor(input, "input")
        check_output(output, what)
        if output.dtype != input.dtype:
            raise TypeError(f"{what}: expected dtype {input.dtype} like the input, got {output.dtype}")
        k = input.numel()
        if output.numel() != self._size * k:
            raise ValueError(f"{what}: expected {self._size} x {k} = {self._size * k} elements "
                             f"(the group size times the input's), got {output.numel()}")
        own = self._is_own_block(output, input)
        dst = Staged(output, "bits" if own else "out", layer)
        if own and dst.direct:
            # FSDP2's all-gather: the input is this rank's block of the output, in place
            starts.append(functools.partial(iallgather, dst.array, comm=self._comm,
                                            out=dst.array, timeout=self._timeout))
        else:
            src = Staged(input, "bits", layer)
            if _shares_memory(input, output):
                src.fresh()
            starts.append(functools.partial(iallgather, src.array, comm=self._comm,
                                            out=dst.array, timeout=self._timeout))
        finishes.append(dst.done)

    def _is_own_block(self, output, input) -> bool:
        """Whether ``input`` is exactly block ``rank`` of a contiguous ``output``."""
        if not (input.device == output.device and output.is_contiguous()
                and input.is_contiguous() and input.numel()):
            return False
        own = output.data_ptr() + self._rank * input.numel() * input.element_size()
        return input.data_ptr() == own and _shares_memory(input, output)

    # -- ReduceScatter ------------------------------------------------------------------------
    @_collective
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        outputs = list(output_tensors)
        inputs = [list(i) for i in input_tensors]
        if len(outputs) != len(inputs):
            raise ValueError(f"input_tensors: expected one list per output ({len(outputs)}), "
                             f"got {len(inputs)}")
        layer, scope = self._device(outputs + [i for ins in inputs for i in ins], "tensors")
        starts, finishes = [], []
        inputs_joined = []  # (their arrays hold no reference: the work keeps them)
        for j, (out, ins) in enumerate(zip(outputs, inputs)):
            check_output(out, f"output_tensors[{j}]")
            if len(ins) != self._size:
                raise ValueError(f"input_tensors[{j}]: expected {self._size} tensors (one per "
                                 f"rank), got {len(ins)}")
            check_same(ins, out.dtype, f"input_tensors[{j}]")
            counts = [i.numel() for i in ins]
            if counts[self._rank] != out.numel():
                raise ValueError(f"output_tensors[{j}]: expected {counts[self._rank]} elements "
                                 f"like input_tensors[{j}][{self._rank}], got {out.numel()}")
            red = reduction(_op(opts), out.dtype)
            src = Staged(torch.cat([i.detach().reshape(-1) for i in ins]), layer=layer)
            inputs_joined.append(src.tensor)
            self._scatter_reduced(out, src, red, counts, starts, finishes, layer)
        return self._work(starts, _all(finishes), outputs, "reduce_scatter", opts, inputs_joined,
                          scope)

    @_collective
    def reduce_scatter_single(self, output, input, opts=None):
        layer, scope = self._device([output, input], "output")
        starts, finishes = [], []
        self._reduce_scatter_single(output, input, _op(opts), "output", starts, finishes, layer)
        return self._work(starts, _all(finishes), [output], "reduce_scatter_single", opts, input,
                          scope)

    @_collective
    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _op(opts)
        return self._coalesced(
            outputs, inputs,
            lambda out, inp, what, starts, finishes, layer: self._reduce_scatter_single(
                out, inp, op, what, starts, finishes, layer),
            "reduce_scatter_single_coalesced", opts)

    def _reduce_scatter_single(self, output, input, op, what, starts, finishes, layer):
        check_tensor(input, "input")
        check_output(output, what)
        if output.dtype != input.dtype:
            raise TypeError(f"{what}: expected dtype {input.dtype} like the input, got {output.dtype}")
        k = output.numel()
        if input.numel() != self._size * k:
            raise ValueError(f"input: expected {self._size} x {k} = {self._size * k} elements "
                             f"(the group size times the output's), got {input.numel()}")
        red = reduction(op, input.dtype)
        src = Staged(input, layer=layer)
        if red.factor is not None or _shares_memory(input, output):
            src.fresh()
        self._scatter_reduced(output, src, red, None, starts, finishes, layer)

    def _scatter_reduced(self, out, src, red, counts, starts, finishes, layer):
        """``src``: this rank's input (a Staged), a copy (or the input itself when ``red``
        has no factor and the output is elsewhere)."""
        dst = Staged(out, layer=layer)
        even = counts is None or len(set(counts)) == 1

        def start():
            red.pre(src)
            return ireduce_scatter(src.array, red.mpi_op, comm=self._comm, out=dst.array,
                                   counts=None if even else counts, timeout=self._timeout)

        starts.append(start)
        finishes.append(lambda: red.post(dst, self._size))

    # -- MPI built-ins ------------------------------------------------------------------------
    # On device memory only where MPI is CUDA-aware (_mpi_layer); the call's stream is then
    # synchronised before the first message (_work's ``sync``): MPI gets pointers, not streams.
    def _mpi(self, what, start, *args, status=None, **kwargs):
        """The start of an MPI built-in: ``start(*args, **kwargs)`` (an mpi4py ``I*`` call),
        made an MpiPiece with the group's timeout."""
        return lambda: MpiPiece(start(*args, **kwargs), what, self._timeout, status)

    @staticmethod
    def _byte_buffer(layer, nbytes, device):
        """Bytes for a built-in to receive into, ``(data, array)``: a host NumPy array (both),
        or a uint8 tensor on ``device`` and its array through ``layer``."""
        if layer is None:
            flat = np.empty(nbytes, np.uint8)
            return flat, flat
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return flat, layer.array(flat)

    @staticmethod
    def _concat_bytes(layer, tensors):
        """The bytes of ``tensors`` one after the other: host, or on their device."""
        if layer is None:
            return np.concatenate([_bytes(Staged(t, "bits").array) for t in tensors])
        return layer.array(torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8)
                                      for t in tensors]))

    @_collective
    def broadcast(self, tensors, opts=None):
        tensors = list(tensors)
        root = 0 if opts is None else opts.rootRank
        self._check_root(root, "rootRank")
        layer, scope = self._device(tensors, "tensors")
        mlayer = self._mpi_layer(layer)
        starts, finishes = [], []
        for i, t in enumerate(tensors):
            check_tensor(t, f"tensors[{i}]")
            s = Staged(t, "bits", mlayer)
            starts.append(self._mpi("broadcast", self._comm.Ibcast, [_bytes(s.array), MPI.BYTE],
                                    root=root))
            finishes.append(s.done)
        return self._work(starts, _all(finishes), tensors, "broadcast", opts, scope=scope,
                          sync=mlayer is not None)

    @_collective
    def barrier(self, opts=None):
        return self._work([self._mpi("barrier", self._comm.Ibarrier)], None, [], "barrier", opts)

    @_collective
    def reduce(self, tensors, opts=None):
        tensors = list(tensors)
        root = 0 if opts is None else opts.rootRank
        self._check_root(root, "rootRank")
        for i, t in enumerate(tensors):
            check_tensor(t, f"tensors[{i}]")
        layer, scope = self._device(tensors, "tensors")
        reds = [reduction(_op(opts), t.dtype) for t in tensors]
        # only the root's tensor receives the result; the others' stay as they were
        staged = [Staged(t if self._rank == root else t.detach().clone(), layer=layer)
                  for t in tensors]
        starts = [functools.partial(self._start_allreduce, s, red, False)
                  for s, red in zip(staged, reds)]

        def finish():
            if self._rank == root:
                for s, red in zip(staged, reds):
                    red.post(s, self._size)

        return self._work(starts, finish, tensors, "reduce", opts, scope=scope)

    @_collective
    def gather(self, output_tensors, input_tensors, opts=None):
        root = 0 if opts is None else opts.rootRank
        self._check_root(root, "rootRank")
        (inp,) = list(input_tensors)
        check_tensor(inp, "input_tensors[0]")
        outs = list(output_tensors[0]) if self._rank == root else []
        layer, scope = self._device([inp] + outs, "tensors")
        mlayer = self._mpi_layer(layer)
        src = Staged(inp, "bits", mlayer)
        nbytes = src.array.nbytes
        if self._rank == root:
            if len(outs) != self._size:
                raise ValueError(f"output_tensors[0]: expected {self._size} tensors, got {len(outs)}")
            check_same(outs, inp.dtype, "output_tensors[0]", output=True)
            for o in outs:
                if o.numel() != inp.numel():
                    raise ValueError(f"output_tensors[0]: expected {inp.numel()} elements each "
                                     f"like the input, got {o.numel()}")
        flat, received = self._byte_buffer(mlayer, nbytes * self._size if self._rank == root
                                           else 0, inp.device)
        start = self._mpi("gather", self._comm.Igather, [_bytes(src.array), MPI.BYTE],
                          [received, MPI.BYTE], root=root)

        def finish():
            for r, o in enumerate(outs):
                dst = Staged(o, "out", mlayer)
                dst.bytes_from(flat[r * nbytes:(r + 1) * nbytes])
                dst.done()

        return self._work([start], finish, [outs], "gather", opts, inp, scope,
                          sync=mlayer is not None)

    @_collective
    def scatter(self, output_tensors, input_tensors, opts=None):
        root = 0 if opts is None else opts.rootRank
        self._check_root(root, "rootRank")
        (out,) = list(output_tensors)
        check_output(out, "output_tensors[0]")
        ins = list(input_tensors[0]) if self._rank == root else []
        layer, scope = self._device([out] + ins, "tensors")
        mlayer = self._mpi_layer(layer)
        dst = Staged(out, "out", mlayer)
        if self._rank == root:
            if len(ins) != self._size:
                raise ValueError(f"input_tensors[0]: expected {self._size} tensors, got {len(ins)}")
            check_same(ins, out.dtype, "input_tensors[0]")
            if any(i.numel() != out.numel() for i in ins):
                raise ValueError(f"input_tensors[0]: expected {out.numel()} elements each like "
                                 f"the output")
            flat = self._concat_bytes(mlayer, ins)
        else:  # (ignored by MPI off the root)
            flat = np.empty(0, np.uint8)
        start = self._mpi("scatter", self._comm.Iscatter, [flat, MPI.BYTE],
                          [_bytes(dst.array), MPI.BYTE], root=root)
        return self._work([start], dst.done, [out], "scatter", opts, scope=scope,
                          sync=mlayer is not None)

    @_collective
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        check_tensor(input, "input")
        check_output(output, "output")
        if output.dtype != input.dtype:
            raise TypeError(f"output: expected dtype {input.dtype} like the input, got {output.dtype}")
        layer, scope = self._device([output, input], "output")
        mlayer = self._mpi_layer(layer)
        scounts = self._split_bytes(input, list(input_split_sizes), "input_split_sizes")
        rcounts = self._split_bytes(output, list(output_split_sizes), "output_split_sizes")
        src = Staged(input, "bits", mlayer)
        if _shares_memory(input, output):
            src.fresh()
        dst = Staged(output, "out", mlayer)
        start = self._mpi("all_to_all_single", self._comm.Ialltoallv,
                          [_bytes(src.array), (scounts, _displs(scounts)), MPI.BYTE],
                          [_bytes(dst.array), (rcounts, _displs(rcounts)), MPI.BYTE])
        return self._work([start], dst.done, [output], "all_to_all_single", opts, input, scope,
                          sync=mlayer is not None)

    @_collective
    def alltoall(self, output_tensors, input_tensors, opts=None):
        outs, ins = list(output_tensors), list(input_tensors)
        for what, ts in (("output_tensors", outs), ("input_tensors", ins)):
            if len(ts) != self._size:
                raise ValueError(f"{what}: expected {self._size} tensors, got {len(ts)}")
        check_tensor(ins[0], "input_tensors[0]")
        check_same(ins, ins[0].dtype, "input_tensors")
        check_same(outs, ins[0].dtype, "output_tensors", output=True)
        layer, scope = self._device(ins + outs, "tensors")
        mlayer = self._mpi_layer(layer)
        flat = self._concat_bytes(mlayer, ins)
        scounts = [i.numel() * i.element_size() for i in ins]
        rcounts = [o.numel() * o.element_size() for o in outs]
        recv, received = self._byte_buffer(mlayer, sum(rcounts), ins[0].device)
        start = self._mpi("alltoall", self._comm.Ialltoallv,
                          [flat, (scounts, _displs(scounts)), MPI.BYTE],
                          [received, (rcounts, _displs(rcounts)), MPI.BYTE])

        def finish():
            at = 0
            for o, n in zip(outs, rcounts):
                dst = Staged(o, "out", mlayer)
                dst.bytes_from(recv[at:at + n])
                dst.done()
                at += n

        return self._work([start], finish, outs, "alltoall", opts, scope=scope,
                          sync=mlayer is not None)

    @_collective
    def send(self, tensors, dst_rank, tag=0):
        self._check_peer(dst_rank, "dst_rank")
        self._control.check_tag(tag)
        for i, t in enumerate(tensors):
            check_tensor(t, f"tensors[{i}]")
        layer, scope = self._device(tensors, "tensors")
        mlayer = self._mpi_layer(layer)
        starts = []
        for t in tensors:
            s = Staged(t, "bits", mlayer)
            starts.append(self._mpi("send", self._comm.Isend, [_bytes(s.array), MPI.BYTE],
                                    dst_rank, tag))
        return self._work(starts, None, list(tensors), "send", None, scope=scope,
                          sync=mlayer is not None)

    @_collective
    def recv(self, tensors, src_rank, tag=0):
        self._check_peer(src_rank, "src_rank")
        return self._recv(tensors, src_rank, tag, "recv")

    @_collective
    def recv_anysource(self, tensors, tag=0):
        """``dist.recv``/``irecv`` without a source: an ``MPI.ANY_SOURCE`` receive; the Work's
        ``_source_rank()`` (what ``dist.recv`` returns, as a global rank) is the sender's
        group rank."""
        if len(tensors) != 1:
            raise ValueError(f"tensors: a receive from any source takes one tensor, "
                             f"got {len(tensors)}")
        return self._recv(tensors, MPI.ANY_SOURCE, tag, "recv_anysource")

    def _recv(self, tensors, source, tag, what):
        self._control.check_tag(tag)
        for i, t in enumerate(tensors):
            check_output(t, f"tensors[{i}]")
        layer, scope = self._device(tensors, "tensors")
        mlayer = self._mpi_layer(layer)
        starts, finishes, statuses = [], [], []
        for t in tensors:
            s = Staged(t, "out", mlayer)
            status = MPI.Status()
            statuses.append(status)
            starts.append(self._mpi(what, self._comm.Irecv, [_bytes(s.array), MPI.BYTE], source,
                                    tag, status=status))
            finishes.append(s.done)
        work = self._work(starts, _all(finishes), list(tensors), what, None, scope=scope,
                          sync=mlayer is not None)
        work.source = statuses[0] if source == MPI.ANY_SOURCE else source
        return work

    # -- torch's other calls on a backend -------------------------------------------------
    def monitored_barrier(self, opts, wait_all_ranks=False):
        """``dist.monitored_barrier``: gloo's protocol and messages (rank 0 names the ranks that
        did not arrive within ``opts.timeout``); raises, never aborts (its failure is what the
        caller asked to learn)."""
        seconds = opts.timeout.total_seconds()
        self._control.monitored_barrier(self._rank, self._size,
                                        self._timeout if seconds < 0 else seconds,
                                        self._timeout, wait_all_ranks)

    def start_coalescing(self):
        """torch's coalescing manager (``_coalescing_manager(group, device)``): the works
        started until :meth:`end_coalescing` are completed by the one work it returns."""
        self._coalescing = []

    def end_coalescing(self):
        works, self._coalescing = self._coalescing, None
        if works is None:
            raise RuntimeError("end_coalescing: no start_coalescing before it")
        # (the works started already: each "start" hands one over)
        return self._work([(lambda w=w: w) for w in works if not w.is_completed()], None, [],
                          "coalesced", None)

    def _check_peer(self, peer, what) -> None:
        if not 0 <= peer < self._size:
            raise ValueError(f"{what}: expected a rank in 0..{self._size - 1}, got {peer}")

    def _check_root(self, root, what) -> None:
        if not 0 <= root < self._size:
            raise ValueError(f"{what}: expected a rank in 0..{self._size - 1}, got {root}")

    def _split_bytes(self, t, splits, what):
        rows = t.shape[0] if t.dim() else 1
        row_bytes = (t.numel() // rows if rows else 0) * t.element_size()
        if not splits:
            if rows % self._size:
                raise ValueError(f"{what}: empty (equal split), but {rows} rows do not split "
                                 f"evenly over {self._size} ranks")
            splits = [rows // self._size] * self._size
        if len(splits) != self._size or sum(splits) != rows:
            raise ValueError(f"{what}: expected {self._size} row counts summing to {rows}, got "
                             f"{splits}")
        return [int(s) * row_bytes for s in splits]


def _displs(counts):
    out, at = [], 0
    for c in counts:
        out.append(at)
        at += c
    return out


def _all(finishes):
    if not finishes:
        return None
    if len(finishes) == 1:
        return finishes[0]

    def finish():
        for f in finishes:
            f()

    return finish
