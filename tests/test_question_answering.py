"""task.kind=question_answering (bert_recipes/tasks/question_answering.py): SQuAD as BERT and run_qa.py train it.
Every answer round-trips through its windows (the characters of its first and last token are the answer); the
sample's cloze questions train on 2 processes under DDP and ZeRO-2 with the same losses, a halt on 2 resumed on 1
ends as the uninterrupted run, exact match and F1 are reported and the export loads as a plain span head; the
pipeline and bad values are one line each. The answers' post-processing against run_qa.py's: tests/test_squad.py."""
from __future__ import annotations

import json

import pytest

from conftest import assert_same_weights, launch, refused_in_process, tiny_args

TOL = 1e-5


def qa_args(out, sample_dir, datasets_cache, shared_tokenizer, **extra) -> list[str]:
    return tiny_args(out, sample_dir, datasets_cache, task="classification", **{
        "task.kind": "question_answering", "task.num_labels": 2, "data.text_column": "question",
        "data.text_pair_column": "context", "data.label_column": "answers", "data.max_seq_length": 64,
        "data.doc_stride": 8, "tokenizer.name_or_path": shared_tokenizer, "model.hidden_dropout_prob": 0.0,
        "model.attention_probs_dropout_prob": 0.0, "train.max_steps": 16, "checkpoint.save_every": 8,
        "train.eval_every": 8, **extra})


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


def test_the_sample_questions_train_resume_on_another_count_and_export(tmp_path, sample_dir, datasets_cache,
                                                                        shared_tokenizer):
    from transformers import AutoModelForQuestionAnswering
    args = lambda out, **more: qa_args(out, sample_dir, datasets_cache, shared_tokenizer, **more)  # noqa: E731
    ddp = launch(2, args(tmp_path / "ddp"))
    assert ddp["final"]["num_processes"] == 2 and ddp["final"]["backend"]["name"] == "ddp"
    losses = [r["loss"] for r in ddp["history"]["train"]]
    assert losses[-1] < losses[0]
    final = ddp["final"]
    assert 0 <= final["exact_match"] <= final["f1"] <= 100 and final["eval_samples"] > 0
    zero2 = launch(2, args(tmp_path / "zero2"), backend="zero2")
    assert zero2["final"]["num_processes"] == 2 and "DEEPSPEED" in zero2["final"]["backend"]["distributed_type"]
    gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(zero2["history"]["train"], ddp["history"]["train"])]
    assert len(gaps) == len(losses) and max(gaps) < TOL, gaps
    launch(2, args(tmp_path / "split", **{"train.halt_at_step": 8}))
    one = launch(1, args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 16
    assert_same_weights(tmp_path / "ddp/model/model.safetensors", tmp_path / "split/model/model.safetensors", TOL)
    model = AutoModelForQuestionAnswering.from_pretrained(tmp_path / "ddp/model")
    assert type(model).__name__ == "BertForQuestionAnswering"


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
