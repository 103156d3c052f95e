"""The host checks (RAM, cores, NUMA and affinity, disk, the NVMe path), NCCL's variables and the versions
in effect: each a function of the readings (`readings["host"]`, `["run"]`, `["env"]`, `["versions"]`).

The run's numbers (`readings["run"]`: ranks on this node, DataLoader workers per rank, the planner's host
bytes per rank under offload, the checkpoint's size) come from the recipe and launch config the doctor
was given (tools/doctor.py); without them the checks use one rank per GPU and the recipe defaults.
"""
from __future__ import annotations

from .verdict import Check, gib

# The field guides' rules of thumb for a training host.
CORES_PER_GPU = 2            # "at least 16 cores for up to 8 GPUs"
RAM_PER_GPU = 8 * 1024 ** 3  # "64-128 GB of RAM" for 8 GPUs

NCCL_VARIABLES = {
    "NCCL_DEBUG": "NCCL's log level (INFO prints the rings and transports chosen: the first thing to read on a hang)",
    "NCCL_DEBUG_SUBSYS": "which NCCL subsystems log",
    "NCCL_P2P_DISABLE": "1 turns off direct GPU-to-GPU copies (NVLink and PCIe P2P): traffic goes through host memory",
    "NCCL_P2P_LEVEL": "the furthest topology distance at which P2P is used (NVL, PIX, PXB, PHB, SYS)",
    "NCCL_SHM_DISABLE": "1 turns off shared-memory transport between processes of one node",
    "NCCL_IB_DISABLE": "1 turns off InfiniBand/RoCE: between nodes NCCL falls back to TCP sockets",
    "NCCL_SOCKET_IFNAME": "the network interfaces NCCL's bootstrap and socket transport use",
    "NCCL_IB_HCA": "the InfiniBand adapters NCCL uses",
    "NCCL_NET_GDR_LEVEL": "how close NIC and GPU must be for GPUDirect RDMA",
    "NCCL_ALGO": "forces NCCL's algorithm (Ring, Tree, ...) instead of its tuner's choice",
    "NCCL_PROTO": "forces NCCL's protocol (Simple, LL, LL128) instead of its tuner's choice",
    "NCCL_ASYNC_ERROR_HANDLING": "renamed TORCH_NCCL_ASYNC_ERROR_HANDLING in torch 2.2",
    "NCCL_BLOCKING_WAIT": "renamed TORCH_NCCL_BLOCKING_WAIT in torch 2.2",
}


def host_checks(readings: dict) -> list[Check]:
    host, run = readings.get("host", {}), readings.get("run") or {}
    gpus = len((readings.get("gpu") or {}).get("torch", []))
    ranks = run.get("ranks") or max(gpus, 1)
    workers = run.get("workers", 0)
    checks = [ram_check(host, run, ranks, workers, gpus), cores_check(host, ranks, workers, gpus),
              numa_check(readings, host)]
    if run.get("output_dir"):
        checks.append(disk_check(run))
    if run.get("nvme_path"):
        checks.append(nvme_check(run))
    return checks


def ram_check(host: dict, run: dict, ranks: int, workers: int, gpus: int) -> Check:
    """ranks x (1 + workers) processes of a rank's resident size, plus each rank's offloaded states."""
    process, offload = run.get("process_bytes", host.get("process_bytes", 0)), run.get("host_bytes_per_rank", 0)
    need = ranks * (1 + workers) * process + ranks * offload
    total, available = host.get("mem_total", 0), host.get("mem_available", 0)
    said = (f"{gib(total)} RAM, {gib(available)} available; the run needs about {gib(need)} = {ranks} ranks x "
            f"(1 + {workers} workers) x {gib(process)} (a process with torch and transformers loaded: a floor)" + (f" + {ranks} x {gib(offload)} offloaded states"
                                                          if offload else ""))
    if need > total:
        return Check("host ram", "fail", said, f"<= {gib(total)}", "fewer DataLoader workers (data.num_workers), "
                     "fewer ranks on this node, or no CPU offload")
    if need > available:
        return Check("host ram", "warn", said, f"<= {gib(available)} available", "other processes hold the rest: "
                     "check `free -g` and stray processes before the run")
    if gpus and total < gpus * RAM_PER_GPU:
        return Check("host ram", "warn", said, f">= {gib(gpus * RAM_PER_GPU)} for {gpus} GPUs (the guides: "
                     "64-128 GB for 8)", "a host this small pages under data loading and checkpointing")
    return Check("host ram", "ok", said, f"<= {gib(available)}")


def cores_check(host: dict, ranks: int, workers: int, gpus: int) -> Check:
    cores, need = host.get("cpus", 0), ranks * (workers + 1)
    said = f"{cores} cores for this process; the run uses {need} = {ranks} ranks x ({workers} workers + 1)"
    if ranks > cores:
        return Check("host cores", "fail", said, f"<= {cores}", f"{ranks} ranks share {cores} cores: every step "
                     "waits for a descheduled rank; run fewer processes on this node (NPROC) or give the job more cores")
    if need > cores:
        fit = max(cores // max(ranks, 1) - 1, 0)
        return Check("host cores", "warn", said, f"<= {cores}", f"oversubscribed cores starve the input pipeline: "
                     f"data.num_workers={fit} fits")
    if gpus and cores < CORES_PER_GPU * gpus:
        return Check("host cores", "warn", said, f">= {CORES_PER_GPU * gpus} for {gpus} GPUs (the guides: 16 for 8)",
                     "a host with fewer cores turns input-bound: pre-tokenize (make prepare) and keep workers low")
    return Check("host cores", "ok", said, f"<= {cores}")


def affinity_binds_own_gpu(visible: str | None) -> bool:
    """tools/affinity.sh's rule: accelerate binds local rank i to NVML's GPU i, which is the rank's own GPU
    only when CUDA_VISIBLE_DEVICES is unset or lists 0,1,...,n-1."""
    return visible is None or (visible != "" and [v.strip() for v in visible.split(",")] ==
                               [str(i) for i in range(len(visible.split(",")))])


def numa_check(readings: dict, host: dict) -> Check:
    nodes = host.get("numa_nodes") or {}
    gpus = (readings.get("gpu") or {}).get("gpus", [])
    affinity = (readings.get("env", {}).get("ACCELERATE_CPU_AFFINITY") == "1"
                or (readings.get("run") or {}).get("affinity", False))
    where = ", ".join(f"gpu{g['index']} node {g.get('numa_node')}" for g in gpus)
    said = f"{len(nodes) or 1} NUMA node(s)" + (f"; {where}" if where else "") + f"; affinity {'on' if affinity else 'off'}"
    if len(nodes) <= 1 or not gpus:
        return Check("numa", "ok", said + ": nothing to bind")
    visible = readings.get("env", {}).get("CUDA_VISIBLE_DEVICES")
    if affinity and not affinity_binds_own_gpu(visible):
        return Check("numa", "warn", said + f", CUDA_VISIBLE_DEVICES={visible}", "affinity by the GPU each rank uses",
                     "accelerate binds local rank i to the CPUs of the machine's GPU i (NVML's order), not of "
                     "the i-th visible one: unset CUDA_VISIBLE_DEVICES or turn affinity off (ACCELERATE_CPU_AFFINITY=0)")
    if not affinity:
        return Check("numa", "warn", said, "each rank bound to its GPU's NUMA node", "launch with "
                     "ACCELERATE_CPU_AFFINITY=1 (make's GPU targets and slurm/launch.sh set it): a rank on the "
                     "far socket copies every batch across the inter-socket link")
    return Check("numa", "ok", said)


def disk_check(run: dict) -> Check:
    """(keep_last + 1) checkpoints at once (the old one goes only after the new one is complete), plus the export."""
    free, size, keep, export = run.get("disk_free", 0), run.get("checkpoint_bytes", 0), run.get("keep_last", 1), \
        run.get("export_bytes", 0)
    need = (keep + 1) * size + export
    said = (f"{gib(free)} free at {run['output_dir']}; the run writes up to {gib(need)} = ({keep} kept + 1 being "
            f"written) x {gib(size)} checkpoints + {gib(export)} export")
    if need > free:
        return Check("disk", "fail", said, f"<= {gib(free)}", "free space, another run.output_dir, or a lower "
                     "checkpoint.keep_last: a full disk fails the save after hours of training")
    if need > 0.8 * free:
        return Check("disk", "warn", said, f"<= {gib(0.8 * free)} (80% of free)", "little headroom: logs and "
                     "caches grow too")
    return Check("disk", "ok", said)


def nvme_check(run: dict) -> Check:
    path, free, need = run["nvme_path"], run.get("nvme_free"), run.get("nvme_bytes", 0)
    if free is None:
        return Check("nvme", "fail", f"offload path {path} cannot be written", "a writable directory on a local "
                     "NVMe drive", "fix its permissions, or point nvme_path in the DeepSpeed JSON at one")
    said = f"{gib(free)} free at {path}; offload swaps about {gib(need)} a rank"
    if not run.get("nvme_exists", True):
        return Check("nvme", "warn", said + f", but {path} does not exist", "an NVMe drive mounted there",
                     f"DeepSpeed would create {path} on {run.get('nvme_mount', 'the parent file system')}, maybe no "
                     "NVMe at all: mount the drive there or change nvme_path in the DeepSpeed JSON")
    if need > free:
        return Check("nvme", "fail", said, f"<= {gib(free)}", "free space on the NVMe drive, or offload to CPU")
    return Check("nvme", "ok", said)


def nccl_checks(readings: dict) -> list[Check]:
    env = readings.get("env", {})
    gpu = readings.get("gpu") or {}
    # any NVLink: disabling P2P hurts the pairs that have it (link_of asks for it on every GPU: the yardstick's case)
    nvlink = any(isinstance(g.get("nvlink_active"), int) and g["nvlink_active"] > 0 for g in gpu.get("gpus", []))
    nodes = (readings.get("run") or {}).get("nodes", 1)
    checks = []
    for key, value in sorted((k, v) for k, v in env.items() if k.startswith("NCCL_")):
        meaning = NCCL_VARIABLES.get(key, "not one this doctor knows: see NCCL's environment variable list")
        status, fix = "ok", ""
        if key == "NCCL_P2P_DISABLE" and value == "1" and nvlink:
            status, fix = "fail", "unset it: on an NVLink node it sends every all-reduce through host memory"
        elif key == "NCCL_IB_DISABLE" and value == "1" and nodes > 1:
            status, fix = "warn", "unset it unless the nodes have no InfiniBand/RoCE: TCP is several times slower"
        elif key == "NCCL_SOCKET_IFNAME" and value.lstrip("=^") in ("lo", "lo0") and nodes > 1:
            status, fix = "fail", "the loopback interface cannot reach another node: name the cluster network's"
        elif key in ("NCCL_ALGO", "NCCL_PROTO", "NCCL_SHM_DISABLE") or key in ("NCCL_ASYNC_ERROR_HANDLING",
                                                                               "NCCL_BLOCKING_WAIT"):
            status, fix = "warn", "unset it unless a measurement shows it helps" if key.startswith(
                ("NCCL_ALGO", "NCCL_PROTO", "NCCL_SHM")) else f"use TORCH_{key}"
        checks.append(Check(f"env {key}", status, f"{key}={value}: {meaning}", fix=fix))
    if not checks:
        checks.append(Check("env NCCL", "ok", "no NCCL_* variable set: NCCL's own choices"))
    return checks


REQUIRED = ("torch", "transformers", "accelerate", "datasets", "evaluate", "tokenizers")


def version_checks(readings: dict) -> list[Check]:
    """The versions in effect against requirements.txt's pins. A GPU image's own torch is a warning."""
    have, pins = readings.get("versions", {}), readings.get("pins", {})
    uses_deepspeed = (readings.get("run") or {}).get("deepspeed", False)
    checks = []
    for name, pin in pins.items():
        got = have.get(name)
        if got is None:
            needed = name in REQUIRED or (name == "deepspeed" and uses_deepspeed)
            checks.append(Check(f"version {name}", "fail" if needed else "warn", "not installed", pin,
                                f"pip install {name}=={pin}" + ("" if needed else " (for the DeepSpeed rows)")))
        elif got.split("+")[0] != pin:
            checks.append(Check(f"version {name}", "warn", got, pin, f"tested with {pin}: pip install {name}=={pin}"
                                + (" (a GPU image's own torch usually works: keep it if its CUDA suits the driver)"
                                   if name == "torch" else "")))
        else:
            checks.append(Check(f"version {name}", "ok", got, pin))
    cuda = ", ".join(f"{k} {have[k]}" for k in ("torch_cuda", "cudnn", "nccl") if have.get(k))
    if cuda:
        checks.append(Check("version cuda", "ok", cuda))
    return checks
