#!/usr/bin/env bash
# One launcher per node, started by `srun` from slurm/ddp.sbatch or slurm/zero3.sbatch. The rendezvous
# comes from SLURM's variables: SLURM_NNODES nodes, this node's SLURM_NODEID as machine rank, the
# job's first node as the main process (its address: SLURM_LAUNCH_NODE_IPADDR, where the batch script runs).
# Each launcher starts one training process per GPU, through the Make targets' wrapper (bert_recipes.launch):
# a rank's one-line reason and its exit code, without torch elastic's ChildFailedError block.
#
#   slurm/launch.sh <accelerate config> <recipe> [--section.key=value ...]
#
# Overridable by hand (the tests run 2 "nodes" on 127.0.0.1 this way): MASTER_ADDR, MASTER_PORT,
# GPUS_PER_NODE. A requeued job (SLURM_RESTART_COUNT > 0) passes --resume auto and continues from its
# last checkpoint; a first submission starts fresh, so an output_dir holding another run's checkpoints
# is refused rather than continued (add --resume auto yourself to continue a run by hand).
set -euo pipefail
config=${1:?usage: slurm/launch.sh <accelerate config> <recipe> [--section.key=value ...]}
recipe=${2:?usage: slurm/launch.sh <accelerate config> <recipe> [--section.key=value ...]}
shift 2
nodes=${SLURM_NNODES:?run under srun, or set SLURM_NNODES and SLURM_NODEID}
node_rank=${SLURM_NODEID:?run under srun, or set SLURM_NNODES and SLURM_NODEID}
gpus=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}}
main_addr=${MASTER_ADDR:-${SLURM_LAUNCH_NODE_IPADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}}
main_port=${MASTER_PORT:-29500}
# gloo's and NCCL's sockets on the interface that reaches the main address (a user's own setting wins): where a
# node's hostname resolves to another network, they would bind there and the ranks hang at start-up.
if [ -z "${GLOO_SOCKET_IFNAME:-}" ] || [ -z "${NCCL_SOCKET_IFNAME:-}" ]; then
    if ifname=$(tools/socket_ifname.sh "$main_addr"); then
        export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ifname} NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ifname}
    else
        echo "config error: no network interface reaches the main node $main_addr from $(hostname): set" \
            "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to the one that does (ip -br addr lists them)" >&2
        exit 2
    fi
fi
# The launcher forwards SIGTERM and SIGUSR1 to the ranks, which finish their step, save a checkpoint
# and exit (143 / 138); it then gives them this long before SIGKILL.
export PET_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-110}
# Each rank bound to its GPU's NUMA node, unless CUDA_VISIBLE_DEVICES selects GPUs that accelerate would bind
# wrongly (tools/affinity.sh); ACCELERATE_CPU_AFFINITY=0 in the job's environment turns it off.
export ACCELERATE_CPU_AFFINITY=${ACCELERATE_CPU_AFFINITY:-$(tools/affinity.sh)}
echo "[slurm] node $node_rank/$nodes: $gpus processes, main $main_addr:$main_port, $config, $recipe," \
    "CPU affinity $ACCELERATE_CPU_AFFINITY, sockets on $GLOO_SOCKET_IFNAME"
resume=()
if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume=(--resume auto); fi
exec python -m bert_recipes.launch accelerate launch --config_file "$config" --num_machines "$nodes" \
    --machine_rank "$node_rank" \
    --num_processes $((nodes * gpus)) --main_process_ip "$main_addr" --main_process_port "$main_port" \
    train.py --recipe "$recipe" "${resume[@]}" "$@"
