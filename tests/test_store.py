"""The token store (data.source=store, bert_recipes/data/store.py): `make prepare STORE=1` tokenizes a FineWeb-shaped
tree of parquet shards with datatrove on 2 worker processes into flat token files whose ids are the tokenizer's own
for every document, cuts a document of megabytes into pieces, checks the disk first, and finishes a preparation killed
with SIGKILL with the same bytes as an uninterrupted one; training memory-maps it, and a halt on 2 processes resumed
on 1 ends as the uninterrupted run; a wrong store is one line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, assert_same_weights, launch, refused_in_process, run_in_process, tiny_args

TOL = 1e-5   # fp32, dropout off: another process count sums in another order
LONG = 2_300_000   # characters of one document: cut into 24 to 46 pieces (store_writer.LONGEST_DOCUMENT_CHARS: 100,000)


def parquet_tree(root: Path, sample_dir: Path, shards: int = 3, long_document: bool = True) -> list[Path]:
    """data/CC-MAIN-*/000_0000N.parquet as FineWeb ships it: a text column among others, documents of several lines
    of the sample; the last shard ends with one document of LONG characters on one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    lines = [line for line in (sample_dir / "pretrain/reference.txt").read_text().splitlines() if line.strip()]
    documents = [" ".join(lines[i:i + 5]) for i in range(0, len(lines), 5)]
    paths = []
    for shard in range(shards):
        texts = documents[shard::shards]
        if long_document and shard == shards - 1:
            texts = texts + [(" ".join(lines) + " ") * (LONG // len(" ".join(lines)) + 1)][:1]
            texts[-1] = texts[-1][:LONG]
        table = pa.table({"text": texts, "id": [f"<urn:{shard}:{i}>" for i in range(len(texts))],
                          "dump": [f"CC-MAIN-2024-1{shard % 2}"] * len(texts), "token_count": [0] * len(texts)})
        path = root / f"data/CC-MAIN-2024-1{shard % 2}/000_0000{shard}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, path)
        paths.append(path)
    return paths


def prepare(out: Path, files, tokenizer, workers: int = 2, extra=(), **popen):
    """tools/prepare.py --store in a process of its own: the CompletedProcess, or the Popen where `popen` is given."""
    argv = [sys.executable, "tools/prepare.py", "--recipe", "recipes/tiny-mlm.yaml", "--out", str(out), "--store",
            "--workers", str(workers), "--data.source=files", f"--data.train_files=[{','.join(map(str, files))}]",
            f"--tokenizer.name_or_path={tokenizer}", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if popen:
        return subprocess.Popen(argv, cwd=REPO, env=env, **popen)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def store(tmp_path_factory, sample_dir, shared_tokenizer):
    """A store of the parquet tree, prepared on 2 worker processes. -> (its directory, the input files)."""
    root = tmp_path_factory.mktemp("store")
    files = parquet_tree(root, sample_dir)
    done = prepare(root / "store", files, shared_tokenizer)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[prepare]" in done.stdout and "a token store of" in done.stdout
    return root / "store", files


def test_a_store_holds_the_tokenizers_ids_for_every_document(store, shared_tokenizer):
    """Each shard is its input file's documents in order, each as the tokenizer itself encodes it ([CLS] ... [SEP]),
    in uint16 with each document's end in the index; the manifest counts them; the document of LONG characters is
    cut at spaces into pieces of at most LONGEST_DOCUMENT_CHARS whose words are the whole document's."""
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer
    root, files = store
    tokenizer = AutoTokenizer.from_pretrained(shared_tokenizer)
    meta = json.loads((root / "store.json").read_text())
    assert meta["dtype"] == "uint16" and len(meta["shards"]) == 3 and meta["text_column"] == "text"
    for shard, path in zip(meta["shards"], files):
        assert shard["input"] == str(path) and shard["input_bytes"] == path.stat().st_size
        tokens = np.fromfile(root / shard["file"], dtype="<u2")
        ends = np.fromfile(root / f"{shard['file']}.index", dtype="<u8")
        assert (shard["tokens"], shard["documents"]) == (len(tokens), len(ends)) and ends[-1] == len(tokens)
        texts = pq.read_table(path, columns=["text"])["text"].to_pylist()
        short = [t for t in texts if len(t) < LONG]
        expected = [i for t in short for i in tokenizer(t)["input_ids"]]
        assert tokens[:len(expected)].tolist() == expected
    last = np.fromfile(root / meta["shards"][-1]["file"], dtype="<u2")
    ends = np.fromfile(root / f"{meta['shards'][-1]['file']}.index", dtype="<u8")
    cut = meta["shards"][-1]["documents"] - len(short)   # the long document's pieces
    assert LONG / 100_000 <= cut <= 2 * LONG / 100_000, cut
    pieces = [last[a:b] for a, b in zip(ends[-cut - 1:-1], ends[-cut:])]
    words = [i for p in pieces for i in p[1:-1].tolist()]   # each piece without its [CLS] and [SEP]
    whole = pq.read_table(files[-1], columns=["text"])["text"].to_pylist()[-1]
    assert words == tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert meta["tokens"] == sum(s["tokens"] for s in meta["shards"]) and meta["vocabulary"]


def test_a_killed_preparation_finishes_with_the_same_bytes(tmp_path, sample_dir, shared_tokenizer):
    """8 shards on 1 worker, killed with SIGKILL once 2 are done: no manifest; run again, it skips the finished
    tasks and its files are byte for byte those of an uninterrupted preparation."""
    files = parquet_tree(tmp_path, sample_dir, shards=8, long_document=False)
    proc = prepare(tmp_path / "cut", files, shared_tokenizer, workers=1, start_new_session=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    done = tmp_path / "cut/logs/completions"
    deadline = time.time() + 120
    while time.time() < deadline and not (done.is_dir() and len(list(done.iterdir())) >= 2):
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = len(list(done.iterdir()))
    assert 2 <= finished < 8 and not (tmp_path / "cut/store.json").exists(), finished
    again = prepare(tmp_path / "cut", files, shared_tokenizer, workers=1)
    assert again.returncode == 0, again.stderr[-3000:]
    whole = prepare(tmp_path / "whole", files, shared_tokenizer, workers=1)
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut, full = (sorted((tmp_path / d / "tokens").iterdir()) for d in ("cut", "whole"))
    assert [p.name for p in cut] == [p.name for p in full] and len(cut) == 16
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(cut, full))
    meta = [json.loads((tmp_path / d / "store.json").read_text()) for d in ("cut", "whole")]
    assert meta[0]["shards"] == meta[1]["shards"]


def test_a_run_trains_from_the_store_and_resumes_on_another_process_count(tmp_path, store, sample_dir,
                                                                           datasets_cache):
    """DDP on 2 processes from the store, documents apart (data.document_mask): the loss goes down; halted at step 4
    and resumed on 1 process, and halted on 1 and resumed on 2, each ends with the uninterrupted run's weights within
    1e-5. DeepSpeed's pipeline (2
    stages) trains from it too, through the store's order."""
    root, _ = store
    args = lambda out, **more: tiny_args(out, sample_dir, datasets_cache, **{  # noqa: E731
        "data.source": "store", "data.store_dir": str(root), "data.document_mask": True, "train.max_steps": 8,
        "checkpoint.save_every": 4, "model.hidden_dropout_prob": 0.0, "model.attention_probs_dropout_prob": 0.0,
        "data.max_train_samples": 400, **more})
    full = launch(2, args(tmp_path / "full"))
    assert full["final"]["num_processes"] == 2 and full["final"]["backend"]["name"] == "ddp"
    losses = [row["loss"] for row in full["history"]["train"]]
    assert losses[-1] < losses[0]
    launch(2, args(tmp_path / "split", **{"train.halt_at_step": 4}))
    one = launch(1, args(tmp_path / "split", **{"checkpoint.resume": "auto"}))
    assert one["final"]["num_processes"] == 1 and one["final"]["steps"] == 8
    assert_same_weights(tmp_path / "full/model/model.safetensors", tmp_path / "split/model/model.safetensors", TOL)
    launch(1, args(tmp_path / "grown", **{"train.halt_at_step": 4}))
    two = launch(2, args(tmp_path / "grown", **{"checkpoint.resume": "auto"}))
    assert two["final"]["num_processes"] == 2 and two["final"]["steps"] == 8
    assert_same_weights(tmp_path / "full/model/model.safetensors", tmp_path / "grown/model/model.safetensors", TOL)
    piped = launch(2, args(tmp_path / "piped", **{"data.document_mask": False}), backend="pipeline")   # its own order
    assert piped["final"]["num_processes"] == 2 and piped["final"]["backend"]["pipeline_stages"] == 2
    assert piped["final"]["steps"] == 8 and np.isfinite(piped["final"]["eval_loss"])


def test_a_wrong_store_is_one_line(tmp_path, store, sample_dir, datasets_cache, shared_tokenizer, capsys, tmpfs):
    """A store_dir without a manifest (a preparation cut off), a store that changed under a resume, a preparation
    started again with other files, and a disk too small for the estimate: each one line, nothing written."""
    root, files = store
    (tmp_path / "cut").mkdir()
    said = refused_in_process([f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{
        "data.source": "store", "data.store_dir": str(tmp_path / "cut")})], tmp_path, capsys)
    assert f"data.store_dir={tmp_path / 'cut'} holds no token store (store.json missing" in said
    copy = tmp_path / "copy"
    copy.mkdir()
    for item in ("store.json", "tokenizer", "tokens"):
        os.symlink(root / item, copy / item)
    args = lambda **more: tiny_args(tmp_path / "run", sample_dir, datasets_cache, **{  # noqa: E731
        "data.source": "store", "data.store_dir": str(copy), "train.max_steps": 4, "checkpoint.save_every": 2, **more})
    run_in_process(args(**{"train.halt_at_step": 2}))
    (copy / "store.json").unlink()
    meta = json.loads((root / "store.json").read_text())
    (copy / "store.json").write_text(json.dumps({**meta, "documents": meta["documents"] + 1}))
    said = refused_in_process([f"--{a}" for a in args(**{"checkpoint.resume": "auto"})], tmp_path / "run", capsys)
    assert f"data.store_dir: {copy}/store.json changed since step_00000002" in said, said
    other = prepare(root, files[:2], shared_tokenizer)
    assert other.returncode == 2 and "holds a preparation of other files or with another tokenizer" in other.stderr
    small = tmpfs(64 * 1024)
    before = sorted(small.iterdir())
    full = prepare(small / "store", files, shared_tokenizer)
    assert full.returncode == 2 and f"--out {small / 'store'}: " in full.stderr and "GB free" in full.stderr
    assert sorted(small.iterdir()) == before


def test_the_stores_order_is_computed_from_the_position():
    """The training order over a store's blocks (batching.PermutedOrder): each epoch every block once, in an order
    of its own that a seed fixes; position k of an epoch computed alone equals the k-th row of the whole epoch (a
    resume seeks); the sampler holds no list of the blocks. Control: another seed gives another order."""
    import tracemalloc

    from bert_recipes.data.batching import PermutedOrder
    for n in (1, 2, 7, 1000, 65537):
        assert sorted(PermutedOrder(n, 3)) == list(range(n)), n
    order = PermutedOrder(5000, 3)
    first = list(order)
    order.set_epoch(1)
    second = list(order)
    assert first != second and sorted(second) == list(range(5000))
    order.set_epoch(0)
    assert order.permute(np.arange(2500, 2600)).tolist() == first[2500:2600]
    assert list(PermutedOrder(5000, 3)) == first and list(PermutedOrder(5000, 4)) != first
    tracemalloc.start()
    big = PermutedOrder(20_000_000, 3)
    head = [i for _, i in zip(range(100_000), big)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(set(head)) == len(head) and peak < 16 * 2 ** 20, peak   # a randperm list: 0.8 GB


def test_parts_of_a_preparation_write_one_store(tmp_path, store, shared_tokenizer):
    """--part j --parts 2 (a SLURM array's tasks: slurm/prepare.sbatch) into one directory: the first part leaves
    no manifest, the second writes it, and the files are byte for byte those of one preparation of them all."""
    root, files = store
    first = prepare(tmp_path / "parts", files, shared_tokenizer, workers=1, extra=["--part", "0", "--parts", "2"])
    assert first.returncode == 0 and "part 0 of 2" in first.stdout and not (tmp_path / "parts/store.json").exists()
    second = prepare(tmp_path / "parts", files, shared_tokenizer, workers=1, extra=["--part", "1", "--parts", "2"])
    assert second.returncode == 0 and "a token store of" in second.stdout, second.stderr[-2000:]
    for name in ("00000_unshuffled.ds", "00001_unshuffled.ds.index", "00002_unshuffled.ds"):
        assert (tmp_path / "parts/tokens" / name).read_bytes() == (root / "tokens" / name).read_bytes()
    assert json.loads((tmp_path / "parts/store.json").read_text())["shards"] == json.loads(
        (root / "store.json").read_text())["shards"]


def test_a_run_makes_its_own_store_on_first_use_and_the_next_run_reads_it(tmp_path, sample_dir, shared_tokenizer):
    """Packed MLM from the sample (datasets reads the text): make prepare (tools/prepare.py, no --store) writes the
    run's token stores into the cache it is given, one a split, and datasets' cache holds no tokenized or packed copy;
    a run with that data.cache_dir trains from them without writing another. Its blocks are the tokenizer's ids of the
    sample's lines in order, and a batched read (Indexed.__getitems__) gives the rows one by one reads do, documents
    included. Control: another tokenizer makes stores of its own."""
    from transformers import AutoTokenizer

    from bert_recipes.data.batching import Indexed
    from bert_recipes.data.store import StoreBlocks, TokenStore
    cache = tmp_path / "cache"
    given = [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, cache, **{
        "tokenizer.name_or_path": str(shared_tokenizer), "train.max_steps": 4, "data.max_train_samples": 300})]
    done = subprocess.run([sys.executable, "tools/prepare.py", "--recipe", "recipes/tiny-mlm.yaml", "--out", str(cache),
                           *given], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    assert done.returncode == 0 and "token stores of train (" in done.stdout, done.stderr[-3000:]
    stores = sorted((cache / "bert_recipes_stores").glob("*/store.json"))
    assert len(stores) == 2 and not list(cache.rglob("cache-*.arrow"))   # train and eval; no map's copy
    written = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    metrics = run_in_process([a.removeprefix("--") for a in given])
    assert metrics["steps"] == 4 and np.isfinite(metrics["eval_loss"])
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file() and p in written} == written
    assert sorted((cache / "bert_recipes_stores").glob("*/store.json")) == stores
    tokenizer = AutoTokenizer.from_pretrained(shared_tokenizer)
    lines = [t for t in (sample_dir / "pretrain/train.txt").read_text().splitlines()[:300] if t.strip()]
    ids = [i for t in lines for i in tokenizer(t)["input_ids"]]
    train = next(TokenStore(p.parent) for p in stores if TokenStore(p.parent).meta["documents"] == len(lines))
    blocks = StoreBlocks(train, 32, tokenizer.all_special_ids, documents=True)
    assert len(blocks) == len(ids) // 32 and blocks[3]["input_ids"].tolist() == ids[96:128]
    picked = [5, 0, len(blocks) - 1, 5, 17]
    batched = Indexed(blocks).__getitems__(picked)
    for row, i in zip(batched, picked):
        one = blocks[i]
        assert row["idx"] == i and all(np.array_equal(row[k], one[k]) for k in one)
    ends = np.cumsum([len(tokenizer(t)["input_ids"]) for t in lines])
    starts = np.searchsorted(ends, 17 * 32 + np.arange(32), side="right")
    assert batched[-1]["document_ids"].tolist() == (starts - starts[0]).tolist()
    assert batched[-1]["special_tokens_mask"].tolist() == [int(i in tokenizer.all_special_ids) for i in ids[544:576]]
    run_in_process([a.removeprefix("--") for a in given if "tokenizer.name_or_path" not in a] + [
        "tokenizer.vocab_size=500", f"run.output_dir={tmp_path / 'other'}"])
    assert len(list((cache / "bert_recipes_stores").glob("*/store.json"))) == 4


def test_prepared_packed_mlm_is_one_line_pointing_to_the_store(tmp_path, sample_dir, datasets_cache, capsys):
    """The packed MLM directories make prepare wrote before token stores: data.source=prepared, or such a directory
    given as data.store_dir, is one line saying how to make the new one; nothing is written."""
    (tmp_path / "old").mkdir()
    (tmp_path / "old/prepared.json").write_text("{}")
    args = lambda **more: [f"--{a}" for a in tiny_args(tmp_path / "run", sample_dir, datasets_cache, **more)]  # noqa: E731
    said = refused_in_process(args(**{"data.source": "prepared", "data.prepared_dir": str(tmp_path / "old")}),
                              tmp_path / "run", capsys)
    assert "data.source=prepared: packed MLM reads a token store now" in said and "--data.cache_dir=DIR" in said
    said = refused_in_process(args(**{"data.source": "store", "data.store_dir": str(tmp_path / "old")}),
                              tmp_path / "run", capsys)
    assert f"data.store_dir={tmp_path / 'old'} holds prepared data (prepared.json" in said
    assert "make prepare RECIPE=<this recipe> STORE=1" in said


def test_a_book_on_one_line_is_read_and_cut_as_it_comes(tmp_path):
    """A plain-text line of megabytes (a book on one line) is read in chunks of LONGEST_DOCUMENT_CHARS: the pieces
    are those that cutting the whole line gives (CutLongDocuments), each at most that long, their text the line's;
    short lines and blank ones as before. The memory this bounds is measured in docs/data.md."""
    from bert_recipes.data.store_writer import LONGEST_DOCUMENT_CHARS, CutLongDocuments, LinesReader
    from datatrove.data import Document
    words = " ".join(f"w{i % 997}" for i in range(200_000))   # about 1.1 MB, a space every few characters
    (tmp_path / "book.txt").write_text("a short line\n\n" + words + "\n" + "x" * 250_000 + "\nthe end\n")
    read = [d.text for d in LinesReader(str(tmp_path)).read_file("book.txt")]
    whole = [d.text for d in CutLongDocuments(LONGEST_DOCUMENT_CHARS).run(
        [Document(text=t, id=str(i)) for i, t in enumerate(["a short line", words, "x" * 250_000, "the end"])])]
    assert read == whole and max(map(len, read)) <= LONGEST_DOCUMENT_CHARS == 100_000
    assert read[0] == "a short line" and read[-1] == "the end" and "".join(read[1:-4]) == words
    assert len(read[1:-4]) > len(words) // 100_000 and all(p.endswith(" ") for p in read[1:-5])   # cut at spaces
    assert read[-4:-1] == ["x" * 100_000, "x" * 100_000, "x" * 50_000]   # no space: cut at the limit


def test_two_runs_that_share_a_cache_write_its_store_once(tmp_path, sample_dir, shared_tokenizer):
    """Two processes that make the same split's store at once (two runs started together on one cache) take turns
    on its lock: datatrove's task runs once (one line in its log), and both read the same blocks."""
    script = ("import json, sys\nfrom transformers import AutoTokenizer\nfrom bert_recipes.config import Config\n"
              "from bert_recipes.data.sources import load_raw\nfrom bert_recipes.tasks import kind_of\n"
              "cfg = Config()\ncfg.data.sample_dir, cfg.data.cache_dir = sys.argv[1], sys.argv[2]\n"
              "data = kind_of('mlm').tokenize(load_raw(cfg.data, cfg.task, seed=0), "
              "AutoTokenizer.from_pretrained(sys.argv[3]), cfg.task, cfg.data)\n"
              "print(json.dumps([len(data['train']), data['train'][7]['input_ids'].tolist()]))\n")
    cache = tmp_path / "cache"
    subprocess.run([sys.executable, "-c", script, str(sample_dir), str(cache), str(shared_tokenizer)], cwd=REPO,
                   check=True, capture_output=True, timeout=300, env={**os.environ, "HF_DATASETS_OFFLINE": "1",
                                                                      "PYTHONPATH": str(REPO)})   # the raw rows once
    import shutil
    shutil.rmtree(cache / "bert_recipes_stores")   # the stores start over: only datasets' reading of the rows is kept
    both = [subprocess.Popen([sys.executable, "-c", script, str(sample_dir), str(cache), str(shared_tokenizer)],
                             cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": str(REPO)}) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=300)[0]) for p in both]
    assert outs[0] == outs[1] and outs[0][0] > 100
    logs = list(cache.glob("bert_recipes_stores/*/prepare.log"))
    assert len(logs) == 2 and all(log.read_text().count("Launching pipeline for rank=0") == 1 for log in logs)
