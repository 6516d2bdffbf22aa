"""A stand-in for CuPy in the ranks of mpicoll's probe job (``python -m mpicoll.info
--probe``), for tests without a GPU: put ``tests/support/fakecupy`` first on ``PYTHONPATH``.

Its arrays are host memory behind ``__cuda_array_interface__`` (as the fake GPU's,
support/fakegpu.py, and mpi4py's own CUDA-array-interface tests), so any MPI moves them.
With ``FAKECUPY_POINTERS=unmapped`` they give an address no process maps instead: an
MPI that is handed one reads memory it cannot read, as an MPI that is not CUDA-aware
does with a real device pointer, and the rank crashes.  Only what the probe uses.
"""

import os

import numpy

__version__ = "0.0-fakecupy"
float64 = numpy.float64
_UNMAPPED = 0x1000  # the page after NULL, which no process maps


class ndarray:
    def __init__(self, host):
        self._h = host

    @property
    def __cuda_array_interface__(self):
        h = self._h
        unmapped = os.environ.get("FAKECUPY_POINTERS") == "unmapped"
        return {"shape": h.shape, "typestr": h.dtype.str, "strides": None, "version": 3,
                "data": (_UNMAPPED if unmapped else h.ctypes.data, False), "stream": None}

    def __add__(self, other):
        return ndarray(self._h + other)


def arange(n, dtype=float64):
    return ndarray(numpy.arange(n, dtype=dtype))


def zeros(n, dtype=float64):
    return ndarray(numpy.zeros(n, dtype=dtype))


def asnumpy(a):
    return a._h.copy()


class _Stream:
    def synchronize(self):
        pass


class _Device:
    def __init__(self, index):
        self.index = index

    def use(self):
        pass


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def getDeviceProperties(index):
        return {"name": b"Fake GPU (tests/support/fakecupy)"}


class cuda:
    """``cupy.cuda``, as far as the probe uses it."""

    Device = _Device
    runtime = _Runtime

    @staticmethod
    def get_current_stream():
        return _Stream()
