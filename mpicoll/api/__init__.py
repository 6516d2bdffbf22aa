"""The public API: the array functions and the mpi4py-compatible Comm."""
