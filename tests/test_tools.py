"""tools/: the GPU check's table, exercised on CPU processes."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_gpu_check_table_on_cpu(tmp_path):
    out = tmp_path / "table.md"
    proc = subprocess.run([sys.executable, "tools/gpu_check.py", "--cpu", "--rows", "ddp,zero2,fsdp,pipeline",
                           "--size", "tiny", "--seq", "32", "--micro", "4", "--steps", "4",
                           "--work", str(tmp_path / "work"), "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = out.read_text()
    for name in ("ddp", "zero2", "pipeline"):
        row = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
        assert row.endswith("| ok |") and "| 2 |" in row, row
    assert "skipped: Accelerate runs FSDP on GPUs only" in table


def test_gpu_check_refuses_without_gpu_unless_cpu():
    import torch
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, "tools/gpu_check.py"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode != 0 and "no GPU visible" in proc.stderr
