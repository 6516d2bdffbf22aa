"""What the test files share besides ``_util``: simulators, data and buffer wrappers.

``schedsim``  every rank's schedule of one collective run in one process (NumPy, no MPI)
``fakegpu``   a fake GPU runtime and backend over host memory
``data``      the one rank-asymmetric input and its exact expectations
``buffers``   the buffer-kind wrappers (DLPack-only, CUDA array interface, ...)

pytest puts ``tests/`` on ``sys.path``, so a test file writes
``from support import schedsim as sim``.
"""
