#!/usr/bin/env bash
# Install what the tests need (launch/setup.sh), then run the whole suite: ruff's lint and format check, the serial
# tests, then the MPI tests under 1, 2 and 4 ranks (oversubscribed where the machine has fewer cores), each under a
# timeout, with the venv's mpirun (Open MPI's or MPICH's Hydra). CROSSBOW_TEST_MPI_ONLY=1 runs only the MPI tests.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/launch/setup.sh"
# shellcheck source=/dev/null  # the venv is made above
source "${CROSSBOW_VENV:-$root/.venv}/bin/activate"
cd "$root"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
per_run_timeout=${CROSSBOW_TEST_TIMEOUT:-600}
oversubscribe=()
mpirun --version 2>/dev/null | grep -q "Open MPI" && oversubscribe=(--oversubscribe)

status=0
if [ "${CROSSBOW_TEST_MPI_ONLY:-0}" != 1 ]; then
    echo "== ruff (pyproject.toml)"
    ruff check . || status=$?
    ruff format --check . || status=$?
    echo "== serial tests"
    python -m pytest -q --durations=15 -m "not mpi" tests "$@" || status=$?
fi
for ranks in 1 2 4; do
    echo "== MPI tests on $ranks rank(s) ($(mpirun --version 2>&1 | grep -m1 -E 'Open MPI|Version:' | tr -s ' '))"
    MPIEXEC_TIMEOUT=$per_run_timeout timeout --kill-after=10 "$per_run_timeout" \
        mpirun -n "$ranks" ${oversubscribe[@]+"${oversubscribe[@]}"} python tests/mpi_pytest.py -q -m mpi --with-mpi tests "$@" \
        || status=$?
done
exit $status
