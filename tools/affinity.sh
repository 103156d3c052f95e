#!/usr/bin/env bash
# Prints 1 when accelerate's CPU affinity (ACCELERATE_CPU_AFFINITY=1) binds each rank to its own GPU's
# NUMA node, else 0. Accelerate binds local rank i to the CPUs of NVML's GPU i (accelerate 1.15,
# utils/environment.py override_numa_affinity), and NVML ignores CUDA_VISIBLE_DEVICES: that is rank i's
# GPU only when CUDA_VISIBLE_DEVICES is unset or lists 0,1,...,n-1. Used by the Makefile's GPU targets
# and slurm/launch.sh; `make doctor` says which case a node is in.
v=${CUDA_VISIBLE_DEVICES-__unset__}
if [ "$v" = "__unset__" ]; then echo 1; exit 0; fi
if [ -z "$v" ]; then echo 0; exit 0; fi
IFS=, read -ra ids <<< "$v"
for i in "${!ids[@]}"; do
    if [ "${ids[$i]// /}" != "$i" ]; then echo 0; exit 0; fi
done
echo 1
