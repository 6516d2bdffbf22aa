# shellcheck shell=bash
# pytest_outcome PREFIX NRANKS RC: the outcome of one pytest run over NRANKS ranks
# (RC: the launcher's exit status), from the files "PREFIX.<rank>" that
# conftest.py writes when MPICOLL_TEST_SUMMARY=PREFIX is set (one line per rank:
# "passed=N failed=N error=N skipped=N xfailed=N xpassed=N exit=N").
#   prints "passed failed skipped problem" (problem: why the run counts as failed, or "")
# Rank 0's passed and skipped count; failed is the most any rank saw (each rank
# runs the same tests).  Sourced by tests/run_tests.sh and .ci/run: under a
# launcher every rank's pytest writes its summary line to the same output, and
# two lines can land on one ("686 passed in 25.70s686 passed in 25.69s"), so a
# count is never read from a log.
outcome_line='^passed=[0-9]+ failed=[0-9]+ error=[0-9]+ skipped=[0-9]+ xfailed=[0-9]+ xpassed=[0-9]+ exit=[0-9]+$'
pytest_outcome() {
    local prefix=$1 nranks=$2 rc=$3 r line p f e s x passed=0 failed=0 skipped=0 problem=""
    for ((r = 0; r < nranks; r++)); do
        line=$(cat "$prefix.$r" 2>/dev/null || true)
        if [[ $line == *$'\n'* ]] || ! [[ $line =~ $outcome_line ]]; then
            problem="rank $r did not finish (exit status $rc)"
            continue
        fi
        p=$(sed -E 's/(^|.* )passed=([0-9]+).*/\2/' <<<"$line")
        f=$(sed -E 's/(^|.* )failed=([0-9]+).*/\2/' <<<"$line")
        e=$(sed -E 's/(^|.* )error=([0-9]+).*/\2/' <<<"$line")
        s=$(sed -E 's/(^|.* )skipped=([0-9]+).*/\2/' <<<"$line")
        x=$(sed -E 's/(^|.* )exit=([0-9]+).*/\2/' <<<"$line")
        if [ "$r" = 0 ]; then passed=$p; skipped=$s; fi
        if ((f + e > failed)); then failed=$((f + e)); fi
        if [ "$x" != 0 ] && [ "$x" != 5 ] && ((f + e == 0)) && [ -z "$problem" ]; then
            problem="rank $r: pytest exit status $x"
        fi
    done
    if [ -z "$problem" ] && [ "$rc" != 0 ] && [ "$rc" != 5 ] && ((failed == 0)); then
        problem="launcher exit status $rc"
    fi
    echo "$passed $failed $skipped $problem"
}
