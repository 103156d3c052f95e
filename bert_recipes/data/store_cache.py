"""A packed MLM run's own token stores, made on first use (tasks/mlm.py's packing): each split as datasets read it
(sources.py: the sample, the Hub, local files; each source of a mixture) tokenized once by datatrove into a store
(store_writer.py) in the data cache, under a key of what decides its bytes (the split's rows: datasets' fingerprint;
the tokenizer's vocabulary; the text column; the store's layout), then memory-mapped as store.StoreBlocks. Every
later run, rank and node that shares the cache finds it; a preparation cut off goes on from its finished tasks.
datasets keeps the rows it read; their tokenized and packed copies are the store's 2 bytes a token (4 past 65,536
ids). No torch at import time."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..config import DataConfig
from .sources import data_cache
from .store import STORE_META, STORE_VERSION, TokenStore, packed_rows
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

