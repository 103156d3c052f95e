"""task.kind=token_classification (bert_recipes/tasks/token_classification.py): named entities as CoNLL-2003 tags
them. A word's tag lands on its first sub-token (on every one with data.label_all_tokens, I- after B-, as run_ner.py
does); entity F1 is seqeval's, not the token F1 a classifier would report (a hand-built case, the token score as the
control); the sample's tagging task trains on 2 processes under every backend row with DDP's losses, a halt on 2
resumed on 1 ends as the uninterrupted run, the export loads as a plain token classifier; the pipeline and bad
values are one line each."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import (assert_row_is_ddp, assert_same_weights, feature_rows, launch, refused_in_process, run_in_process,
                      runs_by_row, tiny_args)

TOL = 1e-5
TAGS = ["O", "B-NAME", "I-NAME", "B-LITERAL", "I-LITERAL"]


def ner_args(out, sample_dir, datasets_cache, shared_tokenizer, **extra) -> list[str]:
    return tiny_args(out, sample_dir, datasets_cache, task="classification", **{
        "task.kind": "token_classification", "task.num_labels": 5, "task.label_names": f"[{', '.join(TAGS)}]",
        "data.text_column": "tokens", "data.label_column": "ner_tags", "data.max_seq_length": 64,
        "tokenizer.name_or_path": shared_tokenizer, "model.hidden_dropout_prob": 0.0,
        "model.attention_probs_dropout_prob": 0.0, "train.max_steps": 16, "checkpoint.save_every": 8,
        "train.eval_every": 8, **extra})


def test_a_words_tag_lands_on_its_first_sub_token(shared_tokenizer):
    """Words split into sub-tokens by the suite's WordPiece: the first piece carries the word's tag, the rest -100;
    with label_all_tokens every piece does, a B- word's later pieces I-. Special tokens are -100."""
    from datasets import Dataset, DatasetDict, Features, Sequence, Value
    from transformers import AutoTokenizer

    from bert_recipes.config import DataConfig, TaskConfig
    from bert_recipes.tasks import token_classification as kind
    tokenizer = AutoTokenizer.from_pretrained(str(shared_tokenizer))
    words = ["call", "multiprocessing.get_context()", "with", "'spawn'"]
    pieces = [len(tokenizer.tokenize(w)) for w in words]
    assert pieces[1] > 1   # a word of several pieces
    raw = DatasetDict({"train": Dataset.from_dict(
        {"tokens": [words], "ner_tags": [["O", "B-NAME", "O", "B-LITERAL"]]},
        features=Features({"tokens": Sequence(Value("string")), "ner_tags": Sequence(Value("string"))}))})
    for all_tokens in (False, True):
        task = TaskConfig(kind="token_classification", num_labels=5, label_names=list(TAGS))
        data = DataConfig(text_column="tokens", label_column="ner_tags", max_seq_length=64,
                          label_all_tokens=all_tokens, num_proc=None)
        labels = kind.tokenize(raw, tokenizer, task, data)["train"][0]["labels"]
        expected = [-100]
        for word, tag, n in zip(words, ["O", "B-NAME", "O", "B-LITERAL"], pieces):
            later = TAGS.index("I-" + tag[2:]) if tag != "O" else 0
            expected += [TAGS.index(tag)] + [later if all_tokens else -100] * (n - 1)
        assert labels == expected + [-100]


def test_the_sample_tags_need_no_capitals(sample_dir):
    """The sample's NAME words show their kind in what an uncased WordPiece sees (a call's parentheses, a dot, an
    underscore, reST's ``quotes``): a CamelCase class name, which only its capitals mark, is O. Control: such names
    are in the paragraphs (the question-answering task's answers hold them)."""
    import re
    for split in ("train", "validation", "test"):
        for row in map(json.loads, (sample_dir / f"ner/{split}.jsonl").open()):
            words = row["tokens"]
            for k, (word, tag) in enumerate(zip(words, row["ner_tags"])):
                if tag == "B-NAME":
                    assert re.search(r"[(._]", word) or k and words[k - 1] == "`", (word, words)
    answers = [r["answers"]["text"][0] for r in map(json.loads, (sample_dir / "qa/train.jsonl").open())]
    assert sum(a.isalnum() and sum(map(str.isupper, a)) >= 2 for a in answers) >= 20


def test_entity_f1_is_seqevals_not_the_token_score():
    """Reference: two entities (NAME at 0; LITERAL over 2-3). The prediction finds NAME and half of LITERAL: one
    entity right of two predicted and two true, F1 0.5 (conlleval counts a partial span as wrong), while 3 of 4
    tokens are right (the control: a token-level score says 0.75)."""
    from bert_recipes.config import TaskConfig
    from bert_recipes.tasks import token_classification as kind
    task = TaskConfig(kind="token_classification", num_labels=5, label_names=list(TAGS))
    refs = np.array([[-100, 1, 0, 3, 4, -100]])
    preds = np.array([[0, 1, 0, 3, 0, 2]])
    scores = kind.metrics(task, {"preds": preds, "refs": refs})
    assert scores["f1"] == scores["precision"] == scores["recall"] == 0.5
    assert scores["accuracy"] == 0.75 and scores["eval_samples"] == 1


@pytest.fixture(scope="module")
def tagger(tmp_path_factory, sample_dir, datasets_cache, shared_tokenizer):
    """row -> the sample tagger's metrics.json on 2 processes under that backend row, each row once."""
    return runs_by_row(tmp_path_factory.mktemp("tagger"),
                       lambda out: ner_args(out, sample_dir, datasets_cache, shared_tokenizer))


@pytest.mark.parametrize("backend", feature_rows()[1:])
def test_every_row_tags_as_ddp_does(backend, tagger):
    """FSDP2, ZeRO-1/2/3 and ZeRO offload on 2 processes: DDP's losses within TOL, and its entity F1 (a near tie's
    flip of one entity allowed for the summation order)."""
    ours, ddp = tagger(backend), tagger("ddp")
    assert_row_is_ddp(backend, ours, ddp, TOL)
    assert ours["final"]["f1"] == pytest.approx(ddp["final"]["f1"], abs=0.02)


def test_the_sample_tagger_trains_resumes_on_another_count_and_exports(tmp_path, sample_dir, datasets_cache,
                                                                       shared_tokenizer, tagger):
    """DDP on 2 processes: the loss goes down, entity F1 and token accuracy are reported; halted at step 8 on 2
    processes and resumed on 1, the uninterrupted run's weights within 1e-5; the export loads with
    AutoModelForTokenClassification and names its tags."""
    from transformers import AutoModelForTokenClassification
    args = lambda out, **more: ner_args(out, sample_dir, datasets_cache, shared_tokenizer, **more)  # noqa: E731
    ddp = tagger("ddp")
    assert ddp["final"]["num_processes"] == 2 and ddp["final"]["backend"]["name"] == "ddp"
    losses = [r["loss"] for r in ddp["history"]["train"]]
    assert losses[-1] < losses[0]
    final, ddp_dir = ddp["final"], Path(ddp["config"]["run/output_dir"])
    assert {"f1", "precision", "recall", "accuracy"} <= set(final) and final["eval_samples"] == final[
        "eval_dataset_size"]
    launch(2, args(tmp_path / "split", **{"train.halt_at_step": 8}))
    one = launch(1, args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 16
    assert_same_weights(ddp_dir / "model/model.safetensors", tmp_path / "split/model/model.safetensors", TOL)
    model = AutoModelForTokenClassification.from_pretrained(ddp_dir / "model")
    assert type(model).__name__ == "BertForTokenClassification" and model.config.id2label[1] == "B-NAME"


def test_prepared_tags_serve_only_the_labelling_they_were_made_with(tmp_path, sample_dir, datasets_cache,
                                                                     shared_tokenizer, capsys):
    """make prepare's tokenized tagger data records data.label_all_tokens: a run that labels otherwise is one line
    naming it (its labels would be the other rule's), and nothing is written; the same labelling trains on it."""
    import os
    import subprocess
    import sys

    from conftest import REPO
    args = ner_args(tmp_path / "run", sample_dir, datasets_cache, shared_tokenizer, **{"train.max_steps": 2,
                                                                                        "train.eval_every": "null"})
    prepared = tmp_path / "prepared"
    proc = subprocess.run([sys.executable, "tools/prepare.py", "--recipe", str(REPO / "recipes/tiny-ner.yaml"),
                           "--out", str(prepared), *[f"--{a}" for a in args]], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    use = [f"--{a}" for a in args] + ["--data.source=prepared", f"--data.prepared_dir={prepared}"]
    said = refused_in_process(use + ["--data.label_all_tokens=true"], tmp_path / "run", capsys)
    assert "was prepared with other settings (data.label_all_tokens: prepared False, this run True)" in said
    assert run_in_process([a[2:] for a in use])["steps"] == 2


def test_the_pipeline_and_bad_values_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    """The pipeline has no token head to cut: one line. A tag the names do not cover, names that are not BIO, a tag
    count that is not task.num_labels, a row whose tags and words differ in count: one line each, nothing written."""
    from bert_recipes.backends.consistency import check_consistency
    from bert_recipes.config import ConfigError, load_config
    from conftest import backend_rows
    cfg = load_config(None, ner_args(tmp_path / "pipe", sample_dir, datasets_cache, shared_tokenizer))
    with pytest.raises(ConfigError, match="task.kind=token_classification: the pipeline engine cuts the heads of mlm, "
                                          "classification only"):
        check_consistency(cfg, backend_rows()["pipeline"].plan, 2, 1, False)
    bad = tmp_path / "bad"
    bad.mkdir()
    rows = {"tag": [{"tokens": ["a", "b"], "ner_tags": ["O", "B-PER"]}],
            "count": [{"tokens": ["a", "b", "c"], "ner_tags": ["O", "B-NAME"]}]}
    cases = [({"data.source": "files", "data.train_files": f"[{bad / 'tag.jsonl'}]"},
              "has the tag 'B-PER', which task.label_names="),
             ({"data.source": "files", "data.train_files": f"[{bad / 'count.jsonl'}]"},
              "has 3 words (tokens) and 2 tags (ner_tags): give every word one tag"),
             ({"task.label_names": "[O, NAME, LITERAL, X, Y]"}, "are not BIO tags (O, B-<type>, I-<type>)"),
             ({"task.num_labels": 3, "task.label_names": "null"}, "has 4 tag names")]   # the sample uses no I-NAME
    for name, lines in rows.items():
        (bad / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines * 40))
    for extra, said in cases:
        argv = [f"--{a}" for a in ner_args(tmp_path / "run", sample_dir, datasets_cache, shared_tokenizer, **extra)]
        assert said in refused_in_process(argv, tmp_path / "run", capsys)


def test_conll_column_files_are_read_as_sentences(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    """CoNLL-2003's own files (word, POS, chunk and NER columns; -DOCSTART- lines; a blank line between sentences),
    gzipped or not, as data.train_files / data.validation_files: sentences of words with their last column's tags, and
    a tagger trains on them; a line of one column is one line naming the file."""
    import gzip

    from bert_recipes.data.files import conll_sentences
    text = ("-DOCSTART- -X- -X- O\n\nEU NNP B-NP B-ORG\nrejects VBZ B-VP O\nGerman JJ B-NP B-MISC\ncall VB B-VP O\n\n"
            "Peter NNP B-NP B-PER\nBlackburn NNP I-NP I-PER\n\n")
    rows = conll_sentences(text.splitlines(), "x.conll")
    assert rows["tokens"] == [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"]]
    assert rows["ner_tags"] == [["B-ORG", "O", "B-MISC", "O"], ["B-PER", "I-PER"]]
    (tmp_path / "train.conll.gz").write_bytes(gzip.compress((text * 40).encode()))
    (tmp_path / "dev.conll").write_text(text * 8)
    names = "[O, B-PER, I-PER, B-ORG, I-ORG, B-LOC, I-LOC, B-MISC, I-MISC]"
    result = run_in_process(ner_args(tmp_path / "run", sample_dir, datasets_cache, shared_tokenizer, **{
        "data.source": "files", "data.train_files": f"[{tmp_path / 'train.conll.gz'}]",
        "data.validation_files": f"[{tmp_path / 'dev.conll'}]", "task.num_labels": 9, "task.label_names": names,
        "train.max_steps": 4, "train.eval_every": "null"}))
    assert result["steps"] == 4 and result["eval_samples"] == 16
    (tmp_path / "bad.conll").write_text("EU B-ORG\nrejects\n")
    argv = [f"--{a}" for a in ner_args(tmp_path / "bad", sample_dir, datasets_cache, shared_tokenizer, **{
        "data.source": "files", "data.train_files": f"[{tmp_path / 'bad.conll'}]"})]
    assert "line 2 ('rejects') has one column" in refused_in_process(argv, tmp_path / "bad", capsys)
