"""Measure this MPI and machine, and write the selection ``algorithm="auto"`` uses.

Usage (every rank runs it; rank 0 prints and writes)::

    mpirun -n 2 python -m mpicoll.tune --quick      # coarse sweep (seconds)
    mpirun -n 2 python -m mpicoll.tune              # the default sweep (a minute or two)
    srun -N 4 --ntasks-per-node 8 python -m mpicoll.tune -o tuning.json
    python -m mpicoll.tune --predict 1024           # predicted crossovers at 1024 ranks
    python -m mpicoll.tune --predict 64,128 --ranks-per-node 8 -o tuning.json
    python -m mpicoll.tune --check tuning.json      # the 5 % rule, size by size

What it measures, in one run on the communicator's layout (ranks, nodes):

1. the point-to-point cost curve: one ``Sendrecv`` exchange between rank 0
   and a rank on its node (``intra``) and, across nodes, the first rank of
   another node (``inter``), from 8 B up, doubling; where the time jumps
   (a protocol cliff such as an eager limit) probes bisect the jump to a
   few tens of bytes;
2. every algorithm of every collective at each size (the hierarchical one
   only where the ranks span nodes), each timed in its own loop with the
   built-in, as the benchmark does (:mod:`mpicoll.tools.harness`: median of
   the slowest rank, interleaved batches) and checked against the exact
   values.  The second pass (sizes in the other order; each point keeps its
   fastest) measures again only the algorithms within :data:`~policy.WIDE`
   of the fastest of the size; from :data:`~policy.SEG_MIN` up an algorithm
   :data:`~policy.LOSING` times slower at two sizes in a row is not measured
   at the larger ones;
3. from :data:`~policy.SEG_MIN` up, the segment size and window (core.config's
   ``segment_bytes`` and ``window``) of the algorithms near the fastest: the
   segment sizes of the sweep, then its windows at the best segment size;
4. the rate of a local reduction, and the cost model
   (:mod:`mpicoll.tools.costmodel`) fitted to all of it.

The fastest algorithm per size becomes a list of size ranges: at every size
an algorithm within 5 % of the fastest measured (any algorithm, any segment
and window), with the fewest switches (noise between near-equal algorithms
does not split a range); the boundary between two measured sizes is where
the model's curves cross.  Per algorithm, the segment size and window chosen
by size (the options' values unless another beats them by more than 5 %).
The report, and ``--check FILE`` later, print per size the chosen
algorithm's time against the fastest measured.  The tuning file (format:
:mod:`mpicoll.engine.tuning`) is keyed by the MPI library and version,
holds one entry per layout (a new run replaces the entry of its own layout
and keeps the others), and records when, where and how it was measured.
By default it is the default file of this MPI library in the user's cache
directory, which "auto" then reads; ``-o`` writes elsewhere
(``MPICOLL_TUNING=path`` to use it).  ``--predict N -o FILE`` adds the
model's selection for N ranks as entries marked predicted (``"source":
"model"``, with the measured entry they come from), which "auto" uses where
no measured entry fits.  The exit status is 1 if any result was wrong (no
file is written then).

The package, one module per concern: :mod:`.policy` (every threshold, with
its reason), :mod:`.measure` (the layout, the exchange curve, the
collectives and their segment/window variants), :mod:`.choose` (from times
to the selection, and the 5 % rule), the cost model
(:mod:`mpicoll.tools.costmodel`) and :mod:`.cli` (the command line).  A
mistake in how it was called or in the file it was given ends it with one
line on stderr and exit status 1 (2 for arguments).
"""

from .cli import main

__all__ = ["main"]
