"""Cluster-grade reliability with real processes (2 CPU ranks over gloo): preemption signals sent to
the launcher, kill -9 of a rank (also in the middle of a checkpoint save), a stuck rank, poison data
and a diverging run. Each run that is cut short is resumed and compared with an uninterrupted one."""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import signal
import threading
import time

import pytest
from safetensors.torch import load_file

from bert_recipes.checkpoint import complete_checkpoints, resolve_resume
from conftest import REPO, assert_same_weights, launch, launch_watched, run_cli_in_process, tiny_args, worker_pids

STEPS = 32
NO_DROPOUT = {"model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0}


def common(shared_tokenizer, **extra):
    return {**NO_DROPOUT, "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": STEPS,
            "logging.log_every": 1, "checkpoint.save_every": 4, **extra}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, sample_dir, datasets_cache, shared_tokenizer):
    """reference(backend) -> the export of an uninterrupted run with the tests' settings (once per backend)."""
    done = {}

    def run(backend: str):
        if backend not in done:
            out = tmp_path_factory.mktemp("reference") / backend
            final = launch(2, tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer)), backend=backend)
            assert final["final"]["steps"] == STEPS and final["final"]["num_processes"] == 2
            done[backend] = load_file(out / "model/model.safetensors")
        return done[backend]
    return run


def at_step(n: int, action):
    """React once the log shows training step n (log_every 1)."""
    def react(line, proc):
        if f"[train] step {n}/" in line:
            action(proc)
            return True
        return False
    return react


def resume_and_compare(args, backend, launcher, expected, out):
    resumed = launch(2, args + ["checkpoint.resume=auto"], backend=backend, launcher=launcher)
    final = resumed["final"]
    assert final["steps"] == STEPS and final["num_processes"] == 2
    assert final["backend"]["name"] == ("pipeline" if backend == "pipeline" else backend)
    assert_same_weights(expected, out / "model/model.safetensors", 1e-6)
    return (out.parent / f"{out.name}.log").read_text()


# ----------------------------------------------------------------------------- preemption
@pytest.mark.parametrize("backend, launcher, sig, resume", [
    ("ddp", "accelerate", signal.SIGTERM, True),
    ("ddp", "torchrun", signal.SIGTERM, "on 1"),   # another launcher's forwarding; resumed on ONE process
    ("zero2", "accelerate", signal.SIGTERM, True),
    ("pipeline", "accelerate", signal.SIGTERM, True),
    ("ddp", "accelerate", signal.SIGUSR1, False),  # another signal; the resume is the same as SIGTERM's
    ("ddp", "accelerate", signal.SIGINT, False),   # Ctrl-C in the loop: the same stop, exit 130 on every rank
])
def test_signal_to_the_launcher_saves_the_step_reached_and_resume_is_exact(backend, launcher, sig, resume, reference,
                                                                          tmp_path, sample_dir, datasets_cache,
                                                                          shared_tokenizer):
    """The launcher forwards the signal to every rank; they agree on one step, save it, and exit
    128 + signal; the resumed run ends with the uninterrupted run's weights (once per engine). (SIGUSR1:
    the launcher must be told to forward it, PET_SIGNALS_TO_HANDLE, as the Makefile and slurm/ scripts do.)"""
    out = tmp_path / "run"
    args = tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer))
    env = {"PET_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"}
    code, log, seconds = launch_watched(args, at_step(10, lambda proc: proc.send_signal(sig)), backend=backend,
                                        launcher=launcher, env=env)
    name, exit_code = sig.name, 128 + int(sig)
    # The ranks stop on their own: the launcher never had to SIGKILL them after its 30 s grace period
    # (a bound on the seconds would only measure how loaded the host is).
    assert code != 0 and "forcefully exiting via" not in log, (code, seconds, log[-3000:])
    assert log.count(f"[preempt] {name} received") == 1, log[-3000:]
    step = int(re.search(r"every rank stopped after step (\d+)/", log).group(1))
    assert 10 <= step < STEPS
    assert f"exiting with code {exit_code}" in log
    halted = json.loads((out / "metrics.json").read_text())["final"]
    assert halted == {"steps": step, "halted": True, "preempted": name, "exit_code": exit_code}
    assert complete_checkpoints(out)[-1].name == f"step_{step:08d}"
    if resume == "on 1":   # the requeued job got fewer GPUs: DDP goes on (docs/checkpoints.md), another summation order
        final = launch(1, args + ["checkpoint.resume=auto"], backend=backend)["final"]
        assert final["steps"] == STEPS and final["num_processes"] == 1 and final["backend"]["name"] == "ddp"
        assert "the world size changed, 2 -> 1 processes" in (out.parent / f"{out.name}.log").read_text()
        assert_same_weights(reference(backend), out / "model/model.safetensors", 1e-5)
    elif resume:
        log = resume_and_compare(args, backend, launcher, reference(backend), out)
        assert f"[resume] from {out}/checkpoints/step_{step:08d} at step {step}" in log


def test_sigterm_exit_code_of_a_single_process(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Without a launcher the process's own exit code is visible: 143 after SIGTERM. A second SIGTERM
    (an impatient scheduler) while it saves changes nothing: the checkpoint verifies and resumes."""
    import subprocess
    import sys

    from bert_recipes.checkpoint import damage
    out = tmp_path / "run"
    args = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer))]
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log = []
    for line in proc.stdout:
        log.append(line)
        if "[train] step 5/" in line:
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.02)
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, "".join(log)[-3000:]
    final = json.loads((out / "metrics.json").read_text())["final"]
    assert final["exit_code"] == 143
    latest = complete_checkpoints(out)[-1]
    assert latest.name == f"step_{final['steps']:08d}" and damage(latest) is None
    resumed = subprocess.run([sys.executable, "train.py", *args, "--resume=auto"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0 and f"[resume] from {latest}" in resumed.stdout


# ----------------------------------------------------------------------------- Ctrl-C
def _interrupt(args: list[str], when: str) -> tuple[int, str]:
    """`python train.py args`, a real SIGINT when a line holding `when` comes (what a terminal's Ctrl-C sends);
    killed, and the test failed with its last lines, if it has not ended 120 s later. -> (exit code, output)."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "train.py", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    log, sent = [], False
    try:
        for line in proc.stdout:
            log.append(line)
            if not sent and when in line:
                proc.send_signal(signal.SIGINT)
                sent = True
        code = proc.wait()
    finally:
        watchdog.cancel()
    assert sent and code != -signal.SIGKILL, f"no '{when}' line, or it hung:\n{''.join(log)[-3000:]}"
    return code, "".join(log)


def test_ctrl_c_is_one_line_and_the_same_command_runs_again(tmp_path, sample_dir, shared_tokenizer):
    """A real SIGINT during data preparation (a fresh data cache: datasets is writing it) and during training:
    each is one line and exit code 130, no traceback; the same command then runs (from training's checkpoint,
    with --resume auto, as the line says) and finishes."""
    import subprocess
    import sys
    out = tmp_path / "run"
    # datasets' bars on (logging.progress_bar): its "Generating train split" says it is writing a new cache
    args = [f"--{a}" for a in tiny_args(out, sample_dir, tmp_path / "cache", **{"train.max_steps": 12,
                                                                               "logging.progress_bar": True})]
    code, log = _interrupt(args, "Generating train split")   # datasets is writing a new cache
    said = [line for line in log.splitlines() if line.startswith("interrupted at")]
    assert code == 130 and said == ["interrupted at data preparation; rerun the same command"], log[-3000:]
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    assert complete_checkpoints(out) == []
    code, log = _interrupt(args, "[train] step 4/")   # the same command, now interrupted in the loop
    assert code == 130 and "Traceback" not in log, log[-3000:]
    latest = complete_checkpoints(out)[-1]
    said = [line for line in log.splitlines() if "SIGINT" in line]
    assert len(said) == 1 and said[0].startswith("[preempt] SIGINT received: every rank stopped after step"), log
    assert said[0].endswith(f"exiting with code 130; continue from {latest} with --resume auto"), said[0]
    resumed = subprocess.run([sys.executable, "train.py", *args, "--resume=auto"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0 and f"[resume] from {latest}" in resumed.stdout, resumed.stderr[-3000:]
    assert json.loads((out / "metrics.json").read_text())["final"]["steps"] == 12


# ----------------------------------------------------------------------------- dead or stuck ranks
@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_kill_9_of_a_rank_stops_the_job_and_resume_is_exact(backend, reference, tmp_path, sample_dir, datasets_cache,
                                                            shared_tokenizer):
    out = tmp_path / "run"
    # The job must end because a rank died, not because a collective gave up waiting for it: with the
    # timeout at 120 s, an end within 60 s (about 6 s measured on 2 loaded cores) can only be the former.
    args = tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer, **{"train.collective_timeout_s": 120}))
    code, log, seconds = launch_watched(args, at_step(10, lambda proc: os.kill(worker_pids(proc)[1], signal.SIGKILL)),
                                        backend=backend)
    assert code != 0 and seconds < 60, (code, seconds)
    saved = complete_checkpoints(out)[-1]
    assert 8 <= int(saved.name.split("_")[1]) < STEPS
    log = resume_and_compare(args, backend, "accelerate", reference(backend), out)
    assert f"[resume] from {saved}" in log


def test_kill_9_during_a_checkpoint_save_keeps_the_previous_one(reference, tmp_path, sample_dir, datasets_cache,
                                                                shared_tokenizer):
    """Rank 1 is killed the moment step 12's checkpoint directory appears (still .partial): step 8
    stays the checkpoint --resume auto picks, and the resumed run is exact."""
    for attempt in range(4):   # a kill that lands after the rename proves nothing: try again
        out = tmp_path / f"run{attempt}"
        args = tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer))
        partial = out / "checkpoints/step_00000012.partial"
        seen = {}

        def watch(proc):
            pids = worker_pids(proc)
            deadline = time.time() + 60
            while not partial.exists() and time.time() < deadline and proc.poll() is None:
                time.sleep(0.0005)
            os.kill(pids[1], signal.SIGKILL)
            seen["killed"] = True

        def react(line, proc):
            if "[train] step 9/" in line:
                threading.Thread(target=watch, args=(proc,), daemon=True).start()
                return True
            return False
        code, _, _ = launch_watched(args, react)
        assert code != 0
        # decided once the job is over: a kill that landed after the save's last barrier lets rank 0
        # publish step 12 after all
        if seen.get("killed") and not (out / "checkpoints/step_00000012/train_state.json").exists():
            break
    else:
        pytest.fail("the kill never landed inside the save")
    assert [p.name for p in complete_checkpoints(out)][-1] == "step_00000008"
    assert resolve_resume("auto", out)[0].name == "step_00000008"
    resume_and_compare(args, "ddp", "accelerate", reference("ddp"), out)


@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_resume_is_exact(backend, reference, tmpfs, tmp_path,
                                                                            sample_dir, datasets_cache,
                                                                            shared_tokenizer):
    """The output directory on a 1 MiB tmpfs: step 4's checkpoint (about 0.7 MB) fits, step 8's does not. Every
    rank learns of it (DDP: only rank 0's write fails; ZeRO-2: every rank writes its own partition) and exits
    with code 5 after one [disk full] line, with no traceback and no hang; the .partial is gone, step 4 stays
    complete, and --resume auto from it, on a disk with room, ends with the uninterrupted run's weights."""
    out = tmpfs(1 << 20) / "run"
    args = tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer, **{"train.collective_timeout_s": 120}))
    code, log, _ = launch_watched(args, lambda line, proc: False, backend=backend)
    lines = [line for line in log.splitlines() if "[disk full]" in line]
    assert code != 0 and "exitcode  : 5" in log and len(lines) == 1, log[-4000:]
    assert "the checkpoint at step 8 could not be written to" in lines[0] and "free on its filesystem" in lines[0]
    assert "needed (an estimate: the size of step_00000004)" in lines[0], lines[0]
    assert "step_00000004 stays the latest checkpoint" in lines[0], lines[0]
    assert not re.search(r'File ".*(train\.py|bert_recipes/)', log), log[-4000:]   # only the launcher's own report
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000004"]
    assert resolve_resume("auto", out)[0].name == "step_00000004"   # complete: its manifest verifies
    moved = tmp_path / "room"
    shutil.copytree(out, moved)
    resume_and_compare(tiny_args(moved, sample_dir, datasets_cache, **common(shared_tokenizer)), backend, "accelerate",
                       reference(backend), moved)


def _full_in_process(argv: list[str], capsys) -> str:
    """train.py's command line in this process, on a disk that fills: exit code 5, one [disk full] line, no
    traceback. -> the line."""
    code, err = run_cli_in_process(argv, capsys)
    lines = [line for line in err.splitlines() if line.startswith("[disk full]")]
    assert code == 5 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_a_full_disk_during_the_export_is_one_line(tmpfs, tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                                   capsys):
    """64 KiB: the run's config and tokenizer fit (about 40 KiB in pages), the export's weights (about 110 KB)
    do not. The model.partial is removed; nothing else of the export is left."""
    out = tmpfs(64 << 10) / "run"
    args = tiny_args(out, sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer,
                                                         "train.max_steps": 2, "checkpoint.save_every": "null",
                                                         "checkpoint.save_final": "false"})
    line = _full_in_process([f"--{a}" for a in args], capsys)
    assert f"the export at step 2 could not be written to {out}/model.partial" in line, line
    assert "needed (an estimate: 4 bytes per parameter" in line and "the checkpoints stay" in line, line
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "tokenizer"]


def test_a_full_disk_in_the_data_cache_is_one_line(tmpfs, tmp_path, sample_dir, shared_tokenizer, capsys):
    """data.cache_dir on 16 KiB: datasets' copy of the sample does not fit. The output directory is not made."""
    cache = tmpfs(16 << 10)
    out = tmp_path / "run"
    args = tiny_args(out, sample_dir, cache, **{"tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 2})
    line = _full_in_process([f"--{a}" for a in args], capsys)
    assert "[disk full] the raw data (the sample, or a download) at step 0 could not be written to" in line, line
    assert str(cache) in line and "the output directory is untouched" in line and not out.exists(), line


def test_a_full_disk_while_saving_a_trained_tokenizer_is_one_line(tmpfs):
    """The tokenizer a run trains goes to the data cache first (tokenizer.get_tokenizer): on a 4 KiB disk its
    tokenizer.json does not fit; nothing is left of it."""
    from datasets import Dataset

    from bert_recipes.config import DataConfig, TokenizerConfig
    from bert_recipes.disk import DiskFull
    from bert_recipes.data.tokenizer import get_tokenizer
    cache = tmpfs(4 << 10)
    raw = Dataset.from_dict({"text": [f"line {i} of words for a tokenizer to learn" for i in range(200)]})
    with pytest.raises(DiskFull) as caught:
        get_tokenizer(TokenizerConfig(vocab_size=300), None, raw, DataConfig(cache_dir=str(cache)), cache / "run",
                      is_main=True)
    assert str(caught.value).startswith("[disk full] the trained tokenizer at step 0 could not be written to")
    assert "needed (an estimate: twice its tokenizer.json)" in str(caught.value)
    assert not [p for p in cache.rglob("*") if p.is_file()]


def test_a_stuck_rank_ends_the_run_within_the_collective_timeout(tmp_path, sample_dir, datasets_cache,
                                                                 shared_tokenizer):
    """SIGSTOP freezes rank 1 (alive, not dead: the launcher cannot tell). Rank 0 gives up after
    train.collective_timeout_s=5 with a message naming it and exits. The launcher would give the frozen
    rank 30 s (its shutdown grace, which `accelerate launch` does not let us shorten) before SIGKILL;
    the test kills it as soon as rank 0 has spoken. The bound only separates "the 5 s setting took
    effect" from "the 600 s default": about 5 s was measured on 2 loaded cores."""
    out = tmp_path / "run"
    args = tiny_args(out, sample_dir, datasets_cache, **common(shared_tokenizer, **{"train.collective_timeout_s": 5}))
    stopped, message_at = {}, {}

    def react(line, proc):
        if "a collective gave up" in line and "t" in stopped and "t" not in message_at:
            message_at["t"] = time.time() - stopped["t"]
            os.kill(stopped["pid"], signal.SIGKILL)
        if "[train] step 10/" in line and "t" not in stopped:
            stopped["pid"] = worker_pids(proc)[1]
            os.kill(stopped["pid"], signal.SIGSTOP)
            stopped["t"] = time.time()
            return True
        return False
    try:
        # cold ranks: a SIGSTOP stops the process it is sent to, and a warm rank's stand-in cannot pass it on (conftest)
        code, log, seconds = launch_watched(args, react, timeout=180, env={"BERT_RECIPES_WARM": "0"})
    finally:
        try:
            os.kill(stopped["pid"], signal.SIGKILL)
        except (KeyError, ProcessLookupError):
            pass
    assert code != 0
    assert 4 < message_at["t"] < 60, message_at
    assert "train.collective_timeout_s=5" in log and "Timed out" in log


# ----------------------------------------------------------------------------- non-finite steps
def _regression_csv(path, sample_dir, rows: int, poison: set[int]):
    texts = [json.loads(l)["text"] for l in (sample_dir / "classify/train.jsonl").read_text().splitlines()][:rows]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["text", "label"])
        for i, t in enumerate(texts):
            w.writerow([t, 1e20 if i in poison else float(len(t) % 5)])
    return path


def regression_args(out, sample_dir, datasets_cache, shared_tokenizer, train_csv, eval_csv, **extra):
    return tiny_args(out, sample_dir, datasets_cache, task="classification", **{
        "task.num_labels": 1, "data.source": "files", "data.train_files": f"[{train_csv}]",
        "data.validation_files": f"[{eval_csv}]", "data.max_train_samples": "null", "data.max_eval_samples": "null",
        "tokenizer.name_or_path": shared_tokenizer, "train.global_batch_size": 16, "train.micro_batch_size": 8,
        "train.max_steps": 16, "logging.log_every": 1, "optim.lr": 1e-3, **extra})


@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_a_poison_batch_is_skipped_and_training_goes_on(backend, tmp_path, sample_dir, datasets_cache,
                                                        shared_tokenizer):
    """One regression target of 1e20 among 256: its step's loss is inf; that update is skipped on
    both ranks, counted, and the run finishes with finite losses."""
    train_csv = _regression_csv(tmp_path / "train.csv", sample_dir, 256, poison={37})
    eval_csv = _regression_csv(tmp_path / "eval.csv", sample_dir, 64, poison=set())
    out = tmp_path / "run"
    metrics = launch(2, regression_args(out, sample_dir, datasets_cache, shared_tokenizer, train_csv, eval_csv),
                     backend=backend)
    final = metrics["final"]
    assert final["num_processes"] == 2 and final["backend"]["name"] == backend
    assert final["steps"] == 16 and final["skipped_steps"] == 1, final
    log = (tmp_path / "run.log").read_text()
    assert log.count("[skip] ") == 1 and "[skip] 1 update skipped (step " in log and "(1 in a row;" in log
    rows = metrics["history"]["train"]
    assert sum(1 for r in rows if r["loss"] != r["loss"] or abs(r["loss"]) == float("inf")) == 1
    assert all(abs(r["loss"]) < 1e6 for r in rows[-4:]) and final["eval_loss"] == final["eval_loss"]


@pytest.mark.parametrize("backend", ["ddp", "zero2"])
def test_a_diverging_run_stops_with_a_diagnosis_and_keeps_its_last_good_checkpoint(backend, tmp_path, sample_dir,
                                                                                   datasets_cache, shared_tokenizer):
    """8 good steps (checkpoints at 4 and 8), then the run continues on data whose every target is
    1e20: 3 skipped updates in a row (train.max_bad_steps=3) stop it with the diagnosis, and the
    checkpoints are exactly those of the good steps."""
    clean = _regression_csv(tmp_path / "clean.csv", sample_dir, 256, poison=set())
    poisoned = _regression_csv(tmp_path / "poisoned.csv", sample_dir, 256, poison=set(range(256)))
    out = tmp_path / "run"
    base = dict(out=out, sample_dir=sample_dir, datasets_cache=datasets_cache, shared_tokenizer=shared_tokenizer,
                eval_csv=clean)
    launch(2, regression_args(train_csv=clean, **base, **{"checkpoint.save_every": 4, "train.halt_at_step": 8}),
           backend=backend)
    before = {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints").iterdir()}
    assert sorted(before) == ["step_00000004", "step_00000008"]
    args = regression_args(train_csv=poisoned, **base, **{"checkpoint.save_every": 1, "train.max_bad_steps": 3,
                                                          "checkpoint.resume": "auto"})
    from conftest import launch_script
    log = launch_script("train.py", [f"--{a}" for a in args], 2, backend=backend, check=False)
    note = next(line for line in log.splitlines() if "the config differs from the checkpoint's" in line)
    assert "data.train_files" in note and "train.max_bad_steps: 10 -> 3" in note, note
    assert log.count("[diverged] 3 steps in a row had a non-finite loss or gradient norm") == 1, log[-3000:]
    assert "stopped at step 11" in log and "no finite step since the run (re)started" in log
    assert "Likely causes" in log and f'File "{REPO / "train.py"}"' not in log   # no traceback from train.py
    assert {p.name: p.stat().st_mtime_ns for p in (out / "checkpoints").iterdir()} == before
    assert resolve_resume("auto", out)[0].name == "step_00000008"
