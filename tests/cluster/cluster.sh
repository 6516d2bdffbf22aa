#!/usr/bin/env bash
# =============================================================================
# cluster.sh: an emulated cluster on one Linux machine, for running mpicoll
# across nodes that really are separate on the network.
#
# Usage (as root):
#
#   sudo bash tests/cluster/cluster.sh up DIR N [--rate R] [--burst B] [--delay D]
#   sudo bash tests/cluster/cluster.sh run DIR --venv V --mpi openmpi|mpich
#            (--ppn K | --ranks K0,K1,...) [--placement block|round-robin|rankfile:FILE]
#            [--np NP] -- COMMAND ...
#   sudo bash tests/cluster/cluster.sh exec DIR NODE COMMAND ...
#   sudo bash tests/cluster/cluster.sh links DIR
#   sudo bash tests/cluster/cluster.sh down DIR
#   sudo bash tests/cluster/cluster.sh with N [--rate R] [--burst B] -- COMMAND ...
#
#   up      makes N nodes node0..node<N-1> and records them in DIR (a new or
#           empty directory); R is a tc rate ("1gbit", default; "0": not
#           shaped), B the token bucket in bytes (default: 4 ms of R, at
#           least 128 KiB, so a message of a few tens of KiB passes at the
#           veth's speed; a small B, e.g. 3100, serializes every packet at R,
#           which costs a softirq per packet: fine at 100mbit on 2 cores, not
#           at 1gbit), D a delay ("2ms"; needs netem, skipped with a message
#           when the kernel has none).
#   run     launches COMMAND under the MPI of the virtual environment V from
#           node0 (the command and V are seen at the same paths on every node)
#           with K ranks on every node (--ppn) or K0 on node0, K1 on node1, ...
#           (--ranks, uneven allowed).  Placement: block (ranks node by node,
#           the launchers' default), round-robin (rank r on the r-th node in
#           turn, skipping full nodes), or rankfile:FILE (one node name or
#           number per line, line r for rank r).  Prints the per-node link
#           bytes the run moved to stderr ("cluster: node1 tx ... rx ...").
#   exec    runs COMMAND inside NODE's namespaces.
#   links   prints "NODE TX_BYTES RX_BYTES" of every node's link (the veth
#           counters, /sys/class/net/*/statistics, as the node sees them).
#   down    stops every process left in the cluster's namespaces (by PID,
#           from `ip netns pids`: only this cluster's processes are there)
#           and removes every namespace, veth, bridge and mount it made, then
#           DIR's contents.  Safe to run twice, or on a half-made cluster.
#   with    up in a temporary directory, COMMAND with CLUSTER_DIR set, down on
#           every exit path (trap), COMMAND's exit status.
#
# What a node is: a network namespace "mcl<ID>-node<k>" (a veth "mc0" with
# address 198.18.0.<k+1>/24 and loopback, nothing else, no default route), in
# a UTS namespace (hostname node<k>) and a mount namespace with its own
# /dev/shm and a tmpfs at DIR/tmp (TMPDIR: the same path on every node, each
# node its own contents), and DIR/hosts bind-mounted on /etc/hosts.  One
# holder process per node keeps the UTS and mount namespaces; everything runs
# there through `nsenter`.  The veths' other ends join a bridge in a network
# namespace of its own ("mcl<ID>-br"), so the host's network is never
# touched and no address outside 198.18.0.0/24 (RFC 2544's benchmark range)
# is reachable.  `tc tbf` shapes both ends of each node's link (egress of the
# node's mc0 and of the bridge's port towards the node), R each way.
#
# Launching, without ssh: Open MPI's PRRTE and MPICH's Hydra start their
# remote daemons through DIR/agent ("agent HOST COMMAND"), which enters that
# node's namespaces.  Open MPI runs with pml ob1 over the tcp, sm and self
# BTLs on mc0, --bind-to none, and mpi_yield_when_idle (oversubscribed ranks
# spin 3-4x slower without it); MPICH with -iface mc0 and UCX_TLS=tcp,self
# (UCX sees one kernel and would carry "inter-node" bytes over shared memory
# otherwise: 0 bytes on the links).  `run` exports MPICOLL_CLUSTER_NODES (the
# node of every rank, comma-separated) for programs that check placement.
# =============================================================================
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SUBNET=198.18.0
IFACE=mc0

die() { echo "cluster: $*" >&2; exit 2; }
say() { echo "cluster: $*" >&2; }

need_tools() {
    [ "$(id -u)" -eq 0 ] || die "needs root (network and mount namespaces): run it with sudo"
    local missing=()
    command -v ip >/dev/null || missing+=(iproute2)
    command -v tc >/dev/null || missing+=(iproute2)
    command -v nsenter >/dev/null || missing+=(util-linux)
    command -v unshare >/dev/null || missing+=(util-linux)
    if [ ${#missing[@]} -gt 0 ]; then
        if [ "${MPICOLL_CLUSTER_NO_INSTALL:-0}" != 1 ] && command -v apt-get >/dev/null; then
            say "installing ${missing[*]} (apt-get)"
            DEBIAN_FRONTEND=noninteractive apt-get -o APT::Sandbox::User=root install -y -q \
                "${missing[@]}" >/dev/null \
                || { apt-get -o APT::Sandbox::User=root update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
                     apt-get install -y -q "${missing[@]}" >/dev/null; } \
                || die "could not install ${missing[*]}"
        else
            die "missing ${missing[*]} (commands ip, tc, nsenter, unshare)"
        fi
    fi
    ip netns list >/dev/null 2>&1 || die "'ip netns' does not work here (no network namespaces?)"
}

state() {  # state DIR: load the cluster recorded in DIR
    DIR=$(cd "$1" 2>/dev/null && pwd) || die "no cluster directory $1"
    [ -f "$DIR/cluster.env" ] || die "$DIR holds no cluster (no cluster.env; 'up' makes one)"
    # shellcheck disable=SC1091
    . "$DIR/cluster.env"
}

holder() { cat "$DIR/node$1.pid"; }

in_node() {  # in_node K COMMAND...: run COMMAND in node K's namespaces
    local k=$1; shift
    nsenter -t "$(holder "$k")" -n -u -m --wdns="$PWD" -- env TMPDIR="$DIR/tmp" "$@"
}

node_index() {  # node_index NAME|NUMBER -> k
    local v=${1#node}
    [[ "$v" =~ ^[0-9]+$ ]] && [ "$v" -lt "$NODES" ] || die "no node '$1' (nodes node0..node$((NODES - 1)))"
    echo "$v"
}

# ---------------------------------------------------------------- up / down
cmd_up() {
    local dir=${1:-} n=${2:-} rate=1gbit burst="" delay=""
    [ -n "$dir" ] && [ -n "$n" ] || die "usage: up DIR N [--rate R] [--burst B] [--delay D]"
    shift 2
    while [ $# -gt 0 ]; do
        case $1 in
            --rate) rate=$2; shift 2 ;;
            --burst) burst=$2; shift 2
                [[ "$burst" =~ ^[0-9]+$ ]] && [ "$burst" -ge 1600 ] ||
                    die "up: --burst: expected bytes >= 1600 (one full-size packet), got $burst" ;;
            --delay) delay=$2; shift 2 ;;
            *) die "up: unknown option $1" ;;
        esac
    done
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le 200 ] || die "up: N must be 1..200, got $n"
    need_tools
    mkdir -p "$dir"
    DIR=$(cd "$dir" && pwd)
    [ -z "$(ls -A "$DIR")" ] || die "up: $DIR is not empty"
    local t0 id k ns br
    t0=$(date +%s.%N)
    # A short id keeps interface and namespace names unique per cluster
    # (interface names have at most 15 characters).
    id=$(printf '%04x' $(( $$ % 65536 )))
    while ip netns list | grep -q "^mcl$id-"; do id=$(printf '%04x' $(( RANDOM % 65536 ))); done
    NODES=$n ID=$id
    cat >"$DIR/cluster.env" <<EOF
NODES=$n
ID=$id
RATE=$rate
BURST=$burst
EOF
    mkdir -p "$DIR/tmp"
    { echo "127.0.0.1 localhost"
      for k in $(seq 0 $((n - 1))); do echo "$SUBNET.$((k + 1)) node$k"; done; } >"$DIR/hosts"
    br=mcl$id-br
    ip netns add "$br"
    ip -n "$br" link set lo up
    ip -n "$br" link add br0 type bridge
    ip -n "$br" link set br0 up
    for k in $(seq 0 $((n - 1))); do
        ns=mcl$id-node$k
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # Made inside the node's namespace, so the host never holds either end.
        ip -n "$ns" link add "$IFACE" type veth peer name "p$k" netns "$br"
        ip -n "$ns" addr add "$SUBNET.$((k + 1))/24" dev "$IFACE"
        ip -n "$ns" link set "$IFACE" up
        ip -n "$br" link set "p$k" master br0
        ip -n "$br" link set "p$k" up
        if [ "$rate" != 0 ]; then
            shape "$ns" "$IFACE" "$rate" "$delay" "$burst"
            shape "$br" "p$k" "$rate" "$delay" "$burst"
        fi
        # The holder: UTS + mount namespaces inside the network namespace.
        # `ip netns exec` mounts the namespace's own /sys (so the node sees
        # its own /sys/class/net); unshare's private propagation keeps every
        # mount below away from the host.
        setsid ip netns exec "$ns" unshare --uts --mount --propagation private \
            sh -c 'hostname "$0" && mount -t tmpfs -o size=2g tmpfs /dev/shm &&
                   mount -t tmpfs -o size=1g tmpfs "$1/tmp" && mount --bind "$1/hosts" /etc/hosts &&
                   exec sleep infinity' "node$k" "$DIR" </dev/null >/dev/null 2>"$DIR/node$k.err" &
        echo $! >"$DIR/node$k.pid"
    done
    # The holder is ready when its hostname is set and its mounts are made.
    for k in $(seq 0 $((n - 1))); do
        local tries=0
        until [ "$(nsenter -t "$(holder "$k")" -u hostname 2>/dev/null)" = "node$k" ] &&
              nsenter -t "$(holder "$k")" -m -- sh -c "grep -q ' node$k\$' /etc/hosts &&
                   mountpoint -q '$DIR/tmp'" 2>/dev/null; do
            tries=$((tries + 1))
            if [ "$tries" -gt 100 ] || ! kill -0 "$(holder "$k")" 2>/dev/null; then
                cat "$DIR/node$k.err" >&2 || true
                cmd_down "$DIR"
                die "up: node$k did not start"
            fi
            sleep 0.05
        done
    done
    write_agent
    say "up: $n nodes in $DIR (rate ${rate}${burst:+, burst $burst B}, id $id) in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}') s"
}

shape() {  # shape NS DEV RATE DELAY [BURST]: tbf (and netem when asked and available)
    local ns=$1 dev=$2 rate=$3 delay=$4 burst=${5:-} bits
    bits=$(tc_bits "$rate")
    if [ -z "$burst" ]; then
        # At least one 4 ms timer tick of traffic, and a GSO packet (64 KiB).
        burst=$(( bits / 8 / 250 ))
        [ "$burst" -ge 131072 ] || burst=131072
    fi
    if [ -n "$delay" ]; then
        if ip netns exec "$ns" tc qdisc add dev "$dev" root handle 1: netem delay "$delay" 2>/dev/null; then
            ip netns exec "$ns" tc qdisc add dev "$dev" parent 1: handle 2: tbf rate "$rate" \
                burst "$burst" latency 100ms
            return
        fi
        say "delay $delay skipped: this kernel has no netem (tc qdisc netem failed); links are rate-shaped only"
    fi
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst "$burst" latency 100ms
}

tc_bits() {  # "1gbit" -> bits per second
    local v=${1,,} num unit
    num=${v%%[a-z]*}; unit=${v#"$num"}
    case $unit in
        gbit) echo $(( num * 1000000000 )) ;;
        mbit) echo $(( num * 1000000 )) ;;
        kbit) echo $(( num * 1000 )) ;;
        bit|"") echo "$num" ;;
        *) die "rate: expected a number with gbit, mbit or kbit, got $1" ;;
    esac
}

cmd_down() {
    local dir=${1:-}
    [ -n "$dir" ] || die "usage: down DIR"
    [ -f "$dir/cluster.env" ] || { say "down: $dir holds no cluster, nothing to do"; return 0; }
    DIR=$(cd "$dir" && pwd)
    # shellcheck disable=SC1091
    . "$DIR/cluster.env"
    local t0 k ns pid pids
    t0=$(date +%s.%N)
    # Every process in a node's network namespace was started by this cluster
    # (its holder, and what `run`/`exec` started there): TERM, then KILL.
    for sig in TERM KILL; do
        pids=""
        for k in $(seq 0 $((NODES - 1))); do
            ns=mcl$ID-node$k
            ip netns list | grep -q "^$ns\b" || continue
            pids+=" $(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')"
        done
        for f in "$DIR"/node*.pid; do [ -f "$f" ] && pids+=" $(cat "$f")"; done
        for pid in $pids; do kill -"$sig" "$pid" 2>/dev/null || true; done
        for _ in $(seq 40); do
            local alive=0
            for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive=1; done
            [ "$alive" = 0 ] && break
            sleep 0.05
        done
    done
    # Deleting a namespace deletes its veth ends (and with them their peers);
    # the mounts lived in the holders' mount namespaces, gone with them.
    for k in $(seq 0 $((NODES - 1))); do
        ip netns del "mcl$ID-node$k" 2>/dev/null || true
    done
    ip netns del "mcl$ID-br" 2>/dev/null || true
    if ip netns list | grep -q "^mcl$ID-"; then
        die "down: namespaces left: $(ip netns list | grep "^mcl$ID-" | tr '\n' ' ')"
    fi
    rm -rf "${DIR:?}/tmp" "$DIR"/*.pid "$DIR"/*.err "$DIR/agent" "$DIR/hosts" "$DIR"/hostfile* \
        "$DIR"/rankfile* "$DIR/cluster.env" "$DIR"/links.*
    say "down: $NODES nodes removed in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN{printf "%.2f", b-a}') s"
}

write_agent() {
    # Called by PRRTE as "agent [ssh options] HOST COMMAND-STRING" and by
    # Hydra as "agent [-x] HOST COMMAND ARGS...": both run the remote part
    # through a shell, so joining the words and running them with sh -c is
    # what ssh would do.
    cat >"$DIR/agent" <<EOF
#!/usr/bin/env bash
set -eu
while [ \$# -gt 0 ] && [ "\${1#-}" != "\$1" ]; do
    case \$1 in -o|-p|-l|-i) shift 2 ;; *) shift ;; esac
done
host=\${1:?agent: no host}; shift
k=\${host#node}
pid=\$(cat "$DIR/node\$k.pid" 2>/dev/null) || { echo "agent: no node \$host in $DIR" >&2; exit 255; }
exec nsenter -t "\$pid" -n -u -m -- env TMPDIR="$DIR/tmp" /bin/sh -c "\$*"
EOF
    chmod +x "$DIR/agent"
}

# --------------------------------------------------------------- counters
link_bytes() {  # link_bytes: "NODE TX RX" per node, as the node's mc0 counts them
    local k
    for k in $(seq 0 $((NODES - 1))); do
        echo "node$k $(in_node "$k" cat /sys/class/net/$IFACE/statistics/tx_bytes) \
$(in_node "$k" cat /sys/class/net/$IFACE/statistics/rx_bytes)"
    done
}

cmd_links() { state "${1:-}"; link_bytes; }

# ------------------------------------------------------------------- run
cmd_run() {
    local dir=${1:-}; [ -n "$dir" ] || die "usage: run DIR --venv V --mpi M (--ppn K|--ranks L) [--placement P] -- CMD"
    shift
    state "$dir"
    local venv="" mpi="" ppn="" ranks="" placement=block np=""
    while [ $# -gt 0 ]; do
        case $1 in
            --venv) venv=$2; shift 2 ;;
            --mpi) mpi=$2; shift 2 ;;
            --ppn) ppn=$2; shift 2 ;;
            --ranks) ranks=$2; shift 2 ;;
            --placement) placement=$2; shift 2 ;;
            --np) np=$2; shift 2 ;;
            --) shift; break ;;
            *) die "run: unknown option $1" ;;
        esac
    done
    [ $# -gt 0 ] || die "run: no command after --"
    [ -x "$venv/bin/python" ] || die "run: --venv: no $venv/bin/python"
    venv=$(cd "$venv" && pwd)
    case $mpi in openmpi|mpich) ;; *) die "run: --mpi: expected openmpi or mpich, got '$mpi'" ;; esac
    # The node of every rank, by the placement rule, from the slots per node.
    local -a slots=() where=()
    if [ -n "$ppn" ]; then
        [[ "$ppn" =~ ^[1-9][0-9]*$ ]] || die "run: --ppn: expected a positive integer, got $ppn"
        for _ in $(seq "$NODES"); do slots+=("$ppn"); done
    elif [ -n "$ranks" ]; then
        IFS=, read -r -a slots <<<"$ranks"
        [ "${#slots[@]}" -le "$NODES" ] || die "run: --ranks: ${#slots[@]} nodes given, the cluster has $NODES"
        local s; for s in "${slots[@]}"; do [[ "$s" =~ ^[0-9]+$ ]] || die "run: --ranks: bad count '$s'"; done
    elif [ "${placement%%:*}" != rankfile ]; then
        die "run: give --ppn K or --ranks K0,K1,... (or --placement rankfile:FILE)"
    fi
    local total=0 s k r; for s in "${slots[@]}"; do total=$((total + s)); done
    case $placement in
        block)
            for k in "${!slots[@]}"; do
                for _ in $(seq "${slots[$k]}"); do where+=("$k"); done
            done ;;
        round-robin|rr)
            placement=round-robin
            local -a left=("${slots[@]}")
            while [ "${#where[@]}" -lt "$total" ]; do
                for k in "${!left[@]}"; do
                    if [ "${left[$k]}" -gt 0 ]; then where+=("$k"); left[k]=$(( left[k] - 1 )); fi
                done
            done ;;
        rankfile:*)
            local f=${placement#rankfile:} line
            [ -f "$f" ] || die "run: --placement rankfile: no file $f"
            while read -r line; do
                [ -n "$line" ] || continue
                where+=("$(node_index "$line")")
            done <"$f"
            [ "${#where[@]}" -gt 0 ] || die "run: $f names no node" ;;
        *) die "run: --placement: expected block, round-robin or rankfile:FILE, got $placement" ;;
    esac
    [ -n "$np" ] || np=${#where[@]}
    [ "$np" -le "${#where[@]}" ] || die "run: --np $np is more than the ${#where[@]} slots"
    where=("${where[@]:0:$np}")
    # Slots: exactly the ranks each node gets (a node without ranks keeps one
    # slot, so that node numbers stay positions in the hostfile).
    slots=()
    for k in $(seq 0 $((NODES - 1))); do slots[k]=0; done
    for k in "${where[@]}"; do slots[k]=$(( slots[k] + 1 )); done
    local nodes_csv; nodes_csv=$(IFS=,; echo "${where[*]}")
    local hf=$DIR/hostfile rf=$DIR/rankfile
    : >"$hf"; : >"$rf"
    local -a launch
    if [ "$mpi" = openmpi ]; then
        for k in "${!slots[@]}"; do
            [ "${slots[$k]}" -eq 0 ] || echo "node$k slots=${slots[$k]}" >>"$hf"
        done
        local -a used=()
        for r in "${!where[@]}"; do
            k=${where[$r]}; echo "rank $r=node$k slot=${used[$k]:-0}" >>"$rf"
            used[k]=$(( ${used[$k]:-0} + 1 ))
        done
        launch=("$venv/bin/mpirun" --allow-run-as-root --hostfile "$hf" -n "$np"
                --prtemca plm_ssh_agent "$DIR/agent" --prtemca plm_ssh_no_tree_spawn 1
                --prtemca oob_tcp_if_include "$IFACE"
                --mca pml ob1 --mca btl tcp,sm,self --mca btl_tcp_if_include "$IFACE"
                --mca mpi_yield_when_idle 1 --bind-to none --wdir "$PWD")
        # The launcher's own mappers for its own placements; the rankfile for
        # any other.
        case $placement in
            block) launch+=(--map-by slot) ;;
            round-robin) launch+=(--map-by node) ;;
            *) launch+=(--map-by "rankfile:file=$rf") ;;
        esac
        launch+=(-x PATH -x PYTHONPATH -x MPICOLL_CLUSTER_NODES -x TMPDIR)
        local v; for v in $(compgen -e | grep -E '^(MPICOLL_|OMPI_MCA_|PYTEST_)' || true); do launch+=(-x "$v"); done
    else
        # Hydra: node ids in -rankmap are positions in the hostfile, which
        # lists every node (one line per host: two lines for one host would
        # be two "nodes" to MPICH's shared-memory split).
        for k in "${!slots[@]}"; do
            s=${slots[$k]}; [ "$s" -gt 0 ] || s=1
            echo "node$k:$s" >>"$hf"
        done
        launch=("$venv/bin/mpiexec" -launcher ssh -launcher-exec "$DIR/agent" -iface "$IFACE"
                -f "$hf" -n "$np" -rankmap "$nodes_csv" -wdir "$PWD"
                -genv UCX_TLS tcp,self -genv UCX_NET_DEVICES "$IFACE"
                -genv MPICOLL_CLUSTER_NODES "$nodes_csv" -genv TMPDIR "$DIR/tmp")
    fi
    say "run: $np ranks, $mpi, placement $placement, nodes of ranks $nodes_csv"
    local before after rc=0
    before=$(link_bytes)
    in_node 0 env MPICOLL_CLUSTER_NODES="$nodes_csv" PATH="$venv/bin:$PATH" \
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        "${launch[@]}" "$@" || rc=$?
    after=$(link_bytes)
    # Per-node bytes this run moved on its link (tx = node to bridge).
    paste -d' ' <(echo "$before") <(echo "$after") | awk '{printf "cluster: %s tx %.0f rx %.0f\n", $1, $5-$2, $6-$3}' \
        | tee "$DIR/links.last" >&2
    return "$rc"
}

cmd_exec() {
    state "${1:-}"; local k; k=$(node_index "${2:-}"); shift 2
    in_node "$k" "$@"
}

cmd_with() {
    local n=${1:-}; shift || true
    local -a upargs=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do upargs+=("$1"); shift; done
    [ "${1:-}" = -- ] || die "usage: with N [--rate R] [--burst B] -- COMMAND"
    shift
    local d; d=$(mktemp -d "${TMPDIR:-/tmp}/mpicoll-cluster.XXXXXX")
    # shellcheck disable=SC2064
    trap "bash '$HERE/cluster.sh' down '$d' || true; rmdir '$d' 2>/dev/null || true" EXIT
    trap 'exit 130' INT TERM
    cmd_up "$d" "$n" "${upargs[@]}"
    local rc=0
    CLUSTER_DIR=$d "$@" || rc=$?
    return "$rc"
}

case ${1:-} in
    up) shift; cmd_up "$@" ;;
    down) shift; need_tools; cmd_down "$@" ;;
    run) shift; cmd_run "$@" ;;
    exec) shift; cmd_exec "$@" ;;
    links) shift; cmd_links "$@" ;;
    with) shift; cmd_with "$@" ;;
    -h|--help|"") sed -n '2,/^# =====/p' "$0" | sed 's/^# \{0,1\}//' | sed '$d'; [ -n "${1:-}" ] ;;
    *) die "unknown command '$1' (up, run, exec, links, down, with; --help)" ;;
esac
