"""Array backends: where buffers live, how they are allocated, copied and reduced.

The algorithms are written once against this small interface:

``empty(n, dtype)``        a new 1-D array of ``n`` elements
``copy(dst, src)``         ``dst[...] = src`` (same length)
``reducer(op, msg)``       a callable ``red(a, b, out)`` computing ``out = a op b``
``prepare()``              make the caller's pending work on the buffers complete
                           before MPI reads them (a no-op on the host)
``finish()``               make the result visible to the caller (no-op on the host)
``channel(ctx, mpitype)``  point-to-point transport for this backend (see transport.channel)

The NumPy backend lives here; backends.registry finds the backend of an
array (NumPy's, or a registered device backend: backends.devices).
"""

from __future__ import annotations

import numpy as np

from ..core import types as _types
from ..transport.channel import Channel
from . import dlpack as _dlpack

# -- floating-point conditions -------------------------------------------------------
# A reduction or cast that overflows (or gives inf - inf) writes its IEEE result (inf,
# NaN) and sets the CPU's floating-point flags, which NumPy then reports: a
# RuntimeWarning (an exception under ``-W error`` or pytest's ``filterwarnings = error``)
# or, under ``np.seterr(all="raise")``, a FloatingPointError.  Raised on the one rank that
# computed the element, mid-collective, it would leave the others waiting for ever.  So
# the engine catches these around every reduction and copy of a collective: the result
# stands, as MPI's built-ins give it (docs/numerics.md, "Overflow, NaN and Inf").
# (Catching, not ``np.errstate(all="ignore")``: entering and leaving errstate on every
# reduction costs a measurable share of a small repeated call; a catch costs nothing
# until a condition arises.)
FP_CONDITIONS = (RuntimeWarning, FloatingPointError)


class Reducer:
    """``out = a op b`` elementwise, for one (op, datatype, backend).

    Predefined ops use the backend's ufunc table; user-defined ops go through
    ``Op.Reduce_local``, which computes ``inout = in op inout``.
    """

    __slots__ = ("op", "ufunc", "mpitype", "commutative", "backend")

    def __init__(self, op, ufunc, mpitype, backend):
        self.op = op
        self.ufunc = ufunc
        self.mpitype = mpitype
        self.commutative = bool(op.Is_commutative())
        self.backend = backend

    def __call__(self, a, b, out):
        if self.ufunc is not None:
            self.ufunc(a, b, out=out)
            return
        # Algorithms often pass different view objects of the same memory (acc[i:j]
        # for both an operand and the output), so compare memory, not identity.
        op, T = self.op, self.mpitype
        if _same_memory(out, b):
            op.Reduce_local([a, T], [out, T])
        elif _same_memory(out, a) and self.commutative:
            op.Reduce_local([b, T], [out, T])
        elif np.may_share_memory(out, a) or np.may_share_memory(out, b):
            tmp = b.copy()
            op.Reduce_local([a, T], [tmp, T])
            self.backend.copy(out, tmp)
        else:
            self.backend.copy(out, b)
            op.Reduce_local([a, T], [out, T])

    def fold(self, xs, outs):
        """Every array of ``outs`` = ``((xs[0] op xs[1]) op xs[2]) op ...`` (a schedule's
        ``Fold``): pairwise in that order into a new array, then copied out, as an output
        may be an operand."""
        be = self.backend
        if len(xs) == 1:
            acc = xs[0]
        else:
            acc = be.empty(len(xs[0]), outs[0].dtype)
            self(xs[0], xs[1], acc)
            for x in xs[2:]:
                self(acc, x, acc)
        for out in outs:
            be.copy(out, acc)


def _same_memory(x, y) -> bool:
    """Whether two NumPy arrays are views of exactly the same elements."""
    if x is y:
        return True
    ix, iy = x.__array_interface__, y.__array_interface__
    return ix["data"][0] == iy["data"][0] and x.shape == y.shape and x.strides == y.strides


class NumpyBackend:
    """Host memory, NumPy arrays."""

    name = "numpy"
    device = "cpu"
    ufuncs = _types.NUMPY_UFUNCS

    def __init__(self):
        self._reducers = {}

    @staticmethod
    def empty(n, dtype):
        return np.empty(n, dtype=dtype)

    @staticmethod
    def copy(dst, src):
        np.copyto(dst, src)

    @staticmethod
    def may_share_memory(a, b):
        return np.may_share_memory(a, b)

    @staticmethod
    def prepare():
        pass

    @staticmethod
    def finish():
        pass

    def reducer(self, op, mpitype, category):
        name = _types.op_name(op)
        if name is None:  # user-defined: not cached (a freed op's handle can be reused)
            return Reducer(op, None, mpitype, self)
        # predefined op on a predefined datatype: one Reducer per combination
        key = (name, mpitype.handle, category)
        red = self._reducers.get(key)
        if red is None:
            ufunc = self.ufuncs.get(name) if category != "pair" else None
            red = self._reducers[key] = Reducer(op, ufunc, mpitype, self)
        return red

    def channel(self, ctx, mpitype):
        return Channel(ctx.comm, mpitype, local=ctx.local, node_bytes=ctx.node_piece)

    @staticmethod
    def is_array(obj):
        return isinstance(obj, np.ndarray)

    @staticmethod
    def asarray(obj):
        """A 1-D-or-more NumPy view of a host buffer (buffer protocol, else DLPack).

        The buffer protocol wins where an object has both, as in mpi4py; DLPack
        tensors are read as mpi4py reads them (see :mod:`mpicoll.backends.dlpack`).
        """
        if isinstance(obj, np.ndarray):
            return obj
        try:
            return np.asarray(memoryview(obj))
        except TypeError:
            pass
        if hasattr(obj, "__dlpack__"):
            return _dlpack.asarray(obj)
        raise TypeError


NUMPY = NumpyBackend()

def is_device_object(obj) -> bool:
    """Whether ``obj`` says its memory is on a device (CUDA array interface, or DLPack with a
    device other than the CPU)."""
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    dev = getattr(obj, "__dlpack_device__", None)
    if dev is not None:
        try:
            return int(dev()[0]) != 1  # kDLCPU == 1
        except Exception:
            return False
    return False
