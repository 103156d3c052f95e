"""The node doctor: verdicts on a node's readings, one line per check (ok / warn / fail), each with
the value measured, the value expected and the fix.

The readings are plain data (a dict, JSON as `tools/doctor.py --record` writes it): the GPUs as NVML
and torch see them (`bert_recipes/doctor/nvml.py` reads them), the host (`/proc`, `/sys`, the disk),
the versions in effect, the environment and, given a recipe and a launch config, the run's numbers.
Every check here is a function of the readings alone, so the verdicts are tested on recorded or
hand-built readings and the product never needs a fake NVML.

- gpu.py: driver against torch's CUDA, the GPU count, PCIe, NVLink and topology, clocks and
  throttling, ECC;
- verdict.py: the Check a line is made of;
- host.py: RAM, cores, NUMA and affinity, disk, the NVMe path, NCCL's variables, versions against
  requirements.txt.
"""
from __future__ import annotations

from .gpu import gpu_checks
from .host import host_checks, nccl_checks, version_checks
from .verdict import NOT_SUPPORTED, STATUSES, Check, gib, supported

__all__ = ["NOT_SUPPORTED", "Check", "exit_code", "gib", "judge", "render", "supported"]


def judge(readings: dict) -> list[Check]:
    """Every check, in the order a reader goes through a node: versions, GPUs, host, network."""
    return [*version_checks(readings), *gpu_checks(readings), *host_checks(readings), *nccl_checks(readings)]


def exit_code(checks: list[Check]) -> int:
    """1 when any check fails, else 0 (a warning does not stop a run)."""
    return int(any(c.status == "fail" for c in checks))


def render(checks: list[Check]) -> str:
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    lines = [c.line() for c in checks]
    lines.append(f"[doctor] {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail")
    return "\n".join(lines)
