"""``benchmarks/torch_bench.py``: its table, every variant timed (interleaved).  (The DDP
step's model takes seconds to build: not run here.)"""

from __future__ import annotations

import pytest
from support import util

dist = pytest.importorskip("torch.distributed")

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.timeout(120)]


def test_bench_prints_a_row_per_size(capsys):
    from mpi4py import MPI

    bench = util.benchmark("torch_bench")
    assert not dist.is_initialized()  # (main() makes and ends its own default group)
    assert bench.main(["--sizes", "16,4K", "-n", "2", "-w", "1", "--ddp-steps", "0"]) == 0
    assert not dist.is_initialized()
    if MPI.COMM_WORLD.rank == 0:
        out = capsys.readouterr().out
        rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
        assert [r[0] + " " + r[1] for r in rows] == ["16 B", "4 KiB"], out
        # gloo, the backend, mpicoll, torch's floor: four times and three ratios per row,
        # all positive (the backend's time includes the floor's)
        assert all(len(r) == 13 for r in rows), out
        assert all(float(v) > 0 for r in rows for v in (r[2], r[4], r[6], r[8], r[10], r[11])), out


def test_bench_json_records(tmp_path):
    """``--json``: one record per size on rank 0, the backend's time over gloo's beside the times."""
    import json

    from mpi4py import MPI

    bench = util.benchmark("torch_bench")
    comm = MPI.COMM_WORLD
    path = comm.bcast(str(tmp_path / "bench.json"), root=0)
    assert bench.main(["--sizes", "4K", "-n", "2", "-w", "1", "--ddp-steps", "0",
                       "--json", path]) == 0
    if comm.rank == 0:
        with open(path) as f:
            records = json.load(f)
        assert [(r["collective"], r["bytes"], r["nranks"], r["device"]) for r in records] == \
            [("allreduce", 4096, comm.size, "cpu")]
        r = records[0]
        assert r["time_us"] > 0 and r["gloo_time_us"] > 0
        assert r["gloo_ratio"] == pytest.approx(r["time_us"] / r["gloo_time_us"])
        # the algorithm the backend's call ran: the host table's at 4 KiB
        assert r["selected"] == "recursive_doubling", r
    comm.Barrier()


def test_bench_cuda_without_a_gpu_says_so():
    import torch

    bench = util.benchmark("torch_bench")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench.main(["--device", "cuda", "--sizes", "16", "--ddp-steps", "0"])


@pytest.mark.parametrize("argv, message", [
    (["--json", "/nonexistent-mpicoll-dir/x.json"],
     "--json: cannot write /nonexistent-mpicoll-dir/x.json: no directory"),
    (["--timeout", "-1"], "argument --timeout: expected a number of seconds >= 0, got '-1'"),
    (["--timeout", "nan"], "argument --timeout: expected a number of seconds >= 0, got 'nan'"),
], ids=["json in a missing folder", "timeout -1", "timeout nan"])
def test_bad_arguments_are_refused_before_the_run(argv, message, capsys):
    """Refused before any group is made or anything is timed: exit status 2 on every rank,
    one line on rank 0 (a small run: a bench that took the argument would end quickly)."""
    from mpi4py import MPI

    bench = util.benchmark("torch_bench")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--sizes", "16", "-n", "1", "-w", "0", "--ddp-steps", "0", *argv])
    assert exc.value.code == 2 and not dist.is_initialized()
    err = capsys.readouterr().err
    if MPI.COMM_WORLD.rank == 0:
        assert message in err.splitlines()[-1] and "Traceback" not in err, err
    else:
        assert err == "", err
