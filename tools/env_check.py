"""What this machine offers for training: library versions, GPUs and their topology, the NCCL
settings in effect and which DeepSpeed ops can be built.

    python tools/env_check.py            # readable report
    python tools/env_check.py --json     # the same as JSON
    make env-check
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bert_recipes.backends.plan import bf16_supported  # noqa: E402


def _version(module: str) -> str | None:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception:   # a broken install should show up in the report, not crash it
        return None


def _first_line(text: str | None) -> str | None:
    """nvidia-smi repeats a per-host value (the driver) once per GPU."""
    return text.strip().splitlines()[0].strip() if text and text.strip() else None


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def deepspeed_ops() -> dict[str, bool] | str:
    """Which DeepSpeed ops this machine can build (ds_report's 'compatible' column)."""
    try:
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
    except Exception as e:
        return f"deepspeed not importable: {e}"
    result = {}
    for name, builder in sorted(ALL_OPS.items()):
        try:
            result[name] = bool(builder.is_compatible(verbose=False))
        except Exception:
            result[name] = False
    return result


def collect() -> dict:
    import torch
    report = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": {name: _version(name) for name in
                     ("torch", "accelerate", "deepspeed", "transformers", "datasets", "tokenizers")},
        "cuda_available": torch.cuda.is_available(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "driver": _first_line(_run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "gpus": [],
        "topology": _run(["nvidia-smi", "topo", "-m"]),
        "peer_access": None,
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        "deepspeed_ops": deepspeed_ops(),
    }
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        for i in range(n):
            props = torch.cuda.get_device_properties(i)
            report["gpus"].append({"index": i, "name": props.name, "memory_gb": round(props.total_memory / 1e9, 1),
                                   "capability": f"{props.major}.{props.minor}",
                                   "bf16": bf16_supported((props.major, props.minor))})
        report["peer_access"] = [[i == j or torch.cuda.can_device_access_peer(i, j) for j in range(n)]
                                 for i in range(n)]
    return report


def render(r: dict) -> str:
    lines = ["== environment ==",
             f"python {r['python']} on {r['platform']}, {r['cpu_count']} CPU cores"]
    lines += [f"  {k:<13}{v or 'not installed'}" for k, v in r["versions"].items()]
    lines.append("== GPUs ==")
    if not r["cuda_available"]:
        lines.append("no GPU: CUDA is not available to torch (CPU-only build or no driver). Training runs on CPU "
                     "(gloo); see docs/backends.md 'Launching on CPU'.")
    else:
        lines.append(f"CUDA {r['cuda']}, cuDNN {r['cudnn']}, NCCL {r['nccl']}, driver {r['driver']}")
        lines.append(f"CUDA_VISIBLE_DEVICES={r['CUDA_VISIBLE_DEVICES']}")
        for g in r["gpus"]:
            lines.append(f"  [{g['index']}] {g['name']}, {g['memory_gb']} GB, sm {g['capability']}, bf16 {g['bf16']}")
        if r["peer_access"] and len(r["peer_access"]) > 1:
            lines.append("peer-to-peer access (row -> column):")
            lines += ["  " + " ".join("Y" if ok else "." for ok in row) for row in r["peer_access"]]
            if not all(all(row) for row in r["peer_access"]):
                lines.append("  some pairs lack P2P: all-reduce goes through host memory (check the topology, "
                             "IOMMU/ACS settings, NCCL_P2P_LEVEL)")
    if r["topology"]:
        lines += ["topology (nvidia-smi topo -m):", r["topology"]]
    lines.append("== NCCL settings ==")
    lines += [f"  {k}={v}" for k, v in r["nccl_env"].items()] or ["  none set (NCCL defaults)"]
    lines.append("== DeepSpeed ops (can be built here) ==")
    ops = r["deepspeed_ops"]
    if isinstance(ops, str):
        lines.append(f"  {ops}")
    else:
        lines.append("  yes: " + ", ".join(k for k, v in ops.items() if v))
        lines.append("  no:  " + (", ".join(k for k, v in ops.items() if not v) or "-"))
        if not ops.get("async_io", True):
            lines.append("  (async_io is needed for ZeRO-3 NVMe offload: apt-get install libaio-dev)")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON instead of the report")
    args = parser.parse_args()
    report = collect()
    print(json.dumps(report, indent=2, default=str) if args.json else render(report))


if __name__ == "__main__":
    main()
