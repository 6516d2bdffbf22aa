# shellcheck shell=bash
# The test matrix: which runs `bash tests/run_tests.sh` makes under each MPI library
# (.ci/run runs it once per MPI), and the torch group's runs (.ci/run's torch section,
# in a venv with torch).  Sourced by both; tests/README.md explains the groups.
#
# One row per run (a line that starts with a blank continues the row above):
#   matrix   openmpi or mpich: the MPI library run_tests.sh finds (--matrix picks another)
#   group    launch, local: plain pytest (ranks "-"); mpi: under the launcher, once per
#            rank count listed; verify: `python -m mpicoll.verify` at that rank count;
#            torch: under the launcher at each count (run by .ci/run, not run_tests.sh)
#   ranks    the rank counts ("-" for plain pytest)
#   the rest the pytest paths and arguments of the run (verify: its arguments)
#
# Open MPI runs every test at every rank count its marker names (the full matrix:
# `--matrix openmpi` runs it under MPICH too).  MPICH leaves out what cannot depend on
# the MPI library, which Open MPI's runs cover:
# - the examples (tests/launch/test_launch_examples.py): they use mpicoll through the
#   API MPICH's mpi runs test, and MPICH's own launch paths are tested by the other
#   launch tests and the SLURM jobs (examples/allreduce.py under srun and mpiexec);
# - the schedule simulator (tests/algorithms/test_schedules.py and
#   test_shared_schedules.py: NumPy on simulated ranks) and conftest.py's --group selection (tests/project/test_groups.py: plain
#   pytest collections);
# - the ring at every window 1-64 (test_workmem.py::test_ring_every_window: 8-byte
#   segments, the window's slot arithmetic, MPICH's longest 3-rank test), whose
#   messages MPI matches by the non-overtaking rule alone;
# - the mpi runs at 2 and 5 ranks (the schedules do not depend on the MPI library; what
#   does, matching, progress and the timeouts, shows at 3, not a power of two, and at
#   4, the timeout tests of several steps); at 4 ranks only the files of those tests
#   (timeouts, progress and completion order, the executor, communicators): the whole
#   suite there spends most of its time in schedules, which Open MPI's 4-rank run
#   covers.
# The torch group: every test's data depends on rank and size, so Open MPI at 3 ranks
# and MPICH at 2 prove what runs at both counts with both MPIs would.
MATRIX='
openmpi  launch  -          tests
openmpi  local   -          tests
openmpi  mpi     1 2 3 4 5  tests
openmpi  verify  4          --quick
openmpi  torch   3          tests/torch

mpich    launch  -          tests --ignore=tests/launch/test_launch_examples.py
mpich    local   -          tests --ignore=tests/algorithms/test_schedules.py
                            --ignore=tests/algorithms/test_shared_schedules.py
                            --ignore=tests/project/test_groups.py
mpich    mpi     1 3        tests --deselect=tests/engine/test_workmem.py::test_ring_every_window
mpich    mpi     4          tests/transport/test_timeout.py tests/api/test_nonblocking.py
                            tests/engine/test_progress.py tests/engine/test_communicators.py
mpich    verify  4          --quick
mpich    torch   2          tests/torch
'

# matrix_rows MATRIX GROUP: one line per row of that matrix and group, "RANKS|ARGUMENTS"
# (RANKS: the counts, space-separated, or "-"); nothing if there is none.
matrix_rows() {
    awk -v want="$1" -v group="$2" '
        function emit(   n, f, i, ranks, args) {
            if (row == "") return
            n = split(row, f, /[ \t]+/)
            if (f[1] != want || f[2] != group) return
            ranks = ""
            for (i = 3; i <= n && f[i] ~ /^([0-9]+|-)$/; i++) ranks = ranks (ranks == "" ? "" : " ") f[i]
            args = ""
            for (; i <= n; i++) args = args (args == "" ? "" : " ") f[i]
            print ranks "|" args
        }
        /^[ \t]*$/ { next }
        /^[ \t]/ { sub(/^[ \t]+/, ""); row = row " " $0; next }
        { emit(); row = $0 }
        END { emit() }' <<<"$MATRIX"
}

# matrix_names: the matrices the table has, one a line
matrix_names() {
    awk 'NF && $0 !~ /^[ \t]/ { print $1 }' <<<"$MATRIX" | sort -u
}
