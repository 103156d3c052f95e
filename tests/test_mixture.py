"""A weighted mix of sources (data.mixture, bert_recipes/data/mixture.py): the order is arithmetic on the position in the
run (each block gives each source its share, each source runs its own passes, each pass a permutation of its rows with
ids of its own), a run reports each source's evaluation and what each source gave, within sampling noise of the
weights, and says when a source runs out; each bad value is one line. The halt that falls mid-ramp, mid-mix and
mid-epoch, resumed on the same and on another process count, is tests/test_batch_ramp.py's (its runs mix two sources)."""
from __future__ import annotations

import json
import math
import re

import numpy as np

from bert_recipes.config import load_config
from bert_recipes.data.mixture import BLOCK, MixedOrder, Mixture
from conftest import refused_in_process, run_in_process, tiny_args
from test_batch_ramp import mixture

SIZES = (40, 300, 7)


def small_mixture(seed: int = 7, tail: int = 0) -> Mixture:
    """Three sources; the run reads all but `tail` positions of each epoch."""
    return Mixture(names=("a", "b", "c"), weights=(3, 1, 0.5), sizes=SIZES, eval_sizes=(1, 1, 1),
                   tokens=(32.0, 32.0, 20.0), seed=seed, read=sum(SIZES) - tail)


def source_of(i: int) -> int:
    row = i % sum(SIZES)
    return 0 if row < 40 else 1 if row < 340 else 2


def test_the_order_is_arithmetic_on_the_position():
    m = small_mixture()
    n = m.total
    flat = sum((m.order(e) for e in range(4)), [])
    assert small_mixture().order(3) == flat[3 * n:]   # an epoch alone, computed without the ones before it
    assert small_mixture(seed=8).order(0) != flat[:n]
    sampler = MixedOrder(m)   # the loader's sampler: the same ids, read from an array
    sampler.set_epoch(2)
    assert list(sampler) == flat[2 * n:3 * n] and len(sampler) == n
    assert m.slots == (667, 222, 111)   # 1000 x 3/4.5, 1/4.5, 0.5/4.5, by largest remainders
    labels = np.array([source_of(i) for i in flat])
    for p in (0, 1, 999, BLOCK, BLOCK + 1, 1234, 2 * n + 5, len(flat)):
        assert list(m.counts(p)) == [int((labels[:p] == s).sum()) for s in range(3)], p
    for start in range(0, len(flat) - BLOCK, BLOCK):   # every whole block: each source its slots, exactly
        assert [int((labels[start:start + BLOCK] == s).sum()) for s in range(3)] == list(m.slots)
    offsets = (0, 40, 340)
    for s, size in enumerate(SIZES):   # each pass a permutation of the source's rows, with ids of that pass
        ids = [i for i in flat if source_of(i) == s]
        for p in range(len(ids) // size):
            chunk = ids[p * size:(p + 1) * size]
            assert sorted(i % n for i in chunk) == list(range(offsets[s], offsets[s] + size))
            assert {i // n for i in chunk} == {p}
    starts = m.pass_starts(0, len(flat))
    for name, number, position in starts:   # where each pass begins: the source's first row of that pass
        s = m.names.index(name)
        assert labels[position] == s and int((labels[:position] == s).sum()) == number * SIZES[s]
    assert [sum(1 for x in starts if x[0] == name) for name in m.names] == [
        math.ceil(int((labels == s).sum()) / SIZES[s]) - 1 for s in range(3)]
    assert m.pass_starts(10, 700) == [x for x in starts if 10 <= x[2] < 700]


def test_what_the_run_read_leaves_out_each_epochs_unread_tail():
    """The run reads whole full-size steps an epoch: the last positions of each epoch are never read, and what a run
    reports (the sequences each source gave, where its passes start) counts the positions it read."""
    m, n = small_mixture(tail=90), sum(SIZES)
    read = [i for e in range(4) for i in m.order(e)[:n - 90]]   # what the run's loader yields, epoch after epoch
    labels = np.array([source_of(i) for i in read])
    for p in (0, 5, n - 90, n - 89, 2 * (n - 90) + 7, len(read)):
        assert [m.seen(p)[name]["sequences"] for name in m.names] == [int((labels[:p] == s).sum()) for s in range(3)]
    firsts = {}   # each pass's first read position, as the run meets it
    for position, i in enumerate(read):
        firsts.setdefault((source_of(i), i // n), position)
    expected = sorted(((m.names[s], p, position) for (s, p), position in firsts.items() if p > 0), key=lambda x: x[2])
    assert m.pass_starts(0, len(read)) == expected
    tails = [x for x in small_mixture().pass_starts(0, 4 * n) if x[2] % n >= n - 90 and x[2] < 3 * n]
    assert tails   # passes that start in an unread tail: the run meets them at their first row it reads


def test_a_mixed_run_reports_each_source(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    """One process, 24 steps of 16 sequences over the sample's reference (weight 3) and docstrings (weight 1): each
    source's evaluation and the overall one; metrics.json's sequences and tokens per source within sampling noise of
    the weights, and the trackers' (TensorBoard's) at each log step; a line where the reference runs out; the [data]
    line."""
    out = tmp_path / "mix"
    final = run_in_process(tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.mixture": mixture(sample_dir),
        "data.max_train_samples": 60, "train.eval_every": 12, "logging.trackers": "[tensorboard]"}))
    printed = capsys.readouterr().out
    cfg = load_config(None, tiny_args(out, sample_dir, datasets_cache))
    seen = final["mixture"]
    positions = 24 * 16
    assert sum(s["sequences"] for s in seen.values()) == positions
    sizes = {name: int(n.replace(",", "")) for name, n in re.findall(r"(\w+) ([\d,]+) train / ", printed)}
    for name, weight in (("reference", 0.75), ("docstrings", 0.25)):
        share = seen[name]["sequences"] / positions
        assert seen[name]["target_share"] == weight
        # the run's positions fall in one block of 1000, whose slots are shuffled: a hypergeometric draw of
        # `positions` of them, 3 sigma about 0.05 here
        band = 3 * math.sqrt(weight * (1 - weight) / positions * (BLOCK - positions) / (BLOCK - 1))
        assert abs(share - weight) < band, (name, share, band)
        unweighted = sizes[name] / sum(sizes.values())   # the control: a sampler that ignored the weights
        assert abs(unweighted - weight) > band, (name, unweighted, band)
        assert seen[name]["tokens"] == seen[name]["sequences"] * cfg.data.max_seq_length   # packed: full blocks
        for key in ("eval_loss", "mlm_accuracy", "eval_samples"):
            assert key in final and f"{name}/{key}" in final
    assert final["eval_samples"] == final["reference/eval_samples"] + final["docstrings/eval_samples"]
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["final"]["mixture"] == seen and saved["config"]["data/mixture"].startswith("[{'name': 'reference'")
    evals = saved["history"]["eval"]
    assert [e["step"] for e in evals] == [12, 24] and all("docstrings/eval_loss" in e for e in evals)
    assert "[data] data.mixture: 2 sources, an epoch of" in printed
    assert "750 of each 1000 positions (target 75.0%" in printed
    ran_out = [line for line in printed.splitlines() if line.startswith("[data] source reference ran out")]
    assert ran_out and "its pass 2 starts at step" in ran_out[0]
    assert seen["reference"]["passes"] > 1
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(next((out / "logs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    for name in ("reference", "docstrings"):   # the trackers: tokens per source at each log step, growing to the final
        points = events.Scalars(f"train/tokens/{name}")
        assert [p.step for p in points] == [4, 8, 12, 16, 20, 24] and points[-1].value == seen[name]["tokens"]
        assert all(a.value < b.value for a, b in zip(points, points[1:]))


def test_bad_mixtures_are_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    reference = f"{sample_dir}/pretrain/reference.txt"
    cases = [
        ("[{name: a, files: [" + reference + "], weight: 0}]", {}, "data.mixture[0].weight=0.0 (source a) must be positive"),
        ("[{name: a, files: [" + reference + "]}, {name: a, files: [" + reference + "]}]", {},
         "data.mixture[1].name='a' names two sources"),
        ("[{name: a, files: []}]", {}, "data.mixture[0].files is empty"),
        ("[{name: '', files: [" + reference + "]}]", {}, "data.mixture[0].name=''"),
        ("[{name: a, file: [" + reference + "]}]", {}, "unknown key 'data.mixture[0].file'"),
        ("[a, b]", {}, "data.mixture[0]: expected a mapping of name, files, weight"),
        ("[]", {}, "data.mixture is an empty list"),
        ("[{name: a, files: [" + reference + "]}]", {"data.source": "sample"},
         "data.mixture samples pretraining sources by weight: it needs task.kind=mlm and data.source=files"),
        ("[{name: a, files: [" + reference + "]}]", {"data.source": "store", "data.store_dir": str(tmp_path)},
         "it needs task.kind=mlm and data.source=files (now task.kind=mlm, data.source=store)"),
        ("[{name: a, files: [" + reference + "]}]", {"data.train_files": f"[{reference}]"},
         "data.mixture and data.train_files / data.validation_files are both set"),
        ("[{name: a, files: [" + f"{sample_dir}/pretrain/nothing.txt" + "]}]", {},
         "data.mixture[0].files: data file not found"),
        ("[{name: a, files: [" + reference + "], dataset_name: " + str(tmp_path) + "}]", {},
         "data.mixture[0] (source a) gives both files and dataset_name"),
        ("[{name: a, files: [" + reference + "], split: train}]", {},
         "data.mixture[0].split (source a) is for a dataset source"),
        ("[{name: a, dataset_name: " + f"{tmp_path}/nowhere" + "}]", {},
         f"data.mixture[0].dataset_name={tmp_path}/nowhere: no such directory"),
    ]
    for given, extra, said in cases:
        argv = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
            "tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.mixture": given, **extra})]
        assert said in refused_in_process(argv, tmp_path, capsys), given
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("one short line of text\n" * 3)
    argv = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "data.source": "files",
        "data.mixture": f"[{{name: small, files: [{tiny}]}}, {{name: reference, files: [{reference}]}}]"})]
    assert "data.mixture: source small has no training sequence once tokenized" in refused_in_process(argv, tmp_path,
                                                                                                         capsys)


def test_the_pipeline_reads_the_same_mix(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """DeepSpeed's pipeline engine (2 stages, one replica) samples the same mix: each source gives it what it gives
    one process under DDP (the order is the recipe's, never the engine's), and it evaluates each source (its model, with
a dense head, is not DDP's: no loss compares). (Its resume
    seeks the sampler as without a mix: tests/test_backends.py.)"""
    from conftest import launch
    args = lambda name: tiny_args(tmp_path / name, sample_dir, datasets_cache, **{  # noqa: E731
        "tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.mixture": mixture(sample_dir),
        "data.max_train_samples": 60, "train.max_steps": 8})
    piped = launch(2, args("piped"), backend="pipeline")
    assert piped["final"]["num_processes"] == 2 and piped["final"]["backend"]["pipeline_stages"] == 2
    one = run_in_process(args("one"))
    assert one["mixture"] == piped["final"]["mixture"] and one["eval_samples"] == piped["final"]["eval_samples"]
    assert {"reference/eval_loss", "docstrings/eval_loss"} <= set(piped["final"])


def halting_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, sources: str):
    """-> args(name, **more): the overrides of an 8-step run of the mixture `sources` under tmp_path/name that saves at
    step 4, dropout off (a halt there and its resume end as the uninterrupted run)."""
    return lambda name, **more: tiny_args(tmp_path / name, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.mixture": sources,
        "data.max_train_samples": 80, "train.max_steps": 8, "checkpoint.save_every": 4,
        "model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0, **more})


def test_a_resume_reads_the_shards_each_source_read(tmp_path, sample_dir, datasets_cache, shared_tokenizer, capsys):
    """A source named by a pattern over gzip shards, halted at step 4; a shard added to it before the resume: the
    resume reads the source's first 3 shards, in their order, with one line, and ends as the uninterrupted run."""
    import gzip
    lines = (sample_dir / "pretrain/reference.txt").read_text().splitlines()[:240]
    (tmp_path / "shards").mkdir()
    for i in range(3):
        (tmp_path / f"shards/part-{i}.txt.gz").write_bytes(gzip.compress("\n".join(lines[i::3]).encode() + b"\n"))
    sources = (f"[{{name: shards, files: ['{tmp_path}/shards/*.txt.gz'], weight: 1}}, "
               f"{{name: docstrings, files: [{sample_dir}/pretrain/docstrings.txt], weight: 1}}]")
    args = halting_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, sources)
    full = run_in_process(args("full"))
    run_in_process(args("split", **{"train.halt_at_step": 4}))
    (tmp_path / "shards/part-3.txt.gz").write_bytes(gzip.compress(b"a shard added later\n" * 50))
    capsys.readouterr()
    resumed = run_in_process(args("split", **{"checkpoint.resume": "auto"}))
    printed = capsys.readouterr().out
    assert "[resume] data.mixture[0].files:" in printed and "the resume reads that run's 3 files" in printed, printed
    assert resumed["mixture"] == full["mixture"] and resumed["eval_loss"] == full["eval_loss"]


def test_a_dataset_source_mixes_with_files_and_resumes_exactly(tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                                                capsys):
    """A mixture source read as a dataset (dataset_name: a local directory datasets.load_dataset reads, its split)
    beside a file source: the run reports both; halted at step 4 and resumed, it ends as the uninterrupted run; a
    split it lacks is one line; its file rewritten (the same size) before a resume is one line naming it, and the
    run's checkpoints stay as they were."""
    lines = (sample_dir / "pretrain/reference.txt").read_text().splitlines()
    (tmp_path / "ds").mkdir()
    rows = [{"text": line} for line in lines if line.strip()][:200]
    (tmp_path / "ds/train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = (f"[{{name: ref, dataset_name: {tmp_path}/ds, weight: 1}}, "
               f"{{name: docstrings, files: [{sample_dir}/pretrain/docstrings.txt], weight: 1}}]")
    args = halting_run(tmp_path, sample_dir, datasets_cache, shared_tokenizer, sources)
    full = run_in_process(args("full"))
    assert {"ref/eval_loss", "docstrings/eval_loss"} <= set(full) and full["mixture"]["ref"]["sequences"] > 0
    run_in_process(args("split", **{"train.halt_at_step": 4}))
    resumed = run_in_process(args("split", **{"checkpoint.resume": "auto"}))
    assert resumed["mixture"] == full["mixture"] and resumed["eval_loss"] == full["eval_loss"]
    assert resumed["last_train_loss"] == full["last_train_loss"]
    missing = sources.replace("weight: 1}, ", "split: dev, weight: 1}, ", 1)
    said = refused_in_process([f"--{a}" for a in tiny_args(tmp_path / "dev", sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.mixture": missing})], tmp_path, capsys)
    assert "data.mixture[0].split='dev' (source ref) is not a split of" in said
    run_in_process(args("changed", **{"train.halt_at_step": 4}))
    data = (tmp_path / "ds/train.jsonl").read_bytes()
    (tmp_path / "ds/train.jsonl").write_bytes(data[:-3] + b"X" + data[-2:])   # one byte, the same size
    before = sorted(p.name for p in (tmp_path / "changed/checkpoints").iterdir())
    said = refused_in_process([f"--{a}" for a in args("changed", **{"checkpoint.resume": "auto"})], tmp_path / "changed",
                              capsys)
    assert f"data.mixture[0].dataset_name: {tmp_path}/ds/train.jsonl changed since" in said, said
    assert sorted(p.name for p in (tmp_path / "changed/checkpoints").iterdir()) == before
