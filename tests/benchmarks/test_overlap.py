"""benchmarks/overlap.py: the overlap formula, and every mode run and checked on the host and
on the fake GPU.  No timing is asserted (this machine is shared).
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from mpi4py import MPI
from support import util

overlap = util.benchmark("overlap")

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()


def test_overlap_formula():
    assert overlap.overlap(10.0, 10.0, 10.0) == 1.0    # the shorter hidden completely
    assert overlap.overlap(10.0, 4.0, 14.0) == 0.0     # one after the other
    assert overlap.overlap(10.0, 4.0, 12.0) == 0.5
    assert overlap.overlap(10.0, 4.0, 16.0) == -0.5    # together slower than in sequence


def test_overlap_tool_runs_and_checks(capsys):
    rc = overlap.main(["--size", "64K", "--reps", "1", "--warmup", "0", "--matrix", "16"])
    out = capsys.readouterr().out
    ok = rc == 0 and (RANK != 0 or ("wrong elements over all ranks and runs: 0" in out
                                    and all(m in out for m in overlap.MODES)))
    util.assert_all(WORLD, ok, f"rc={rc}\n{out}")


class _FakeCupy:
    """The part of CuPy the overlap tool's GPU mode uses, over the fake GPU
    (tests/support/fakegpu.py): arrays, streams as context managers, matmul, fill."""

    def __init__(self, rt):
        import types

        from support import fakegpu

        class Array(fakegpu.FakeArray):  # (a subclass: the fake backend still claims it)
            def fill(self, value):
                h = self._h
                rt.launch(lambda: h.fill(value), "kernel fill")

        class Stream:
            def __init__(self, non_blocking=False):
                self.stream = rt.new_stream()

            def __enter__(self):
                self._using = rt.using(self.stream)
                return self._using.__enter__()

            def __exit__(self, *exc):
                return self._using.__exit__(*exc)

            def synchronize(self):
                rt.synchronize(self.stream)

        self.rt, self.Array = rt, Array
        self.cuda = types.SimpleNamespace(Stream=Stream, get_current_stream=rt.current_stream)

    def asarray(self, host):
        return self.Array(self.rt, np.array(host, copy=True), owndata=True)

    def empty(self, shape, dtype):
        return self.Array(self.rt, self.rt.xp.empty(shape, dtype)._h, owndata=True)

    def asnumpy(self, a):
        return self.rt.to_host(a)

    def matmul(self, a, b, out):
        ah, bh, oh = a._h, b._h, out._h
        self.rt.launch(lambda: np.matmul(ah, bh, out=oh), "kernel matmul")


@pytest.mark.timeout(120)
@pytest.mark.ranks(1, 2)  # the tool's modes do not depend on the rank count beyond 2
def test_overlap_gpu_mode_on_the_fake_gpu():
    """``overlap --device gpu``: the AllReduce on device arrays beside products queued on a
    stream of their own, every mode timed and its result checked (on the fake GPU, whose
    queued work runs only when something waits for it: a missing wait shows as wrong data)."""
    from support import fakegpu

    backend = fakegpu.fake_backend(compute="lazy", copies="lazy")
    out = io.StringIO()
    with fakegpu.registered(backend):
        status = overlap.main(["--device", "gpu", "--size", "64K", "--reps", "2", "--warmup", "1",
                               "--matrix", "8", "--dtype", "float32"], out=out,
                              cupy=_FakeCupy(backend.rt))
    assert status == 0, out.getvalue()
    if WORLD.rank == 0:
        text = out.getvalue()
        assert "device gpu" in text and "CuPy float32, on their own stream" in text, text
        assert "wrong elements over all ranks and runs: 0" in text, text
        assert all(f" {mode} " in text for mode in overlap.MODES)
    # the products went to their own stream, the AllReduce's work to the current one
    queued = [e for e in backend.rt.log if e[0] == "queue"]
    assert any(e[1] != "compute" and e[2] == "kernel matmul" for e in queued)
    assert not any(e[1] == "compute" and e[2] == "kernel matmul" for e in queued)
