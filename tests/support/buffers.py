"""Buffer-kind wrappers for tests: the same buffers the library's checker builds.

:mod:`mpicoll.tools.arrays` already wraps host memory as every kind of buffer
a caller may pass (NumPy, ``array.array``, ``bytearray``, ``memoryview``,
DLPack only); tests take those wrappers from here instead of writing them
again, so a kind is defined once.
"""

from __future__ import annotations

from mpicoll.tools import arrays as _arrays

# An array seen only through __dlpack__ / __dlpack_device__ (no buffer protocol); it wraps
# the array itself, so what a collective writes into it lands in the wrapped array.
DLPackOnly = _arrays._DLPackOnly


def kind(name):
    """The host buffer kind of :data:`mpicoll.tools.arrays.HOST_KINDS` called ``name``."""
    return next(k for k in _arrays.HOST_KINDS if k.name == name)
