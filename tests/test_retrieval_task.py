"""task.kind=retrieval (bert_recipes/tasks/retrieval.py, its step bert_recipes/contrastive.accelerate_step): the
sample's (summary line, rest of the docstring) pairs train with the in-batch softmax over the whole global batch, so
a run on 2 processes (DDP, FSDP2, ZeRO-1/2/3, ZeRO offload: backends.tsv's rows) has the losses of the same run on 1 process with twice the
accumulation (control: task.negatives=micro, whose softmax spans one micro batch, does not); halted on 2 and resumed
on 1 it ends as the uninterrupted run, where task.negatives=micro is one line; the export is a sentence-transformers
model whose `encode` gives the embeddings the run scored (its nDCG@10 again); bad values are one line each."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import (assert_row_is_ddp, assert_same_weights, feature_rows, launch, refused_in_process, run_in_process,
                      runs_by_row, tiny_args)

TOL = 1e-5
ROWS = feature_rows()   # DDP, FSDP2, ZeRO-1/2/3 and ZeRO-2 offload: backends.tsv's first row of each


def pair_args(out, sample_dir, datasets_cache, shared_tokenizer, **extra) -> list[str]:
    """No dropout: 1 and 2 processes draw different masks (per-rank streams), and the test compares their losses."""
    return tiny_args(out, sample_dir, datasets_cache, task="classification", **{
        "task.kind": "retrieval", "data.text_column": "query", "data.text_pair_column": "positive",
        "data.max_seq_length": 64, "data.max_train_samples": 256, "data.max_eval_samples": 96,
        "tokenizer.name_or_path": shared_tokenizer, "model.hidden_dropout_prob": 0.0,
        "model.attention_probs_dropout_prob": 0.0, "optim.lr": 1e-3, "train.max_steps": 16,
        "checkpoint.save_every": 8, "train.eval_every": 8, **extra})


@pytest.fixture(scope="module")
def encoders(tmp_path_factory, sample_dir, datasets_cache, shared_tokenizer):
    """row -> the sample's retrieval run on 2 processes under that backend row (global 16 = micro 8 x 2), each once;
    "one": the same run on 1 process (micro 8 x accum 2)."""
    root = tmp_path_factory.mktemp("retrieval")
    args = lambda out: pair_args(out, sample_dir, datasets_cache, shared_tokenizer)  # noqa: E731
    runs = runs_by_row(root, args)

    def run(name: str) -> dict:
        if name == "one":
            if not (root / "one/metrics.json").exists():
                launch(1, args(root / "one"))
            return json.loads((root / "one/metrics.json").read_text())
        return runs(name)
    return run


@pytest.mark.parametrize("backend", ROWS)
def test_the_loss_is_the_global_batchs_on_any_process_count(backend, encoders):
    """2 processes under the row: the losses of 1 process step for step (TOL), and its nDCG@10."""
    ours, one = encoders(backend), encoders("one")
    assert one["final"]["num_processes"] == 1
    assert_row_is_ddp(backend, ours, one, TOL)
    assert ours["final"]["ndcg@10"] == pytest.approx(one["final"]["ndcg@10"], abs=1e-4)
    assert ours["final"]["eval_queries"] + ours["final"]["eval_corpus"] == ours["final"]["eval_dataset_size"]


def test_negatives_of_a_micro_batch_are_another_loss(tmp_path, sample_dir, datasets_cache, shared_tokenizer, encoders,
                                                      capsys):
    """The control: task.negatives=micro on 1 process (each query against the 8 pairs of its micro batch, not the 16
    of the step) has other losses than the global softmax; halted there and resumed on 2 processes (16 pairs a
    softmax) is one line, and nothing more is written."""
    args = pair_args(tmp_path / "micro", sample_dir, datasets_cache, shared_tokenizer,
                     **{"task.negatives": "micro", "train.halt_at_step": 8})
    micro = run_in_process(args)
    one = encoders("one")["history"]["train"]
    history = json.loads((tmp_path / "micro/metrics.json").read_text())["history"]["train"]
    assert micro["steps"] == 8 and abs(history[0]["loss"] - one[0]["loss"]) > 1e-2, (history[0], one[0])
    before = sorted(p.name for p in (tmp_path / "micro").iterdir())
    out = launch_refused(args + ["checkpoint.resume=auto"], tmp_path)
    assert "task.negatives=micro:" in out and "resume with 1 processes and micro batch 8" in out
    assert sorted(p.name for p in (tmp_path / "micro").iterdir()) == before


def launch_refused(overrides: list[str], tmp_path: Path) -> str:
    """2 processes that stop before training: the output."""
    from conftest import launch_script
    return launch_script("train.py", [f"--{o}" for o in overrides], 2, check=False)


def test_a_halt_on_two_resumes_on_one_and_exports_a_sentence_transformer(tmp_path, sample_dir, datasets_cache,
                                                                         shared_tokenizer, encoders):
    """DDP on 2 processes halted at step 8, resumed on 1: the uninterrupted run's weights (TOL). Its export loads with
    SentenceTransformer: encode, at the run's max_seq_length, gives this package's embeddings (1e-5), and their
    scores are the run's final nDCG@10, MRR@10 and recall@100."""
    import torch
    from sentence_transformers import SentenceTransformer

    from bert_recipes.metrics.retrieval import scores
    from bert_recipes.tasks.retrieval import PooledEncoder
    args = lambda out, **more: pair_args(out, sample_dir, datasets_cache, shared_tokenizer, **more)  # noqa: E731
    ddp = encoders(ROWS[0])
    ddp_dir = Path(ddp["config"]["run/output_dir"])
    launch(2, args(tmp_path / "split", **{"train.halt_at_step": 8}))
    one = launch(1, args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 16
    assert_same_weights(ddp_dir / "model/model.safetensors", tmp_path / "split/model/model.safetensors", TOL)

    export = ddp_dir / "model"
    st = SentenceTransformer(str(export), device="cpu")
    assert st.max_seq_length == 64 and st.similarity_fn_name == "cosine"
    rows = [json.loads(line) for line in (sample_dir / "retrieval/validation.jsonl").read_text().splitlines()][:96]
    queries, corpus = [r["query"] for r in rows], list(dict.fromkeys(r["positive"] for r in rows))
    theirs_q = st.encode(queries, convert_to_tensor=True, batch_size=16)
    theirs_d = st.encode(corpus, convert_to_tensor=True, batch_size=16)
    model = PooledEncoder.from_pretrained(str(export)).eval()
    tokens = st.tokenizer(queries[:8], truncation=True, max_length=64, padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).logits
    assert float((ours - theirs_q[:8]).abs().max()) < 1e-5
    at = {text: f"d{n}" for n, text in enumerate(corpus)}
    found = scores(theirs_q, theirs_d, [f"q{n}" for n in range(len(rows))], list(at.values()),
                   {f"q{n}": {at[r["positive"]]} for n, r in enumerate(rows)})
    for name, value in found.items():
        assert value == pytest.approx(ddp["final"][name], abs=1e-5), name


def test_bad_values_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    """No positive column, a column the data lacks, data.unpad, data.group_by_length, a BEIR folder without its files,
    the pipeline: one line each, and nothing written."""
    from bert_recipes.backends.consistency import check_consistency
    from bert_recipes.config import ConfigError, load_config
    from conftest import backend_rows
    out = tmp_path / "run"
    args = pair_args(out, sample_dir, datasets_cache, shared_tokenizer)
    cases = {
        "data.text_pair_column=null": "task.kind=retrieval needs data.text_pair_column: the positive passage's column",
        "data.negative_columns=[hard]": "column 'hard' not in the train split",
        "data.unpad=true": "data.unpad=true: task.kind=retrieval pools each text over its own padded row",
        "data.group_by_length=true": "data.group_by_length=true: task.kind=retrieval batches a query with its",
        f"data.beir_dir={tmp_path}": f"data.beir_dir={tmp_path}: no corpus.jsonl, queries.jsonl, qrels/test.tsv there",
    }
    for change, message in cases.items():
        said = refused_in_process([f"--{a}" for a in args] + [f"--{change}"], out, capsys)
        assert message in said, (change, said)
        assert not out.exists() or not any(out.iterdir()), change
    with pytest.raises(ConfigError, match="task.kind=retrieval: the pipeline engine cuts the heads of mlm, "
                                          "classification only"):
        check_consistency(load_config(None, args), backend_rows()["pipeline"].plan, 2, 1, False)


def test_hard_negatives_join_every_querys_softmax(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Triplets from files (data.negative_columns): each query's softmax spans the step's 16 positives and 16 hard
    negatives. A fresh encoder scores every text nearly alike, so the first step's loss is near log(candidates): log 32
    with the negatives, log 16 without (the control: the same rows, data.negative_columns unset), log 2 apart
    (measured: 3.28 and 2.58)."""
    import math
    rows = [json.loads(line) for line in (sample_dir / "retrieval/train.jsonl").read_text().splitlines()][:128]
    triplets = tmp_path / "triplets.jsonl"
    triplets.write_text("".join(json.dumps({**r, "negative": rows[(n + 1) % len(rows)]["positive"]}) + "\n"
                                for n, r in enumerate(rows)))
    first = {}
    for name, negatives in (("with", "[negative]"), ("without", "null")):
        out = tmp_path / name
        final = run_in_process(pair_args(out, sample_dir, datasets_cache, shared_tokenizer, **{
            "data.source": "files", "data.train_files": f"[{triplets}]", "data.negative_columns": negatives,
            "train.max_steps": 2, "logging.log_every": 1, "train.eval_every": "null", "checkpoint.save_every": "null"}))
        assert final["steps"] == 2
        first[name] = json.loads((out / "metrics.json").read_text())["history"]["train"][0]["loss"]
    assert first["with"] - first["without"] == pytest.approx(math.log(2), abs=0.1), first   # twice the candidates
    assert first["with"] == pytest.approx(math.log(32), abs=0.3), first
