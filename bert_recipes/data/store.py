"""The token store (data.source=store): a corpus tokenized once, outside the job, into flat token files and their
documents' boundaries, which training memory-maps. datatrove writes it (`write_store`: its reader for the files'
format, a step that cuts very long documents, its DocumentTokenizer; the local executor's tasks, one input file a
task, resume a preparation that was killed: a finished task is skipped, a task cut off is written again), in its own
format (`<task>_unshuffled.ds`: uint16 or uint32 token ids; `.ds.index`: each document's end, uint64), so that its
tools and nanotron read it too; `store.json`, written last, is the manifest a run reads: the tokenizer's vocabulary
fingerprint, the input files with their sizes, the tokens and documents of each shard, the dtype.

A packed block of data.max_seq_length tokens is a slice of one shard (a shard's tail that fills no block is left
out); its documents come from the boundaries on the fly (no per-token column on disk). Starting a run reads the
manifest, never the tokens. No torch at import time."""
from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import numpy as np

from ..config import ConfigError, path_kind

STORE_META = "store.json"
STORE_VERSION = 1
SHARD_NAME = "tokens"                       # datatrove's files: <task:05d>_unshuffled.ds under <store>/tokens/
LONGEST_DOCUMENT_CHARS = 1_000_000          # a longer document is cut into pieces of this many characters (memory)
READERS = {"text": "text", "json": "jsonl", "parquet": "parquet", "csv": "csv"}   # datasets' builder -> datatrove's


# ----------------------------------------------------------------------------- writing (make prepare)
def write_store(files: list[str], out: Path, tokenizer_dir: Path, text_column: str, builder: str, workers: int,
                vocabulary: str, part: int = 0, parts: int = 1) -> dict | None:
    """Tokenize `files` (resolved, one format: datasets' `builder` name) into a store at `out` with datatrove's local
    executor, one task a file on `workers` processes, then write the manifest. Run again after a kill, it skips the
    finished tasks and gives the same bytes. part of parts (a SLURM array's task of its count: slurm/prepare.sbatch):
    this machine runs its contiguous share of the tasks into the shared `out`, and whichever part finds every task
    done writes the manifest. -> the manifest, or None while other parts' tasks are not done."""
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.tokens import DocumentTokenizer

    out.mkdir(parents=True, exist_ok=True)
    plan = check_same_preparation(out, files, vocabulary, text_column)
    write_atomically(out / PREPARING, json.dumps(plan, indent=1))   # every part writes the same bytes
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    paths_file = out / "inputs.txt"   # the executor's tasks read their file from it: the i-th line is task i's
    write_atomically(paths_file, "".join(os.path.relpath(f, root) + "\n" for f in files))
    first, end = len(files) * part // parts, len(files) * (part + 1) // parts   # this part's tasks
    pipeline = [reader(builder, root, str(paths_file), text_column), CutLongDocuments(LONGEST_DOCUMENT_CHARS),
                DocumentTokenizer(str(out / SHARD_NAME), str(tokenizer_dir / "tokenizer.json"), save_filename=None,
                                  shuffle_documents=False, save_final_metadata=False, batch_size=1000)]
    if end > first:
        LocalPipelineExecutor(pipeline, tasks=len(files), workers=max(1, min(workers, end - first)),
                              local_tasks=end - first, local_rank_offset=first, logging_dir=str(out / "logs"),
                              start_method="fork").run()
    done = out / "logs" / "completions"
    if not all((done / f"{task:05d}").exists() for task in range(len(files))):
        return None   # another part's tasks still run: the last part to finish writes the manifest
    shards = []
    for task, path in enumerate(files):
        tokens_file = out / SHARD_NAME / f"{task:05d}_unshuffled.ds"
        ends = (np.fromfile(f"{tokens_file}.index", dtype="<u8") if tokens_file.exists() else np.zeros(0, "<u8"))
        shards.append({"file": tokens_file.relative_to(out).as_posix() if tokens_file.exists() else None,
                       "input": path, "input_bytes": os.path.getsize(path),
                       "tokens": int(ends[-1]) if len(ends) else 0, "documents": int(len(ends))})
    dtype = "uint16" if token_bytes(tokenizer_dir) == 2 else "uint32"
    meta = {"version": STORE_VERSION, "vocabulary": vocabulary, "dtype": dtype, "text_column": text_column,
            "tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
            "shards": shards}
    write_atomically(out / STORE_META, json.dumps(meta, indent=1))
    return meta


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a file of this process's own, renamed: a reader sees the old or the new bytes."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


PREPARING = "preparing.json"   # what a preparation resumed in the same place must agree with (its finished tasks stay)


def check_same_preparation(out: Path, files: list[str], vocabulary: str, text_column: str) -> dict:
    """A preparation started again where one was cut off goes on only with the same files and tokenizer: else one
    line, before anything there changes. -> its plan."""
    plan = {"version": STORE_VERSION, "vocabulary": vocabulary, "text_column": text_column,
            "inputs": [[f, os.path.getsize(f)] for f in files]}
    started = Path(out) / PREPARING
    if started.exists() and json.loads(started.read_text()) != plan:
        raise ConfigError(f"--out {out} holds a preparation of other files or with another tokenizer ({started}): "
                          "give another --out, or remove it to start again")
    return plan


def token_bytes(tokenizer_dir: Path) -> int:
    """The bytes a token takes in the store, as datatrove decides it: 2 (uint16) where the vocabulary fits, else 4."""
    from tokenizers import Tokenizer
    return 2 if Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size() < 2 ** 16 else 4


def reader(builder: str, root: str, paths_file: str, text_column: str):
    """datatrove's reader for the files' format (datasets' builder name), reading the text column; plain text: a
    document a non-empty line (as data.source=files reads it)."""
    from datatrove.pipeline import readers
    kind = READERS.get(builder)
    if kind == "jsonl":
        return readers.JsonlReader(root, paths_file=paths_file, text_key=text_column, add_file_path=False)
    if kind == "parquet":
        return readers.ParquetReader(root, paths_file=paths_file, text_key=text_column, read_metadata=False)
    if kind == "csv":
        return readers.CSVReader(root, paths_file=paths_file, text_key=text_column)
    if kind == "text":
        return LinesReader(root, paths_file=paths_file, add_file_path=False)
    raise ConfigError(f"data files of the {builder} format cannot go into a token store (it reads "
                      f"{', '.join(READERS)}): convert them, or train from data.source=files")


def _lines_reader_class():
    from datatrove.pipeline.readers.base import BaseDiskReader

    class LinesReader(BaseDiskReader):
        """Plain text (compressed or not): a document a non-empty line, as datasets' text builder and the MLM
        tokenizing of data.source=files read it."""
        name = "📄 Lines"

        def read_file(self, filepath: str):
            with self.data_folder.open(filepath, "rt", compression="infer") as f:
                for i, line in enumerate(f):
                    line = line.rstrip("\n")
                    if line.strip():
                        yield self.get_document_from_dict({"text": line}, filepath, i)
    return LinesReader


def LinesReader(*args, **kwargs):   # noqa: N802 (a class made on first use: datatrove is imported only to write)
    return _lines_reader_class()(*args, **kwargs)


def _cut_class():
    from datatrove.data import Document
    from datatrove.pipeline.base import PipelineStep

    class CutLongDocuments(PipelineStep):
        """A document longer than `chars` characters goes on as pieces of at most that many (cut at the last space
        before the limit where there is one), so the tokenizer's memory stays bounded whatever one document holds
        (a book on one line). Each piece is a document of its own in the store."""
        name = "✂️ Cut long documents"

        def __init__(self, chars: int):
            super().__init__()
            self.chars = chars

        def run(self, data, rank: int = 0, world_size: int = 1):
            for document in data:
                text = document.text
                if len(text) <= self.chars:
                    yield document
                    continue
                start, piece = 0, 0
                while start < len(text):
                    end = min(start + self.chars, len(text))
                    if end < len(text):
                        space = text.rfind(" ", start + self.chars // 2, end)
                        end = space + 1 if space > 0 else end
                    yield Document(text=text[start:end], id=f"{document.id}/{piece}", metadata=document.metadata)
                    start, piece = end, piece + 1
    return CutLongDocuments


def CutLongDocuments(chars: int):   # noqa: N802 (as LinesReader)
    return _cut_class()(chars)


# ----------------------------------------------------------------------------- reading (training)
def check_store_dir(store_dir: str) -> Path:
    """data.store_dir: a directory with a store's manifest (make prepare writes it last), else one line."""
    root = Path(store_dir).expanduser()
    kind = path_kind(root, "data.store_dir")
    if kind == "dir":
        path_kind(root / STORE_META, "data.store_dir")   # a directory this user cannot look into: its own line
    if kind == "file":
        raise ConfigError(f"data.store_dir={store_dir} is a file, not a directory: give the directory make prepare "
                          "STORE=1 wrote")
    if kind == "missing":
        raise ConfigError(f"data.store_dir={store_dir}: no such directory: write a token store there with make prepare "
                          f"RECIPE=<this recipe> STORE=1 OUT={store_dir}")
    if not (root / STORE_META).is_file():
        raise ConfigError(f"data.store_dir={store_dir} holds no token store ({STORE_META} missing: an interrupted "
                          "preparation writes it last): write it with make prepare RECIPE=<this recipe> STORE=1 "
                          f"OUT={store_dir}, or run that again to finish it")
    return root


class TokenStore:
    """A store's shards, memory-mapped on first read (each process its own maps: DataLoader workers too)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.meta = json.loads((self.root / STORE_META).read_text())
        self.dtype = np.dtype(self.meta["dtype"]).newbyteorder("<")
        self.shards = [s for s in self.meta["shards"] if s["tokens"]]
        self._tokens: dict[int, np.ndarray] = {}
        self._ends: dict[int, np.ndarray] = {}

    def tokens(self, shard: int) -> np.ndarray:
        if shard not in self._tokens:
            self._tokens[shard] = np.memmap(self.root / self.shards[shard]["file"], dtype=self.dtype, mode="r")
        return self._tokens[shard]

    def ends(self, shard: int) -> np.ndarray:
        """The shard's document ends, in tokens (uint64)."""
        if shard not in self._ends:
            self._ends[shard] = np.memmap(self.root / f"{self.shards[shard]['file']}.index", dtype="<u8", mode="r")
        return self._ends[shard]

    def __getstate__(self):   # a DataLoader worker maps the files again rather than pickling the maps
        return {**self.__dict__, "_tokens": {}, "_ends": {}}


class StoreBlocks:
    """The packed blocks of `seq` tokens of a store, numbered shard after shard (a shard's tail is left out), as a
    dataset the loaders read: `rows` (a range of block numbers: the training or the evaluation share) selects them.
    A row is {input_ids, special_tokens_mask[, document_ids]} as data.source=files' packed MLM rows are: a document
    cut at a block's start goes on there as document 0 (tasks/mlm.py's packing)."""

    def __init__(self, store: TokenStore, seq: int, special_ids: list[int], documents: bool, rows: range | None = None):
        self.store, self.seq, self.documents = store, seq, documents
        self.special = np.zeros(max(max(special_ids, default=0) + 1, 1), dtype=bool)
        self.special[list(special_ids)] = True
        counts = [s["tokens"] // seq for s in store.shards]
        self.first = np.cumsum([0] + counts)   # shard i holds blocks first[i] .. first[i+1] - 1
        self.rows = rows if rows is not None else range(int(self.first[-1]))

    def __len__(self) -> int:
        return len(self.rows)

    def training_order(self, seed: int):
        """The training loader's sampler: each epoch's order computed from the position (batching.PermutedOrder),
        so no rank holds a list of the store's blocks."""
        from .batching import PermutedOrder
        return PermutedOrder(len(self), seed)

    def select(self, rows: range) -> "StoreBlocks":
        other = object.__new__(StoreBlocks)
        other.__dict__.update(self.__dict__)
        other.rows = rows
        return other

    def __getitem__(self, i: int) -> dict:
        block = self.rows[i]
        shard = int(np.searchsorted(self.first, block, side="right")) - 1
        start = (block - int(self.first[shard])) * self.seq
        ids = np.asarray(self.store.tokens(shard)[start:start + self.seq], dtype=np.int64)
        special = self.special[np.minimum(ids, len(self.special) - 1)] & (ids < len(self.special))
        row = {"input_ids": ids, "special_tokens_mask": special.astype(np.int64)}
        if self.documents:
            ends = self.store.ends(shard)
            first = int(np.searchsorted(ends, start, side="right"))   # the document the block starts in
            ids_within = np.searchsorted(ends[first:], np.arange(start, start + self.seq), side="right")
            row["document_ids"] = ids_within.astype(np.int64)
        return row


def store_splits(store_dir: str, seq: int, special_ids: list[int], documents: bool, percent: float,
                 max_train: int | None, max_eval: int | None) -> dict:
    """{"train", "eval"}: the store's blocks, the last ceil(percent %) held out for evaluation (arithmetic: no list of
    block numbers in memory), each cut to data.max_*_samples."""
    blocks = StoreBlocks(TokenStore(check_store_dir(store_dir)), seq, special_ids, documents)
    n = len(blocks)
    held = math.ceil(n * percent / 100)
    if n - held < 1 or held < 1:
        raise ConfigError(f"data.store_dir={store_dir} holds {n} blocks of data.max_seq_length={seq} tokens: "
                          f"data.validation_split_percentage={percent} leaves {n - held} to train on and {held} to "
                          "evaluate (at least 1 of each is needed): give a larger corpus or shorter sequences")
    train, evaluation = range(0, n - held), range(n - held, n)
    if max_train is not None:
        train = train[:max_train]
    if max_eval is not None:
        evaluation = evaluation[:max_eval]
    return {"train": blocks.select(train), "eval": blocks.select(evaluation)}


def manifest_digest(store_dir: str) -> str:
    """The store's identity for a resume: a digest of its manifest."""
    return hashlib.sha256((Path(store_dir).expanduser() / STORE_META).read_bytes()).hexdigest()[:16]
