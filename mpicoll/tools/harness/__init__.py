"""The one benchmark harness of mpicoll's tools.

``python -m mpicoll.bench`` and ``python -m mpicoll.tune``, and the
measurement scripts in the repository's ``benchmarks/`` (``latency.py``,
``overlap.py``, ``torch_bench.py``), time, check and record through these
modules and nothing else:

:mod:`~mpicoll.tools.harness.timing`
    :class:`Variant` and :func:`time_variants`: warm-up, interleaved batches
    after a ``Barrier``, each sample timed with ``MPI.Wtime`` on every rank,
    the slowest rank's time per sample, the median over samples.
:mod:`~mpicoll.tools.harness.workload`
    one collective call as the tools run it (:class:`Case`: the input, the
    mpicoll call out of place and in place, MPI's built-in beside it, on NumPy
    or device arrays) and its check against the exact result
    (:func:`check_case`, :mod:`mpicoll.tools.results`' rule).
:mod:`~mpicoll.tools.harness.records`
    what a run records: the environment, JSON, CSV and the plot.
:mod:`~mpicoll.tools.harness.cli`
    the command lines' shared parts: argument types, the progress line, and
    :class:`ToolError`, how every tool reports a user's mistake (one line on
    stderr, exit status 1 or 2, no traceback).
"""
