"""Device check, preflight: CuPy works on this GPU (float16 add, a compiled kernel, pinned
memory, memcpyAsync).  Prints one line per check; exit 1 at the first failure, with why.

    python tests/device/preflight.py
"""

from __future__ import annotations

import sys
import time


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
    sys.exit(main())
