#!/usr/bin/env bash
# PBS Pro / Torque: one rank per GPU; each rank picks its GPU from its local rank (crossbow_mpi.runtime).
# Submit from the repository root:  qsub launch/pbs.sh
#PBS -N crossbow
#PBS -l select=2:ncpus=64:ngpus=8:mpiprocs=8
#PBS -l walltime=04:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-$PWD}"
source "${CROSSBOW_VENV:-$PWD/.venv}/bin/activate"
ranks=$(wc -l < "$PBS_NODEFILE")
mpirun -np "$ranks" --hostfile "$PBS_NODEFILE" --map-by ppr:8:node --bind-to none \
    python -m crossbow_mpi.train --device cuda --run-dir "runs/pbs-${PBS_JOBID%%.*}" ${TRAIN_ARGS:-}
