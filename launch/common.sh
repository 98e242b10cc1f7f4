# shellcheck shell=bash
# Shared by launch/local.sh, launch/slurm.sbatch and launch/pbs.sh; source it from the repository root.
# Whether to resume and whether to submit again are read from the run's own files, never from the launcher's
# exit code (srun and mpirun report the signal of a rank they killed instead of the code it was exiting with).

# Print the number of records in RUN_DIR/metrics.jsonl (0 when there is none yet).
record_count() {
    if [ -f "$1/metrics.jsonl" ]; then wc -l < "$1/metrics.jsonl"; else echo 0; fi
}

# Succeed when RUN_DIR holds a checkpoint to resume from.
has_checkpoint() {
    compgen -G "$1/checkpoint-*.h5" > /dev/null
}

# Succeed when the records that RUN_DIR's run wrote after its first N include the stop on a signal: the
# `preempted` event, which rank 0 writes after the checkpoint is complete.
stopped_by_signal() {
    [ -f "$1/metrics.jsonl" ] &&
        awk -v skip="$2" 'NR > skip && /^\{"event": "preempted"/ { found = 1 } END { exit !found }' "$1/metrics.jsonl"
}

# Refuse bad training flags with crossbow_mpi's one line before the launcher starts any rank: after a rank's refusal
# the launcher adds its own report of a failed job.
check_flags() {
    python -c 'import sys; from crossbow_mpi.train import check; sys.exit(check(sys.argv[1:]))' "$@"
}

# With CROSSBOW_FT=1 a rank that dies (a killed process) does not end the job: mpirun's flag for
# Open MPI 5's ULFM, and the training flag that goes on with the survivors (docs/failures.md). Flags given to the
# script come later, so they override it.
# shellcheck disable=SC2034  # used by the scripts that source this file
if [ "${CROSSBOW_FT:-0}" = 1 ]; then
    ft_mpirun=(--with-ft ulfm) ft_train=(--on-rank-loss continue)
else
    ft_mpirun=() ft_train=()
fi

# hwloc's OpenCL plugin loads LLVM (through pocl) into mpirun, and LLVM takes SIGUSR1 over: the stop signal these
# scripts send to mpirun would never reach the ranks (seen with Open MPI 4.1 on a GPU machine: docs/failures.md).
export HWLOC_COMPONENTS=${HWLOC_COMPONENTS:--opencl}
