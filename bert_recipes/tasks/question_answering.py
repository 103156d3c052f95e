"""Extractive question answering (task.kind=question_answering: SQuAD v1.1, and v2.0 with task.unanswerable), the
whole kind behind the task contract (bert_recipes/interface.py: `Task`): a question (data.text_column) and its
context (data.text_pair_column) in windows of data.max_seq_length tokens that share data.doc_stride tokens, as BERT
and run_qa.py build them, each window labelled with the answer's first and last token (both at [CLS] where the
window does not hold it); the architecture's span head (transformers' AutoModelForQuestionAnswering, its two
logits a token returned as one `logits` tensor); answers from the windows' logits as run_qa.py's post-processing
takes them, and exact match and F1 by the official SQuAD normalisation (bert_recipes/metrics/squad.py)."""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F

from ..config import ConfigError, DataConfig, TaskConfig
from ..data.collate import _collate
from ..data.tokenizing import map_splits, tokenizer_fingerprint

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask", "labels")


def tokenize(raw, tokenizer, task: TaskConfig, data: DataConfig):
    """-> each split's windows: the model inputs, labels (the answer's first token, last token, the window's number
    in its split), and what evaluation reads: each token's characters in the context (None outside it), the
    example's id, context and gold answers. Every answer is checked first to lie in its context."""
    from datasets import DatasetDict
    seq, question_col, context_col, answers_col = (data.max_seq_length, data.text_column, data.text_pair_column,
                                                   data.label_column)
    if data.doc_stride >= seq:
        raise ConfigError(f"data.doc_stride={data.doc_stride} must be less than data.max_seq_length={seq}: "
                          "consecutive windows share that many tokens; BERT's is 128 at 384")
    for split, rows in raw.items():
        check_answers(rows, split, context_col, answers_col, task.unanswerable)
        check_questions(rows, split, question_col, tokenizer, seq, data.doc_stride)

    def encode(batch):
        out = tokenizer(batch[question_col], batch[context_col], truncation="only_second", max_length=seq,
                        stride=data.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
                        padding="max_length")
        fields = {"labels": [], "offset_mapping": [], "example_id": [], "context": [], "gold": []}
        for k, source in enumerate(out.pop("overflow_to_sample_mapping")):
            inside = out.sequence_ids(k)
            offsets = out["offset_mapping"][k]
            context_offsets = [list(o) if inside[j] == 1 else None for j, o in enumerate(offsets)]
            answers = batch[answers_col][source]
            fields["labels"].append(list(answer_tokens(context_offsets, answers)))
            fields["offset_mapping"].append(context_offsets)
            fields["example_id"].append(str(batch["id"][source]) if "id" in batch else f"{source}")
            fields["context"].append(batch[context_col][source])
            fields["gold"].append(list(answers["text"]))
        out.pop("offset_mapping")
        out.update(fields)
        return out

    key = ["question_answering", tokenizer_fingerprint(tokenizer), seq, data.doc_stride, question_col, context_col,
           answers_col]
    columns = next(iter(raw.values())).column_names
    tokenized = DatasetDict(map_splits(raw, encode, key, "windowing", data.num_proc, columns))
    return DatasetDict({split: rows.map(lambda row, k: {"labels": row["labels"][:2] + [k]}, with_indices=True,
                                        desc="numbering windows") for split, rows in tokenized.items()})


def answer_tokens(offsets: list, answers: dict) -> tuple[int, int]:
    """The first answer's first and last token in a window (`offsets`: each token's characters in the context,
    None outside it), or (0, 0), [CLS], where the window does not hold the whole answer or there is none."""
    if not answers["text"]:
        return 0, 0
    begin = answers["answer_start"][0]
    end = begin + len(answers["text"][0])
    inside = [j for j, o in enumerate(offsets) if o is not None]
    if not inside or offsets[inside[0]][0] > begin or offsets[inside[-1]][1] < end:
        return 0, 0
    first = next(j for j in inside if offsets[j][1] > begin)
    last = next(j for j in reversed(inside) if offsets[j][0] < end)
    return first, last


def check_answers(rows, split: str, context_col: str, answers_col: str, unanswerable: bool) -> None:
    """Every answer's text is in its context where its answer_start says; a question without one needs
    task.unanswerable (SQuAD v2.0). One line for the first row that is not."""
    for i, (context, answers) in enumerate(zip(rows[context_col], rows[answers_col])):
        if not answers["text"]:
            if not unanswerable:
                raise ConfigError(f"row {i} of the {split} split has no answer: set task.unanswerable=true (SQuAD "
                                  "v2.0), or give every question an answer")
            continue
        for text, start in zip(answers["text"], answers["answer_start"]):
            if context[start:start + len(text)] != text:
                raise ConfigError(f"row {i} of the {split} split: the answer {text[:40]!r} is not at character {start} "
                                  f"of its context ({data_column_hint(answers_col)}): fix answer_start")


def check_questions(rows, split: str, question_col: str, tokenizer, seq: int, stride: int) -> None:
    """A window holds the question whole, three special tokens and more context than the windows share: a question
    too long for that is one line (the tokenizer's own error is a traceback)."""
    room = seq - stride - 3
    lengths = [len(ids) for ids in tokenizer(list(rows[question_col]), add_special_tokens=False)["input_ids"]]
    longest = max(range(len(lengths)), key=lengths.__getitem__, default=None)
    if longest is not None and lengths[longest] >= room:
        raise ConfigError(f"row {longest} of the {split} split has a question of {lengths[longest]} tokens, and a "
                          f"window of data.max_seq_length={seq} sharing data.doc_stride={stride} has room for "
                          f"{room - 1}: raise data.max_seq_length, lower data.doc_stride, or shorten the question")


def data_column_hint(column: str) -> str:
    return f"data.label_column '{column}': {{text: [...], answer_start: [...]}}"


def notes(tokenized, task: TaskConfig) -> list[str]:
    return []


# ----------------------------------------------------------------------------- the collator
class QuestionAnsweringCollator:
    """Windows padded to data.max_seq_length (their tokenization pads them): the model's inputs and labels only."""

    def __init__(self, tokenizer, fixed_length: int | None = None):
        self.pad_id, self.fixed_length = tokenizer.pad_token_id, fixed_length
        self.bins: list[int] | None = None
        self.epoch = 0
        self.unpad, self.attention_path = False, None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        rows = [{k: e[k] for k in MODEL_INPUTS if k in e and k != "labels"} for e in examples]
        batch = _collate(rows, self.pad_id, None, self.fixed_length, None)
        batch["labels"] = torch.tensor([e["labels"] for e in examples], dtype=torch.int64)
        return batch

    def evaluation_copy(self):
        return copy.copy(self)

    def follow(self, schedule) -> None:
        """A masking rate's levels: a span head masks nothing."""


def collator(data: DataConfig, task: TaskConfig, seed: int, tokenizer, fixed_length: int | None):
    return QuestionAnsweringCollator(tokenizer, fixed_length=fixed_length)


# ----------------------------------------------------------------------------- the model
def config_fields(task: TaskConfig) -> dict:
    return {"num_labels": 2}


class SpanLogits:
    """A span head whose forward returns one `logits` tensor (batch, tokens, 2: start, end), as the engines read
    every kind's, and takes labels (start, end, window number); the weights and the export are transformers'."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **kwargs):
        from transformers.modeling_outputs import QuestionAnsweringModelOutput
        if token_type_ids is not None and "token_type_ids" in self.forward_arguments:
            kwargs["token_type_ids"] = token_type_ids
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask,
                              start_positions=None if labels is None else labels[:, 0],
                              end_positions=None if labels is None else labels[:, 1], **kwargs)
        result = QuestionAnsweringModelOutput(loss=out.loss, start_logits=out.start_logits, end_logits=out.end_logits)
        result["logits"] = torch.stack([out.start_logits, out.end_logits], -1)
        return result

    def save_pretrained(self, save_directory, *args, **kwargs):
        super().save_pretrained(save_directory, *args, **kwargs)
        from ..modeling import exported_as
        exported_as(save_directory, type(self).__mro__[2].__name__)


def span_logits(model):
    """`model` (a transformers span head) as SpanLogits: its class extended, nothing else changed."""
    import inspect
    cls = type(model)
    model.__class__ = type(f"Recipe{cls.__name__}", (SpanLogits, cls), {})
    model.forward_arguments = set(inspect.signature(cls.forward).parameters)
    return model


class AutoSpanHead:
    """transformers' span head of the config's model type as SpanLogits: cls(config) fresh (built as the token
    classifier's is: tasks/token_classification.AutoTokenClassifier), from_pretrained a checkpoint's."""

    def __new__(cls, config):
        from transformers import MODEL_FOR_QUESTION_ANSWERING_MAPPING
        return span_logits(MODEL_FOR_QUESTION_ANSWERING_MAPPING[type(config)](config))

    @staticmethod
    def from_pretrained(*args, **kwargs):
        from transformers import AutoModelForQuestionAnswering
        loaded = AutoModelForQuestionAnswering.from_pretrained(*args, **kwargs)
        if isinstance(loaded, tuple):   # output_loading_info=True
            return (span_logits(loaded[0]), *loaded[1:])
        return span_logits(loaded)


def head(arch):
    return AutoSpanHead


def loss(task: TaskConfig):
    def span_loss(logits, labels):
        return (F.cross_entropy(logits[..., 0].float(), labels[:, 0]) + F.cross_entropy(logits[..., 1].float(),
                                                                                         labels[:, 1])) / 2
    return span_loss


def trial_labels(task: TaskConfig, ids: torch.Tensor, rate: float, k: int | None, g: torch.Generator) -> dict:
    starts = torch.randint(ids.shape[1], (len(ids),), generator=g)
    return {"labels": torch.stack([starts, starts, torch.arange(len(ids))], 1)}


# ----------------------------------------------------------------------------- evaluation
def eval_rows(task: TaskConfig, logits, labels, masked_positions=None) -> dict:
    """Each window's start and end logits (data.max_seq_length wide) and its number in the split."""
    return {"start": logits[..., 0].float(), "end": logits[..., 1].float(), "window": labels[:, 2]}


def metrics(task: TaskConfig, rows: dict, split=None) -> dict[str, float]:
    """Each example's answer from its windows' logits (run_qa.py's post-processing) and exact match and F1 over the
    examples (the official SQuAD script's; v2.0 also HasAns / NoAns). Needs the split the rows are of."""
    from ..metrics.squad import scores
    found, _, golds = answered(task, rows, split)
    return {**scores(found, golds), "eval_samples": len(golds)}


def answer_files(task: TaskConfig, rows: dict, split) -> dict[str, dict]:
    """The evaluation's answers as SQuAD's official evaluation scripts read them: predictions.json ({id: text}) and,
    with unanswerable questions, null_odds.json ({id: the null answer's score minus the best span's}: v2.0's
    --na-prob-file)."""
    found, null_odds, _ = answered(task, rows, split)
    return {"predictions.json": found, **({"null_odds.json": null_odds} if task.unanswerable else {})}


def answered(task: TaskConfig, rows: dict, split) -> tuple[dict, dict | None, dict]:
    """-> each example's answer, its null odds (v2.0) and its gold answers, from the rows of `split`'s windows."""
    from ..metrics.squad import answers
    if split is None:
        raise ValueError("question answering's answers read the evaluated split's windows")
    windows = [int(w) for w in rows["window"]]
    columns = split.select(windows).select_columns(["example_id", "offset_mapping", "context", "gold"])
    features = [{"example_id": r["example_id"], "offset_mapping": r["offset_mapping"]} for r in columns]
    examples, golds = {"id": [], "context": []}, {}
    for r in columns:
        if r["example_id"] not in golds:
            examples["id"].append(r["example_id"])
            examples["context"].append(r["context"])
            golds[r["example_id"]] = r["gold"]
    found, null_odds = answers(examples, features, rows["start"], rows["end"], with_negative=task.unanswerable,
                               max_answer_length=task.max_answer_length, null_threshold=task.null_threshold)
    return found, null_odds, golds


def baseline(task: TaskConfig, data) -> float | None:
    return None


def card_task(task: TaskConfig) -> str:
    return "extractive question answering" + (" with unanswerable questions" if task.unanswerable else "")
