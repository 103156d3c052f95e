"""Token classification (task.kind=token_classification: named entities as CoNLL-2003 tags them, any BIO/IOB2 tag
set), the whole kind behind the task contract (bert_recipes/interface.py: `Task`): rows of words (data.text_column)
with a tag a word (data.label_column: ids with names, as the Hub's conll2003 ships them, or the tags' text), each
word's tag on its first sub-token (every sub-token with data.label_all_tokens, an I- tag after a B- one, as
transformers' run_ner.py does), -100 elsewhere; padded batches; the architecture's token classifier
(transformers' AutoModelForTokenClassification); entity-level precision, recall and F1 by seqeval (the field's
scorer, conlleval's rules) and token accuracy."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ConfigError, DataConfig, TaskConfig
from ..data.collate import _collate
from ..data.tokenizing import map_splits, tokenizer_fingerprint

IGNORED = -100   # a label the loss and the scores skip: sub-tokens after a word's first, special tokens, padding


def tokenize(raw, tokenizer, task: TaskConfig, data: DataConfig):
    """-> DatasetDict of model inputs, each token's tag id (IGNORED where no word starts). The tag names are
    task.label_names, else the label column's own (a Sequence of ClassLabel), else its sorted text tags; they are
    written into `task` (the resolved config and the export's id2label name them). Every row is checked first: as
    many tags as words, every tag a name, the names BIO."""
    from datasets import DatasetDict
    seq, words_col, tags_col = data.max_seq_length, data.text_column, data.label_column
    names = tag_names(raw, task, data)
    task.label_names = names
    ids = {name: i for i, name in enumerate(names)}
    inside = [ids.get("I-" + name[2:], i) if name.startswith("B-") else i for i, name in enumerate(names)]

    def encode(batch):
        out = tokenizer(batch[words_col], is_split_into_words=True, truncation=True, max_length=seq,
                        return_token_type_ids=False)
        labels = []
        for row, tags in enumerate(batch[tags_col]):
            tags = [ids[t] if isinstance(t, str) else int(t) for t in tags]
            previous, row_labels = None, []
            for word in out.word_ids(row):
                if word is None:
                    row_labels.append(IGNORED)
                elif word != previous:
                    row_labels.append(tags[word])
                else:   # a later sub-token of the same word
                    row_labels.append(inside[tags[word]] if data.label_all_tokens else IGNORED)
                previous = word
            labels.append(row_labels)
        out["labels"] = labels
        return out

    key = ["token_classification", tokenizer_fingerprint(tokenizer), seq, words_col, tags_col, names,
           data.label_all_tokens]
    columns = next(iter(raw.values())).column_names
    return DatasetDict(map_splits(raw, encode, key, "tokenizing", data.num_proc, columns))


def tag_names(raw, task: TaskConfig, data: DataConfig) -> list[str]:
    """The tag names, checked against every row of every split: one line for a row whose tags and words differ in
    count, a tag no name covers, a name that is not BIO (O, B-X, I-X), a count that is not task.num_labels."""
    words_col, tags_col = data.text_column, data.label_column
    feature = raw["train"].features.get(tags_col)
    inner = getattr(feature, "feature", None)
    names = task.label_names or getattr(inner, "names", None)
    if names is None:
        texts = {t for split in raw.values() for tags in split[tags_col] for t in tags if isinstance(t, str)}
        if not texts:
            raise ConfigError(f"data.label_column '{tags_col}' holds tag ids without names: give them as "
                              "task.label_names, in id order (BIO: [O, B-PER, I-PER, ...])")
        names = sorted(texts)
    names = list(names)
    bad = [n for n in names if n != "O" and not n.startswith(("B-", "I-"))]
    if bad:
        raise ConfigError(f"task.label_names: {bad[:3]} are not BIO tags (O, B-<type>, I-<type>): seqeval scores "
                          "entities by them; rename the tags")
    if len(names) != task.num_labels:
        raise ConfigError(f"data.label_column '{tags_col}' has {len(names)} tag names {names[:10]} but "
                          f"task.num_labels={task.num_labels}; set task.num_labels={len(names)}")
    known = set(names)
    for split, rows in raw.items():
        for i, (words, tags) in enumerate(zip(rows[words_col], rows[tags_col])):
            if len(words) != len(tags):
                raise ConfigError(f"row {i} of the {split} split has {len(words)} words ({words_col}) and {len(tags)} "
                                  f"tags ({tags_col}): give every word one tag")
            unknown = [t for t in tags if (t not in known if isinstance(t, str) else not 0 <= int(t) < len(names))]
            if unknown:
                raise ConfigError(f"row {i} of the {split} split has the tag {unknown[0]!r}, which task.label_names="
                                  f"{names} does not name: add it, or fix the data")
    return names


def notes(tokenized, task: TaskConfig) -> list[str]:
    """Lines about the tokenized data worth a user's eye: none."""
    return []


# ----------------------------------------------------------------------------- the collator
class TokenClassificationCollator:
    """Dynamic padding (to a multiple of 8), each row's tags padded with IGNORED to the batch's width; evaluation's
    copy pads to data.max_seq_length, so every rank's rows have one width (eval_rows)."""

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = 8, fixed_length: int | None = None,
                 eval_length: int | None = None):
        self.pad_id = tokenizer.pad_token_id
        self.pad_to_multiple_of, self.fixed_length, self.eval_length = pad_to_multiple_of, fixed_length, eval_length
        self.bins: list[int] | None = None
        self.epoch = 0
        self.unpad, self.attention_path = False, None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = _collate([{k: v for k, v in e.items() if k != "labels"} for e in examples], self.pad_id,
                         self.pad_to_multiple_of, self.fixed_length, self.bins)
        labels = torch.full(batch["input_ids"].shape, IGNORED, dtype=torch.int64)
        for row, e in enumerate(examples):
            labels[row, :len(e["labels"])] = torch.as_tensor(e["labels"])
        batch["labels"] = labels
        batch.pop("special_tokens_mask", None)
        return batch

    def evaluation_copy(self):
        other = copy.copy(self)
        other.fixed_length = self.fixed_length or self.eval_length
        return other

    def follow(self, schedule) -> None:
        """A masking rate's levels: a tagger masks nothing."""


def collator(data: DataConfig, task: TaskConfig, seed: int, tokenizer, fixed_length: int | None):
    return TokenClassificationCollator(tokenizer, fixed_length=fixed_length, eval_length=data.max_seq_length)


# ----------------------------------------------------------------------------- the model
def config_fields(task: TaskConfig) -> dict:
    fields = {"num_labels": task.num_labels}
    if task.label_names:
        fields["id2label"] = dict(enumerate(task.label_names))
        fields["label2id"] = {n: i for i, n in enumerate(task.label_names)}
    return fields


class AutoTokenClassifier:
    """transformers' token classifier of the config's model type: cls(config) a fresh one, from_pretrained a
    checkpoint's (BertForTokenClassification, ModernBertForTokenClassification, ...). A fresh one is built as the
    architectures build theirs, not by from_config: under ZeRO-3 that draws its weights inside zero.Init, other
    numbers than every other backend's."""

    def __new__(cls, config):
        from transformers import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING
        return MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING[type(config)](config)

    @staticmethod
    def from_pretrained(*args, **kwargs):
        from transformers import AutoModelForTokenClassification
        return AutoModelForTokenClassification.from_pretrained(*args, **kwargs)


def head(arch):
    return AutoTokenClassifier


def loss(task: TaskConfig):
    def token_loss(logits, labels):
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORED)
    return token_loss


def trial_labels(task: TaskConfig, ids: torch.Tensor, rate: float, k: int | None, g: torch.Generator) -> dict:
    return {"labels": torch.randint(task.num_labels, tuple(ids.shape), generator=g)}


# ----------------------------------------------------------------------------- evaluation
def eval_rows(task: TaskConfig, logits, labels, masked_positions=None) -> dict:
    """Each sample's predicted and reference tags, data.max_seq_length wide (evaluation's collator pads to it)."""
    return {"preds": logits.argmax(-1), "refs": labels}


def tag_sequences(task: TaskConfig, rows: dict) -> tuple[list[list[str]], list[list[str]]]:
    """Each sample's (predicted, reference) tag names at the positions that carry a reference tag."""
    names = task.label_names
    predicted, reference = [], []
    for preds, refs in zip(rows["preds"], rows["refs"]):
        kept = refs != IGNORED
        predicted.append([names[int(p)] for p in preds[kept]])
        reference.append([names[int(r)] for r in refs[kept]])
    return predicted, reference


def metrics(task: TaskConfig, rows: dict, split=None) -> dict[str, float]:
    """Entity-level precision, recall and F1 (seqeval's default: conlleval's chunking) and token accuracy, over
    every rank's samples once."""
    from seqeval.metrics import f1_score, precision_score, recall_score
    predicted, reference = tag_sequences(task, rows)
    tokens = sum(len(r) for r in reference)
    right = sum(p == r for ps, rs in zip(predicted, reference) for p, r in zip(ps, rs))
    return {"f1": float(f1_score(reference, predicted, zero_division=0)),
            "precision": float(precision_score(reference, predicted, zero_division=0)),
            "recall": float(recall_score(reference, predicted, zero_division=0)),
            "accuracy": right / max(tokens, 1), "eval_samples": len(reference)}


def baseline(task: TaskConfig, data) -> float | None:
    """The token accuracy of the training split's most frequent tag on the evaluation split (its entity F1 is 0)."""
    from collections import Counter
    train = Counter(t for row in data["train"]["labels"] for t in row if t != IGNORED)
    if not train:
        return None
    top = train.most_common(1)[0][0]
    evaluation = [t for row in data["eval"]["labels"] for t in row if t != IGNORED]
    return sum(t == top for t in evaluation) / max(len(evaluation), 1)


def card_task(task: TaskConfig) -> str:
    return f"token classification, {task.num_labels} tags"
