"""Everything the test files share: helpers, simulators, data, buffer wrappers, GPU cases.

``util``      communicators, collective assertions ("raises before any message"),
              launching MPI jobs from a test, algorithm functions, options
``schedsim``  every rank's schedule of one collective run in one process (NumPy, no MPI)
``fakegpu``   a fake GPU runtime and backend over host memory
``gpucases``  the device-array cases run on the fake GPU and on CuPy
``data``      the one rank-asymmetric input and its exact expectations
``buffers``   the buffer-kind wrappers (DLPack-only, CUDA array interface, ...)

``tests/`` is on ``sys.path`` (setup.cfg's ``pythonpath``), so a test file in any
folder writes ``from support import schedsim as sim``.
"""
