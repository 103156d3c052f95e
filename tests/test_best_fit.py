"""data.packing: best_fit (bert_recipes/data/best_fit.py): a token store's documents packed whole into rows, as
ModernBERT's packer packs. The plan puts every token of the store in exactly one row, cuts only the documents longer
than a row, and is the rule written out plainly (each piece into the open row with the least free space that holds
it); a row reads as those pieces, each its own document, then padding that is special, unattended and its own
document. A run trains on it with documents apart, halted on 2 processes and resumed on 1 as the uninterrupted run;
without document masks it is one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import assert_same_weights, launch, refused_in_process, run_in_process, tiny_args
from test_store import parquet_tree, prepare

TOL = 1e-5   # fp32, dropout off: another process count sums in another order
SEQ = 64


@pytest.fixture(scope="module")
def store(tmp_path_factory, sample_dir, shared_tokenizer):
    """A store of the parquet tree (documents of several lines; one of 2.3M characters), on 2 worker processes."""
    root = tmp_path_factory.mktemp("best-fit")
    done = prepare(root / "store", parquet_tree(root, sample_dir), shared_tokenizer)
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "store"


def reference_plan(store, seq: int, open_rows: int) -> list[list[tuple]]:
    """The rule in plain Python: each piece (a document cut only where it is longer than a row) into the open row
    with the least free space that holds it (of equal ones, the one whose free space was set last); none: a new
    row, after closing the fullest (the same tie rule) where `open_rows` are open; the rest closed in opening order.
    -> the rows as they close, each its pieces (shard, start, length)."""
    rows, opened, stamp, next_id = [], {}, 0, 0
    tightest = lambda candidates: min(candidates, key=lambda r: (r["free"], -r["stamp"]))  # noqa: E731
    for shard in range(len(store.shards)):
        ends = [int(e) for e in store.ends(shard)]
        for begin, end in zip([0] + ends[:-1], ends):
            for start in range(begin, end, seq):
                length = min(seq, end - start)
                fitting = [r for r in opened.values() if r["free"] >= length]
                if fitting:
                    row = tightest(fitting)
                else:
                    if len(opened) >= open_rows:
                        rows.append(opened.pop(tightest(opened.values())["id"])["pieces"])
                    row, next_id = {"id": next_id, "free": seq, "pieces": []}, next_id + 1
                    opened[row["id"]] = row
                row["pieces"].append((shard, start, length))
                row["free"] -= length
                stamp += 1
                row["stamp"] = stamp
                if row["free"] == 0:
                    rows.append(opened.pop(row["id"])["pieces"])
    return rows + [opened[i]["pieces"] for i in sorted(opened)]


def test_the_plan_holds_every_token_once_and_is_the_best_fit_rule(store):
    from bert_recipes.data import best_fit
    from bert_recipes.data.store import TokenStore
    tokens = TokenStore(store)
    rows, pieces, packed = best_fit.pack(tokens, SEQ)
    assert packed == sum(s["tokens"] for s in tokens.shards)   # every token, none dropped
    lengths = np.add.reduceat(pieces["length"], rows[:-1]) if len(pieces) else np.array([])
    assert (lengths <= SEQ).all() and (np.diff(rows) >= 1).all()
    for shard in range(len(tokens.shards)):   # each token once: the shard's pieces tile it, none spans two documents
        mine = np.sort(pieces[pieces["shard"] == shard], order="start")
        assert (mine["start"][1:] == mine["start"][:-1] + mine["length"][:-1]).all() and mine["start"][0] == 0
        ends = np.asarray(tokens.ends(shard), dtype=np.int64)
        document = np.searchsorted(ends, mine["start"], side="right")
        assert (mine["start"] + mine["length"] <= ends[document]).all()
        short = np.diff(ends, prepend=0) <= SEQ   # a document no longer than a row is one piece
        assert (np.bincount(document, minlength=len(ends))[short] == 1).all()
    expected = reference_plan(tokens, SEQ, best_fit.OPEN_ROWS)
    got = [[tuple(int(x) for x in p) for p in pieces[rows[i]:rows[i + 1]]] for i in range(len(rows) - 1)]
    assert got == expected


def test_a_row_reads_as_its_pieces_then_padding_apart(store, shared_tokenizer):
    from transformers import AutoTokenizer

    from bert_recipes.data.best_fit import BestFitRows
    from bert_recipes.data.store import TokenStore
    tokenizer = AutoTokenizer.from_pretrained(str(shared_tokenizer))
    tokens = TokenStore(store)
    rows = BestFitRows(tokens, SEQ, tokenizer.all_special_ids, tokenizer.pad_token_id)
    padded = [i for i in range(len(rows)) if rows.row_first[i + 1] - rows.row_first[i] > 1][:20]
    for i, row in zip(padded, rows.__getitems__(padded)):
        pieces = rows.pieces[rows.row_first[i]:rows.row_first[i + 1]]
        real = int(pieces["length"].sum())
        text = np.concatenate([tokens.tokens(int(p["shard"]))[p["start"]:p["start"] + p["length"]] for p in pieces])
        assert (row["input_ids"][:real] == text).all() and (row["input_ids"][real:] == tokenizer.pad_token_id).all()
        assert row["attention_mask"].sum() == real and (row["special_tokens_mask"][real:] == 1).all()
        bounds = np.cumsum(pieces["length"])
        assert (row["document_ids"][:real] == np.searchsorted(bounds, np.arange(real), side="right")).all()
        assert (row["document_ids"][real:] == len(pieces)).all()   # the padding: a document of its own
    plan = json.loads((store / f"best_fit_{SEQ}/plan.json").read_text())
    assert plan["rows"] == len(rows) and 0 <= plan["padding"] < 0.05


def args(out, sample_dir, datasets_cache, shared_tokenizer, **more):
    return tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "data.packing": "best_fit", "data.document_mask": True,
        "train.max_steps": 8, "checkpoint.save_every": 4, "model.hidden_dropout_prob": 0.0,
        "model.attention_probs_dropout_prob": 0.0, **more})


def test_best_fit_trains_and_resumes_on_another_process_count(tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                                               capsys):
    """The sample's own store, best-fit (the run says its padding): DDP on 2 processes, the loss goes down; halted at
    step 4 and resumed on 1 process, it ends with the uninterrupted run's weights within 1e-5; on 1 process, halted
    and resumed, bit for bit."""
    full = launch(2, args(tmp_path / "full", sample_dir, datasets_cache, shared_tokenizer))
    assert full["final"]["num_processes"] == 2 and full["final"]["backend"]["name"] == "ddp"
    log = (tmp_path / "full.log").read_text()
    assert "[data] data.packing=best_fit: the training store's documents in" in log and "% of them padding" in log
    losses = [row["loss"] for row in full["history"]["train"]]
    assert losses[-1] < losses[0]
    launch(2, args(tmp_path / "split", sample_dir, datasets_cache, shared_tokenizer, **{"train.halt_at_step": 4}))
    one = launch(1, args(tmp_path / "split", sample_dir, datasets_cache, shared_tokenizer,
                         **{"checkpoint.resume": "auto"}))
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 8
    assert_same_weights(tmp_path / "full/model/model.safetensors", tmp_path / "split/model/model.safetensors", TOL)
    first = run_in_process(args(tmp_path / "one", sample_dir, datasets_cache, shared_tokenizer))
    run_in_process(args(tmp_path / "halted", sample_dir, datasets_cache, shared_tokenizer, **{"train.halt_at_step": 4}))
    again = run_in_process(args(tmp_path / "halted", sample_dir, datasets_cache, shared_tokenizer,
                                **{"checkpoint.resume": "auto"}))
    assert again["steps"] == first["steps"] == 8
    assert_same_weights(tmp_path / "one/model/model.safetensors", tmp_path / "halted/model/model.safetensors", 0.0)


def test_best_fit_without_document_masks_is_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    argv = [f"--{a}" for a in args(tmp_path / "run", sample_dir, datasets_cache, shared_tokenizer,
                                   **{"data.document_mask": False})]
    assert ("data.packing=best_fit packs whole documents into a row and pads its tail: the documents and the padding "
            "must attend apart, so it needs task.kind=mlm and data.document_mask=true") in refused_in_process(
        argv, tmp_path, capsys)


def test_a_read_only_store_without_its_plan_is_one_line(tmp_path, store, sample_dir, datasets_cache, shared_tokenizer,
                                                        capsys, tmpfs):
    """A store prepared elsewhere and read-only here (a tmpfs remounted ro), with no plan for this row length: one
    line naming the way to make one, nothing written."""
    import shutil
    import subprocess
    place = tmpfs(64 * 2 ** 20)
    shutil.copytree(store, place / "store", ignore=shutil.ignore_patterns("best_fit_*"))
    assert subprocess.run(["mount", "-o", "remount,ro", str(place)]).returncode == 0
    argv = [f"--{a}" for a in args(tmp_path / "run", sample_dir, datasets_cache, shared_tokenizer, **{
        "data.source": "store", "data.store_dir": str(place / "store"), "data.max_seq_length": 32})]
    said = refused_in_process(argv, tmp_path, capsys)
    assert ("data.packing=best_fit: no pack plan for rows of 32 tokens beside the store in" in said
            and "with tools/prepare.py --store" in said), said
