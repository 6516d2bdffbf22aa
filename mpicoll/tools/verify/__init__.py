"""Check mpicoll against MPI's built-in collectives: ``mpirun -n 4 python -m mpicoll.verify``.

Every collective runs through mpicoll (each registered algorithm, in place and
out of place) on rank-asymmetric input, and its result is judged against a
reference built from the same input.  Rank 0 prints one row per (collective,
dtype, op) and a closing PASS/FAIL line; every rank exits with the same status
(0: all agree, 1: some case failed, 2: a bad option, or options that select
nothing to check, refused before any collective runs).  Op names are
case-insensitive (``--op sum`` or ``--op SUM``).

The parts:

:mod:`.cases`
    the case table: element types and the ops that apply, rank-asymmetric
    inputs (:func:`make_input`), uneven counts and gapped layouts, the
    collectives and their algorithms (local, no MPI);
:mod:`.runner`
    :func:`run_case`: one collective on one input through mpicoll, every
    check, one verdict on every rank (collective);
:mod:`.cli`
    the command line (:func:`main`).

The reference, the one tolerance rule and the comparison are
:mod:`mpicoll.tools.results` (``python -m pydoc mpicoll.tools.results``),
shared with ``python -m mpicoll.bench``, the examples and the tests; the
buffers are :mod:`mpicoll.tools.arrays`.  The names below are re-exported
so ``from mpicoll.tools import verify`` reaches all of them.
"""

from __future__ import annotations

from ..results import (
    Comparison,
    Reference,
    builtin_can_reduce,
    compare,
    identical_across_ranks,
    reference_allgatherv,
    reference_allreduce,
    same_values,
    tolerance,
    value_bytes,
)
from .cases import (
    COLLECTIVES,
    REDUCTION_OPS,
    TypeInfo,
    algorithms_for,
    available_types,
    gapped_displs,
    make_input,
    ops_for,
    type_info,
    uneven_counts,
)
from .cli import _counts, main
from .runner import CaseResult, Prepared, prepare_case, run_case

__all__ = [
    "TypeInfo", "Reference", "Comparison", "CaseResult",
    "available_types", "type_info", "ops_for", "make_input", "uneven_counts", "gapped_displs",
    "builtin_can_reduce", "reference_allreduce", "reference_allgatherv",
    "tolerance", "compare", "identical_across_ranks", "value_bytes", "same_values",
    "COLLECTIVES", "REDUCTION_OPS", "algorithms_for", "Prepared", "prepare_case", "run_case",
    "main", "_counts",
]
