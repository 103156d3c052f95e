"""Prepared data (data.source=prepared, written by make prepare: tools/prepare.py): classification, or MLM a line a
row, tokenized once, memory-mapped by every rank (packed MLM reads token stores: store.py, store_cache.py), used
only by a recipe whose settings agree with those it was prepared with (its signature). No torch at import time."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import ConfigError, DataConfig, TaskConfig, TokenizerConfig, path_kind
from ..tasks import TASKS
from .tokenizer import tokenizer_identity


PREPARED_META = "prepared.json"


# Keys of the prepared signature that came later, with what data prepared before them holds
SIGNATURE_BEFORE = {"data.document_mask": False, "data.doc_stride": 128, "data.label_all_tokens": False}


def prepared_signature(data: DataConfig, task: TaskConfig, tok: TokenizerConfig, model_name_or_path: str | None) -> dict:
    """The settings that decide a run's tokens: prepared data is used only by a recipe that agrees."""
    named = tok.name_or_path or model_name_or_path
    return {"task.kind": task.kind, "task.num_labels": task.num_labels if TASKS[task.kind].labelled else None,
            "task.label_names": task.label_names,
            "tokenizer": tokenizer_identity(named),
            "tokenizer.vocab_size": tok.vocab_size if not named else None,
            **{f"data.{k}": getattr(data, k) for k in (
                "max_seq_length", "packing", "document_mask", "doc_stride", "label_all_tokens", "text_column",
                "text_pair_column", "label_column",
                "train_split", "eval_split",
                "extra_eval_splits", "test_splits", "max_train_samples", "max_eval_samples",
                "validation_split_percentage")}}


def check_prepared_dir(data: DataConfig) -> Path:
    root = Path(data.prepared_dir)
    kind = path_kind(root, "data.prepared_dir")
    if kind == "dir":
        path_kind(root / PREPARED_META, "data.prepared_dir")   # a directory this user cannot look into
    if kind == "file":
        raise ConfigError(f"data.prepared_dir={root} is a file, not a directory: give the directory make prepare wrote")
    if not (root / PREPARED_META).is_file():
        raise ConfigError(f"data.prepared_dir={root} holds no prepared data ({PREPARED_META} missing): write it with "
                          "make prepare RECIPE=<this recipe> (tools/prepare.py)")
    return root


def load_prepared(data: DataConfig, task: TaskConfig, tok: TokenizerConfig, model_name_or_path: str | None):
    """-> (tokenizer, memory-mapped splits, test_index) from data.prepared_dir, checked against the recipe."""
    from datasets import DatasetDict
    from transformers import AutoTokenizer
    root = check_prepared_dir(data)
    meta = json.loads((root / PREPARED_META).read_text())
    expected = prepared_signature(data, task, tok, model_name_or_path)
    given = tok.name_or_path or model_name_or_path   # data prepared before tokenizer_identity: a path
    prepared = {**SIGNATURE_BEFORE, **meta["signature"]}   # a key added since: the value of the data it was written for
    differ = [f"{k}: prepared {prepared.get(k)!r}, this run {v!r}" for k, v in expected.items()
              if k != "data.source" and prepared.get(k) != v and not (k == "tokenizer" and prepared.get(k) == given)]
    if differ:
        raise ConfigError(f"data.prepared_dir={root} was prepared with other settings ({'; '.join(differ)}): prepare "
                          "it again with this recipe")
    if task.label_names is None and meta.get("label_names"):   # text labels, named when prepared
        task.label_names = meta["label_names"]
    splits = DatasetDict.load_from_disk(str(root / "data"))
    return AutoTokenizer.from_pretrained(str(root / "tokenizer")), splits, meta["test_index"]
