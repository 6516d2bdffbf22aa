"""What importing mpicoll does before its modules initialise MPI (mpi4py does, at
``from mpi4py import MPI``): for ``python -m mpicoll.info --probe`` alone, the probe's
two-process child job, which no process that has initialised MPI may start (no process
is started after MPI_Init).  Any other program: nothing (backends.cuda.probe_first).
"""

from .backends.cuda import probe_first

probe_first()
