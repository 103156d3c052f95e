"""Tokenize a recipe's corpus once, ahead of its runs, into a directory every rank memory-maps, so a run starts
training in seconds instead of tokenizing.

    make prepare RECIPE=recipes/bert-base-mlm-phase1.yaml OUT=data/prepared/phase1 WORKERS=16
    # packed MLM: the run's own token stores (bert_recipes/data/store_cache.py), made here rather than on its first
    # start; then: --data.cache_dir=data/prepared/phase1 (any backend, any world size)
    make prepare RECIPE=recipes/tiny-classify.yaml OUT=data/prepared/classify
    # classification (or MLM a line a row): datasets' tokenized splits; then: --data.source=prepared
    # --data.prepared_dir=data/prepared/classify
    python tools/prepare.py --make-corpus data/corpus-1g.txt --size 1G   # a generated corpus to measure on
    python tools/prepare.py --make-corpus data/book.txt --size 10M --one-line   # a book on one line
    python tools/prepare.py --make-corpus data/long.txt --size 40M --paragraphs 20   # articles of ~20 paragraphs
    python tools/prepare.py --recipe R --out data/store/x --store --workers 16   # a token store (datatrove), for MLM
    make prepare RECIPE=R OUT=data/store/x STORE=1 WORKERS=16
    # then: --data.source=store --data.store_dir=data/store/x

--store writes a token store of data.train_files instead (bert_recipes/data/store.py; for a corpus on many machines:
slurm/prepare.sbatch): datatrove tokenizes the training files, one task a file on --workers processes, into flat
token files and their documents' boundaries; run again after a kill, it skips the finished files and gives the same
bytes. Its free disk is checked first.

Without --store, datatrove (packed MLM) or `datasets.map` (the rest) stream in batches, written to disk as they go,
so the peak memory stays bounded whatever the corpus size (measured in docs/data.md). The tokenizer (given, or
trained on the corpus) is saved beside the data; prepared.json records the settings, which a run must match.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")   # one process: let the Rust tokenizer use the cores

from bert_recipes.config import ConfigError, load_config, validate   # noqa: E402
from bert_recipes.tasks import TASKS   # noqa: E402
from bert_recipes.data.files import resolve_into   # noqa: E402
from bert_recipes.data import prepare_data   # noqa: E402
from bert_recipes.data.prepared import PREPARED_META, prepared_signature   # noqa: E402

UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def peak_rss_mb() -> tuple[float, float]:
    """(this process, its largest child) peak resident memory, MB (Linux reports KB). Resident memory
    includes the pages of memory-mapped Arrow files read so far, which the kernel can drop at will."""
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)


WATCHER = r"""
import json, os, sys, time
pid, out = int(sys.argv[1]), sys.argv[2]
def anon(p):
    try:
        for line in open(f"/proc/{p}/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0
def children(p):
    found = []
    for task in os.listdir(f"/proc/{p}/task") if os.path.isdir(f"/proc/{p}/task") else []:
        try:
            kids = [int(k) for k in open(f"/proc/{p}/task/{task}/children").read().split()]
        except OSError:
            kids = []
        for k in kids:
            found += [k] + children(k)
    return found
peak = {"main": 0.0, "largest_worker": 0.0}
while os.path.exists(f"/proc/{pid}"):
    peak["main"] = max(peak["main"], anon(pid))
    peak["largest_worker"] = max([peak["largest_worker"]] + [anon(c) for c in children(pid)])
    with open(out, "w") as f:
        json.dump(peak, f)
    time.sleep(0.5)
"""


class AnonymousMemory:
    """Samples, every half second, the anonymous memory (RssAnon: heap and stacks, not file pages) of
    this process and of its children: the memory that has to fit, whatever the corpus size. The
    sampler is a separate process (a thread here would be copied, mid-lock, into datasets' forked
    workers and hang them)."""

    def __enter__(self):
        import subprocess
        import tempfile
        self.file = Path(tempfile.mkstemp(suffix=".json")[1])
        self.proc = subprocess.Popen([sys.executable, "-c", WATCHER, str(os.getpid()), str(self.file)])
        return self

    def __exit__(self, *exc):
        time.sleep(1.0)   # one more sample
        self.proc.terminate()
        self.proc.wait()
        try:
            peak = json.loads(self.file.read_text())
        except ValueError:
            peak = {"main": 0.0, "largest_worker": 0.0}
        self.peak_main, self.peak_child = peak["main"], peak["largest_worker"]
        self.file.unlink()


def make_corpus(path: Path, size: str, sample_dir: Path, one_line: bool = False, paragraphs: int = 1) -> int:
    """A generated corpus of `size` bytes: the embedded sample's pretraining text, its lines shuffled
    anew on every pass, one paragraph per line; one_line: all of it one document on one line (a book on one line,
    the long document a token store cuts); paragraphs: documents of several paragraphs a line, their count drawn
    (seeded) from a geometric distribution of that mean, so lengths spread as articles' do. -> bytes written."""
    from bert_recipes.data.sample import build_sample
    build_sample(sample_dir)
    lines = (sample_dir / "pretrain/train.txt").read_text().splitlines()
    target = int(float(size[:-1]) * UNITS[size[-1].upper()]) if size[-1].upper() in UNITS else int(size)
    rng, written = random.Random(0), 0
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        while written < target:
            rng.shuffle(lines)
            if paragraphs > 1:
                documents, at = [], 0
                while at < len(lines):
                    n = 1 + int(rng.expovariate(1 / (paragraphs - 1)))
                    documents.append(" ".join(lines[at:at + n]))
                    at += n
            else:
                documents = lines
            chunk = ("\n" if not one_line else " ").join(documents) + ("\n" if not one_line else " ")
            f.write(chunk)
            written += len(chunk.encode())
        if one_line:
            f.write("\n")
    return written + one_line


def prepare(cfg, out: Path) -> dict:
    signature = prepared_signature(cfg.data, cfg.task, cfg.tokenizer, cfg.model.name_or_path)   # before prepare_data,
    # which may name text labels
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with AnonymousMemory() as anon:
        tokenizer, data, _, test_index = prepare_data(cfg.data, cfg.task, cfg.tokenizer, cfg.model.name_or_path,
                                                      cfg.run.seed, tmp, True, lambda: None)
        tokenized_s = time.perf_counter() - t0
        data.save_to_disk(str(tmp / "data"))
        tokenizer.save_pretrained(tmp / "tokenizer")
    meta = {"signature": signature, "data_files": {"train": cfg.data.train_files, "validation": cfg.data.validation_files},
            "label_names": cfg.task.label_names, "test_index": test_index,
            "splits": {k: len(v) for k, v in data.items()},
            "seconds": {"tokenize_and_pack": round(tokenized_s, 1), "total": round(time.perf_counter() - t0, 1)},
            "peak_rss_mb": dict(zip(("main", "largest_worker"), (round(v) for v in peak_rss_mb()))),
            "peak_anonymous_mb": {"main": round(anon.peak_main), "largest_worker": round(anon.peak_child)}}
    (tmp / PREPARED_META).write_text(json.dumps(meta, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)   # complete or absent
    return meta


def prepare_run_stores(cfg, out: Path, workers: int) -> dict:
    """A packed MLM recipe's token stores, as its run makes them on first use (bert_recipes/data/store_cache.py), made
    ahead of time with `workers` processes into `out` as the run's data.cache_dir (the text as datasets read it, the
    tokenizer trained on it if the recipe trains one, a store a split). -> what was made."""
    cfg.data.cache_dir = str(out)
    cfg.data.num_proc = workers if workers > 1 else cfg.data.num_proc
    t0 = time.perf_counter()
    tokenizer, data, _, _ = prepare_data(cfg.data, cfg.task, cfg.tokenizer, cfg.model.name_or_path, cfg.run.seed,
                                         out / "tokenizer", True, lambda: None)
    tokenizer.save_pretrained(out / "tokenizer")   # for a node without the Hub: --tokenizer.name_or_path=OUT/tokenizer
    return {"blocks": {split: len(blocks) for split, blocks in data.items()},
            "seconds": round(time.perf_counter() - t0, 1)}


STORE_BYTES_PER_TEXT_BYTE = 1.0   # a uint16 store of English text and its index: 0.74 measured on the sample (tools
# /prepare.py --store: 610,723 tokens, 1.22 MB of ids and 63 KB of index for 1.66 MB of text); 1.0 leaves a margin


def prepare_store(cfg, out: Path, workers: int, part: int = 0, parts: int = 1) -> dict | None:
    """data.train_files -> a token store at `out` (bert_recipes/data/store.py), with the recipe's tokenizer beside it;
    the disk's free space is checked against the estimate before any work."""
    from bert_recipes.config import nearest_existing
    from bert_recipes.data.store_writer import check_same_preparation, running_datatrove, write_store
    from bert_recipes.data.files import check_kinds
    from bert_recipes.data.tokenizing import vocabulary_fingerprint
    from bert_recipes.places import make_place
    named = cfg.tokenizer.name_or_path or cfg.model.name_or_path
    if not named:
        raise ConfigError("a token store is tokenized with the run's tokenizer: set tokenizer.name_or_path (or "
                          "model.name_or_path); make prepare without STORE=1 trains one")
    if cfg.data.source != "files" or cfg.data.validation_files:
        raise ConfigError("a token store holds data.train_files (data.source=files), its last blocks held out for "
                          "evaluation: set data.source=files and leave data.validation_files out")
    files = list(cfg.data.train_files)
    builder = check_kinds(files)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(named)
    size = 2 if len(tokenizer) < 2 ** 16 else 4   # datatrove's token size (store.token_bytes)
    text_bytes = sum(os.path.getsize(f) for f in files)
    needed = text_bytes * STORE_BYTES_PER_TEXT_BYTE * size / 2
    free = shutil.disk_usage(nearest_existing(out)).free   # before anything is written
    if free < needed:
        raise ConfigError(f"--out {out}: {free / 1e9:.2f} GB free, and a store of {text_bytes / 1e9:.2f} GB of text "
                          f"needs about {needed / 1e9:.2f} GB ({STORE_BYTES_PER_TEXT_BYTE} byte a byte of text at "
                          f"{size} bytes a token): free space there, or give another --out")
    check_same_preparation(out, [[f, os.path.getsize(f)] for f in files], vocabulary_fingerprint(tokenizer),
                           cfg.data.text_column)
    make_place("--out", str(out))
    if not (out / "tokenizer").is_dir():   # a SLURM array's parts share `out`: the first to rename its copy wins
        mine = out / f"tokenizer.{os.getpid()}.tmp"
        tokenizer.save_pretrained(mine)
        try:
            os.rename(mine, out / "tokenizer")
        except OSError:
            shutil.rmtree(mine, ignore_errors=True)
    t0 = time.perf_counter()
    with running_datatrove(out / "prepare.log"):   # a line a task, its stats: the terminal gets one line
        meta = write_store(files, out, out / "tokenizer", cfg.data.text_column, builder, workers,
                           vocabulary_fingerprint(tokenizer), part, parts)
    if meta is not None:
        meta["seconds"] = round(time.perf_counter() - t0, 1)
    return meta


def prepared_splits(path: Path, seq: int) -> dict:
    """The splits a tool's workload was prepared into: a token store's blocks of `seq` tokens (store.json: packed MLM,
    its last 5% held out) or datasets' tokenized splits (prepared.json). The tools' own reading of both (make bench's
    Trainer, tools/quality.py)."""
    if (Path(path) / "store.json").is_file():
        from transformers import AutoTokenizer

        from bert_recipes.data.store_cache import store_splits
        specials = AutoTokenizer.from_pretrained(str(Path(path) / "tokenizer")).all_special_ids
        return store_splits(str(path), seq, specials, False, 5, None, None)
    from datasets import DatasetDict
    return DatasetDict.load_from_disk(str(Path(path) / "data"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", help="the recipe whose data, tokenizer and sequence settings to use")
    parser.add_argument("--out", help="the directory to write (data.prepared_dir of later runs)")
    parser.add_argument("--make-corpus", help="instead: write a generated corpus to this file")
    parser.add_argument("--size", default="1G", help="of the generated corpus: 256M, 1G, ...")
    parser.add_argument("--one-line", action="store_true", help="--make-corpus: the whole corpus one line (a book)")
    parser.add_argument("--paragraphs", type=int, default=1, help="--make-corpus: paragraphs a document, on average")
    parser.add_argument("--sample-dir", default="data/sample")
    parser.add_argument("--store", action="store_true", help="write a token store (datatrove) instead")
    parser.add_argument("--workers", type=int, default=1, help="--store: processes (a task a file)")
    parser.add_argument("--part", type=int, default=0, help="--store: this machine's share, of --parts "
                        "(slurm/prepare.sbatch: the array task's id and count)")
    parser.add_argument("--parts", type=int, default=1)
    args, overrides = parser.parse_known_args(argv)
    if args.make_corpus:
        n = make_corpus(Path(args.make_corpus), args.size, Path(args.sample_dir), args.one_line, args.paragraphs)
        print(f"[prepare] wrote {n / 1e9:.2f} GB of text to {args.make_corpus}")
        return 0
    try:
        if not (args.recipe and args.out):
            raise ConfigError("give --recipe and --out (or --make-corpus)")
        cfg = load_config(args.recipe, [o.removeprefix("--") for o in overrides])
        validate(cfg)
        if cfg.data.source == "prepared":
            raise ConfigError("data.source=prepared: that recipe reads prepared data; prepare from its source")
        for line in resolve_into(cfg.data):   # patterns and directories: the files, as a run resolves them
            print(line, flush=True)
        if args.store:
            if not 0 <= args.part < args.parts:
                raise ConfigError(f"--part {args.part} of --parts {args.parts}: give 0 <= part < parts")
            meta = prepare_store(cfg, Path(args.out), args.workers, args.part, args.parts)
            if meta is None:
                print(f"[prepare] part {args.part} of {args.parts}: its files are in {args.out}; the manifest "
                      "(store.json) comes with the part that finishes last")
                return 0
            print(f"[prepare] {args.out}: a token store of {meta['tokens']:,} tokens in {meta['documents']:,} documents "
                  f"({meta['dtype']}, {len(meta['shards'])} shards) in {meta['seconds']}s; train with "
                  f"--data.source=store --data.store_dir={args.out}")
            if cfg.data.packing == "best_fit":   # the pack plan beside it, so a read-only store serves every run
                from bert_recipes.data.best_fit import plan_rows
                from bert_recipes.data.store import TokenStore
                plan = json.loads((plan_rows(TokenStore(Path(args.out)), cfg.data.max_seq_length) / "plan.json"
                                   ).read_text())
                print(f"[prepare] {args.out}: its best-fit plan, {plan['rows']:,} rows of {plan['seq']} tokens, "
                      f"{plan['padding']:.1%} padding")
            return 0
        if TASKS[cfg.task.kind].masked_lm and cfg.data.packing:
            meta = prepare_run_stores(cfg, Path(args.out), args.workers)
            print(f"[prepare] {args.out}: token stores of " + ", ".join(f"{split} ({n:,} blocks of "
                  f"{cfg.data.max_seq_length} tokens)" for split, n in meta["blocks"].items()) + f" in {meta['seconds']}s;"
                  f" a run of this recipe finds them with --data.cache_dir={args.out}")
            return 0
        if cfg.data.mixture:
            raise ConfigError("data.mixture: make prepare writes a mixture's token stores (packed MLM: data.packing="
                              "true); a mixture a line a row tokenizes each source once into datasets' cache")
        meta = prepare(cfg, Path(args.out))
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    anon, rss = meta["peak_anonymous_mb"], meta["peak_rss_mb"]
    print(f"[prepare] {args.out}: {meta['splits']} sequences in {meta['seconds']['total']}s; peak memory "
          f"{anon['main']} MB anonymous / {rss['main']} MB resident (largest worker {anon['largest_worker']} / "
          f"{rss['largest_worker']} MB); train with --data.source=prepared --data.prepared_dir={args.out}")
    return 0


if __name__ == "__main__":
    from bert_recipes.cli import quick_exit   # without the interpreter's teardown (about 1 s)
    quick_exit(main())
