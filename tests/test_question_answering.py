"""task.kind=question_answering (bert_recipes/tasks/question_answering.py): SQuAD as BERT and run_qa.py train it.
Every answer round-trips through its windows (the characters of its first and last token are the answer); the
sample's cloze questions train on 2 processes under every backend row with DDP's losses, a halt on 2 resumed on 1
ends as the uninterrupted run, exact match and F1 are reported and the export loads as a plain span head; the
pipeline and bad values are one line each. The answers' post-processing against run_qa.py's: tests/test_squad.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import (assert_row_is_ddp, assert_same_weights, feature_rows, launch, refused_in_process, runs_by_row,
                      tiny_args)

TOL = 1e-5


def qa_args(out, sample_dir, datasets_cache, shared_tokenizer, **extra) -> list[str]:
    return tiny_args(out, sample_dir, datasets_cache, task="classification", **{
        "task.kind": "question_answering", "task.num_labels": 2, "data.text_column": "question",
        "data.text_pair_column": "context", "data.label_column": "answers", "data.max_seq_length": 64,
        "data.doc_stride": 8, "tokenizer.name_or_path": shared_tokenizer, "model.hidden_dropout_prob": 0.0,
        "model.attention_probs_dropout_prob": 0.0, "train.max_steps": 16, "checkpoint.save_every": 8,
        "train.eval_every": 8, **extra})


def scored(out, sample_dir) -> dict:
    """The run's predictions.json scored against the sample's validation answers by the official normalisation (the
    questions it answers: data.max_eval_samples's), and how many it answers as eval_samples."""
    from bert_recipes.metrics.squad import scores
    golds = {r["id"]: r["answers"]["text"] for r in map(json.loads, (sample_dir / "qa/validation.jsonl").open())}
    found = json.loads((out / "predictions.json").read_text())
    assert set(found) <= set(golds) and all(isinstance(text, str) for text in found.values())
    return {**scores(found, {q: golds[q] for q in found}), "eval_samples": len(found)}


def test_every_answer_round_trips_through_its_windows(sample_dir, shared_tokenizer):
    """Windows of 64 tokens sharing 8: a window that holds the answer labels its first and last token, whose
    characters in the context are the answer; every question whose answer fits in the windows' overlap has one such
    window (and 95% of all); the others point at [CLS]; the windows are numbered in order."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from bert_recipes.config import DataConfig, TaskConfig
    from bert_recipes.tasks import question_answering as kind
    tokenizer = AutoTokenizer.from_pretrained(str(shared_tokenizer))
    raw = load_dataset("json", data_files={"train": str(sample_dir / "qa/validation.jsonl")})
    data = DataConfig(text_column="question", text_pair_column="context", label_column="answers", max_seq_length=64,
                      doc_stride=8, num_proc=None)
    windows = kind.tokenize(raw, tokenizer, TaskConfig(kind="question_answering"), data)["train"]
    held = set()
    for w in windows:
        first, last, number = w["labels"]
        if (first, last) == (0, 0):
            continue
        text = w["context"][w["offset_mapping"][first][0]:w["offset_mapping"][last][1]]
        assert text == w["gold"][0], (text, w["gold"])
        held.add(w["example_id"])
    # an answer longer than the windows' overlap may straddle every window boundary: SQuAD's windows lose it too
    short = {r["id"] for r in raw["train"] if len(tokenizer.tokenize(" " + r["answers"]["text"][0])) <= 8}
    assert short <= held and len(held) >= 0.95 * len(raw["train"]) and len(windows) > len(held)
    assert [w["labels"][2] for w in windows] == list(range(len(windows)))


@pytest.fixture(scope="module")
def answerer(tmp_path_factory, sample_dir, datasets_cache, shared_tokenizer):
    """row -> the sample questions' metrics.json on 2 processes under that backend row, each row once."""
    return runs_by_row(tmp_path_factory.mktemp("answerer"),
                       lambda out: qa_args(out, sample_dir, datasets_cache, shared_tokenizer))


@pytest.mark.parametrize("backend", feature_rows()[1:])
def test_every_row_answers_as_ddp_does(backend, answerer):
    """FSDP2, ZeRO-1/2/3 and ZeRO offload on 2 processes: DDP's losses within TOL, and its exact match (a near tie's
    flip of one question allowed for the summation order); its predictions.json scores as its final metrics."""
    ours, ddp = answerer(backend), answerer("ddp")
    assert_row_is_ddp(backend, ours, ddp, TOL)
    final = ours["final"]
    assert final["exact_match"] == pytest.approx(ddp["final"]["exact_match"], abs=100 / final["eval_samples"])
    out, sample = Path(ours["config"]["run/output_dir"]), Path(ours["config"]["data/sample_dir"])
    assert scored(out, sample) == pytest.approx({k: final[k] for k in ("exact_match", "f1", "eval_samples")})


def test_the_sample_questions_train_resume_on_another_count_and_export(tmp_path, sample_dir, datasets_cache,
                                                                        shared_tokenizer, answerer):
    from transformers import AutoModelForQuestionAnswering
    args = lambda out, **more: qa_args(out, sample_dir, datasets_cache, shared_tokenizer, **more)  # noqa: E731
    ddp = answerer("ddp")
    assert ddp["final"]["num_processes"] == 2 and ddp["final"]["backend"]["name"] == "ddp"
    losses = [r["loss"] for r in ddp["history"]["train"]]
    assert losses[-1] < losses[0]
    final, ddp_dir = ddp["final"], Path(ddp["config"]["run/output_dir"])
    assert 0 <= final["exact_match"] <= final["f1"] <= 100 and final["eval_samples"] > 0
    assert scored(ddp_dir, sample_dir) == pytest.approx({k: final[k] for k in ("exact_match", "f1", "eval_samples")})
    assert not (ddp_dir / "null_odds.json").exists()   # SQuAD v1.1: every question has an answer
    launch(2, args(tmp_path / "split", **{"train.halt_at_step": 8}))
    one = launch(1, args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 16
    assert scored(tmp_path / "split", sample_dir) == pytest.approx({k: one["final"][k] for k in ("exact_match", "f1",
                                                                                                "eval_samples")})
    assert_same_weights(ddp_dir / "model/model.safetensors", tmp_path / "split/model/model.safetensors", TOL)
    model = AutoModelForQuestionAnswering.from_pretrained(ddp_dir / "model")
    assert type(model).__name__ == "BertForQuestionAnswering"


def test_v2_writes_the_null_odds_and_the_best_states_answers(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """SQuAD v2.0 (task.unanswerable): null_odds.json holds every question's null score minus its best span's, and a
    question is answered empty exactly where that exceeds task.null_threshold; with checkpoint.metric_for_best the
    answer files are the restored best state's (its final metrics)."""
    out = tmp_path / "v2"
    run = launch(1, qa_args(out, sample_dir, datasets_cache, shared_tokenizer, **{
        "task.unanswerable": True, "task.null_threshold": 0.5, "checkpoint.metric_for_best": "f1",
        "train.max_steps": 12, "train.eval_every": 4, "checkpoint.save_every": 4, "optim.lr": 3e-3}))
    final, odds = run["final"], json.loads((out / "null_odds.json").read_text())
    found = json.loads((out / "predictions.json").read_text())
    assert set(odds) == set(found) and all(isinstance(v, float) for v in odds.values())
    assert all((found[q] == "") == (odds[q] > 0.5) for q in found)
    assert scored(out, sample_dir) == pytest.approx({k: v for k, v in final.items() if k.endswith(("exact", "f1"))
                                                     or k in ("exact_match", "eval_samples")})
    assert [e["step"] for e in run["history"]["eval"]] == [4, 8, 12]


def test_the_pipeline_and_bad_values_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    from bert_recipes.backends.consistency import check_consistency
    from bert_recipes.config import ConfigError, load_config
    from conftest import backend_rows
    cfg = load_config(None, qa_args(tmp_path / "pipe", sample_dir, datasets_cache, shared_tokenizer))
    with pytest.raises(ConfigError, match="task.kind=question_answering: the pipeline engine cuts the heads of"):
        check_consistency(cfg, backend_rows()["pipeline"].plan, 2, 1, False)
    bad = tmp_path / "bad"
    bad.mkdir()
    row = {"id": "x", "question": "Which call returns the path?", "context": "Use os.path.join() to join paths."}
    files = {"moved": {**row, "answers": {"text": ["os.path.join()"], "answer_start": [2]}},
             "none": {**row, "answers": {"text": [], "answer_start": []}}}
    for name, r in files.items():
        (bad / f"{name}.jsonl").write_text(json.dumps(r) + "\n" + json.dumps({**r, "id": "y"}) + "\n")
    cases = [({"data.doc_stride": 64}, "data.doc_stride=64 must be less than data.max_seq_length=64"),
             ({"data.source": "files", "data.train_files": f"[{bad / 'moved.jsonl'}]",
               "data.validation_files": f"[{bad / 'moved.jsonl'}]"}, "is not at character 2 of its context"),
             ({"data.source": "files", "data.train_files": f"[{bad / 'none.jsonl'}]",
               "data.validation_files": f"[{bad / 'none.jsonl'}]"}, "has no answer: set task.unanswerable=true")]
    for extra, said in cases:
        argv = [f"--{a}" for a in qa_args(tmp_path / "run", sample_dir, datasets_cache, shared_tokenizer, **extra)]
        assert said in refused_in_process(argv, tmp_path / "run", capsys)
