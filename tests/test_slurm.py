"""slurm/ under a real scheduler: SLURM 22.05 (Debian's packages), a throw-away cluster of 2 nodes on this machine
(tools/slurm_cluster.py: each node its own hostname, network namespace and address on a bridge, and a second
interface its hostname resolves to, which reaches nobody). The repository's own slurm/ddp.sbatch and
slurm/zero3.sbatch are submitted unchanged: the overrides go on the sbatch command line and in the environment;
logs, runs and the nodes' data caches live under the test's tmp dir. What a cluster does to a job: the time-limit
signal, a preemption, a cancel, a node lost (killed, or silenced), a requeue on fewer nodes.
The jobs run cold (BERT_RECIPES_WARM=0: slurmd starts the ranks inside their node), without the warm server's
PYTHONPATH. Skipped, with one line, where the packages are missing or the suite does not run as root.

test_launch_line_runs_two_nodes runs slurm/launch.sh without a scheduler, as a user without SLURM can (two
launchers on 127.0.0.1, SLURM's variables by hand): the scheduler is not needed for that path."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, _port, tiny_args

sys.path.insert(0, str(REPO / "tools"))
import slurm_cluster  # noqa: E402

VENV_BIN = Path(os.sys.executable).parent
NO_DROPOUT = {"model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0}


def slurm_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("CUDA_VISIBLE_DEVICES", "PYTHONPATH", "BERT_RECIPES_WARM_SOCKET")}
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
    assert "sockets on lo" in logs[0]   # every node on this host: the loopback reaches the main address
    final = json.loads((out / "metrics.json").read_text())["final"]
    assert final["num_processes"] == 2 and final["backend"]["name"] == backend and final["steps"] == 8
    # launch.sh asks accelerate to bind each rank to its GPU's NUMA node (no CUDA_VISIBLE_DEVICES here), and
    # the ranks see it; with no GPU accelerate has nothing to bind
    assert "CPU affinity 1" in logs[0] and final["backend"]["cpu_affinity"] == "asked, nothing to bind (no GPU)"
    assert logs[1].count("[done]") == 0 and logs[0].count("[done]") == 1   # output once, from global rank 0


# ----------------------------------------------------------------------------------- the real scheduler

@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2 nodes, each with a second interface; stopped (jobs cancelled, daemons by PID, namespaces, links) at the end,
    and nothing may be left."""
    why = slurm_cluster.missing()
    if why:
        pytest.skip(f"no SLURM cluster: {why}")
    d = tmp_path_factory.mktemp("cluster")
    slurm_cluster.up(d, 2, second_interface=True)   # where the packages are there, a cluster that fails is a failure
    try:
        yield d
    finally:
        slurm_cluster.down(d)
        left = slurm_cluster.leftovers()
        assert not left, left


class Job:
    """One sbatch submission of a repository script; its state from scontrol, its log (appended over requeues)."""

    def __init__(self, cluster: Path, tmp: Path, script: str, args: list[str], env: dict, sbatch: list[str] = ()):
        self.cluster, self.log_path = cluster, tmp / "job.log"
        tmp.mkdir(parents=True, exist_ok=True)
        cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--cpus-per-task=1", f"--output={self.log_path}",
               *sbatch, script, "recipes/tiny-mlm.yaml", *args]
        env = slurm_env({"SLURM_CONF": str(cluster / slurm_cluster.CONF), "BERT_RECIPES_WARM": "0",
                         "GPUS_PER_NODE": "1", "MASTER_PORT": str(_port()), "HF_HUB_OFFLINE": "1",
                         "HF_DATASETS_OFFLINE": "1", **env})
        self.id = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=True).stdout.strip()

    def info(self) -> dict:
        out = slurm_cluster.sh("scontrol", "show", "job", "-o", self.id, env=slurm_cluster.env(self.cluster),
                               check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def log(self) -> str:   # a node killed mid-write can cut a progress bar's multi-byte character in two
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait(self, what: str, ok, timeout: float = 180) -> float:
        """Polls until ok(self) is true; the seconds it took. A timeout says what was awaited, with the log's end."""
        start = time.time()
        while not ok(self):
            if time.time() - start > timeout:
                raise AssertionError(f"job {self.id}: no {what} after {timeout:.0f} s; {self.info()}\n"
                                     f"{self.log()[-4000:]}")
            time.sleep(0.3)
        return time.time() - start

    def done(self, timeout: float = 240) -> dict:
        self.wait("end", lambda j: j.info().get("JobState") in ("COMPLETED", "FAILED", "CANCELLED"), timeout)
        return self.info()

    def steps(self) -> int:
        found = re.findall(r"\[train\] step (\d+)/", self.log())
        return int(found[-1]) if found else 0

    def scontrol(self, *args) -> None:
        slurm_cluster.sh(*args, env=slurm_cluster.env(self.cluster))


def tiny(out: Path, cache, sample_dir, tokenizer, **extra) -> list[str]:
    return [f"--{a}" for a in tiny_args(out, sample_dir, cache, **{"tokenizer.name_or_path": tokenizer,
                                                                   "logging.log_every": 1, **extra})]


def final(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())["final"]


def weights(out: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(out / "model" / "model.safetensors")


def same_weights(a: Path, b: Path) -> None:
    import torch
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6, msg=k)


def test_ddp_two_nodes_time_limit_and_preemption(cluster, tmp_path, sample_dir, shared_tokenizer):
    """slurm/ddp.sbatch on 2 nodes. The time-limit signal (scancel --signal=USR1 --batch, what --signal=B:USR1@120
    sends): the ranks checkpoint at the step reached, the job requeues itself (same id, SLURM_RESTART_COUNT=1, the
    log appended) and continues. Then a job of the urgent partition preempts it: USR1 at once (the cluster's
    preempt_send_user_signal and GraceTime), the same path. The final weights equal an uninterrupted run's."""
    cache = cluster / "local" / tmp_path.name   # each node's own disk
    # 120 steps: the preemption (a scheduler pass, then USR1) must land before the run's end, which at 60 steps it
    # did not always (the run resumed at its final step 60)
    over = {"train.max_steps": 120, "checkpoint.save_every": 1000, **NO_DROPOUT}
    env = {"ACCELERATE_USE_CPU": "1"}
    ref = Job(cluster, tmp_path / "ref", "slurm/ddp.sbatch",
              tiny(tmp_path / "ref" / "run", f"{cache}-ref", sample_dir, shared_tokenizer, **over), env)
    job = Job(cluster, tmp_path, "slurm/ddp.sbatch", tiny(tmp_path / "run", cache, sample_dir, shared_tokenizer,
                                                          **over), env)
    job.wait("training", lambda j: "[slurm] trap ready" in j.log() and j.steps() >= 6)
    job.scontrol("scancel", "--signal=USR1", "--batch", job.id)
    job.wait("requeue", lambda j: j.info().get("Restarts") == "1")
    job.wait("training after the requeue", lambda j: "[resume] from" in j.log() and j.steps() >= 24)
    urgent = subprocess.run(["sbatch", "--parsable", "-p", "urgent", "--exclusive", "-N2", "--output=/dev/null",
                             "--wrap", "sleep 1"], env=slurm_cluster.env(cluster), capture_output=True, text=True)
    assert urgent.returncode == 0, urgent.stderr
    info = job.done()
    log = job.log()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "2", (info, log[-3000:])
    assert ref.done()["JobState"] == "COMPLETED", ref.log()[-3000:]
    assert log.count("[slurm] USR1 (the time limit in 120 s, or a preemption with grace time): the ranks "
                     f"checkpoint, then job {job.id} goes back to the queue") == 2
    saved = [int(s) for s in re.findall(r"\[preempt\] SIGUSR1 received: every rank stopped after step (\d+)/120, "
                                        r"checkpoint saved", log)]
    resumed = [int(s) for s in re.findall(r"\[resume\] from \S+/step_(\d+) at step", log)]
    assert len(saved) == 2 and resumed == saved, log[-3000:]   # each run continues where the last one saved
    assert "Traceback" not in log and "SignalException" not in log   # the launcher's report is dropped
    assert log.count("[slurm] trap ready") == 3 and log.count("[done]") == 1
    assert log.count("[slurm] node 1/2") == 3 and "sockets on eth0" in log   # not eth1, where the hostname points
    result = final(tmp_path / "run")
    assert result["steps"] == 120 and result["num_processes"] == 2 and result["backend"]["name"] == "ddp"
    same_weights(tmp_path / "run", tmp_path / "ref" / "run")


def test_zero3_two_nodes_and_a_mistake_is_one_line(cluster, tmp_path, sample_dir, shared_tokenizer):
    """slurm/zero3.sbatch on 2 nodes: 2 processes under ZeRO-3, the output written once. The same submission again
    is a mistake (its output_dir holds that run's checkpoints): one line in the job's log, before srun starts."""
    args = tiny(tmp_path / "run", cluster / "local" / tmp_path.name, sample_dir, shared_tokenizer,
                **{"train.max_steps": 6})
    job = Job(cluster, tmp_path / "first", "slurm/zero3.sbatch", args, {"DS_ACCELERATOR": "cpu"})
    info, log = job.done(), job.log()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-2]", (info, log[-3000:])
    result = final(tmp_path / "run")
    assert result["num_processes"] == 2 and result["backend"]["name"] == "zero3" and result["steps"] == 6
    assert log.count("[done]") == 1 and "[slurm] node 1/2" in log
    written = sorted(p.name for p in (tmp_path / "run").iterdir())
    again = Job(cluster, tmp_path, "slurm/zero3.sbatch", args, {"DS_ACCELERATOR": "cpu"})
    info, log = again.done(), again.log()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", (info, log)
    errors = [line for line in log.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("config error: ") and "already holds checkpoints" in errors[0]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == written


def test_nodes_that_see_different_shards_are_one_line(cluster, tmp_path, sample_dir, shared_tokenizer):
    """data.train_files names a node-local directory whose copy on n2 is still being written (its last shard
    shorter): each node's ranks resolved their own list, and the lists are compared before any data is read. One
    config error line (rank 0's, and n2's first rank's), exit 2 on every rank, no traceback, nothing written."""
    lines = (sample_dir / "pretrain/train.txt").read_text().splitlines(keepends=True)[:400]
    for node, short in (("n1", 0), ("n2", 40)):
        shards = cluster / "nodes" / node / "local" / tmp_path.name / "shards"
        shards.mkdir(parents=True)
        for i in range(4):
            part = lines[i * 100:(i + 1) * 100 - (short if i == 3 else 0)]
            (shards / f"part-{i:05d}.txt").write_text("".join(part))
    local = cluster / "local" / tmp_path.name
    args = tiny(tmp_path / "run", local / "cache", sample_dir, shared_tokenizer,
                **{"data.source": "files", "data.train_files": f"[{local / 'shards'}]", "train.max_steps": 4})
    job = Job(cluster, tmp_path, "slurm/ddp.sbatch", args, {"ACCELERATE_USE_CPU": "1"})
    info, log = job.done(), job.log()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0" and info["NodeList"] == "n[1-2]", \
        (info, log[-3000:])
    errors = [line for line in log.splitlines() if line.startswith("config error:")]
    assert 1 <= len(errors) <= 2, log[-3000:]
    assert all("data.train_files, data.validation_files: the ranks resolved different files" in e for e in errors)
    assert "rank 0: 4 files" in log and "Traceback" not in log, log[-3000:]
    assert "[slurm] node 1/2" in log   # the ranks of both nodes started and compared (not the batch's preflight)
    assert not (tmp_path / "run").exists()


def lose_node(cluster: Path, tmp_path: Path, sample_dir, tokenizer, how, gpus: int, node: str = "n2",
              **over) -> tuple[Job, float]:
    """slurm/ddp.sbatch with --nodes=1-2 (--spread-job: both nodes while both are up), `node` lost once a
    periodic checkpoint exists; the seconds until the first run was over (the controller requeued it)."""
    args = tiny(tmp_path / "run", cluster / "local" / tmp_path.name, sample_dir, tokenizer,
                **{"checkpoint.save_every": 4, **over})
    job = Job(cluster, tmp_path, "slurm/ddp.sbatch", args, {"ACCELERATE_USE_CPU": "1", "GPUS_PER_NODE": str(gpus)},
              ["--nodes=1-2", "--spread-job"])
    # any complete checkpoint: the rotation (checkpoint.keep_last=2) may already have removed step_00000004
    job.wait("a checkpoint", lambda j: j.steps() >= 5 and any(
        not p.name.endswith(".partial") for p in (tmp_path / "run/checkpoints").glob("step_*")))
    assert job.info()["NodeList"] == "n[1-2]"
    how(cluster, node)
    lost = time.time()
    job.wait("end of the first run", lambda j: j.info().get("Restarts") == "1", timeout=120)
    return job, time.time() - lost


def test_node_killed_requeued_on_the_node_left(cluster, tmp_path, sample_dir, shared_tokenizer):
    """Every process of node n2 killed (its sockets reset): n1's ranks stop at once, the controller marks n2 DOWN
    (SlurmdTimeout=10) and requeues the job, which runs on n1 alone and resumes on 2 processes instead of 4. Two
    processes per node, each node its own data cache: each node's first rank prepared it, once."""
    job, took = lose_node(cluster, tmp_path, sample_dir, shared_tokenizer, slurm_cluster.kill_node, 2,
                          **{"train.max_steps": 40, "train.micro_batch_size": 4})   # not over before n2 is lost
    try:
        assert took < 60, took   # the node's loss, seen by the controller (10 s), then KillWait (5 s): a wide margin
        info = job.done()
        assert slurm_cluster.sh("sinfo", "-h", "-n", "n2", "-o", "%T", env=slurm_cluster.env(cluster)).stdout.strip() \
            .startswith("down")
    finally:
        slurm_cluster.revive_node(cluster, "n2")
    log = job.log()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n1", (info, log[-3000:])
    assert "[resume] the world size changed, 4 -> 2 processes" in log and "[slurm] node 0/1: 2 processes" in log
    assert final(tmp_path / "run")["steps"] == 40 and final(tmp_path / "run")["num_processes"] == 2
    # the token stores (train, eval): written once on each node (n1: rank 0, n2: its first rank), read by the others
    # and by the requeued job; each store's log has a line for each time its task ran
    for node in ("n1", "n2"):
        logs = list((cluster / "nodes" / node / "local" / tmp_path.name).rglob("bert_recipes_stores/*/prepare.log"))
        runs = [log.read_text().count("Launching pipeline for rank=0") for log in logs]
        assert len(logs) == 2 and runs == [1, 1], (node, runs)


def test_node_silenced_then_the_job_cancelled(cluster, tmp_path, sample_dir, shared_tokenizer):
    """Node n2's link down inside its namespace: nothing is reset, its ranks live on. n1's ranks wait in a
    collective (train.collective_timeout_s=300) until the controller, which no longer hears n2, ends the job and
    requeues it: within a minute, not the collective timeout. The requeued job resumes on n1 alone; a cancel
    then ends it (no requeue: the script does nothing on TERM)."""
    # max_steps far beyond what runs before the cancel: on a fast machine 400 steps took 10 s, and the first run
    # ended before node n2 was silenced (CI, 2026-12-04)
    job, took = lose_node(cluster, tmp_path, sample_dir, shared_tokenizer, slurm_cluster.silence_node, 1,
                          **{"train.max_steps": 100000, "train.collective_timeout_s": 300})
    try:
        assert took < 60, took
        job.wait("the resumed run", lambda j: "[resume] the world size changed, 2 -> 1 processes" in j.log()
                 and j.info().get("JobState") == "RUNNING")
        assert job.info()["NodeList"] == "n1"
        job.scontrol("scancel", job.id)
        info = job.done(60)
        assert info["JobState"] == "CANCELLED" and info["Restarts"] == "1", info
    finally:
        slurm_cluster.kill_node(cluster, "n2")   # its ranks still wait for n1
        slurm_cluster.revive_node(cluster, "n2")
    time.sleep(2)
    assert job.info()["JobState"] == "CANCELLED"


def test_a_requeue_waits_for_the_old_allocations_hold_on_the_output_dir(cluster, tmp_path, sample_dir,
                                                                        shared_tokenizer):
    """Node n1, where rank 0 runs, silenced: its ranks live on (waiting in a collective, train.collective_timeout_s=180),
    and rank 0 still holds run.lock (its heartbeat thread renews it) while the controller, which no longer hears n1,
    requeues the job onto n2. The requeued job's rank 0 (SLURM_RESTART_COUNT=1: it waits, run.lock_wait_s's default)
    says whom it waits for and does not start. Then n1's processes are killed: the hold's heartbeat stops, and once it
    is older than run.lock_stale_s (30 s here) the requeued job takes it over with one line and resumes. Never two
    runs writing one directory at once."""
    job, took = lose_node(cluster, tmp_path, sample_dir, shared_tokenizer, slurm_cluster.silence_node, 1, node="n1",
                          **{"train.max_steps": 100000, "train.collective_timeout_s": 180, "run.lock_stale_s": 30})
    try:
        assert took < 60, took
        job.wait("the requeued job waiting", lambda j: "[lock] run.output_dir=" in j.log(), timeout=120)
        waiting = next(line for line in job.log().splitlines() if line.startswith("[lock] run.output_dir="))
        assert "is held by pid" in waiting and "on host n1 (SLURM job" in waiting, waiting
        assert "waiting up to 300s for it to end" in waiting
        time.sleep(5)
        assert "[resume] the world size changed" not in job.log(), job.log()[-2000:]   # it waits: no second writer
        slurm_cluster.kill_node(cluster, "n1")   # the old allocation ends: its heartbeat stops
        job.wait("the resumed run", lambda j: "[resume] the world size changed, 2 -> 1 processes" in j.log()
                 and j.steps() > 0, timeout=150)
        log = job.log()
        taken = [line for line in log.splitlines() if "took over the hold of pid" in line]
        assert len(taken) == 1 and "on host n1" in taken[0] and "no heartbeat from n1 for" in taken[0] \
            and "(run.lock_stale_s=30)" in taken[0], log[-3000:]
        assert log.index(waiting) < log.index(taken[0]) < log.index("[resume] the world size changed, 2 -> 1")
        assert job.info()["NodeList"] == "n2"
        holder = json.loads((tmp_path / "run" / "run.lock").read_text())
        assert holder["host"] == "n2" and holder["job"]["SLURM_RESTART_COUNT"] == "1", holder
        job.scontrol("scancel", job.id)
        assert job.done(60)["JobState"] == "CANCELLED"
    finally:
        slurm_cluster.kill_node(cluster, "n1")
        slurm_cluster.revive_node(cluster, "n1")


def test_an_array_job_prepares_a_store_that_two_nodes_train_from(cluster, tmp_path, sample_dir, shared_tokenizer):
    """slurm/prepare.sbatch as an array of 2 tasks over 4 parquet shards into one shared directory: the task
    that finishes last writes the manifest (both, the same bytes, where they finish together), and the files are byte for byte a one-machine preparation's; then
    slurm/ddp.sbatch trains on 2 nodes from that store (data.source=store)."""
    from test_store import parquet_tree, prepare
    files = parquet_tree(tmp_path / "corpus", sample_dir, shards=4, long_document=False)
    store = tmp_path / "store"
    job = Job(cluster, tmp_path / "prep", "slurm/prepare.sbatch",
              [str(store), "--data.source=files", f"--data.train_files=[{','.join(map(str, files))}]",
               f"--tokenizer.name_or_path={shared_tokenizer}"], {}, sbatch=["--array=0-1", "--open-mode=append"])
    job.wait("store.json", lambda j: (store / "store.json").exists(), timeout=240)
    job.wait("the array's end", lambda j: not slurm_cluster.sh("squeue", "-h", "-j", j.id,
                                                                env=slurm_cluster.env(cluster)).stdout.strip())
    log = job.log()
    # each part says what it did: a part that found another's tasks still running leaves the manifest to it; parts
    # that end together both find every task done and write the same manifest, through a rename each
    assert log.count("[prepare] ") == 2 and 1 <= log.count("a token store of") <= 2, log[-3000:]
    local = prepare(tmp_path / "local", files, shared_tokenizer, workers=1)
    assert local.returncode == 0, local.stderr[-2000:]
    assert sorted(p.name for p in (store / "tokens").iterdir()) == sorted(p.name for p in (tmp_path / "local/tokens").iterdir())
    assert all((store / "tokens" / p.name).read_bytes() == p.read_bytes() for p in (tmp_path / "local/tokens").iterdir())
    args = tiny(tmp_path / "run", cluster / "local" / tmp_path.name, sample_dir, shared_tokenizer, **{
        "train.max_steps": 6, "data.source": "store", "data.store_dir": str(store)})
    train = Job(cluster, tmp_path / "train", "slurm/ddp.sbatch", args, {"ACCELERATE_USE_CPU": "1"})
    info, log = train.done(), train.log()
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "n[1-2]", (info, log[-3000:])
    result = final(tmp_path / "run")
    assert result["num_processes"] == 2 and result["backend"]["name"] == "ddp" and result["steps"] == 6
