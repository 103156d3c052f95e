"""A resume's data files against those its checkpoint recorded (checkpoint.data_record, check_data_fits): each
file's size and a digest of sampled blocks (files.sampled_digest). A file rewritten in place since the halt is one
line naming the key, the file and what changed, with nothing written; checkpoint.accept_data_change=true resumes,
saying so; a checkpoint from before the record resumes as before. (A file a pattern added is
tests/test_mixture.py's: the resume reads the checkpoint's own files.)"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from bert_recipes.checkpoint import data_changes
from bert_recipes.data.files import BLOCK_BYTES, SAMPLED_BLOCKS, SAMPLING, data_fingerprint, sampled_digest
from conftest import refused_in_process, run_cli_in_process, run_in_process, tiny_args


def argv(out: Path, sample_dir, datasets_cache, **extra) -> list[str]:
    return [f"--{a}" for a in tiny_args(out, sample_dir, datasets_cache, **extra)]


# ----------------------------------------------------------------------------- the fingerprint
def test_a_sampled_block_changes_the_digest_and_a_touch_does_not(tmp_path):
    """1 MiB of bytes: one byte changed in the first, a middle or the last sampled block, the size the same, gives
    another digest; a new modification time alone (os.utime: a node-local copy has its own) gives the same. The
    positive control of the sample's limit: a byte between two sampled blocks goes unseen (a sample, not a pass)."""
    import random
    path = tmp_path / "shard.bin"
    data = bytearray(random.Random(0).randbytes(1 << 20))
    path.write_bytes(data)
    size, digest = sampled_digest(str(path))
    assert size == 1 << 20
    step = (size - BLOCK_BYTES) // (SAMPLED_BLOCKS - 1)   # the blocks' starts: 0, step, 2 step, ..., size - 4 KiB
    for offset in (0, 3 * step + 100, size - 1):
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(changed)
        now = sampled_digest(str(path))
        assert now[0] == size and now[1] != digest, offset
    path.write_bytes(data)
    os.utime(path, (1_000_000_000, 1_000_000_000))
    assert sampled_digest(str(path)) == (size, digest)
    between = bytearray(data)
    between[BLOCK_BYTES + (step - BLOCK_BYTES) // 2] ^= 0xFF   # after the first block, before the second
    path.write_bytes(between)
    assert sampled_digest(str(path)) == (size, digest)
    small = tmp_path / "small.txt"   # up to 32 KiB a file is read whole: any byte counts
    small.write_bytes(b"x" * 20000)
    before = sampled_digest(str(small))
    small.write_bytes(b"x" * 9000 + b"y" + b"x" * 10999)
    assert sampled_digest(str(small))[1] != before[1]


def test_a_copy_elsewhere_is_the_same_file_and_a_lost_one_is_named(tmp_path):
    """data_changes: the same bytes under another path (a node's own copy, a moved store) is no change; another file
    named while the first is still on the disk is a list edited on purpose (the config's own line); one file gone
    from the disk with another in its place is named with both; a file gone is named; a list the run no longer
    reads is the config's."""
    for name, text in (("a.txt", "alpha\n"), ("b.txt", "beta\n"), ("c.txt", "gamma gamma\n")):
        (tmp_path / name).write_text(text)
    a, b, c = (str(tmp_path / n) for n in ("a.txt", "b.txt", "c.txt"))
    record = lambda **lists: {"sampling": SAMPLING, "files": data_fingerprint(lists)}   # noqa: E731
    saved = record(**{"data.train_files": [a, b], "data.validation_files": [b]})
    shutil.copy(a, tmp_path / "copy.txt")
    moved = record(**{"data.train_files": [str(tmp_path / "copy.txt"), b]})
    assert data_changes(saved, moved, "step_00000004") == []
    assert data_changes(saved, record(**{"data.train_files": [c, b]}), "step_00000004") == []   # named on purpose
    os.remove(a)
    replaced = data_changes(saved, record(**{"data.train_files": [c, b]}), "step_00000004")
    assert replaced == [f"data.train_files: {a} changed since step_00000004: this run reads {c} in its place "
                        "(size 6 -> 12 bytes)"]
    assert data_changes(saved, record(**{"data.train_files": [b]}), "step_00000004") == [
        f"data.train_files: {a} is gone since step_00000004 (no such file now)"]
    other = {"sampling": "another sampling", "files": saved["files"]}   # digests of another sampling: sizes only
    assert data_changes(other, record(**{"data.train_files": [b], "data.validation_files": [b]}), "s") == [
        f"data.train_files: {a} is gone since s (no such file now)"]


def test_a_prepared_store_is_recorded_by_its_manifest(tmp_path):
    """data.source=prepared: the store's prepared.json (make prepare writes it anew each time, with its counts and
    timings) is what the checkpoint records; the store prepared again is named, a copy of it elsewhere is the same."""
    from bert_recipes.checkpoint import data_record
    from bert_recipes.config import DataConfig
    store = tmp_path / "prepared"
    store.mkdir()
    (store / "prepared.json").write_text(json.dumps({"splits": {"train": 388}, "seconds": {"total": 4.1}}))
    data = DataConfig(source="prepared", prepared_dir=str(store))
    saved = data_record(data)
    assert list(saved["files"]) == ["data.prepared_dir"] and saved["sampling"] == SAMPLING
    assert data_record(DataConfig(source="sample")) == {}   # the sample and the Hub record none
    shutil.copytree(store, tmp_path / "copy")
    copy = DataConfig(source="prepared", prepared_dir=str(tmp_path / "copy"))
    assert data_changes(saved, data_record(copy), "s") == []
    (store / "prepared.json").write_text(json.dumps({"splits": {"train": 390}, "seconds": {"total": 4.3}}))
    assert data_changes(saved, data_record(data), "step_00000004") == [
        f"data.prepared_dir: {store}/prepared.json changed since step_00000004 (the same size, 53 bytes, other "
        "bytes in its sampled blocks)"]


# ----------------------------------------------------------------------------- a resume
def two_sources(tmp_path: Path, sample_dir: Path) -> tuple[str, Path]:
    """data.mixture over copies of the sample's two texts (the session's sample stays as it is). -> (the mixture,
    the second source's file)."""
    (tmp_path / "corpus").mkdir()
    for name in ("reference", "docstrings"):
        shutil.copy(sample_dir / f"pretrain/{name}.txt", tmp_path / f"corpus/{name}.txt")
    return (f"[{{name: reference, files: [{tmp_path}/corpus/reference.txt], weight: 3}}, "
            f"{{name: docstrings, files: [{tmp_path}/corpus/docstrings.txt], weight: 1}}]",
            tmp_path / "corpus/docstrings.txt")


def test_a_source_rewritten_in_place_is_one_line_and_the_override_resumes(tmp_path, sample_dir, datasets_cache,
                                                                          shared_tokenizer, capsys):
    """Two sources, halted at step 4; the second source's file replaced by another text at the same path: the resume
    is one line naming the source, the file and the sizes, and writes nothing. With checkpoint.accept_data_change=true
    it resumes on the new text, says so in a [resume] line, finishes, and its checkpoint records the new file."""
    sources, rewritten = two_sources(tmp_path, sample_dir)
    out = tmp_path / "run"
    common = {"tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.mixture": sources,
              "data.max_train_samples": 60, "train.max_steps": 8, "checkpoint.export": False}
    run_in_process(tiny_args(out, sample_dir, datasets_cache, **common, **{"train.halt_at_step": 4}))
    size_before = rewritten.stat().st_size
    lines = (sample_dir / "pretrain/reference.txt").read_text().splitlines()
    rewritten.write_text("\n".join(reversed(lines[:300])) + "\n")   # another text, the same path
    size_now = rewritten.stat().st_size
    assert size_now != size_before
    line = refused_in_process(argv(out, sample_dir, datasets_cache, **common, **{"checkpoint.resume": "auto"}), out,
                              capsys)
    assert line == (f"config error: data.mixture[1].files: {rewritten} changed since step_00000004 (size {size_before} "
                    f"-> {size_now} bytes): the resumed run would read other data than {out}/checkpoints/step_00000004 "
                    "was trained on; restore the file, start a new run (another run.output_dir), or set "
                    "checkpoint.accept_data_change=true to go on knowingly"), line
    code, printed = run_cli_in_process(argv(out, sample_dir, datasets_cache, **common, **{
        "checkpoint.resume": "auto", "checkpoint.accept_data_change": True}), capsys, stdout_too=True)
    assert code == 0, printed[-3000:]
    said = [row for row in printed.splitlines() if "accept_data_change=true:" in row]
    assert said == [f"[resume] checkpoint.accept_data_change=true: data.mixture[1].files: {rewritten} changed since "
                    f"step_00000004 (size {size_before} -> {size_now} bytes); the run goes on with the data as it is "
                    "now"], printed[-3000:]
    assert "accept_data_change: False -> True" not in printed   # the override steers this resume, not the run
    assert json.loads((out / "metrics.json").read_text())["final"]["steps"] == 8
    state = json.loads((out / "checkpoints/step_00000008/train_state.json").read_text())
    assert state["data_files"]["files"]["data.mixture[1].files"] == [[str(rewritten), size_now,
                                                                       sampled_digest(str(rewritten))[1]]]


def test_train_files_rewritten_at_the_same_size_is_one_line(tmp_path, sample_dir, datasets_cache, shared_tokenizer,
                                                            capsys):
    """data.train_files, one file, halted at step 4; its text rewritten at the same size (each line reversed): only
    the sampled blocks tell, and the resume is one line saying so, nothing written. A checkpoint from before the
    record (its data_files removed) resumes as before, without a word about the data."""
    corpus = tmp_path / "train.txt"
    lines = (sample_dir / "pretrain/reference.txt").read_text().splitlines()[:400]
    corpus.write_text("\n".join(lines) + "\n")
    out = tmp_path / "run"
    common = {"tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.train_files": f"[{corpus}]",
              "train.max_steps": 8, "checkpoint.export": False, "data.max_train_samples": 120}
    run_in_process(tiny_args(out, sample_dir, datasets_cache, **common, **{"train.halt_at_step": 4}))
    size = corpus.stat().st_size
    corpus.write_text("\n".join(line[::-1] for line in lines) + "\n")
    assert corpus.stat().st_size == size
    line = refused_in_process(argv(out, sample_dir, datasets_cache, **common, **{"checkpoint.resume": "auto"}), out,
                              capsys)
    assert line.startswith(f"config error: data.train_files: {corpus} changed since step_00000004 (the same size, "
                           f"{size} bytes, other bytes in its sampled blocks): the resumed run would read other "
                           "data"), line
    state_file = out / "checkpoints/step_00000004/train_state.json"
    state = json.loads(state_file.read_text())
    del state["data_files"]
    state_file.write_text(json.dumps(state))
    code, printed = run_cli_in_process(argv(out, sample_dir, datasets_cache, **common, **{
        "checkpoint.resume": "auto"}), capsys, stdout_too=True)
    assert code == 0 and "[resume] from" in printed, printed[-3000:]
    assert "changed since" not in printed and "accept_data_change" not in printed, printed[-3000:]


def test_under_two_processes_the_line_comes_once_from_rank_0(tmp_path, sample_dir, datasets_cache, shared_tokenizer):
    """Rank 0 reads the sampled blocks and compares them; the other rank raises what it says: a 2-process resume of
    a run (halted on one) whose source was rewritten at the same size is one line in the job's log, the job exits 2
    with no traceback of train.py's, and nothing is written."""
    from conftest import REPO, launch_script, snapshot
    sources, rewritten = two_sources(tmp_path, sample_dir)
    out = tmp_path / "run"
    common = {"tokenizer.name_or_path": shared_tokenizer, "data.source": "files", "data.mixture": sources,
              "data.max_train_samples": 60, "train.max_steps": 8, "checkpoint.export": False}
    run_in_process(tiny_args(out, sample_dir, datasets_cache, **common, **{"train.halt_at_step": 4}))
    rewritten.write_text(rewritten.read_text().upper())   # the same size, other bytes
    before = snapshot(out)
    log = launch_script("train.py", argv(out, sample_dir, datasets_cache, **common, **{"checkpoint.resume": "auto"}),
                        2, check=False)
    assert log.count("config error:") == 1, log[-3000:]
    assert f"config error: data.mixture[1].files: {rewritten} changed since step_00000004 (the same size" in log
    assert "exitcode  : 2" in log and f'File "{REPO / "train.py"}"' not in log, log[-3000:]   # no traceback of ours
    assert snapshot(out) == before
