"""The compiled hit (engine/_hit.c, engine.native): built, used, and the same as Python's.

tests/engine/test_plans.py runs every rule of a hit both ways (compiled and in
Python); here: that the compiled one is really what a repeat runs where it
can be built, that it hands every case it cannot prove to the Python repeat
(an operation in flight, options changed, an equal but not identical
argument), and that a build which cannot be used says why instead of failing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
from mpi4py import MPI

import mpicoll
from mpicoll.engine import cache as _cache
from mpicoll.engine import context as _context
from mpicoll.engine import native as _native

WORLD = MPI.COMM_WORLD
pytestmark = pytest.mark.ranks(1, 2, 3)  # 1: a copy; 2: one exchange; 3: the fold


def _module():
    """The compiled hit module; skip where no mpicc exists, fail where it exists and the
    module is not used (a build that should work and does not is a defect)."""
    if not _native.find_mpicc():
        pytest.skip("no mpicc: the hit stays in Python (engine.native)")
    mod = _native.load()
    used, why = _native.status()
    assert mod is not None and used, why
    return mod


def _want(x):
    want = np.empty_like(x)
    WORLD.Allreduce(x, want)
    return want


@pytest.mark.timeout(60)
def test_a_repeat_runs_compiled_and_right():
    """After the first call (the general path, which keeps the plan), every repeat of the
    same call runs in C: the module's hit count grows by one per call; results equal the
    built-in's, for the Comm and the array forms, with and without a timeout."""
    mod = _module()
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        x = np.arange(10.0) * 3 + WORLD.rank
        y, z, t = np.empty(10), np.empty(10), np.empty(10)
        mc.Allreduce(x, y)
        mpicoll.allreduce(x, comm=comm, out=z)
        mpicoll.allreduce(x, comm=comm, out=t, timeout=30)  # a timed plan: its waits poll
        assert _cache.latest(_context.context(comm), "Comm.Allreduce").hit is not None
        before = mod.hits()
        for step in range(5):
            x += step
            mc.Allreduce(x, y)
            np.testing.assert_array_equal(y, _want(x))
            mpicoll.allreduce(x, comm=comm, out=z)
            np.testing.assert_array_equal(z, _want(x))
        for step in range(5):
            x += step
            mpicoll.allreduce(x, comm=comm, out=t, timeout=30)
            np.testing.assert_array_equal(t, _want(x))
        # 5 + 4 + 4: the first allreduce with out=z after one with out=t (and back) is not
        # its function's last plan; Python finds it by its arrays, proves the hit and runs
        # it compiled (Hit.go, not counted), and it is the last plan from then on
        assert mod.hits() - before == 13
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_what_it_cannot_prove_goes_to_python():
    """An operation in flight, an equal but not identical op argument and a changed
    option epoch are each handed to the Python repeat, which runs the hit (or the
    general path): no compiled hit is counted for them, and results stay right."""
    mod = _module()
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        x = np.arange(6.0) + WORLD.rank
        y = np.empty(6)
        mc.Allreduce(x, y)
        slow = []
        python_repeat = _cache._repeat
        mod.setup(_cache._LAST, lambda *a: slow.append(a[1]) or python_repeat(*a),
                  _cache._failed, _cache.IN_FLIGHT, _cache.EPOCH, MPI.IN_PLACE, np.ndarray,
                  MPI.Exception)
        try:
            before = mod.hits()
            h = mc.Iallreduce(x, np.empty(6))  # in flight during the blocking repeat
            in_flight = bool(_cache.IN_FLIGHT)  # (one rank: it ended as it started)
            mc.Allreduce(x, y)
            h.Wait()
            np.testing.assert_array_equal(y, _want(x))
            assert slow == ["Comm.Allreduce"] * in_flight
            assert mod.hits() == before + (not in_flight)
            slow.clear()
            z = np.empty(6)
            mpicoll.allreduce(x, comm=comm, out=z, algorithm="auto")  # (its plan: made)
            slow.clear()
            before = mod.hits()
            same = "".join(["au", "to"])  # equal to the plan's "auto", another object
            assert same == "auto" and same is not "auto"  # noqa: F632 (the point of the test)
            z[...] = 0
            mpicoll.allreduce(x, comm=comm, out=z, algorithm=same)
            np.testing.assert_array_equal(z, _want(x))
            assert slow == ["allreduce"] and mod.hits() == before
            slow.clear()
            with mpicoll.options(timeout=None):  # (an epoch bump: no option changes)
                mc.Allreduce(x, y)
                assert slow == ["Comm.Allreduce"] and mod.hits() == before
                mc.Allreduce(x, y)  # the plan holds for the new epoch: compiled again
                assert len(slow) == 1 and mod.hits() == before + 1
            np.testing.assert_array_equal(y, _want(x))
        finally:
            mod.setup(_cache._LAST, python_repeat, _cache._failed, _cache.IN_FLIGHT,
                      _cache.EPOCH, MPI.IN_PLACE, np.ndarray, MPI.Exception)
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_native_off_makes_plans_without_it():
    """``native=False`` (MPICOLL_NATIVE=0): a plan made under it has no compiled hit, a
    plan made before it is re-made at its next call; switching back compiles again."""
    mod = _module()
    comm = WORLD.Dup()
    try:
        mc = mpicoll.Comm(comm)
        ctx = _context.context(comm)
        x = np.arange(5.0) + WORLD.rank
        y = np.empty(5)
        mc.Allreduce(x, y)
        compiled = _cache.latest(ctx, "Comm.Allreduce")
        assert compiled.hit is not None
        with mpicoll.options(native=False):
            before = mod.hits()
            for _ in range(3):
                mc.Allreduce(x, y)
            plan = _cache.latest(ctx, "Comm.Allreduce")
            assert plan is not compiled and plan.hit is None and not compiled.live
            assert mod.hits() == before and compiled.hit.live == 0
            np.testing.assert_array_equal(y, _want(x))
        mc.Allreduce(x, y)
        assert _cache.latest(ctx, "Comm.Allreduce").hit is not None
    finally:
        comm.Free()


@pytest.mark.timeout(60)
def test_two_threads_on_two_communicators_complete_compiled():
    """The compiled hit releases the interpreter while MPI waits, as mpi4py does: two
    threads repeating calls on two communicators in opposite orders on the two ranks
    complete (MPI_THREAD_MULTIPLE), every result right."""
    _module()
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        pytest.skip("needs MPI_THREAD_MULTIPLE")
    comms = [WORLD.Dup(), WORLD.Dup()]
    errors = []

    def work(comm):
        try:
            mc = mpicoll.Comm(comm)
            x = np.arange(4.0) + WORLD.rank
            y = np.empty(4)
            want = np.full(4, 0.0)
            for r in range(WORLD.size):
                want += np.arange(4.0) + r
            for _ in range(200):
                mc.Allreduce(x, y)
                if not np.array_equal(y, want):
                    errors.append(y.copy())
        except BaseException as exc:  # (reported below, in the main thread)
            errors.append(exc)

    order = comms if WORLD.rank % 2 == 0 else comms[::-1]
    threads = [threading.Thread(target=work, args=(c,)) for c in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    try:
        assert not any(t.is_alive() for t in threads), "a thread did not finish"
        assert not errors, errors[:3]
    finally:
        for c in comms:
            c.Free()


# --- a build that cannot be used says why ------------------------------------------

def _script(tmp_path, name, body):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


@pytest.mark.local
def test_a_wrapper_that_links_another_mpi_is_not_used(tmp_path):
    """An mpicc whose libraries are not the libmpi this process loaded (another MPI) is
    never built with: the reason names both."""
    cc = _script(tmp_path, "mpicc", 'echo "cc -I/elsewhere/include -L/elsewhere/lib -lmpi"\n')
    with pytest.raises(_native._NotUsed, match="does not link the loaded"):
        _native._build_and_load(cc, str(tmp_path))


@pytest.mark.local
def test_a_failed_build_is_remembered_and_says_where(tmp_path):
    """A wrapper that links the right library but cannot compile: the build fails once,
    its log is kept, and the next process does not try again until the log is removed."""
    libdir = os.path.dirname(_native._loaded_libmpi())
    if not libdir:
        pytest.skip("no /proc/self/maps")
    cc = _script(tmp_path, "mpicc", f'case "$1" in -show*) echo "cc -L{libdir} -lmpi";; '
                                    '*) echo "no compiler here" >&2; exit 1;; esac\n')
    with pytest.raises(_native._NotUsed, match="the build failed") as first:
        _native._build_and_load(cc, str(tmp_path))
    logs = list((tmp_path / "mpicoll" / "native").glob("*.failed"))
    assert len(logs) == 1 and "no compiler here" in logs[0].read_text()
    assert str(logs[0]) in str(first.value)
    with pytest.raises(_native._NotUsed, match="failed before"):
        _native._build_and_load(cc, str(tmp_path))


@pytest.mark.local
def test_no_wrapper_is_reported():
    with pytest.raises(_native._NotUsed, match="no mpicc found"):
        _native._build_and_load("/nonexistent/mpicc", None)


@pytest.mark.local
def test_an_unwritable_cache_directory_leaves_the_hit_in_python(tmp_path, monkeypatch):
    """A cache directory that cannot be written (a read-only home on a cluster) is a
    reason, not an error: the load answers None and says why."""
    if not _native.find_mpicc():
        pytest.skip("no mpicc")
    blocked = tmp_path / "file"
    blocked.write_text("")  # (a file where the directory would be)
    monkeypatch.setattr(_native, "_STATE", {})
    assert _native.load(None, str(blocked)) is None
    used, why = _native.status()
    assert not used and "cannot create" in why


# --- what it loads: only a file this user alone could have written ------------------

OTHER_UID = 12345  # another local user (no account needed: files are chowned to it)


def _as_other(path, mode):
    os.chown(path, OTHER_UID, OTHER_UID)
    os.chmod(path, mode)


def _planted(tmp_path, cache, name):
    """A shared object at ``cache/mpicoll/native/name`` whose constructor, if it is ever
    loaded, writes a marker file; (its path, the marker's path)."""
    marker = tmp_path / "constructor-ran"
    src = tmp_path / "planted.c"
    src.write_text("#include <stdio.h>\n__attribute__((constructor)) static void planted(void)"
                   f' {{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    so = cache / "mpicoll" / "native" / name
    so.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    return so, marker


def _hit_name(tmp_path):
    """The file name the compiled repeat gets here (built once in a private folder)."""
    cc = _native.find_mpicc()
    if not cc or shutil.which("cc") is None:
        pytest.skip("no mpicc or cc")
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    _, path = _native._build_and_load(cc, str(mine))
    return cc, os.path.basename(path)


@pytest.mark.local
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files owned by another user")
def test_a_module_another_user_planted_is_never_loaded(tmp_path):
    """A cache folder another user made (mode 0777: XDG_CACHE_HOME on a shared or group
    folder) holding a shared object under the predictable name: refused with the reason,
    never loaded (its constructor would run as this user)."""
    cc, name = _hit_name(tmp_path)
    shared = tmp_path / "shared"
    shared.mkdir()
    so, marker = _planted(tmp_path, shared, name)
    for path in (shared, shared / "mpicoll", shared / "mpicoll" / "native"):
        _as_other(path, 0o777)
    _as_other(so, 0o755)
    with pytest.raises(_native._NotUsed, match="not private.*owned by uid 12345"):
        _native._build_and_load(cc, str(shared))
    assert not marker.exists()


@pytest.mark.local
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files owned by another user")
def test_a_module_in_a_private_folder_owned_by_another_user_is_not_loaded(tmp_path):
    """The folder is this user's and private, but the file in it is another user's (or
    writable by others, or a link): not loaded, and a link is never followed."""
    cc, name = _hit_name(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    so, marker = _planted(tmp_path, cache, name)
    for path in (cache / "mpicoll", cache / "mpicoll" / "native"):
        os.chmod(path, 0o700)
    _as_other(so, 0o755)
    with pytest.raises(_native._NotUsed, match="owned by uid 12345"):
        _native._build_and_load(cc, str(cache))
    os.chown(so, 0, 0)
    os.chmod(so, 0o777)
    with pytest.raises(_native._NotUsed, match="writable by group or others"):
        _native._build_and_load(cc, str(cache))
    target = tmp_path / "victim-file"
    target.write_text("precious")
    so.unlink()
    so.symlink_to(target)
    with pytest.raises(_native._NotUsed, match="not a regular file"):
        _native._build_and_load(cc, str(cache))
    assert not marker.exists() and target.read_text() == "precious"


@pytest.mark.local
def test_a_failed_build_writes_its_log_through_no_planted_name(tmp_path):
    """The build and its log are written in a private scratch folder with an unpredictable
    name and renamed into place: a link or a folder planted at the names the build used
    (``<file>.<pid>.tmp``, ``<file>.failed.<pid>``) is neither followed nor in the way."""
    libdir = os.path.dirname(_native._loaded_libmpi())
    if not libdir:
        pytest.skip("no /proc/self/maps")
    cc = _script(tmp_path, "mpicc", f'case "$1" in -show*) echo "cc -L{libdir} -lmpi";; '
                                    '*) echo "no compiler here" >&2; exit 1;; esac\n')
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    folder = cache / "mpicoll" / "native"
    folder.mkdir(parents=True, mode=0o700)
    os.chmod(folder.parent, 0o700)
    target = tmp_path / "victim-file"
    target.write_text("precious")
    with pytest.raises(_native._NotUsed, match="the build failed") as failed:
        _native._build_and_load(cc, str(cache))
    path = str(failed.value.path)
    log = folder / (os.path.basename(path) + ".failed")
    log.unlink()
    os.mkdir(f"{path}.{os.getpid()}.tmp")
    os.symlink(target, f"{path}.failed.{os.getpid()}")
    with pytest.raises(_native._NotUsed, match="the build failed"):
        _native._build_and_load(cc, str(cache))
    assert target.read_text() == "precious"
    assert "no compiler here" in log.read_text() and not log.is_symlink()
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]  # (scratch gone)


@pytest.mark.local
def test_a_relative_cache_home_is_ignored():
    """XDG_CACHE_HOME counts only as an absolute path (the XDG rule): a relative one would
    name a folder under each job's working directory."""
    from mpicoll.core import config

    home = os.path.expanduser("~/.cache")
    assert config.read_environment({"XDG_CACHE_HOME": "relative/cache"})["cache_dir"] == home
    assert config.read_environment({"XDG_CACHE_HOME": "/abs/cache"})["cache_dir"] == "/abs/cache"
    config.read_environment()
