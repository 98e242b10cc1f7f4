#!/usr/bin/env bash
# Install what the tests need (launch/setup.sh), then run the whole suite: ruff's lint and format check, mypy, the
# documentation's strict build (where mkdocs.yml exists), the serial tests, then the MPI tests under 1, 2 and 4 ranks
# (oversubscribed where the machine has fewer cores), each under a timeout, with the venv's mpirun (Open MPI's or
# MPICH's Hydra). `--fast` (first argument) leaves out the tests marked slow and runs the MPI tests under 2 ranks
# only: a few minutes. The serial tests run in CROSSBOW_TEST_WORKERS pytest-xdist processes (default 2: one at a time
# they kept about 1.3 of 2 cores busy; 0 runs them in pytest's own process). CROSSBOW_TEST_MPI_ONLY=1
# runs only the MPI tests. Other arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fast=0
if [ "${1:-}" = --fast ]; then
    fast=1
    shift
fi
"$root/launch/setup.sh"
# shellcheck source=/dev/null  # the venv is made above
source "${CROSSBOW_VENV:-$root/.venv}/bin/activate"
cd "$root"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1 NO_MKDOCS_2_WARNING=1
# Open MPI's shared-memory segments (/dev/shm) and session directories (/tmp) outlive the jobs whose ranks a test
# kills, and a later job that draws a stale one's name can crash in btl/sm or fail to start its PMIx listener
# (seen after a day of runs on one machine): each suite run keeps them, and every test's files, in its own directory.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
export TMPDIR=$scratch OMPI_MCA_btl_sm_backing_directory=$scratch
per_run_timeout=${CROSSBOW_TEST_TIMEOUT:-600}
oversubscribe=()
mpirun --version 2>/dev/null | grep -q "Open MPI" && oversubscribe=(--oversubscribe)
if [ "$fast" = 1 ]; then
    serial=(-m "not mpi and not slow") mpi=(-m "mpi and not slow") all_ranks=(2)
else
    serial=(-m "not mpi") mpi=(-m mpi) all_ranks=(1 2 4)
fi

status=0
if [ "${CROSSBOW_TEST_MPI_ONLY:-0}" != 1 ]; then
    echo "== ruff (pyproject.toml)"
    ruff check . || status=$?
    ruff format --check . || status=$?
    echo "== mypy (pyproject.toml)"
    mypy || status=$?
    if [ -f mkdocs.yml ]; then
        echo "== mkdocs build --strict"
        site=$(mktemp -d)
        mkdocs build --strict -q -d "$site" || status=$?
        rm -rf "$site"
    fi
    echo "== serial tests"
    python -m pytest -q --durations=15 -n "${CROSSBOW_TEST_WORKERS:-2}" "${serial[@]}" tests "$@" || status=$?
fi
for ranks in "${all_ranks[@]}"; do
    echo "== MPI tests on $ranks rank(s) ($(mpirun --version 2>&1 | grep -m1 -E 'Open MPI|Version:' | tr -s ' '))"
    MPIEXEC_TIMEOUT=$per_run_timeout timeout --kill-after=10 "$per_run_timeout" \
        mpirun -n "$ranks" ${oversubscribe[@]+"${oversubscribe[@]}"} python tests/mpi_pytest.py -q "${mpi[@]}" --with-mpi \
        tests "$@" || status=$?
done
exit $status
