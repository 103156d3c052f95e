"""Sequence classification and regression (task.kind=classification; task.num_labels 1: a regression), the whole
kind behind the task contract (bert_recipes/interface.py: `Task`): a sentence or a pair tokenized with its label
(text labels mapped to ids, every label checked first), padded batches, the architecture's classifier (its
SEQUENCE_CLASSIFICATION class; a checkpoint of another model type: transformers' own), cross-entropy or MSE, and
evaluation's metric scripts (bert_recipes/metrics/), test-set predictions in GLUE's submission format."""
from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F

from ..data.collate import _collate, documents_apart
from ..config import ConfigError, DataConfig, TaskConfig
from ..metrics import compute_metrics, default_metrics, majority_baseline
from ..data.tokenizing import map_splits, tokenizer_fingerprint


def tokenize(raw, tokenizer, task: TaskConfig, data: DataConfig):
    """-> DatasetDict of model inputs, each row's label as a class id (or a value, a regression); a test split's
    hidden labels as -1. Every label of the labelled splits is checked first (label_mapping); text labels without
    task.label_names: their sorted order is written into `task.label_names`, so the resolved config and the
    export's id2label name them. Cached by datasets' fingerprint of (data, function, tokenizer)."""
    from datasets import DatasetDict
    seq = data.max_seq_length
    text_cols = [data.text_column] + ([data.text_pair_column] if data.text_pair_column else [])
    columns = next(iter(raw.values())).column_names
    regression = task.num_labels == 1
    labelled = {k: v for k, v in raw.items() if not k.startswith("test:")}
    mapping = label_mapping(labelled, task, data, task.label_names)
    if mapping is not None and task.label_names is None:
        task.label_names = list(mapping)

    def encode(batch):
        out = tokenizer(*[batch[c] for c in text_cols], truncation=True, max_length=seq)
        labels = batch[data.label_column]
        if mapping is not None:
            labels = [mapping[l] for l in labels]
        out["labels"] = [float(l) for l in labels] if regression else [int(l) for l in labels]
        return out

    def encode_unlabelled(batch):   # a test split: its labels are hidden (GLUE: -1) and never used
        out = tokenizer(*[batch[c] for c in text_cols], truncation=True, max_length=seq)
        out["labels"] = [-1.0 if regression else -1] * len(out["input_ids"])
        return out

    key = ["classification", tokenizer_fingerprint(tokenizer), seq, text_cols, data.label_column, regression, mapping]
    out = dict(map_splits(DatasetDict(labelled), encode, key, "tokenizing", data.num_proc, columns))
    tests = DatasetDict({k: v for k, v in raw.items() if k.startswith("test:")})
    if tests:
        out.update(map_splits(tests, encode_unlabelled, key + ["unlabelled"], "tokenizing",
                              data.num_proc, tests[next(iter(tests))].column_names))
    return DatasetDict(out)


# ----------------------------------------------------------------------------- labels
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

def notes(tokenized, task: TaskConfig) -> list[str]:
    """Lines about the tokenized data worth a user's eye: a split without a class (missing_classes)."""
    return missing_classes(tokenized, task)


# ----------------------------------------------------------------------------- the collator
class ClassificationCollator:
    """Dynamic padding (to a multiple of 8 for tensor cores); labels pass through."""

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = 8, fixed_length: int | None = None):
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.fixed_length = fixed_length
        self.bins: list[int] | None = None   # data.length_bins, set by the engine (fit_length_bins)
        self.epoch = 0
        self.unpad, self.attention_path = False, None   # data.unpad and the plan's path, set by the engine

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = _collate(examples, self.pad_id, self.pad_to_multiple_of, self.fixed_length, self.bins)
        return documents_apart(batch, self.unpad, self.attention_path)

    def evaluation_copy(self):
        """The collator as evaluation and prediction use it: a copy, never unpadded (data.unpad is for training)."""
        other = copy.copy(self)
        other.unpad = False
        return other

    def follow(self, schedule) -> None:
        """A masking rate's levels (mask_rate.MaskSchedule): a classifier masks nothing, so its one level changes
        nothing here."""

def collator(data: DataConfig, task: TaskConfig, seed: int, tokenizer, fixed_length: int | None):
    """The run's collator: padded batches (fixed_length: the pipeline's buffers)."""
    return ClassificationCollator(tokenizer, fixed_length=fixed_length)


# ----------------------------------------------------------------------------- the model
def config_fields(task: TaskConfig) -> dict:
    """What the task sets in the model's config: the label count, the problem type, the label names."""
    fields = {"num_labels": task.num_labels,
              "problem_type": "regression" if task.num_labels == 1 else "single_label_classification"}
    if task.label_names:
        fields["id2label"] = dict(enumerate(task.label_names))
        fields["label2id"] = {n: i for i, n in enumerate(task.label_names)}
    return fields


def head(arch):
    """The model class this kind trains on an architecture's file (bert_recipes/architectures/<name>.py); for a
    checkpoint whose model type no architecture here builds (roberta, ...), transformers' own classifier."""
    if arch is None:
        from transformers import AutoModelForSequenceClassification
        return AutoModelForSequenceClassification
    return arch.SEQUENCE_CLASSIFICATION


def loss(task: TaskConfig):
    """The loss of (logits, labels), in fp32, as the pipeline's last stage computes it: MSE for a regression
    (num_labels 1), else cross-entropy (the architectures' classifiers: modeling.classification_loss)."""
    def classification_loss(logits, labels):
        if task.num_labels == 1:
            return F.mse_loss(logits.squeeze(-1).float(), labels.float())
        return F.cross_entropy(logits.float(), labels)
    return classification_loss


def trial_labels(task: TaskConfig, ids: torch.Tensor, rate: float, k: int | None, g: torch.Generator) -> dict:
    """A trial batch's labels (bert_recipes/trial.py): a class id, or a value, a row."""
    size = len(ids)
    if task.num_labels == 1:
        return {"labels": torch.rand(size, generator=g)}
    return {"labels": torch.randint(task.num_labels, (size,), generator=g)}


# ----------------------------------------------------------------------------- evaluation
def predictions(task: TaskConfig, logits):
    """Class ids, or the value of a regression (num_labels 1), from a batch's logits."""
    return logits.squeeze(-1).float() if task.num_labels == 1 else logits.argmax(-1)


def eval_rows(task: TaskConfig, logits, labels, masked_positions=None) -> dict:
    """One evaluation batch's per-sample rows (device tensors), the same for every engine: predictions and
    references."""
    return {"preds": predictions(task, logits), "refs": labels}


def metrics(task: TaskConfig, rows: dict, split=None) -> dict[str, float]:
    """The evaluation's metrics from every rank's rows, each sample once, whatever the engine: task.metrics (else
    accuracy and F1, or Pearson and Spearman for a regression, which also reports its MSE as eval_loss)."""
    import numpy as np
    preds, refs = np.asarray(rows["preds"]), np.asarray(rows["refs"])
    out = compute_metrics(task.metrics or default_metrics(task.num_labels), preds, refs, task.num_labels)
    if task.num_labels == 1:
        out["eval_loss"] = float(((preds - refs) ** 2).mean())
    return {**out, "eval_samples": len(refs)}


def prediction_text(task: TaskConfig, preds) -> list[str]:
    """A test split's predictions as its submission file writes them: label names where task.label_names gives
    them (else class ids), or values for a regression."""
    names = task.label_names if task.num_labels > 1 else None
    if names:
        return [names[int(p)] for p in preds]
    return [f"{float(p):.3f}" for p in preds] if task.num_labels == 1 else [str(int(p)) for p in preds]


def baseline(task: TaskConfig, data) -> float | None:
    """A score any model beats, for the final metrics: the majority class's accuracy on the eval split (none for a
    regression)."""
    return majority_baseline(data["train"]["labels"], data["eval"]["labels"]) if task.num_labels > 1 else None


def card_task(task: TaskConfig) -> str:
    """The model card's task line."""
    return "regression" if task.num_labels == 1 else f"sequence classification, {task.num_labels} labels"
