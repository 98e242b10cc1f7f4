#!/usr/bin/env bash
# Install what is needed (launch/setup.sh), then train on this machine with $RANKS ranks (default 2).
# Extra arguments go to `python -m crossbow_mpi.train`. The ranks are not bound to cores, so each takes its
# share of the machine's cores as its threads (--threads 0).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/launch/setup.sh"
# shellcheck source=/dev/null
source "${CROSSBOW_VENV:-$root/.venv}/bin/activate"
cd "$root"
# shellcheck source=launch/common.sh
source launch/common.sh
ranks=${RANKS:-2}
mpi_args=()
if mpirun --version 2>/dev/null | grep -q "Open MPI"; then
    mpi_args+=(--oversubscribe --bind-to none)
    [ "$(id -u)" = 0 ] && export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# mpirun answers SIGTERM and SIGINT by killing the ranks within half a second, too soon for a checkpoint; it
# forwards SIGUSR1, on which every rank writes one and exits 75. So this script turns the first two into the third,
# and runs mpirun in a session of its own, out of reach of the terminal's Ctrl-C.
train_args=(${ft_train[@]+"${ft_train[@]}"} "$@")
check_flags ${train_args[@]+"${train_args[@]}"} || exit $?
setsid mpirun -n "$ranks" ${mpi_args[@]+"${mpi_args[@]}"} ${ft_mpirun[@]+"${ft_mpirun[@]}"} \
    python -m crossbow_mpi.train ${train_args[@]+"${train_args[@]}"} < /dev/null &
pid=$!
trap 'kill -USR1 "$pid" 2>/dev/null || true' TERM INT
while kill -0 "$pid" 2>/dev/null; do wait "$pid" || true; done
wait "$pid"
