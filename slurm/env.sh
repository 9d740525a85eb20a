# The environment of hpcpar's SLURM jobs. Sourced by slurm/*.sbatch from the repository root, and
# usable by hand or in `sbatch --wrap` commands:  . slurm/env.sh && mpiexec -n 4 hpcpar info
# Plain POSIX sh, because --wrap commands run under /bin/sh.
#
# Python environment. Here: the repository's .venv (what `make test` creates), or HPCPAR_VENV.
# On a cluster, load the site's modules instead and activate a venv built on top of them, e.g.
#     module load gcc/12.2 openmpi/4.1.6 cuda/12.4 hdf5/1.14 python/3.11
#     . "$HOME/venvs/hpcpar/bin/activate"
#
# mpi4py must talk to the MPI that srun starts on the cluster, not to the MPICH wheel that the
# `mpich` extra installs for laptops and CI (that wheel runs on one node and over TCP only).
# Build it from source against the module's MPI, in the venv, without the `mpich` extra:
#     env MPICC="$(which mpicc)" python -m pip install --no-cache-dir --no-binary=mpi4py mpi4py
#     python -m mpi4py --mpi-lib-version       # must name the cluster's MPI, not "MPICH 5 (PyPI)"
# and start the ranks with the srun MPI plugin that MPI was built for (`srun --mpi=list`; MPICH
# and Intel MPI: pmi2, Open MPI 4/5: pmix), or with that MPI's own mpiexec (HPCPAR_LAUNCHER).
#
# GPUs: hpcpar binds rank i of a node to GPU (node-local rank) % (visible GPUs), so request one
# task per GPU (--ntasks-per-node = --gpus-per-node). Without a CUDA-aware MPI, GPU buffers are
# staged through host memory. With Open MPI built --with-cuda (check:
#     ompi_info --parsable --all | grep mpi_built_with_cuda_support:value
# ) buffers go GPU to GPU; `hpcpar info` shows what was detected, and HPCPAR_CUDA_AWARE=0|1
# overrides the detection when a library misreports.

HPCPAR_ROOT=${HPCPAR_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
HPCPAR_VENV=${HPCPAR_VENV:-$HPCPAR_ROOT/.venv}
if [ -x "$HPCPAR_VENV/bin/python" ] && [ "${VIRTUAL_ENV:-}" != "$HPCPAR_VENV" ]; then
    VIRTUAL_ENV=$HPCPAR_VENV
    PATH=$VIRTUAL_ENV/bin:$PATH
    export VIRTUAL_ENV PATH
fi
export HPCPAR_ROOT

# One BLAS/OpenMP thread per CPU given to the task: more threads than CPUs fight each other
# (and every rank of a node would start one thread per core of the whole node).
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK
fi
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OPENBLAS_NUM_THREADS=$OMP_NUM_THREADS
MKL_NUM_THREADS=$OMP_NUM_THREADS
export OMP_NUM_THREADS OPENBLAS_NUM_THREADS MKL_NUM_THREADS

# HDF5 locks files with flock(), which Lustre and GPFS often refuse ("unable to lock file") or
# serialize. hpcpar never opens one checkpoint file from two writers (one shard file per rank,
# the master file written by one rank, committed by rename), so the lock buys nothing.
export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}

# Lines of all ranks reach the log as they are printed, not when a buffer fills.
export PYTHONUNBUFFERED=1

if ! command -v hpcpar >/dev/null 2>&1; then
    echo "slurm/env.sh: no hpcpar on PATH (looked for a venv at $HPCPAR_VENV); run \`make setup\` in $HPCPAR_ROOT or activate the environment that has hpcpar installed" >&2
    return 1 2>/dev/null || exit 1
fi
