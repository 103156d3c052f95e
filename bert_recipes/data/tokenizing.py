"""What every task kind's tokenizing shares (bert_recipes/tasks/<kind>.py says how its text becomes model inputs):
`datasets.map` over each split with a fingerprint of its own (batched, cached: a second run with the same data and
tokenizer loads the cached result instead of re-tokenizing), and the tokenizer's fingerprints. No torch at import
time."""
from __future__ import annotations

import hashlib
import json


TOKENIZE_VERSION = 1   # bump when a task's tokenize (encode, MLM's packing) changes: it is part of the cache fingerprint


def tokenizer_fingerprint(tokenizer) -> str:
    """A content hash of a fast tokenizer that is the same in every process. (datasets' default
    fingerprint pickles the tokenizer, whose vocabulary is a hash map serialized in random order,
    so every process would compute a different fingerprint and re-tokenize.)"""
    content = json.loads(tokenizer.backend_tokenizer.to_str())
    extra = {k: str(getattr(tokenizer, k, None)) for k in ("model_max_length", "padding_side", "truncation_side")}
    return hashlib.sha256(json.dumps([content, type(tokenizer).__name__, extra], sort_keys=True).encode()).hexdigest()


def vocabulary_fingerprint(tokenizer) -> str:
    """What a model's token ids mean: a hash of the fast tokenizer's vocabulary and ids, normaliser, pre-tokenizer,
    post-processor and added (special) tokens, the same in every process and after any call: its truncation and
    padding settings, which the last tokenizing call left in it, are not part of it (checkpoint.tokenizer_record)."""
    content = json.loads(tokenizer.backend_tokenizer.to_str())
    kept = {k: content.get(k) for k in ("model", "normalizer", "pre_tokenizer", "post_processor", "added_tokens")}
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def map_splits(dataset_dict, fn, key: list, desc: str, num_proc, remove_columns):
    """datasets.map on each split, with a fingerprint from (split data, key) alone, so the cache is
    found by every rank and by the next run."""
    from datasets import DatasetDict
    out = {}
    for split, ds in dataset_dict.items():
        fingerprint = hashlib.sha256(json.dumps([ds._fingerprint, TOKENIZE_VERSION, *key], default=str)
                                     .encode()).hexdigest()[:32]
        out[split] = ds.map(fn, batched=True, num_proc=num_proc, remove_columns=remove_columns,
                            new_fingerprint=fingerprint, desc=desc)
    return DatasetDict(out)
