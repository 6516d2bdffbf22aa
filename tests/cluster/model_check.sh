#!/usr/bin/env bash
# =============================================================================
# model_check.sh: the cost model's predictions against measured times across
# nodes, on the emulated cluster (tests/cluster/cluster.sh).
#
# Usage (as root):  bash tests/cluster/model_check.sh VENV openmpi|mpich [OUTDIR]
#
# 1. a tuning at 2 nodes x 1 rank (`python -m mpicoll.tune --quick
#    --no-segments`: the model needs the exchange curve, the reduction rate
#    and the overheads, not the segment search), on nodes 0 and 1;
# 2. the benchmark at 4 nodes x 1 (`python -m mpicoll.bench -C
#    allreduce,reduce_scatter -b 64K -e 4M -f 4 -a all -w 1 -n 5 --batch 1`)
#    with the piece to another node the tuning chose; MODEL_LAYOUT=2x2: both
#    at 2 nodes x 2 ranks instead (ranks node by node), where the ranks of a
#    node share its link and the hierarchical algorithm runs (a tuning at one
#    rank per node has no intra-node curve, and the model then prices an
#    exchange inside a node as one across nodes);
# 3. the table (tests/cluster/across_nodes.py --model): predicted / measured
#    per algorithm and size, and how many cells are within 20 %.
#
# The links: 100 Mbit/s with a token bucket of 3,100 B (MODEL_RATE,
# MODEL_BURST), so every packet is serialized at the rate.  tbf's default
# bucket (128 KiB and more) lets a message of a few tens of KiB pass at the
# veth's speed, and the model's small-message cells then compare with a link
# no real network is; a small bucket at 1 Gbit/s costs a softirq per packet,
# more than 2 cores do beside 4 ranks (every algorithm at half speed).
# `--batch 1` times every call after a barrier, as the model predicts it:
# calls back to back overlap the next call's first step with the last one's,
# and a pairwise schedule then shares links the model gives it alone.
#
# OUTDIR (default a new temporary directory) keeps tune.json, tune.log,
# bench.json, bench.log and table.md.  Takes about 7 minutes (Open MPI; MPICH 5) on the
# 2-core VM, 2x2 about 6 (MPICH 5): the tuning's sweep at 100 Mbit/s is most of it.
# =============================================================================
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
venv=${1:-}; mpi=${2:-}
[ -n "$venv" ] && [ -n "$mpi" ] || { sed -n '2,/^# =====/p' "$0" | sed 's/^# \{0,1\}//' | sed '$d'; exit 2; }
venv=$(cd "$venv" && pwd)
out=${3:-$(mktemp -d "${TMPDIR:-/tmp}/mpicoll-model.XXXXXX")}
mkdir -p "$out"; out=$(cd "$out" && pwd)
rate=${MODEL_RATE:-100mbit} burst=${MODEL_BURST:-3100} layout=${MODEL_LAYOUT:-4x1}
case "$layout" in
    4x1) nodes=4 ppn=1 labels=0,1,2,3 tune_np=2 tune_ppn=1 ;;
    2x2) nodes=2 ppn=2 labels=0,0,1,1 tune_np=4 tune_ppn=2 ;;
    *) echo "model_check.sh: MODEL_LAYOUT: expected 4x1 or 2x2, got '$layout'" >&2; exit 2 ;;
esac
if [ -z "${CLUSTER_DIR:-}" ]; then  # the cluster: up, this script in it, down on every exit
    exec bash "$HERE/cluster.sh" with "$nodes" --rate "$rate" --burst "$burst" -- \
        bash "${BASH_SOURCE[0]}" "$venv" "$mpi" "$out"
fi
cd "$ROOT"
run() { bash "$HERE/cluster.sh" run "$CLUSTER_DIR" --venv "$venv" --mpi "$mpi" "$@"; }
env_=(env PYTHONPATH="$ROOT" MPICOLL_TUNING=off)
t0=$(date +%s)
run --np "$tune_np" --ppn "$tune_ppn" -- "${env_[@]}" "$venv/bin/python" -m mpicoll.tune --quick --no-segments \
    -o "$out/tune.json" >"$out/tune.log" 2>&1
piece=$("$venv/bin/python" -c "import json, sys; e = json.load(open(sys.argv[1]))['entries'][0]
print(e.get('node_piece_bytes', ''))" "$out/tune.json")
echo "model-check: tuned at 2 nodes x $tune_ppn in $(( $(date +%s) - t0 )) s; piece to another node ${piece:-the default}"
t0=$(date +%s)
run --ppn "$ppn" -- "${env_[@]}" ${piece:+MPICOLL_NODE_PIECE_BYTES=$piece} "$venv/bin/python" -m mpicoll.bench \
    -C allreduce,reduce_scatter -b 64K -e 4M -f 4 -a all -w 1 -n 5 --batch 1 -q \
    --json "$out/bench.json" >"$out/bench.log" 2>&1
echo "model-check: bench at $nodes nodes x $ppn in $(( $(date +%s) - t0 )) s"
"$venv/bin/python" "$HERE/across_nodes.py" --nodes "$labels" --rate "$rate" --model "$out/tune.json" \
    "$out/bench.json" >"$out/table.md"
sed -n '/^predicted/,$p' "$out/table.md"
echo "model-check: files in $out"
