"""torch's ReduceOp -> what mpicoll runs: an MPI op, a factor applied before, a step after.

One table per dtype category; dispatch by lookup.  MPI has no AVG and no
PREMUL_SUM: AVG is SUM, then a division by the group size (floating point:
a true division; integers: truncated toward zero, as NCCL's average); PREMUL_SUM
multiplies every rank's input by its factor first, then sums.  bool has no
arithmetic in MPI: MIN and PRODUCT are logical AND, MAX and SUM logical OR
(what NCCL does for bool), BAND/BOR/BXOR the logical LAND/LOR/LXOR.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from mpi4py import MPI

R = dist.ReduceOp.RedOpType

# op -> (MPI op, post step): "avg" divides by the group size afterwards
_NUMERIC = {
    R.SUM: (MPI.SUM, None),
    R.AVG: (MPI.SUM, "avg"),
    R.PRODUCT: (MPI.PROD, None),
    R.MIN: (MPI.MIN, None),
    R.MAX: (MPI.MAX, None),
    R.PREMUL_SUM: (MPI.SUM, None),
}
_BITWISE = {R.BAND: (MPI.BAND, None), R.BOR: (MPI.BOR, None), R.BXOR: (MPI.BXOR, None)}
_INTEGER = {**_NUMERIC, **_BITWISE}
_BOOL = {
    R.MIN: (MPI.LAND, None), R.PRODUCT: (MPI.LAND, None), R.BAND: (MPI.LAND, None),
    R.MAX: (MPI.LOR, None), R.SUM: (MPI.LOR, None), R.BOR: (MPI.LOR, None),
    R.BXOR: (MPI.LXOR, None),
}
_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class Reduction:
    """What one reduction runs: ``mpi_op``, ``factor`` (PREMUL_SUM, else None), ``avg``."""

    __slots__ = ("mpi_op", "factor", "avg", "name")

    def __init__(self, mpi_op, factor, avg, name):
        self.mpi_op, self.factor, self.avg, self.name = mpi_op, factor, avg, name

    def pre(self, staged) -> None:
        """Scale a rank's contribution (PREMUL_SUM) in place (a tensors.Staged: its array)."""
        if self.factor is not None:
            staged.scale(self.factor)

    def post(self, staged, size: int) -> None:
        """Finish a staged result and copy it back (tensors.Staged): AVG divides by ``size``.

        Floating point divides the reduced array (bfloat16: the ml_dtypes array,
        so the sum and the quotient are each rounded, as NCCL's AVG; without
        ml_dtypes the float32 stand-in, rounded once); integers divide the
        reduced tensor (the staging copy, where there is one), truncating.
        """
        if self.avg:
            if staged.tensor.is_floating_point():  # ml_dtypes' bfloat16 is NumPy kind "V"
                staged.divide(size)
            else:
                h = staged.host
                h.copy_(torch.div(h, size, rounding_mode="trunc"))
        staged.done()


_MADE: dict = {}  # (RedOpType, dtype) -> Reduction, for every op but PREMUL_SUM (its factor varies)


def reduction(op, dtype) -> Reduction:
    """The :class:`Reduction` of a ``ReduceOp`` on ``dtype``; ValueError for one that does not apply."""
    kind = getattr(op, "op", op)  # a ReduceOp holds its RedOpType; ReduceOp.SUM is one
    made = _MADE.get((kind, dtype))
    if made is not None:
        return made
    if not isinstance(kind, R):
        raise TypeError(f"op: expected a torch.distributed.ReduceOp, got {type(op).__name__}")
    if dtype is torch.bool:
        table = _BOOL
    elif dtype in _FLOATING:
        table = _NUMERIC
    else:
        table = _INTEGER
    if kind not in table:
        raise ValueError(f"op: ReduceOp.{kind.name} does not apply to {dtype} "
                         f"(the mpicoll backend takes {', '.join(k.name for k in table)} on it)")
    mpi_op, post = table[kind]
    if kind == R.PREMUL_SUM:
        return Reduction(mpi_op, _factor(op), False, kind.name)
    made = _MADE[(kind, dtype)] = Reduction(mpi_op, None, post == "avg", kind.name)
    return made


def _factor(op) -> float:
    """PREMUL_SUM's factor: a number (a one-element tensor is read once, on the host)."""
    factor = getattr(op, "factor", None)
    if factor is None:
        raise ValueError("op: PREMUL_SUM without a factor (make it with "
                         "torch.distributed._make_nccl_premul_sum(factor))")
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"op: PREMUL_SUM factor: expected one element, got {factor.numel()}")
        factor = factor.item()
    return float(factor)
