"""The device path of the backend: tensors handed to mpicoll as device arrays, on the call's stream.

Every collective form runs on three "devices" (the ``dev`` fixture):

- ``fake-staging`` and ``fake-direct``: CPU tensors, with the backend's
  device layer (mpicoll.torch.devices) replaced by a fake one whose arrays
  are tests/support/fakegpu's device arrays over the tensors' memory.
  mpicoll then runs its real device code on the fake CUDA runtime (eager
  streams), through its pinned staging (an MPI that is not CUDA-aware) or
  directly (CUDA-aware: the fake arrays point at host memory, which MPI
  reads).  This checks, without a GPU, what the backend does with a device
  tensor: which array mpicoll and MPI get, the copies it makes on the
  device (strided views, bfloat16's float32), the copies back, AVG and
  PREMUL_SUM, the scope (the call's stream) entered where the call starts
  and where it finishes, the stream synchronised before MPI's own
  collectives take device memory.
- ``cuda``: real CUDA tensors and CuPy (skipped without both); run by the
  device check (tests/device/torch_cuda.sh).

Expected values are exact (small integers), from rank and size.
"""

from __future__ import annotations

import collections
import ctypes
import sys
import threading
import types

import numpy as np
import pytest

dist = pytest.importorskip("torch.distributed")
import torch  # noqa: E402
from support import fakegpu  # noqa: E402

import mpicoll  # noqa: E402
from mpicoll.torch import backend as _backend  # noqa: E402
from mpicoll.torch import devices as _devices  # noqa: E402
from mpicoll.torch.work import Finished  # noqa: E402

R = dist.ReduceOp
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


# -- the fake device layer ---------------------------------------------------------------------
class FakeScope:
    """A call's "stream": the fake runtime's current stream when the call was made."""

    def __init__(self, layer):
        self.layer = layer
        self.stream = layer.rt.current_stream()
        self._entered = threading.local()

    def __enter__(self):
        self.layer.log.append(("enter", threading.current_thread().name))
        using = self.layer.rt.using(self.stream)
        using.__enter__()
        self._entered.__dict__.setdefault("stack", []).append(using)
        return self

    def __exit__(self, *exc):
        self._entered.stack.pop().__exit__(None, None, None)
        return False

    def record(self):
        return self.layer.rt.record(self.stream)

    def after(self, event):
        self.layer.log.append(("after", threading.current_thread().name))

    def done(self, event):
        return self.layer.rt.done(event)

    def synchronize(self):
        self.layer.log.append(("synchronize", threading.current_thread().name))
        self.layer.rt.synchronize(self.stream)

    def future(self):
        return torch.futures.Future()


class FakeLayer:
    """mpicoll.torch.devices.CudaLayer's interface for CPU tensors: fake device arrays."""

    def __init__(self, rt, direct):
        self.rt = rt
        self.direct = direct
        self.log = []

    def array(self, t):
        return fakegpu.FakeArray(self.rt, t.detach().numpy().reshape(-1))

    def scope(self, device):
        return FakeScope(self)

    def direct_mpi(self):
        return self.direct


class Dev:
    """One "device": how its tensors are made and read, what its arrays are."""

    def __init__(self, name, layer=None):
        self.name = name
        self.layer = layer
        self.device = torch.device("cuda", torch.cuda.current_device()) if name == "cuda" \
            else torch.device("cpu")

    def tensor(self, t):
        return t.to(self.device)

    def is_array(self, x):
        if self.name == "cuda":
            return type(x).__module__.startswith("cupy")
        return isinstance(x, fakegpu.FakeArray)

    def mpi_direct(self):
        return self.layer.direct if self.layer is not None else mpicoll.cuda_aware_mpi().aware


@pytest.fixture(params=["fake-staging", "fake-direct", "cuda"])
def dev(request, groups, monkeypatch):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        pytest.importorskip("cupy")
        torch.cuda.set_device(groups.rank % torch.cuda.device_count())
        assert _devices.layer_of(torch.device("cuda")) is not None
        yield Dev("cuda")
        return
    direct = request.param == "fake-direct"
    be = fakegpu.fake_backend(compute="eager", copies="eager", slow_queries=False)
    layer = FakeLayer(be.rt, direct)
    monkeypatch.setattr(_devices, "layer_of", lambda device: layer)
    # (the short path of all_reduce is for CPU tensors, which these stand in for devices')
    monkeypatch.setattr(_backend, "_PLAIN_SUM", frozenset())
    with fakegpu.registered(be), mpicoll.options(cuda_aware=direct):
        yield Dev(request.param, layer)


@pytest.fixture
def seen(monkeypatch):
    """The arrays mpicoll's collectives and MPI's built-ins were given, by name."""
    got = {}

    def spy(name, fn):
        def call(x, *args, **kwargs):
            got.setdefault(name, []).append(x)
            return fn(x, *args, **kwargs)
        return call

    for name in ("allreduce", "iallreduce", "iallgather", "ireduce_scatter"):
        monkeypatch.setattr(_backend, name, spy(name, getattr(_backend, name)))
    real = _backend.MpicollBackend._mpi

    def mpi(self, what, start, *args, **kwargs):
        buffers = [a[0] for a in args if isinstance(a, list)]
        got.setdefault(what, []).extend(buffers)
        return real(self, what, start, *args, **kwargs)

    monkeypatch.setattr(_backend.MpicollBackend, "_mpi", mpi)
    return got


def data(rank, n, dtype, salt=0):
    """Rank ``rank``'s input: small values (exact in every dtype), different on every rank."""
    i = torch.arange(n, dtype=torch.int64)
    if dtype is torch.bool:
        return (i + rank + salt) % 3 == 0
    return ((i * 7 + rank * 5 + salt) % 5 + 1).to(dtype)


def reference(op, tensors, size):
    stack = torch.stack([t.double() if t.dtype is not torch.bool else t for t in tensors])
    dtype = tensors[0].dtype
    if dtype is torch.bool:
        return stack.any(0) if op in ("SUM", "MAX") else stack.all(0)
    out = {"SUM": lambda: stack.sum(0), "MAX": lambda: stack.max(0).values,
           "PREMUL_SUM": lambda: (stack * 2).sum(0),
           "AVG": lambda: stack.sum(0) / size if dtype.is_floating_point
           else torch.div(stack.sum(0), size, rounding_mode="trunc")}[op]()
    return out.to(dtype)


def make_op(name):
    return dist._make_nccl_premul_sum(2.0) if name == "PREMUL_SUM" else getattr(R, name)


def same(got, want):
    got = got.cpu()
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


CASES = [(torch.float32, "SUM"), (torch.float32, "AVG"), (torch.float32, "PREMUL_SUM"),
         (torch.float16, "SUM"), (torch.bfloat16, "SUM"), (torch.bfloat16, "AVG"),
         (torch.int32, "AVG"), (torch.int64, "MAX"), (torch.bool, "MAX")]


def ids(case):
    return f"{str(case[0]).replace('torch.', '')}-{case[1]}"


# -- mpicoll's collectives ---------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("async_op", [False, True])
@pytest.mark.parametrize("case", CASES, ids=ids)
def test_all_reduce(groups, dev, seen, case, async_op, layout):
    dtype, op = case
    g = groups
    base = dev.tensor(data(g.rank, 14, dtype))
    t = base[::2] if layout == "strided" else base[:7]
    work = dist.all_reduce(t, op=make_op(op), group=g.mpicoll, async_op=async_op)
    if async_op:
        work.wait()
    want = reference(op, [data(r, 14, dtype)[::2 if layout == "strided" else 1][:7]
                          for r in range(g.size)], g.size)
    same(t, want)
    if layout == "strided":  # the elements between the view's are as they were
        same(base[1::2], data(g.rank, 14, dtype)[1::2])
    arrays = seen["allreduce" if not async_op else "iallreduce"]
    assert arrays and all(dev.is_array(x) for x in arrays), arrays


@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_on_one_node_takes_the_node_path(groups, dev, async_op):
    """CUDA tensors, every rank on one node, ``intranode`` left at "auto": the node path (one
    shot for a small tensor, two shot for a large one), no byte of them through MPI, whether
    MPI is CUDA-aware or not."""
    g = groups
    if g.size < 2:
        pytest.skip("needs a node peer")
    small, large = 7, (64 << 10) // 4 + 1  # float32 elements (engine.select.DEVICE_ONESHOT_BYTES)
    with mpicoll.traffic() as seen:
        for n in (small, large):
            t = dev.tensor(data(g.rank, n, torch.float32))
            work = dist.all_reduce(t, group=g.mpicoll, async_op=async_op)
            if async_op:
                work.wait()
            same(t, reference("SUM", [data(r, n, torch.float32) for r in range(g.size)], g.size))
    got = ([c.algorithm for c in seen.calls], seen.bytes_sent)
    assert got == (["shared_oneshot", "shared_twoshot"], 0), got


def test_all_reduce_coalesced_and_reduce(groups, dev, seen):
    g = groups
    ts = [dev.tensor(data(g.rank, n, torch.float32, salt=n)) for n in (1, 5, 0)]
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = R.MAX
    g.mpicoll.allreduce_coalesced(ts, opts).wait()
    for n, t in zip((1, 5, 0), ts):
        same(t, reference("MAX", [data(r, n, torch.float32, salt=n) for r in range(g.size)],
                          g.size))
    root = g.size - 1
    t = dev.tensor(data(g.rank, 4, torch.bfloat16))
    dist.reduce(t, dst=root, group=g.mpicoll)
    same(t, reference("SUM", [data(r, 4, torch.bfloat16) for r in range(g.size)], g.size)
         if g.rank == root else data(g.rank, 4, torch.bfloat16))
    assert all(dev.is_array(x) for x in seen["iallreduce"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool], ids=str)
def test_all_gather_forms(groups, dev, seen, dtype):
    g = groups
    x = dev.tensor(data(g.rank, 3, dtype))
    want = torch.cat([data(r, 3, dtype) for r in range(g.size)])
    outs = [dev.tensor(torch.zeros(3, dtype=dtype)) for _ in range(g.size)]
    dist.all_gather(outs, x, group=g.mpicoll)
    same(torch.cat([o.cpu() for o in outs]), want)
    flat = dev.tensor(torch.zeros(3 * g.size, dtype=dtype))
    dist.all_gather_into_tensor(flat, x, group=g.mpicoll)
    same(flat, want)
    own = dev.tensor(torch.zeros(3 * g.size, dtype=dtype))  # FSDP2's form, in place
    own[3 * g.rank:3 * g.rank + 3].copy_(x)
    dist.all_gather_into_tensor(own, own[3 * g.rank:3 * g.rank + 3], group=g.mpicoll)
    same(own, want)
    uneven = [dev.tensor(torch.zeros(r % 3, dtype=dtype)) for r in range(g.size)]
    dist.all_gather(uneven, dev.tensor(data(g.rank, g.rank % 3, dtype)), group=g.mpicoll)
    for r, o in enumerate(uneven):
        same(o, data(r, r % 3, dtype))
    outs = [dev.tensor(torch.zeros(n * g.size, dtype=dtype)) for n in (2, 1)]
    ins = [dev.tensor(data(g.rank, n, dtype, salt=n)) for n in (2, 1)]
    g.mpicoll.all_gather_single_coalesced(outs, ins, None).wait()
    for n, o in zip((2, 1), outs):
        same(o, torch.cat([data(r, n, dtype, salt=n) for r in range(g.size)]))
    assert all(dev.is_array(x) for x in seen["iallgather"])


@pytest.mark.parametrize("case", [(torch.float32, "PREMUL_SUM"), (torch.bfloat16, "AVG"),
                                  (torch.int32, "MAX")], ids=ids)
def test_reduce_scatter_forms(groups, dev, seen, case):
    dtype, op = case
    g = groups
    k = 3
    x = dev.tensor(data(g.rank, k * g.size, dtype))
    before = x.clone()
    full = reference(op, [data(r, k * g.size, dtype) for r in range(g.size)], g.size)
    out = dev.tensor(torch.zeros(k, dtype=dtype))
    dist.reduce_scatter_tensor(out, x, op=make_op(op), group=g.mpicoll)
    same(out, full[g.rank * k:(g.rank + 1) * k])
    same(x, before.cpu())  # the input as it was (PREMUL_SUM scales a copy)
    counts = [(r * 3 + 1) % 4 for r in range(g.size)]
    ins = [dev.tensor(data(g.rank, c, dtype, salt=r)) for r, c in enumerate(counts)]
    out = dev.tensor(torch.zeros(counts[g.rank], dtype=dtype))
    dist.reduce_scatter(out, ins, op=make_op(op), group=g.mpicoll)
    same(out, reference(op, [data(r, counts[g.rank], dtype, salt=g.rank) for r in range(g.size)],
                        g.size))
    outs = [dev.tensor(torch.zeros(n, dtype=dtype)) for n in (2, 1)]
    ins = [dev.tensor(data(g.rank, n * g.size, dtype, salt=n)) for n in (2, 1)]
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = make_op(op)
    g.mpicoll.reduce_scatter_single_coalesced(outs, ins, opts).wait()
    for n, o in zip((2, 1), outs):
        full = reference(op, [data(r, n * g.size, dtype, salt=n) for r in range(g.size)], g.size)
        same(o, full[g.rank * n:(g.rank + 1) * n])
    assert all(dev.is_array(x) for x in seen["ireduce_scatter"])


# -- MPI's built-ins -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.bool], ids=str)
def test_builtins(groups, dev, seen, dtype):
    """broadcast, gather, scatter, all_to_all_single, all_to_all, send/recv, any source: on
    device memory where MPI is CUDA-aware (the call's stream synchronised first), else
    through host copies."""
    g = groups
    root = g.size - 1
    b = dev.tensor(data(g.rank, 5, dtype))
    dist.broadcast(b, src=root, group=g.mpicoll)
    same(b, data(root, 5, dtype))
    outs = [dev.tensor(torch.zeros(3, dtype=dtype)) for _ in range(g.size)] if g.rank == 0 \
        else None
    dist.gather(dev.tensor(data(g.rank, 3, dtype)), outs, dst=0, group=g.mpicoll)
    if g.rank == 0:
        same(torch.cat([o.cpu() for o in outs]), torch.cat([data(r, 3, dtype)
                                                            for r in range(g.size)]))
    out = dev.tensor(torch.zeros(2, dtype=dtype))
    ins = [dev.tensor(data(r, 2, dtype, salt=7)) for r in range(g.size)] if g.rank == 0 else None
    dist.scatter(out, ins, src=0, group=g.mpicoll)
    same(out, data(g.rank, 2, dtype, salt=7))
    x = dev.tensor(data(g.rank, 2 * g.size, dtype))
    y = dev.tensor(torch.zeros(2 * g.size, dtype=dtype))
    dist.all_to_all_single(y, x, group=g.mpicoll)
    same(y, torch.cat([data(r, 2 * g.size, dtype)[2 * g.rank:2 * g.rank + 2]
                       for r in range(g.size)]))
    outs = [dev.tensor(torch.zeros(g.rank + 1, dtype=dtype)) for _ in range(g.size)]
    dist.all_to_all(outs, [dev.tensor(data(g.rank, k + 1, dtype, salt=k)) for k in range(g.size)],
                    group=g.mpicoll)
    for k, o in enumerate(outs):
        same(o, data(k, g.rank + 1, dtype, salt=g.rank))
    nxt, prv = (g.rank + 1) % g.size, (g.rank - 1) % g.size
    got = dev.tensor(torch.zeros(4, dtype=dtype))
    works = [dist.isend(dev.tensor(data(g.rank, 4, dtype)), nxt, group=g.mpicoll),
             dist.irecv(got, group=g.mpicoll)]
    for w in works:
        w.wait()
    assert works[1]._source_rank() == prv
    same(got, data(prv, 4, dtype))
    buffers = [x for what in ("broadcast", "gather", "scatter", "all_to_all_single", "alltoall",
                              "send", "recv_anysource") for x in seen.get(what, [])
               if getattr(x, "size", 1)]  # (scatter off the root: an empty host array)
    assert buffers
    if dev.mpi_direct():
        assert all(dev.is_array(x) for x in buffers), buffers
        if dev.layer is not None:
            assert ("synchronize", "MainThread") in dev.layer.log
    else:
        assert all(isinstance(x, np.ndarray) for x in buffers), buffers


# -- the call's stream -----------------------------------------------------------------------
def test_the_scope_is_current_where_the_call_runs(groups, dev):
    """The call's scope is entered on the caller's thread to start it and wherever it
    finishes; wait() orders the waiting stream after it; the future completes with the
    output."""
    if dev.layer is None:
        pytest.skip("the fake layer's log")
    g = groups
    log = dev.layer.log
    t = dev.tensor(data(g.rank, 6, torch.float32))
    work = dist.all_reduce(t, op=R.AVG, group=g.mpicoll, async_op=True)
    fut = work.get_future()
    assert ("enter", "MainThread") in log
    work.wait()
    assert ("after", "MainThread") in log
    want = reference("AVG", [data(r, 6, torch.float32) for r in range(g.size)], g.size)
    same(fut.wait()[0], want)
    entered = {name for what, name in log if what == "enter"}
    assert entered <= {"MainThread", "mpicoll-progress"} | {
        n for n in entered if n.startswith("mpicoll-futures")}, entered
    assert work.is_completed() and work.is_success()


def test_tensors_on_two_devices_are_refused(groups):
    g = groups
    with pytest.raises(TypeError, match="one device"):
        g.mpicoll.allreduce_coalesced([torch.ones(1), torch.ones(1, device="meta")],
                                      dist.AllreduceCoalescedOptions())
    t = torch.ones(2)
    dist.all_reduce(t, group=g.mpicoll)
    assert t.tolist() == [float(g.size)] * 2


def test_layers_by_device(monkeypatch):
    """CPU: no layer (host arrays); a device other than CUDA, or CUDA without CuPy: none
    either (host copies), with one warning for the missing CuPy."""
    assert _devices.layer_of(torch.device("cpu")) is None
    assert _devices._make("meta") is None
    monkeypatch.setitem(__import__("sys").modules, "cupy", None)  # import cupy fails
    monkeypatch.setattr(_devices, "_warned", [])
    with pytest.warns(RuntimeWarning, match="host copies"):
        assert _devices._make("cuda") is None


def test_cuda_streams(groups, dev):
    """Real CUDA only: the input is written by a kernel still queued on a side stream when
    the collective starts there (mpicoll orders its messages after it); the result is used
    on another stream after wait() (ordered after the call's stream), and through the
    future."""
    if dev.name != "cuda":
        pytest.skip("torch CUDA streams")
    g = groups
    side = torch.cuda.Stream()
    want = torch.full((1 << 20,), float(sum(2 * (r + 1) for r in range(g.size))))
    with torch.cuda.stream(side):
        x = torch.full((1 << 20,), float(g.rank + 1), device=dev.device)
        torch.cuda._sleep(50_000_000)  # a long kernel: the next one runs well after the call
        x.mul_(2)
        y = torch.full((1 << 20,), float(g.rank + 1), device=dev.device)
        torch.cuda._sleep(50_000_000)
        y.mul_(2)
        work = dist.all_reduce(x, async_op=True, group=g.mpicoll)
        fut = dist.all_reduce(y, async_op=True, group=g.mpicoll).get_future()
    work.wait()  # on the default stream: ordered after the side stream's call
    same(x * 1, want)
    assert fut.wait()[0] is y
    same(fut.wait()[0] * 1, want)


# -- the CUDA layer's cost per call --------------------------------------------------------------
class StandInCupy(types.ModuleType):
    """The part of CuPy mpicoll.torch.devices.CudaLayer uses, its arrays the fake GPU's over
    the (CPU) tensors' memory; ``made`` counts the objects it makes, ``entered`` the
    contexts entered."""

    def __init__(self, rt):
        super().__init__("cupy")
        self.rt = rt
        self.made = collections.Counter()
        self.entered = 0
        fake = self

        class Context:
            def __init__(self, *args):
                fake.made[type(self).__name__] += 1

            def __enter__(self):
                fake.entered += 1
                return self

            def __exit__(self, *exc):
                return False

        class ExternalStream(Context):
            pass

        class Device(Context):
            pass

        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id):
                self.ptr, self.size = ptr, size

        class MemoryPointer:
            def __init__(self, mem, offset):
                self.ptr = mem.ptr + offset

        # (the tensors' device is the CPU, whose index is None: the current one here)
        runtime = types.SimpleNamespace(getDevice=lambda: None)
        self.cuda = types.SimpleNamespace(ExternalStream=ExternalStream, Device=Device,
                                          UnownedMemory=UnownedMemory,
                                          MemoryPointer=MemoryPointer, runtime=runtime)

    def ndarray(self, shape, dtype, memptr):
        self.made["ndarray"] += 1
        dtype = np.dtype(dtype)
        n = int(np.prod(shape))
        memory = (ctypes.c_char * (n * dtype.itemsize)).from_address(memptr.ptr)
        return fakegpu.FakeArray(self.rt, np.frombuffer(memory, dtype))

    def from_dlpack(self, t):
        self.made["from_dlpack"] += 1
        return fakegpu.FakeArray(self.rt, t.numpy().reshape(-1))


class StandInTorchCuda:
    """torch.cuda's streams and events as CudaLayer and its Scope use them, counted."""

    def __init__(self, cupy):
        self.cupy = cupy
        self.stream = types.SimpleNamespace(cuda_stream=1, synchronize=lambda: None,
                                            wait_event=lambda event: None)
        fake = self

        self.pending = False  # events recorded from now on: not complete

        class Event:
            def __init__(self):
                cupy.made["Event"] += 1
                self.complete = True

            def record(self, stream):
                self.complete = not fake.pending

            def query(self):
                return self.complete

        class StreamContext:
            def __init__(self, stream):
                cupy.made["torch.cuda.stream"] += 1

            def __enter__(self):
                cupy.entered += 1

            def __exit__(self, *exc):
                return False

        self.Event, self.StreamContext = Event, StreamContext
        self.current_stream = lambda device=None: fake.stream


def test_a_repeated_call_makes_nothing_and_enters_one_context(groups, monkeypatch):
    """The CUDA layer (mpicoll.torch.devices, on a stand-in CuPy and torch.cuda over the fake
    GPU): a blocking all_reduce repeated on the same tensor makes no CuPy array (no DLPack
    exchange), no CuPy stream object and no torch event, and enters one context (CuPy's
    stream: torch's and the device are the call's already); the first call makes the
    array, the stream object and the event."""
    g = groups
    be = fakegpu.fake_backend(compute="eager", copies="eager", slow_queries=False)
    cupy = StandInCupy(be.rt)
    cuda = StandInTorchCuda(cupy)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", cuda.StreamContext)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    layer = _devices.CudaLayer()
    monkeypatch.setattr(_devices, "layer_of", lambda device: layer)
    monkeypatch.setattr(_backend, "_PLAIN_SUM", frozenset())
    t = torch.zeros(1000)
    per_call = []
    with fakegpu.registered(be), mpicoll.options(cuda_aware=False):
        for k in range(4):
            t.fill_(g.rank + k)
            made, entered = dict(cupy.made), cupy.entered
            dist.all_reduce(t, group=g.mpicoll)
            assert torch.equal(t, torch.full((1000,), float(sum(r + k for r in range(g.size)))))
            per_call.append(({n: c - made.get(n, 0) for n, c in cupy.made.items()
                              if c - made.get(n, 0)}, cupy.entered - entered))
    assert per_call[0] == ({"ndarray": 1, "ExternalStream": 1, "Event": 1}, 1), per_call
    assert per_call[1:] == [({}, 1)] * 3, per_call


def test_the_scope_makes_the_calls_stream_and_device_current_where_they_are_not(monkeypatch):
    """Where the call's stream is not torch's current one (another thread, a caller that
    switched streams since) or CuPy's current device is another, entering the scope makes
    them current too."""
    be = fakegpu.fake_backend()
    cupy = StandInCupy(be.rt)
    cuda = StandInTorchCuda(cupy)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", cuda.StreamContext)
    layer = _devices.CudaLayer()
    device = torch.device("cpu")
    scope = layer.scope(device)
    with scope:
        pass
    assert (dict(cupy.made), cupy.entered) == ({"ExternalStream": 1}, 1)
    assert layer.scope(device)._cupy_stream is scope._cupy_stream  # (one per stream)
    cuda.stream = types.SimpleNamespace(cuda_stream=2)  # torch's current stream: another
    cupy.cuda.runtime.getDevice = lambda: 7             # CuPy's current device: another
    with scope:
        with scope:  # (a future's callback inside the scope, say)
            pass
    assert (dict(cupy.made), cupy.entered) == (
        {"ExternalStream": 1, "torch.cuda.stream": 2, "Device": 2}, 7)


def test_a_complete_work_stays_complete_when_its_event_is_reused(monkeypatch):
    """The layer records an event again once it is complete (for a later call): a Work that
    saw its event complete stays complete, and waits for nothing of the later call's."""
    be = fakegpu.fake_backend()
    cupy = StandInCupy(be.rt)
    cuda = StandInTorchCuda(cupy)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    waited = []
    monkeypatch.setattr(cuda.stream, "wait_event", waited.append)
    scope = _devices.CudaLayer().scope(torch.device("cpu"))
    first = Finished(None, scope)
    assert first.is_completed()
    cuda.pending = True
    second = Finished(None, scope)
    assert second._event is not None and cupy.made["Event"] == 1  # (the first's, reused)
    assert first.is_completed() and not second.is_completed()
    first.wait()
    assert waited == []
