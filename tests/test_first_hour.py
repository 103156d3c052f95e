"""A new user's first hour: `make demo` works twice in a row, and a mistake reached through a Make
target is one `config error:` line, with no launcher traceback: checked before the launch when a
plain process can see it (bert_recipes/preflight.py), or said by the rank, after which the wrapper
(bert_recipes/launch.py) drops the launcher's report and keeps the rank's exit code."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, tiny_args

# The launcher's own lines after a rank has failed (torch.distributed.elastic; seen with torch 2.13).
LAUNCHER_REPORT = ("ChildFailedError", "Traceback", "elastic/multiprocessing/api.py", "Root Cause")


def make(*args, timeout=600, env=None):
    import os
    return subprocess.run(["make", "-s", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def one_config_error(proc, expected: str):
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr[-3000:]
    for marker in LAUNCHER_REPORT:
        assert marker not in proc.stderr + proc.stdout, (marker, proc.stderr[-3000:])


# A library's warning a clean demo may still print: its exact text, and why the project cannot fix it at its cause
# (transformers' `torch_dtype` deprecation, Accelerate's "Removed shared tensor" on every checkpoint and DeepSpeed's
# "Setting accelerator to CPU" were fixed where the project caused them).
ALLOWED_LIBRARY_WARNINGS: dict[str, str] = {
    "Port `29500` is already in use. Accelerate will attempt to launch in a standalone-like mode":
        "accelerate launch's own, only while another job on the host holds the default rendezvous port (here the "
        "suite's parallel launches, or another user's run): it takes a free port and the run is the same; the "
        "demo's command cannot know which port is free before the launcher looks",
}
# what a library's warning looks like in the log: logging's levels, Python's warnings, the libraries' own words, and
# transformers' and Accelerate's records as the project's log handler prefixes them (the project's own: `[warning]`)
LIBRARY_WARNING = re.compile(r"\bWARNING\b|\w+Warning\b|is deprecated|Removed shared tensor|"
                             r"^\[(transformers|accelerate|datasets|deepspeed|torch)\] ")


# what a library's progress bar looks like in the log: tqdm's shape (`45%|####  | 9/20`, `287.08it/s]`, `810.2
# examples/s]`: transformers' "Writing model shards", datasets' "Generating train split" and map's "tokenizing"); the
# train loop's own bar is off too (logging.progress_bar=false)
PROGRESS_BAR = re.compile(r"\d+%\||it/s\]|examples/s\]")


def progress_bars(log: str) -> list[str]:
    return [line for line in log.splitlines() if PROGRESS_BAR.search(line)]


def library_warnings(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if LIBRARY_WARNING.search(line) and not any(text in line for text in ALLOWED_LIBRARY_WARNINGS)]


def test_demo_works_twice_in_a_row(tmp_path, sample_dir):
    """The demo starts over in its own directories (run.overwrite), so a second `make demo` runs the
    same way as the first (shrunk here to a few steps of a tiny model); its log holds no library warning a
    user cannot act on and no library progress bar (the two recipes on 2 processes: a checkpoint, an export, a
    warm start from it). Its own datasets cache: the first demo loads, tokenizes, packs and trains the tokenizer
    (each with a library bar unless logging.progress_bar=false turns it off), the second reads them back."""
    shrink = " ".join(["--train.max_steps=3", "--train.eval_every=null", "--checkpoint.save_every=null",
                       "--data.max_train_samples=400", "--data.max_eval_samples=32", "--tokenizer.vocab_size=500",
                       "--model.hidden_size=32", "--model.intermediate_size=64", "--logging.trackers=[]",
                       "--logging.plot=false", "--train.global_batch_size=8", "--train.micro_batch_size=4",
                       f"--data.cache_dir={tmp_path / 'datasets'}"])
    runs = tmp_path / "runs"
    for attempt in (1, 2):
        proc = make("demo", f"RUNS={runs}", f"SAMPLE={sample_dir}", f"ARGS={shrink}")
        assert proc.returncode == 0, (attempt, proc.stdout[-3000:], proc.stderr[-3000:])
        assert "bert-recipes demo summary" in proc.stdout and "eval accuracy" in proc.stdout, proc.stdout[-3000:]
        log = proc.stdout + proc.stderr
        assert library_warnings(log) == [], proc.stdout[-3000:] + proc.stderr[-3000:]
        assert progress_bars(log) == [], (attempt, progress_bars(log))
        # the tokenizers trainer's bar, hidden off a terminal, still prints one empty line per stage
        assert "\n\n\n" not in proc.stdout, (attempt, proc.stdout[:3000])
        for name in ("tiny-mlm", "tiny-classify"):
            final = json.loads((runs / name / "metrics.json").read_text())["final"]
            assert final["steps"] == 3 and final["num_processes"] == 2, final
    # the second demo replaced the first one's checkpoints instead of refusing to start
    assert "[resume]" not in proc.stdout


@pytest.mark.parametrize("bars_before", [True, False])
def test_the_export_writes_without_the_shard_bar_and_leaves_the_bars_as_they_were(bars_before, tmp_path, capfd):
    """export.no_shard_bar: no "Writing model shards" bar while save_pretrained writes, and transformers' switch as
    it was after (a user's bars stay on, bars that were off stay off). The control: the same save without it shows
    the bar where the bars are on."""
    from transformers import BertConfig, BertModel
    from transformers.utils import logging as hf_logging

    from bert_recipes.export import no_shard_bar
    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=100))
    was = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if bars_before else hf_logging.disable_progress_bar)()
    try:
        capfd.readouterr()
        model.save_pretrained(tmp_path / "plain")
        plain = "".join(capfd.readouterr())
        assert ("Writing model shards" in plain) == bars_before, plain
        with no_shard_bar():
            model.save_pretrained(tmp_path / "quiet")
        quiet = "".join(capfd.readouterr())
        assert "Writing model shards" not in quiet and progress_bars(quiet) == [], quiet
        assert hf_logging.is_progress_bar_enabled() == bars_before
    finally:
        (hf_logging.enable_progress_bar if was else hf_logging.disable_progress_bar)()


def test_a_mistake_through_make_is_one_line_before_any_launch(tmp_path):
    """`make zero2 CPU=1 ARGS=--optim.lr=-1`: refused by the preflight, in the launch's own
    environment, before `accelerate launch` starts (it never prints its launch lines)."""
    out = tmp_path / "out"
    proc = make("zero2", "CPU=1", f"ARGS=--optim.lr=-1 --run.output_dir={out}", timeout=120)
    assert proc.returncode == 2
    one_config_error(proc, "optim.lr=-1.0 is not allowed: it must be positive")
    assert "accelerate launch" not in proc.stdout and not out.exists()


def test_an_output_dir_that_is_a_file_is_refused_before_the_launch(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file")
    proc = make("ddp", "CPU=1", f"ARGS=--run.output_dir={blocker}", timeout=120)
    one_config_error(proc, f"run.output_dir={blocker} is a file, not a directory")
    assert blocker.read_text() == "a file"


def test_a_gpu_only_row_on_cpu_is_one_line_from_the_table(tmp_path):
    """`make fsdp CPU=1`: backends.tsv gives FSDP no CPU launch, and the Makefile says so from the
    table (gpu-only) in one line, before any process starts; gpu-check skips the row for the same
    reason, read from the same table."""
    from bert_recipes.backends.plan import backend_rows
    assert [name for name, row in backend_rows().items() if row.gpu_only] == ["fsdp"]
    out = tmp_path / "out"
    proc = make("fsdp", "CPU=1", f"ARGS=--run.output_dir={out}", timeout=120)
    assert proc.returncode == 2
    one_config_error(proc, "fsdp runs on GPUs only (accelerate_configs/backends.tsv)")
    assert "accelerate launch" not in proc.stdout and not out.exists()
    with pytest.raises(Exception, match="fsdp runs on GPUs only"):
        backend_rows()["fsdp"].cpu_config


def test_a_mistake_only_a_rank_sees_is_one_line_and_keeps_its_code(tmp_path, sample_dir, datasets_cache,
                                                                   shared_tokenizer):
    """A ZeRO-3 NVMe run whose gradients DeepSpeed would swap on CPU processes (a 1 MiB partition:
    backends/deepspeed.py: check_nvme_gradient_swap) is refused inside the ranks, after the model is built: the
    rank's line comes once, the launcher's ChildFailedError report is dropped, nothing is written."""
    ds = json.loads((REPO / "ds_configs/zero3_nvme.json").read_text())
    (tmp_path / "nvme").mkdir()
    for kind in ("offload_optimizer", "offload_param"):
        ds["zero_optimization"][kind]["nvme_path"] = str(tmp_path / "nvme")
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    yaml_text = (REPO / "accelerate_configs/zero3_nvme.yaml").read_text()
    (tmp_path / "acc.yaml").write_text(yaml_text.replace("ds_configs/zero3_nvme.json", str(tmp_path / "ds.json")))
    out = tmp_path / "out"
    args = " ".join(f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "model.intermediate_size": 16384}))
    proc = make("zero3-nvme", "CPU=1", f"CONFIG={tmp_path / 'acc.yaml'}", f"ARGS={args}",
                env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 2
    one_config_error(proc, "DeepSpeed 0.19.8 swaps gradient partitions of 1 MiB or more")
    assert not out.exists()


# ----------------------------------------------------------------------------- the wrapper's rules
FAKE_LAUNCHER = '''
import sys
rank_line, code = sys.argv[1], int(sys.argv[2])
print("[train] step 1/10 loss 1.0", flush=True)
if rank_line:
    print(rank_line, file=sys.stderr, flush=True)
print("W1130 18:37:20.672000 5338 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 1 "
      "closing signal SIGTERM", file=sys.stderr, flush=True)
print("E1130 18:37:20.682000 5338 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: "
      f"{code}) local_rank: 0 (pid: 2) of binary: python", file=sys.stderr)
print("Traceback (most recent call last):", file=sys.stderr)
print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", file=sys.stderr)
print("Root Cause (first observed failure):", file=sys.stderr)
print(f"  exitcode  : {code} (pid: 2)", file=sys.stderr)
sys.exit(1)
'''


@pytest.mark.parametrize("rank_line, code, hidden", [
    ("config error: train.max_steps: expected int", 2, True),
    ("[diverged] 3 steps in a row had a non-finite loss", 3, True),
    ("[rank 1] a collective gave up: Timed out", 4, True),
    ("[preempt] SIGTERM received: every rank stopped after step 4/10, checkpoint saved; exiting with code 143", 143,
     True),
    ("[disk full] the export at step 2 could not be written to /x/model.partial: 8.0 KiB free", 5, True),
    ("", 1, False),                                   # a crash: the launcher's report is the only clue
    ("config error: x", 1, False),                    # a code train.py never uses: kept whole
])
def test_the_wrapper_drops_the_launchers_report_only_after_a_ranks_own_line(rank_line, code, hidden, tmp_path):
    script = tmp_path / "fake_launcher.py"
    script.write_text(textwrap.dedent(FAKE_LAUNCHER))
    proc = subprocess.run([sys.executable, "-m", "bert_recipes.launch", sys.executable, str(script), rank_line, str(code)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "[train] step 1/10" in proc.stdout
    if rank_line:
        assert proc.stderr.count(rank_line) == 1
    if hidden:
        assert proc.returncode == code
        assert not any(marker in proc.stderr for marker in LAUNCHER_REPORT), proc.stderr
    else:
        assert proc.returncode == 1 and "ChildFailedError" in proc.stderr and "Root Cause" in proc.stderr


def test_a_full_disk_under_make_ends_with_its_line_and_code_5(tmpfs, sample_dir, datasets_cache, shared_tokenizer):
    """`make ddp CPU=1` with run.output_dir on a 64 KiB tmpfs: the run's config and tokenizer fit, the export does not.
    The rank's [disk full] line comes once, the launcher's report is dropped, the wrapper exits 5 and make says
    `Error 5` (and exits 2, as make does for any failed command)."""
    out = tmpfs(64 << 10) / "run"
    args = " ".join(f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 2, "checkpoint.save_every": "null",
        "checkpoint.save_final": "false"}))
    proc = make("ddp", "CPU=1", f"ARGS={args}", env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    log = proc.stdout + proc.stderr
    lines = [line for line in log.splitlines() if line.startswith("[disk full]")]
    assert len(lines) == 1 and f"the export at step 2 could not be written to {out}/model.partial" in lines[0], log[-3000:]
    assert proc.returncode == 2 and re.search(r"\] Error 5$", proc.stderr, re.MULTILINE), proc.stderr[-2000:]
    for marker in LAUNCHER_REPORT:
        assert marker not in log, (marker, log[-3000:])


def test_the_exit_code_table_in_the_docs_is_the_list():
    """docs/cluster.md's table of exit codes holds exactly bert_recipes/exit_codes.py's codes, each row with its lines'
    starts, and the wrapper's rank codes and lines are the list's."""
    from bert_recipes.exit_codes import EXIT_CODES, RANK_CODES, RANK_LINE
    text = (REPO / "docs/cluster.md").read_text()
    table = text[text.index("## Exit codes of `train.py`"):].split("\n## ")[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0][:1].isdigit():
            rows[tuple(sorted(int(c) for c in cells[0].split("/")))] = re.findall(r"`([^`]+)`", cells[1])
    assert rows == {tuple(sorted(way.codes)): list(way.starts) for way in EXIT_CODES}, rows
    assert RANK_CODES == {2, 3, 4, 5, 129, 130, 131, 138, 143}
    for line in ("config error: x", "[diverged] x", "[rank 1] a collective gave up: x", "[disk full] x",
                 "[preempt] x", "interrupted at start-up; rerun"):
        assert RANK_LINE.search(line), line
    assert not RANK_LINE.search("[train] step 1/10 loss 1.0")


def test_the_wrapper_passes_a_clean_run_and_its_code_through(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bert_recipes.launch", sys.executable, "-c",
                           "import sys; print('out'); print('err', file=sys.stderr); sys.exit(0)"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "out\n", "err\n")


def test_the_makefile_launches_through_the_preflight_and_the_wrapper():
    """Every training target checks first and launches through the wrapper (make -n prints the commands)."""
    for target in ("zero2", "ddp", "pipeline", "demo"):
        lines = make("-n", target, "CPU=1").stdout.replace("\\\n", " ").splitlines()
        checks = [line for line in lines if "bert_recipes.preflight" in line]
        launches = [line for line in lines if " launch " in line and "train.py" in line]
        assert checks and launches and all("-m bert_recipes.launch " in line for line in launches), lines
    assert Path(REPO / "bert_recipes/launch.py").exists()
