"""Corpora as they ship (bert_recipes/data/files.py): sharded, compressed, named by a glob pattern, a directory or
a mix, resolved through datasets. The tokens equal those of the same text given as one plain file, on 1 and 2
processes; the resolved list is one line and the run's config; a resume reads its run's files; a pattern
that matches nothing, mixed formats, a corrupt .gz and a .zst without zstandard are one line each."""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import pytest
import yaml
import zstandard

from conftest import column, launch, refused_in_process, run_in_process, tiny_args

SHARDS = 4
NO_DROPOUT = {"model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0}


@pytest.fixture
def corpus(tmp_path, sample_dir) -> dict:
    """The sample's first 800 pretraining lines as one plain file, and cut in order into 4 compressed shards
    laid out for each form: all in shards/ (with a README that a directory skips); a mix: shards 0-1 in
    a/ (a directory), shard 2 in b/ (a pattern), shard 3 as c.txt.xz (a file); and JSON lines in zstd, as
    The Pile and SlimPajama ship ({"text": ...} per line, pile/*.jsonl.zst)."""
    lines = (sample_dir / "pretrain/train.txt").read_text().splitlines(keepends=True)[:800]
    (tmp_path / "one.txt").write_text("".join(lines))
    cut = [lines[i * len(lines) // SHARDS:(i + 1) * len(lines) // SHARDS] for i in range(SHARDS)]
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards/README.md").write_text("not data\n")
    for i, part in enumerate(cut):
        (tmp_path / f"shards/part-{i:05d}.txt.gz").write_bytes(gzip.compress("".join(part).encode()))
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
    for i in (0, 1):
        (tmp_path / f"a/part-{i:05d}.txt.bz2").write_bytes(bz2.compress("".join(cut[i]).encode()))
    (tmp_path / "b/part-00002.txt.gz").write_bytes(gzip.compress("".join(cut[2]).encode()))
    (tmp_path / "c.txt.xz").write_bytes(lzma.compress("".join(cut[3]).encode()))
    (tmp_path / "pile").mkdir()
    for i, part in enumerate(cut):
        rows = "".join(json.dumps({"text": line.rstrip("\n"), "meta": {"shard": i}}) + "\n" for line in part)
        (tmp_path / f"pile/{i:02d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))
    return {"one file": [tmp_path / "one.txt"], "pattern": [tmp_path / "shards/part-*.txt.gz"],
            "directory": [tmp_path / "shards"], "mix": [tmp_path / "a", tmp_path / "b/*.gz", tmp_path / "c.txt.xz"],
            "jsonl.zst": [tmp_path / "pile/*.jsonl.zst"]}


def files_arg(entries) -> str:
    return "[" + ", ".join(map(str, entries)) + "]"


def test_every_form_gives_the_tokens_of_the_plain_file(corpus, datasets_cache, shared_tokenizer, capsys):
    """In process, the data path train.py takes (preflight's resolution, then load_raw and tokenize): every
    split's token ids equal the plain file's, and datasets' cache key follows the files, not the text."""
    from transformers import AutoTokenizer

    from bert_recipes.config import Config
    from bert_recipes.data.files import resolve_into
    from bert_recipes.data.sources import load_raw
    from bert_recipes.tasks.mlm import tokenize

    tokenizer = AutoTokenizer.from_pretrained(shared_tokenizer)
    got, fingerprints = {}, {}
    for form, entries in corpus.items():
        cfg = Config()
        cfg.data.source, cfg.data.train_files, cfg.data.cache_dir = "files", list(map(str, entries)), str(datasets_cache)
        cfg.data.max_seq_length = 32
        notes = resolve_into(cfg.data)
        assert len(notes) == 1 and notes[0].startswith(f"[data] data.train_files: {1 if form == 'one file' else 4} file")
        raw = load_raw(cfg.data, cfg.task, seed=0)
        fingerprints[form] = raw["train"]._fingerprint
        data = tokenize(raw, tokenizer, cfg.task, cfg.data)
        got[form] = {split: column(data[split], "input_ids") for split in ("train", "eval")}
    for form in ("pattern", "directory", "mix", "jsonl.zst"):
        assert got[form] == got["one file"], form
    assert len(got["one file"]["train"]) > 200
    # pattern and directory name the same files: one cache entry; the resolved files are the key
    assert fingerprints["pattern"] == fingerprints["directory"] != fingerprints["one file"]


def test_one_and_two_processes_train_on_the_shards_as_on_the_plain_file(corpus, tmp_path, sample_dir, datasets_cache,
                                                                       shared_tokenizer, capsys):
    """One process: the plain file, and the pattern halted at step 3 then resumed after a shard was added (the
    resume reads its run's 4 files, with one line): equal losses. Two processes (gloo, a real launcher): the mix,
    within all-reduce's reordering of sums of the one-process run."""
    common = {**NO_DROPOUT, "tokenizer.name_or_path": shared_tokenizer, "data.source": "files",
              "train.max_steps": 6, "logging.log_every": 3, "checkpoint.save_every": 3}

    def args(name, form, **extra):
        return tiny_args(tmp_path / name, sample_dir, datasets_cache,
                         **{**common, "data.train_files": files_arg(corpus[form]), **extra})

    run_in_process(args("one", "one file"))
    one = json.loads((tmp_path / "one/metrics.json").read_text())["history"]
    capsys.readouterr()

    run_in_process(args("pattern", "pattern", **{"train.halt_at_step": 3}))
    log = capsys.readouterr().out
    line = next(x for x in log.splitlines() if x.startswith("[data] data.train_files:"))
    assert "4 files" in line and "part-00000.txt.gz ... " in line and line.endswith("written into the run's config)")
    saved = yaml.safe_load((tmp_path / "pattern/checkpoints/step_00000003/config.yaml").read_text())
    assert saved["data"]["train_files"] == [str(tmp_path / f"shards/part-{i:05d}.txt.gz") for i in range(SHARDS)]
    (tmp_path / "shards/part-00004.txt.gz").write_bytes(gzip.compress(b"a shard added later\n" * 50))
    run_in_process(args("pattern", "pattern", **{"checkpoint.resume": "auto"}))
    log = capsys.readouterr().out
    assert "[resume] data.train_files:" in log and "part-00004.txt.gz): the resume reads that run's 4 files" in log
    assert "the config differs" not in log, log
    pattern = json.loads((tmp_path / "pattern/metrics.json").read_text())["history"]
    assert [h["loss"] for h in pattern["train"]] == pytest.approx([h["loss"] for h in one["train"]], abs=1e-5)
    assert pattern["eval"][-1]["eval_loss"] == pytest.approx(one["eval"][-1]["eval_loss"], abs=1e-5)

    two = launch(2, args("two", "mix"))
    assert two["final"]["num_processes"] == 2 and two["final"]["distributed_type"] == "DistributedType.MULTI_CPU"
    assert two["final"]["rank_checksums"][0] == two["final"]["rank_checksums"][1]
    assert two["config"]["data/train_files"].endswith(f"'{tmp_path / 'c.txt.xz'}']")   # the resolved list
    for a, b in zip(two["history"]["train"], one["train"]):
        assert a["step"] == b["step"] and a["loss"] == pytest.approx(b["loss"], abs=1e-4)
    assert two["history"]["eval"][-1]["eval_loss"] == pytest.approx(one["eval"][-1]["eval_loss"], abs=1e-4)
    assert (tmp_path / "two.log").read_text().count("[data] data.train_files: 4 files") == 1   # rank 0 says it


def _no_match(tmp_path: Path, corpus) -> tuple[list, str]:
    pattern = tmp_path / "shards/*.jsonl.gz"
    return [pattern], f"data.train_files: the pattern {pattern} matches no data file"


def _mixed(tmp_path: Path, corpus) -> tuple[list, str]:
    (tmp_path / "rows.jsonl").write_text('{"text": "a row"}\n' * 20)
    return [tmp_path / "shards", tmp_path / "rows.jsonl"], "data files of different formats in one run (json: 1 file"


def _corrupt(tmp_path: Path, corpus) -> tuple[list, str]:
    """A shard cut off halfway, as a failed copy leaves it: the line names it and where its text breaks."""
    text = "".join(f"line {i} of a longer shard, {i * 7919 % 10007} {i * 104729 % 7}\n" for i in range(40000)).encode()
    whole = gzip.compress(text)
    (tmp_path / "shards/part-00002.txt.gz").write_bytes(whole[:len(whole) // 2])
    with gzip.open(tmp_path / "shards/part-00002.txt.gz") as f:   # what decompresses in 64 KiB reads
        good = 0
        try:
            while chunk := f.read(1 << 16):
                good += len(chunk)
        except EOFError:
            pass
    assert good > 0
    line = text[:good].count(b"\n") + 1
    return [tmp_path / "shards"], (f"data.train_files: {tmp_path / 'shards/part-00002.txt.gz'} is a corrupt gzip "
                                   "file (EOFError: Compressed file ended before the end-of-stream marker was reached), "
                                   f"in its decompressed bytes from {good} on (line {line})")


@pytest.mark.parametrize("build", [_no_match, _mixed, _corrupt], ids=["no match", "mixed formats", "corrupt gz"])
def test_a_corpus_that_cannot_be_read_is_one_line(build, corpus, tmp_path, sample_dir, datasets_cache,
                                                  shared_tokenizer, capsys):
    entries, expected = build(tmp_path, corpus)
    out = tmp_path / "out"
    argv = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.train_files": files_arg(entries)})]
    line = refused_in_process(argv, out, capsys)
    assert expected in line, line
    assert not out.exists()


def test_zst_without_zstandard_is_one_line(corpus, tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                          monkeypatch, capsys):
    """An installation without zstandard (requirements.txt has it; a hand-made environment may not): train.py,
    in process, with the package made unfindable, refuses the .zst shards in one line naming the package."""
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "zstandard" else find_spec(name, *a))
    out = tmp_path / "out"
    argv = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "data.source": "files",
        "data.train_files": files_arg(corpus["jsonl.zst"])})]
    line = refused_in_process(argv, out, capsys)
    assert f"data file {tmp_path / 'pile/00.jsonl.zst'}: reading zstd needs the zstandard package" in line, line
    assert "pip install zstandard, or decompress the file" in line, line
    assert not out.exists()


def test_under_two_processes_a_corrupt_shard_is_one_line_from_rank_0(corpus, tmp_path, sample_dir, datasets_cache,
                                                                     shared_tokenizer):
    """The corrupt file is found where rank 0 reads the data (the others wait for it): one line in the job's
    log, every rank exits 2, no traceback from train.py, no output directory."""
    from conftest import REPO, launch_script
    entries, expected = _corrupt(tmp_path, corpus)
    out = tmp_path / "out"
    args = [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **{
        "tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.train_files": files_arg(entries)})]
    log = launch_script("train.py", args, 2, check=False)
    assert log.count("config error:") == 1 and expected in log, log[-3000:]
    assert "exitcode  : 2" in log and f'File "{REPO / "train.py"}"' not in log, log[-3000:]
    assert not out.exists()
