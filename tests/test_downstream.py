"""The downstream score of each checkpoint (checkpoint.downstream, bert_recipes/downstream.py, tools/downstream.py):
a tiny pretraining on 2 processes exports each save's model apart from the rotation; the tool fine-tunes each in its
own process and puts the scores into the run's metrics.json, curves.png and trackers (TensorBoard, the MLflow run
continued), by pretraining step; a
scored step is not fine-tuned again; a live run's files are left alone; each bad value is one line. A ModernBERT
pretraining is scored the same way (make downstream, its recipe naming no architecture: the export's config says it),
and a downstream recipe that cannot fine-tune the model the run trains is one line at the run's start."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, launch, refused_in_process, run_in_process, tiny_args

sys.path.insert(0, str(REPO / "tools"))
import downstream as tool  # noqa: E402 (tools/downstream.py: a tool's, not a training run's)

def run_tool(argv: list[str]) -> int:
    """tools/downstream.py's main in this process, which opens the run's trackers: what that sets in os.environ
    (MLflow's request settings) and Accelerate's process state are undone after it, as run_in_process does, or every
    later launch of the suite would start cold (the warm server refuses another environment)."""
    from accelerate.state import AcceleratorState, GradientState
    environment = dict(os.environ)
    try:
        return tool.main(argv)
    finally:
        os.environ.clear()
        os.environ.update(environment)
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


FINE_TUNE = ["--train.epochs=null", "--train.max_steps=6", "--data.max_train_samples=256", "--data.max_eval_samples=96",
             "--train.eval_every=null", "--logging.trackers=[]", "--logging.plot=false", "--checkpoint.save_every=null",
             "--model.max_position_embeddings=64", "--data.max_seq_length=32"]


QUESTIONS = ["--data.max_seq_length=64", "--data.doc_stride=8"]   # FINE_TUNE's 32 tokens hold no sample question


@pytest.mark.parametrize("recipe, metric, more", [("tiny-ner.yaml", "f1", []),
                                                  ("tiny-squad.yaml", "exact_match", QUESTIONS),
                                                  ("tiny-retrieval.yaml", "ndcg@10", [])],
                         ids=["token_classification", "question_answering", "retrieval"])
def test_the_tagger_and_the_answerer_score_a_pretraining(recipe, metric, more, tmp_path, sample_dir, datasets_cache,
                                                         shared_tokenizer, capsys):
    """checkpoint.downstream=recipes/tiny-ner.yaml, tiny-squad.yaml or tiny-retrieval.yaml: make downstream fine-tunes
    the pretraining's step-4 export as a tagger, a span head or an embedding model and records its score (the
    recipe's first metric: entity F1, exact match, nDCG@10) by pretraining step."""
    run = tmp_path / "pretrain"
    run_in_process(tiny_args(run, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 4, "checkpoint.save_every": 4,
        "model.max_position_embeddings": 128, "checkpoint.downstream": REPO / "recipes" / recipe}))
    common = [f"--data.sample_dir={sample_dir}", f"--data.cache_dir={datasets_cache}"]
    assert run_tool([str(run), "--", *common, *FINE_TUNE, *more]) == 0
    (row,) = json.loads((run / "metrics.json").read_text())["history"]["downstream"]
    assert row["step"] == 4 and row["metric"] == metric and row["value"] >= 0
    finetune = json.loads((run / "downstream/step_00000004/finetune/metrics.json").read_text())["final"]
    assert finetune[metric] == row["value"] and finetune["eval_samples"] > 0


def test_each_checkpoint_gets_its_downstream_score(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    run = tmp_path / "pretrain"
    result = launch(2, tiny_args(run, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "train.max_steps": 8, "checkpoint.save_every": 4,
        "model.max_position_embeddings": 128,   # tiny-classify's data.max_seq_length: checked at the run's start
        "checkpoint.keep_last": 1, "checkpoint.downstream": REPO / "recipes/tiny-classify.yaml",
        "logging.trackers": "[tensorboard,mlflow]", "logging.plot": True}))
    assert result["final"]["num_processes"] == 2 and result["final"]["backend"]["name"] == "ddp"
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_00000008"]   # the rotation ran ...
    assert sorted(p.name for p in (run / "downstream").iterdir()) == ["step_00000004", "step_00000008"]   # ... not here
    before = (run / "curves.png").stat().st_size
    common = [f"--data.sample_dir={sample_dir}", f"--data.cache_dir={datasets_cache}"]
    assert run_tool([str(run), "--", *common, *FINE_TUNE]) == 0
    said = capsys.readouterr().out
    metrics = json.loads((run / "metrics.json").read_text())
    rows = metrics["history"]["downstream"]
    assert [r["step"] for r in rows] == [4, 8] and all(r["metric"] == "accuracy" and 0 <= r["value"] <= 1 for r in rows)
    assert metrics["final"]["downstream"] == {"step": 8, "accuracy": rows[-1]["value"]}
    for row in rows:   # each score is its fine-tune's own final accuracy, from the export of that step
        finetune = run / f"downstream/step_{row['step']:08d}/finetune"
        assert json.loads((finetune / "metrics.json").read_text())["final"]["accuracy"] == row["value"]
        assert str(run / f"downstream/step_{row['step']:08d}/model") in (finetune / "config.yaml").read_text()
    assert "[downstream] step 4: accuracy" in said and "[downstream] 2 scores" in said
    assert (run / "curves.png").stat().st_size != before   # redrawn with the downstream panel
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run / "logs" / metrics["config"]["run/name"]))
    events.Reload()
    assert [e.step for e in events.Scalars("downstream/accuracy")] == [4, 8]
    from mlflow.tracking import MlflowClient   # the pretraining's own MLflow run, continued
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'logs/mlflow.db'}")
    (mlflow_run,) = client.search_runs([client.get_experiment_by_name(metrics["config"]["run/name"]).experiment_id])
    assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, "downstream/accuracy")] == [4, 8]
    assert client.get_metric_history(mlflow_run.info.run_id, "train/loss")   # (the same run as the pretraining's)

    assert run_tool([str(run), "--", *common, *FINE_TUNE]) == 0   # scored already: nothing fine-tuned again
    assert "fine-tuning" not in capsys.readouterr().out
    from bert_recipes.run_dir import OutputDirLock
    (run / "downstream/step_00000004/score.json").unlink()
    lock = OutputDirLock(run, 60)
    lock.acquire(0)   # a live run holds its directory: the score waits in score.json, metrics.json is not touched
    try:
        written = (run / "metrics.json").read_text()
        assert run_tool([str(run), "--", *common, *FINE_TUNE]) == 0
        assert "is held by a live run (run.lock)" in capsys.readouterr().out
        assert (run / "metrics.json").read_text() == written and (run / "downstream/step_00000004/score.json").is_file()
    finally:
        lock.release()


def test_bad_downstream_settings_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    cases = [({"checkpoint.downstream": REPO / "recipes/tiny-mlm.yaml"},
              "is a task.kind=mlm recipe: give a fine-tuning (classification) recipe"),
             ({"checkpoint.downstream": tmp_path / "missing.yaml"}, "not found: give a fine-tuning recipe file")]
    for extra, said in cases:
        argv = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache,
                                            **{"tokenizer.name_or_path": shared_tokenizer, **extra})]
        assert said in refused_in_process(argv, tmp_path / "run", capsys)
    argv = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache, task="classification", **{
        "checkpoint.downstream": REPO / "recipes/tiny-classify.yaml", "tokenizer.name_or_path": shared_tokenizer})]
    assert "scores a pretraining's checkpoints, and task.kind=classification" in refused_in_process(
        argv, tmp_path / "run", capsys)
    (tmp_path / "empty").mkdir()
    assert run_tool([str(tmp_path / "empty")]) == 2
    assert "holds no run (no config.yaml)" in capsys.readouterr().err


# recipes/tiny-modernbert-mlm.yaml shrunk as tiny_args shrinks any recipe: 2 layers (layer 0 global, layer 1 local over
# 16 tokens), no batch ramp (a 16-sequence batch throughout); 128 positions (RoPE: no weight), what tiny-classify reads
MODERN_RECIPE = str(REPO / "recipes/tiny-modernbert-mlm.yaml")
MODERN = {"model.local_attention": 16, "model.max_position_embeddings": 128, "train.global_batch_size_start": "null",
          "train.batch_rampup_tokens": "null", "train.eval_every": "null", "train.eval_final": False}


def downstream_recipe(tmp_path, **model_or_data) -> str:
    """recipes/tiny-classify.yaml with some model.* / data.* keys changed (a dotted key each)."""
    recipe = yaml.safe_load((REPO / "recipes/tiny-classify.yaml").read_text())
    for key, value in model_or_data.items():
        section, name = key.split(".")
        recipe[section][name] = value
    path = tmp_path / f"classify-{len(list(tmp_path.glob('classify-*')))}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def test_a_modernbert_pretraining_is_scored_through_make_downstream(tmp_path, sample_dir, datasets_cache,
                                                                  shared_tokenizer):
    """A ModernBERT pretraining (recipes/tiny-modernbert-mlm.yaml) exports each save; make downstream fine-tunes each
    export with recipes/tiny-classify.yaml, which names no model.architecture: the export's config.json says
    modernbert, and the fine-tune builds transformers' ModernBertForSequenceClassification from it. A score a step."""
    run = tmp_path / "modern"
    run_in_process(tiny_args(run, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, **MODERN, "train.max_steps": 4, "checkpoint.save_every": 2,
        "checkpoint.downstream": REPO / "recipes/tiny-classify.yaml"}), MODERN_RECIPE)
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["architecture"] == "modernbert"
    overrides = [f"--data.sample_dir={sample_dir}", f"--data.cache_dir={datasets_cache}", *FINE_TUNE]
    done = subprocess.run(["make", "-s", "downstream", f"RUN={run}", "CPU=1", f"ARGS=--nproc 1 -- {' '.join(overrides)}"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads((run / "metrics.json").read_text())["history"]["downstream"]
    assert [r["step"] for r in rows] == [2, 4] and all(r["metric"] == "accuracy" and 0 <= r["value"] <= 1 for r in rows)
    for row in rows:   # each fine-tune resolved the export's architecture and trained a ModernBERT classifier
        finetune = run / f"downstream/step_{row['step']:08d}/finetune"
        assert yaml.safe_load((finetune / "config.yaml").read_text())["model"]["architecture"] == "modernbert"
        assert json.loads((finetune / "model/config.json").read_text())["architectures"] == [
            "ModernBertForSequenceClassification"]
        assert json.loads((finetune / "metrics.json").read_text())["final"]["accuracy"] == row["value"]


def test_a_downstream_recipe_that_cannot_fine_tune_the_model_is_one_line(tmp_path, sample_dir, datasets_cache,
                                                                         shared_tokenizer, capsys):
    """At a ModernBERT pretraining's start, its checkpoint.downstream recipe against the model it trains: another
    model.architecture, a field only BERT has, a sequence longer than its positions: exit 2, one line naming the
    field, the value and the fix, nothing written. The same recipe without them passes that check."""
    cases = [({"model.architecture": "bert"}, "sets model.architecture=bert, and this run trains "
                                              "model.architecture=modernbert: its fine-tunes start from this run's "
                                              "exports; remove model.architecture from that recipe (an export's config "
                                              "says what it is)"),
             ({"model.hidden_dropout_prob": 0.1}, "sets model.hidden_dropout_prob=0.1, BERT's, and this run trains "
                                                  "model.architecture=modernbert, which has no such field: remove it from "
                                                  "that recipe"),
             ({"data.max_seq_length": 256}, "has data.max_seq_length=256, and this run's exports hold "
                                            "model.max_position_embeddings=128: set data.max_seq_length at most 128 in "
                                            "that recipe, or pretrain with --model.max_position_embeddings=256")]
    for change, said in cases:
        recipe = downstream_recipe(tmp_path, **change)
        argv = ["--recipe", MODERN_RECIPE] + [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
            "tokenizer.name_or_path": shared_tokenizer, **MODERN, "checkpoint.downstream": recipe})]
        line = refused_in_process(argv, tmp_path / "run", capsys)
        assert line == f"config error: checkpoint.downstream={recipe} {said}", line
    from bert_recipes.config import load_config, validate
    from bert_recipes.downstream import check_downstream
    cfg = load_config(MODERN_RECIPE, tiny_args(tmp_path / "run", sample_dir, datasets_cache, **MODERN))
    validate(cfg)
    check_downstream(downstream_recipe(tmp_path, **{"model.architecture": "modernbert"}), "mlm", cfg.model)   # passes
