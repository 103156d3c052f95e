"""Text to token ids with `datasets.map` (batched, cached by fingerprint: a second run with the same data
and tokenizer loads the cached result instead of re-tokenizing), packed into blocks for MLM, labels mapped
for classification. No torch at import time."""
from __future__ import annotations

import hashlib
import itertools
import json
import math

from .config import ConfigError, DataConfig, TaskConfig


TOKENIZE_VERSION = 1   # bump when encode/group below change: it is part of the cache fingerprint


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


def _map_splits(dataset_dict, fn, key: list, desc: str, num_proc, remove_columns):
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


def tokenize(raw, tokenizer, task: TaskConfig, data: DataConfig, label_names: list[str] | None = None):
    """-> DatasetDict of model inputs. Cached by datasets' fingerprint of (data, function, tokenizer)."""
    seq = data.max_seq_length
    text_cols = [data.text_column] + ([data.text_pair_column] if data.text_pair_column else [])
    columns = next(iter(raw.values())).column_names   # the training split's (a mixture: every source's, one column)
    tok_fp = tokenizer_fingerprint(tokenizer)

    if task.kind == "mlm":
        def encode(batch):
            lines = [t for t in batch[data.text_column] if t and t.strip()]
            if data.packing:
                return tokenizer(lines, return_special_tokens_mask=True)
            return tokenizer(lines, truncation=True, max_length=seq, return_special_tokens_mask=True)

        key = ["mlm", tok_fp, seq, data.packing, data.text_column]
        tokenized = _map_splits(raw, encode, key, "tokenizing", data.num_proc, columns)
        if data.packing:
            documents = data.document_mask

            def group(batch):
                # concatenate every sequence, then cut into full blocks of max_seq_length; the tail is dropped.
                # data.document_mask: each token's document within its block too (document_ids: 0, 0, ..., 1, 1, ...;
                # a document cut at a block's end goes on in the next block as that block's document 0)
                joined = {k: list(itertools.chain.from_iterable(batch[k])) for k in batch}
                if documents:
                    joined["document_ids"] = [d for d, ids in enumerate(batch["input_ids"]) for _ in ids]
                n = (len(joined["input_ids"]) // seq) * seq
                blocks = {k: [v[i:i + seq] for i in range(0, n, seq)] for k, v in joined.items()}
                if documents:
                    blocks["document_ids"] = [[d - block[0] for d in block] for block in blocks["document_ids"]]
                return blocks

            tokenized = _map_splits(tokenized, group, key + ["group"] + (["documents"] if documents else []),
                                    f"packing into {seq}-token blocks", data.num_proc, None)
        return tokenized

    regression = task.num_labels == 1
    labelled = {k: v for k, v in raw.items() if not k.startswith("test:")}
    mapping = label_mapping(labelled, task, data, label_names)

    def encode(batch):
        args = [batch[c] for c in text_cols]
        out = tokenizer(*args, truncation=True, max_length=seq)
        labels = batch[data.label_column]
        if mapping is not None:
            labels = [mapping[l] for l in labels]
        out["labels"] = [float(l) for l in labels] if regression else [int(l) for l in labels]
        return out

    def encode_unlabelled(batch):   # a test split: its labels are hidden (GLUE: -1) and never used
        out = tokenizer(*[batch[c] for c in text_cols], truncation=True, max_length=seq)
        out["labels"] = [-1.0 if regression else -1] * len(out["input_ids"])
        return out

    from datasets import DatasetDict
    key = ["classification", tok_fp, seq, text_cols, data.label_column, regression, mapping]
    out = dict(_map_splits(DatasetDict(labelled), encode, key, "tokenizing", data.num_proc, columns))
    tests = DatasetDict({k: v for k, v in raw.items() if k.startswith("test:")})
    if tests:
        out.update(_map_splits(tests, encode_unlabelled, key + ["unlabelled"], "tokenizing",
                               data.num_proc, tests[next(iter(tests))].column_names))
    return DatasetDict(out)


def label_mapping(raw, task: TaskConfig, data: DataConfig, label_names: list[str] | None) -> dict | None:
    """Check every label of the train and eval splits before tokenizing; -> {name: id} for string
    labels (task.label_names' order, else sorted), None for numeric ones."""
    col = data.label_column
    for split in (s for s in raw if not s.startswith("test:")):
        check_no_empty_labels(raw[split][col], col, split)
    feature = raw["train"].features.get(col)
    if getattr(feature, "dtype", None) in ("string", "large_string") and task.num_labels > 1:
        names = label_names or sorted(set(raw["train"][col]))
        if len(names) != task.num_labels:
            raise ConfigError(f"data.label_column '{col}' has {len(names)} distinct labels {names[:10]} but "
                              f"task.num_labels={task.num_labels}; set task.num_labels (or task.label_names)")
        for split in (s for s in raw if not s.startswith("test:")):
            unknown = sorted(set(raw[split][col]) - set(names))
            if unknown:
                raise ConfigError(f"data.label_column '{col}' of the {split} split has labels {unknown[:5]} that "
                                  f"task.label_names={names} does not list; add them or fix the data")
        return {n: i for i, n in enumerate(names)}
    for split in raw:
        if split.startswith("test:"):
            continue
        values = raw[split][col]
        try:
            numbers = [float(v) for v in values]
        except (TypeError, ValueError):
            raise ConfigError(f"data.label_column '{col}' of the {split} split holds non-numeric labels (e.g. "
                              f"{next(v for v in values if not _is_number(v))!r}); for text labels set "
                              "task.num_labels > 1 (and task.label_names)") from None
        if task.num_labels == 1:
            bad = [i for i, v in enumerate(numbers) if not math.isfinite(v)]
            what = "regression targets that are not finite"
        else:
            bad = [i for i, v in enumerate(numbers)
                   if not (math.isfinite(v) and v == int(v) and 0 <= v < task.num_labels)]
            what = f"labels outside [0, task.num_labels={task.num_labels})"
        if bad:
            shown = ", ".join(f"row {i}: {values[i]}" for i in bad[:3])
            raise ConfigError(f"data.label_column '{col}' of the {split} split has {len(bad)} {what} ({shown}); "
                              "fix the data or task.num_labels")
    return None


def is_empty_label(value) -> bool:
    """A label cell with nothing in it, however its format says so: null (JSON lines, parquet; a CSV's
    empty cell in a text column), a key a JSON line leaves out (datasets fills None), NaN (a CSV's empty cell
    in a number column, a parquet float) or text that is empty or only spaces."""
    return (value is None or (isinstance(value, float) and math.isnan(value))
            or (isinstance(value, str) and not value.strip()))


def check_no_empty_labels(values, col: str, split: str) -> None:
    """Every row of a labelled split has a label: else one line naming the column, the count and the
    first rows (counted from 0, as datasets numbers them; a CSV's header is not a row)."""
    empty = [i for i, v in enumerate(values) if is_empty_label(v)]
    if empty:
        shown = ", ".join(map(str, empty[:5])) + (", ..." if len(empty) > 5 else "")
        raise ConfigError(f"data.label_column '{col}' of the {split} split has {len(empty)} empty label"
                          f"{'s' * (len(empty) > 1)} (rows {shown}; counted from 0: null, NaN, a missing key or "
                          "empty text): give every row a label, or drop those rows")


def missing_classes(tokenized, task: TaskConfig) -> list[str]:
    """A training or evaluation split without a single row of one of the task's classes is legal (a small
    evaluation split often is), and the run goes on: -> one [warning] line per such split, naming the classes.
    Reads the labels tokenize wrote (class ids, whatever the data's own labels were)."""
    if task.num_labels == 1:
        return []
    out = []
    for split, name in (("train", "training"), ("eval", "evaluation")):
        values = tokenized[split]["labels"]
        seen = set(values)
        missing = [i for i in range(task.num_labels) if i not in seen]
        if missing:
            shown = ", ".join(f"{i} ({task.label_names[i]})" if task.label_names else str(i) for i in missing[:8])
            what = "the model never learns them" if split == "train" else "their per-class scores are not measured"
            out.append(f"[warning] the {name} split ({len(values)} rows) has no row of class {shown} of "
                       f"task.num_labels={task.num_labels}: {what}; the run goes on")
    return out


def _is_number(value) -> bool:
    try:
        float(value)
        return True
    except (TypeError, ValueError):
        return False
