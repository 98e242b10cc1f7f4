# shellcheck shell=bash
# Shared by launch/slurm.sbatch and launch/pbs.sh; source it from the repository root.
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
