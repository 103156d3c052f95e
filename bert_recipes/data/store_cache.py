"""The token stores a packed MLM run reads, as data.packing reads them (blocks, or best-fit rows): its own, made on
first use (tasks/mlm.py's packing): each split as datasets read it
(sources.py: the sample, the Hub, local files; each source of a mixture) tokenized once by datatrove into a store
(store_writer.py) in the data cache, under a key of what decides its bytes (the split's rows: datasets' fingerprint;
the tokenizer's vocabulary; the text column; the store's layout), then memory-mapped as store.StoreBlocks. Every
later run, rank and node that shares the cache finds it; a preparation cut off goes on from its finished tasks.
datasets keeps the rows it read; their tokenized and packed copies are the store's 2 bytes a token (4 past 65,536
ids). No torch at import time."""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from ..config import ConfigError, DataConfig
from .best_fit import BestFitRows
from .sources import data_cache
from .store import STORE_META, STORE_VERSION, StoreBlocks, TokenStore, check_store_dir
from .tokenizing import TOKENIZE_VERSION, vocabulary_fingerprint

STORES = "bert_recipes_stores"   # under the data cache: a store a split, by key


def stored_splits(raw, tokenizer, data: DataConfig) -> dict:
    """{split: its packed blocks of data.max_seq_length tokens} for datasets' splits `raw`, each read from its store,
    written first where the cache has none (call it under ranks.main_first: rank 0 writes, the others read; two runs
    that share the cache take turns on a file lock beside the store, and the second finds it made)."""
    from .store_writer import LONGEST_DOCUMENT_CHARS, ROWS_A_TASK, running_datatrove, save_tokenizer_file, \
        write_rows_store
    vocabulary = vocabulary_fingerprint(tokenizer)
    out = {}
    for split, rows in raw.items():
        key = json.dumps([rows._fingerprint, vocabulary, data.text_column, STORE_VERSION, TOKENIZE_VERSION,
                          ROWS_A_TASK, LONGEST_DOCUMENT_CHARS])
        root = store_root(data, hashlib.sha256(key.encode()).hexdigest()[:24])
        if not (root / STORE_META).is_file():
            from filelock import FileLock   # datasets' own lock: two runs that share the cache write a store once
            root.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(f"{root}.lock"):
                if not (root / STORE_META).is_file():   # the other run may have finished it meanwhile
                    save_tokenizer_file(tokenizer, root / "tokenizer")
                    with running_datatrove(root / "prepare.log"):   # its lines stay out of the run's log
                        write_rows_store(rows, root, root / "tokenizer", data.text_column, data.num_proc or 1,
                                         vocabulary, rows._fingerprint)
        out[split] = packed_rows(TokenStore(root), data.max_seq_length, data.packing, data.document_mask,
                                 tokenizer.all_special_ids, tokenizer.pad_token_id)
    return out


def store_root(data: DataConfig, key: str) -> Path:
    return data_cache(data) / STORES / key


def packed_rows(store: TokenStore, seq: int, packing, documents: bool, special_ids: list[int], pad_id: int | None):
    """A store's rows as data.packing reads them: full blocks (true), or whole documents best-fit into rows with
    padding (best_fit: bert_recipes/data/best_fit.py; its pack plan made on first use, beside the store)."""
    if packing == "best_fit":
        return BestFitRows(store, seq, special_ids, pad_id)
    return StoreBlocks(store, seq, special_ids, documents)


def store_splits(store_dir: str, seq: int, special_ids: list[int], documents: bool, percent: float,
                 max_train: int | None, max_eval: int | None, packing=True, pad_id: int | None = None) -> dict:
    """{"train", "eval"}: the store's blocks (or best-fit rows: `packing`), the last ceil(percent %) held out for
    evaluation (arithmetic: no list of block numbers in memory), each cut to data.max_*_samples."""
    blocks = packed_rows(TokenStore(check_store_dir(store_dir)), seq, packing, documents, special_ids, pad_id)
    n = len(blocks)
    held = math.ceil(n * percent / 100)
    if n - held < 1 or held < 1:
        raise ConfigError(f"data.store_dir={store_dir} holds {n} rows of data.max_seq_length={seq} tokens: "
                          f"data.validation_split_percentage={percent} leaves {n - held} to train on and {held} to "
                          "evaluate (at least 1 of each is needed): give a larger corpus or shorter sequences")
    train, evaluation = range(0, n - held), range(n - held, n)
    if max_train is not None:
        train = train[:max_train]
    if max_eval is not None:
        evaluation = evaluation[:max_eval]
    return {"train": blocks.select(train), "eval": blocks.select(evaluation)}
