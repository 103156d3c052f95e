"""Config: recipes parse, overrides apply in order, bad input fails with a message naming the key."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bert_recipes.config import Config, ConfigError, grad_accum_steps, load_config, to_yaml, validate

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_defaults_validate_with_an_end():
    cfg = load_config(None, ["train.max_steps=10"])
    validate(cfg)
    assert cfg.train.max_steps == 10 and cfg.data.mlm_probability == 0.15


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_loads_and_validates(recipe):
    cfg = load_config(recipe)
    validate(cfg)
    grad_accum_steps(cfg.train, 1)   # every recipe must at least run on one process
    header = recipe.read_text().splitlines()[0]
    assert header.startswith("# "), f"{recipe.name} must open with a header comment"
    text = recipe.read_text()
    assert "Launch:" in text and "Hardware:" in text and "Time:" in text, f"{recipe.name}: header incomplete"


def test_recipe_then_override_precedence(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 0.5\ntrain:\n  max_steps: 3\n")
    cfg = load_config(path, ["optim.lr=1e-4", "run.name=007", "data.train_files=[a.txt, b.txt]",
                             "model.name_or_path=null"])
    assert cfg.optim.lr == 1e-4          # override beats recipe
    assert cfg.train.max_steps == 3      # recipe beats default
    assert cfg.run.name == "007"         # text fields keep the text as written
    assert cfg.data.train_files == ["a.txt", "b.txt"]
    assert cfg.model.name_or_path is None


def test_yaml_no_is_the_string_no(tmp_path):
    assert load_config(write(tmp_path, "train:\n  mixed_precision: no\n")).train.mixed_precision == "no"
    assert load_config(None, ["train.mixed_precision=no"]).train.mixed_precision == "no"


def test_int_is_accepted_for_float(tmp_path):
    cfg = load_config(write(tmp_path, "optim:\n  lr: 1\n"))
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


@pytest.mark.parametrize("text, key", [
    ("optim:\n  learning_rate: 0.1\n", "optim.learning_rate"),
    ("trainer:\n  max_steps: 1\n", "trainer"),
    ("train:\n  max_steps: ten\n", "train.max_steps"),
    ("train:\n  max_steps: 1.5\n", "train.max_steps"),
    ("train:\n  mixed_precision: fp8\n", "train.mixed_precision"),
    ("task:\n  metrics: accuracy\n", "task.metrics"),
    ("model:\n  gradient_checkpointing: 1\n", "model.gradient_checkpointing"),
    ("optim: 3\n", "optim"),
])
def test_bad_recipe_names_the_key(tmp_path, text, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize("override, key", [
    ("train.max_step=3", "train.max_step"),
    ("nosuch.key=3", "nosuch.key"),
    ("optim.lr=fast", "optim.lr"),
    ("max_steps=3", "max_steps"),
])
def test_bad_override_names_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_batch_divisibility_error_shows_the_numbers():
    cfg = Config()
    cfg.train.global_batch_size, cfg.train.micro_batch_size = 48, 8
    assert grad_accum_steps(cfg.train, 2) == 3
    with pytest.raises(ConfigError, match=r"global_batch_size=48.*micro_batch_size=8 x world_size=4 = 32"):
        grad_accum_steps(cfg.train, 4)
    cfg.train.global_batch_size, cfg.train.max_steps = 50, 1
    with pytest.raises(ConfigError, match="global_batch_size=50 is not a multiple of train.micro_batch_size=8"):
        validate(cfg)


@pytest.mark.parametrize("overrides, message", [
    (["train.global_batch_size=64"], "needs an end"),
    (["train.max_steps=1", "task.kind=classification"], "classification needs a tokenizer"),
    (["train.max_steps=1", "data.max_seq_length=1024"], "exceeds model.max_position_embeddings"),
    (["train.max_steps=1", "data.source=hub"], "needs data.dataset_name"),
    (["train.max_steps=1", "task.metrics=[accuracy, bleu]"], "unknown metric 'bleu'"),
    (["train.max_steps=1", "data.mlm_probability=1.5"], "mlm_probability"),
])
def test_relations_are_validated(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, overrides))


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(REPO / "recipes/tiny-mlm.yaml", ["optim.lr=0.25"])
    again = load_config(write(tmp_path, to_yaml(cfg)))
    assert again == cfg


def test_print_config_cli():
    out = subprocess.run([sys.executable, "train.py", "--recipe", "recipes/tiny-mlm.yaml", "--print-config",
                          "--optim.lr=0.125", "--resume", "auto"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["optim"]["lr"] == 0.125 and resolved["checkpoint"]["resume"] == "auto"
    assert resolved["model"]["hidden_size"] == 128   # from the recipe


def test_cli_reports_config_errors_cleanly():
    out = subprocess.run([sys.executable, "train.py", "--recipe", "recipes/tiny-mlm.yaml", "--optim.lrr=1"],
                         cwd=REPO, capture_output=True, text=True)
    assert out.returncode != 0
    assert "config error: unknown key 'optim.lrr'" in out.stderr
    assert "Traceback" not in out.stderr


ACCELERATE_CONFIGS = sorted((REPO / "accelerate_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=[p.stem for p in ACCELERATE_CONFIGS])
def test_accelerate_configs_parse_and_every_line_is_annotated(path):
    from accelerate.commands.config.config_args import load_config_from_file
    config = load_config_from_file(str(path))   # what `accelerate launch --config_file` reads
    assert config.num_processes >= 1 and config.distributed_type is not None
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            assert "#" in line, f"{path.name}: line without a comment: {line!r}"


# ---------------------------------------------------------------------------- model.architecture's default
def resolved(*overrides: str) -> str:
    """model.architecture as config.validate decides it for these overrides."""
    cfg = load_config(None, ["train.max_steps=1", *overrides])
    validate(cfg)
    return cfg.model.architecture


def checkpoint_dir(tmp_path, model_type: str) -> Path:
    """A model directory whose config.json says model_type (all that the architecture is read from)."""
    path = tmp_path / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 32}))
    return path


def test_the_architecture_is_the_checkpoints_unless_the_recipe_names_it(tmp_path):
    """Unset, model.architecture is what model.name_or_path's config.json says (bert for a fresh model), decided once
    and saved so; named as another, or beside a field its checkpoint's architecture lacks: one line naming both."""
    modern, bert, roberta = (checkpoint_dir(tmp_path, t) for t in ("modernbert", "bert", "roberta"))
    assert resolved() == "bert"
    assert resolved(f"model.name_or_path={modern}") == "modernbert"
    assert resolved(f"model.name_or_path={bert}") == "bert"
    assert resolved(f"model.name_or_path={modern}", "model.architecture=modernbert") == "modernbert"
    # a classifier from a model type built nowhere here (a Hub RoBERTa): transformers' class, BERT's fields
    assert resolved(f"model.name_or_path={roberta}", "task.kind=classification") == "bert"
    cfg = load_config(None, ["train.max_steps=1", f"model.name_or_path={modern}"])
    validate(cfg)
    validate(cfg)   # a second validate (train.py's command line, then preflight) keeps it
    assert yaml.safe_load(to_yaml(cfg))["model"]["architecture"] == "modernbert"
    cases = [((f"model.name_or_path={modern}", "model.architecture=bert"),
              f"model.name_or_path={modern} is a modernbert model and model.architecture=bert: set "
              "model.architecture=modernbert, or leave it unset (the checkpoint's)"),
             ((f"model.name_or_path={roberta}",),
              f"model.name_or_path={roberta} is a roberta model: masked-LM pretraining here builds bert, modernbert "
              "(model.architecture, bert_recipes/architectures/); give a checkpoint of one of them, or leave "
              "model.name_or_path unset for a fresh model"),
             ((f"model.name_or_path={bert}", "model.local_attention=64"),
              f"model.local_attention=64 is ModernBERT's; model.architecture=bert (unset, so the checkpoint's: "
              f"model.name_or_path={bert} is a bert model) has no such field: remove it"),
             (("model.local_attention=64",), "model.local_attention=64 is ModernBERT's; model.architecture=bert has no "
                                             "such field: remove it (or set model.architecture=modernbert)")]
    for overrides, said in cases:
        with pytest.raises(ConfigError) as err:
            resolved(*overrides)
        assert str(err.value) == said
    # a checkpoint not written yet: the recipe's own fields stand in; the run's path check says why it cannot start
    assert resolved(f"model.name_or_path={tmp_path / 'runs/x/model'}") == "bert"
    assert resolved(f"model.name_or_path={tmp_path / 'runs/x/model'}", "model.local_attention=64") == "modernbert"


def test_a_phase_takes_the_architecture_of_the_run_it_starts_from(tmp_path):
    """checkpoint.init_from: the architecture the run it names trained (its checkpoint's saved config), from the run's
    directory or one checkpoint; a checkpoint saved before model.architecture existed holds a BERT."""
    run = tmp_path / "phase1"
    checkpoint = run / "checkpoints" / "step_00000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "train_state.json").write_text("{}")
    (checkpoint / "config.yaml").write_text(to_yaml(load_config(None, ["model.architecture=modernbert"])))
    assert resolved(f"checkpoint.init_from={run}", "model.local_attention=64") == "modernbert"
    assert resolved(f"checkpoint.init_from={checkpoint}") == "modernbert"
    with pytest.raises(ConfigError, match=f"model.hidden_dropout_prob=0.1 is BERT's; model.architecture=modernbert "
                                          f"\\(unset, so the checkpoint's: checkpoint.init_from={run} trained "
                                          "model.architecture=modernbert\\) has no such field: remove it"):
        resolved(f"checkpoint.init_from={run}", "model.hidden_dropout_prob=0.1")
    (checkpoint / "config.yaml").write_text("model:\n  hidden_size: 32\n")   # before model.architecture
    assert resolved(f"checkpoint.init_from={run}") == "bert"
