# shellcheck shell=bash
# watch_run LABEL LIMIT MARKS -- COMMAND...: run COMMAND; stop it only when it has made no
# progress for LIMIT seconds.  Sourced by tests/run_tests.sh (its tests/project test runs it
# on a tiny suite).
#
# Progress: a file among MARKS (a glob, expanded at each look) was written.  A pytest run
# under MPICOLL_TEST_PROGRESS=P writes P.<rank> whenever a test starts or finishes
# (conftest.py, support/progress.py: "<epoch seconds> <state> <test id>"), so a slow but
# healthy run goes on however long it takes, while a run whose tests stopped finishing
# (one hung past pytest-timeout's limit, a rank stuck outside any test: collection,
# MPI_Finalize) is stopped: TERM, then KILL 10 s later, as `timeout -k 10` did.  For
# another command (verify) MARKS is its log.  Each test's own limit is pytest-timeout's;
# this is the backstop behind it.
#
# When it stops a run it prints why, and what each mark says ("rank 1: running
# tests/x.py::test_y for 612 s"), and writes the same lines to LABEL's stop file
# ($WATCH_DIR/LABEL.stopped, when WATCH_DIR is set); the exit status is then 124, as
# timeout's.  Otherwise the exit status is COMMAND's.  WATCH_POLL: seconds between looks
# (default: 5, or 0.2 under a LIMIT below 50 s).  WATCHED: the pid of the command while
# it runs (a command started in the background ignores ^C: the caller's exit trap ends it).

# shellcheck disable=SC2034  # read by the caller's exit trap
WATCHED=""

# watch_marks MARKS NOW: one line per mark file, what it says
watch_marks() {
    local marks=$1 now=$2 file line stamp state what rank any=0
    for file in $marks; do
        [ -e "$file" ] || continue
        any=1
        line=$(head -n 1 "$file" 2>/dev/null)
        rank=${file##*.}
        case "$file" in
            *.log) echo "  $(basename "$file"): last line: $(tail -n 1 "$file" 2>/dev/null)"; continue ;;
        esac
        read -r stamp state what <<<"$line"
        [[ "$stamp" =~ ^[0-9]+$ ]] || { echo "  rank $rank: '$line'"; continue; }
        case "$state" in
            running) echo "  rank $rank: running $what for $((now - stamp)) s" ;;
            finished) echo "  rank $rank: between tests, $((now - stamp)) s after $what finished" ;;
            collecting) echo "  rank $rank: collecting the tests for $((now - stamp)) s" ;;
            done) echo "  rank $rank: after its last test, for $((now - stamp)) s (pytest's end, MPI_Finalize)" ;;
            *) echo "  rank $rank: $state $what ($((now - stamp)) s ago)" ;;
        esac
    done
    ((any)) || echo "  no rank wrote its progress: nothing started (the launcher, python's start-up)"
}

watch_run() {
    local label=$1 limit=$2 marks=$3
    shift 3
    [ "${1:-}" = "--" ] && shift
    local poll=${WATCH_POLL:-}
    [ -n "$poll" ] || { if ((limit < 50)); then poll=0.2; else poll=5; fi; }
    "$@" &
    local pid=$! last now newest file mtime rc why
    WATCHED=$pid  # (for the caller's exit trap: a command in the background ignores ^C)
    last=$(date +%s)
    while kill -0 "$pid" 2>/dev/null; do
        sleep "$poll"
        newest=0
        for file in $marks; do
            mtime=$(stat -c %Y "$file" 2>/dev/null) || continue
            ((mtime > newest)) && newest=$mtime
        done
        ((newest > last)) && last=$newest
        now=$(date +%s)
        if ((now - last >= limit)) && kill -0 "$pid" 2>/dev/null; then
            why=$(echo "!!! $label: stopped: no test started or finished for $((now - last)) s (MPICOLL_RUN_TIMEOUT=$limit)"
                  watch_marks "$marks" "$now")
            printf '\n%s\n' "$why"  # (on a line of its own: pytest's dots may not end theirs)
            [ -z "${WATCH_DIR:-}" ] || echo "$why" >"$WATCH_DIR/$label.stopped"
            kill -TERM "$pid" 2>/dev/null
            for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
            kill -KILL "$pid" 2>/dev/null
            wait "$pid" 2>/dev/null
            WATCHED=""
            return 124
        fi
    done
    wait "$pid"
    rc=$?
    WATCHED=""
    return "$rc"
}
