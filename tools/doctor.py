"""The node doctor: one line per check (ok / warn / fail) with the value measured, the value expected and
the fix; exit code 1 when any check fails. Run it on a node before a long run:

    make doctor                                   # this node, with a short GPU burn
    make doctor RECIPE=recipes/bert-base-mlm-phase1.yaml CONFIG=accelerate_configs/zero3-offload.yaml
    python tools/doctor.py --json                 # the same as data
    python tools/doctor.py --record FILE          # write the readings (to judge elsewhere, or for a test)
    python tools/doctor.py --readings FILE        # judge recorded readings instead of this node

The GPUs are read through NVML (nvidia-ml-py), under a bf16 matmul burn of --burn seconds (an idle GPU
lowers its PCIe generation and clocks); the host through /proc, /sys and the disk. With a recipe and an
accelerate config, the host checks use that run's numbers: ranks, DataLoader workers, the planner's host
bytes under offload, the checkpoint's size. The verdicts: bert_recipes/doctor/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import sys
import time
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bert_recipes.backends.deepspeed import nvme_offloads  # noqa: E402
from bert_recipes.config import nearest_existing  # noqa: E402
from bert_recipes.doctor import exit_code, judge, render  # noqa: E402

PACKAGES = ("torch", "transformers", "accelerate", "datasets", "evaluate", "tokenizers", "deepspeed")


def pins(path: Path = REPO / "requirements.txt") -> dict[str, str]:
    """name -> version of each `name==version` line."""
    found = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", path.read_text(), re.M)
    return {name: version for name, version in found if name in PACKAGES}


def versions() -> dict:
    have = {}
    for name in PACKAGES:
        try:
            have[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            have[name] = None
    import torch
    have["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        have["cudnn"] = str(torch.backends.cudnn.version())
        have["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return have


def host() -> dict:
    """The cores this process may use, RAM, NUMA nodes and this process's resident size with what a rank
    imports loaded (torch, transformers' BERT): a floor for a rank's, which adds its model and batches."""
    import psutil
    import transformers.models.bert.modeling_bert  # noqa: F401  (a rank's imports, for its resident size)
    memory = psutil.virtual_memory()
    nodes = {p.name.removeprefix("node"): (p / "cpulist").read_text().strip()
             for p in sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))}
    return {"hostname": socket.gethostname(), "cpus": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
            "mem_total": memory.total, "mem_available": memory.available,
            "numa_nodes": nodes, "process_bytes": psutil.Process().memory_info().rss}


def free_bytes(path: str) -> int | None:
    """Free bytes on the file system that holds `path`, None if it cannot be written."""
    p = nearest_existing(path)
    return shutil.disk_usage(p).free if os.access(p, os.W_OK) else None


def mount_of(path: str) -> str:
    """The mount point of the file system that holds `path` (or would hold it)."""
    p = nearest_existing(path)
    while not os.path.ismount(p):
        p = p.parent
    return str(p)


def run_numbers(recipe: str, config: str | None, nproc: int | None, gpus: int, overrides: list[str]) -> dict:
    """The run's numbers the host checks need, from the recipe and the accelerate config (as make memory reads them)."""
    sys.path.insert(0, str(REPO / "tools"))
    from memory import plan_for, read_launch_config, recipe_shape

    from bert_recipes.config import load_config
    from bert_recipes.preflight import auto_workers
    cfg = load_config(recipe, overrides)
    backend, plan = read_launch_config(config, nproc or (gpus or None), None, cfg.train.mixed_precision)
    launch = backend.launch
    nodes = max(1, plan.num_machines)
    ranks = max(1, launch.world // nodes)
    workers = cfg.data.num_workers
    if workers == "auto":
        workers, _ = auto_workers(plan.on_gpu, {"LOCAL_WORLD_SIZE": str(ranks)})
    shape, _ = recipe_shape(cfg)
    micro = cfg.train.micro_batch_size if isinstance(cfg.train.micro_batch_size, int) else 1
    planned = plan_for(backend, shape, cfg, micro, cfg.model.gradient_checkpointing)
    P = shape.params
    nvme = next((o["nvme_path"] for _, o in nvme_offloads(plan.ds_config if plan.deepspeed else {})
                 if o.get("nvme_path")), None)
    return {"recipe": recipe, "config": config, "backend": backend.label, "nodes": nodes, "ranks": ranks,
            "workers": int(workers), "host_bytes_per_rank": 0 if nvme else planned.host,
            "deepspeed": bool(plan.deepspeed), "output_dir": cfg.run.output_dir,
            "disk_free": free_bytes(cfg.run.output_dir) or 0, "keep_last": cfg.checkpoint.keep_last,
            # a checkpoint holds fp32 weights, two Adam moments and (ZeRO) an fp32 master: about 16 bytes a
            # parameter; the export is the fp32 model (4)
            "checkpoint_bytes": 16 * P, "export_bytes": 4 * P,
            "nvme_path": nvme, "nvme_free": free_bytes(nvme) if nvme else None, "nvme_bytes": planned.host if nvme else 0,
            "nvme_exists": bool(nvme) and Path(nvme).expanduser().exists(), "nvme_mount": mount_of(nvme) if nvme else None,
            "affinity": os.environ.get("ACCELERATE_CPU_AFFINITY") == "1"}


def collect(args, overrides: list[str]) -> dict:
    from bert_recipes.doctor.nvml import read_gpus
    readings = {"schema": 1, "recorded": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "source": f"tools/doctor.py on {socket.gethostname()}", "versions": versions(), "pins": pins(),
                "env": {k: v for k, v in os.environ.items()
                        if k.startswith("NCCL_") or k in ("CUDA_VISIBLE_DEVICES", "ACCELERATE_CPU_AFFINITY")},
                "host": host()}
    gpu, why = read_gpus(args.burn)
    readings["gpu"], readings["gpu_error"] = gpu, why
    for g in (gpu or {}).get("gpus", []):   # NVML's NUMA node needs a recent driver; sysfs has it too
        if not isinstance(g.get("numa_node"), int):
            node = Path(f"/sys/bus/pci/devices/{g['bus_id'].lower()[-12:]}/numa_node")
            g["numa_node"] = int(node.read_text()) if node.exists() else None
    if args.recipe:
        readings["run"] = run_numbers(args.recipe, args.config, args.nproc, len((gpu or {}).get("torch", [])),
                                      overrides)
    return readings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", help="judge the host for this recipe's run (with --config)")
    parser.add_argument("--config", help="the accelerate YAML of that run")
    parser.add_argument("--nproc", type=int, help="processes, all nodes together (default: the config's, else the GPUs)")
    parser.add_argument("--burn", type=float, default=5.0, help="seconds of bf16 matmuls on every GPU (0: read idle)")
    parser.add_argument("--json", action="store_true", help="print the verdicts and readings as JSON")
    parser.add_argument("--record", help="write the readings to this file")
    parser.add_argument("--readings", help="judge the readings in this file instead of this node")
    args, overrides = parser.parse_known_args(argv)
    from bert_recipes.config import ConfigError
    try:
        readings = (json.loads(Path(args.readings).read_text()) if args.readings else collect(args, overrides))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        print(f"doctor: cannot read --readings {args.readings}: {err}", file=sys.stderr)
        return 2
    if args.record:
        Path(args.record).write_text(json.dumps(readings, indent=1) + "\n")
    checks = judge(readings)
    if args.json:
        print(json.dumps({"checks": [c.as_dict() for c in checks], "exit_code": exit_code(checks),
                          "readings": readings}, indent=1))
    else:
        print(render(checks))
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
