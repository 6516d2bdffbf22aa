"""Which backend owns an array: NumPy's, or a device backend registered here.

The API asks :func:`backend_of` for every buffer argument.  A NumPy array (or
any host buffer) is NumPy's (backends.host); a device array goes to the first
registered device backend that claims it.  The CuPy backend
(backends.devices) is registered the first time a device array arrives, so
importing mpicoll never imports CuPy; tests register a fake one first
(:func:`register` with ``first=True``).
"""

from __future__ import annotations

import numpy as np

from .host import NUMPY, is_device_object

# Device backends, tried in order by backend_of(); each has ``claims(obj) -> bool`` and
# ``asarray(obj)``.
_DEVICE_BACKENDS: list = []


def register(backend, *, first: bool = False) -> None:
    """Make a device backend known to :func:`backend_of`."""
    if backend not in _DEVICE_BACKENDS:
        if first:
            _DEVICE_BACKENDS.insert(0, backend)
        else:
            _DEVICE_BACKENDS.append(backend)


def unregister(backend) -> None:
    if backend in _DEVICE_BACKENDS:
        _DEVICE_BACKENDS.remove(backend)


def backend_of(obj):
    """The backend that owns ``obj``, or None if no backend recognises it."""
    if isinstance(obj, np.ndarray):
        return NUMPY
    for backend in _DEVICE_BACKENDS:
        if backend.claims(obj):
            return backend
    if is_device_object(obj):
        try:
            from . import devices
        except ImportError:
            return None
        register(devices.CUPY)
        for backend in _DEVICE_BACKENDS:
            if backend.claims(obj):
                return backend
        return None
    return NUMPY
