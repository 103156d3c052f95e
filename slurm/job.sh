# The body of slurm/*.sbatch (sourced): one launcher per node through srun, and a requeue when the
# job is about to lose its nodes. SLURM sends USR1 120 s before the time limit (--signal=B:USR1@120)
# and TERM on preemption; either way the ranks are told to checkpoint (SIGTERM through srun and the
# launcher), the script waits for them, and puts the job back in the queue, where --resume auto
# continues it.
cd "${SLURM_SUBMIT_DIR:-.}"
if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi   # the repository's venv (make setup)
set -euo pipefail
config=$1
recipe=${2:?usage: sbatch slurm/<mode>.sbatch <recipe.yaml> [--section.key=value ...]}
shift 2
srun_pid=
requeue() {
    echo "[slurm] $1: the ranks checkpoint, then job ${SLURM_JOB_ID:-?} goes back to the queue"
    if [ -n "$srun_pid" ]; then kill -TERM "$srun_pid" 2>/dev/null || true; fi
    status=0
    wait "$srun_pid" || status=$?
    if [ "$status" -eq 0 ]; then   # the run had already finished: nothing to continue
        echo "[slurm] the run had finished; not requeued"
        exit 0
    fi
    scontrol requeue "${SLURM_JOB_ID:?}" || true
    exit 0
}
trap 'requeue "time limit in 120 s (USR1)"' USR1
trap 'requeue "preempted (TERM)"' TERM
# srun (Slurm 22.05+) does not inherit --cpus-per-task from the batch job: pass it on, or each node's
# launcher and all its ranks share one CPU. No --kill-on-bad-exit: on preemption every launcher exits
# non-zero, and one node's exit must not kill another's rank 0 in the middle of its save.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi
srun --kill-on-bad-exit=0 --ntasks-per-node=1 bash slurm/launch.sh "$config" "$recipe" "$@" &
srun_pid=$!
wait "$srun_pid"
