"""slurm/: the launch line with SLURM's variables set by hand (2 "nodes" x 1 process on 127.0.0.1),
and the batch script's preemption path with stand-ins for srun and scontrol: USR1 makes the ranks
checkpoint and the job requeue itself; the requeued job continues with --resume auto."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from conftest import REPO, _port, tiny_args

VENV_BIN = Path(os.sys.executable).parent


def slurm_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return {**env, "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", **extra}


@pytest.mark.parametrize("config, cpu_env, backend", [
    ("accelerate_configs/multinode.yaml", {"ACCELERATE_USE_CPU": "1"}, "ddp"),
    ("accelerate_configs/multinode_zero3.yaml", {"DS_ACCELERATOR": "cpu"}, "zero3"),
])
def test_launch_line_runs_two_nodes(config, cpu_env, backend, tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    out = tmp_path / "run"
    args = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8})]
    port = str(_port())
    files = [open(tmp_path / f"node{node}.log", "w+") for node in (0, 1)]   # files, not pipes: no pipe can fill up
    procs = [subprocess.Popen(["bash", "slurm/launch.sh", config, "recipes/tiny-mlm.yaml", *args], cwd=REPO,
                              env=slurm_env({"SLURM_NNODES": "2", "SLURM_NODEID": str(node), "GPUS_PER_NODE": "1",
                                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **cpu_env}),
                              stdout=files[node], stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    for p in procs:
        p.wait(timeout=600)
    logs = [(tmp_path / f"node{node}.log").read_text() for node in (0, 1)]
    assert [p.returncode for p in procs] == [0, 0], logs[0][-3000:] + logs[1][-3000:]
    assert "[slurm] node 0/2: 1 processes, main 127.0.0.1" in logs[0] and "[slurm] node 1/2" in logs[1]
    final = json.loads((out / "metrics.json").read_text())["final"]
    assert final["num_processes"] == 2 and final["backend"]["name"] == backend and final["steps"] == 8
    # launch.sh asks accelerate to bind each rank to its GPU's NUMA node (no CUDA_VISIBLE_DEVICES here), and
    # the ranks see it; with no GPU accelerate has nothing to bind
    assert "CPU affinity 1" in logs[0] and final["backend"]["cpu_affinity"] == "asked, nothing to bind (no GPU)"
    assert logs[1].count("[done]") == 0 and logs[0].count("[done]") == 1   # output once, from global rank 0


def test_sbatch_checkpoints_and_requeues_on_usr1(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "srun").write_text('#!/usr/bin/env bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (stubs / "scontrol").write_text('#!/usr/bin/env bash\necho "$@" >> "$SCONTROL_LOG"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    out = tmp_path / "run"
    args = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 60, "logging.log_every": 1})]
    env = slurm_env({"PATH": f"{stubs}:{VENV_BIN}:{os.environ['PATH']}", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
                     "GPUS_PER_NODE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_port()),
                     "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(REPO), "ACCELERATE_USE_CPU": "1",
                     "SCONTROL_LOG": str(tmp_path / "scontrol.log")})
    job = subprocess.Popen(["bash", "slurm/ddp.sbatch", "recipes/tiny-mlm.yaml", *args], cwd=REPO, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if "[train] step 10/" in line:
            job.send_signal(signal.SIGUSR1)   # what --signal=B:USR1@120 sends the batch script
    log = "".join(lines)
    assert job.wait(timeout=120) == 0, log[-3000:]
    assert "[slurm] time limit in 120 s (USR1): the ranks checkpoint, then job 4242 goes back to the queue" in log
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    halted = json.loads((out / "metrics.json").read_text())["final"]
    assert halted["preempted"] == "SIGTERM" and 10 <= halted["steps"] < 60, halted
    # a new submission of the same command is refused: it would overwrite the preempted run
    fresh = subprocess.run(["bash", "slurm/ddp.sbatch", "recipes/tiny-mlm.yaml", *args], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert fresh.returncode != 0 and "already holds checkpoints of this run" in fresh.stdout + fresh.stderr
    # the requeued job (SLURM_RESTART_COUNT=1): the same command, continuing from that checkpoint
    again = subprocess.run(["bash", "slurm/ddp.sbatch", "recipes/tiny-mlm.yaml", *args], cwd=REPO,
                           env={**env, "SLURM_RESTART_COUNT": "1"}, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:]
    assert f"[resume] from {out}/checkpoints/step_{halted['steps']:08d}" in again.stdout
    final = json.loads((out / "metrics.json").read_text())["final"]
    assert final["steps"] == 60 and final["num_processes"] == 2
