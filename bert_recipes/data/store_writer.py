"""The token store's writer (make prepare STORE=1: tools/prepare.py, slurm/prepare.sbatch): datatrove tokenizes the
files into the store that bert_recipes/data/store.py reads: its reader for the files' format, a step that cuts very
long documents, its DocumentTokenizer (the files' order kept: its shuffle is off), on its local executor, one task an
input file, whose finished tasks a preparation started again skips (a task cut off is written again, from its
start: the bytes are an uninterrupted preparation's); the manifest comes last."""
from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import numpy as np
from datatrove.data import Document
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline import readers
from datatrove.pipeline.base import PipelineStep
from datatrove.pipeline.readers.base import BaseDiskReader
from datatrove.pipeline.tokens import DocumentTokenizer

from ..config import ConfigError
from .store import SHARD_NAME, STORE_META, STORE_VERSION

LONGEST_DOCUMENT_CHARS = 100_000   # a longer document is cut into pieces of at most this many characters, and the
TOKENIZER_BATCH = 16               # tokenizer encodes this many documents at a time: at most 1.6M characters a call,
# whatever the documents (a corpus of books included). Measured on a 10 MB one-line book against the same 10 MB as
# 47,299 lines: docs/data.md. A batch of 16 tokenizes as fast as one of 1,000 (1.16-1.18M tokens/s on one core).
READERS = {"text": "text", "json": "jsonl", "parquet": "parquet", "csv": "csv"}   # datasets' builder -> datatrove's


def write_store(files: list[str], out: Path, tokenizer_dir: Path, text_column: str, builder: str, workers: int,
                vocabulary: str, part: int = 0, parts: int = 1) -> dict | None:
    """Tokenize `files` (resolved, one format: datasets' `builder` name) into a store at `out` with datatrove's local
    executor, one task a file on `workers` processes, then write the manifest. Run again after a kill, it skips the
    finished tasks and gives the same bytes. part of parts (a SLURM array's task of its count: slurm/prepare.sbatch):
    this machine runs its contiguous share of the tasks into the shared `out`, and whichever part finds every task
    done writes the manifest. -> the manifest, or None while other parts' tasks are not done."""
    out.mkdir(parents=True, exist_ok=True)
    inputs = [[f, os.path.getsize(f)] for f in files]
    write_atomically(out / PREPARING, json.dumps(check_same_preparation(out, inputs, vocabulary, text_column), indent=1))
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    paths_file = out / "inputs.txt"   # the executor's tasks read their file from it: the i-th line is task i's
    write_atomically(paths_file, "".join(os.path.relpath(f, root) + "\n" for f in files))
    return tokenize_tasks(reader(builder, root, str(paths_file), text_column), inputs, out, tokenizer_dir, workers,
                          vocabulary, text_column, part, parts)


def write_rows_store(rows, out: Path, tokenizer_dir: Path, text_column: str, workers: int, vocabulary: str,
                     fingerprint: str) -> dict:
    """A datasets split's rows (a run's own text, as datasets read it: bert_recipes/data/store_cache.py) into a store at
    `out`: task i of ceil(rows / ROWS_A_TASK) tokenizes its contiguous share of the rows, on `workers` processes.
    Run again after a kill, it skips the finished tasks. -> the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    tasks = max(1, -(-len(rows) // ROWS_A_TASK))
    inputs = [[f"{fingerprint}[{len(rows) * t // tasks}:{len(rows) * (t + 1) // tasks}]", None] for t in range(tasks)]
    write_atomically(out / PREPARING, json.dumps(check_same_preparation(out, inputs, vocabulary, text_column), indent=1))
    return tokenize_tasks(DatasetRows(rows, text_column), inputs, out, tokenizer_dir, workers, vocabulary, text_column)


ROWS_A_TASK = 50_000   # a run's own store: rows a datatrove task (its shard: a shard's tail that fills no block is cut)


def tokenize_tasks(read, inputs: list, out: Path, tokenizer_dir: Path, workers: int, vocabulary: str,
                   text_column: str, part: int = 0, parts: int = 1) -> dict | None:
    """datatrove's local executor runs `read` (a reader step: task i reads input i), CutLongDocuments and its
    DocumentTokenizer (the inputs' order kept: its shuffle is off), task i into tokens/<i>_unshuffled.ds, this part's
    share of the tasks on `workers` processes; a finished task is skipped. When every task is done, the manifest.
    -> the manifest, or None while other parts' tasks are not done."""
    tasks = len(inputs)
    first, end = tasks * part // parts, tasks * (part + 1) // parts   # this part's tasks
    pipeline = [read, CutLongDocuments(LONGEST_DOCUMENT_CHARS),
                DocumentTokenizer(str(out / SHARD_NAME), str(tokenizer_dir / "tokenizer.json"), save_filename=None,
                                  shuffle_documents=False, save_final_metadata=False,
                                  batch_size=TOKENIZER_BATCH)]
    if end > first:
        LocalPipelineExecutor(pipeline, tasks=tasks, workers=max(1, min(workers, end - first)),
                              local_tasks=end - first, local_rank_offset=first, logging_dir=str(out / "logs"),
                              start_method="fork").run()
    done = out / "logs" / "completions"
    if not all((done / f"{task:05d}").exists() for task in range(tasks)):
        return None   # another part's tasks still run: the last part to finish writes the manifest
    shards = []
    for task, (name, size) in enumerate(inputs):
        tokens_file = out / SHARD_NAME / f"{task:05d}_unshuffled.ds"
        ends = (np.fromfile(f"{tokens_file}.index", dtype="<u8") if tokens_file.exists() else np.zeros(0, "<u8"))
        shards.append({"file": tokens_file.relative_to(out).as_posix() if tokens_file.exists() else None,
                       "input": name, "input_bytes": size,
                       "tokens": int(ends[-1]) if len(ends) else 0, "documents": int(len(ends))})
    dtype = "uint16" if token_bytes(tokenizer_dir) == 2 else "uint32"
    meta = {"version": STORE_VERSION, "vocabulary": vocabulary, "dtype": dtype, "text_column": text_column,
            "tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
            "shards": shards}
    write_atomically(out / STORE_META, json.dumps(meta, indent=1))
    return meta


def save_tokenizer_file(tokenizer, directory: Path) -> None:
    """The fast tokenizer as datatrove loads it (`directory`/tokenizer.json), without the truncation or padding that
    the last call may have left in it: a store holds whole documents."""
    from tokenizers import Tokenizer
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.no_truncation()
    backend.no_padding()
    directory.mkdir(parents=True, exist_ok=True)
    mine = directory / f"tokenizer.json.{os.getpid()}.tmp"
    backend.save(str(mine))
    os.replace(mine, directory / "tokenizer.json")


@contextlib.contextmanager
def running_datatrove(log: Path):
    """datatrove's log lines (loguru: a line a task, its stats) appended to `log` rather than the terminal, and none
    anywhere once the block ends (its handlers would keep writing to the closed file); the variables its executor sets
    in the process's environment (DATATROVE_*) taken out again, so a run's later processes start as they would."""
    from loguru import logger
    log.parent.mkdir(parents=True, exist_ok=True)
    environment = dict(os.environ)
    with open(log, "a") as lines, contextlib.redirect_stderr(lines):
        logger.remove()
        logger.add(lines, level="INFO")
        try:
            yield
        finally:
            logger.remove()
            os.environ.clear()
            os.environ.update(environment)


def write_atomically(path: Path, text: str) -> None:
    """`text` into `path` through a file of this process's own, renamed: a reader sees the old or the new bytes."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


PREPARING = "preparing.json"   # what a preparation resumed in the same place must agree with (its finished tasks stay)


def check_same_preparation(out: Path, inputs: list, vocabulary: str, text_column: str) -> dict:
    """A preparation started again where one was cut off goes on only with the same inputs ([name, bytes] a task) and
    tokenizer: else one line, before anything there changes. -> its plan."""
    plan = {"version": STORE_VERSION, "vocabulary": vocabulary, "text_column": text_column, "inputs": inputs}
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


class LinesReader(BaseDiskReader):
    """Plain text (compressed or not): a document a non-empty line, as datasets' text builder and the MLM tokenizing
    of data.source=files read it; a line longer than LONGEST_DOCUMENT_CHARS is read in chunks and goes on as the
    pieces CutLongDocuments would cut, so memory does not grow with the longest line (a book on one line)."""
    name = "📄 Lines"

    def read_file(self, filepath: str):
        with self.data_folder.open(filepath, "rt", compression="infer") as f:
            i = 0
            while chunk := f.readline(LONGEST_DOCUMENT_CHARS):   # a line longer than that comes in chunks

                def chunks(chunk=chunk):
                    while not chunk.endswith("\n"):
                        yield chunk
                        chunk = f.readline(LONGEST_DOCUMENT_CHARS)
                        if not chunk:
                            return
                    yield chunk[:-1]
                for piece in cut_pieces(chunks(), LONGEST_DOCUMENT_CHARS):   # CutLongDocuments' pieces, read as
                    if piece.strip():                                         # they come: the line is never whole
                        yield self.get_document_from_dict({"text": piece}, filepath, i)
                i += 1


class DatasetRows(PipelineStep):
    """datatrove's reader over a datasets split (memory-mapped Arrow, a row selection kept): task `rank` of
    `world_size` reads its contiguous share of the rows, a document a row with text (as MLM's tokenizing of
    data.source=files read them), in batches of 1,000."""
    name = "📚 Dataset rows"
    type = "📖 - READER"

    def __init__(self, rows, text_column: str):
        super().__init__()
        self.rows, self.text_column = rows, text_column

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        n = len(self.rows)
        for start in range(n * rank // world_size, n * (rank + 1) // world_size, 1000):
            end = min(start + 1000, n * (rank + 1) // world_size)
            for i, text in enumerate(self.rows[start:end][self.text_column], start):
                if text and text.strip():
                    self.stat_update("documents")
                    yield Document(text=text, id=str(i))


class CutLongDocuments(PipelineStep):
    """A document longer than `chars` characters goes on as pieces of at most that many (cut at the last space
    before the limit where there is one), so the tokenizer's memory stays bounded whatever one document holds (a book
    on one line). Each piece is a document of its own in the store."""
    name = "✂️ Cut long documents"
    type = "✂️ - SPLITTER"

    def __init__(self, chars: int):
        super().__init__()
        self.chars = chars

    def run(self, data, rank: int = 0, world_size: int = 1):
        for document in data:
            if len(document.text) <= self.chars:
                yield document
                continue
            for piece, text in enumerate(cut_pieces([document.text], self.chars)):
                yield Document(text=text, id=f"{document.id}/{piece}", metadata=document.metadata)


def cut_pieces(chunks, chars: int):
    """One document, given as consecutive chunks of its text, as pieces: the whole of it where it has at most `chars`
    characters, else pieces of at most `chars`, each cut after the last space in its second half where it has one.
    Only the piece being cut is held (at most twice `chars` with chunks of at most `chars`)."""
    text = ""
    for chunk in chunks:
        text += chunk
        while len(text) > chars:
            space = text.rfind(" ", chars // 2, chars)
            end = space + 1 if space > 0 else chars
            yield text[:end]
            text = text[end:]
    if text:
        yield text
