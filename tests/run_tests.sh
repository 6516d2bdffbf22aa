#!/usr/bin/env bash
# Run mpicoll's whole test suite with the python and MPI launcher on PATH.
#
#   bash tests/run_tests.sh [--mpi openmpi|mpich] [--matrix NAME] [--quick] [--collect DIR]
#
# The runs are the rows of tests/matrix.sh for the MPI library found (or --matrix NAME:
# `--matrix openmpi` is the full matrix, every test at every rank count its marker
# names, also under MPICH); tests/README.md explains the groups:
# 1. launch: plain pytest, --group launch: tests/launch/, whose tests start mpirun
#    themselves (not with --quick);
# 2. local: plain pytest, --group local: the tests that need no peer (marked local);
# 3. mpi: pytest under the MPI launcher at each rank count of the matrix (--quick: 2
#    and 3), --group mpi: each test only at the rank counts of its pytest.mark.ranks
#    (default: all five);
# 4. verify: python -m mpicoll.verify under the launcher.
# The torch rows are .ci/run's (they need a venv with torch).  Without --quick, local
# and then mpi at 1 rank run in the background, beside launch and then verify (the
# machine's other core: the two sides take about as long); their output is printed
# when they are done.
#
# Each test is under pytest-timeout (thread method: a rank stuck inside MPI is killed and
# the launcher ends the job); every run is under a watchdog (tests/watchdog.sh), the
# backstop: a run goes on as long as its tests keep starting and finishing, however slow
# the machine, and is stopped only when none did for MPICOLL_RUN_TIMEOUT seconds (each
# rank writes which test it runs: conftest.py, support/progress.py); then it says which
# test each rank was running and why it stopped the run, and the run counts as failed.
# Only rank 0's pytest output is shown; the other ranks write to log files that
# are printed when their run fails.  The closing line is "N passed, M failed"
# summed over all runs (verify counts as one test); the exit status is 0 only
# if nothing failed.  pytest's "no tests collected" (exit 5) counts as 0 tests.
#
# --collect DIR: run nothing; write the IDs of the tests each pytest run of the matrix
# (torch rows included: put torch on PYTHONPATH) would run to DIR/<run>.txt, one a line
# (tests/check_ids.py compares two such folders).
#
# Environment: PYTHON (default: python), MPICOLL_RUN_TIMEOUT (seconds a run may go without
# a test starting or finishing before the watchdog stops it, default 900: longer than any
# test's own limit), MPICOLL_TEST_TIMEOUT (seconds per test without a timeout mark, default 120),
# MPICOLL_TEST_ARGS (extra pytest arguments, e.g. "-k allreduce"), MPICOLL_TEST_JUNIT
# (a directory: rank 0 of each run writes <run>.xml there, for a per-test record),
# MPICOLL_TEST_RANKS (the mpi runs' rank counts, e.g. "1 2 3 4"; default: the matrix's;
# a count the matrix has no row for runs the paths of its first mpi row).
set -u -o pipefail

usage() { sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

flavour=""
matrix=""
collect=""
quick=0
while [ $# -gt 0 ]; do
    case "$1" in
        --mpi) flavour="${2:-}"; shift 2 ;;
        --mpi=*) flavour="${1#--mpi=}"; shift ;;
        --matrix) matrix="${2:-}"; shift 2 ;;
        --matrix=*) matrix="${1#--matrix=}"; shift ;;
        --collect) collect="${2:-}"; shift 2 ;;
        --collect=*) collect="${1#--collect=}"; shift ;;
        --quick) quick=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) echo "run_tests.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$flavour" in
    ""|openmpi|mpich) ;;
    *) echo "run_tests.sh: --mpi: expected openmpi or mpich, got '$flavour'" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python}
RUN_TIMEOUT=${MPICOLL_RUN_TIMEOUT:-900}
TEST_TIMEOUT=${MPICOLL_TEST_TIMEOUT:-120}
command -v "$PY" >/dev/null || { echo "run_tests.sh: no '$PY' on PATH (activate the venv)" >&2; exit 2; }
[[ "$RUN_TIMEOUT" =~ ^[1-9][0-9]*$ ]] \
    || { echo "run_tests.sh: MPICOLL_RUN_TIMEOUT: expected a number of seconds > 0, got '$RUN_TIMEOUT'" >&2; exit 2; }

library=$("$PY" -c "from mpi4py import MPI; print(MPI.Get_library_version().replace(chr(0), '').strip().splitlines()[0].strip())" 2>&1) \
    || { echo "run_tests.sh: mpi4py does not load: $library" >&2; exit 2; }
case "$library" in
    *"Open MPI"*) detected=openmpi ;;
    *MPICH*|*"Intel(R) MPI"*) detected=mpich ;;
    *) detected="" ;;
esac
if [ -z "$flavour" ]; then
    flavour=$detected
    [ -n "$flavour" ] || { echo "run_tests.sh: unknown MPI '$library'; pass --mpi openmpi|mpich" >&2; exit 2; }
elif [ -n "$detected" ] && [ "$detected" != "$flavour" ]; then
    echo "run_tests.sh: --mpi $flavour, but $PY's mpi4py uses $library (activate the other venv)" >&2
    exit 2
fi

# The launcher next to the python (a venv's MPI wheel) first, then PATH.
bindir=$(dirname "$(command -v "$PY")")
launcher=""
for cand in "$bindir/mpirun" "$bindir/mpiexec" "$(command -v mpirun || true)" "$(command -v mpiexec || true)"; do
    if [ -n "$cand" ] && [ -x "$cand" ]; then launcher=$cand; break; fi
done
[ -n "$launcher" ] || { echo "run_tests.sh: no mpirun or mpiexec found" >&2; exit 2; }

launch_opts=()
if [ "$flavour" = openmpi ]; then
    launch_opts=(--oversubscribe)
    if [ "$(id -u)" = 0 ]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
fi

# The runs: the rows of tests/matrix.sh for this MPI (or --matrix NAME).
# shellcheck source=tests/matrix.sh
source tests/matrix.sh
matrix=${matrix:-$flavour}
matrix_names | grep -qx -- "$matrix" \
    || { echo "run_tests.sh: --matrix: expected one of $(matrix_names | paste -s -d ' '), got '$matrix'" >&2; exit 2; }
has_row() { [ -n "$(matrix_rows "$matrix" "$1")" ]; }  # has_row GROUP
read -r -a launch_args <<<"$(matrix_rows "$matrix" launch | head -n 1 | cut -d '|' -f 2-)"
read -r -a local_args <<<"$(matrix_rows "$matrix" local | head -n 1 | cut -d '|' -f 2-)"
mapfile -t verify_rows < <(matrix_rows "$matrix" verify)
mapfile -t mpi_rows < <(matrix_rows "$matrix" mpi)
# mpi_args N: the pytest paths and arguments of the mpi run at N ranks: those of the row
# that lists N, else of the first mpi row
mpi_args() {
    local row
    for row in ${mpi_rows[@]+"${mpi_rows[@]}"}; do
        if [[ " ${row%%|*} " == *" $1 "* ]]; then echo "${row#*|}"; return; fi
    done
    row=${mpi_rows[0]:-|tests}
    echo "${row#*|}"
}
ranks=()
if [ "$quick" = 1 ]; then
    ranks=(2 3)
else
    for row in ${mpi_rows[@]+"${mpi_rows[@]}"}; do
        for n in ${row%%|*}; do ranks+=("$n"); done
    done
    [ ${#ranks[@]} = 0 ] || mapfile -t ranks < <(printf '%s\n' "${ranks[@]}" | sort -n -u)
fi
if [ -n "${MPICOLL_TEST_RANKS:-}" ]; then
    # shellcheck disable=SC2206  # a list of numbers
    ranks=($MPICOLL_TEST_RANKS)
    for n in "${ranks[@]}"; do
        [[ "$n" =~ ^[1-9][0-9]*$ ]] \
            || { echo "run_tests.sh: MPICOLL_TEST_RANKS: expected rank counts like '1 2 3 4', got '$MPICOLL_TEST_RANKS'" >&2; exit 2; }
    done
fi
logdir=$(mktemp -d "${TMPDIR:-/tmp}/mpicoll-tests.XXXXXX")
# watch_run LABEL LIMIT MARKS -- COMMAND...: COMMAND under the watchdog
# shellcheck source=tests/watchdog.sh
source tests/watchdog.sh
export WATCH_DIR=$logdir  # (LABEL.stopped: why the watchdog stopped a run)
beside=""  # pid of the runs in the background, while they run
# at exit (also on a signal): stop the run being watched and the background runs (each
# pytest or launcher ends on TERM), and remove the logs
# shellcheck disable=SC2317  # called from the EXIT trap
stop_runs() {
    [ -z "${WATCHED:-}" ] || kill "$WATCHED" 2>/dev/null
    [ -n "$beside" ] || return 0
    local kids
    kids=$(pgrep -P "$beside")  # its watched run and the watchdog's sleep
    kill "$beside" 2>/dev/null
    # shellcheck disable=SC2086  # a list of pids
    [ -z "$kids" ] || kill $kids 2>/dev/null
}
trap 'stop_runs; rm -rf "$logdir"' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
pytest_opts=(-p no:cacheprovider --timeout="$TEST_TIMEOUT" --timeout-method=thread)
# shellcheck disable=SC2206  # word splitting of the user's extra arguments is intended
extra=(${MPICOLL_TEST_ARGS:-})

total_passed=0
total_failed=0
summary=()
status=0

echo "mpicoll tests: $library ($flavour), launcher $launcher, python $(command -v "$PY")"
echo "matrix: $matrix (tests/matrix.sh)"
one=0 rest=()
for n in ${ranks[@]+"${ranks[@]}"}; do if [ "$n" = 1 ]; then one=1; else rest+=("$n"); fi; done
if [ -n "$collect" ]; then
    echo "collecting the IDs of every pytest run into $collect"
elif [ "$quick" = 1 ]; then
    echo "runs: plain pytest (local), pytest at ${ranks[*]} rank(s) (mpi), verify"
else
    # the mpi run at 1 rank, where asked for, and verify run after launch, beside local (below)
    echo "runs: plain pytest (launch$([ "$one" = 1 ] && echo ", then pytest at 1 rank (mpi)"), then verify;"
    echo "      beside them plain pytest (local)), pytest at ${rest[*]:-no other} rank(s) (mpi)"
fi

# pytest_outcome PREFIX NRANKS RC: the per-rank outcome files of one run, added up
# shellcheck source=tests/outcome.sh
source tests/outcome.sh

# start_pytest LABEL NRANKS (0: plain pytest) PYTEST-ARGS...: run one pytest run, under the
# watchdog; its exit status and seconds go to $logdir/LABEL.rc and .secs for account.
start_pytest() {
    local label=$1 nranks=$2; shift 2
    local prefix="$logdir/$label" start rc
    start=$(date +%s)
    echo
    echo "=== $label: $([ "$nranks" = 0 ] && echo "plain pytest" || echo "$launcher -n $nranks") ==="
    local junit=${MPICOLL_TEST_JUNIT:+--junitxml=$MPICOLL_TEST_JUNIT/$label.xml}
    if [ "$nranks" = 0 ]; then
        watch_run "$label" "$RUN_TIMEOUT" "$prefix.now.*" -- \
            env MPICOLL_TEST_SUMMARY="$prefix" MPICOLL_TEST_PROGRESS="$prefix.now" \
            "$PY" -m pytest "${pytest_opts[@]}" ${junit:+"$junit"} "$@"
        rc=$?
    else
        # rank 0 writes to the terminal, the others to $prefix.rank<r>.log
        # shellcheck disable=SC2016  # expanded by the bash each rank runs
        watch_run "$label" "$RUN_TIMEOUT" "$prefix.now.*" -- \
            env MPICOLL_TEST_SUMMARY="$prefix" MPICOLL_TEST_PROGRESS="$prefix.now" \
            MPICOLL_TEST_LOG="$prefix" MPICOLL_TEST_JUNIT_OPT="$junit" \
            "$launcher" -n "$nranks" "${launch_opts[@]}" bash -c '
                r=${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${PMIX_RANK:-0}}}
                if [ "$r" = 0 ]; then exec "$@" ${MPICOLL_TEST_JUNIT_OPT:+"$MPICOLL_TEST_JUNIT_OPT"}; fi
                exec "$@" >"$MPICOLL_TEST_LOG.rank$r.log" 2>&1' bash \
            "$PY" -m pytest "${pytest_opts[@]}" "$@"
        rc=$?
    fi
    echo "$rc" >"$prefix.rc"
    echo "$(($(date +%s) - start))" >"$prefix.secs"
}

# account LABEL NRANKS: add a finished run's outcome to the totals and the summary; on a
# failure print why and the other ranks' logs.
account() {
    local label=$1 nranks=$2
    local prefix="$logdir/$label" rc result passed failed skipped problem
    rc=$(cat "$prefix.rc" 2>/dev/null || echo "none")
    result=$(pytest_outcome "$prefix" "$((nranks > 0 ? nranks : 1))" "$rc")
    read -r passed failed skipped problem <<<"$result"
    if [ -e "$logdir/$label.stopped" ]; then  # (the watchdog's reason, first)
        problem="$(head -n 1 "$logdir/$label.stopped" | sed 's/^!!! [^:]*: //')${problem:+; $problem}"
    fi
    if [ -n "$problem" ] && ((failed == 0)); then failed=1; fi
    total_passed=$((total_passed + passed))
    total_failed=$((total_failed + failed))
    summary+=("$(printf '%-12s %5d passed, %3d failed, %3d skipped  (%ss)%s' "$label" "$passed" \
        "$failed" "$skipped" "$(cat "$prefix.secs" 2>/dev/null || echo '?')" "${problem:+  -- $problem}")")
    if ((failed > 0)); then
        status=1
        for log in "$prefix".rank*.log; do
            [ -e "$log" ] || continue
            echo "--- $(basename "$log") (last 150 lines) ---"
            tail -n 150 "$log"
        done
    fi
}

run_pytest() {  # run_pytest LABEL NRANKS PYTEST-ARGS...: start_pytest, then account
    start_pytest "$@"
    account "$1" "$2"
}

# run_verify NRANKS ARGS...: python -m mpicoll.verify ARGS against MPI's built-ins (counts
# as one test)
run_verify() {
    local nranks=$1 start rc; shift
    echo
    echo "=== verify: $launcher -n $nranks $PY -m mpicoll.verify $* ==="
    start=$(date +%s)
    # shellcheck disable=SC2094  # (the watchdog only looks at the log's time)
    # (unbuffered: each row reaches the log as it is checked, and the watchdog sees it)
    watch_run verify "$RUN_TIMEOUT" "$logdir/verify.log" -- env PYTHONUNBUFFERED=1 \
        "$launcher" -n "$nranks" "${launch_opts[@]}" "$PY" -m mpicoll.verify "$@" >"$logdir/verify.log" 2>&1
    rc=$?
    # the table has hundreds of rows: show the header, anything not ok, and the verdict
    grep -v -E ' ok$' "$logdir/verify.log" | grep -v -E '^-+$' | head -n 200
    if [ "$rc" = 0 ] && grep -q '^PASS' "$logdir/verify.log"; then
        total_passed=$((total_passed + 1))
        summary+=("$(printf '%-12s %5d passed, %3d failed  (%ss)' verify 1 0 "$(($(date +%s) - start))")")
    else
        total_failed=$((total_failed + 1))
        status=1
        local why="exit status $rc"
        [ -e "$logdir/verify.stopped" ] && why=$(head -n 1 "$logdir/verify.stopped" | sed 's/^!!! [^:]*: //')
        summary+=("$(printf '%-12s %5d passed, %3d failed  (%ss)  -- %s' verify 0 1 \
            "$(($(date +%s) - start))" "$why")")
    fi
}

run_verifies() {  # every verify row of the matrix
    local row args
    for row in ${verify_rows[@]+"${verify_rows[@]}"}; do
        read -r -a args <<<"${row#*|}"
        run_verify "${row%%|*}" ${args[@]+"${args[@]}"}
    done
}

# collect_ids LABEL NRANKS (0: plain pytest) PYTEST-ARGS...: the IDs of the tests one run
# would run, to $collect/LABEL.txt (conftest.py writes them, rank 0 of the run)
collect_ids() {
    local label=$1 nranks=$2 rc; shift 2
    local cmd=("$PY" -m pytest -p no:cacheprovider --collect-only -q "$@")
    [ "$nranks" = 0 ] || cmd=("$launcher" -n "$nranks" "${launch_opts[@]}" "${cmd[@]}")
    rm -f "$collect/$label.txt"
    watch_run "$label" "$RUN_TIMEOUT" "$logdir/$label.now.*" -- env MPICOLL_TEST_IDS="$collect/$label.txt" \
        MPICOLL_TEST_PROGRESS="$logdir/$label.now" "${cmd[@]}" >"$logdir/$label.log" 2>&1
    rc=$?
    if { [ "$rc" = 0 ] || [ "$rc" = 5 ]; } && [ -e "$collect/$label.txt" ]; then
        printf '%-12s %5d tests\n' "$label" "$(wc -l <"$collect/$label.txt")"
    else
        status=1
        echo "$label: the collection failed (exit status $rc):"
        tail -n 30 "$logdir/$label.log"
    fi
}

if [ -n "$collect" ]; then
    mkdir -p "$collect" || exit 2
    collect=$(cd "$collect" && pwd)
    ! has_row launch || collect_ids launch 0 --group launch "${launch_args[@]}" ${extra[@]+"${extra[@]}"}
    ! has_row local || collect_ids local 0 --group local "${local_args[@]}" ${extra[@]+"${extra[@]}"}
    for n in ${ranks[@]+"${ranks[@]}"}; do
        # shellcheck disable=SC2046  # word splitting of the paths is intended
        collect_ids "np$n" "$n" --group mpi $(mpi_args "$n") ${extra[@]+"${extra[@]}"}
    done
    while IFS='|' read -r counts args; do
        for n in $counts; do
            # shellcheck disable=SC2086  # word splitting of the paths is intended
            collect_ids "torch-np$n" "$n" --group torch $args ${extra[@]+"${extra[@]}"}
        done
    done < <(matrix_rows "$matrix" torch)
    exit "$status"
fi

if [ "$quick" = 1 ]; then
    ! has_row local || run_pytest local 0 --group local "${local_args[@]}" ${extra[@]+"${extra[@]}"}
else
    # local (the tests that need no peer) and then np1 in the background, beside the
    # launch tests and then verify: one core each on a two-core machine.  Their output
    # goes to a file, printed once they are done; each is under its own watchdog like any
    # run.
    (
        ! has_row local || start_pytest local 0 --group local "${local_args[@]}" ${extra[@]+"${extra[@]}"}
        # shellcheck disable=SC2046  # word splitting of the paths is intended
        [ "$one" = 0 ] || start_pytest np1 1 --group mpi $(mpi_args 1) ${extra[@]+"${extra[@]}"}
    ) >"$logdir/beside.out" 2>&1 &
    beside=$!
    ! has_row launch || run_pytest launch 0 --group launch "${launch_args[@]}" ${extra[@]+"${extra[@]}"}
    run_verifies
    wait "$beside"
    beside=""
    echo
    echo "=== (beside launch and verify: local$([ "$one" = 1 ] && echo ", then np1")) ==="
    cat "$logdir/beside.out"
    ! has_row local || account local 0
    [ "$one" = 0 ] || account np1 1
fi

for n in ${ranks[@]+"${ranks[@]}"}; do
    [ "$n" = 1 ] && [ "$quick" = 0 ] && continue  # (ran beside launch)
    # shellcheck disable=SC2046  # word splitting of the paths is intended
    run_pytest "np$n" "$n" --group mpi $(mpi_args "$n") ${extra[@]+"${extra[@]}"}
done

[ "$quick" = 1 ] && run_verifies  # (otherwise they ran beside local)

echo
echo "=== summary ($library, matrix $matrix) ==="
printf '%s\n' "${summary[@]}"
echo "$total_passed passed, $total_failed failed"
exit "$status"
