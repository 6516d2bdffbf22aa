# shellcheck shell=bash
# =============================================================================
# The shared part of the mpicoll jobscripts: sourced by cpu.sbatch,
# gpu_single_node.sbatch and multi_node.sbatch, never run on its own.
#
# A jobscript sets its MPICOLL_* settings (see any .sbatch's SITE SETTINGS),
# sources this file and then calls the steps it wants, in order:
#
#     job_setup            checks, modules + venv, launcher, a summary line
#     step_world_size      1. MPI world size must equal SLURM_NTASKS
#     step_verify          2. python -m mpicoll.verify
#     step_allreduce_example  3. python examples/allreduce.py
#     step_tune            (optional) python -m mpicoll.tune: measures, writes the
#                          tuning file "auto" reads (MPICOLL_TUNE=1 turns it on)
#     step_bench           4. python -m mpicoll.bench
#     job_done             "mpicoll-job: all steps passed"
#
# Every step runs through launch() (srun or the MPI's mpirun) and the job
# stops at the first failing step with that step's exit status. Nothing
# here is site-specific: edit the .sbatch files, not this one.
# =============================================================================
if [[ ${BASH_SOURCE[0]} == "$0" ]]; then
    echo "mpicoll-job: ERROR: $0 is sourced by the jobscripts; submit one of them with sbatch" >&2
    exit 2
fi
set -euo pipefail

log() { printf 'mpicoll-job: %s\n' "$*"; }
die() { printf 'mpicoll-job: ERROR: %s\n' "$*" >&2; exit 1; }

# job_setup: check the job, activate modules and venv, prepare the options
# of the programs and of the launcher, and print what the job will use.
job_setup() {
    [[ -n ${SLURM_JOB_ID:-} ]] || die "not inside a Slurm job: submit this script with sbatch"
    [[ -n ${SLURM_NTASKS:-} ]] || die "SLURM_NTASKS is not set: request tasks (--ntasks or --ntasks-per-node)"
    cd "$MPICOLL_DIR" || die "cannot cd to MPICOLL_DIR=$MPICOLL_DIR"

    # ---- Environment activation point: modules first, then the venv. -------
    if [[ -n $MPICOLL_MODULES ]]; then
        if ! command -v module >/dev/null 2>&1; then
            # Batch shells are not login shells; initialise Lmod / Environment
            # Modules by hand where the site did not do it already.
            local init
            for init in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh \
                        /usr/share/lmod/lmod/init/bash /usr/share/modules/init/bash; do
                # shellcheck disable=SC1090
                if [[ -r $init ]]; then set +u; source "$init"; set -u; break; fi
            done
        fi
        command -v module >/dev/null 2>&1 || die "MPICOLL_MODULES is set but no 'module' command exists"
        set +u  # module init scripts are rarely 'set -u' clean
        # shellcheck disable=SC2086  # a space-separated list of module names
        module load $MPICOLL_MODULES
        set -u
    fi
    if [[ $MPICOLL_VENV != none ]]; then
        [[ -x $MPICOLL_VENV/bin/$MPICOLL_PYTHON ]] ||
            die "no $MPICOLL_PYTHON in MPICOLL_VENV=$MPICOLL_VENV/bin (edit MPICOLL_VENV or set it to 'none')"
        # The same as `source $MPICOLL_VENV/bin/activate`, minus the prompt logic.
        export VIRTUAL_ENV=$MPICOLL_VENV
        export PATH=$MPICOLL_VENV/bin:$PATH
    fi
    command -v "$MPICOLL_PYTHON" >/dev/null 2>&1 || die "$MPICOLL_PYTHON is not on PATH"

    # ---- Options for the programs and the launcher. -------------------------
    DEVICE_ARGS=()
    [[ -z $MPICOLL_DEVICE ]] || DEVICE_ARGS=(--device "$MPICOLL_DEVICE")
    VERIFY_ARGS=() BENCH_ARGS=()
    read -ra VERIFY_ARGS <<<"$MPICOLL_VERIFY_ARGS"
    read -ra BENCH_ARGS <<<"$MPICOLL_BENCH_ARGS"
    read -ra TUNE_ARGS <<<"${MPICOLL_TUNE_ARGS:-}"

    # GPU binding. "library": every rank sees all GPUs of its node and
    # mpicoll (--device gpu) selects the GPU whose index is the rank's
    # node-local rank (mpicoll.bind_device()); this keeps CUDA IPC between
    # ranks possible. "env": a wrapper sets CUDA_VISIBLE_DEVICES of each rank
    # to one entry of the node's GPU list, picked by the node-local rank (from
    # the MPI launcher's variable, or SLURM_LOCALID under srun), so each rank
    # sees exactly one GPU. "none": leave it all to the site (e.g. srun
    # --gpus-per-task=1 --gpu-bind=... in MPICOLL_SRUN_ARGS). The "env"
    # wrapper is applied whatever the device, so that it can be checked on
    # CPU-only machines (CI does).
    RANK_PREFIX=()
    case $MPICOLL_GPU_BIND in
        env)
            # shellcheck disable=SC2016  # expanded by the per-rank bash, not here
            RANK_PREFIX=(bash -c '
                lr=${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${SLURM_LOCALID:-0}}}
                IFS=, read -ra gpus <<<"${CUDA_VISIBLE_DEVICES:-}"
                if ((${#gpus[@]} > 0)); then
                    export CUDA_VISIBLE_DEVICES=${gpus[lr % ${#gpus[@]}]}
                else
                    export CUDA_VISIBLE_DEVICES=$lr
                fi
                exec "$@"' mpicoll-bind)
            ;;
        library | none) ;;
        *) die "MPICOLL_GPU_BIND must be library, env or none, not '$MPICOLL_GPU_BIND'" ;;
    esac

    local launcher_desc
    case $MPICOLL_LAUNCHER in
        srun) launcher_desc="srun --mpi=$MPICOLL_SRUN_MPI $MPICOLL_SRUN_ARGS" ;;
        mpirun) launcher_desc="$MPICOLL_MPIRUN -n $SLURM_NTASKS $MPICOLL_MPIRUN_ARGS" ;;
        *) die "MPICOLL_LAUNCHER must be srun or mpirun, not '$MPICOLL_LAUNCHER'" ;;
    esac
    log "job $SLURM_JOB_ID: ${SLURM_JOB_NUM_NODES:-1} node(s) [${SLURM_JOB_NODELIST:-?}]," \
        "$SLURM_NTASKS tasks, launcher: ${launcher_desc% }, device: ${MPICOLL_DEVICE:-default}," \
        "GPU binding: $MPICOLL_GPU_BIND, directory: $PWD"
    log "shared part: ${BASH_SOURCE[0]}"
    if [[ $MPICOLL_DEVICE == gpu && -z ${CUDA_VISIBLE_DEVICES:-} && -z ${SLURM_GPUS_ON_NODE:-} ]]; then
        log "WARNING: --device gpu but Slurm allocated no GPU to this job (no CUDA_VISIBLE_DEVICES," \
            "no SLURM_GPUS_ON_NODE); for a CPU-only run set MPICOLL_DEVICE=cpu"
    fi
    "$MPICOLL_PYTHON" -c 'import sys, mpi4py, numpy
print("mpicoll-job: python %s (%s), mpi4py %s, numpy %s"
      % (sys.executable, sys.version.split()[0], mpi4py.__version__, numpy.__version__))' ||
        die "$MPICOLL_PYTHON cannot import mpi4py and numpy"
    STEP=0
}

# launch CMD...: start CMD as SLURM_NTASKS MPI ranks with the chosen launcher.
launch() {
    local -a extra=()
    case $MPICOLL_LAUNCHER in
        srun)
            read -ra extra <<<"$MPICOLL_SRUN_ARGS"
            # Slurm 22.05 srun does not inherit --cpus-per-task from sbatch.
            if [[ -n ${SLURM_CPUS_PER_TASK:-} ]]; then
                extra=(--cpus-per-task="$SLURM_CPUS_PER_TASK" ${extra[@]+"${extra[@]}"})
            fi
            # --kill-on-bad-exit: one failing rank ends the step instead of
            # leaving the others blocked in a collective until the time limit.
            srun --mpi="$MPICOLL_SRUN_MPI" --kill-on-bad-exit=1 ${extra[@]+"${extra[@]}"} \
                ${RANK_PREFIX[@]+"${RANK_PREFIX[@]}"} "$@"
            ;;
        mpirun)
            read -ra extra <<<"$MPICOLL_MPIRUN_ARGS"
            "$MPICOLL_MPIRUN" -n "$SLURM_NTASKS" ${extra[@]+"${extra[@]}"} \
                ${RANK_PREFIX[@]+"${RANK_PREFIX[@]}"} "$@"
            ;;
        *) die "MPICOLL_LAUNCHER must be srun or mpirun, not '$MPICOLL_LAUNCHER'" ;;
    esac
}

# run_step NAME CMD...: launch CMD, announce it, stop the job if it fails.
run_step() {
    local name=$1 t0=$SECONDS rc=0
    shift
    STEP=$((STEP + 1))
    log "step $STEP ($name): $*"
    launch "$@" || rc=$?
    if ((rc != 0)); then
        log "step $STEP ($name): FAILED with exit status $rc after $((SECONDS - t0)) s"
        exit "$rc"
    fi
    log "step $STEP ($name): OK in $((SECONDS - t0)) s"
}

# Step: the world size must equal SLURM_NTASKS. srun with a missing or wrong
# --mpi plugin does not fail: every task initialises MPI alone and the job
# "succeeds" as N one-rank runs. Rank 0 also lists where each rank runs. The
# expected size is an argument: under mpirun the ranks may see another
# SLURM_NTASKS (Open MPI's daemons are started by a one-task srun).  A
# world on fewer hosts than the job has nodes is only warned about: the
# launcher's mapping put it there (Open MPI's mpirun --oversubscribe maps by
# core, which fills the first node with every rank).
WORLD_CHECK='import os, sys
from mpi4py import MPI
c = MPI.COMM_WORLD
want, nodes = int(sys.argv[1]), int(sys.argv[2])
local = c.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
me = "host %s (slurm node %s), node-local rank %d, CUDA_VISIBLE_DEVICES=%s" % (
    MPI.Get_processor_name(), os.environ.get("SLURMD_NODENAME", "?"), local,
    os.environ.get("CUDA_VISIBLE_DEVICES", "unset"))
everyone = c.gather((me, MPI.Get_processor_name()))
if c.rank == 0:
    print("mpicoll-job: MPI world size %d (SLURM_NTASKS=%d), %s"
          % (c.size, want, MPI.Get_library_version().splitlines()[0].strip()))
    for r, (where, _) in enumerate(everyone):
        print("mpicoll-job:   rank %d: %s" % (r, where))
    hosts = len({host for _, host in everyone})
    if hosts < nodes:
        print("mpicoll-job: WARNING: the %d ranks run on %d host(s), the job has %d nodes:"
              " check how the launcher maps ranks (MPICOLL_LAUNCHER=mpirun with Open MPI:"
              " --map-by slot:OVERSUBSCRIBE, not --oversubscribe)" % (c.size, hosts, nodes))
    sys.stdout.flush()
sys.exit(0 if c.size == want else 3)'
step_world_size() {
    STEP=$((STEP + 1))
    log "step $STEP (world-size): MPI world size must be $SLURM_NTASKS"
    if ! launch "$MPICOLL_PYTHON" -c "$WORLD_CHECK" "$SLURM_NTASKS" "${SLURM_JOB_NUM_NODES:-1}"; then
        die "step $STEP (world-size): FAILED: expected ONE MPI job of $SLURM_NTASKS ranks. If the" \
            "lines above say 'MPI world size 1', the launcher started $SLURM_NTASKS separate" \
            "one-rank jobs: srun needs --mpi=pmix for Open MPI >= 5 or --mpi=pmi2 for MPICH" \
            "(set MPICOLL_SRUN_MPI; 'srun --mpi=list' shows what this Slurm offers), or use" \
            "MPICOLL_LAUNCHER=mpirun. Current: MPICOLL_LAUNCHER=$MPICOLL_LAUNCHER" \
            "MPICOLL_SRUN_MPI=$MPICOLL_SRUN_MPI."
    fi
    log "step $STEP (world-size): OK"
}

# Step: every collective, type and op against MPI's built-in.
step_verify() {
    run_step verify "$MPICOLL_PYTHON" -m mpicoll.verify ${VERIFY_ARGS[@]+"${VERIFY_ARGS[@]}"} \
        ${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"}
}

# Step: the AllReduce example (every rank prints n(n+1)/2, then OK).
step_allreduce_example() {
    run_step allreduce-example "$MPICOLL_PYTHON" examples/allreduce.py \
        ${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"}
}

# Step (optional, MPICOLL_TUNE=1): measure this MPI, network and layout and
# write the tuning file algorithm="auto" reads (by default this MPI library's
# file in the user's cache directory; MPICOLL_TUNE_ARGS="-o PATH" elsewhere,
# then export MPICOLL_TUNING=PATH for later jobs). A later bench step in the
# same job uses it. Host buffers: the tuning measures the host algorithms.
step_tune() {
    if [[ ${MPICOLL_TUNE:-0} != 1 ]]; then
        log "tune: skipped (set MPICOLL_TUNE=1 to measure and write the tuning file)"
        return 0
    fi
    run_step tune "$MPICOLL_PYTHON" -m mpicoll.tune ${TUNE_ARGS[@]+"${TUNE_ARGS[@]}"}
}

# Step: the nccl-tests style benchmark table.
step_bench() {
    run_step bench "$MPICOLL_PYTHON" -m mpicoll.bench ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} \
        ${DEVICE_ARGS[@]+"${DEVICE_ARGS[@]}"}
}

job_done() { log "all steps passed"; }
