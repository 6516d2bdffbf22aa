"""Device check, preflight: CuPy works on this GPU (float16 add, a compiled kernel, pinned
memory, memcpyAsync).  Prints one line per check; exit 1 at the first failure, with why.

    python tests/device/preflight.py            # the image's Python: CuPy alone
    python tests/device/preflight.py --warm     # an environment with mpicoll's MPI

``--warm`` fills CuPy's kernel cache (on disk, shared by this user's processes) with
every kernel the checks launch: each reduction ufunc on each dtype it applies to
(mpicoll.core.types' tables, the dtypes the device backend supports), the copies
and casts between them, the test suite's producer kernel.  CuPy compiles a kernel
at its first use; without this every rank of the first lines compiles the same
kernels at once, inside their time limits.  Compiled on threads (NVRTC releases
the GIL); importing mpicoll initialises MPI (a singleton), so no process is
started.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def warm() -> int:
    """Compile every kernel the checks launch into CuPy's cache; exit status (1: a failure)."""
    import cupy
    import numpy as np

    sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]
    from support import gpucases

    from mpicoll.backends import devices
    from mpicoll.core import types

    dtypes = [np.dtype(t) for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
                                    "uint32", "uint64", "float16", "float32", "float64",
                                    "complex64", "complex128")
              if devices.CUPY.supports(t)]
    jobs = []
    for dt in dtypes:
        category = types.category_of_dtype(dt)
        for name, ufunc in types.NUMPY_UFUNCS.items():
            if category in types.OP_CATEGORIES[name]:
                f = getattr(cupy, ufunc.__name__)
                jobs.append((f"{name} {dt}", lambda f=f, dt=dt: f(
                    cupy.ones(4, dt), cupy.ones(4, dt), out=cupy.empty(4, dt))))
        jobs.append((f"copy {dt}", lambda dt=dt: cupy.copyto(cupy.empty(4, dt), cupy.ones(4, dt))))
        jobs.append((f"fill {dt}", lambda dt=dt: cupy.empty(4, dt).fill(0)))
    for a, b in (("float16", "float32"), ("float32", "float16"), ("float32", "float64"),
                 ("float64", "float32")):  # (the float16 policies' widening and rounding copies)
        jobs.append((f"cast {a}->{b}", lambda a=a, b=b: cupy.copyto(cupy.empty(4, b), cupy.ones(4, a),
                                                                    casting="unsafe")))
    jobs.append(("the tests' producer kernel", lambda: cupy.RawKernel(
        gpucases.LATE_COPY_SRC, "late_copy").compile()))
    t0 = time.perf_counter()
    failed = []

    def run(job):
        what, fn = job
        try:
            fn()
        except Exception as exc:
            failed.append(f"{what}: {type(exc).__name__}: {exc}")

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 4)) as pool:
        list(pool.map(run, jobs))
    cupy.cuda.get_current_stream().synchronize()
    print(f"preflight: {'FAILED' if failed else 'ok  '} kernel cache: {len(jobs) - len(failed)} of "
          f"{len(jobs)} kernels compiled or found in {time.perf_counter() - t0:.1f} s "
          f"({os.environ.get('CUPY_CACHE_DIR', '~/.cupy/kernel_cache')})")
    for line in failed[:5]:
        print(f"preflight:      {line}")
    return 1 if failed else 0


def main() -> int:
    try:
        import cupy
        import numpy as np
    except Exception as exc:
        print(f"preflight: FAILED: CuPy cannot be imported ({type(exc).__name__}: {exc})")
        return 1
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        count, why = 0, f"{type(exc).__name__}: {exc}"
    else:
        why = "getDeviceCount() == 0"
    if count == 0:
        print(f"preflight: FAILED: no GPU visible to CuPy ({why})")
        return 1
    checks = []

    def check(name, fn):
        t0 = time.perf_counter()
        try:
            detail = fn()
        except Exception as exc:
            print(f"preflight: FAILED: {name}: {type(exc).__name__}: {exc}")
            return False
        checks.append(name)
        print(f"preflight: ok   {name} ({(time.perf_counter() - t0) * 1e3:.0f} ms){': ' + detail if detail else ''}")
        return True

    def f16():
        a = cupy.arange(1024, dtype=cupy.float16)
        b = a + a
        assert np.array_equal(cupy.asnumpy(b), (np.arange(1024, dtype=np.float16) * 2)), "wrong sum"

    def kernel():
        k = cupy.RawKernel(r'''extern "C" __global__ void twice(const float* x, float* y, int n) {
            int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = 2.0f * x[i]; }''', "twice")
        x = cupy.arange(4096, dtype=cupy.float32)
        y = cupy.empty_like(x)
        k((16,), (256,), (x, y, np.int32(4096)))
        assert np.array_equal(cupy.asnumpy(y), 2 * np.arange(4096, dtype=np.float32)), "wrong result"
        return f"compute capability {cupy.cuda.Device().compute_capability}"

    def pinned_memcpy():
        import cupyx
        n = 1 << 24
        host = cupyx.empty_pinned(n, dtype=np.uint8)
        host[:] = np.arange(n, dtype=np.uint64).astype(np.uint8)
        dev = cupy.empty(n, dtype=cupy.uint8)
        back = cupyx.empty_pinned(n, dtype=np.uint8)
        rt = cupy.cuda.runtime
        s = cupy.cuda.Stream(non_blocking=True)
        rt.memcpyAsync(dev.data.ptr, host.ctypes.data, n, rt.memcpyHostToDevice, s.ptr)
        rt.memcpyAsync(back.ctypes.data, dev.data.ptr, n, rt.memcpyDeviceToHost, s.ptr)
        s.synchronize()
        assert np.array_equal(host, back), "round trip changed the data"
        return "16 MiB pinned host -> device -> host on a non-blocking stream"

    ok = (check("float16 add", f16) and check("compiled kernel (RawKernel)", kernel)
          and check("pinned allocation + memcpyAsync", pinned_memcpy))
    if not ok:
        return 1
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    print(f"preflight: CuPy {cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, "
          f"driver {cupy.cuda.runtime.driverGetVersion()}, {count} GPU(s): "
          f"{name.decode() if isinstance(name, bytes) else name}")
    return 0


if __name__ == "__main__":
    sys.exit(warm() if sys.argv[1:] == ["--warm"] else main())
