"""What breaks a run from outside it, each tried as it happens: a tracking server that does not answer or is lost
during the run (a real MLflow server, started and stopped by the test by its PID), a store MLflow refuses, W&B's
own directory, a tokenizer that changed under a resume, two runs in one output directory (real processes: a live
holder, one killed -9, one on another host whose heartbeat stopped), a shard still being downloaded, and a Hub
dataset or tokenizer that cannot be reached (offline, nothing cached)."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import (REPO, _port, launch_commands, launch_watched, refused_in_process, run_cli_in_process, run_in_process,
                      snapshot, tiny_args)


def argv(out: Path, sample_dir, datasets_cache, **extra) -> list[str]:
    return [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **extra)]


# ----------------------------------------------------------------------------- trackers
def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    return _port()


def test_a_tracking_server_that_does_not_answer_is_one_line_before_anything_is_written(
        tmp_path, sample_dir, datasets_cache, shared_tokenizer, monkeypatch, capsys):
    """MLFLOW_TRACKING_URI at a closed port: one line naming the URI and the fixes, from the check before anything is
    written, in seconds (MLflow's own default, 7 retries with backoff, took 254 s a call and then 5 tracebacks)."""
    uri = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    out = tmp_path / "run"
    started = time.monotonic()
    line = refused_in_process(argv(out, sample_dir, datasets_cache, **{
        "logging.trackers": "[mlflow]", "tokenizer.name_or_path": shared_tokenizer}), tmp_path, capsys)
    took = time.monotonic() - started
    assert f"the tracking server MLFLOW_TRACKING_URI={uri} does not answer" in line, line
    assert "start it, correct MLFLOW_TRACKING_URI, or leave mlflow out of logging.trackers" in line
    assert took < 60, took   # a closed port answers at once; a wide margin for a loaded host (the bug: 254 s)
    assert not out.exists()


def test_a_store_mlflow_refuses_is_one_line_naming_the_fix(tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                                           monkeypatch, capsys):
    """A file: URI, the form most MLflow tutorials still show: MLflow 3 keeps its file store in maintenance mode.
    One line naming the URI and both ways out, before anything is created (neither the store nor the run)."""
    store = tmp_path / "mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{store}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    line = refused_in_process(argv(tmp_path / "run", sample_dir, datasets_cache, **{
        "logging.trackers": "[mlflow]", "tokenizer.name_or_path": shared_tokenizer}), tmp_path, capsys)
    assert f"MLflow refuses MLFLOW_TRACKING_URI=file://{store}" in line, line
    assert "sqlite:///" in line and "MLFLOW_ALLOW_FILE_STORE=true" in line
    assert not store.exists() and not (tmp_path / "run").exists()


def mlflow_server(tmp_path: Path) -> tuple[subprocess.Popen, str, Path]:
    """A real MLflow tracking server on a loopback port (its own process group), its store a SQLite file.
    -> (process, URI, the store's file)."""
    store, port = tmp_path / "server.db", _port()
    server_path = Path(sys.executable).parent.parent / "mlflow-server"   # requirements-tests.txt, by make setup
    if not (server_path / "mlflow" / "server").is_dir():
        pytest.fail(f"no MLflow server in {server_path}: make setup installs requirements-tests.txt there")
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--backend-store-uri", f"sqlite:///{store}", "--default-artifact-root",
                             str(tmp_path / "artifacts"), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "MLFLOW_TRACKING_URI": "", "PYTHONPATH": str(server_path),
                                 "MLFLOW_DISABLE_TELEMETRY": "true"})
    uri = f"http://127.0.0.1:{port}"
    import urllib.request
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    return proc, uri, store
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            stop(proc)
            raise AssertionError(f"the MLflow server did not start: {(tmp_path / 'server.log').read_text()[-3000:]}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """The server's whole process group, by its PID, whatever state it is in."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def test_a_tracking_server_lost_during_the_run_neither_ends_nor_stalls_it(tmp_path, sample_dir, datasets_cache,
                                                                         shared_tokenizer):
    """2 processes log to a real MLflow server, which is killed after step 4 is logged. One warning line, the run
    goes on at its own pace (no MLflow retries of minutes a call), metrics.json holds every step, TensorBoard too,
    exit 0; the server's store holds the points logged before it was lost, each once."""
    from mlflow import MlflowClient
    server, uri, store = mlflow_server(tmp_path)
    killed = []

    def react(line, proc):
        if "[train] step 4/" in line and not killed:
            stop(server)
            killed.append(time.time())
            return True
        return False
    try:
        out = tmp_path / "run"
        code, log, after = launch_watched(tiny_args(out, sample_dir, datasets_cache, **{
            "tokenizer.name_or_path": shared_tokenizer, "logging.trackers": "[mlflow,tensorboard]",
            "train.max_steps": 24, "logging.log_every": 4}), react, env={"MLFLOW_TRACKING_URI": uri})
    finally:
        stop(server)
    assert code == 0, log[-3000:]
    warnings = [line for line in log.splitlines() if line.startswith("[trackers] WARNING: mlflow failed")]
    assert len(warnings) == 1 and "the run goes on" in warnings[0], log[-3000:]
    assert after < 120, after   # the rest of the run (5 log steps, an eval, the export): MLflow's default: 254 s a call
    metrics = json.loads((out / "metrics.json").read_text())
    assert [r["step"] for r in metrics["history"]["train"]] == [4, 8, 12, 16, 20, 24]
    assert metrics["final"]["num_processes"] == 2
    assert list((out / "logs").rglob("events.out.tfevents.*")), "TensorBoard went on"
    client = MlflowClient(f"sqlite:///{store}")
    (run,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert [p.step for p in client.get_metric_history(run.info.run_id, "train/loss")] == [4]


def test_wandb_writes_where_wandb_dir_says(tmp_path, sample_dir, datasets_cache, shared_tokenizer, monkeypatch):
    """WANDB_DIR, W&B's own convention, is where its files go when set (offline: nothing leaves the machine)."""
    home = tmp_path / "wandb-home"
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": home,
                       "WANDB_CACHE_DIR": home / "cache", "WANDB_DATA_DIR": home / "data",
                       "WANDB_DIR": tmp_path / "elsewhere"}.items():
        monkeypatch.setenv(var, str(value))
    out = tmp_path / "run"
    run_in_process(tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "logging.trackers": "[wandb]", "train.max_steps": 4,
        "checkpoint.export": False}))
    assert list((tmp_path / "elsewhere" / "wandb").glob("offline-run-*")), list((tmp_path / "elsewhere").rglob("*"))
    assert not (out / "logs" / "wandb").exists()


# ----------------------------------------------------------------------------- the tokenizer of a resume
def swapped_tokenizer(source: Path, into: Path, a: str = "the", b: str = "of") -> Path:
    """A copy of `source` with the ids of two tokens swapped: the same size, other meanings."""
    shutil.copytree(source, into)
    spec = json.loads((into / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (into / "tokenizer.json").write_text(json.dumps(spec))
    return into


def test_a_resume_with_another_tokenizer_is_one_line_and_writes_nothing(tmp_path, sample_dir, datasets_cache,
                                                                        shared_tokenizer, capsys):
    """Halted at step 4 with one tokenizer; the resume names a copy with two ids swapped (the same vocabulary size):
    one line naming both and the ways out, before anything is written; the run's own saved tokenizer stays as it was.
    The same tokenizer resumes without a word about it; a checkpoint from before fingerprints resumes with one note."""
    out = tmp_path / "run"
    common = {"train.max_steps": 8, "checkpoint.save_every": 4, "checkpoint.export": False}
    run_in_process(tiny_args(out, sample_dir, datasets_cache, **common, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.halt_at_step": 4}))
    other = swapped_tokenizer(shared_tokenizer, tmp_path / "other")
    line = refused_in_process(argv(out, sample_dir, datasets_cache, **common, **{
        "tokenizer.name_or_path": other, "checkpoint.resume": "auto"}), out, capsys)
    assert line.startswith(f"config error: tokenizer: {out}/checkpoints/step_00000004 was trained with another "
                           f"tokenizer ({shared_tokenizer}, 1000 tokens"), line
    assert f"than this run's ({other}, 1000 tokens" in line
    assert f"resume with the run's own saved tokenizer (--tokenizer.name_or_path={out}/tokenizer), or start a new run " \
           "in another run.output_dir" in line
    # the run's own tokenizer is the way back: the resume with it goes on, silent about the tokenizer
    code, printed = run_cli_in_process(argv(out, sample_dir, datasets_cache, **common, **{
        "tokenizer.name_or_path": out / "tokenizer", "checkpoint.resume": "auto", "train.halt_at_step": 6}), capsys,
        stdout_too=True)
    assert code == 0 and "[resume] from" in printed, printed[-2000:]
    assert "another tokenizer" not in printed and "fingerprint" not in printed, printed[-2000:]
    # a checkpoint that records no fingerprint (saved before checkpoints did): one note, and it resumes
    state_file = out / "checkpoints/step_00000006/train_state.json"
    state = json.loads(state_file.read_text())
    del state["tokenizer"]
    state_file.write_text(json.dumps(state))
    resumed = run_in_process(tiny_args(out, sample_dir, datasets_cache, **common, **{
        "tokenizer.name_or_path": shared_tokenizer, "checkpoint.resume": "auto"}))
    assert resumed["steps"] == 8
    assert "records no tokenizer fingerprint" in capsys.readouterr().out


# ----------------------------------------------------------------------------- one run per output directory
# A long run's checkpoints: every 50 steps (a tiny step takes about 12 ms here), none pruned while a test reads them
KEEP = {"checkpoint.save_every": 50, "checkpoint.keep_last": 1000}
STEP_50 = "checkpoints/step_00000050/train_state.json"


def start_run(out: Path, sample_dir, datasets_cache, tokenizer, log: Path, **extra) -> subprocess.Popen:
    """A long one-process run (python train.py), started in its own session; its output to `log`."""
    cmd = [sys.executable, "train.py", *argv(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": tokenizer, "train.max_steps": 100000, **KEEP, **extra})]
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})


def wait_for(what: str, ok, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not ok():
        if time.time() > deadline:
            raise AssertionError(f"no {what} within {timeout:.0f}s: {log.read_text()[-3000:]}")
        time.sleep(0.2)


def kill(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=120)


def kill_every_run_into(out: Path) -> None:
    """SIGKILL every process training into `out`, whatever a failed assertion left running: under the suite's warm
    start a killed `python train.py` leaves its twin (tests/warm/), which must not train on for hours."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            if f"--run.output_dir={out}" in (process.info["cmdline"] or []):
                process.kill()
        except psutil.Error:
            pass


def test_a_second_run_into_a_held_output_dir_is_one_line_and_writes_nothing(tmp_path, sample_dir, datasets_cache,
                                                                             shared_tokenizer):
    """A run trains (and has saved step 4); a second one, launched on 2 processes with --resume auto into the same
    directory, is refused: one line naming the holder (its pid and host), exit 2 on every rank, no traceback,
    nothing written. The first trains on, and its lock is gone once it ends."""
    out, log = tmp_path / "run", tmp_path / "first.log"
    first = start_run(out, sample_dir, datasets_cache, shared_tokenizer, log)
    try:
        wait_for("checkpoint at step 50", lambda: (out / STEP_50).exists(), log)
        holder = json.loads((out / "run.lock").read_text())   # the training process (under the suite's warm start
        # not `first` itself, which forwards signals to it and ends as it ends: tests/warm/); a process the warm server
        # forked keeps the server's command line
        cmdline = " ".join(psutil.Process(holder["pid"]).cmdline())
        assert holder["host"] == socket.gethostname() and holder["pid"] != first.pid
        assert "train.py" in cmdline or "tests/warm/server.py" in cmdline, cmdline
        # the second run, as the Make targets launch it: 2 ranks; what it reads does not change meanwhile (the first
        # writes its later checkpoints beside it: the watched part is checkpoint 50)
        watched = out / "checkpoints" / "step_00000050"
        before = snapshot(watched)
        (cmd,), env = launch_commands("train.py", argv(out, sample_dir, datasets_cache, **{
            "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 100000, "checkpoint.resume": "auto",
            **KEEP}), 2)
        done = subprocess.run([sys.executable, "-m", "bert_recipes.launch", *cmd], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)   # as make <row> launches: its exit code
        code, second = done.returncode, done.stdout + done.stderr
        errors = [line for line in second.splitlines() if line.startswith("config error:")]
        assert code == 2 and len(errors) == 1, second[-3000:]
        assert f"run.output_dir={out} is in use by another run: pid {holder['pid']} on host {socket.gethostname()}" \
            in errors[0] and "give this run another run.output_dir" in errors[0], errors
        assert "Traceback" not in second and "[resume] from" not in second
        assert snapshot(watched) == before and first.poll() is None
    finally:
        kill(first, signal.SIGTERM)   # it saves and leaves, releasing its hold
        kill_every_run_into(out)
    assert first.returncode == 143, log.read_text()[-2000:]
    assert not (out / "run.lock").exists()


def test_a_hold_whose_holder_is_gone_is_taken_over_with_one_line(tmp_path, sample_dir, datasets_cache,
                                                                 shared_tokenizer, capsys):
    """kill -9 leaves the lock behind: the next run on this host finds its process gone and takes it over (one line),
    then resumes. A hold from another host is taken over once its heartbeat is older than run.lock_stale_s, and
    refused while it is fresh."""
    out, log = tmp_path / "run", tmp_path / "first.log"
    first = start_run(out, sample_dir, datasets_cache, shared_tokenizer, log)
    try:
        wait_for("checkpoint at step 50", lambda: (out / STEP_50).exists(), log)
        pid = json.loads((out / "run.lock").read_text())["pid"]   # the training process (the warm start: tests/warm/)
        os.kill(pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        kill_every_run_into(out)
    assert json.loads((out / "run.lock").read_text())["pid"] == pid   # left behind
    latest = max(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*[0-9]"))
    done = {"train.max_steps": latest + 4, "checkpoint.resume": "auto", "tokenizer.name_or_path": shared_tokenizer,
            "checkpoint.export": False, **KEEP}
    code, printed = run_cli_in_process(argv(out, sample_dir, datasets_cache, **done), capsys, stdout_too=True)
    assert code == 0, printed[-3000:]
    taken = [line for line in printed.splitlines() if line.startswith("[lock]")]
    assert len(taken) == 1 and f"took over the hold of pid {pid} on host {socket.gethostname()}" in taken[0] \
        and f"its process {pid} is gone (same host)" in taken[0], printed[-3000:]
    assert not (out / "run.lock").exists()
    # another host: fresh, it is refused naming the host; with no heartbeat for longer than run.lock_stale_s, taken over
    lock = {"host": "n9.cluster", "pid": 4242, "started": time.time() - 600, "token": "x", "job": {"SLURM_JOB_ID": "77"}}
    (out / "run.lock").write_text(json.dumps({**lock, "heartbeat": time.time() - 5}))
    line = refused_in_process(argv(out, sample_dir, datasets_cache, **done), out / "checkpoints", capsys)
    assert "is in use by another run: pid 4242 on host n9.cluster (SLURM job 77)" in line and "heartbeat 5s ago" in line
    (out / "run.lock").write_text(json.dumps({**lock, "heartbeat": time.time() - 200}))
    code, printed = run_cli_in_process(argv(out, sample_dir, datasets_cache, **{**done, "train.max_steps": latest + 8}),
                                       capsys, stdout_too=True)
    assert code == 0 and "took over the hold of pid 4242 on host n9.cluster" in printed, printed[-3000:]
    assert "no heartbeat from n9.cluster for 200s (run.lock_stale_s=120)" in printed


def test_a_run_waits_for_the_holder_when_asked_and_says_so(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """run.lock_wait_s (what a SLURM requeue gets by default: tests/test_slurm.py): the second run says whom it waits
    for, and starts once the first has saved and left (SIGTERM), resuming from the checkpoint it saved."""
    from bert_recipes.run_dir import REQUEUE_WAIT_S, lock_wait
    assert lock_wait(None, {}) == 0 and lock_wait(None, {"SLURM_RESTART_COUNT": "1"}) == REQUEUE_WAIT_S
    assert lock_wait(7.0, {"SLURM_RESTART_COUNT": "1"}) == 7.0
    out, log, second_log = tmp_path / "run", tmp_path / "first.log", tmp_path / "second.log"
    first = start_run(out, sample_dir, datasets_cache, shared_tokenizer, log)
    second = None
    try:
        wait_for("checkpoint at step 50", lambda: (out / STEP_50).exists(), log)
        second = subprocess.Popen([sys.executable, "train.py", *argv(out, sample_dir, datasets_cache, **{
            "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 100000, "checkpoint.resume": "auto",
            "run.lock_wait_s": 300, **KEEP})], cwd=REPO, stdout=open(second_log, "w"), stderr=subprocess.STDOUT,
            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        wait_for("the waiting line", lambda: "waiting up to 300s for it to end" in second_log.read_text(), second_log)
        holder = json.loads((out / "run.lock").read_text())["pid"]
        assert f"is held by pid {holder} on host {socket.gethostname()}" in second_log.read_text()
        kill(first, signal.SIGTERM)   # it saves the step reached and leaves
        saved = re.search(r"every rank stopped after step (\d+)/", log.read_text())
        assert first.returncode == 143 and saved, log.read_text()[-2000:]
        wait_for("the resume", lambda: f"[resume] from {out}/checkpoints/step_{int(saved[1]):08d}"
                 in second_log.read_text(), second_log)
        assert json.loads((out / "run.lock").read_text())["pid"] not in (holder, None)   # the second's now
    finally:
        kill(first, signal.SIGTERM)
        if second is not None:
            kill(second, signal.SIGTERM)
        kill_every_run_into(out)
    assert second.returncode == 143 and not (out / "run.lock").exists(), second_log.read_text()[-2000:]


def test_a_run_refused_after_taking_the_hold_leaves_no_directory_behind(tmp_path, sample_dir, datasets_cache, capsys):
    """The hold is taken before the data is read; a mistake found there (a corrupt shard: datasets finds it while
    reading) is one line and leaves nothing: no output directory, none of the directories above it, no lock."""
    import gzip
    shards = tmp_path / "shards"
    shards.mkdir()
    text = (sample_dir / "pretrain/train.txt").read_text()
    (shards / "part-00000.txt.gz").write_bytes(gzip.compress(text[:20000].encode()))
    (shards / "part-00001.txt.gz").write_bytes(gzip.compress(text[20000:40000].encode())[:-100] + b"\0" * 100)
    out = tmp_path / "deep" / "run"
    line = refused_in_process(argv(out, sample_dir, tmp_path / "cache", **{
        "data.source": "files", "data.train_files": f"[{shards}]"}), tmp_path / "deep", capsys)
    assert "part-00001.txt.gz is a corrupt gzip file" in line, line
    assert not (tmp_path / "deep").exists()


def test_a_shard_still_being_downloaded_is_one_line_naming_it(tmp_path, sample_dir, datasets_cache, capsys):
    """A directory of shards with one still downloading (huggingface_hub names it .incomplete until it is whole):
    refused, naming the file and what it looks like (docs/data.md), before anything is written."""
    shards = tmp_path / "shards"
    shards.mkdir()
    lines = (sample_dir / "pretrain/train.txt").read_text().splitlines(keepends=True)
    (shards / "part-00000.txt").write_text("".join(lines[:300]))
    (shards / "part-00001.txt.incomplete").write_text("".join(lines[300:350]))
    out = tmp_path / "run"
    line = refused_in_process(argv(out, sample_dir, datasets_cache, **{
        "data.source": "files", "data.train_files": f"[{shards}]"}), tmp_path, capsys)
    assert f"data file {shards}/part-00001.txt.incomplete looks like a download in progress" in line, line
    assert "wait until the download finishes" in line and "or remove the file" in line
    assert not out.exists()


# ----------------------------------------------------------------------------- the Hub out of reach
@pytest.fixture
def offline_empty_caches(tmp_path, monkeypatch) -> Path:
    """A compute node without the Hub: offline mode on and every cache empty. The libraries read HF_HOME and the
    offline variables when imported (this process imported them long ago), so their constants are set too."""
    import datasets
    from huggingface_hub import constants
    home = tmp_path / "hf_home"
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(home / "datasets"))
    return home


def test_a_hub_dataset_out_of_reach_is_one_line_naming_it_and_the_fix(tmp_path, offline_empty_caches, capsys):
    """recipes/modernbert-base-mlm.yaml as it ships (FineWeb-Edu from the Hub) on a node without the Hub: datasets'
    ConnectionError becomes one line naming the dataset, its config, the cache looked in, offline mode and the fix,
    before the model is built; nothing is written to run.output_dir."""
    runs = tmp_path / "runs"
    line = refused_in_process(["--recipe", str(REPO / "recipes/modernbert-base-mlm.yaml"),
                               f"--run.output_dir={runs / 'modernbert'}", f"--data.cache_dir={tmp_path / 'cache'}"],
                              runs, capsys)
    assert "data.dataset_name=HuggingFaceFW/fineweb-edu (data.dataset_config=sample-10BT): the Hub cannot be " \
           f"reached and the dataset is not in the cache {tmp_path / 'cache'} (data.cache_dir)" in line, line
    assert "offline mode is on (HF_DATASETS_OFFLINE=1, HF_HUB_OFFLINE=1)" in line, line
    assert "run make prepare RECIPE=<this recipe>" in line and "data.cache_dir / HF_HOME" in line, line
    assert not runs.exists()


def test_a_hub_tokenizer_out_of_reach_is_one_line_naming_it_and_the_fix(tmp_path, sample_dir, datasets_cache,
                                                                        offline_empty_caches, capsys):
    """The sample's text (in the shared cache) with a Hub tokenizer no cache holds: transformers' OSError ("We
    couldn't connect to ...") becomes one line naming tokenizer.name_or_path, the Hub cache and the fix."""
    out = tmp_path / "run"
    line = refused_in_process(["--recipe", str(REPO / "recipes/tiny-mlm.yaml")] + argv(
        out, sample_dir, datasets_cache, **{"tokenizer.name_or_path": "some-org/unreachable-tokenizer"}), out, capsys)
    assert "tokenizer.name_or_path=some-org/unreachable-tokenizer: the Hub cannot be reached and the tokenizer is " \
           f"not in the cache {offline_empty_caches / 'hub'}" in line, line
    assert "offline mode is on (HF_HUB_OFFLINE=1)" in line and "run make prepare RECIPE=<this recipe>" in line, line
    assert not out.exists()
