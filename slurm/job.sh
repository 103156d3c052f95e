# The body of slurm/*.sbatch (sourced): a check of the job's arguments, then one launcher per node through srun,
# and a requeue when the time limit is near.
# - USR1 (--signal=B:USR1@120, 120 s before the time limit) reaches this script: it passes USR1 to srun, which
#   forwards it to every node's launcher and on to the ranks; they checkpoint at the step reached and exit, and
#   the script requeues the job as its last act. The requeued job (SLURM_RESTART_COUNT > 0) resumes there.
#   A preemption sends USR1 too where the cluster sets SlurmctldParameters=preempt_send_user_signal and a GraceTime.
# - TERM (a cancel, a preemption without those, `scontrol requeue`) is SLURM's: it goes to every process of the
#   job, srun included, and srun answers it by killing its tasks at once. The script does nothing on TERM: the
#   controller requeues a preempted job itself (PreemptMode=REQUEUE) and ends a cancelled one. Such a preempted
#   job resumes from its last periodic checkpoint (checkpoint.save_every); docs/cluster.md#preemption.
# Never TERM to srun: that is a SIGKILL for every rank.
cd "${SLURM_SUBMIT_DIR:-.}"
if [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi   # the repository's venv (make setup)
set -euo pipefail
config=$1
recipe=${2:?usage: sbatch slurm/<mode>.sbatch <recipe.yaml> [--section.key=value ...]}
shift 2
resume=()
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume=(--resume auto); fi
# A mistake in the job's arguments is one `config error:` line here, once, before srun starts the nodes.
gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}}
python -m bert_recipes.preflight "$config" --num_processes $(( ${SLURM_NNODES:-1} * gpus )) -- \
    --recipe "$recipe" "${resume[@]}" "$@"
srun_pid=
time_limit() {
    echo "[slurm] USR1 (the time limit in 120 s, or a preemption with grace time): the ranks checkpoint, then job" \
        "${SLURM_JOB_ID:-?} goes back to the queue"
    kill -USR1 "$srun_pid" 2>/dev/null || true   # srun forwards USR1 to its tasks (TERM would kill them)
    status=0
    wait "$srun_pid" || status=$?
    if [ "$status" -eq 0 ]; then   # the run had already finished: nothing to continue
        echo "[slurm] the run had finished; not requeued"
        exit 0
    fi
    scontrol requeue "${SLURM_JOB_ID:?}"   # requeueing a running job ends it: the last act
    exit 0
}
# srun (Slurm 22.05+) does not inherit --cpus-per-task from the batch job: pass it on, or each node's
# launcher and all its ranks share one CPU. No --kill-on-bad-exit: on a time limit every launcher exits
# non-zero, and one node's exit must not kill another's rank 0 in the middle of its save.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK; fi
srun --kill-on-bad-exit=0 --ntasks-per-node=1 bash slurm/launch.sh "$config" "$recipe" "$@" &
srun_pid=$!
trap time_limit USR1
echo "[slurm] trap ready: USR1 checkpoints and requeues job ${SLURM_JOB_ID:-?}"
wait "$srun_pid"
