#!/usr/bin/env bash
# Run mpicoll's whole test suite with the python and MPI launcher on PATH.
#
#   bash tests/run_tests.sh [--mpi openmpi|mpich] [--quick]
#
# Each group of tests where it means something (tests/README.md has the table):
# 1. launch: plain pytest, --group launch: tests/test_launch_*.py, which start
#    mpirun themselves (not with --quick);
# 2. local: plain pytest, --group local: the tests that need no peer (marked
#    local);
# 3. mpi: pytest under the MPI launcher at 1, 2, 3, 4 and 5 ranks (--quick: 2
#    and 3), --group mpi: each test only at the rank counts of its
#    pytest.mark.ranks (default: all five);
# 4. verify: mpirun -n 4 python -m mpicoll.verify --quick.
# local and then mpi at 1 rank run in the background, beside launch and then
# verify (the machine's other core); their output is printed when they are done.
# (The two sides are about even: Open MPI 54 + 17 s against 58 + 13 s, MPICH
# 13 + 13 s against 15 + 17 s; with np1 after launch the launch side was the
# longer by 17 s, resp. 19 s.)
#
# Every run is under an outer `timeout`; each test under pytest-timeout (thread
# method: a rank stuck inside MPI is killed and the launcher ends the job).
# Only rank 0's pytest output is shown; the other ranks write to log files that
# are printed when their run fails.  The closing line is "N passed, M failed"
# summed over all runs (verify counts as one test); the exit status is 0 only
# if nothing failed.  pytest's "no tests collected" (exit 5) counts as 0 tests.
#
# Environment: PYTHON (default: python), MPICOLL_RUN_TIMEOUT (seconds per run,
# default 600), MPICOLL_TEST_TIMEOUT (seconds per test without a timeout mark, default 120),
# MPICOLL_TEST_ARGS (extra pytest arguments, e.g. "-k allreduce"), MPICOLL_TEST_JUNIT
# (a directory: rank 0 of each run writes <run>.xml there, for a per-test record),
# MPICOLL_TEST_RANKS (the mpi runs' rank counts, e.g. "1 2 3 4"; default 1-5, --quick 2 3),
# MPICOLL_TEST_PATHS_NP<n> (the test paths of the mpi run at n ranks, word-split; default
# tests: e.g. MPICOLL_TEST_PATHS_NP4="tests/test_timeout.py").
set -u -o pipefail

usage() { sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'; }

flavour=""
quick=0
while [ $# -gt 0 ]; do
    case "$1" in
        --mpi) flavour="${2:-}"; shift 2 ;;
        --mpi=*) flavour="${1#--mpi=}"; shift ;;
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
RUN_TIMEOUT=${MPICOLL_RUN_TIMEOUT:-600}
TEST_TIMEOUT=${MPICOLL_TEST_TIMEOUT:-120}
command -v "$PY" >/dev/null || { echo "run_tests.sh: no '$PY' on PATH (activate the venv)" >&2; exit 2; }

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

if [ "$quick" = 1 ]; then ranks=(2 3); else ranks=(1 2 3 4 5); fi
if [ -n "${MPICOLL_TEST_RANKS:-}" ]; then
    # shellcheck disable=SC2206  # a list of numbers
    ranks=($MPICOLL_TEST_RANKS)
    for n in "${ranks[@]}"; do
        [[ "$n" =~ ^[1-9][0-9]*$ ]] \
            || { echo "run_tests.sh: MPICOLL_TEST_RANKS: expected rank counts like '1 2 3 4', got '$MPICOLL_TEST_RANKS'" >&2; exit 2; }
    done
fi
logdir=$(mktemp -d "${TMPDIR:-/tmp}/mpicoll-tests.XXXXXX")
beside=""  # pid of the runs in the background, while they run
# at exit (also on a signal): stop the background runs (their `timeout`s end pytest) and
# remove the logs
# shellcheck disable=SC2317  # called from the EXIT trap
stop_beside() {
    [ -n "$beside" ] || return 0
    local kids
    kids=$(pgrep -P "$beside")  # the `timeout`s: each ends its pytest or launcher on TERM
    kill "$beside" 2>/dev/null
    # shellcheck disable=SC2086  # a list of pids
    [ -z "$kids" ] || kill $kids 2>/dev/null
}
trap 'stop_beside; rm -rf "$logdir"' EXIT
trap 'exit 143' TERM
trap 'exit 130' INT
pytest_opts=(-p no:cacheprovider --timeout="$TEST_TIMEOUT" --timeout-method=thread)
# shellcheck disable=SC2206  # word splitting of the user's extra arguments is intended
extra=(${MPICOLL_TEST_ARGS:-})

# the test paths of the mpi run at $1 ranks (MPICOLL_TEST_PATHS_NP$1, else tests)
paths_of() {
    local var="MPICOLL_TEST_PATHS_NP$1"
    echo "${!var:-tests}"
}

total_passed=0
total_failed=0
summary=()
status=0

echo "mpicoll tests: $library ($flavour), launcher $launcher, python $(command -v "$PY")"
if [ "$quick" = 1 ]; then
    echo "runs: plain pytest (local), pytest at ${ranks[*]} rank(s) (mpi), verify at 4 ranks"
else
    # the mpi run at 1 rank, where asked for, and verify run after launch, beside local (below)
    one=0 rest=()
    for n in "${ranks[@]}"; do if [ "$n" = 1 ]; then one=1; else rest+=("$n"); fi; done
    echo "runs: plain pytest (launch$([ "$one" = 1 ] && echo ", then pytest at 1 rank (mpi)"), then verify at 4 ranks;"
    echo "      beside them plain pytest (local)), pytest at ${rest[*]:-no other} rank(s) (mpi)"
fi

# pytest_outcome PREFIX NRANKS RC: the per-rank outcome files of one run, added up
# shellcheck source=tests/outcome.sh
source tests/outcome.sh

# start_pytest LABEL NRANKS (0: plain pytest) PYTEST-ARGS...: run one pytest run, under the
# outer timeout; its exit status and seconds go to $logdir/LABEL.rc and .secs for account.
start_pytest() {
    local label=$1 nranks=$2; shift 2
    local prefix="$logdir/$label" start rc
    start=$(date +%s)
    echo
    echo "=== $label: $([ "$nranks" = 0 ] && echo "plain pytest" || echo "$launcher -n $nranks") ==="
    local junit=${MPICOLL_TEST_JUNIT:+--junitxml=$MPICOLL_TEST_JUNIT/$label.xml}
    if [ "$nranks" = 0 ]; then
        MPICOLL_TEST_SUMMARY=$prefix timeout -k 10 "$RUN_TIMEOUT" "$PY" -m pytest "${pytest_opts[@]}" \
            ${junit:+"$junit"} "$@"
        rc=$?
    else
        # rank 0 writes to the terminal, the others to $prefix.rank<r>.log
        # shellcheck disable=SC2016  # expanded by the bash each rank runs
        MPICOLL_TEST_SUMMARY=$prefix MPICOLL_TEST_LOG=$prefix MPICOLL_TEST_JUNIT_OPT=$junit \
            timeout -k 10 "$RUN_TIMEOUT" "$launcher" -n "$nranks" "${launch_opts[@]}" bash -c '
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
    if [ -n "$problem" ] && ((failed == 0)); then failed=1; fi
    total_passed=$((total_passed + passed))
    total_failed=$((total_failed + failed))
    summary+=("$(printf '%-12s %5d passed, %3d failed, %3d skipped  (%ss)%s' "$label" "$passed" \
        "$failed" "$skipped" "$(cat "$prefix.secs" 2>/dev/null || echo '?')" "${problem:+  -- $problem}")")
    if ((failed > 0)); then
        status=1
        [ "$rc" = 124 ] && echo "!!! $label: killed after $RUN_TIMEOUT s (MPICOLL_RUN_TIMEOUT)"
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

# verify: mpicoll.verify --quick at 4 ranks against MPI's built-ins (counts as one test)
run_verify() {
    local start rc
    echo
    echo "=== verify: $launcher -n 4 $PY -m mpicoll.verify --quick ==="
    start=$(date +%s)
    timeout -k 10 "$RUN_TIMEOUT" "$launcher" -n 4 "${launch_opts[@]}" "$PY" -m mpicoll.verify --quick \
        >"$logdir/verify.log" 2>&1
    rc=$?
    # the table has hundreds of rows: show the header, anything not ok, and the verdict
    grep -v -E ' ok$' "$logdir/verify.log" | grep -v -E '^-+$' | head -n 200
    if [ "$rc" = 0 ] && grep -q '^PASS' "$logdir/verify.log"; then
        total_passed=$((total_passed + 1))
        summary+=("$(printf '%-12s %5d passed, %3d failed  (%ss)' verify 1 0 "$(($(date +%s) - start))")")
    else
        total_failed=$((total_failed + 1))
        status=1
        summary+=("$(printf '%-12s %5d passed, %3d failed  (%ss)  -- exit status %s' verify 0 1 \
            "$(($(date +%s) - start))" "$rc")")
    fi
}

if [ "$quick" = 1 ]; then
    run_pytest local 0 --group local tests ${extra[@]+"${extra[@]}"}
else
    # local (the tests that need no peer) and then np1 in the background, beside the
    # launch tests and then verify: one core each on a two-core machine.  Their output
    # goes to a file, printed once they are done; each is under its own outer timeout
    # like any run.
    (
        start_pytest local 0 --group local tests ${extra[@]+"${extra[@]}"}
        # shellcheck disable=SC2046  # word splitting of the paths is intended
        [ "$one" = 0 ] || start_pytest np1 1 --group mpi $(paths_of 1) ${extra[@]+"${extra[@]}"}
    ) >"$logdir/beside.out" 2>&1 &
    beside=$!
    run_pytest launch 0 --group launch tests ${extra[@]+"${extra[@]}"}
    run_verify
    wait "$beside"
    beside=""
    echo
    echo "=== (beside launch and verify: local$([ "$one" = 1 ] && echo ", then np1")) ==="
    cat "$logdir/beside.out"
    account local 0
    [ "$one" = 0 ] || account np1 1
fi

for n in "${ranks[@]}"; do
    [ "$n" = 1 ] && [ "$quick" = 0 ] && continue  # (ran beside launch)
    # shellcheck disable=SC2046  # word splitting of the paths is intended
    run_pytest "np$n" "$n" --group mpi $(paths_of "$n") ${extra[@]+"${extra[@]}"}
done

[ "$quick" = 1 ] && run_verify  # (otherwise it ran beside local)

echo
echo "=== summary ($library) ==="
printf '%s\n' "${summary[@]}"
echo "$total_passed passed, $total_failed failed"
exit "$status"
