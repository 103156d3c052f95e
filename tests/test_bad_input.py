"""What the run refuses: one parametrized matrix of bad inputs. Each case must end with exit code 2,
one `config error:` line that names the field or file and says what to do, no traceback, and
nothing created or changed in the output directory. Most cases run train.py's command line in this
process (train.run_cli, the same function `python train.py` calls); a few run under `accelerate
launch` with 2 processes, where the message must come once, from rank 0."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, launch_script, refused_in_process, run_in_process, tiny_args


@dataclass
class Ctx:
    tmp: Path
    out: Path
    sample: Path
    cache: Path
    tok: Path
    old_run: Path       # a finished run's output_dir with checkpoints (step 4, 8)
    small_model: Path   # a saved BertForMaskedLM: vocab 500, 64 positions

    def args(self, task="mlm", **extra):
        extra = {"tokenizer.name_or_path": self.tok, **extra}
        return [f"--{a}" for a in tiny_args(self.out, self.sample, self.cache, task=task, **extra)]

    def file(self, name, text):
        path = self.tmp / name
        path.write_text(text)
        return path

    def binary(self, name):
        path = self.tmp / name
        path.write_bytes(bytes(range(128, 256)) * 4)   # not UTF-8
        return path

    def files(self, train_text, task="classification", valid_text="text,label\nan example,0\nanother one,1\n",
              **extra):
        train = self.file("train.csv", train_text)
        valid = self.file("valid.csv", valid_text)
        return self.args(task, **{"data.source": "files", "data.train_files": f"[{train}]",
                                  "data.validation_files": f"[{valid}]", "task.num_labels": 2, **extra})


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, sample_dir, datasets_cache, shared_tokenizer):
    root = tmp_path_factory.mktemp("bad_input")
    old_run = root / "old_run"
    run_in_process(tiny_args(old_run, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "checkpoint.save_every": 4}))
    from transformers import BertConfig, BertForMaskedLM
    small = root / "small_model"
    BertForMaskedLM(BertConfig(vocab_size=500, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=64)).save_pretrained(small)
    shutil.copytree(shared_tokenizer, small, dirs_exist_ok=True)   # a 1000-token tokenizer beside it
    return old_run, small


def _corrupt_copy(c: Ctx) -> list[str]:
    shutil.copytree(c.old_run, c.out)
    target = c.out / "checkpoints/step_00000008/model.safetensors"
    target.write_bytes(target.read_bytes()[:1000])
    return c.args(**{"checkpoint.resume": c.out / "checkpoints/step_00000008"})


def _ds_env(c: Ctx, monkeypatch, text: str):
    path = c.file("ds.json", text)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))


# (id, argv builder (ctx, monkeypatch) -> argv, what the one line must say)
CASES = [
    # ---- recipes and overrides
    ("misspelt key", lambda c, m: c.args() + ["--optim.lrr=1"], "unknown key 'optim.lrr'"),
    ("wrong type", lambda c, m: c.args() + ["--train.max_steps=ten"], "train.max_steps: expected int"),
    ("missing recipe", lambda c, m: ["--recipe", str(c.tmp / "nope.yaml")] + c.args(), "recipe not found"),
    ("recipe not a mapping", lambda c, m: ["--recipe", str(c.file("r.yaml", "- a\n- b\n"))] + c.args(),
     "recipe: expected a mapping"),
    ("recipe not YAML", lambda c, m: ["--recipe", str(c.file("r.yaml", "train: [1, 2\n"))] + c.args(),
     "is not valid YAML"),
    ("empty recipe", lambda c, m: ["--recipe", str(c.file("r.yaml", ""))] + c.args(), "is empty: give its sections"),
    ("binary recipe", lambda c, m: ["--recipe", str(c.binary("r.yaml"))] + c.args(), "is not a text file"),
    ("recipe that is a directory", lambda c, m: ["--recipe", str(c.tmp)] + c.args(), "is a directory: give a file"),
    ("unknown section", lambda c, m: ["--recipe", str(c.file("r.yaml", "optimizer:\n  lr: 0.1\n"))] + c.args(),
     "unknown key 'optimizer'"),
    ("override without a value", lambda c, m: c.args() + ["--train.max_steps"], "unrecognized argument"),
    ("override without a section", lambda c, m: c.args() + ["--max_steps=3"], "must look like section.key"),
    ("override not YAML", lambda c, m: c.args() + ["--optim.betas=[0.9,"], "override optim.betas='[0.9,' is not valid YAML: expected"),
    # ---- values
    ("zero lr", lambda c, m: c.args(**{"optim.lr": 0}), "optim.lr=0.0 is not allowed: it must be positive"),
    ("negative lr", lambda c, m: c.args(**{"optim.lr": -1e-4}), "optim.lr=-0.0001 is not allowed"),
    ("zero steps", lambda c, m: c.args(**{"train.max_steps": 0}), "train.max_steps=0 is not allowed"),
    ("negative epochs", lambda c, m: c.args(**{"train.epochs": -1}), "train.epochs=-1.0 is not allowed"),
    ("no end", lambda c, m: c.args(**{"train.max_steps": "null"}), "the run needs an end"),
    ("zero global batch", lambda c, m: c.args(**{"train.global_batch_size": 0}), "train.global_batch_size=0"),
    ("negative micro batch", lambda c, m: c.args(**{"train.micro_batch_size": -8}), "train.micro_batch_size=-8"),
    ("global batch not a multiple", lambda c, m: c.args(**{"train.global_batch_size": 20}), "is not a multiple of"),
    ("mlm probability above 1", lambda c, m: c.args(**{"data.mlm_probability": 1.5}), "data.mlm_probability=1.5"),
    ("heads do not divide hidden", lambda c, m: c.args(**{"model.num_attention_heads": 3}),
     "not divisible by model.num_attention_heads=3"),
    ("sequence above positions", lambda c, m: c.args(**{"data.max_seq_length": 128}),
     "exceeds model.max_position_embeddings=64"),
    ("sequence above a checkpoint's positions",
     lambda c, m: c.args(**{"model.name_or_path": c.small_model, "tokenizer.name_or_path": "null",
                            "data.max_seq_length": 128, "model.max_position_embeddings": 512}),
     "exceeds the max_position_embeddings=64 of model.name_or_path"),
    ("zero labels", lambda c, m: c.args("classification", **{"task.num_labels": 0}), "task.num_labels=0"),
    ("unknown metric", lambda c, m: c.args("classification", **{"task.metrics": "[bleu]"}), "unknown metric 'bleu'"),
    ("fp16 on a CPU", lambda c, m: c.args(**{"train.mixed_precision": "fp16"}), "fp16 needs a CUDA GPU"),
    ("unknown tracker", lambda c, m: c.args(**{"logging.trackers": "[comet]"}), "unknown tracker 'comet'"),
    # ---- data
    ("missing data file", lambda c, m: c.args(**{"data.source": "files", "data.train_files": "[/no/such.txt]"}),
     "data.train_files: data file not found: /no/such.txt"),
    ("empty data file", lambda c, m: c.args(**{"data.source": "files", "data.train_files": f"[{c.file('e.txt', '')}]"}),
     "is empty"),
    ("header without rows", lambda c, m: c.files("text,label\n"), "cannot be read as csv"),
    ("no text column", lambda c, m: c.files("sentence,label\nhello,0\n", valid_text="sentence,label\nhi,1\n"),
     "column 'text' not in the training data"),
    ("label column missing", lambda c, m: c.files("text\nhello\nworld\n", valid_text="text\nhi\n"),
     "column 'label' not in the training data"),
    ("files that disagree", lambda c, m: c.files("sentence,label\nhello,0\n"), "all files need the same columns"),
    ("labels outside the range", lambda c, m: c.files("text,label\nhello,0\nworld,9\n"),
     "labels outside [0, task.num_labels=2)"),
    ("string label not in label_names", lambda c, m: c.files("text,label\nhello,pos\nworld,maybe\n",
                                                              **{"task.label_names": "[neg, pos]"}),
     "labels ['maybe'] that task.label_names"),
    ("label names YAML reads as booleans", lambda c, m: c.args("classification", **{"task.label_names": "[no, yes]"}),
     "task.label_names[0]: YAML read this text as the boolean False; quote it"),
    ("fewer examples than one global batch", lambda c, m: c.args("classification", **{"data.max_train_samples": 4}),
     "cannot fill one optimizer step"),
    ("a held-out share that leaves nothing to train on",
     lambda c, m: c.args(**{"data.source": "files", "data.train_files": "[" + str(c.file("one.txt", "one line\n")) + "]"}),
     "data.validation_split_percentage=5 of the 1 training rows holds out 1 for evaluation and leaves 0 to train on"),
    # ---- models, checkpoints, output directories
    ("missing model directory", lambda c, m: c.args("classification", **{"model.name_or_path": "/no/such/model",
                                                                           "tokenizer.name_or_path": "null"}),
     "model.name_or_path=/no/such/model: cannot load"),
    ("tokenizer larger than the model", lambda c, m: c.args(**{"model.name_or_path": c.small_model}),
     "the tokenizer has 1000 tokens but model.name_or_path"),
    ("missing resume path", lambda c, m: c.args(**{"checkpoint.resume": "/no/such/checkpoint"}),
     "checkpoint.resume=/no/such/checkpoint: not a complete checkpoint"),
    ("corrupt checkpoint", lambda c, m: _corrupt_copy(c), "model.safetensors has 1000 bytes"),
    ("another run's output_dir", lambda c, m: (shutil.copytree(c.old_run, c.out),
                                                c.args(**{"optim.lr": 1e-3, "train.max_steps": 8,
                                                          "checkpoint.save_every": 4}))[1],
     "of a different run (optim.lr: 0.003 -> 0.001): pick another run.output_dir"),
    ("a checkpoint of another model shape", lambda c, m: (shutil.copytree(c.old_run, c.out),
                                                          c.args(**{"model.hidden_size": 64, "task.kind": "mlm",
                                                                    "checkpoint.resume": "auto"}))[1],
     "holds a model of another shape than this run's (model.hidden_size: 32 in the checkpoint, 64 now): resume it "
     "with the config it was saved with"),
    ("this run's output_dir without --resume", lambda c, m: (shutil.copytree(c.old_run, c.out),
                                                              c.args(**{"train.max_steps": 8,
                                                                        "checkpoint.save_every": 4}))[1],
     "already holds checkpoints of this run (up to step_00000008): continue it with --resume auto"),
    ("output_dir that is a file", lambda c, m: (c.tmp.joinpath("f").write_text("x"),
                                                 c.args(**{"run.output_dir": c.tmp / "f"}))[1],
     "is a file, not a directory: give a directory path"),
    ("output_dir below a file", lambda c, m: (c.tmp.joinpath("f").write_text("x"),
                                               c.args(**{"run.output_dir": c.tmp / "f/run"}))[1],
     "is a file, so the directory cannot be created there"),
    ("tokenizer directory that does not exist", lambda c, m: c.args(**{"tokenizer.name_or_path": "/no/such/tokenizer"}),
     "tokenizer.name_or_path=/no/such/tokenizer: cannot load it: no such directory"),
    ("a local dataset directory that does not exist", lambda c, m: c.args(**{"data.source": "hub",
                                                                             "data.dataset_name": "/no/such/dataset"}),
     "data.dataset_name=/no/such/dataset: no such directory (a dataset on the Hub is named"),
    ("an automatic micro batch on a CPU", lambda c, m: c.args(**{"train.micro_batch_size": "auto"}),
     "train.micro_batch_size=auto sizes the batch from a GPU's free memory; on CPU processes set a number"),
    ("push to the Hub without a repository", lambda c, m: c.args(**{"checkpoint.push_to_hub": "true"}),
     "checkpoint.push_to_hub needs checkpoint.hub_model_id"),
    ("best by a metric the task does not report", lambda c, m: c.args(**{"checkpoint.metric_for_best": "accuracy"}),
     "checkpoint.metric_for_best=accuracy is not among this task's evaluation metrics"),
    ("prepared data that is not there", lambda c, m: c.args(**{"data.source": "prepared", "data.packing": False,
                                                               "data.prepared_dir": c.tmp / "nothing"}),
     "holds no prepared data (prepared.json missing): write it with make prepare"),
    ("test predictions for MLM", lambda c, m: c.args(**{"data.test_splits": "[test]"}),
     "data.test_splits: test predictions are for classification tasks"),
    ("an extra evaluation split that does not exist", lambda c, m: c.args(**{"data.extra_eval_splits": "[nope]"}),
     "data.extra_eval_splits: 'nope' is not a split of the dataset"),
    # ---- launch configs (the variables `accelerate launch` sets)
    ("DeepSpeed JSON missing", lambda c, m: (m.setenv("ACCELERATE_USE_DEEPSPEED", "true"),
                                             m.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "/no/ds.json"), c.args())[2],
     "DeepSpeed config not found: /no/ds.json"),
    ("DeepSpeed JSON not JSON", lambda c, m: (_ds_env(c, m, "{stage: 2"), c.args())[1], "is not valid JSON"),
    ("DeepSpeed JSON not an object", lambda c, m: (_ds_env(c, m, "[1, 2]"), c.args())[1], "is not a JSON object"),
    ("DeepSpeed JSON that is a directory", lambda c, m: (m.setenv("ACCELERATE_USE_DEEPSPEED", "true"),
                                                        m.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(c.tmp)),
                                                        c.args())[2], "is a directory: give a file"),
    ("DeepSpeed JSON's batch against the recipe", lambda c, m: (_ds_env(c, m, '{"train_batch_size": 64}'), c.args())[1],
     "train_batch_size=64"),
    ("DeepSpeed JSON contradicts the recipe", lambda c, m: (_ds_env(c, m, '{"gradient_clipping": 0.3}'), c.args())[1],
     "clipping: recipe optim.max_grad_norm=1.0"),
    # ---- two mistakes at once: the first in preflight's order (what was written, then what is on disk)
    ("a launch conflict and an output_dir holding this run",
     lambda c, m: (shutil.copytree(c.old_run, c.out), _ds_env(c, m, '{"train_batch_size": 64}'),
                   c.args(**{"train.max_steps": 8, "checkpoint.save_every": 4}))[2], "train_batch_size=64"),
    ("a wrong recipe value and a missing data file",
     lambda c, m: c.args(**{"optim.lr": 0, "data.source": "files", "data.train_files": "[/no/such.txt]"}),
     "optim.lr=0.0 is not allowed"),
    ("LAMB under ZeRO", lambda c, m: (_ds_env(c, m, '{"zero_optimization": {"stage": 2}}'),
                                      c.args(**{"optim.name": "lamb"}))[1],
     "optim.name=lamb needs whole parameter tensors"),
    ("StableAdamW under ZeRO offload", lambda c, m: (_ds_env(c, m, '{"zero_optimization": {"stage": 2, '
                                                                  '"offload_optimizer": {"device": "cpu"}}}'),
                                                     c.args(**{"optim.name": "stable_adamw"}))[1],
     "optim.name=stable_adamw needs whole parameter tensors for its per-tensor update RMS, but ZeRO-2 hands"),
]


@pytest.mark.parametrize("name, build, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_with_one_line(name, build, expected, prepared, tmp_path, sample_dir, datasets_cache,
                                            shared_tokenizer, capsys, monkeypatch):
    c = Ctx(tmp_path, tmp_path / "out", sample_dir, datasets_cache, shared_tokenizer, *prepared)
    argv = build(c, monkeypatch)
    assert expected in refused_in_process(argv, c.out, capsys)


def test_the_matrix_is_large():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name, extra, expected", [
    ("misspelt key", ["--optim.lrr=1"], "unknown key 'optim.lrr'"),
    ("missing data file (rank 0 reads it)", ["--data.source=files", "--data.train_files=[/no/such.txt]"],
     "data file not found: /no/such.txt"),
    ("fewer examples than one global batch", ["--data.max_train_samples=8"], "cannot fill one optimizer step"),
])
def test_under_accelerate_launch_the_message_comes_once(name, extra, expected, tmp_path, sample_dir, datasets_cache,
                                                        shared_tokenizer):
    out = tmp_path / "out"
    args = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer})]
    log = launch_script("train.py", args + extra, 2, check=False)
    assert log.count("config error:") == 1 and expected in log, log[-3000:]
    assert "exitcode  : 2" in log                      # the launcher's report: the rank exited 2
    assert f'File "{REPO / "train.py"}"' not in log     # no traceback from train.py
    assert not out.exists()


@pytest.mark.parametrize("text, expected", [
    (None, "accelerate config {path}: No such file or directory"),
    ("num_processes: [2,\n", "is not valid YAML: expected"),
    ("- a list\n", "is not a mapping of settings"),
])
def test_make_refuses_a_missing_or_broken_accelerate_config(text, expected, tmp_path):
    path = tmp_path / "acc.yaml"
    if text is not None:
        path.write_text(text)
    proc = subprocess.run(["make", "-s", "zero2", f"CONFIG={path}", f"RECIPE={REPO / 'recipes/tiny-mlm.yaml'}",
                           f"ARGS=--run.output_dir={tmp_path / 'out'}"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(lines) == 1 and expected.format(path=path) in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "accelerate launch" not in proc.stdout


def _zero2_config(tmp_path: Path, ds_text: str) -> Path:
    """accelerate_configs/zero2.yaml pointing at a DeepSpeed JSON holding ds_text."""
    ds = tmp_path / "ds.json"
    ds.write_text(ds_text)
    path = tmp_path / "acc.yaml"
    path.write_text((REPO / "accelerate_configs/zero2.yaml").read_text().replace("ds_configs/zero2.json", str(ds)))
    return path


@pytest.mark.parametrize("ds_text, expected", [
    ("{stage: 2", "is not valid JSON"),
    ("[1, 2]", "is not a JSON object"),
    ('{"train_batch_size": 128}', "global batch: recipe train.global_batch_size=64"),
])
def test_make_refuses_a_broken_deepspeed_json_before_the_launch(ds_text, expected, tmp_path):
    # run.output_dir in the test's own directory: the recipe's default (runs/tiny-mlm) may hold a demo's checkpoints
    proc = subprocess.run(["make", "-s", "zero2", "CPU=1", f"CONFIG={_zero2_config(tmp_path, ds_text)}",
                           f"RECIPE={REPO / 'recipes/tiny-mlm.yaml'}", f"ARGS=--run.output_dir={tmp_path / 'out'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert proc.returncode != 0 and len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "accelerate launch" not in proc.stdout


def test_a_deepspeed_json_against_the_recipe_under_accelerate_launch(tmp_path, sample_dir, datasets_cache,
                                                                     shared_tokenizer):
    """The same refusal with the launcher in front (2 ranks): one line, from rank 0, exit code 2."""
    out = tmp_path / "out"
    args = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer})]
    log = launch_script("train.py", args, 2, backend="zero2", config=_zero2_config(tmp_path, '{"train_batch_size": 64}'),
                        check=False)
    assert log.count("config error:") == 1 and "train_batch_size=64" in log, log[-3000:]
    assert "exitcode  : 2" in log and not out.exists()


def test_suspicious_settings_warn_once_and_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    """The one rule for a value that is legal but cannot mean what it says: it is kept, and one [warning]
    line says what happens instead (docs/troubleshooting.md)."""
    metrics = run_in_process(tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 4, "optim.warmup_steps": 10,
        "train.eval_every": 6, "checkpoint.save_every": 5, "data.max_predictions_per_seq": 40}))
    out = capsys.readouterr().out
    assert metrics["steps"] == 4
    for line in ("[warning] the warmup (10 steps) is not shorter than the run (4 steps)",
                 "[warning] checkpoint.save_every=5 >= the run's 4 steps: the only checkpoint is the final one",
                 "[warning] train.eval_every=6 >= the run's 4 steps: the only evaluation is the final one",
                 "[warning] data.max_predictions_per_seq=40, but at most round(data.mlm_probability x "
                 "data.max_seq_length) = 5 tokens of a sequence are chosen: 35 of its 40 slots are always empty"):
        assert out.count(line) == 1, out


def test_a_split_without_a_class_is_said_and_the_run_goes_on(tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                                            capsys):
    """A classification split lacking one of the task's classes is legal (small evaluation splits often do)."""
    train = tmp_path / "train.csv"
    train.write_text("text,label\n" + "".join(f"sentence number {i},{i % 2}\n" for i in range(64)))
    valid = tmp_path / "valid.csv"
    valid.write_text("text,label\nonly the first class,0\nagain the first,0\n")
    metrics = run_in_process(tiny_args(tmp_path / "run", sample_dir, datasets_cache, task="classification", **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 2, "task.num_labels": 3,
        "task.label_names": "[neg, pos, odd]", "data.source": "files", "data.train_files": f"[{train}]",
        "data.validation_files": f"[{valid}]"}))
    out = capsys.readouterr().out
    assert metrics["steps"] == 2
    assert out.count("[warning] the training split (64 rows) has no row of class 2 (odd) of task.num_labels=3: "
                     "the model never learns them") == 1, out
    assert out.count("[warning] the evaluation split (2 rows) has no row of class 1 (pos), 2 (odd)") == 1, out


def test_exit_codes_of_the_command_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """`python train.py` itself: 2 for a config error (one line on stderr, no traceback), told before
    torch or transformers is imported (bert_recipes/cli.py: about 5 s sooner); --print-config likewise."""
    out = tmp_path / "out"
    args = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer})]
    proc = subprocess.run([sys.executable, "-X", "importtime", "train.py", *args, "--optim.lr=-1"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    assert proc.returncode == 2
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "yaml" in imported and not {"torch", "transformers"} & imported
    mine = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    # the only line of ours (a library's warning on some host would not be a second one of ours)
    assert [line for line in mine if "error" in line.lower()] == [
        "config error: optim.lr=-1.0 is not allowed: it must be positive (e.g. 1e-4)"]
    assert "Traceback" not in proc.stderr
    assert not out.exists()
    shown = subprocess.run([sys.executable, "-X", "importtime", "train.py", *args, "--print-config"], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "max_steps: 24" in shown.stdout and "| torch\n" not in shown.stderr + "\n"


def test_resume_auto_skips_a_damaged_checkpoint_and_says_so(prepared, tmp_path, sample_dir, datasets_cache,
                                                            shared_tokenizer, capsys):
    """Truncate the newest checkpoint's weights: --resume auto names the file, falls back to the
    previous checkpoint and finishes with the weights of the run that never stopped."""
    from safetensors.torch import load_file
    old_run, _ = prepared
    out = tmp_path / "run"
    shutil.copytree(old_run, out)
    expected = load_file(out / "model/model.safetensors")
    damaged = out / "checkpoints/step_00000008/optimizer.bin"
    damaged.write_bytes(damaged.read_bytes()[:-10])
    metrics = run_in_process(tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "checkpoint.save_every": 4,
        "checkpoint.resume": "auto"}))
    log = capsys.readouterr().out
    assert f"[resume] skipping damaged checkpoint step_00000008: {damaged} has" in log
    assert f"[resume] from {out}/checkpoints/step_00000004 at step 4" in log
    assert metrics["steps"] == 8
    got = load_file(out / "model/model.safetensors")
    for k in expected:
        assert (got[k] == expected[k]).all(), k


def test_checkpoints_load_without_pickles(tmp_path, sample_dir, datasets_cache, shared_tokenizer, monkeypatch):
    """A resume through the Accelerate engine never calls torch.load with weights_only=False, and the
    code never shells out with user strings or turns on remote code by itself."""
    import torch
    real = torch.load
    calls = []

    def guarded(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        assert kwargs.get("weights_only", True) is not False, f"torch.load(weights_only=False) of {args[0]}"
        return real(*args, **kwargs)
    args = tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "checkpoint.save_every": 4})
    run_in_process(args + ["train.halt_at_step=4"])
    monkeypatch.setattr(torch, "load", guarded)
    assert run_in_process(args + ["checkpoint.resume=auto"])["steps"] == 8
    assert calls, "the resume loaded nothing through torch.load"
    for path in list((REPO / "bert_recipes").rglob("*.py")) + list((REPO / "tools").glob("*.py")) + [REPO / "train.py"]:
        text = path.read_text()
        assert "shell=True" not in text and "os.system(" not in text, path
        assert "trust_remote_code=True" not in text, path


def test_a_cpu_launch_without_accelerate_use_cpu_is_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """The 2-process CPU config launched without ACCELERATE_USE_CPU=1 on a machine without GPUs: the launcher starts
    2 processes and Accelerate runs each alone (DistributedType.NO), two unsynchronised copies of one run that
    trained to the end before this check. Now one line naming the fix, exit code 2, nothing written."""
    from conftest import launch_commands, snapshot
    out = tmp_path / "run"
    args = tiny_args(out, sample_dir, datasets_cache, **{"tokenizer.name_or_path": shared_tokenizer})
    (cmd,), env = launch_commands("train.py", [f"--{a}" for a in args], 2, backend="ddp")
    assert env.pop("ACCELERATE_USE_CPU") == "1" and "--num_processes" in cmd and "2" in cmd
    before = snapshot(tmp_path)
    done = subprocess.run([sys.executable, "-m", "bert_recipes.launch", *cmd], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("config error:")]
    assert done.returncode == 2 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "the launcher started 2 processes but Accelerate runs 2 as distributed_type=DistributedType.NO, each " \
           "alone; on CPUs launch with ACCELERATE_USE_CPU=1" in lines[0]
    assert "Traceback" not in done.stderr and snapshot(tmp_path) == before
